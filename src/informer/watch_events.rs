//! A watch response, line by line, as kube's `WatchEvent`s whose objects are already in their
//! cached form: each line's `object` goes from the response's bytes through
//! [`Transform::cache`] (no `DynamicObject` tree), as list items do, so an object cached from
//! a watch is byte for byte what a list would have cached.
//!
//! What kube's `Client::request_events` does, it does too: a line that is not an event but a
//! `Status` is that API error; a truncated last line is dropped; a stream that ends with an
//! unexpected EOF (the server or a proxy cut it) ends cleanly, so the watch is started again;
//! any other read error (a stall's read timeout included) is `ReadEvents`. Unlike kube, the
//! members of a line may come in any order.
//!
//! With a shard the server does not select, an object of another shard is not cached at all:
//! its line becomes a bookmark at its resourceVersion, which moves the watch on exactly as the
//! skipped event would have.

use std::{borrow::Cow, sync::Arc};

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
    body.lines()
        .filter_map(move |line| {
            let event = match line {
                Ok(line) => decode(&line, &transform, shard.as_ref()),
                Err(e) if ended(&e) => {
                    tracing::debug!(error = %e, "Watch stream cut; it is started again");
                    None
                }
                Err(e) => Some(Err(kube::Error::ReadEvents(e))),
            };
            futures::future::ready(event)
        })
        .boxed()
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
            if let Some(shard) = shard {
                let (namespace, rv) = peek(object);
                if !shard.holds_namespace(namespace.as_deref().unwrap_or("")) {
                    return rv.map(|rv| Ok(skipped(rv.into_owned())));
                }
            }
            transform.cache(object).map(|obj| {
                let obj = Arc::new(obj);
                match &*kind {
                    "ADDED" => WatchEvent::Added(obj),
                    "MODIFIED" => WatchEvent::Modified(obj),
                    _ => WatchEvent::Deleted(obj),
                }
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

/// A bookmark at `rv`: where an event of another shard moves the watch.
fn skipped(rv: String) -> WatchEvent<ObjectRef> {
    WatchEvent::Bookmark(Bookmark {
        types: TypeMeta::default(),
        metadata: BookmarkMeta {
            resource_version: rv,
            annotations: Default::default(),
        },
    })
}

/// An object's `metadata.namespace` and `resourceVersion`, read from its JSON without caching
/// it; `None` for what cannot be read.
pub fn peek(json: &str) -> (Option<Cow<'_, str>>, Option<Cow<'_, str>>) {
    #[derive(serde::Deserialize)]
    struct Item<'a> {
        #[serde(borrow)]
        metadata: Meta<'a>,
    }
    #[derive(serde::Deserialize)]
    struct Meta<'a> {
        #[serde(borrow, default)]
        namespace: Option<Cow<'a, str>>,
        #[serde(borrow, default, rename = "resourceVersion")]
        resource_version: Option<Cow<'a, str>>,
    }
    match serde_json::from_str::<Item>(json) {
        Ok(Item { metadata: m }) => (m.namespace, m.resource_version),
        Err(_) => (None, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::informer::ObjectMetaRef;

    fn configmaps() -> Transform {
        Transform::new(
            TypeMeta {
                api_version: "v1".into(),
                kind: "ConfigMap".into(),
            },
            true,
            false,
        )
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
    fn bookmarks_errors_and_bad_lines_read_as_kube_reads_them() {
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
        // Without a resourceVersion there is nothing to move to.
        let bare = r#"{"type":"ADDED","object":{"metadata":{"name":"a","namespace":"ns"}}}"#;
        assert!(decoded(bare, Some(&other)).is_none());
    }

    #[tokio::test]
    async fn a_stream_ends_at_a_cut_and_fails_on_other_read_errors() {
        let line = format!("{{\"type\":\"ADDED\",\"object\":{OBJECT}}}\n");
        // Two events, then a last line cut short: two events and the end.
        let body = format!("{line}{line}{{\"type\":\"ADD");
        let got: Vec<_> = events(
            futures::io::Cursor::new(body.into_bytes()),
            configmaps(),
            None,
        )
        .collect()
        .await;
        assert_eq!(got.len(), 2);
        assert!(got.iter().all(|e| matches!(e, Ok(WatchEvent::Added(_)))));
        let cut = std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "cut");
        assert!(ended(&std::io::Error::other(cut)));
        let timeout = std::io::Error::new(std::io::ErrorKind::TimedOut, "read timed out");
        assert!(!ended(&std::io::Error::other(timeout)));
    }
}
