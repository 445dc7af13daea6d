//! Publishing to NATS with async-nats.
//!
//! # Contract
//! - JetStream mode: a publish resolves once the stream acknowledged the message (PubAck).
//!   Every message carries `Nats-Msg-Id` = the message id, so a retry after a lost ack is
//!   dropped by the server within the stream's duplicate window.
//! - Core mode: a publish resolves once the message is handed to the connection (at most once).
//! - Errors are classified: retriable (no stream answering, ack timeout, connection lost, too
//!   many pending acks) or final (larger than the server's `max_payload`, a subject that is not
//!   valid, a publish the server's permissions refuse).
//! - At most `max_in_flight` publishes wait for their ack at once; more publishers wait.
//!
//! # Recovery
//! async-nats reconnects by itself; meanwhile publishes time out and are retried by the
//! pipeline. A permissions violation is reported by the server asynchronously: the subject is
//! remembered, and a publish to it that then times out fails for good as `denied`.

use std::{
    collections::HashSet,
    sync::{Arc, Mutex},
};

use async_nats::{
    ConnectOptions, HeaderMap,
    connection::State,
    jetstream::{self, context::PublishErrorKind},
};
use futures::{FutureExt, future::BoxFuture};
use tracing::{info, warn};

use super::{NatsMode, NatsSinkConfig, StreamRetention, StreamStorage};
use crate::{
    message::Message,
    sinks::{
        Ack, Error, Result, Sink,
        template::{
            Template, escape_nats_token, is_valid_nats_subject, nats_filter_covers, nats_wildcard,
        },
    },
};

/// See the module docs.
pub struct NatsSink {
    name: String,
    client: async_nats::Client,
    jetstream: Option<jetstream::Context>,
    subject: Template,
    denied: Arc<Mutex<HashSet<String>>>,
    // The server's `max_payload` at connect (read once: `server_info` clones the whole INFO).
    // A server reached later with a smaller one refuses at hand-over, which trims further.
    max_payload: usize,
}

impl NatsSink {
    /// Connects (failing fast with a clear error), and in JetStream mode creates or checks the
    /// stream.
    pub async fn connect(name: &str, cfg: &NatsSinkConfig) -> Result<Self> {
        let setup = |what: String| Error::Setup(format!("sink {name}: {what}"));
        let servers = cfg.servers.join(",");
        let denied: Arc<Mutex<HashSet<String>>> = Arc::default();
        let client = connect_client(name, cfg, {
            let denied = denied.clone();
            let sink = name.to_owned();
            move |event| on_event(&sink, &denied, event)
        })
        .await?;
        let subject = Template::parse(&cfg.subject).map_err(|e| setup(format!("subject: {e}")))?;
        let jetstream = match cfg.mode {
            NatsMode::Core => None,
            NatsMode::Jetstream => {
                let context = jetstream::ContextBuilder::new()
                    .timeout(cfg.ack_timeout)
                    .max_ack_inflight(cfg.max_in_flight)
                    .backpressure_on_inflight(true)
                    .build(client.clone());
                check_stream(name, &context, cfg, &subject).await?;
                Some(context)
            }
        };
        info!(sink = %name, servers = %servers, mode = ?cfg.mode, "Connected to NATS");
        let max_payload = client.server_info().max_payload;
        Ok(Self {
            name: name.to_owned(),
            max_payload,
            client,
            jetstream,
            subject,
            denied,
        })
    }

    /// The JetStream context (`jetstream` mode), shared with the checkpoint store.
    pub(super) fn jetstream(&self) -> Option<&jetstream::Context> {
        self.jetstream.as_ref()
    }

    /// The subject `message` goes to.
    pub fn subject_for(&self, message: &Message) -> String {
        self.subject.render(message, escape_nats_token)
    }

    fn headers(&self, m: &Message) -> HeaderMap {
        let mut h = HeaderMap::new();
        if self.jetstream.is_some() {
            h.insert("Nats-Msg-Id", m.id.as_str());
        }
        h.insert("content-type", m.content_type);
        for (name, value) in &m.attributes {
            h.insert(format!("ce-{name}").as_str(), value.as_str());
        }
        h
    }

    fn classify(
        &self,
        subject: &str,
        size: usize,
        kind: PublishErrorKind,
        detail: String,
    ) -> Error {
        classify(&self.client, &self.denied, subject, size, kind, detail)
    }
}

