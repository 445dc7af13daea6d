//! Sinks: where messages go. Every sink implements [`Sink`]; a publish returns only once the
//! destination has accepted the message, and its error says whether a retry can help.

pub mod checkpoint;
pub mod kafka;
pub mod nats;
pub mod secret;
pub mod stdout;
pub mod template;
pub mod tls;

pub use checkpoint::CheckpointStore;
pub use secret::SecretRef;

use futures::{FutureExt, future::BoxFuture};

use crate::message::Message;

/// Errors of a sink. Each says whether retrying the same message can help
/// ([`Error::is_retriable`]) and gives a bounded label for metrics ([`Error::reason`]).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Writing failed (a closed pipe, a full disk); worth retrying.
    #[error("write failed: {0}")]
    Io(std::io::Error),
    /// The destination cannot take messages now (disconnected, no stream answering, too many
    /// pending acks); worth retrying.
    #[error("destination unavailable: {0}")]
    Unavailable(String),
    /// The message was fine, but the transaction it went in was aborted (another record of it
    /// failed) or none could be opened: sent again without counting as a retry of its own.
    #[error("transaction aborted: {0}")]
    Aborted(String),
    /// No acknowledgement in time; the message may or may not have been stored, so it is
    /// retried (with the same id, which brokers deduplicate).
    #[error("no acknowledgement in time: {0}")]
    TimedOut(String),
    /// The destination will never take this message: it is larger than it accepts.
    #[error("message of {size} bytes is larger than the {max} bytes the destination accepts")]
    TooLarge {
        /// The message's size.
        size: usize,
        /// The destination's limit.
        max: usize,
    },
    /// The message's topic or subject is not valid for the destination.
    #[error("invalid destination {destination:?}: {reason}")]
    InvalidDestination {
        /// The rendered topic or subject.
        destination: String,
        /// Why it is invalid.
        reason: String,
    },
    /// The destination refuses this client the message (permissions).
    #[error("denied: {0}")]
    Denied(String),
    /// The sink could not be set up at start.
    #[error("cannot open {what}: {cause}")]
    Open {
        /// What was being opened.
        what: String,
        /// The cause (in the message).
        cause: std::io::Error,
    },
    /// The sink could not connect or check its destination at start.
    #[error("{0}")]
    Setup(String),
}

impl Error {
    /// Whether publishing the same message again can succeed.
    pub fn is_retriable(&self) -> bool {
        matches!(
            self,
            Self::Io(_) | Self::Unavailable(_) | Self::Aborted(_) | Self::TimedOut(_)
        )
    }

    /// The bounded `reason` of `keb_sink_failed_total` for this error.
    pub fn reason(&self) -> FailureReason {
        match self {
            Self::Io(_) => FailureReason::Io,
            Self::Unavailable(_) | Self::Aborted(_) => FailureReason::Unavailable,
            Self::TimedOut(_) => FailureReason::Timeout,
            Self::TooLarge { .. } => FailureReason::TooLarge,
            Self::InvalidDestination { .. } => FailureReason::InvalidDestination,
            Self::Denied(_) => FailureReason::Denied,
            Self::Open { .. } => FailureReason::Open,
            Self::Setup(_) => FailureReason::Setup,
        }
    }
}

/// The `reason` label of `keb_sink_failed_total`: the sink errors' reasons, plus the
/// pipeline's own (`encode`, `max_retries`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureReason {
    /// [`Error::Io`].
    Io,
    /// [`Error::Unavailable`].
    Unavailable,
    /// [`Error::TimedOut`].
    Timeout,
    /// [`Error::TooLarge`], or a message too large even as a reference.
    TooLarge,
    /// [`Error::InvalidDestination`].
    InvalidDestination,
    /// [`Error::Denied`].
    Denied,
    /// [`Error::Open`].
    Open,
    /// [`Error::Setup`].
    Setup,
    /// The notification could not be encoded.
    Encode,
    /// Retried `max_retries` times.
    MaxRetries,
}

impl FailureReason {
    /// Every reason; routes start each at zero, so that every series exists before the first
    /// failure.
    pub const ALL: [FailureReason; 10] = [
        Self::Io,
        Self::Unavailable,
        Self::Timeout,
        Self::TooLarge,
        Self::InvalidDestination,
        Self::Denied,
        Self::Open,
        Self::Setup,
        Self::Encode,
        Self::MaxRetries,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Io => "io",
            Self::Unavailable => "unavailable",
            Self::Timeout => "timeout",
            Self::TooLarge => "too_large",
            Self::InvalidDestination => "invalid_destination",
            Self::Denied => "denied",
            Self::Open => "open",
            Self::Setup => "setup",
            Self::Encode => "encode",
            Self::MaxRetries => "max_retries",
        }
    }
}

/// `Result` with this module's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The acknowledgement of a message handed over with [`Sink::submit`].
pub type Ack = BoxFuture<'static, Result<()>>;

