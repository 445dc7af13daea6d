//! Settings of a `nats` sink.

use std::{path::PathBuf, time::Duration};

use serde::{Deserialize, Serialize};

use crate::{
    message::Encoding,
    sinks::{SecretRef, tls::TlsFiles},
};

/// Settings of a `nats` sink.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NatsSinkConfig {
    /// Server URLs (`nats://host:4222`, `tls://host:4222`); several for a cluster. Credentials
    /// in a URL (`nats://user:password@host`, `nats://token@host`) are used when `auth` is
    /// unset (every URL that has some must have the same); logs and errors show such a URL as
    /// `nats://***@host`. Prefer `auth`, whose secrets come from files or the environment.
    pub servers: Vec<String>,
    /// `jetstream`: delivered means the stream stored the message (PubAck), at least once.
    /// `core`: delivered means handed to the connection, at most once.
    #[serde(default)]
    pub mode: NatsMode,
    /// Subject template; placeholder values are escaped into single tokens (see the book's
    /// NATS chapter).
    #[serde(default = "default_subject")]
    pub subject: String,
    /// `structured` (one JSON CloudEvent) or `binary` (`ce-*` headers, data as the body).
    #[serde(default)]
    pub encoding: Encoding,
    /// Most JetStream publishes waiting for their PubAck at once; publishers wait beyond it.
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: usize,
    /// How long to wait for a PubAck before the publish counts as failed (and is retried).
    #[serde(default = "default_ack_timeout", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub ack_timeout: Duration,
    /// How long the first connection may take before start fails.
    #[serde(default = "default_connect_timeout", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub connect_timeout: Duration,
    /// Credentials; at most one method.
    #[serde(default)]
    pub auth: NatsAuthConfig,
    /// TLS settings; a `tls://` server URL or this section turns TLS on.
    #[serde(default)]
    pub tls: Option<TlsFiles>,
    /// The JetStream stream the subjects belong to (required in `jetstream` mode).
    #[serde(default)]
    pub stream: Option<NatsStreamConfig>,
    /// JetStream key-value bucket holding the checkpoints of this sink's routes (see
    /// `sinks[].resume`; `jetstream` mode only): one key per route and object, deleted when
    /// its delete was acknowledged. Created at start when missing (history 1, file storage).
    #[serde(default = "default_checkpoint_bucket")]
    pub checkpoint_bucket: String,
}

/// How a `nats` sink publishes.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum NatsMode {
    /// JetStream publish, acknowledged by the stream.
    #[default]
    Jetstream,
    /// Core NATS publish, not acknowledged.
    Core,
}

/// NATS credentials. Secrets come from files or environment variables, never inline.
#[derive(Debug, Clone, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NatsAuthConfig {
    /// A token.
    #[serde(default)]
    pub token: Option<SecretRef>,
    /// A user name (with `password`).
    #[serde(default)]
    pub user: Option<String>,
    /// The user's password.
    #[serde(default)]
    pub password: Option<SecretRef>,
    /// An NKey seed (`SU…`).
    #[serde(default)]
    pub nkey_seed: Option<SecretRef>,
    /// A `.creds` file (JWT and NKey seed).
    #[serde(default)]
    pub credentials_file: Option<PathBuf>,
}

/// The JetStream stream a sink publishes into.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NatsStreamConfig {
    /// Stream name. At start the stream must exist (or be created) and cover the subjects.
    pub name: String,
    /// Create the stream, or update its settings, at start.
    #[serde(default)]
    pub create: bool,
    /// Subjects of a created stream; unset means the subject template with each placeholder
    /// token as `*`.
    #[serde(default)]
    pub subjects: Vec<String>,
    /// Retention of a created stream: `limits`, `interest` or `workqueue`.
    #[serde(default)]
    pub retention: StreamRetention,
    /// Storage of a created stream: `file` or `memory`.
    #[serde(default)]
    pub storage: StreamStorage,
    /// Oldest message a created stream keeps; 0 means no limit.
    #[serde(default, with = "humantime_serde")]
    #[schemars(with = "String")]
    pub max_age: Duration,
    /// Most bytes a created stream keeps; unset means no limit.
    #[serde(default)]
    pub max_bytes: Option<i64>,
    /// Replicas of a created stream.
    #[serde(default = "default_replicas")]
    pub replicas: usize,
    /// Window in which the server drops a message whose `Nats-Msg-Id` it has seen.
    #[serde(default = "default_duplicate_window", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub duplicate_window: Duration,
}

/// JetStream retention policies.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum StreamRetention {
    /// Keep messages up to the limits.
    #[default]
    Limits,
    /// Keep messages while a consumer is interested.
    Interest,
    /// Keep each message until one consumer acknowledges it.
    Workqueue,
}

