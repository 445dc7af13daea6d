//! JSON read straight into CEL values that borrow its strings (cel's own `Value` conversion
//! deep-copies every map), skipping the fields an expression does not read.

use std::collections::HashMap;

use cel::common::{types, value::Val};
use serde::de::{Deserializer, MapAccess, SeqAccess, Visitor};

/// What an expression reads of one variable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Usage {
    /// Nothing: the variable is not parsed at all.
    Unused,
    /// Only these fields, each read whole or only in some of its own fields
    /// (`object.metadata.labels…` reads `labels` of `metadata`, nothing else of either).
    Fields(Fields),
    /// Anything (`size(object)`, `object["spec"]`, a macro variable of the same name).
    Whole,
}

/// The fields read of a map, by name: each [`Usage::Whole`] or [`Usage::Fields`].
pub(super) type Fields = HashMap<String, Usage>;

/// CEL's `null`.
pub(super) fn null<'v>() -> Box<dyn Val + 'v> {
    Box::new(types::CelNull)
}

/// Parses JSON straight into a CEL value borrowing its strings; of a map, only the fields in
/// `keep` (all when `None`), and of those, what their own [`Usage`] says. A value that is not
/// a map where `keep` names fields is read whole (selecting a field of it is an error either
/// way).
pub(super) fn to_val<'a>(
    json: &'a str,
    keep: Option<&Fields>,
) -> Result<Box<dyn Val + 'a>, String> {
    let mut de = serde_json::Deserializer::from_str(json);
    de.deserialize_any(ValVisitor { keep })
        .map_err(|e| format!("cannot read the object: {e}"))
}

struct ValVisitor<'k> {
    keep: Option<&'k Fields>,
}

impl<'de> Visitor<'de> for ValVisitor<'_> {
    type Value = Box<dyn Val + 'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("JSON")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(Box::new(types::CelBool::from(v)))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(Box::new(types::CelInt::from(v)))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(match i64::try_from(v) {
            Ok(i) => Box::new(types::CelInt::from(i)),
            Err(_) => Box::new(types::CelUInt::from(v)),
        })
    }
    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        Ok(Box::new(types::CelDouble::from(v)))
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Box::new(types::CelString::from(v)))
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Box::new(types::CelString::from(v.to_owned())))
    }
    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(Box::new(types::CelString::from(v)))
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Box::new(types::CelNull))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items: Vec<Box<dyn Val + 'de>> = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(v) = seq.next_element_seed(ValSeed { keep: None })? {
            items.push(v);
        }
        Ok(Box::new(types::CelList::from(items)))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut entries: HashMap<types::CelMapKey<'de>, Box<dyn Val + 'de>> = HashMap::new();
        while let Some(k) = map.next_key_seed(KeySeed)? {
            let below = match self.keep.map(|keep| keep.get(k.as_ref())) {
                None => None,
                Some(Some(Usage::Fields(below))) => Some(below),
                Some(Some(_)) => None,
                Some(None) => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                    continue;
                }
            };
            let v = map.next_value_seed(ValSeed { keep: below })?;
            let key = match k {
                std::borrow::Cow::Borrowed(k) => types::CelMapKey::from(k),
                std::borrow::Cow::Owned(k) => types::CelMapKey::from(k),
            };
            entries.insert(key, v);
        }
        Ok(Box::new(types::CelMap::from(entries)))
    }
}

/// A value, of which (if it is a map) only the fields in `keep` are read.
struct ValSeed<'k> {
    keep: Option<&'k Fields>,
}

impl<'de> serde::de::DeserializeSeed<'de> for ValSeed<'_> {
    type Value = Box<dyn Val + 'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(ValVisitor { keep: self.keep })
    }
}

/// A map key, borrowed from the JSON unless it has escapes.
struct KeySeed;

impl<'de> serde::de::DeserializeSeed<'de> for KeySeed {
    type Value = std::borrow::Cow<'de, str>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeySeed {
    type Value = std::borrow::Cow<'de, str>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a string")
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(std::borrow::Cow::Borrowed(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(std::borrow::Cow::Owned(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(std::borrow::Cow::Owned(v))
    }
}
