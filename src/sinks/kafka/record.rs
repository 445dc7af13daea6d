//! The checkpoint record, as the sink and its transactions write it and the store reads it:
//! key `["route", "namespace/name"]`, value the entry as JSON (`None`: a tombstone).

use crate::sinks::checkpoint::Change;

/// A checkpoint record: key, and value (`None`: a tombstone).
pub(super) type CheckpointRecord = (String, Option<String>);

/// The record of `change` to the checkpoint of `route`: key `["route", "namespace/name"]`,
/// value the entry (`None`: a tombstone).
pub(super) fn record_of(route: &str, (key, entry): Change) -> CheckpointRecord {
    let k = serde_json::to_string(&(route, &key)).expect("strings serialize");
    let v = entry.map(|e| serde_json::to_string(&e).expect("strings serialize"));
    (k, v)
}
