//! Leaving parts out of a message too large for its destination, step by step: the old
//! object, then the patch, then all but a reference to the object.

use super::{DiffMode, Encoder, Encoding};
use crate::informer::{CachedObject, EventType, Notification};

/// How much of a message is left out to fit the destination's size limit, in the order the
/// steps are taken (each one keeps the previous ones' cuts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Trim {
    /// The whole message.
    None = 0,
    /// Without `data.oldObject` (the patch stays).
    OldObject,
    /// Without `data.oldObject` and `data.patch`.
    Patch,
    /// `data.object` is a reference: apiVersion, kind and metadata without annotations and
    /// managedFields; the message says `k8struncated: true`.
    Reference,
}

impl Trim {
    /// The label of `keb_message_degraded_total{step}`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::OldObject => "old_object",
            Self::Patch => "patch",
            Self::Reference => "reference",
        }
    }
}

/// Metadata fields a reference-only message keeps.
const REFERENCE_METADATA: [&str; 9] = [
    "name",
    "namespace",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "labels",
    "ownerReferences",
];

/// The reference-only form of `obj` (see [`Trim::Reference`]).
pub fn reference_of(obj: &CachedObject) -> Box<serde_json::value::RawValue> {
    #[derive(serde::Deserialize)]
    struct Parts {
        #[serde(rename = "apiVersion", default)]
        api_version: Option<serde_json::Value>,
        #[serde(default)]
        kind: Option<serde_json::Value>,
        #[serde(default)]
        metadata: serde_json::Map<String, serde_json::Value>,
    }
    let parts: Parts = serde_json::from_str(obj.json().get()).unwrap_or(Parts {
        api_version: None,
        kind: None,
        metadata: Default::default(),
    });
    let metadata: serde_json::Map<_, _> = parts
        .metadata
        .into_iter()
        .filter(|(k, _)| REFERENCE_METADATA.contains(&k.as_str()))
        .collect();
    let reference = serde_json::json!({
        "apiVersion": parts.api_version,
        "kind": parts.kind,
        "metadata": metadata,
    });
    serde_json::value::to_raw_value(&reference).expect("a JSON value serializes")
}

impl Encoder {
    /// Whether update messages carry `data.patch`.
    pub fn patches(&self) -> bool {
        self.encoding != Encoding::State && self.diff == DiffMode::Patch
    }

    /// The steps of [`Trim`] that change the message of `n`, in order (`Reference` always).
    pub fn trim_steps(&self, n: &Notification) -> Vec<Trim> {
        let update = n.event_type() == EventType::Updated && !n.resumed;
        let mut steps = Vec::with_capacity(3);
        let carries_data = self.encoding != Encoding::State;
        if carries_data && update && self.include_old_object {
            steps.push(Trim::OldObject);
        }
        if carries_data && update && self.diff == DiffMode::Patch {
            steps.push(Trim::Patch);
        }
        steps.push(Trim::Reference);
        steps
    }
}