/// JetStream storage types.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum StreamStorage {
    /// On disk.
    #[default]
    File,
    /// In memory.
    Memory,
}

fn default_checkpoint_bucket() -> String {
    "kube-event-bridge-checkpoints".into()
}
fn default_subject() -> String {
    "k8s.{cluster}.{group}.{kind}.{namespace}.{name}".into()
}
// async-nats' default window is 5000 acks; 1024 bounds memory at a few MB of 1 KB messages.
fn default_max_in_flight() -> usize {
    1024
}
fn default_ack_timeout() -> Duration {
    Duration::from_secs(5)
}
fn default_connect_timeout() -> Duration {
    Duration::from_secs(10)
}
fn default_replicas() -> usize {
    1
}
// nats-server's default duplicate window.
fn default_duplicate_window() -> Duration {
    Duration::from_secs(120)
}

impl NatsSinkConfig {
    /// The server URLs as logs and errors show them: credentials in a URL
    /// (`nats://user:password@host`, `nats://token@host`) become `***`.
    pub fn servers_for_logs(&self) -> String {
        self.servers_redacted().join(",")
    }

    /// Each server URL with its credentials, if any, as `***`.
    pub fn servers_redacted(&self) -> Vec<String> {
        self.servers
            .iter()
            .map(|url| redact_userinfo(url))
            .collect()
    }

    /// The server URLs to connect to, without their credentials (async-nats does not read
    /// them from a URL: see [`url_credentials`](Self::url_credentials)).
    pub fn servers_to_connect(&self) -> String {
        self.servers
            .iter()
            .map(|url| split_userinfo(url).1)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The credentials written in the server URLs, if any: `(user, Some(password))` or
    /// `(token, None)`, percent-decoded. `Err` when two URLs carry different ones.
    pub fn url_credentials(&self) -> Result<Option<(String, Option<String>)>, String> {
        let mut found: Option<(String, Option<String>)> = None;
        for url in &self.servers {
            let Some(info) = split_userinfo(url).0 else {
                continue;
            };
            let creds = match info.split_once(':') {
                Some((user, password)) => (percent_decode(user), Some(percent_decode(password))),
                None => (percent_decode(&info), None),
            };
            match &found {
                Some(f) if *f != creds => {
                    return Err("the server URLs carry different credentials".into());
                }
                _ => found = Some(creds),
            }
        }
        Ok(found)
    }

    /// Field checks; each error is `(path below the sink, reason)`.
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut errors = Vec::new();
        if self.checkpoint_bucket.is_empty()
            || !self
                .checkpoint_bucket
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'))
        {
            errors.push((
                "checkpoint_bucket".to_owned(),
                format!(
                    "{:?} is not a valid bucket name (letters, digits, `-`, `_`)",
                    self.checkpoint_bucket
                ),
            ));
        }
        let mut err = |path: &str, reason: String| errors.push((path.to_owned(), reason));
        if self.servers.is_empty() {
            err("servers", "at least one server URL is required".into());
        }
        match crate::sinks::template::Template::parse(&self.subject) {
            Err(e) => err("subject", e.to_string()),
            Ok(t) => {
                let wildcard = crate::sinks::template::nats_wildcard(&t);
                if !crate::sinks::template::is_valid_nats_subject(&wildcard.replace('*', "x")) {
                    err(
                        "subject",
                        format!(
                            "{:?} does not make valid subjects (tokens separated by `.`)",
                            self.subject
                        ),
                    );
                }
            }
        }
        if self.max_in_flight == 0 {
            err("max_in_flight", "must be at least 1".into());
        }
        if self.mode == NatsMode::Jetstream && self.stream.is_none() {
            err(
                "stream",
                "jetstream mode needs the stream (at least `stream.name`)".into(),
            );
        }
        if let Some(s) = &self.stream {
            if s.name.is_empty() || s.name.contains(['.', ' ', '*', '>']) {
                err("stream.name", format!("{:?} is not a stream name", s.name));
            }
            if s.replicas == 0 {
                err("stream.replicas", "must be at least 1".into());
            }
        }
        let a = &self.auth;
        let methods = [
            a.token.is_some(),
            a.user.is_some(),
            a.nkey_seed.is_some(),
            a.credentials_file.is_some(),
        ];
        match self.url_credentials() {
            Err(reason) => err("servers", reason),
            Ok(Some(_)) if methods.iter().any(|m| *m) => err(
                "servers",
                "credentials in a server URL and in `auth` both: give them once (in `auth`)".into(),
            ),
            Ok(_) => {}
        }
        if methods.iter().filter(|m| **m).count() > 1 {
            err(
                "auth",
                "choose one of token, user/password, nkey_seed, credentials_file".into(),
            );
        }
        if a.user.is_some() != a.password.is_some() {
            err("auth", "user and password go together".into());
        }
        for (name, secret) in [
            ("auth.token", &a.token),
            ("auth.password", &a.password),
            ("auth.nkey_seed", &a.nkey_seed),
        ] {
            if let Some(reason) = secret.as_ref().and_then(SecretRef::problem) {
                err(name, reason);
            }
        }
        if let Some(reason) = self.tls.as_ref().and_then(TlsFiles::problem) {
            err("tls", reason);
        }
        errors
    }
}

