//! RFC 6902 JSON Patch between two cached objects (`message.diff: patch`), computed on their
//! JSON text: the diff descends only where the text differs and parses only the values it
//! writes into the patch.
//!
//! An update usually changes a few leaves (`metadata.resourceVersion`, a status condition, a
//! data key); parsing both objects whole into `serde_json::Value` trees
//! to find them cost more than the rest of the message. The patch is the one
//! `json_patch::diff` gives for the parsed objects, operation for operation (the property
//! tests compare them): objects are walked in key order (additions and replacements, then
//! removals), arrays by index as `json_patch` does, and values whose text differs are parsed
//! and compared as values (`1e1` and `10.0` are the same number). One exception, which no
//! API server writes: a member named `$serde_json::private::RawValue`, which serde_json's
//! `Value` takes for embedded JSON, is diffed as the member it is.
//!
//! The walk goes at most [`MAX_DEPTH`] levels deep: the API server accepts objects nested far
//! deeper than serde_json parses (128 levels), and list and watch bytes are cached without
//! parsing them whole, so such an object can reach here; a change below that depth gives no
//! patch (as a parse of the whole field failing did before), never a stack overflow.

use std::collections::BTreeMap;

use json_patch::{
    AddOperation, Patch, PatchOperation, RemoveOperation, ReplaceOperation, jsonptr::PointerBuf,
};
use serde_json::{Value, value::RawValue};

use crate::informer::CachedObject;

/// How deep the walk descends: serde_json's own limit when it parses a value.
const MAX_DEPTH: usize = 128;

/// RFC 6902 JSON Patch from `old` to `new`; `None` when a value the diff must parse cannot be
/// parsed (a number beyond f64, a lone surrogate escape, nesting past 128 levels) or the
/// objects differ more than [`MAX_DEPTH`] levels deep.
pub fn patch_between(old: &CachedObject, new: &CachedObject) -> Option<Patch> {
    let mut patch = Patch(Vec::new());
    let mut walk = Walk {
        at: PointerBuf::new(),
        depth: 0,
        patch: &mut patch,
    };
    walk.diff(old.json(), new.json())?;
    Some(patch)
}

/// An object's members, borrowed from its text (fails on escaped keys, which cannot be
/// borrowed).
type Members<'a> = BTreeMap<&'a str, &'a RawValue>;

/// Where the walk is, and the patch it writes.
struct Walk<'p> {
    at: PointerBuf,
    /// Objects and arrays entered.
    depth: usize,
    patch: &'p mut Patch,
}

impl Walk<'_> {
    /// Appends the operations turning `old` into `new`, both at `self.at`; `None` if a value
    /// cannot be parsed or the difference lies deeper than [`MAX_DEPTH`].
    fn diff(&mut self, old: &RawValue, new: &RawValue) -> Option<()> {
        let (a, b) = (old.get(), new.get());
        if a == b {
            return Some(());
        }
        if self.depth >= MAX_DEPTH {
            return None;
        }
        self.depth += 1;
        match (opening(a), opening(b)) {
            (Some(b'{'), Some(b'{')) => {
                match (
                    serde_json::from_str::<Members>(a),
                    serde_json::from_str::<Members>(b),
                ) {
                    (Ok(x), Ok(y)) => self.members(&x, &y)?,
                    // Escaped keys: this subtree is diffed parsed.
                    _ => {
                        let (x, y) = (parse(old)?, parse(new)?);
                        let at = &self.at;
                        let ops = json_patch::diff(&x, &y).0.into_iter();
                        self.patch.0.extend(ops.map(|op| under(at, op)));
                    }
                }
            }
            (Some(b'['), Some(b'[')) => {
                let x: Vec<&RawValue> = serde_json::from_str(a).ok()?;
                let y: Vec<&RawValue> = serde_json::from_str(b).ok()?;
                self.elements(&x, &y)?;
            }
            _ => {
                let new = parse(new)?;
                if parse(old)? != new {
                    self.push(|path| {
                        PatchOperation::Replace(ReplaceOperation { path, value: new })
                    });
                }
            }
        }
        self.depth -= 1;
        Some(())
    }

    /// Members of `new` added or changed, then members of `old` removed, in key order.
    fn members(&mut self, old: &Members, new: &Members) -> Option<()> {
        for (key, value) in new {
            self.at.push_back(*key);
            match old.get(key) {
                Some(was) => self.diff(was, value)?,
                None => {
                    let value = parse(value)?;
                    self.push(|path| PatchOperation::Add(AddOperation { path, value }));
                }
            }
            self.at.pop_back();
        }
        for key in old.keys().filter(|k| !new.contains_key(*k)) {
            self.at.push_back(*key);
            self.push(|path| PatchOperation::Remove(RemoveOperation { path }));
            self.at.pop_back();
        }
        Some(())
    }

    /// Elements compared index by index; extra old ones removed (each at the same index, as
    /// the array shrinks under the patch), extra new ones added.
    fn elements(&mut self, old: &[&RawValue], new: &[&RawValue]) -> Option<()> {
        let mut removed = 0;
        for i in 0..old.len().max(new.len()) {
            self.at.push_back(i - removed);
            match (old.get(i), new.get(i)) {
                (Some(was), Some(value)) => self.diff(was, value)?,
                (Some(_), None) => {
                    removed += 1;
                    self.push(|path| PatchOperation::Remove(RemoveOperation { path }));
                }
                (None, Some(value)) => {
                    let value = parse(value)?;
                    self.push(|path| PatchOperation::Add(AddOperation { path, value }));
                }
                (None, None) => {}
            }
            self.at.pop_back();
        }
        Some(())
    }

    /// Appends the operation `op` makes of the current path.
    fn push(&mut self, op: impl FnOnce(PointerBuf) -> PatchOperation) {
        self.patch.0.push(op(self.at.clone()));
    }
}

