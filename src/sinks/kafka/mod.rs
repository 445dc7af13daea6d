//! The `kafka` sink: idempotent, acks=all producing with librdkafka (rdkafka), CloudEvents in
//! structured or binary mode, or a compacted state topic.

mod checkpoint;
mod config;
pub mod reader;
mod sink;

pub use checkpoint::KafkaCheckpointStore;
pub use config::{
    Compression, KafkaMode, KafkaSaslConfig, KafkaSinkConfig, KafkaTlsConfig, KafkaTopicsConfig,
    SaslMechanism, is_valid_topic,
};
pub use sink::{KafkaSink, client_config};
