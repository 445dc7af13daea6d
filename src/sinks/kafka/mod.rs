//! The `kafka` sink: idempotent, acks=all producing with librdkafka (rdkafka), CloudEvents in
//! structured or binary mode, or a compacted state topic; PLAIN, SCRAM and OAUTHBEARER (OIDC
//! client credentials) authentication, TLS.

mod checkpoint;
mod client;
mod config;
mod error;
mod oauth;
mod producer;
pub mod reader;
mod record;
mod sink;
mod transactions;

pub use checkpoint::KafkaCheckpointStore;
pub use client::{KafkaClient, KafkaContext, client_config};
pub use config::{
    Compression, KafkaMode, KafkaSaslConfig, KafkaSinkConfig, KafkaTlsConfig, KafkaTopicsConfig,
    SaslMechanism, is_valid_topic, transactional_id,
};
pub use sink::KafkaSink;
