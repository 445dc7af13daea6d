//! The `nats` sink: JetStream (acknowledged, deduplicated by `Nats-Msg-Id`) or core NATS.

mod checkpoint;
mod client;
mod config;
mod error;
mod sink;

pub use checkpoint::{NatsCheckpointStore, READ_STALL};
pub use client::connect_client;
pub use config::{
    NatsAuthConfig, NatsMode, NatsSinkConfig, NatsStreamConfig, StreamRetention, StreamStorage,
    scrub_url_credentials,
};
pub use sink::NatsSink;
