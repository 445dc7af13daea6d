//! A message as the consumer tools see it: the structured CloudEvent (binary-mode and
//! state-topic records mapped back to it), the few attributes people read, filters over them,
//! and the one-line form `tail` prints.

use std::collections::BTreeMap;

use kube::core::{Selector, SelectorExt};
use serde_json::{Value, json};

use crate::message::TYPE_PREFIX;

/// The CloudEvents attributes that are flags (`"true"` in a header, `true` in JSON).
const FLAGS: [&str; 5] = [
    "k8sinitial",
    "k8sfinalstateunknown",
    "k8sresumed",
    "k8sfilteredout",
    "k8struncated",
];

/// A binary-mode message (or a state-topic record) mapped back to structured mode: every
/// header named `prefix` + attribute becomes that attribute (the flag extensions `"true"`
/// become `true`), the `content-type` header becomes `datacontenttype`, and `data` (when
/// there is a body) is the body.
pub fn structured_from_binary<'a>(
    headers: impl IntoIterator<Item = (&'a str, &'a str)>,
    prefix: &str,
    data: Option<Value>,
) -> Value {
    let mut event = json!({});
    if let Some(data) = data {
        event["data"] = data;
    }
    for (name, value) in headers {
        if name.eq_ignore_ascii_case("content-type") {
            event["datacontenttype"] = json!(value);
        } else if let Some(attr) = name.strip_prefix(prefix) {
            event[attr] = if FLAGS.contains(&attr) && value == "true" {
                json!(true)
            } else {
                json!(value)
            };
        }
    }
    event
}

/// Why a message could not be read as an event.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct DecodeError(pub String);

/// How a destination carries its events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// One JSON CloudEvent per message.
    Structured,
    /// Attributes as headers (with this prefix: `ce_` for Kafka, `ce-` for NATS), `data` as
    /// the body.
    Binary(&'static str),
    /// A Kafka state topic: attributes as `ce_` headers, the object alone as the value, no
    /// value for a delete.
    State,
}

impl Layout {
    /// The structured CloudEvent of a message with these headers and body. A message carrying
    /// a structured event is read as one whatever the layout (its content type says so), so
    /// a sink whose encoding changed is still read right.
    pub fn decode<'a>(
        self,
        headers: impl IntoIterator<Item = (&'a str, &'a str)> + Clone,
        body: Option<&[u8]>,
    ) -> Result<Value, DecodeError> {
        let content_type = headers
            .clone()
            .into_iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("content-type"))
            .map(|(_, v)| v);
        let parse = |b: &[u8]| {
            serde_json::from_slice::<Value>(b)
                .map_err(|e| DecodeError(format!("the body is not JSON: {e}")))
        };
        let structured = content_type == Some(crate::message::STRUCTURED_CONTENT_TYPE)
            || (self == Self::Structured && content_type.is_none());
        if structured {
            let event = parse(body.unwrap_or_default())?;
            return if event.is_object() {
                Ok(event)
            } else {
                Err(DecodeError("the body is not a JSON object".into()))
            };
        }
        match self {
            Self::Structured | Self::Binary(_) => {
                let prefix = match self {
                    Self::Binary(p) => p,
                    _ => "ce-",
                };
                let data = body.map(parse).transpose()?;
                Ok(structured_from_binary(headers, prefix, data))
            }
            Self::State => {
                let object = body.filter(|b| !b.is_empty()).map(parse).transpose()?;
                let event =
                    structured_from_binary(headers, "ce_", object.map(|o| json!({ "object": o })));
                Ok(event)
            }
        }
    }
}

/// The attributes of an event that people read and filters test.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    /// `time`.
    pub time: String,
    /// The event type without its prefix: `added`, `updated`, `deleted`, `synced`.
    pub event_type: String,
    /// `k8skind`.
    pub kind: String,
    /// `k8sresource`.
    pub resource: String,
    /// `k8sgroup` (empty for core).
    pub group: String,
    /// `k8snamespace`, empty for cluster-scoped objects.
    pub namespace: String,
    /// `k8sname`.
    pub name: String,
    /// `k8sresourceversion`.
    pub resource_version: String,
    /// What the line adds in brackets: `filtered-out` (`k8sfilteredout`), `truncated`
    /// (`k8struncated`); empty for most events.
    pub notes: Vec<&'static str>,
}

