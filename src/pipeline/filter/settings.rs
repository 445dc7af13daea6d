//! A route filter's settings (`filter`, `publish_if`, `filter_error`, `ignore_fields`), the
//! rules compiled from them (their errors are `expr::Error`), and the reasons a notification
//! is filtered.

use json_patch::jsonptr::PointerBuf;
use prometheus::IntCounter;
use serde::{Deserialize, Serialize};

use super::expr::{Error, Expr};
use crate::{
    informer::{CachedObject, object::differing_fields},
    problems::Section,
};

/// What an evaluation error of a resource's `filter` does.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum FilterErrorPolicy {
    /// Publish the notification.
    #[default]
    Pass,
    /// Drop the notification (counted in `keb_filtered_total{reason="filter_error"}`).
    Drop,
}

/// A resource's filter settings (the `filter`, `publish_if`, `filter_error` and
/// `ignore_fields` of its `resources[]` entry).
#[derive(Debug, Clone, Default)]
pub struct FilterSettings {
    /// The membership expression over `object`, if any.
    pub filter: Option<String>,
    /// The change condition over `object`, `oldObject` and `type`, if any.
    pub publish_if: Option<String>,
    /// What an evaluation error does.
    pub on_error: FilterErrorPolicy,
    /// JSON pointers an update may change without being published.
    pub ignore_fields: Vec<String>,
}

impl FilterSettings {
    /// Compiles the expression and parses the pointers; reports into `p` (paths relative to
    /// the resource entry).
    pub fn validate(&self, p: &mut Section) {
        if let Some(filter) = &self.filter
            && let Err(reason) = Expr::compile_membership(filter)
        {
            p.add("filter", format!("{reason} (in `{filter}`)"));
        }
        if let Some(publish_if) = &self.publish_if
            && let Err(reason) = Expr::compile(publish_if)
        {
            p.add("publish_if", format!("{reason} (in `{publish_if}`)"));
        }
        for (j, pointer) in self.ignore_fields.iter().enumerate() {
            if let Err(reason) = field_pointer(pointer) {
                p.add(&format!("ignore_fields[{j}]"), reason);
            }
        }
    }
}

/// `pointer` parsed, when it points at a field (not the whole object).
pub(super) fn field_pointer(pointer: &str) -> Result<PointerBuf, Error> {
    match PointerBuf::parse(pointer) {
        Ok(p) if pointer.len() >= 2 => Ok(p),
        _ => Err(Error::Pointer(pointer.to_owned())),
    }
}

/// Why a notification was not published, as counted in `keb_filtered_total{reason}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The object does not belong to the stream (`filter`).
    Filter = 0,
    /// An expression could not be evaluated and `filter_error` is `drop`.
    FilterError,
    /// An update that changed only `ignore_fields`.
    Suppressed,
    /// A change of a member that `publish_if` did not pass.
    PublishIf,
}

impl Reason {
    /// Every reason, in discriminant order (the order of [`FilterMetrics::filtered`]).
    pub const ALL: [Reason; 4] = [
        Self::Filter,
        Self::FilterError,
        Self::Suppressed,
        Self::PublishIf,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Filter => "filter",
            Self::FilterError => "filter_error",
            Self::Suppressed => "suppressed",
            Self::PublishIf => "publish_if",
        }
    }
}

/// Removes each of `pointers` from `value`; one that points at nothing (a missing key, an
/// index past an array's end, `-`) is ignored. (jsonptr's own `delete` takes an index equal
/// to the array's length as valid and then panics removing it.)
pub fn remove_pointers(value: &mut serde_json::Value, pointers: &[PointerBuf]) {
    use json_patch::jsonptr::index::Index;
    for p in pointers {
        let Some((parent, last)) = p.split_back() else {
            continue;
        };
        match parent.resolve_mut(value) {
            Ok(serde_json::Value::Object(m)) => {
                m.remove(last.decoded().as_ref());
            }
            Ok(serde_json::Value::Array(a)) => {
                if let Ok(Index::Num(i)) = last.to_index()
                    && i < a.len()
                {
                    a.remove(i);
                }
            }
            _ => {}
        }
    }
}

/// Whether `a` and `b` are equal once `pointers` are removed from both.
pub fn equal_ignoring(a: &CachedObject, b: &CachedObject, pointers: &[PointerBuf]) -> bool {
    // Only the top-level fields that differ are parsed; what is equal stays equal.
    match differing_fields(a, b) {
        Some((mut a, mut b)) => {
            remove_pointers(&mut a, pointers);
            remove_pointers(&mut b, pointers);
            a == b
        }
        None => false,
    }
}

/// What a resource's routes filter by; compiled once per resource.
#[derive(Debug)]
pub struct Rules {
    pub(super) filter: Option<Expr>,
    pub(super) publish_if: Option<Expr>,
    pub(super) on_error: FilterErrorPolicy,
    pub(super) ignore_fields: Vec<PointerBuf>,
}

impl Rules {
    /// The rules of `settings`, or `None` when they filter nothing.
    pub fn new(settings: &FilterSettings) -> Result<Option<Self>, Error> {
        if settings.filter.is_none()
            && settings.publish_if.is_none()
            && settings.ignore_fields.is_empty()
        {
            return Ok(None);
        }
        Ok(Some(Self {
            filter: settings
                .filter
                .as_deref()
                .map(Expr::compile_membership)
                .transpose()?,
            publish_if: settings
                .publish_if
                .as_deref()
                .map(Expr::compile)
                .transpose()?,
            on_error: settings.on_error,
            ignore_fields: settings
                .ignore_fields
                .iter()
                .map(|p| field_pointer(p))
                .collect::<Result<_, _>>()?,
        }))
    }

    /// Whether the route must remember which objects its consumers have.
    pub(super) fn tracks(&self) -> bool {
        self.filter.is_some() || self.publish_if.is_some()
    }
}

/// Counters of one route.
pub struct FilterMetrics {
    /// `keb_filtered_total{resource,sink,reason}`, by [`Reason`].
    pub filtered: [IntCounter; Reason::ALL.len()],
    /// `keb_filter_errors_total{resource,sink}`.
    pub errors: IntCounter,
}
