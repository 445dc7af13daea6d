//! Topic, subject and key templates: literal text with `{placeholder}`s filled from a message.
//!
//! Placeholders: `{cluster}` `{group}` `{version}` `{kind}` `{resource}` `{namespace}` `{name}`
//! `{type}`. Each sink decides how a value is made safe for its destination (see
//! [`escape_nats_token`]) and how an empty group or namespace is written.

use crate::message::Message;

/// Errors parsing a template.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// `{something}` that is not a placeholder.
    #[error(
        "unknown placeholder {{{0}}} (known: {{cluster}} {{group}} {{version}} {{kind}} {{resource}} {{namespace}} {{name}} {{type}})"
    )]
    UnknownPlaceholder(String),
    /// A `{` without its `}`.
    #[error("unclosed `{{` at byte {0}")]
    Unclosed(usize),
    /// A placeholder the sink does not allow here.
    #[error("placeholder {{{0}}} is not allowed here")]
    NotAllowed(&'static str),
}

/// The values a template can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// The cluster name.
    Cluster,
    /// API group, empty for core.
    Group,
    /// API version.
    Version,
    /// Kind.
    Kind,
    /// Plural resource name.
    Resource,
    /// Namespace, empty for cluster-scoped objects.
    Namespace,
    /// Object name.
    Name,
    /// Event type (`added`, `updated`, `deleted`, `synced`).
    Type,
}

impl Field {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "cluster" => Self::Cluster,
            "group" => Self::Group,
            "version" => Self::Version,
            "kind" => Self::Kind,
            "resource" => Self::Resource,
            "namespace" => Self::Namespace,
            "name" => Self::Name,
            "type" => Self::Type,
            _ => return None,
        })
    }

    /// The placeholder's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cluster => "cluster",
            Self::Group => "group",
            Self::Version => "version",
            Self::Kind => "kind",
            Self::Resource => "resource",
            Self::Namespace => "namespace",
            Self::Name => "name",
            Self::Type => "type",
        }
    }

    /// The field's value in `m` (possibly empty).
    pub fn value(self, m: &Message) -> &str {
        match self {
            Self::Cluster => &m.resource.cluster,
            Self::Group => &m.resource.group,
            Self::Version => &m.resource.version,
            Self::Kind => &m.resource.kind,
            Self::Resource => &m.resource.plural,
            Self::Namespace => m.namespace.as_deref().unwrap_or(""),
            Self::Name => &m.name,
            Self::Type => m.event_type.as_str(),
        }
    }
}

/// A piece of a template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// Text copied as is.
    Literal(String),
    /// A value from the message.
    Placeholder(Field),
}

/// A parsed template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    segments: Vec<Segment>,
}

impl Template {
    /// Parses `{placeholder}`s out of `text`.
    pub fn parse(text: &str) -> Result<Self, Error> {
        let mut segments = Vec::new();
        let mut rest = text;
        let mut offset = 0;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                segments.push(Segment::Literal(rest[..open].to_owned()));
            }
            let close = rest[open..]
                .find('}')
                .ok_or(Error::Unclosed(offset + open))?
                + open;
            let name = &rest[open + 1..close];
            let field =
                Field::parse(name).ok_or_else(|| Error::UnknownPlaceholder(name.to_owned()))?;
            segments.push(Segment::Placeholder(field));
            offset += close + 1;
            rest = &rest[close + 1..];
        }
        if !rest.is_empty() {
            segments.push(Segment::Literal(rest.to_owned()));
        }
        Ok(Self { segments })
    }

    /// The segments, in order.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// The template with every `field` placeholder replaced by the text `value` (what a
    /// reader knows for certain, such as the config's cluster name).
    pub fn with_value(&self, field: Field, value: &str) -> Self {
        let segments = self
            .segments
            .iter()
            .map(|s| match s {
                Segment::Placeholder(f) if *f == field => Segment::Literal(value.to_owned()),
                other => other.clone(),
            })
            .collect();
        Self { segments }
    }

    /// Fails if the template uses one of `fields`.
    pub fn forbid(&self, fields: &[Field]) -> Result<(), Error> {
        match self.segments.iter().find_map(|s| match s {
            Segment::Placeholder(f) if fields.contains(f) => Some(*f),
            _ => None,
        }) {
            Some(f) => Err(Error::NotAllowed(f.name())),
            None => Ok(()),
        }
    }

    /// Renders with every value passed through `escape(field, value)`.
    pub fn render(&self, m: &Message, mut escape: impl FnMut(Field, &str, &mut String)) -> String {
        let mut out = String::with_capacity(64);
        for s in &self.segments {
            match s {
                Segment::Literal(l) => out.push_str(l),
                Segment::Placeholder(f) => escape(*f, f.value(m), &mut out),
            }
        }
        out
    }
}

/// Token written for an empty API group (the core group) in NATS subjects.
pub const NATS_CORE_GROUP: &str = "core";
/// Token written for the namespace of a cluster-scoped object in NATS subjects.
pub const NATS_NO_NAMESPACE: &str = "_";

/// Makes `value` one valid NATS subject token, reversibly ([`unescape_nats_token`]):
/// `%`, `.`, `*`, `>`, whitespace and control characters become `%XX` (the byte in upper-case
/// hex); everything else is kept. An empty group becomes [`NATS_CORE_GROUP`] and an empty
/// namespace [`NATS_NO_NAMESPACE`]; neither can collide with a real value, as Kubernetes
/// namespaces cannot contain `_` and built-in or custom API groups are never `core`.
pub fn escape_nats_token(field: Field, value: &str, out: &mut String) {
    if value.is_empty() {
        out.push_str(match field {
            Field::Group => NATS_CORE_GROUP,
            _ => NATS_NO_NAMESPACE,
        });
        return;
    }
    for c in value.chars() {
        if matches!(c, '%' | '.' | '*' | '>') || c.is_whitespace() || c.is_control() {
            let mut buf = [0u8; 4];
            for b in c.encode_utf8(&mut buf).bytes() {
                out.push_str(&format!("%{b:02X}"));
            }
        } else {
            out.push(c);
        }
    }
}

