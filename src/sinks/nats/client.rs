//! Connections to a NATS sink's servers: the options (credentials, TLS, events), one
//! connection per leadership term and its retirement (see [`super::sink`]'s module docs).

use std::{
    collections::HashSet,
    sync::{
        Arc, Mutex, RwLock,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use async_nats::{
    ConnectOptions, ReconnectToServer,
    jetstream::{self, kv},
};
use tracing::{info, warn};

use super::config::{NatsMode, NatsSinkConfig};
use crate::sinks::{Error, Result};

/// One term's connection (see "Terms" in [`super::sink`]).
pub(super) struct Conn {
    pub(super) client: async_nats::Client,
    pub(super) jetstream: Option<jetstream::Context>,
    /// Set when its term ended: it never reconnects.
    pub(super) retired: Arc<AtomicBool>,
    /// Whether it carried anything (a term that published nothing need not retire it).
    used: AtomicBool,
    /// The checkpoint bucket, opened on this connection when first used.
    kv: tokio::sync::OnceCell<kv::Store>,
}

impl Conn {
    /// Connects as `cfg` says; a connection that is retired (and lost) never reconnects.
    pub(super) async fn open(
        name: &str,
        cfg: &NatsSinkConfig,
        denied: &Arc<Mutex<HashSet<String>>>,
    ) -> Result<Self> {
        let retired = Arc::new(AtomicBool::new(false));
        let options = options(name, cfg, {
            let denied = denied.clone();
            let sink = name.to_owned();
            move |event| on_event(&sink, &denied, event)
        })
        .await?
        .reconnect_to_server_callback({
            let retired = retired.clone();
            move |servers, _| {
                let retired = retired.clone();
                async move {
                    // The server tried least lately, after async-nats' own backoff; the
                    // check comes after the wait, right before connecting.
                    let server = servers.iter().min_by_key(|s| s.failed_attempts)?;
                    tokio::time::sleep(reconnect_delay(server.failed_attempts)).await;
                    if retired.load(Ordering::SeqCst) {
                        std::future::pending::<()>().await;
                    }
                    Some(ReconnectToServer {
                        addr: server.addr.clone(),
                        delay: Some(Duration::ZERO),
                    })
                }
            }
        });
        let client = options
            .connect(cfg.servers_to_connect().as_str())
            .await
            .map_err(|e| cannot_connect(name, cfg, e))?;
        let jetstream = (cfg.mode == NatsMode::Jetstream).then(|| {
            jetstream::ContextBuilder::new()
                .timeout(cfg.ack_timeout)
                .max_ack_inflight(cfg.max_in_flight)
                .backpressure_on_inflight(true)
                .build(client.clone())
        });
        Ok(Self {
            client,
            jetstream,
            retired,
            used: AtomicBool::new(false),
            kv: tokio::sync::OnceCell::new(),
        })
    }

    /// The JetStream context (`jetstream` mode).
    pub(super) fn jetstream(&self) -> Option<&jetstream::Context> {
        self.jetstream.as_ref()
    }

    /// The checkpoint bucket on this connection, opened by `open` the first time.
    pub(super) async fn kv<E>(
        &self,
        open: impl AsyncFnOnce(&jetstream::Context) -> std::result::Result<kv::Store, E>,
    ) -> std::result::Result<&kv::Store, E> {
        let js = self
            .jetstream
            .as_ref()
            .expect("checkpoints need jetstream mode");
        self.kv.get_or_try_init(|| open(js)).await
    }
}

/// async-nats' reconnect backoff: none at first, then doubling from 2 ms up to 4 s.
fn reconnect_delay(failed_attempts: usize) -> Duration {
    match failed_attempts {
        0 => Duration::ZERO,
        n => Duration::from_millis(1 << n.min(12) as u32).min(Duration::from_secs(4)),
    }
}

/// The connection of each term: the current one, and a count of retirements (a newer
/// term's connection replaces it only if no later term began meanwhile). The sink's own
/// always has one; a shard view's has one only during the shard's terms here.
pub(super) struct Conns {
    pub(super) current: RwLock<Option<Arc<Conn>>>,
    pub(super) generation: AtomicU64,
    /// Why the current term's connection could not be opened (a shard view's), for
    /// readiness.
    pub(super) problem: Mutex<Option<String>>,
}

/// The shard views' connections, by shard label.
pub(super) type ShardConns = Arc<Mutex<std::collections::HashMap<String, Arc<Conns>>>>;

impl Conns {
    pub(super) fn of(conn: Option<Conn>) -> Self {
        Self {
            current: RwLock::new(conn.map(Arc::new)),
            generation: AtomicU64::new(0),
            problem: Mutex::new(None),
        }
    }

    /// The current term's connection; `None` between a shard's terms.
    pub(super) fn current(&self) -> Option<Arc<Conn>> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The current term's connection, unless it is retired (the next one still opening) or
    /// there is none (a shard not led here).
    pub(super) fn open(&self) -> Result<Arc<Conn>> {
        let Some(conn) = self.current() else {
            return Err(Error::Unavailable(
                "this shard's term has no NATS connection here (not leading it)".into(),
            ));
        };
        if conn.retired.load(Ordering::SeqCst) {
            return Err(Error::Unavailable(
                "the last leadership term's NATS connection is retired; the next one is opening"
                    .into(),
            ));
        }
        // Loaded first: a store on every publish would contend across workers.
        if !conn.used.load(Ordering::Relaxed) {
            conn.used.store(true, Ordering::SeqCst);
        }
        Ok(conn)
    }

    /// Ends a shard's term: closes its connection (what it still owes acknowledgements for
    /// keeps it until they come or time out) and forgets why the term could not start.
    pub(super) fn close(&self) {
        *self.problem.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.current
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .take();
    }

    /// Retires the current connection if it carried anything (it never reconnects); returns
    /// the generation of the next one, or `None` when nothing was retired.
    pub(super) fn retire(&self) -> Option<u64> {
        // Under the lock: a connection swapped in is always the newest term's.
        let current = self.current.write().unwrap_or_else(|e| e.into_inner());
        let conn = current.as_ref()?;
        if !conn.used.load(Ordering::SeqCst) && !conn.retired.load(Ordering::SeqCst) {
            // The ended term sent nothing on it (a standby's): it can serve the next.
            return None;
        }
        conn.retired.store(true, Ordering::SeqCst);
        Some(self.generation.fetch_add(1, Ordering::SeqCst) + 1)
    }
}

/// A connection to the servers of a sink, with its credentials and TLS settings; `events`
/// hears the connection's events. Fails fast with an error naming the sink and the servers.
pub async fn connect_client(
    name: &str,
    cfg: &NatsSinkConfig,
    events: impl Fn(async_nats::Event) + Send + Sync + 'static,
) -> Result<async_nats::Client> {
    options(name, cfg, events)
        .await?
        .connect(cfg.servers_to_connect().as_str())
        .await
        .map_err(|e| cannot_connect(name, cfg, e))
}

/// A first connection that failed, naming the sink and its servers (credentials redacted).
fn cannot_connect(name: &str, cfg: &NatsSinkConfig, e: impl std::fmt::Display) -> Error {
    Error::Setup(format!(
        "sink {name}: cannot connect to NATS at {}: {e}",
        cfg.servers_for_logs()
    ))
}

/// The options of a connection to the servers of a sink: its credentials and TLS settings;
/// `events` hears the connection's events.
async fn options(
    name: &str,
    cfg: &NatsSinkConfig,
    events: impl Fn(async_nats::Event) + Send + Sync + 'static,
) -> Result<ConnectOptions> {
    let setup = |what: String| Error::Setup(format!("sink {name}: {what}"));
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
    // Credentials written in the server URLs (validation made sure `auth` is unset then):
    // async-nats does not read them from a URL.
    match cfg
        .url_credentials()
        .map_err(|e| setup(format!("servers: {e}")))?
    {
        Some((user, Some(password))) => options = options.user_and_password(user, password),
        Some((token, None)) => options = options.token(token),
        None => {}
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
        if let Some((cert, key)) = tls.client_pair() {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
    }
    Ok(options)
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
