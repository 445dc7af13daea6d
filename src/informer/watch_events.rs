//! A watch response, line by line, as kube's `WatchEvent`s whose objects are already in their
//! cached form: each line's `object` goes from the response's bytes through
//! [`Transform::cache`] (no `DynamicObject` tree), as list items do: the two are cached by
//! one writer, from the server's bytes (a list item of a built-in kind, which comes without
//! its types, gets them first; a watched object keeps the server's order).
//!
//! The rules are kube's `Client::request_events`: a line that is not an event but a `Status`
//! is that API error; a truncated last line is dropped; a stream that ends with an unexpected
//! EOF (the server or a proxy cut it) ends quietly, so the watch is started again from its
//! last resourceVersion; any other read error (a stall's read timeout included) and a line
//! that is not UTF-8 are one `ReadEvents` error, and the stream ends there too (as kube's
//! line reader does). A line that does not decode is an error that names why (kube reports an
//! empty `Status`), counted and logged, and the watch goes on (garbage is no reason to
//! relist; the event it held is lost until the next list). Lines are read into one buffer,
//! reused.
//!
//! An object that cannot be peeked at for its namespace (a field given twice) is cached
//! first, by the parsed path, and judged by its cached namespace: nothing is skipped unread.
//!
//! With a shard the server does not select, an object of another shard is not cached at all:
//! its line becomes a bookmark at its resourceVersion, which moves the watch on exactly as the
//! skipped event would have.

use std::{borrow::Cow, io, sync::Arc};

use futures::{AsyncBufRead, AsyncBufReadExt, StreamExt, stream::BoxStream};
use kube::core::{
    Status, TypeMeta, WatchEvent,
    watch::{Bookmark, BookmarkMeta},
};
use serde_json::value::RawValue;

use super::{ObjectRef, transform::Transform};
use crate::shard::Shard;

/// Watch events with cached objects.
pub type Events = BoxStream<'static, kube::Result<WatchEvent<ObjectRef>>>;

/// The events of a watch response's `body`; objects rewritten by `transform`, those outside
/// `shard` (if any) skipped.
pub fn events(
    body: impl AsyncBufRead + Send + Unpin + 'static,
    transform: Transform,
    shard: Option<Shard>,
) -> Events {
    let reader = Reader {
        body,
        line: Vec::new(),
        transform,
        shard,
        failed: false,
    };
    futures::stream::unfold(reader, |mut r| async move {
        let event = r.next().await?;
        Some((event, r))
    })
    .boxed()
}

/// The state of [`events`], kept across polls by the stream.
struct Reader<R> {
    body: R,
    line: Vec<u8>,
    transform: Transform,
    shard: Option<Shard>,
    failed: bool,
}

impl<R: AsyncBufRead + Unpin> Reader<R> {
    async fn next(&mut self) -> Option<kube::Result<WatchEvent<ObjectRef>>> {
        while !self.failed {
            // `line` is cleared once a line is handled, not before a read: the bytes of a
            // read dropped half-way stay, and the next read completes the line.
            let read = self.body.read_until(b'\n', &mut self.line).await;
            let error = match read {
                Ok(0) if self.line.is_empty() => return None,
                Ok(_) => {
                    let event = match std::str::from_utf8(self.line.trim_ascii_end()) {
                        Ok("") => None,
                        Ok(line) => decode(line, &self.transform, self.shard.as_ref()),
                        Err(e) => {
                            self.failed = true;
                            let e = io::Error::new(io::ErrorKind::InvalidData, e);
                            Some(Err(kube::Error::ReadEvents(e)))
                        }
                    };
                    self.line.clear();
                    match event {
                        Some(event) => return Some(event),
                        None => continue,
                    }
                }
                Err(e) => e,
            };
            self.failed = true;
            if ended(&error) {
                tracing::debug!(%error, "Watch stream cut; it is started again");
                return None;
            }
            return Some(Err(kube::Error::ReadEvents(error)));
        }
        None
    }
}

