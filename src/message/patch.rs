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
//! and compared as values (`1e1` and `10.0` are the same number).

use std::collections::BTreeMap;

use json_patch::{
    AddOperation, Patch, PatchOperation, RemoveOperation, ReplaceOperation, jsonptr::PointerBuf,
};
use serde_json::{Value, value::RawValue};

use crate::informer::CachedObject;

/// RFC 6902 JSON Patch from `old` to `new`; `None` for JSON serde_json cannot parse as a value
/// (deeper than 128 levels, a number beyond f64, a lone surrogate escape).
pub fn patch_between(old: &CachedObject, new: &CachedObject) -> Option<Patch> {
    let mut patch = Patch(Vec::new());
    diff(old.json(), new.json(), &mut PointerBuf::new(), &mut patch).ok()?;
    Some(patch)
}

/// An object's members, borrowed from its text (fails on escaped keys, which cannot be
/// borrowed).
type Members<'a> = BTreeMap<&'a str, &'a RawValue>;

/// Appends to `patch` the operations turning `old` into `new`, both at `at`.
fn diff(
    old: &RawValue,
    new: &RawValue,
    at: &mut PointerBuf,
    patch: &mut Patch,
) -> serde_json::Result<()> {
    let (a, b) = (old.get(), new.get());
    if a == b {
        return Ok(());
    }
    match (opening(a), opening(b)) {
        (Some(b'{'), Some(b'{')) => {
            match (
                serde_json::from_str::<Members>(a),
                serde_json::from_str::<Members>(b),
            ) {
                (Ok(x), Ok(y)) => diff_members(&x, &y, at, patch)?,
                // Escaped keys: this subtree is diffed parsed.
                _ => {
                    let parsed = json_patch::diff(&serde_json::from_str(a)?, &parse(new)?);
                    patch.0.extend(parsed.0.into_iter().map(|op| under(at, op)));
                }
            }
        }
        (Some(b'['), Some(b'[')) => {
            let x: Vec<&RawValue> = serde_json::from_str(a)?;
            let y: Vec<&RawValue> = serde_json::from_str(b)?;
            diff_elements(&x, &y, at, patch)?;
        }
        _ => {
            let new = parse(new)?;
            if serde_json::from_str::<Value>(a)? != new {
                patch.0.push(PatchOperation::Replace(ReplaceOperation {
                    path: at.clone(),
                    value: new,
                }));
            }
        }
    }
    Ok(())
}

/// Members of `new` added or changed, then members of `old` removed, in key order.
fn diff_members(
    old: &Members,
    new: &Members,
    at: &mut PointerBuf,
    patch: &mut Patch,
) -> serde_json::Result<()> {
    for (key, value) in new {
        at.push_back(*key);
        match old.get(key) {
            Some(was) => diff(was, value, at, patch)?,
            None => patch.0.push(PatchOperation::Add(AddOperation {
                path: at.clone(),
                value: parse(value)?,
            })),
        }
        at.pop_back();
    }
    for key in old.keys().filter(|k| !new.contains_key(*k)) {
        at.push_back(*key);
        patch
            .0
            .push(PatchOperation::Remove(RemoveOperation { path: at.clone() }));
        at.pop_back();
    }
    Ok(())
}

/// Elements compared index by index; extra old ones removed (each at the same index, as the
/// array shrinks under the patch), extra new ones added.
fn diff_elements(
    old: &[&RawValue],
    new: &[&RawValue],
    at: &mut PointerBuf,
    patch: &mut Patch,
) -> serde_json::Result<()> {
    let mut removed = 0;
    for i in 0..old.len().max(new.len()) {
        at.push_back(i - removed);
        match (old.get(i), new.get(i)) {
            (Some(was), Some(value)) => diff(was, value, at, patch)?,
            (Some(_), None) => {
                removed += 1;
                patch
                    .0
                    .push(PatchOperation::Remove(RemoveOperation { path: at.clone() }));
            }
            (None, Some(value)) => patch.0.push(PatchOperation::Add(AddOperation {
                path: at.clone(),
                value: parse(value)?,
            })),
            (None, None) => {}
        }
        at.pop_back();
    }
    Ok(())
}

/// The first byte of a JSON value's text.
fn opening(text: &str) -> Option<u8> {
    text.trim_start().bytes().next()
}

fn parse(raw: &RawValue) -> serde_json::Result<Value> {
    serde_json::from_str(raw.get())
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

    #[test]
    fn equal_text_gives_an_empty_patch() {
        let a = cached(object("7", json!({})));
        assert!(patch_between(&a, &a).unwrap().0.is_empty());
    }
}
