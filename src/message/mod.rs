//! Notification → message: the CloudEvents 1.0 envelope and its settings.
//!
//! The envelope is the product's public interface; docs/src/message-format.md documents it
//! field by field.
//! [`trim`] leaves parts out of messages too large for their destination; [`transform`] is
//! what informers apply to objects before caching them (managedFields stripped, Secret data
//! redacted).

pub mod patch;
pub mod transform;
pub mod trim;

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use bytes::Bytes;
use kube::api::ApiResource;
use serde::{Deserialize, Serialize};

use crate::informer::{CachedObject, EventType, Notification, NotificationKind};

pub use patch::patch_between;
pub use transform::{REDACTED, object_transform, redact_secret};
pub use trim::{Trim, reference_of};

/// What goes into each message.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MessageConfig {
    /// Put the previous state in `data.oldObject` of update messages.
    #[serde(default = "default_true")]
    pub include_old_object: bool,
    /// Remove `metadata.managedFields` from objects (it is large and rarely useful downstream).
    #[serde(default = "default_true")]
    pub strip_managed_fields: bool,
    /// Keep the values of a Secret's `data` and `stringData`; by default they are redacted.
    #[serde(default)]
    pub allow_secret_data: bool,
    /// `none`, or `patch`: update messages carry `data.patch`, an RFC 6902 JSON Patch from the
    /// last published state to the new object (`include_old_object: false` then saves bytes).
    #[serde(default)]
    pub diff: DiffMode,
}

impl Default for MessageConfig {
    fn default() -> Self {
        Self {
            include_old_object: true,
            strip_managed_fields: true,
            allow_secret_data: false,
            diff: DiffMode::None,
        }
    }
}

/// What update messages carry besides the new object.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum DiffMode {
    /// Nothing more.
    #[default]
    None,
    /// `data.patch`: an RFC 6902 JSON Patch from `oldObject` to `object`.
    Patch,
}

// On unless a setting turns it off.
fn default_true() -> bool {
    true
}

/// The id of the message about `uid` at `resource_version` of `event_type`:
/// `uid:resourceVersion:type`. Deterministic, so that brokers (JetStream's `Nats-Msg-Id`) and
/// consumers can deduplicate redelivery. A delete inferred by a list (final state unknown)
/// takes the version of the last state known (the cache's, or the checkpoint's), not the one
/// its message reports as found gone at (see `Notification::gone_at`), which differs between
/// the replicas and attempts that infer the same delete.
pub fn message_id(uid: &str, resource_version: &str, event_type: EventType) -> String {
    // Pieces pushed, not `format!`: made for every message.
    let ty = event_type.as_str();
    let mut id = String::with_capacity(uid.len() + resource_version.len() + ty.len() + 2);
    for piece in [uid, ":", resource_version, ":", ty] {
        id.push_str(piece);
    }
    id
}

/// Errors encoding a notification. They are final: retrying cannot fix the object.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The object lacks a field the message id needs.
    #[error("object {key} has no metadata.{field}")]
    MissingField {
        /// `namespace/name` of the object.
        key: String,
        /// The missing field.
        field: &'static str,
    },
    /// serde_json failed (an object with a non-string map key, for example).
    #[error("cannot serialize object {key}: {cause}")]
    Serialize {
        /// `namespace/name` of the object.
        key: String,
        /// The serializer's error.
        cause: serde_json::Error,
    },
}

/// `Result` with this module's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Prefix of the CloudEvents `type` attribute; the event type follows (`….added`).
pub const TYPE_PREFIX: &str = "io.github.kube-event-bridge.object";

/// How a message carries its CloudEvent (CloudEvents' content modes).
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    serde::Serialize,
    serde::Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// The whole event as one JSON document (`application/cloudevents+json`).
    #[default]
    Structured,
    /// The event's `data` as the body, every other attribute as a header.
    Binary,
    /// Not a CloudEvents mode: the body is the newest object alone, empty for deletes (a
    /// tombstone), and the attributes travel as headers. For compacted state topics.
    #[serde(skip)]
    State,
}

/// The resource a message is about; shared by every message of an encoder.
#[derive(Debug)]
pub struct ResourceInfo {
    /// Cluster name from the config.
    pub cluster: String,
    /// API group, `""` for core.
    pub group: String,
    /// API version.
    pub version: String,
    /// Kind.
    pub kind: String,
    /// Plural resource name.
    pub plural: String,
}

