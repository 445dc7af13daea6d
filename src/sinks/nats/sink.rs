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
//! pipeline.
//!
//! # Terms
//! Each leadership term publishes on a connection of its own ([`Sink::abandon_queued`]
//! retires the last one). A retired connection never reconnects: what async-nats still holds
//! for it (publishes buffered while it was disconnected) belongs to an ended term and is never
//! sent, so it cannot land behind a newer leader's messages. Its publishes time out; the next
//! term starts from the checkpoint. With sharding, each shard's term has a connection of its
//! own (see [`Sink::shard_view`]): a hand-over of one shard retires only that one.
//!
//! A permissions violation is reported by the server asynchronously: the subject is
//! remembered, and a publish to it that then times out fails for good as `denied`.

use std::{
    collections::HashSet,
    sync::{Arc, Mutex, atomic::Ordering},
    time::Duration,
};

use async_nats::{
    HeaderMap,
    connection::State,
    jetstream::{self, context::PublishErrorKind},
};
use futures::{FutureExt, future::BoxFuture};
use tracing::{info, warn};

use super::{
    client::{Conn, Conns, ShardConns},
    config::{NatsMode, NatsSinkConfig, StreamRetention, StreamStorage},
    error::classify,
};
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
    cfg: NatsSinkConfig,
    conns: Arc<Conns>,
    /// The connections of the shard views (see [`Sink::shard_view`]), by shard label.
    shard_conns: ShardConns,
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
        let servers = cfg.servers_for_logs();
        let denied: Arc<Mutex<HashSet<String>>> = Arc::default();
        let subject = Template::parse(&cfg.subject).map_err(|e| setup(format!("subject: {e}")))?;
        let conn = Conn::open(name, cfg, &denied).await?;
        if let Some(context) = &conn.jetstream {
            check_stream(name, context, cfg, &subject).await?;
        }
        info!(sink = %name, servers = %servers, mode = ?cfg.mode, "Connected to NATS");
        let max_payload = conn.client.server_info().max_payload;
        Ok(Self {
            name: name.to_owned(),
            cfg: cfg.clone(),
            max_payload,
            conns: Arc::new(Conns::of(Some(conn))),
            shard_conns: ShardConns::default(),
            subject,
            denied,
        })
    }

    /// The connections, shared with the checkpoint store (whose writes use the current
    /// term's connection too).
    pub(super) fn conns(&self) -> Arc<Conns> {
        self.conns.clone()
    }

    /// The shard views' connections, shared with the checkpoint store (a shard route's
    /// writes go on its shard's term's connection).
    pub(super) fn shard_conns(&self) -> ShardConns {
        self.shard_conns.clone()
    }

    /// Whether the sink publishes to JetStream.
    pub(super) fn is_jetstream(&self) -> bool {
        self.cfg.mode == NatsMode::Jetstream
    }

    /// The subject `message` goes to.
    pub fn subject_for(&self, message: &Message) -> String {
        self.subject.render(message, escape_nats_token)
    }

    fn headers(&self, m: &Message) -> HeaderMap {
        let mut h = HeaderMap::new();
        if self.is_jetstream() {
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
        client: &async_nats::Client,
        subject: &str,
        size: usize,
        kind: PublishErrorKind,
        detail: String,
    ) -> Error {
        classify(client, &self.denied, subject, size, kind, detail)
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

impl NatsSink {
    /// The subject of `m`, if it is a valid one.
    fn valid_subject(&self, m: &Message) -> Result<String> {
        let subject = self.subject_for(m);
        if !is_valid_nats_subject(&subject) {
            return Err(Error::InvalidDestination {
                destination: subject,
                reason: "not a NATS subject".into(),
            });
        }
        Ok(subject)
    }

    /// [`Sink::publish`] on the term's connection of `conns`.
    async fn publish_on(&self, conns: &Conns, m: &Message) -> Result<()> {
        self.valid_subject(m)?;
        match conns.open()?.jetstream {
            Some(_) => self.submit_on(conns, m).await?.await,
            None => self.submit_on(conns, m).await.map(|_| ()),
        }
    }

    /// [`Sink::submit`] on the term's connection of `conns`.
    async fn submit_on(&self, conns: &Conns, m: &Message) -> Result<Ack> {
        let subject = self.valid_subject(m)?;
        let size = m.payload.len();
        let conn = conns.open()?;
        let Some(js) = &conn.jetstream else {
            conn.client
                .publish_with_headers(subject, self.headers(m), m.payload.clone())
                .await
                .map_err(|e| match e.kind() {
                    async_nats::client::PublishErrorKind::MaxPayloadExceeded => Error::TooLarge {
                        size,
                        max: conn.client.server_info().max_payload,
                    },
                    _ => Error::Unavailable(e.to_string()),
                })?;
            return Ok(Box::pin(async { Ok(()) }) as Ack);
        };
        let ack = js
            .publish_with_headers(subject.clone(), self.headers(m), m.payload.clone())
            .await
            .map_err(|e| self.classify(&conn.client, &subject, size, e.kind(), e.to_string()))?;
        let (client, denied) = (conn.client.clone(), self.denied.clone());
        // Polled by the caller, no task of its own: async-nats releases the `max_in_flight`
        // permit only when this future ends (or is dropped), so a caller must not hold many
        // of these unpolled while it submits more; the route's workers keep one message of a
        // key in flight and poll its PubAck while they take other keys (see `pipeline::worker`).
        Ok(Box::pin(async move {
            ack.await
                .map(|_| ())
                .map_err(|e| classify(&client, &denied, &subject, size, e.kind(), e.to_string()))
        }) as Ack)
    }

    /// Waits until the term's connection of `conns` (if any) has sent what it buffers.
    async fn flush_on(&self, conns: &Conns) -> Result<()> {
        match conns.current() {
            Some(conn) if !conn.retired.load(Ordering::SeqCst) => conn
                .client
                .flush()
                .await
                .map_err(|e| Error::Unavailable(e.to_string())),
            _ => Ok(()),
        }
    }

    /// Opens a connection for the term of generation `generation` of `conns` (retrying until
    /// it connects, or a later term began).
    fn reopen(&self, conns: Arc<Conns>, generation: u64) {
        let (name, cfg, denied) = (self.name.clone(), self.cfg.clone(), self.denied.clone());
        tokio::spawn(async move {
            let mut delay = Duration::from_millis(100);
            while conns.generation.load(Ordering::SeqCst) == generation {
                match Conn::open(&name, &cfg, &denied).await {
                    Ok(conn) => {
                        let mut current = conns.current.write().unwrap_or_else(|e| e.into_inner());
                        if conns.generation.load(Ordering::SeqCst) == generation {
                            *current = Some(Arc::new(conn));
                        }
                        return;
                    }
                    Err(e) => {
                        warn!(sink = %name, error = %e, "Cannot open the new term's NATS connection; retrying");
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(Duration::from_secs(4));
                    }
                }
            }
        });
    }

    /// The shard views' connections.
    fn all_shard_conns(&self) -> Vec<Arc<Conns>> {
        self.shard_conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }
}

impl Sink for NatsSink {
    fn name(&self) -> &str {
        &self.name
    }

    fn max_message_bytes(&self) -> Option<usize> {
        Some(self.max_payload).filter(|&m| m > 0)
    }

    fn publish<'a>(&'a self, m: &'a Message) -> BoxFuture<'a, Result<()>> {
        self.publish_on(&self.conns, m).boxed()
    }

    /// JetStream: writes the message to the connection (waiting while `max_in_flight`
    /// acknowledgements are pending) and returns its PubAck; one connection keeps the order.
    /// Core NATS: the publish itself (there is no acknowledgement).
    fn submit<'a>(&'a self, m: &'a Message) -> BoxFuture<'a, Result<Ack>> {
        self.submit_on(&self.conns, m).boxed()
    }

    fn flush(&self) -> BoxFuture<'_, Result<()>> {
        async move {
            self.conns.open()?;
            self.flush_on(&self.conns).await?;
            // JetStream's publishes were acknowledged one by one (a flush of a reconnecting
            // shard connection would wait for the reconnect); core NATS sends what is buffered.
            if !self.is_jetstream() {
                for conns in self.all_shard_conns() {
                    self.flush_on(&conns).await?;
                }
            }
            Ok(())
        }
        .boxed()
    }

    /// Retires the term's connection and opens the next term's (retrying until it
    /// connects); until it is up, publishes fail as unavailable. The shard views'
    /// connections are retired too (shutdown).
    fn abandoned(&self) -> u64 {
        self.conns.generation.load(Ordering::SeqCst)
    }

    fn abandon_queued(&self) {
        if let Some(generation) = self.conns.retire() {
            self.reopen(self.conns.clone(), generation);
        }
        for conns in self.all_shard_conns() {
            conns.retire();
        }
    }

    fn end_terms(&self) {
        self.all_shard_conns().iter().for_each(|c| c.close());
    }

    fn shard_view(self: Arc<Self>, shard: crate::shard::Shard) -> Option<Arc<dyn Sink>> {
        let conns = Arc::new(Conns::of(None));
        self.shard_conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(shard.label(), conns.clone());
        Some(Arc::new(NatsShardSink {
            sink: self,
            shard,
            conns,
        }))
    }

    fn health(&self) -> std::result::Result<(), String> {
        // The shard views' terms: a connection that could not be opened, or is not connected.
        let shards = self
            .shard_conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(label, conns)| (label.clone(), conns.clone()))
            .collect::<Vec<_>>();
        for (label, conns) in shards {
            if let Some(why) = conns
                .problem
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
            {
                return Err(why);
            }
            if let Some(conn) = conns.current()
                && !conn.retired.load(Ordering::SeqCst)
                && conn.client.connection_state() != State::Connected
            {
                return Err(format!(
                    "sink {}: shard {label}'s NATS connection is {:?}",
                    self.name,
                    conn.client.connection_state()
                ));
            }
        }
        let Some(conn) = self.conns.current() else {
            return Err(format!("sink {}: no NATS connection", self.name));
        };
        if conn.retired.load(Ordering::SeqCst) {
            return Err(format!(
                "sink {}: the next leadership term's NATS connection is opening",
                self.name
            ));
        }
        match conn.client.connection_state() {
            State::Connected => Ok(()),
            state => Err(format!("sink {}: NATS connection is {state:?}", self.name)),
        }
    }
}