/// What a failed JetStream publish of `size` bytes to `subject` means.
fn classify(
    client: &async_nats::Client,
    denied: &Mutex<HashSet<String>>,
    subject: &str,
    size: usize,
    kind: PublishErrorKind,
    detail: String,
) -> Error {
    match kind {
        PublishErrorKind::MaxPayloadExceeded => Error::TooLarge {
            size,
            max: client.server_info().max_payload,
        },
        PublishErrorKind::TimedOut
            if denied
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(subject) =>
        {
            Error::Denied(format!(
                "publish to {subject} violates the server's permissions"
            ))
        }
        PublishErrorKind::TimedOut => Error::TimedOut(detail),
        _ => Error::Unavailable(detail),
    }
}

/// A connection to the servers of a sink, with its credentials and TLS settings; `events`
/// hears the connection's events. Fails fast with an error naming the sink and the servers.
pub async fn connect_client(
    name: &str,
    cfg: &NatsSinkConfig,
    events: impl Fn(async_nats::Event) + Send + Sync + 'static,
) -> Result<async_nats::Client> {
    let setup = |what: String| Error::Setup(format!("sink {name}: {what}"));
    let servers = cfg.servers.join(",");
    let events = Arc::new(events);
    let mut options = ConnectOptions::new()
        .name(format!("kube-event-bridge/{name}"))
        .connection_timeout(cfg.connect_timeout)
        .event_callback(move |event| {
            let events = events.clone();
            async move { events(event) }
        });
    let auth = &cfg.auth;
    let secret = |r: &crate::sinks::SecretRef, what: &str| {
        r.resolve().map_err(|e| setup(format!("{what}: {e}")))
    };
    if let Some(token) = &auth.token {
        options = options.token(secret(token, "auth.token")?);
    }
    if let (Some(user), Some(password)) = (&auth.user, &auth.password) {
        options = options.user_and_password(user.clone(), secret(password, "auth.password")?);
    }
    if let Some(seed) = &auth.nkey_seed {
        options = options.nkey(secret(seed, "auth.nkey_seed")?);
    }
    if let Some(creds) = &auth.credentials_file {
        options = options.credentials_file(creds).await.map_err(|e| {
            setup(format!(
                "cannot read credentials file {}: {e}",
                creds.display()
            ))
        })?;
    }
    if let Some(tls) = &cfg.tls {
        options = options.require_tls(true);
        if let Some(ca) = &tls.ca_file {
            options = options.add_root_certificates(ca.clone());
        }
        if let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
    }
    options
        .connect(servers.as_str())
        .await
        .map_err(|e| setup(format!("cannot connect to NATS at {servers}: {e}")))
}

fn on_event(sink: &str, denied: &Mutex<HashSet<String>>, event: async_nats::Event) {
    match event {
        async_nats::Event::ServerError(async_nats::ServerError::Other(text))
            if text
                .to_lowercase()
                .contains("permissions violation for publish") =>
        {
            // "Permissions Violation for Publish to \"subject\""
            if let Some(subject) = text.split('"').nth(1) {
                denied
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(subject.to_owned());
            }
            warn!(sink, error = %text, "NATS refused a publish");
        }
        async_nats::Event::Disconnected => warn!(sink, "NATS connection lost; reconnecting"),
        async_nats::Event::Connected => info!(sink, "NATS connected"),
        other => info!(sink, event = %other, "NATS event"),
    }
}