impl Summary {
    /// Reads the attributes of a structured CloudEvent (missing ones are empty).
    pub fn of(event: &Value) -> Self {
        let s = |k: &str| event[k].as_str().unwrap_or_default().to_owned();
        let ty = s("type");
        Self {
            time: s("time"),
            event_type: ty
                .strip_prefix(TYPE_PREFIX)
                .and_then(|t| t.strip_prefix('.'))
                .map_or(ty.clone(), str::to_owned),
            kind: s("k8skind"),
            resource: s("k8sresource"),
            group: s("k8sgroup"),
            namespace: s("k8snamespace"),
            name: s("k8sname"),
            resource_version: s("k8sresourceversion"),
            notes: [
                ("k8sfilteredout", "filtered-out"),
                ("k8struncated", "truncated"),
            ]
            .into_iter()
            .filter(|(flag, _)| event[flag] == true)
            .map(|(_, note)| note)
            .collect(),
        }
    }

    /// `namespace/name`, or `name` for cluster-scoped objects.
    pub fn key(&self) -> String {
        if self.namespace.is_empty() {
            self.name.clone()
        } else {
            format!("{}/{}", self.namespace, self.name)
        }
    }

    /// kubectl's name of the resource: `configmaps`, `widgets.example.com`.
    pub fn resource_name(&self) -> String {
        if self.group.is_empty() {
            self.resource.clone()
        } else {
            format!("{}.{}", self.resource, self.group)
        }
    }
}

/// What `tail` keeps; every set part must match (an empty list matches everything).
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Kinds or resources (`ConfigMap`, `configmaps`, `widgets.example.com`), any case.
    pub kinds: Vec<String>,
    /// Namespaces.
    pub namespaces: Vec<String>,
    /// Event types: `added`, `updated`, `deleted`, `synced`.
    pub types: Vec<String>,
    /// A label selector over `data.object.metadata.labels`.
    pub labels: Option<Selector>,
}

impl Filter {
    /// Whether `event` (with its summary) passes.
    pub fn matches(&self, event: &Value, s: &Summary) -> bool {
        let any = |list: &[String], f: &dyn Fn(&str) -> bool| {
            list.is_empty() || list.iter().any(|x| f(x))
        };
        any(&self.kinds, &|k| {
            k.eq_ignore_ascii_case(&s.kind)
                || k.eq_ignore_ascii_case(&s.resource)
                || k.eq_ignore_ascii_case(&s.resource_name())
        }) && any(&self.namespaces, &|n| n == s.namespace)
            && any(&self.types, &|t| t.eq_ignore_ascii_case(&s.event_type))
            && self.labels.as_ref().is_none_or(|sel| {
                let labels = serde_json::from_value::<BTreeMap<String, String>>(
                    event["data"]["object"]["metadata"]["labels"].clone(),
                )
                .unwrap_or_default();
                sel.matches(&labels)
            })
    }
}

