//! Which transform an informer applies to objects before caching them (client-go's
//! `TransformFunc`), from the message options. What it does is
//! [`crate::informer::transform`].

use kube::api::{ApiResource, TypeMeta};

use super::MessageConfig;
pub use crate::informer::transform::{REDACTED, Transform, redact_secret};

/// The transform for objects of `resource`: restores `apiVersion`/`kind` (list items of
/// built-in types omit them), strips `metadata.managedFields` if `strip_managed_fields`, and
/// redacts Secrets unless `allow_secret_data`.
pub fn object_transform(resource: &ApiResource, options: &MessageConfig) -> Transform {
    let types = TypeMeta {
        api_version: resource.api_version.clone(),
        kind: resource.kind.clone(),
    };
    let redact =
        !options.allow_secret_data && resource.group.is_empty() && resource.kind == "Secret";
    Transform::new(types, options.strip_managed_fields, redact)
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
        let mut s = obj("ns", "s", "1").to_dynamic().unwrap();
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
        object_transform(&secrets, &MessageConfig::default()).apply(&mut redacted);
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
        object_transform(&secrets, &allowed).apply(&mut kept);
        assert_eq!(kept.data["data"]["password"], "aHVudGVyMg==");
        assert!(kept.metadata.managed_fields.is_some());
    }
}