/// An encoded notification, ready for a sink.
#[derive(Debug, Clone)]
pub struct Message {
    /// Deterministic id `uid:resourceVersion:type`; brokers and consumers deduplicate on it.
    pub id: String,
    /// Partition/ordering key, `namespace/name` (or `name`).
    pub key: String,
    /// The notification type.
    pub event_type: EventType,
    /// Structured mode: the whole CloudEvent (JSON). Binary mode: the event's `data` (JSON).
    /// State mode: the object (JSON), empty for a delete.
    pub payload: Bytes,
    /// Binary mode: every CloudEvents attribute but `datacontenttype`, by attribute name
    /// (sinks add their protocol's prefix, `ce-` or `ce_`); empty in structured mode.
    pub attributes: Vec<(&'static str, String)>,
    /// The media type of `payload`.
    pub content_type: &'static str,
    /// The resource the object belongs to.
    pub resource: Arc<ResourceInfo>,
    /// The object's namespace, `None` for cluster-scoped objects.
    pub namespace: Option<String>,
    /// The object's name.
    pub name: String,
    /// When the change was received from the API server.
    pub received: std::time::Instant,
}

impl Message {
    /// What the message weighs on the wire, roughly: payload, key and attributes (as
    /// headers). Sinks' own headers and record framing come on top.
    pub fn wire_size(&self) -> usize {
        self.payload.len()
            + self.key.len()
            + self
                .attributes
                .iter()
                .map(|(k, v)| k.len() + v.len() + 8)
                .sum::<usize>()
    }
}

/// Media type of structured-mode payloads.
pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json";
/// Media type of binary-mode payloads (the `data` member).
pub const DATA_CONTENT_TYPE: &str = "application/json";

/// Builds messages for one resource and one encoding.
#[derive(Debug)]
pub struct Encoder {
    resource: Arc<ResourceInfo>,
    source_prefix: String,
    types: [String; 4],
    include_old_object: bool,
    diff: DiffMode,
    encoding: Encoding,
    // Size of the last payload: the next buffer starts that large, so serializing rarely
    // reallocates.
    size_hint: AtomicUsize,
    // The structured envelope's parts that are the same for every message, as JSON (see
    // `Constants`).
    constants: Arc<Constants>,
}

/// The parts of a structured envelope that do not depend on the object, escaped once: the
/// JSON is written around them in the order and form `serde_json` gives [`Envelope`] (tested
/// byte for byte).
#[derive(Debug)]
struct Constants {
    // `"<source prefix>`: the source's opening quote and prefix.
    source_prefix: String,
    // `/<plural>","type":`: the end of the source and the next member's name.
    source_end: String,
    // `"<type>"` per event type.
    types: [String; 4],
    // `,"datacontenttype":…,"k8sresource":"…"`.
    resource: String,
}

impl Constants {
    fn new(resource: &ResourceInfo, source_prefix: &str, types: &[String; 4]) -> Self {
        let json = |s: &str| serde_json::to_string(s).expect("a string serializes");
        let inner = |s: &str| {
            let j = json(s);
            j[1..j.len() - 1].to_owned()
        };
        let mut members = String::new();
        for (name, value) in [
            ("datacontenttype", DATA_CONTENT_TYPE),
            ("k8scluster", &resource.cluster),
            ("k8sgroup", &resource.group),
            ("k8sversion", &resource.version),
            ("k8skind", &resource.kind),
            ("k8sresource", &resource.plural),
        ] {
            members.push_str(&format!(",\"{name}\":{}", json(value)));
        }
        Self {
            source_prefix: format!("\"{}", inner(source_prefix)),
            source_end: format!("/{}\",\"type\":", inner(&resource.plural)),
            types: types.each_ref().map(|t| json(t)),
            resource: members,
        }
    }
}

/// Writes `s` as a JSON string: as it is when nothing in it needs escaping (keys, names,
/// uids and versions never do), else escaped by `serde_json`.
fn write_str(out: &mut Vec<u8>, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.reserve(s.len() + 2);
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        serde_json::to_writer(&mut *out, s).expect("writing to a Vec");
    }
}

impl Clone for Encoder {
    fn clone(&self) -> Self {
        Self {
            resource: self.resource.clone(),
            source_prefix: self.source_prefix.clone(),
            types: self.types.clone(),
            include_old_object: self.include_old_object,
            diff: self.diff,
            encoding: self.encoding,
            size_hint: AtomicUsize::new(self.size_hint.load(Ordering::Relaxed)),
            constants: self.constants.clone(),
        }
    }
}

#[derive(Serialize)]
struct Envelope<'a> {
    specversion: &'static str,
    id: &'a str,
    source: Source<'a>,
    #[serde(rename = "type")]
    ty: &'a str,
    subject: &'a str,
    time: jiff::Timestamp,
    datacontenttype: &'static str,
    k8scluster: &'a str,
    k8sgroup: &'a str,
    k8sversion: &'a str,
    k8skind: &'a str,
    k8sresource: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    k8snamespace: Option<&'a str>,
    k8sname: &'a str,
    k8suid: &'a str,
    k8sresourceversion: &'a str,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    k8sinitial: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    k8sfinalstateunknown: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    k8sresumed: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    k8sfilteredout: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    k8struncated: bool,
    data: Data<'a>,
}