/// A destination for messages.
pub trait Sink: Send + Sync {
    /// The sink's configured name.
    fn name(&self) -> &str;
    /// Publishes one message; resolves once the destination accepted it.
    fn publish<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<()>>;
    /// Hands one message over and resolves to the future of its acknowledgement. Messages
    /// one caller hands over one after another reach the destination in that order (Kafka:
    /// librdkafka keeps per-partition order with idempotence; JetStream: one connection), so
    /// a caller may hand over several before awaiting any acknowledgement. An acknowledgement
    /// may hold a slot of the sink's in-flight window (JetStream's `max_in_flight`) until it
    /// is polled to its end or dropped, so a caller polls what it holds rather than keeping
    /// more than that window unpolled. The default publishes to completion first (no
    /// pipelining).
    fn submit<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<Ack>> {
        async move {
            self.publish(message).await?;
            Ok(Box::pin(async { Ok(()) }) as Ack)
        }
        .boxed()
    }
    /// The largest message the destination takes (Kafka: the producer's `message.max.bytes`;
    /// NATS: the server's `max_payload`), headers and key included; `None`: no limit.
    fn max_message_bytes(&self) -> Option<usize> {
        None
    }
    /// Pushes out anything buffered; called once at shutdown.
    fn flush(&self) -> BoxFuture<'_, Result<()>>;
    /// Drops what was handed over but not sent to the destination yet (this replica stopped
    /// leading: a new leader publishes from now on); their acknowledgements fail. The default
    /// drops nothing (nothing is held, or the client cannot take it back).
    fn abandon_queued(&self) {}
    /// How many times [`abandon_queued`](Self::abandon_queued) has dropped (or may have
    /// dropped) something so far: a failure seen after it changed may be that, not the
    /// destination's answer.
    fn abandoned(&self) -> u64 {
        0
    }
    /// Whether the sink writes its routes' checkpoint records itself, in the transaction of
    /// the messages they are about (Kafka with `exactly_once`): the pipeline then hands each
    /// message's record over with it ([`Self::submit_settling`]) and every other settlement
    /// through [`Self::settle_silently`], and writes no checkpoint of its own.
    fn in_transactions(&self) -> bool {
        false
    }
    /// [`Self::submit`], with the change of route `route`'s checkpoint that the message's
    /// acknowledgement settles: written in the same transaction, so a reader sees both or
    /// neither. The default ignores the change.
    fn submit_settling<'a>(
        &'a self,
        message: &'a Message,
        route: &'a str,
        change: Option<checkpoint::Change>,
    ) -> BoxFuture<'a, Result<Ack>> {
        let _ = (route, change);
        self.submit(message)
    }
    /// A change of route `route`'s checkpoint settled without a message (a delete the route
    /// does not publish, a message failed for good), written in the open transaction, before
    /// any message handed over after this call; an aborted transaction's are written again in
    /// the next. The default does nothing.
    fn settle_silently(&self, route: &str, change: checkpoint::Change) {
        let _ = (route, change);
    }
    /// This replica starts publishing shard `shard` (it became its leader, or it runs without
    /// leader election): a transactional sink makes the shard's producer for the term here,
    /// fencing the last leader's, before the checkpoints are read, and only while `fence` (the
    /// lease's; `None` without leader election) is valid; a shard view (see
    /// [`Self::shard_view`]) makes the term's producer or opens its connection. An error is
    /// tried again by the caller, and nothing of the shard is published meanwhile. The
    /// default does nothing.
    fn begin_term(
        &self,
        shard: crate::shard::Shard,
        fence: Option<crate::leader::Fence>,
    ) -> BoxFuture<'_, Result<()>> {
        let _ = (shard, fence);
        async { Ok(()) }.boxed()
    }
    /// Shard `shard`'s term here ended (it may begin again): a transactional sink fails what
    /// the term's transaction holds and drops its producer. The default does nothing.
    fn end_term(&self, shard: crate::shard::Shard) {
        let _ = shard;
    }
    /// Shard `shard`'s lease, lost while this replica led it (not released, not handed on),
    /// is held by `holder` now, who could take it from `takeable_from`: a transactional sink
    /// counts the ended term's producer of the shard as fenced unless it was closed cleanly
    /// before then (`holder`'s producer of the same transactional.id fences it when its term
    /// begins, and the broker may never tell this one: an empty transaction asks nothing),
    /// reported by [`Self::broken`] until this replica begins a term of the shard again. The
    /// default does nothing: only transactions are fenced by the broker.
    fn deposed(
        &self,
        shard: crate::shard::Shard,
        holder: &str,
        takeable_from: tokio::time::Instant,
    ) {
        let _ = (shard, holder, takeable_from);
    }
    /// Commits what shard `shard`'s term wrote so far (a drained hand-over, before it releases
    /// the Lease: the next owner reads the checkpoint with everything in it; a core NATS
    /// view sends what its connection buffers). The default has nothing to commit.
    fn commit_term(&self, shard: crate::shard::Shard) -> BoxFuture<'_, Result<()>> {
        let _ = shard;
        async { Ok(()) }.boxed()
    }
    /// Every term here ended (shutdown): [`Self::end_term`] of every shard.
    fn end_terms(&self) {}
    /// The sink as the routes of shard `shard` use it (sharded only), or `None` when the sink
    /// keeps nothing per shard (then the sink itself serves every shard). A view's terms are
    /// its shard's alone: Kafka without `exactly_once` publishes each shard's term with a
    /// producer of its own and JetStream on a connection of its own, both made at
    /// [`Self::begin_term`]; the view's [`Self::abandon_queued`] drops only its shard's
    /// queue, and its [`Self::abandoned`] counts only those. So a hand-over of one shard
    /// fails no message of another.
    fn shard_view(
        self: std::sync::Arc<Self>,
        shard: crate::shard::Shard,
    ) -> Option<std::sync::Arc<dyn Sink>> {
        let _ = shard;
        None
    }
    /// Why the sink can never publish again in this process (for `/healthz`: the pod is
    /// restarted and resumes from its checkpoint), or `None`.
    fn broken(&self) -> Option<String> {
        None
    }
    /// Why the sink cannot publish now (for `/readyz`), or `Ok`.
    fn health(&self) -> std::result::Result<(), String> {
        Ok(())
    }
}