/// The line `tail` prints for people: `time type kind namespace/name rv`, the type colored
/// when `color` is on.
pub fn human_line(s: &Summary, color: bool) -> String {
    let ty = format!("{:<8}", s.event_type);
    let ty = match (color, s.event_type.as_str()) {
        (false, _) => ty,
        (true, "added") => format!("\x1b[32m{ty}\x1b[0m"),
        (true, "updated") => format!("\x1b[33m{ty}\x1b[0m"),
        (true, "deleted") => format!("\x1b[31m{ty}\x1b[0m"),
        (true, _) => format!("\x1b[2m{ty}\x1b[0m"),
    };
    let mut line = format!(
        "{}  {}  {}  {}  {}",
        s.time,
        ty,
        s.kind,
        s.key(),
        s.resource_version
    );
    if !s.notes.is_empty() {
        line += &format!("  [{}]", s.notes.join(", "));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(ty: &str, ns: &str, labels: Value) -> Value {
        json!({
            "type": format!("{TYPE_PREFIX}.{ty}"), "time": "2026-11-23T01:00:00Z",
            "k8skind": "ConfigMap", "k8sresource": "configmaps", "k8sgroup": "",
            "k8snamespace": ns, "k8sname": "a", "k8sresourceversion": "7",
            "data": {"object": {"metadata": {"labels": labels}}},
        })
    }

    #[test]
    fn filters_take_kind_or_resource_namespace_type_and_labels() {
        let e = event("updated", "shop", json!({"team": "shop"}));
        let s = Summary::of(&e);
        assert_eq!(s.event_type, "updated");
        assert_eq!(s.key(), "shop/a");
        let f = |kinds: &[&str], ns: &[&str], types: &[&str], l: Option<&str>| Filter {
            kinds: kinds.iter().map(|s| s.to_string()).collect(),
            namespaces: ns.iter().map(|s| s.to_string()).collect(),
            types: types.iter().map(|s| s.to_string()).collect(),
            labels: l.map(|l| crate::selector::parse(l).unwrap()),
        };
        assert!(f(&[], &[], &[], None).matches(&e, &s));
        assert!(f(&["configmap"], &["shop"], &["updated"], Some("team=shop")).matches(&e, &s));
        assert!(f(&["configmaps"], &[], &[], None).matches(&e, &s));
        assert!(!f(&["Secret"], &[], &[], None).matches(&e, &s));
        assert!(!f(&[], &["other"], &[], None).matches(&e, &s));
        assert!(!f(&[], &[], &["deleted"], None).matches(&e, &s));
        assert!(!f(&[], &[], &[], Some("team=ops")).matches(&e, &s));
    }

    #[test]
    fn binary_and_state_records_map_back_to_structured_events() {
        let headers = [
            ("content-type", "application/json"),
            ("ce_type", "io.github.kube-event-bridge.object.deleted"),
            ("ce_k8sfinalstateunknown", "true"),
            ("ce_k8sfilteredout", "true"),
            ("ce_k8struncated", "true"),
            ("ce_k8sname", "a"),
            ("other", "x"),
        ];
        let e = Layout::Binary("ce_")
            .decode(headers, Some(br#"{"object":{}}"#))
            .unwrap();
        assert_eq!(e["k8sfinalstateunknown"], true);
        assert_eq!(
            e["k8sfilteredout"], true,
            "a flag, as the state fold reads it"
        );
        assert_eq!(
            human_line(&Summary::of(&e), false),
            "  deleted     a    [filtered-out, truncated]"
        );
        assert_eq!(e["datacontenttype"], "application/json");
        assert_eq!(e["data"], json!({"object": {}}));
        assert!(e.get("other").is_none());
        let tombstone = Layout::State.decode(headers, None).unwrap();
        assert!(tombstone.get("data").is_none());
        let state = Layout::State
            .decode(headers, Some(b"{\"kind\":\"X\"}"))
            .unwrap();
        assert_eq!(state["data"]["object"]["kind"], "X");
        let structured = [("content-type", crate::message::STRUCTURED_CONTENT_TYPE)];
        let e = Layout::Binary("ce-")
            .decode(structured, Some(br#"{"id":"1"}"#))
            .unwrap();
        assert_eq!(e["id"], "1");
        assert!(Layout::Structured.decode([], Some(b"[1]")).is_err());
        assert!(Layout::Structured.decode([], Some(b"{")).is_err());
    }

    #[test]
    fn human_lines_carry_time_type_kind_key_and_rv() {
        let s = Summary::of(&event("deleted", "", json!({})));
        assert_eq!(
            human_line(&s, false),
            "2026-11-23T01:00:00Z  deleted   ConfigMap  a  7"
        );
        assert!(human_line(&s, true).contains("\x1b[31m"));
    }
}