/// `{prefix}[/namespaces/{ns}]/{plural}`, written straight into the output.
struct Source<'a> {
    prefix: &'a str,
    namespace: Option<&'a str>,
    plural: &'a str,
}

impl std::fmt::Display for Source<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.namespace {
            Some(ns) => write!(f, "{}/namespaces/{ns}/{}", self.prefix, self.plural),
            None => write!(f, "{}/{}", self.prefix, self.plural),
        }
    }
}

impl Serialize for Source<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[derive(Serialize)]
struct Data<'a> {
    object: &'a serde_json::value::RawValue,
    #[serde(rename = "oldObject", skip_serializing_if = "Option::is_none")]
    old_object: Option<&'a serde_json::value::RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    patch: Option<&'a json_patch::Patch>,
}

impl Encoder {
    /// An encoder for objects of `resource` in `cluster`, producing `encoding`.
    pub fn new(
        cluster: &str,
        resource: &ApiResource,
        options: &MessageConfig,
        encoding: Encoding,
    ) -> Self {
        let source_prefix = if resource.group.is_empty() {
            format!("/clusters/{cluster}/api/{}", resource.version)
        } else {
            format!(
                "/clusters/{cluster}/apis/{}/{}",
                resource.group, resource.version
            )
        };
        let types = [
            EventType::Added,
            EventType::Updated,
            EventType::Deleted,
            EventType::Synced,
        ]
        .map(|t| format!("{TYPE_PREFIX}.{}", t.as_str()));
        let resource = ResourceInfo {
            cluster: cluster.to_owned(),
            group: resource.group.clone(),
            version: resource.version.clone(),
            kind: resource.kind.clone(),
            plural: resource.plural.clone(),
        };
        let constants = Arc::new(Constants::new(&resource, &source_prefix, &types));
        Self {
            resource: Arc::new(resource),
            source_prefix,
            types,
            include_old_object: options.include_old_object,
            diff: options.diff,
            encoding,
            size_hint: AtomicUsize::new(1024),
            constants,
        }
    }

    /// The resource this encoder's messages are about.
    pub fn resource(&self) -> &Arc<ResourceInfo> {
        &self.resource
    }

    /// An empty message about this encoder's resource, for rendering what does not depend on
    /// the object (topic names known at start).
    pub fn sample_message(&self) -> Message {
        Message {
            id: String::new(),
            key: String::new(),
            event_type: EventType::Added,
            payload: Bytes::new(),
            attributes: Vec::new(),
            content_type: DATA_CONTENT_TYPE,
            resource: self.resource.clone(),
            namespace: None,
            name: String::new(),
            received: std::time::Instant::now(),
        }
    }

    /// About what the message of `n` weighs, before it is encoded: the objects' JSON it
    /// carries (the old one only where update messages carry it, the new one again for a
    /// patch at most about its size) and 1 KiB for the envelope's attributes (a structured
    /// CloudEvent's take 600-700 bytes; in binary and state mode they go as headers, which
    /// [`Message::wire_size`] counts too).
    pub fn size_estimate(&self, n: &Notification) -> usize {
        const ENVELOPE: usize = 1024;
        let object = n.object().json().get().len();
        if self.encoding == Encoding::State {
            return object + ENVELOPE;
        }
        let old = match n.kind() {
            NotificationKind::Update { old, .. } if self.include_old_object => {
                old.json().get().len()
            }
            _ => 0,
        };
        let patch = match n.kind() {
            NotificationKind::Update { .. } if self.diff == DiffMode::Patch => object,
            _ => 0,
        };
        object + old + patch + ENVELOPE
    }

    /// Encodes one notification about the object at `key` (`namespace/name`, as
    /// [`Notification::key`] gives it).
    pub fn encode(&self, key: &str, n: &Notification) -> Result<Message> {
        self.encode_trimmed(key, n, Trim::None)
    }

    /// [`Encoder::encode`], leaving out what `trim` says.
    pub fn encode_trimmed(&self, key: &str, n: &Notification, trim: Trim) -> Result<Message> {
        self.encode_with(key, n, trim, |out, envelope, ty| {
            self.write_structured(out, envelope, ty)
        })
    }