/// Creates or updates the stream if asked, then checks that it exists and covers every subject
/// the template can produce.
async fn check_stream(
    name: &str,
    js: &jetstream::Context,
    cfg: &NatsSinkConfig,
    subject: &Template,
) -> Result<()> {
    let stream = cfg
        .stream
        .as_ref()
        .expect("validated: jetstream mode has a stream");
    let wildcard = nats_wildcard(subject);
    let setup = |what: String| Error::Setup(format!("sink {name}: stream {}: {what}", stream.name));
    if stream.create {
        let config = jetstream::stream::Config {
            name: stream.name.clone(),
            subjects: if stream.subjects.is_empty() {
                vec![wildcard.clone()]
            } else {
                stream.subjects.clone()
            },
            retention: match stream.retention {
                StreamRetention::Limits => jetstream::stream::RetentionPolicy::Limits,
                StreamRetention::Interest => jetstream::stream::RetentionPolicy::Interest,
                StreamRetention::Workqueue => jetstream::stream::RetentionPolicy::WorkQueue,
            },
            storage: match stream.storage {
                StreamStorage::File => jetstream::stream::StorageType::File,
                StreamStorage::Memory => jetstream::stream::StorageType::Memory,
            },
            max_age: stream.max_age,
            max_bytes: stream.max_bytes.unwrap_or(-1),
            num_replicas: stream.replicas,
            duplicate_window: stream.duplicate_window,
            ..Default::default()
        };
        js.create_or_update_stream(config)
            .await
            .map_err(|e| setup(format!("cannot create or update: {e}")))?;
    }
    let mut handle = js
        .get_stream(&stream.name)
        .await
        .map_err(|e| setup(format!("{e} (create it, or set `stream.create: true`)")))?;
    let info = handle
        .info()
        .await
        .map_err(|e| setup(format!("cannot read its settings: {e}")))?;
    let subjects = &info.config.subjects;
    if !subjects.iter().any(|s| nats_filter_covers(s, &wildcard)) {
        return Err(setup(format!(
            "its subjects {subjects:?} do not cover {wildcard:?}, where this sink publishes"
        )));
    }
    Ok(())
}

impl Sink for NatsSink {
    fn name(&self) -> &str {
        &self.name
    }

    fn max_message_bytes(&self) -> Option<usize> {
        Some(self.max_payload).filter(|&m| m > 0)
    }

    fn publish<'a>(&'a self, m: &'a Message) -> BoxFuture<'a, Result<()>> {
        async move {
            let subject = self.subject_for(m);
            if !is_valid_nats_subject(&subject) {
                return Err(Error::InvalidDestination {
                    destination: subject,
                    reason: "not a NATS subject".into(),
                });
            }
            let headers = self.headers(m);
            let size = m.payload.len();
            match &self.jetstream {
                Some(_) => self.submit(m).await?.await,
                None => self
                    .client
                    .publish_with_headers(subject.clone(), headers, m.payload.clone())
                    .await
                    .map_err(|e| match e.kind() {
                        async_nats::client::PublishErrorKind::MaxPayloadExceeded => {
                            Error::TooLarge {
                                size,
                                max: self.client.server_info().max_payload,
                            }
                        }
                        _ => Error::Unavailable(e.to_string()),
                    }),
            }
        }
        .boxed()
    }

    /// JetStream: writes the message to the connection (waiting while `max_in_flight`
    /// acknowledgements are pending) and returns its PubAck; one connection keeps the order.
    /// Core NATS: the publish itself (there is no acknowledgement).
    fn submit<'a>(&'a self, m: &'a Message) -> BoxFuture<'a, Result<Ack>> {
        async move {
            let Some(js) = &self.jetstream else {
                self.publish(m).await?;
                return Ok(Box::pin(async { Ok(()) }) as Ack);
            };
            let subject = self.subject_for(m);
            if !is_valid_nats_subject(&subject) {
                return Err(Error::InvalidDestination {
                    destination: subject,
                    reason: "not a NATS subject".into(),
                });
            }
            let size = m.payload.len();
            let ack = js
                .publish_with_headers(subject.clone(), self.headers(m), m.payload.clone())
                .await
                .map_err(|e| self.classify(&subject, size, e.kind(), e.to_string()))?;
            let (client, denied) = (self.client.clone(), self.denied.clone());
            // The PubAck is awaited by a task of its own: async-nats releases the
            // `max_in_flight` permit only when the future is polled to its end, and a
            // worker may hold its acks unpolled while it hands over more messages,
            // which would wait for permits forever.
            let acked = tokio::spawn(async move {
                ack.await.map(|_| ()).map_err(|e| {
                    classify(&client, &denied, &subject, size, e.kind(), e.to_string())
                })
            });
            Ok(Box::pin(async move {
                acked.await.unwrap_or_else(|e| {
                    Err(Error::Unavailable(format!("acknowledgement task: {e}")))
                })
            }) as Ack)
        }
        .boxed()
    }

    fn flush(&self) -> BoxFuture<'_, Result<()>> {
        async move {
            self.client
                .flush()
                .await
                .map_err(|e| Error::Unavailable(e.to_string()))
        }
        .boxed()
    }

    fn health(&self) -> std::result::Result<(), String> {
        match self.client.connection_state() {
            State::Connected => Ok(()),
            state => Err(format!("sink {}: NATS connection is {state:?}", self.name)),
        }
    }
}
