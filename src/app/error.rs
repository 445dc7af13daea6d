//! What building or running the service can fail with.

use std::net::SocketAddr;

use crate::{cluster, pipeline, pipeline::filter};

/// Errors building or running the service.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A resource could not be resolved.
    #[error(transparent)]
    Cluster(#[from] cluster::Error),
    /// A sink could not be opened.
    #[error("sinks: {0}")]
    Sink(crate::sinks::Error),
    /// A route's checkpoint could not be read.
    #[error(transparent)]
    Checkpoint(#[from] pipeline::checkpoint::Error),
    /// A route's checkpoint was written for another cluster.
    #[error("{0}")]
    OtherCluster(String),
    /// The cluster's identity could not be read (routes with a checkpoint need it).
    #[error("cluster identity: {0}")]
    Identity(String),
    /// A resource's filter settings do not compile (the config check catches this first).
    #[error("filter: {0}")]
    Filter(filter::Error),
    /// The admin address could not be bound.
    #[error("cannot listen on admin address {address}: {cause}")]
    Admin {
        /// The configured address.
        address: SocketAddr,
        /// The cause (in the message).
        cause: std::io::Error,
    },
}

// The messages above print their causes, so these are not `#[from]` sources (a log of the
// chain would repeat each cause).
impl From<crate::sinks::Error> for Error {
    fn from(e: crate::sinks::Error) -> Self {
        Self::Sink(e)
    }
}

impl From<filter::Error> for Error {
    fn from(e: filter::Error) -> Self {
        Self::Filter(e)
    }
}
