//! What a librdkafka error means: for a record (its [`Error`] class), for the producer (fatal),
//! and for a transaction's commit or abort (retriable, a consequence of the abort, a missing
//! ACL).

use rdkafka::{
    error::{KafkaError, RDKafkaErrorCode},
    producer::Producer as _,
};

use super::client::SinkProducer;
use crate::sinks::Error;

/// What a librdkafka error means for a record of `size` bytes to `topic`.
pub(super) fn classify(
    err: KafkaError,
    topic: &str,
    size: usize,
    max_message_bytes: usize,
) -> Error {
    let code = err.rdkafka_error_code();
    match code {
        Some(RDKafkaErrorCode::MessageSizeTooLarge) => Error::TooLarge {
            size,
            max: max_message_bytes,
        },
        Some(
            RDKafkaErrorCode::TopicAuthorizationFailed
            | RDKafkaErrorCode::ClusterAuthorizationFailed
            | RDKafkaErrorCode::SaslAuthenticationFailed
            | RDKafkaErrorCode::Authentication,
        ) => Error::Denied(err.to_string()),
        Some(RDKafkaErrorCode::InvalidTopic) => Error::InvalidDestination {
            destination: topic.to_owned(),
            reason: err.to_string(),
        },
        Some(RDKafkaErrorCode::MessageTimedOut | RDKafkaErrorCode::RequestTimedOut) => {
            Error::TimedOut(err.to_string())
        }
        _ => Error::Unavailable(err.to_string()),
    }
}

/// The fatal error the producer hit, if any: librdkafka's idempotent producer stops for good
/// on one (an unrecoverable sequence gap, a fenced producer), and every later record fails.
pub(super) fn fatal(producer: &SinkProducer) -> Option<String> {
    producer
        .client()
        .fatal_error()
        .map(|(code, reason)| format!("the Kafka producer failed for good ({code:?}: {reason})"))
}

/// Whether a commit or abort that failed so may be tried again.
pub(super) fn is_retriable(e: &KafkaError) -> bool {
    matches!(e, KafkaError::Transaction(r) if r.is_retriable() && !r.is_fatal())
}

/// Whether a record's error is only the consequence of its transaction's failure (purged by
/// the abort, refused while the transaction waited for it), not its own.
pub(super) fn is_consequence(e: &KafkaError) -> bool {
    matches!(
        e.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::PurgeQueue
                | RDKafkaErrorCode::PurgeInflight
                | RDKafkaErrorCode::State
        )
    )
}

/// What to grant when an `init_transactions` is refused for want of an ACL.
pub(super) fn acl_hint(e: &KafkaError) -> &'static str {
    match e.rdkafka_error_code() {
        Some(
            RDKafkaErrorCode::TransactionalIdAuthorizationFailed
            | RDKafkaErrorCode::ClusterAuthorizationFailed,
        ) => " (grant this principal WRITE and DESCRIBE on the transactional id)",
        _ => "",
    }
}
