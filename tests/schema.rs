//! The published message schema (`schemas/cloudevent.schema.json`) accepts what the encoder
//! emits for every message shape and catches broken messages. The integration tests check
//! every message they read back from stdout, Kafka and NATS against it as well.

mod support;

use kube_event_bridge::{
    config::MessageConfig,
    informer::{Notification, NotificationKind, ObjectRef},
    message::{Encoder, Encoding},
};
use serde_json::{Value, json};
use support::{
    objects::{Meta, cached, configmap, configmaps},
    schema::{check_cloudevent, check_state_value, cloudevent_errors},
};

/// ConfigMap `settings` at resourceVersion `rv` (also its `data.v`) in namespace `ns`
/// (`None`: as if cluster-scoped), as cached.
fn object(ns: Option<&str>, rv: &str) -> ObjectRef {
    let cm = configmap(ns.unwrap_or_default(), "settings", rv)
        .meta(|m| m.namespace = ns.map(Into::into))
        .uid("6f1c-uid")
        .resource_version(rv);
    cached(cm)
}

fn encode(kind: NotificationKind, resumed: bool) -> Value {
    let encoder = Encoder::new(
        "prod",
        &configmaps(),
        &MessageConfig::default(),
        Encoding::Structured,
    );
    let mut n = Notification::new(kind);
    n.resumed = resumed;
    let m = encoder.encode(n.key(), &n).unwrap();
    serde_json::from_slice(&m.payload).unwrap()
}

fn shapes() -> Vec<(&'static str, Value)> {
    let ns = Some("shop");
    vec![
        (
            "initial add",
            encode(
                NotificationKind::Add {
                    obj: object(ns, "1"),
                    is_initial_list: true,
                },
                false,
            ),
        ),
        (
            "add",
            encode(
                NotificationKind::Add {
                    obj: object(ns, "1"),
                    is_initial_list: false,
                },
                false,
            ),
        ),
        (
            "update",
            encode(
                NotificationKind::Update {
                    old: object(ns, "1"),
                    new: object(ns, "2"),
                },
                false,
            ),
        ),
        (
            "resync",
            encode(
                NotificationKind::Update {
                    old: object(ns, "2"),
                    new: object(ns, "2"),
                },
                false,
            ),
        ),
        (
            "delete",
            encode(
                NotificationKind::Delete {
                    obj: object(ns, "3"),
                    final_state_unknown: false,
                },
                false,
            ),
        ),
        (
            "relist delete",
            encode(
                NotificationKind::Delete {
                    obj: object(ns, "3"),
                    final_state_unknown: true,
                },
                false,
            ),
        ),
        (
            "resumed update",
            encode(
                NotificationKind::Update {
                    old: object(ns, "1"),
                    new: object(ns, "2"),
                },
                true,
            ),
        ),
        (
            "resumed delete",
            encode(
                NotificationKind::Delete {
                    obj: object(ns, "3"),
                    final_state_unknown: true,
                },
                true,
            ),
        ),
        (
            "cluster-scoped",
            encode(
                NotificationKind::Add {
                    obj: object(None, "1"),
                    is_initial_list: false,
                },
                false,
            ),
        ),
    ]
}

#[test]
fn every_message_shape_matches_the_schema() {
    for (shape, event) in shapes() {
        let errors = cloudevent_errors(&event);
        assert!(errors.is_empty(), "{shape}: {errors:?}\n{event}");
    }
    check_state_value(&serde_json::from_str(object(Some("shop"), "1").json().get()).unwrap());
}

#[test]
fn broken_messages_are_caught() {
    let (_, good) = shapes().remove(2); // an update
    check_cloudevent(&good);
    let mut broken: Vec<(&str, Value)> = Vec::new();
    let mut e = good.clone();
    e.as_object_mut().unwrap().remove("id");
    broken.push(("no id", e));
    let mut e = good.clone();
    e["type"] = json!("io.github.kube-event-bridge.object.changed");
    broken.push(("unknown type", e));
    let mut e = good.clone();
    e["type"] = json!("io.github.kube-event-bridge.object.added");
    broken.push(("oldObject on an add", e));
    let mut e = good.clone();
    e["k8sinitial"] = json!("true");
    broken.push(("flag as a string", e));
    let mut e = good.clone();
    e["time"] = json!("yesterday");
    broken.push(("time not RFC 3339", e));
    let mut e = good.clone();
    e["data"]["object"]["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("uid");
    broken.push(("object without uid", e));
    let mut e = good.clone();
    e["k8sextra"] = json!("x");
    broken.push(("undocumented attribute", e));
    let mut e = good;
    e["id"] = json!("6f1c-uid:2");
    broken.push(("id without its type", e));
    for (what, event) in broken {
        assert!(
            !cloudevent_errors(&event).is_empty(),
            "{what} was not caught: {event}"
        );
    }
}

#[test]
fn filtered_out_truncated_and_patched_messages_match_the_schema() {
    use kube_event_bridge::{config::DiffMode, message::Trim};
    let options = MessageConfig {
        diff: DiffMode::Patch,
        ..Default::default()
    };
    let encoder = Encoder::new("prod", &configmaps(), &options, Encoding::Structured);
    let note = |kind, filtered_out| {
        let mut n = Notification::new(kind);
        n.filtered_out = filtered_out;
        n
    };
    let update = note(
        NotificationKind::Update {
            old: object(Some("shop"), "1"),
            new: object(Some("shop"), "2"),
        },
        false,
    );
    let out = note(
        NotificationKind::Delete {
            obj: object(Some("shop"), "3"),
            final_state_unknown: false,
        },
        true,
    );
    let decode = |m: kube_event_bridge::message::Message| -> Value {
        serde_json::from_slice(&m.payload).unwrap()
    };
    let patched = decode(encoder.encode("shop/settings", &update).unwrap());
    assert!(patched["data"]["patch"].is_array());
    let mut shapes = vec![("patched update", patched.clone())];
    for trim in [Trim::OldObject, Trim::Patch, Trim::Reference] {
        shapes.push((
            trim.as_str(),
            decode(
                encoder
                    .encode_trimmed("shop/settings", &update, trim)
                    .unwrap(),
            ),
        ));
    }
    shapes.push((
        "filtered out",
        decode(encoder.encode("shop/settings", &out).unwrap()),
    ));
    for (shape, event) in &shapes {
        let errors = cloudevent_errors(event);
        assert!(errors.is_empty(), "{shape}: {errors:?}\n{event}");
    }
    let mut e = patched.clone();
    e["type"] = json!("io.github.kube-event-bridge.object.synced");
    e["data"].as_object_mut().unwrap().remove("oldObject");
    assert!(!cloudevent_errors(&e).is_empty(), "a patch on a resync");
    let mut e = patched;
    e["k8sfilteredout"] = json!(true);
    assert!(
        !cloudevent_errors(&e).is_empty(),
        "k8sfilteredout on an update"
    );
}
