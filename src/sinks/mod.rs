//! Sinks: where messages go. Every sink implements [`Sink`]; a publish returns only once the
//! destination has accepted the message, and its error says whether a retry can help.

pub mod stdout;

use futures::future::BoxFuture;

use crate::message::Message;

/// Errors of a publish or flush.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Writing failed (a closed pipe, a full disk); worth retrying.
    #[error("write failed: {0}")]
    Io(#[source] std::io::Error),
    /// The destination will never take this message: it is larger than it accepts.
    #[error("message of {size} bytes is larger than the {max} bytes the destination accepts")]
    TooLarge {
        /// The message's size.
        size: usize,
        /// The destination's limit.
        max: usize,
    },
    /// The sink could not be set up at start.
    #[error("cannot open {what}: {source}")]
    Open {
        /// What was being opened.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// Whether publishing the same message again can succeed.
    pub fn is_retriable(&self) -> bool {
        match self {
            Self::Io(_) => true,
            Self::TooLarge { .. } | Self::Open { .. } => false,
        }
    }

    /// A short, bounded label for the `reason` of `keb_sink_failed_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Io(_) => "io",
            Self::TooLarge { .. } => "too_large",
            Self::Open { .. } => "open",
        }
    }
}

/// `Result` with this module's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A destination for messages.
pub trait Sink: Send + Sync {
    /// The sink's configured name.
    fn name(&self) -> &str;
    /// Publishes one message; resolves once the destination accepted it.
    fn publish<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<()>>;
    /// Pushes out anything buffered; called once at shutdown.
    fn flush(&self) -> BoxFuture<'_, Result<()>>;
}