/// The first byte of a JSON value's text.
fn opening(text: &str) -> Option<u8> {
    text.trim_start().bytes().next()
}

fn parse(raw: &RawValue) -> Option<Value> {
    serde_json::from_str(raw.get()).ok()
}

/// `op` (one `json_patch::diff` writes: add, remove or replace) moved under `at`.
fn under(at: &PointerBuf, op: PatchOperation) -> PatchOperation {
    match op {
        PatchOperation::Add(AddOperation { path, value }) => PatchOperation::Add(AddOperation {
            path: at.concat(&path),
            value,
        }),
        PatchOperation::Remove(RemoveOperation { path }) => {
            PatchOperation::Remove(RemoveOperation {
                path: at.concat(&path),
            })
        }
        PatchOperation::Replace(ReplaceOperation { path, value }) => {
            PatchOperation::Replace(ReplaceOperation {
                path: at.concat(&path),
                value,
            })
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cached(v: Value) -> CachedObject {
        CachedObject::new(&serde_json::from_value(v).unwrap())
    }

    /// The patch text-diffing gives is `json_patch::diff`'s for the parsed objects, and
    /// applies.
    fn same_as_parsed(old: Value, new: Value) -> Patch {
        let (a, b) = (cached(old), cached(new));
        let patch = patch_between(&a, &b).unwrap();
        let (x, y): (Value, Value) = (
            serde_json::from_str(a.json().get()).unwrap(),
            serde_json::from_str(b.json().get()).unwrap(),
        );
        assert_eq!(patch, json_patch::diff(&x, &y));
        let mut doc = x;
        json_patch::patch(&mut doc, &patch).unwrap();
        assert_eq!(doc, y);
        patch
    }

    fn object(rv: &str, extra: Value) -> Value {
        let mut v = json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "a", "namespace": "ns", "resourceVersion": rv,
                         "labels": {"app": "web"},
                         "managedFields": [{"manager": "kubectl", "time": "2026-01-01T00:00:00Z", "fieldsV1": {"f:data": {}}},
                                           {"manager": "ctl", "time": "2026-01-01T00:00:00Z"}]},
            "data": {"k": "v"},
        });
        if let (Value::Object(m), Value::Object(e)) = (&mut v, extra) {
            m.extend(e);
        }
        v
    }

    #[test]
    fn only_the_leaves_that_changed_are_in_the_patch() {
        let mut new = object("8", json!({}));
        new["metadata"]["managedFields"][1]["time"] = json!("2026-01-01T00:00:01Z");
        let patch = same_as_parsed(object("7", json!({})), new);
        let paths: Vec<String> = patch
            .0
            .iter()
            .map(|op| match op {
                PatchOperation::Replace(r) => r.path.to_string(),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            paths,
            [
                "/metadata/managedFields/1/time",
                "/metadata/resourceVersion"
            ]
        );
    }

    #[test]
    fn additions_removals_arrays_escaped_keys_and_equal_numbers_match_json_patch() {
        let old = object(
            "7",
            json!({"status": {"n": 1.0, "a~b/c": [1, 2, 3], "gone": true, "list": [{"x": 1}]},
                   "spec": [1, {"y": "z"}]}),
        );
        let new = object(
            "8",
            json!({"status": {"n": 1.0, "a~b/c": [1], "added": {"deep": [null]}, "list": [{"x": 2}, {"x": 3}]},
                   "spec": {"now": "an object"}, "extra": "é\"\u{1}"}),
        );
        same_as_parsed(old.clone(), new.clone());
        same_as_parsed(new, old);
    }

    #[test]
    fn escaped_keys_are_diffed_parsed_under_their_path() {
        let (a, b) = (
            cached(object("7", json!({"data": {"q\"uote": "1", "k": "v"}}))),
            cached(object("7", json!({"data": {"q\"uote": "2", "k": "v"}}))),
        );
        let patch = patch_between(&a, &b).unwrap();
        assert_eq!(
            serde_json::to_value(&patch).unwrap(),
            json!([{"op": "replace", "path": "/data/q\"uote", "value": "2"}])
        );
    }

    /// An object as the server wrote it (compact, cached without parsing).
    fn as_written(json: &str) -> CachedObject {
        CachedObject::from_json(RawValue::from_string(json.to_owned()).unwrap()).unwrap()
    }

    #[test]
    fn text_written_differently_but_equal_gives_what_json_patch_gives() {
        // Server text (Go's \u0026, 1e2, members in its order, an escaped key spelled as a
        // \u escape) against serde's text of the same values with one change.
        let written = as_written(
            r#"{"metadata":{"resourceVersion":"7","name":"a","namespace":"ns"},"kind":"ConfigMap","apiVersion":"v1","data":{"url":"a\u0026b","k\u0022ey":"v","n":1e2,"f":-0.0,"l":[1.0,"\u00e9"]}}"#,
        );
        let parsed: Value = serde_json::from_str(written.json().get()).unwrap();
        let mut changed = parsed.clone();
        changed["data"]["l"][1] = json!("e");
        changed["metadata"]["resourceVersion"] = json!("8");
        let serde_text = cached(changed.clone());
        for (a, b) in [(&written, &serde_text), (&serde_text, &written)] {
            let (x, y): (Value, Value) = (
                serde_json::from_str(a.json().get()).unwrap(),
                serde_json::from_str(b.json().get()).unwrap(),
            );
            let patch = patch_between(a, b).unwrap();
            assert_eq!(patch, json_patch::diff(&x, &y));
            assert_eq!(patch.0.len(), 2, "{patch:?}");
        }
    }

    #[test]
    fn a_change_nested_deeper_than_serde_parses_gives_no_patch_and_no_overflow() {
        let object = |leaf: &str| {
            let depth = 10_000;
            as_written(&format!(
                r#"{{"apiVersion":"x/v1","kind":"T","metadata":{{"name":"a","resourceVersion":"1"}},"spec":{}{leaf}{},"status":{{"n":{leaf}}}}}"#,
                "[".repeat(depth),
                "]".repeat(depth)
            ))
        };
        let (a, b) = (object("1"), object("2"));
        // A worker thread's stack (Tokio's default is 2 MiB).
        let patch = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || patch_between(&a, &b))
            .unwrap()
            .join()
            .unwrap();
        assert!(patch.is_none());
        // Within the limit, the same shape diffs.
        let shallow = |leaf: &str| {
            as_written(&format!(
                r#"{{"apiVersion":"x/v1","kind":"T","metadata":{{"name":"a"}},"spec":{}{leaf}{}}}"#,
                "[".repeat(100),
                "]".repeat(100)
            ))
        };
        let patch = patch_between(&shallow("1"), &shallow("2")).unwrap();
        assert_eq!(patch.0.len(), 1);
    }

    #[test]
    fn equal_text_gives_an_empty_patch() {
        let a = cached(object("7", json!({})));
        assert!(patch_between(&a, &a).unwrap().0.is_empty());
    }
}
