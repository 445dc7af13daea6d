//! Tools for the consumers of what the bridge writes: `state` rebuilds the objects a state
//! topic holds and compares them with the cluster.

pub mod state;

/// Errors of the consumer tools.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The command line or config does not fit the command.
    #[error("{0}")]
    Usage(String),
    /// Reading the destination failed.
    #[error("{0}")]
    Read(String),
    /// The cluster could not be asked.
    #[error(transparent)]
    Cluster(#[from] crate::cluster::Error),
    /// A sink could not be opened.
    #[error(transparent)]
    Sink(#[from] crate::sinks::Error),
}

/// `Result` with this module's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;
