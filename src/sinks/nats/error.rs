//! What a failed publish to NATS means.

use std::{collections::HashSet, sync::Mutex};

use async_nats::jetstream::context::PublishErrorKind;

use crate::sinks::Error;

/// What a failed JetStream publish of `size` bytes to `subject` means.
pub(super) fn classify(
    client: &async_nats::Client,
    denied: &Mutex<HashSet<String>>,
    subject: &str,
    size: usize,
    kind: PublishErrorKind,
    detail: String,
) -> Error {
    match kind {
        PublishErrorKind::MaxPayloadExceeded => Error::TooLarge {
            size,
            max: client.server_info().max_payload,
        },
        PublishErrorKind::TimedOut
            if denied
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(subject) =>
        {
            Error::Denied(format!(
                "publish to {subject} violates the server's permissions"
            ))
        }
        PublishErrorKind::TimedOut => Error::TimedOut(detail),
        _ => Error::Unavailable(detail),
    }
}