/// Reverses [`escape_nats_token`] for a token of `field`.
pub fn unescape_nats_token(field: Field, token: &str) -> Option<String> {
    match (field, token) {
        (Field::Group, NATS_CORE_GROUP) => return Some(String::new()),
        (Field::Namespace, NATS_NO_NAMESPACE) => return Some(String::new()),
        _ => {}
    }
    let bytes = token.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = token.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Whether `subject` is a valid NATS subject to publish to: non-empty tokens separated by
/// `.`, no wildcards, no whitespace or control characters.
pub fn is_valid_nats_subject(subject: &str) -> bool {
    !subject.is_empty()
        && subject.split('.').all(|t| {
            !t.is_empty()
                && !t
                    .chars()
                    .any(|c| matches!(c, '*' | '>') || c.is_whitespace() || c.is_control())
        })
}

/// The subject filter that covers every subject `template` can produce: each token that holds
/// a placeholder becomes `*` (escaping keeps every value inside its token).
pub fn nats_wildcard(template: &Template) -> String {
    let mut tokens: Vec<String> = vec![String::new()];
    let mut wild = vec![false];
    for s in template.segments() {
        match s {
            Segment::Literal(l) => {
                let mut parts = l.split('.');
                tokens
                    .last_mut()
                    .expect("one token")
                    .push_str(parts.next().unwrap_or_default());
                for p in parts {
                    tokens.push(p.to_owned());
                    wild.push(false);
                }
            }
            Segment::Placeholder(_) => *wild.last_mut().expect("one token") = true,
        }
    }
    tokens
        .iter()
        .zip(wild)
        .map(|(t, w)| if w { "*" } else { t.as_str() })
        .collect::<Vec<_>>()
        .join(".")
}

/// Whether the stream subject filter `filter` matches every subject the filter `pattern`
/// matches (`*` one token, `>` one or more trailing tokens).
pub fn nats_filter_covers(filter: &str, pattern: &str) -> bool {
    let f: Vec<&str> = filter.split('.').collect();
    let p: Vec<&str> = pattern.split('.').collect();
    for (i, ft) in f.iter().enumerate() {
        if *ft == ">" {
            return p.len() > i;
        }
        let Some(pt) = p.get(i) else { return false };
        if *pt == ">" {
            return false;
        }
        if *ft != "*" && ft != pt {
            return false;
        }
    }
    f.len() == p.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_literals_and_placeholders() {
        let t = Template::parse("k8s.{cluster}.{group}-{kind}").unwrap();
        assert_eq!(
            t.segments(),
            [
                Segment::Literal("k8s.".into()),
                Segment::Placeholder(Field::Cluster),
                Segment::Literal(".".into()),
                Segment::Placeholder(Field::Group),
                Segment::Literal("-".into()),
                Segment::Placeholder(Field::Kind),
            ]
        );
        assert_eq!(
            Template::parse("a.{nope}").unwrap_err(),
            Error::UnknownPlaceholder("nope".into())
        );
        assert_eq!(Template::parse("a.{name").unwrap_err(), Error::Unclosed(2));
        assert_eq!(
            Template::parse("x.{name}")
                .unwrap()
                .forbid(&[Field::Name])
                .unwrap_err(),
            Error::NotAllowed("name")
        );
    }

    #[test]
    fn nats_escaping_round_trips_and_yields_one_token() {
        let cases = [
            (Field::Name, "my.app.v2", "my%2Eapp%2Ev2"),
            (Field::Name, "100%", "100%25"),
            (Field::Name, "a b*c>d", "a%20b%2Ac%3Ed"),
            (Field::Group, "networking.k8s.io", "networking%2Ek8s%2Eio"),
            (Field::Group, "", "core"),
            (Field::Namespace, "", "_"),
            (Field::Name, "plain-name", "plain-name"),
        ];
        for (field, value, token) in cases {
            let mut out = String::new();
            escape_nats_token(field, value, &mut out);
            assert_eq!(out, token);
            assert!(is_valid_nats_subject(&out) && !out.contains('.'), "{out}");
            assert_eq!(unescape_nats_token(field, &out).as_deref(), Some(value));
        }
    }

    #[test]
    fn wildcard_form_and_coverage() {
        let t = Template::parse("k8s.{cluster}.{group}.{kind}.{namespace}.{name}").unwrap();
        assert_eq!(nats_wildcard(&t), "k8s.*.*.*.*.*");
        assert_eq!(
            nats_wildcard(&Template::parse("events.{kind}-x.fixed").unwrap()),
            "events.*.fixed"
        );
        assert!(nats_filter_covers("k8s.>", "k8s.*.*.*.*.*"));
        assert!(nats_filter_covers("k8s.*.*.*.*.*", "k8s.*.*.*.*.*"));
        assert!(nats_filter_covers("k8s.prod.>", "k8s.prod.*"));
        assert!(
            !nats_filter_covers("k8s.prod.>", "k8s.*.*"),
            "a literal does not cover a wildcard"
        );
        assert!(!nats_filter_covers("k8s.*", "k8s.*.*"));
        assert!(!nats_filter_covers("other.>", "k8s.*"));
        assert!(nats_filter_covers(">", "k8s.*"));
    }
}