/// Whether a read error is the stream's end: an unexpected EOF anywhere in its chain, or
/// hyper's "unexpected EOF during chunk" (kube's rule).
fn ended(err: &std::io::Error) -> bool {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(err);
    // Bounded, should a `source` ever cycle.
    for _ in 0..16 {
        let Some(e) = next else { break };
        next = e.source();
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::UnexpectedEof {
                return true;
            }
            // An io::Error's `source` skips the error it wraps.
            if let Some(inner) = io.get_ref() {
                next = Some(inner);
            }
        }
    }
    err.to_string().contains("unexpected EOF during chunk")
}

#[derive(serde::Deserialize)]
struct Line<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(borrow)]
    object: &'a RawValue,
}

/// One line of the response; `None` for nothing to hand on.
fn decode(
    line: &str,
    transform: &Transform,
    shard: Option<&Shard>,
) -> Option<kube::Result<WatchEvent<ObjectRef>>> {
    let Line { kind, object } = match serde_json::from_str::<Line>(line) {
        Ok(line) => line,
        // A last line cut short.
        Err(e) if e.is_eof() => return None,
        Err(e) => {
            return Some(Err(match serde_json::from_str::<Status>(line) {
                Ok(status) => kube::Error::Api(status.boxed()),
                Err(_) => kube::Error::SerdeError(e),
            }));
        }
    };
    let object = object.get();
    let event = match &*kind {
        "ADDED" | "MODIFIED" | "DELETED" => {
            let other_shard = |namespace: Option<&str>| {
                shard.is_some_and(|s| !s.holds_namespace(namespace.unwrap_or("")))
            };
            // Read before caching (only where a shard may skip it: the peek is a pass over
            // the object); one that cannot be peeked at is cached first (the parsed path
            // decides it), then judged by its cached namespace.
            if shard.is_some()
                && let Some(p) = peek(object)
                && other_shard(p.namespace.as_deref())
            {
                return skipped(p.resource_version.as_deref());
            }
            let obj = match transform.cache(object) {
                Ok(obj) => obj,
                Err(e) => return Some(Err(kube::Error::SerdeError(e))),
            };
            if other_shard(obj.namespace()) {
                return skipped(obj.resource_version());
            }
            let obj = Arc::new(obj);
            Ok(match &*kind {
                "ADDED" => WatchEvent::Added(obj),
                "MODIFIED" => WatchEvent::Modified(obj),
                _ => WatchEvent::Deleted(obj),
            })
        }
        "BOOKMARK" => serde_json::from_str(object).map(WatchEvent::Bookmark),
        "ERROR" => serde_json::from_str::<Status>(object).map(|s| WatchEvent::Error(s.boxed())),
        other => Err(serde::de::Error::custom(format!(
            "unknown watch event type `{other}`"
        ))),
    };
    Some(event.map_err(kube::Error::SerdeError))
}

/// What an event of another shard becomes: a bookmark at its resourceVersion, which moves
/// the watch as the event would have; nothing without one.
fn skipped(rv: Option<&str>) -> Option<kube::Result<WatchEvent<ObjectRef>>> {
    let rv = rv.filter(|rv| !rv.is_empty())?;
    Some(Ok(WatchEvent::Bookmark(Bookmark {
        types: TypeMeta::default(),
        metadata: BookmarkMeta {
            resource_version: rv.to_owned(),
            annotations: Default::default(),
        },
    })))
}

/// What [`peek`] reads of an object.
pub struct Peeked<'a> {
    /// `metadata.namespace`.
    pub namespace: Option<Cow<'a, str>>,
    /// `metadata.resourceVersion`, if a string.
    pub resource_version: Option<Cow<'a, str>>,
}