    /// [`Encoder::encode_trimmed`], writing a structured envelope with `structured` (the
    /// tests compare [`Encoder::write_structured`] with `serde_json` through it).
    fn encode_with(
        &self,
        key: &str,
        n: &Notification,
        trim: Trim,
        structured: impl FnOnce(&mut Vec<u8>, &Envelope<'_>, EventType) -> serde_json::Result<()>,
    ) -> Result<Message> {
        let event_type = n.event_type();
        let obj = n.object();
        let meta = &**obj;
        let missing = |field| Error::MissingField {
            key: key.to_owned(),
            field,
        };
        let uid = meta.uid().ok_or_else(|| missing("uid"))?;
        let rv = meta
            .resource_version()
            .ok_or_else(|| missing("resourceVersion"))?;
        let name = meta.name().ok_or_else(|| missing("name"))?;
        let namespace = meta.namespace().filter(|ns| !ns.is_empty());
        let id = message_id(uid, rv, event_type);
        let (initial, final_state_unknown, old) = match n.kind() {
            NotificationKind::Add {
                is_initial_list, ..
            } => (*is_initial_list, false, None),
            NotificationKind::Update { old, .. } => (
                false,
                false,
                // A resumed update's `old` is a stub from the checkpoint, not an object.
                (event_type == EventType::Updated && !n.resumed).then_some(&**old),
            ),
            NotificationKind::Delete {
                final_state_unknown,
                ..
            } => (false, *final_state_unknown, None),
        };
        let old_object = old.filter(|_| self.include_old_object && trim < Trim::OldObject);
        let patch = match old {
            Some(old) if self.diff == DiffMode::Patch && trim < Trim::Patch => {
                let patch = patch_between(old, obj);
                if patch.is_none() {
                    // Only for JSON serde_json cannot parse as a value (deeper than 128
                    // levels, a number beyond f64, a lone surrogate escape), which a list
                    // item cached as the server wrote it could hold and no API server
                    // writes; the message still goes, with its objects.
                    tracing::warn!(
                        key,
                        "Cannot diff the old and new object; the update goes without data.patch"
                    );
                }
                patch
            }
            _ => None,
        };
        let truncated = trim == Trim::Reference;
        let reference = truncated.then(|| reference_of(obj));
        let object = reference.as_deref().unwrap_or(obj.json());
        let r = &*self.resource;
        let envelope = Envelope {
            specversion: "1.0",
            id: &id,
            source: Source {
                prefix: &self.source_prefix,
                namespace,
                plural: &r.plural,
            },
            ty: &self.types[event_type as usize],
            subject: key,
            time: n.observed,
            datacontenttype: DATA_CONTENT_TYPE,
            k8scluster: &r.cluster,
            k8sgroup: &r.group,
            k8sversion: &r.version,
            k8skind: &r.kind,
            k8sresource: &r.plural,
            k8snamespace: namespace,
            k8sname: name,
            k8suid: uid,
            k8sresourceversion: n.gone_at.as_deref().unwrap_or(rv),
            k8sinitial: initial,
            k8sfinalstateunknown: final_state_unknown,
            k8sresumed: n.resumed,
            k8sfilteredout: n.filtered_out,
            k8struncated: truncated,
            data: Data {
                object,
                old_object: old_object.map(CachedObject::json),
                patch: patch.as_ref(),
            },
        };
        let mut payload = Vec::with_capacity(self.size_hint.load(Ordering::Relaxed) + 256);
        let serialized = match self.encoding {
            Encoding::Structured => structured(&mut payload, &envelope, event_type),
            Encoding::Binary => serde_json::to_writer(&mut payload, &envelope.data),
            Encoding::State if event_type == EventType::Deleted => Ok(()),
            // The cached JSON is the payload.
            Encoding::State => {
                payload.extend_from_slice(object.get().as_bytes());
                Ok(())
            }
        };
        serialized.map_err(|cause| Error::Serialize {
            key: key.to_owned(),
            cause,
        })?;
        self.size_hint.store(payload.len(), Ordering::Relaxed);
        let (attributes, content_type) = match self.encoding {
            Encoding::Structured => (Vec::new(), STRUCTURED_CONTENT_TYPE),
            Encoding::Binary | Encoding::State => (envelope.attributes(), DATA_CONTENT_TYPE),
        };
        Ok(Message {
            id,
            key: key.to_owned(),
            event_type,
            payload: payload.into(),
            attributes,
            content_type,
            resource: self.resource.clone(),
            namespace: namespace.map(str::to_owned),
            name: name.to_owned(),
            received: n.received,
        })
    }
}

/// How `time` is printed: as `jiff::Timestamp`'s `Display` prints it.
const TIMESTAMP_PRINTER: jiff::fmt::temporal::DateTimePrinter =
    jiff::fmt::temporal::DateTimePrinter::new();

impl Encoder {
    /// Writes `e` as `serde_json::to_writer` does (the same members in the same order, the
    /// same escaping), with the parts that are the same for every message written once
    /// ([`Constants`]).
    fn write_structured(
        &self,
        out: &mut Vec<u8>,
        e: &Envelope<'_>,
        event_type: EventType,
    ) -> serde_json::Result<()> {
        let c = &*self.constants;
        out.extend_from_slice(br#"{"specversion":"1.0","id":"#);
        write_str(out, e.id);
        out.extend_from_slice(br#","source":"#);
        out.extend_from_slice(c.source_prefix.as_bytes());
        if let Some(ns) = e.source.namespace {
            // The namespace within the source string: escaped as a part of it.
            let mut quoted = Vec::with_capacity(ns.len() + 2);
            write_str(&mut quoted, ns);
            out.extend_from_slice(b"/namespaces/");
            out.extend_from_slice(&quoted[1..quoted.len() - 1]);
        }
        out.extend_from_slice(c.source_end.as_bytes());
        out.extend_from_slice(c.types[event_type as usize].as_bytes());
        out.extend_from_slice(br#","subject":"#);
        write_str(out, e.subject);
        out.extend_from_slice(br#","time":""#);
        // jiff's printer, as `Display` (and so serde) prints it, without `core::fmt`.
        TIMESTAMP_PRINTER
            .print_timestamp(&e.time, jiff::fmt::StdIoWrite(&mut *out))
            .expect("writing to a Vec");
        out.push(b'"');
        out.extend_from_slice(c.resource.as_bytes());
        if let Some(ns) = e.k8snamespace {
            out.extend_from_slice(br#","k8snamespace":"#);
            write_str(out, ns);
        }
        out.extend_from_slice(br#","k8sname":"#);
        write_str(out, e.k8sname);
        out.extend_from_slice(br#","k8suid":"#);
        write_str(out, e.k8suid);
        out.extend_from_slice(br#","k8sresourceversion":"#);
        write_str(out, e.k8sresourceversion);
        for (set, member) in [
            (e.k8sinitial, &br#","k8sinitial":true"#[..]),
            (e.k8sfinalstateunknown, br#","k8sfinalstateunknown":true"#),
            (e.k8sresumed, br#","k8sresumed":true"#),
            (e.k8sfilteredout, br#","k8sfilteredout":true"#),
            (e.k8struncated, br#","k8struncated":true"#),
        ] {
            if set {
                out.extend_from_slice(member);
            }
        }
        out.extend_from_slice(br#","data":"#);
        serde_json::to_writer(&mut *out, &e.data)?;
        out.push(b'}');
        Ok(())
    }
}

impl Envelope<'_> {
    /// Binary mode: every attribute but `datacontenttype` and `data`, as strings. Extension
    /// flags appear only when true, as in structured mode.
    fn attributes(&self) -> Vec<(&'static str, String)> {
        let mut a = vec![
            ("specversion", self.specversion.to_owned()),
            ("id", self.id.to_owned()),
            ("source", self.source.to_string()),
            ("type", self.ty.to_owned()),
            ("subject", self.subject.to_owned()),
            ("time", self.time.to_string()),
            ("k8scluster", self.k8scluster.to_owned()),
            ("k8sgroup", self.k8sgroup.to_owned()),
            ("k8sversion", self.k8sversion.to_owned()),
            ("k8skind", self.k8skind.to_owned()),
            ("k8sresource", self.k8sresource.to_owned()),
        ];
        if let Some(ns) = self.k8snamespace {
            a.push(("k8snamespace", ns.to_owned()));
        }
        a.push(("k8sname", self.k8sname.to_owned()));
        a.push(("k8suid", self.k8suid.to_owned()));
        a.push(("k8sresourceversion", self.k8sresourceversion.to_owned()));
        if self.k8sinitial {
            a.push(("k8sinitial", "true".to_owned()));
        }
        if self.k8sfinalstateunknown {
            a.push(("k8sfinalstateunknown", "true".to_owned()));
        }
        if self.k8sresumed {
            a.push(("k8sresumed", "true".to_owned()));
        }
        if self.k8sfilteredout {
            a.push(("k8sfilteredout", "true".to_owned()));
        }
        if self.k8struncated {
            a.push(("k8struncated", "true".to_owned()));
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::informer::testing::obj;
    use kube::api::{DynamicObject, GroupVersionKind};
    use std::sync::Arc;

    fn configmaps() -> ApiResource {
        ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("", "v1", "ConfigMap"),
            "configmaps",
        )
    }

    fn note(kind: NotificationKind) -> Notification {
        Notification::at(
            kind,
            std::time::Instant::now(),
            "2026-01-02T03:04:05Z".parse().unwrap(),
        )
    }

    fn decode(m: &Message) -> serde_json::Value {
        serde_json::from_slice(&m.payload).unwrap()
    }

    #[test]
    fn the_structured_writer_matches_serde_byte_for_byte() {
        // Strings that need escaping, in every member that can hold one.
        let nasty = [
            "plain",
            "quote\"d",
            "back\\slash",
            "new\nline\u{1}ctl",
            "ünïcødé ☃",
            "slash/and\u{7f}del",
        ];
        let at = |i: usize| nasty[i % nasty.len()];
        let object = |i: usize, namespaced: bool, rv: &str| -> crate::informer::ObjectRef {
            let o: DynamicObject = serde_json::from_value(serde_json::json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {
                    "name": at(i), "uid": at(i + 1), "resourceVersion": rv,
                    "namespace": if namespaced { Some(at(i + 2)) } else { None },
                    "annotations": {"a": at(i + 3), "empty": ""},
                },
                "data": {"k": at(i + 4)},
            }))
            .unwrap();
            Arc::new(CachedObject::new(&o))
        };
        let mut checked = 0;
        for i in 0..nasty.len() {
            let group = if i % 2 == 0 { "" } else { at(i) };
            let resource = ApiResource::from_gvk_with_plural(
                &GroupVersionKind::gvk(group, at(i + 1), at(i + 2)),
                at(i + 3),
            );
            for (include_old_object, diff) in [
                (true, DiffMode::None),
                (false, DiffMode::Patch),
                (true, DiffMode::Patch),
            ] {
                let config = MessageConfig {
                    include_old_object,
                    diff,
                    ..MessageConfig::default()
                };
                // An empty cluster name too (the empty string in a member of its own).
                let cluster = if i % 3 == 0 { "" } else { at(i + 4) };
                let enc = Encoder::new(cluster, &resource, &config, Encoding::Structured);
                for namespaced in [true, false] {
                    let (old, new) = (
                        object(i, namespaced, &format!("1{}", at(i))),
                        object(i, namespaced, &format!("2{}", at(i + 5))),
                    );
                    let kinds = [
                        NotificationKind::Add {
                            obj: new.clone(),
                            is_initial_list: true,
                        },
                        NotificationKind::Add {
                            obj: new.clone(),
                            is_initial_list: false,
                        },
                        NotificationKind::Update {
                            old: old.clone(),
                            new: new.clone(),
                        },
                        NotificationKind::Update {
                            old: new.clone(),
                            new: new.clone(),
                        },
                        NotificationKind::Delete {
                            obj: new.clone(),
                            final_state_unknown: true,
                        },
                        NotificationKind::Delete {
                            obj: new.clone(),
                            final_state_unknown: false,
                        },
                    ];
                    for kind in kinds {
                        for flags in 0..8u8 {
                            let mut n = note(kind.clone());
                            n.resumed = flags & 1 != 0;
                            n.filtered_out = flags & 2 != 0;
                            if flags & 4 != 0 {
                                // The time as observed: with nanoseconds.
                                n.observed = "2026-01-02T03:04:05.123456789Z".parse().unwrap();
                            }
                            let key = n.key().clone();
                            for trim in [Trim::None, Trim::OldObject, Trim::Patch, Trim::Reference]
                            {
                                let written = enc.encode_trimmed(&key, &n, trim).unwrap();
                                let expected = enc
                                    .encode_with(&key, &n, trim, |out, e, _| {
                                        serde_json::to_writer(out, e)
                                    })
                                    .unwrap();
                                assert_eq!(
                                    String::from_utf8_lossy(&written.payload),
                                    String::from_utf8_lossy(&expected.payload)
                                );
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(checked, nasty.len() * 3 * 2 * 6 * 8 * 4);
    }

    #[test]
    fn update_envelope_has_every_attribute() {
        let enc = Encoder::new(
            "prod",
            &configmaps(),
            &MessageConfig::default(),
            Encoding::Structured,
        );
        let m = enc
            .encode(
                "ns/a",
                &note(NotificationKind::Update {
                    old: obj("ns", "a", "1"),
                    new: obj("ns", "a", "2"),
                }),
            )
            .unwrap();
        assert_eq!(m.id, "uid-ns-a:2:updated");
        assert_eq!(m.key, "ns/a");
        let v = decode(&m);
        assert_eq!(v["specversion"], "1.0");
        assert_eq!(v["type"], "io.github.kube-event-bridge.object.updated");
        assert_eq!(
            v["source"],
            "/clusters/prod/api/v1/namespaces/ns/configmaps"
        );
        assert_eq!(v["subject"], "ns/a");
        assert_eq!(v["time"], "2026-01-02T03:04:05Z");
        assert_eq!(v["k8skind"], "ConfigMap");
        assert_eq!(v["k8sgroup"], "");
        assert_eq!(v["k8snamespace"], "ns");
        assert_eq!(v["k8sresourceversion"], "2");
        assert_eq!(v["data"]["object"]["metadata"]["resourceVersion"], "2");
        assert_eq!(v["data"]["oldObject"]["metadata"]["resourceVersion"], "1");
        assert!(v.get("k8sinitial").is_none());
    }

    #[test]
    fn resync_and_delete_flags() {
        let enc = Encoder::new(
            "c",
            &configmaps(),
            &MessageConfig::default(),
            Encoding::Structured,
        );
        let sync = enc.encode(
            "ns/a",
            &note(NotificationKind::Update {
                old: obj("ns", "a", "1"),
                new: obj("ns", "a", "1"),
            }),
        );
        let sync = sync.unwrap();
        assert_eq!(sync.id, "uid-ns-a:1:synced");
        assert!(decode(&sync)["data"].get("oldObject").is_none());
        let del = enc.encode(
            "ns/a",
            &note(NotificationKind::Delete {
                obj: obj("ns", "a", "3"),
                final_state_unknown: true,
            }),
        );
        let v = decode(&del.unwrap());
        assert_eq!(v["k8sfinalstateunknown"], true);
        assert_eq!(v["type"], "io.github.kube-event-bridge.object.deleted");
        let add = enc.encode(
            "cluster-wide",
            &note(NotificationKind::Add {
                obj: obj("", "cluster-wide", "4"),
                is_initial_list: true,
            }),
        );
        let v = decode(&add.unwrap());
        assert_eq!(v["k8sinitial"], true);
        assert!(v.get("k8snamespace").is_none());
        assert_eq!(v["source"], "/clusters/c/api/v1/configmaps");
    }

    #[test]
    fn an_inferred_delete_reports_where_it_was_found_gone_and_keeps_its_id() {
        let enc = Encoder::new(
            "c",
            &configmaps(),
            &MessageConfig::default(),
            Encoding::Structured,
        );
        let delete = |rv: &str, unknown: bool| {
            note(NotificationKind::Delete {
                obj: obj("ns", "a", rv),
                final_state_unknown: unknown,
            })
        };
        // Seen on a watch: its own version.
        let seen = decode(&enc.encode("ns/a", &delete("7", false)).unwrap());
        assert_eq!(seen["id"], "uid-ns-a:7:deleted");
        assert_eq!(seen["k8sresourceversion"], "7");
        // Inferred by a list at 12: reported at 12, identified by the last state known (3),
        // whatever list found it gone.
        for listed_at in ["12", "15"] {
            let inferred = delete("3", true).found_gone_at(Some(listed_at.into()));
            let inferred = decode(&enc.encode("ns/a", &inferred).unwrap());
            assert_eq!(inferred["id"], "uid-ns-a:3:deleted");
            assert_eq!(inferred["k8sresourceversion"], listed_at);
            assert_eq!(
                inferred["data"]["object"]["metadata"]["resourceVersion"], "3",
                "the object is the last state known"
            );
        }
    }

    #[test]
    fn missing_uid_is_an_error_naming_the_object() {
        let mut o = obj("ns", "a", "1").to_dynamic().unwrap();
        o.metadata.uid = None;
        let enc = Encoder::new(
            "c",
            &configmaps(),
            &MessageConfig::default(),
            Encoding::Structured,
        );
        let err = enc
            .encode(
                "ns/a",
                &note(NotificationKind::Add {
                    obj: Arc::new(crate::informer::CachedObject::new(&o)),
                    is_initial_list: false,
                }),
            )
            .unwrap_err();
        assert_eq!(err.to_string(), "object ns/a has no metadata.uid");
    }

    fn big(rv: &str, v: &str) -> Arc<CachedObject> {
        let o: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"namespace": "ns", "name": "a", "uid": "u", "resourceVersion": rv,
                         "labels": {"team": "shop"},
                         "annotations": {"kubectl.kubernetes.io/last-applied-configuration": v}},
            "data": {"v": v, "same": "s"},
        }))
        .unwrap();
        Arc::new(CachedObject::new(&o))
    }

    fn patching(include_old_object: bool) -> Encoder {
        let options = MessageConfig {
            diff: DiffMode::Patch,
            include_old_object,
            ..Default::default()
        };
        Encoder::new("c", &configmaps(), &options, Encoding::Structured)
    }

    /// The estimate the bytes in flight take before encoding: never below the message, and
    /// without the old object where update messages leave it out.
    #[test]
    fn the_size_estimate_counts_what_the_message_carries() {
        let update = note(NotificationKind::Update {
            old: big("1", "x"),
            new: big("2", "y"),
        });
        let plain = Encoder::new(
            "c",
            &configmaps(),
            &MessageConfig::default(),
            Encoding::Structured,
        );
        let state = Encoder::new(
            "c",
            &configmaps(),
            &MessageConfig::default(),
            Encoding::State,
        );
        for enc in [plain, patching(true), patching(false), state] {
            let size = enc.encode("ns/a", &update).unwrap().wire_size();
            let estimate = enc.size_estimate(&update);
            assert!(
                (size..=2 * size + 1024).contains(&estimate),
                "{estimate} for a message of {size}"
            );
        }
        let old = update.kind();
        let NotificationKind::Update { old, .. } = old else {
            unreachable!()
        };
        assert_eq!(
            patching(true).size_estimate(&update) - patching(false).size_estimate(&update),
            old.json().get().len()
        );
    }

    #[test]
    fn the_patch_turns_the_old_object_into_the_new_one() {
        let update = note(NotificationKind::Update {
            old: big("1", "x"),
            new: big("2", "y"),
        });
        let v = decode(&patching(true).encode("ns/a", &update).unwrap());
        let patch: json_patch::Patch = serde_json::from_value(v["data"]["patch"].clone()).unwrap();
        let mut doc = v["data"]["oldObject"].clone();
        json_patch::patch(&mut doc, &patch).unwrap();
        assert_eq!(doc, v["data"]["object"]);
        assert_eq!(
            patch.0.len(),
            3,
            "v, the annotation, resourceVersion: {patch:?}"
        );
        let without_old = decode(&patching(false).encode("ns/a", &update).unwrap());
        assert!(without_old["data"].get("oldObject").is_none());
        assert_eq!(without_old["data"]["patch"], v["data"]["patch"]);
        // Neither adds nor resyncs carry one.
        for n in [
            note(NotificationKind::Update {
                old: big("2", "y"),
                new: big("2", "y"),
            }),
            note(NotificationKind::Add {
                obj: big("2", "y"),
                is_initial_list: false,
            }),
        ] {
            let v = decode(&patching(true).encode("ns/a", &n).unwrap());
            assert!(v["data"].get("patch").is_none());
        }
    }

    #[test]
    fn each_trim_step_leaves_out_more_and_the_reference_keeps_metadata_without_annotations() {
        let enc = patching(true);
        let update = note(NotificationKind::Update {
            old: big("1", &"x".repeat(10_000)),
            new: big("2", &"y".repeat(10_000)),
        });
        assert_eq!(
            enc.trim_steps(&update),
            [Trim::OldObject, Trim::Patch, Trim::Reference]
        );
        let sizes: Vec<usize> = [Trim::None, Trim::OldObject, Trim::Patch, Trim::Reference]
            .iter()
            .map(|&t| enc.encode_trimmed("ns/a", &update, t).unwrap().wire_size())
            .collect();
        assert!(sizes.windows(2).all(|w| w[0] > w[1]), "{sizes:?}");
        let patch_only = decode(
            &enc.encode_trimmed("ns/a", &update, Trim::OldObject)
                .unwrap(),
        );
        assert!(patch_only["data"].get("oldObject").is_none());
        assert!(patch_only["data"]["patch"].is_array());
        let reference = decode(
            &enc.encode_trimmed("ns/a", &update, Trim::Reference)
                .unwrap(),
        );
        assert_eq!(reference["k8struncated"], true);
        assert_eq!(reference["k8sresourceversion"], "2");
        let object = &reference["data"]["object"];
        assert_eq!(object["kind"], "ConfigMap");
        assert_eq!(object["metadata"]["labels"]["team"], "shop");
        assert_eq!(object["metadata"]["uid"], "u");
        assert!(object["metadata"].get("annotations").is_none());
        assert!(object.get("data").is_none());
        assert!(reference["data"].get("patch").is_none());
        // An add has nothing to drop but its object.
        let add = note(NotificationKind::Add {
            obj: big("1", "x"),
            is_initial_list: false,
        });
        assert_eq!(enc.trim_steps(&add), [Trim::Reference]);
    }

    #[test]
    fn filtered_out_and_truncated_show_in_both_modes() {
        let mut n = note(NotificationKind::Delete {
            obj: big("3", "x"),
            final_state_unknown: false,
        });
        n.filtered_out = true;
        let options = MessageConfig::default();
        let structured = Encoder::new("c", &configmaps(), &options, Encoding::Structured);
        let v = decode(&structured.encode("ns/a", &n).unwrap());
        assert_eq!(v["k8sfilteredout"], true);
        assert_eq!(v["type"], "io.github.kube-event-bridge.object.deleted");
        let binary = Encoder::new("c", &configmaps(), &options, Encoding::Binary);
        let m = binary.encode_trimmed("ns/a", &n, Trim::Reference).unwrap();
        for flag in ["k8sfilteredout", "k8struncated"] {
            assert!(m.attributes.contains(&(flag, "true".to_owned())), "{flag}");
        }
        assert!(decode(&m)["object"].get("data").is_none());
    }
}
