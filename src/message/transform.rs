//! The transform every informer applies to objects before caching them (client-go's
//! `TransformFunc`).

use kube::api::{ApiResource, DynamicObject, TypeMeta};

use super::MessageConfig;
use crate::informer::reflector::Transform;

/// Value that replaces each redacted Secret value.
pub const REDACTED: &str = "<redacted>";

/// The transform every informer applies before caching (client-go's `TransformFunc`):
/// restores `apiVersion`/`kind` (list items of built-in types omit them), strips
/// `metadata.managedFields`, and redacts Secrets unless allowed. Doing it before the cache
/// means redacted data never sits in memory and stripped fields cost nothing.
pub fn object_transform(resource: &ApiResource, options: &MessageConfig) -> Transform {
    let types = TypeMeta {
        api_version: resource.api_version.clone(),
        kind: resource.kind.clone(),
    };
    let strip = options.strip_managed_fields;
    let redact =
        !options.allow_secret_data && resource.group.is_empty() && resource.kind == "Secret";
    std::sync::Arc::new(move |obj: &mut DynamicObject| {
        if obj.types.as_ref().is_none_or(|t| t.kind.is_empty()) {
            obj.types = Some(types.clone());
        }
        if strip {
            obj.metadata.managed_fields = None;
        }
        if redact {
            redact_secret(obj);
        }
    })
}

/// Replaces every value of `data` and `stringData` with [`REDACTED`] (keys stay, so consumers
/// see which entries exist), and drops the last-applied-configuration annotation, which holds
/// the same data in clear.
pub fn redact_secret(obj: &mut DynamicObject) {
    for field in ["data", "stringData"] {
        if let Some(map) = obj.data.get_mut(field).and_then(|v| v.as_object_mut()) {
            for value in map.values_mut() {
                *value = serde_json::Value::String(REDACTED.to_owned());
            }
        }
    }
    if let Some(annotations) = obj.metadata.annotations.as_mut() {
        annotations.remove("kubectl.kubernetes.io/last-applied-configuration");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::informer::testing::obj;
    use kube::api::GroupVersionKind;

    #[test]
    fn secrets_are_redacted_unless_allowed() {
        let secrets = ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("", "v1", "Secret"),
            "secrets",
        );
        let mut s = obj("ns", "s", "1").to_dynamic();
        s.types = None;
        s.data = serde_json::json!({"data": {"password": "aHVudGVyMg=="}, "stringData": {"token": "t0p"}});
        s.metadata.annotations = Some(
            [(
                "kubectl.kubernetes.io/last-applied-configuration".to_string(),
                "{...}".to_string(),
            )]
            .into(),
        );
        s.metadata.managed_fields = Some(vec![Default::default()]);
        let mut redacted = s.clone();
        object_transform(&secrets, &MessageConfig::default())(&mut redacted);
        assert_eq!(redacted.data["data"]["password"], REDACTED);
        assert_eq!(redacted.data["stringData"]["token"], REDACTED);
        assert!(redacted.metadata.annotations.unwrap().is_empty());
        assert!(redacted.metadata.managed_fields.is_none());
        assert_eq!(
            redacted.types.unwrap().kind,
            "Secret",
            "list items get their kind back"
        );
        let allowed = MessageConfig {
            allow_secret_data: true,
            strip_managed_fields: false,
            ..Default::default()
        };
        let mut kept = s.clone();
        object_transform(&secrets, &allowed)(&mut kept);
        assert_eq!(kept.data["data"]["password"], "aHVudGVyMg==");
        assert!(kept.metadata.managed_fields.is_some());
    }
}