/// `text` with the credentials of every URL in it (`scheme://…@`) as `***`: for messages
/// that may quote a setting's value (a config error).
pub fn scrub_url_credentials(text: &str) -> String {
    // Everything from a `://` to the last `@` before the next URL is user info: a password may
    // hold spaces or quotes (quoted Debug-escaped by serde), so the URL's end cannot be
    // guessed; redacting too much of a message is harmless, too little is not.
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (head, tail) = rest.split_at(at + 3);
        out.push_str(head);
        let next = tail.find("://").unwrap_or(tail.len());
        match tail[..next].rfind('@') {
            Some(i) => {
                out.push_str("***");
                rest = &tail[i..];
            }
            None => rest = tail,
        }
    }
    out.push_str(rest);
    out
}

/// `scheme://user:password@host:port` → `scheme://***@host:port`; a URL without credentials
/// is returned unchanged.
fn redact_userinfo(url: &str) -> String {
    match split_userinfo(url) {
        (Some(_), bare) => match bare.split_once("://") {
            Some((scheme, rest)) => format!("{scheme}://***@{rest}"),
            None => format!("***@{bare}"),
        },
        (None, _) => url.to_owned(),
    }
}

/// A URL's user info (`user:password`, `token`) and the URL without it. The last `@` ends the
/// user info, wherever it is: a password written without percent-encoding may hold `/`, `?`
/// or `#`, and a NATS server URL has no path that could hold an `@` (so a URL is never shown
/// with its credentials because they were not recognized as such).
fn split_userinfo(url: &str) -> (Option<String>, String) {
    let (scheme, rest) = match url.split_once("://") {
        Some((s, r)) => (format!("{s}://"), r),
        None => (String::new(), url),
    };
    match rest.rfind('@') {
        Some(at) => (
            Some(rest[..at].to_owned()),
            format!("{scheme}{}", &rest[at + 1..]),
        ),
        None => (None, url.to_owned()),
    }
}

/// `%40` → `@`: user info is percent-encoded in a URL.
fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_in_server_urls_never_reach_logs() {
        assert_eq!(
            redact_userinfo("nats://bridge:s3cret@nats-0:4222"),
            "nats://***@nats-0:4222"
        );
        assert_eq!(
            redact_userinfo("tls://tok3n@nats:4222"),
            "tls://***@nats:4222"
        );
        assert_eq!(
            redact_userinfo("nats://u:pa#s/s?@nats:4222"),
            "nats://***@nats:4222"
        );
        assert_eq!(redact_userinfo("u:p@host:4222"), "***@host:4222");
        assert_eq!(redact_userinfo("nats://host:4222"), "nats://host:4222");
    }

    #[test]
    fn messages_quoting_a_url_lose_its_credentials() {
        assert_eq!(
            scrub_url_credentials(
                "invalid type: string \"nats://u:p@h:4222\", expected a sequence"
            ),
            "invalid type: string \"nats://***@h:4222\", expected a sequence"
        );
        assert_eq!(
            scrub_url_credentials("at nats://h:1, tls://t@h:2"),
            "at nats://h:1, tls://***@h:2"
        );
        // A password with a space or a quote (Debug-escaped) loses all of itself.
        assert_eq!(
            scrub_url_credentials(r#"string "nats://u:pa ss\"x@h:4222", expected"#),
            r#"string "nats://***@h:4222", expected"#
        );
    }

    #[test]
    fn credentials_in_server_urls_are_read_once() {
        let cfg = |servers: &[&str]| NatsSinkConfig {
            servers: servers.iter().map(|s| s.to_string()).collect(),
            ..serde_json::from_value(serde_json::json!({"servers": ["x"], "mode": "core"})).unwrap()
        };
        let c = cfg(&["nats://bridge:p%40ss@a:4222", "nats://b:4222"]);
        assert_eq!(
            c.url_credentials(),
            Ok(Some(("bridge".into(), Some("p@ss".into()))))
        );
        assert_eq!(c.servers_to_connect(), "nats://a:4222,nats://b:4222");
        assert_eq!(
            cfg(&["nats://t0ken@a:4222"]).url_credentials(),
            Ok(Some(("t0ken".into(), None)))
        );
        assert!(
            cfg(&["nats://a:1@h", "nats://b:2@h"])
                .url_credentials()
                .is_err()
        );
        assert_eq!(cfg(&["nats://h"]).url_credentials(), Ok(None));
    }
}