/// A NATS sink as the routes of one shard use it (see [`Sink::shard_view`]): each term of
/// the shard publishes on a connection of its own, opened when the term begins and retired
/// when it is abandoned (see the module docs), so a hand-over of one shard retires no other
/// shard's connection, and its routes' checkpoint writes go on it too.
struct NatsShardSink {
    sink: Arc<NatsSink>,
    shard: crate::shard::Shard,
    conns: Arc<Conns>,
}

impl Sink for NatsShardSink {
    fn name(&self) -> &str {
        self.sink.name()
    }

    fn max_message_bytes(&self) -> Option<usize> {
        self.sink.max_message_bytes()
    }

    fn publish<'a>(&'a self, m: &'a Message) -> BoxFuture<'a, Result<()>> {
        self.sink.publish_on(&self.conns, m).boxed()
    }

    fn submit<'a>(&'a self, m: &'a Message) -> BoxFuture<'a, Result<Ack>> {
        self.sink.submit_on(&self.conns, m).boxed()
    }

    fn flush(&self) -> BoxFuture<'_, Result<()>> {
        self.sink.flush_on(&self.conns).boxed()
    }

    fn abandoned(&self) -> u64 {
        self.conns.generation.load(Ordering::SeqCst)
    }

    fn abandon_queued(&self) {
        self.conns.retire();
    }

    /// Opens the term's connection (a failure is tried again by the caller; nothing of the
    /// shard is published meanwhile).
    fn begin_term(
        &self,
        shard: crate::shard::Shard,
        _fence: Option<crate::leader::Fence>,
    ) -> BoxFuture<'_, Result<()>> {
        debug_assert_eq!(shard, self.shard);
        async move {
            if self.conns.open().is_ok() {
                return Ok(());
            }
            let opened = Conn::open(&self.sink.name, &self.sink.cfg, &self.sink.denied).await;
            let mut problem = self.conns.problem.lock().unwrap_or_else(|e| e.into_inner());
            let conn = match opened {
                Ok(conn) => conn,
                Err(e) => {
                    let why = format!("{}: cannot open the term's connection: {e}", self.shard);
                    *problem = Some(why.clone());
                    return Err(Error::Unavailable(why));
                }
            };
            *problem = None;
            let mut current = self
                .conns
                .current
                .write()
                .unwrap_or_else(|e| e.into_inner());
            *current = Some(Arc::new(conn));
            Ok(())
        }
        .boxed()
    }

    /// Core NATS: sends what the term's connection buffers (a publish counts as done once it
    /// is buffered): a drained hand-over releases the lease only after this.
    fn commit_term(&self, shard: crate::shard::Shard) -> BoxFuture<'_, Result<()>> {
        debug_assert_eq!(shard, self.shard);
        async move {
            // JetStream's publishes were acknowledged (a flush would wait for a reconnect).
            if self.sink.is_jetstream() {
                return Ok(());
            }
            self.sink.flush_on(&self.conns).await
        }
        .boxed()
    }

    /// Closes the term's connection (what it still owes acknowledgements for keeps it until
    /// they come or time out).
    fn end_term(&self, shard: crate::shard::Shard) {
        debug_assert_eq!(shard, self.shard);
        self.conns.close();
    }

    fn end_terms(&self) {
        self.end_term(self.shard);
    }

    fn health(&self) -> std::result::Result<(), String> {
        self.sink.health()
    }
}