/// An object's `metadata.namespace` and `resourceVersion`, read from its JSON without caching
/// it (`None` inside for a field absent or, for the resourceVersion, not a string); `None`
/// where the object cannot be read so (a duplicate field, `metadata` not an object).
pub fn peek(json: &str) -> Option<Peeked<'_>> {
    #[derive(serde::Deserialize)]
    struct Item<'a> {
        #[serde(borrow)]
        metadata: Meta<'a>,
    }
    #[derive(serde::Deserialize)]
    struct Meta<'a> {
        #[serde(borrow, default)]
        namespace: Option<Cow<'a, str>>,
        // Read on its own: one that is not a string leaves the namespace readable.
        #[serde(borrow, default, rename = "resourceVersion")]
        resource_version: Option<&'a RawValue>,
    }
    let m = serde_json::from_str::<Item>(json).ok()?.metadata;
    let rv = m
        .resource_version
        .and_then(|rv| serde_json::from_str(rv.get()).ok());
    Some(Peeked {
        namespace: m.namespace,
        resource_version: rv,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::informer::{ObjectMetaRef, testing::transform};

    fn configmaps() -> Transform {
        transform("ConfigMap", false)
    }

    const OBJECT: &str = r#"{"metadata":{"name":"a","namespace":"ns","resourceVersion":"7","managedFields":[{}]},"data":{"k":"v"}}"#;

    fn decoded(line: &str, shard: Option<&Shard>) -> Option<kube::Result<WatchEvent<ObjectRef>>> {
        decode(line, &configmaps(), shard)
    }

    #[test]
    fn events_come_cached_whatever_the_order_of_a_lines_members() {
        for line in [
            format!(r#"{{"type":"MODIFIED","object":{OBJECT}}}"#),
            format!(r#"{{"object":{OBJECT},"type":"MODIFIED"}}"#),
        ] {
            let Some(Ok(WatchEvent::Modified(obj))) = decoded(&line, None) else {
                panic!("{line}");
            };
            // What a list would have cached from the same object.
            assert_eq!(
                obj.json().get(),
                configmaps().cache(OBJECT).unwrap().json().get()
            );
            assert!(!obj.json().get().contains("managedFields"));
            assert_eq!(obj.resource_version(), Some("7"));
        }
        let added = format!(r#"{{"type":"ADDED","object":{OBJECT}}}"#);
        assert!(matches!(
            decoded(&added, None),
            Some(Ok(WatchEvent::Added(_)))
        ));
        let deleted = format!(r#"{{"type":"DELETED","object":{OBJECT}}}"#);
        assert!(matches!(
            decoded(&deleted, None),
            Some(Ok(WatchEvent::Deleted(_)))
        ));
    }

    #[test]
    fn bookmarks_errors_and_bad_lines_are_events_or_errors_that_say_why() {
        let bookmark = r#"{"type":"BOOKMARK","object":{"kind":"ConfigMap","apiVersion":"v1","metadata":{"resourceVersion":"9","annotations":{"k8s.io/initial-events-end":"true"}}}}"#;
        let Some(Ok(WatchEvent::Bookmark(bm))) = decoded(bookmark, None) else {
            panic!("a bookmark");
        };
        assert_eq!(bm.metadata.resource_version, "9");
        assert!(
            bm.metadata
                .annotations
                .contains_key("k8s.io/initial-events-end")
        );
        let gone = r#"{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","status":"Failure","message":"too old resource version","reason":"Expired","code":410}}"#;
        let Some(Ok(WatchEvent::Error(status))) = decoded(gone, None) else {
            panic!("an error event");
        };
        assert_eq!(status.code, 410);
        // A Status instead of an event is that API error.
        let status = r#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"forbidden","reason":"Forbidden","code":403}"#;
        assert!(matches!(decoded(status, None), Some(Err(kube::Error::Api(s))) if s.code == 403));
        // A last line cut short is dropped; garbage and unknown types are errors that say so.
        assert!(decoded(r#"{"type":"ADDED","object":{"metad"#, None).is_none());
        assert!(matches!(
            decoded("not json", None),
            Some(Err(kube::Error::SerdeError(_)))
        ));
        let unknown = format!(r#"{{"type":"RENAMED","object":{OBJECT}}}"#);
        let Some(Err(kube::Error::SerdeError(e))) = decoded(&unknown, None) else {
            panic!("an unknown type");
        };
        assert!(e.to_string().contains("RENAMED"), "{e}");
    }

    #[test]
    fn an_event_of_another_shard_moves_the_watch_without_being_cached() {
        let shards = [Shard { index: 0, count: 2 }, Shard { index: 1, count: 2 }];
        let line = format!(r#"{{"type":"MODIFIED","object":{OBJECT}}}"#);
        let (held, other) = if shards[0].holds_namespace("ns") {
            (shards[0], shards[1])
        } else {
            (shards[1], shards[0])
        };
        assert!(matches!(
            decoded(&line, Some(&held)),
            Some(Ok(WatchEvent::Modified(_)))
        ));
        let Some(Ok(WatchEvent::Bookmark(bm))) = decoded(&line, Some(&other)) else {
            panic!("a bookmark for the other shard");
        };
        assert_eq!(bm.metadata.resource_version, "7");
        assert!(bm.metadata.annotations.is_empty());
        // Without a resourceVersion (or an empty one) there is nothing to move to.
        let bare = r#"{"type":"ADDED","object":{"metadata":{"name":"a","namespace":"ns"}}}"#;
        assert!(decoded(bare, Some(&other)).is_none());
        let empty =
            r#"{"type":"ADDED","object":{"metadata":{"namespace":"ns","resourceVersion":""}}}"#;
        assert!(decoded(empty, Some(&other)).is_none());
        // An object that cannot be peeked at (its namespace given twice) is cached, then
        // judged by its cached namespace (the last one, as ObjectMeta reads it).
        let twice = r#"{"type":"ADDED","object":{"metadata":{"name":"a","namespace":"x","namespace":"ns","resourceVersion":"8"}}}"#;
        let Some(Ok(WatchEvent::Bookmark(bm))) = decoded(twice, Some(&other)) else {
            panic!("a bookmark for the other shard");
        };
        assert_eq!(bm.metadata.resource_version, "8");
        let Some(Ok(WatchEvent::Added(obj))) = decoded(twice, Some(&held)) else {
            panic!("an add for its shard");
        };
        assert_eq!(obj.namespace(), Some("ns"));
        // A resourceVersion that is not a string leaves the namespace readable.
        let odd =
            r#"{"type":"ADDED","object":{"metadata":{"namespace":"ns","resourceVersion":5}}}"#;
        assert!(decoded(odd, Some(&other)).is_none());
    }

    /// The events of a body of `chunks`, read as the client reads a response.
    async fn read(
        chunks: Vec<io::Result<&'static [u8]>>,
    ) -> Vec<kube::Result<WatchEvent<ObjectRef>>> {
        use futures::TryStreamExt;
        let body = futures::stream::iter(chunks).into_async_read();
        events(body, configmaps(), None).collect().await
    }

    fn line(kind: &str) -> &'static [u8] {
        format!("{{\"type\":\"{kind}\",\"object\":{OBJECT}}}\n")
            .leak()
            .as_bytes()
    }

    /// An error as hyper's body hands it through kube's client: wrapped twice.
    fn body_error(kind: io::ErrorKind) -> io::Error {
        io::Error::other(kube::Error::Service(Box::new(io::Error::new(kind, "read"))))
    }

    #[tokio::test]
    async fn a_stream_reads_lines_across_chunks_and_skips_blank_ones() {
        let added = line("ADDED");
        let status = br#"{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Expired","code":410}"#;
        let got = read(vec![
            Ok(&added[..10]),
            Ok(&added[10..]),
            Ok(b"\r\n\n"),
            Ok(status),
            Ok(b"\r\n"),
            Ok(line("DELETED")),
            // The last line cut short: dropped.
            Ok(br#"{"type":"ADDED","obj"#),
        ])
        .await;
        assert_eq!(got.len(), 3, "{got:?}");
        assert!(matches!(&got[0], Ok(WatchEvent::Added(_))));
        assert!(matches!(&got[1], Err(kube::Error::Api(s)) if s.code == 410));
        assert!(matches!(&got[2], Ok(WatchEvent::Deleted(_))));
    }

    #[tokio::test]
    async fn a_cut_ends_the_stream_quietly_and_other_read_errors_end_it_with_one_error() {
        let added = line("ADDED");
        // Cut in the middle of a line: the events before it, then the end.
        let got = read(vec![
            Ok(added),
            Ok(&added[..20]),
            Err(body_error(io::ErrorKind::UnexpectedEof)),
            Ok(added),
        ])
        .await;
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(matches!(&got[0], Ok(WatchEvent::Added(_))));
        // A stall's read timeout: one error the reflector counts as a stall, then the end.
        let got = read(vec![
            Ok(added),
            Err(body_error(io::ErrorKind::TimedOut)),
            Ok(added),
        ])
        .await;
        assert_eq!(got.len(), 2, "{got:?}");
        let Err(e) = got.into_iter().nth(1).unwrap() else {
            panic!("an error");
        };
        let e = kube::runtime::watcher::Error::WatchFailed(e);
        assert!(crate::informer::reflector::is_stall(&e), "{e:?}");
        // A line that is not UTF-8: one error, then the end (as kube's line reader).
        let got = read(vec![Ok(b"{\"type\":\"\xff\"}\n"), Ok(added)]).await;
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(
            matches!(&got[0], Err(kube::Error::ReadEvents(e)) if e.kind() == io::ErrorKind::InvalidData)
        );
    }

    #[tokio::test]
    async fn a_read_dropped_half_way_through_a_line_loses_none_of_it() {
        use futures::TryStreamExt;
        let (tx, rx) = futures::channel::mpsc::unbounded::<io::Result<&'static [u8]>>();
        let mut reader = Reader {
            body: rx.into_async_read(),
            line: Vec::new(),
            transform: configmaps(),
            shard: None,
            failed: false,
        };
        let added = line("ADDED");
        tx.unbounded_send(Ok(&added[..30])).unwrap();
        // The read waits for the rest of the line and is dropped (as a `select!` drops it).
        let waited = tokio::time::timeout(std::time::Duration::from_millis(20), reader.next());
        assert!(waited.await.is_err());
        tx.unbounded_send(Ok(&added[30..])).unwrap();
        drop(tx);
        assert!(matches!(
            reader.next().await,
            Some(Ok(WatchEvent::Added(_)))
        ));
        assert!(reader.next().await.is_none());
    }

    #[test]
    fn a_watched_secret_is_redacted_and_a_pretty_object_is_cached_compact() {
        let secrets = transform("Secret", true);
        let line = r#"{"type":"ADDED","object":{"metadata":{"name":"s","annotations":{"kubectl.kubernetes.io/last-applied-configuration":"{\"data\":{\"p\":\"aHVudGVy\"}}"}},"data":{"p":"aHVudGVy"},"stringData":{"t":"t0p"}}}"#;
        let Some(Ok(WatchEvent::Added(obj))) = decode(line, &secrets, None) else {
            panic!("an add");
        };
        let json = obj.json().get();
        assert!(
            !json.contains("aHVudGVy") && !json.contains("t0p"),
            "{json}"
        );
        assert!(json.contains(r#""p":"<redacted>""#), "{json}");
        let pretty = "{\"type\":\"ADDED\",\"object\":{\"metadata\": {\"name\": \"p\", \"resourceVersion\": \"3\"}}}";
        let Some(Ok(WatchEvent::Added(obj))) = decoded(pretty, None) else {
            panic!("an add");
        };
        assert!(!obj.json().get().contains(' '), "{}", obj.json().get());
        assert_eq!(obj.resource_version(), Some("3"));
    }
}
