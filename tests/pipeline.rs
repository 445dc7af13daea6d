//! The delivery pipeline with test sinks that fail, are slow, stall or reject: route queue →
//! workers → encoder → sink, fed by a synthetic informer (notifications pushed directly).

#[path = "support/fake_sink.rs"]
mod fake_sink;
#[path = "support/objects.rs"]
mod objects;
#[path = "support/wait.rs"]
mod wait;

use std::{
    collections::HashMap,
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use fake_sink::FakeSink;
use kube_event_bridge::{
    config::MessageConfig,
    informer::{Notification, NotificationKind, ObjectRef},
    message::{Encoder, Encoding},
    metrics::Metrics,
    pipeline::{
        self, Budget, Delivery, InFlight, Route, RouteBuilder, RouteQueue,
        route::{DEFAULT_MAX_BYTES_IN_FLIGHT, DEFAULT_MAX_OBJECTS_IN_FLIGHT},
    },
    sinks::Sink,
    workqueue::{TokenBucket, rate_limiter::RetrySettings},
};
use objects::{Meta, cached, configmap_with_data, configmaps};
use wait::Patience;

/// ConfigMap `ns/name` at resourceVersion `rv` (uid `uid-{name}`) with `padding` bytes of
/// data, as the informer would cache it.
fn object(name: &str, rv: u64, padding: usize) -> ObjectRef {
    cached(
        configmap_with_data("ns", name, [("pad", "x".repeat(padding))])
            .uid(format!("uid-{name}"))
            .resource_version(rv),
    )
}

struct Harness {
    queue: Arc<RouteQueue>,
    route: Arc<Route>,
    budget: Arc<Budget>,
    metrics: Arc<Metrics>,
}

fn fast_retries() -> RetrySettings {
    RetrySettings {
        base: Duration::from_millis(1),
        max: Duration::from_millis(20),
        qps: 10_000.0,
        burst: 10_000,
    }
}

fn harness(
    sink: Arc<FakeSink>,
    dead_letter: Option<Arc<FakeSink>>,
    cap: usize,
    max_retries: Option<u32>,
) -> Harness {
    harness_with(sink, dead_letter, cap, max_retries, None, default_room())
}

/// The default room in flight.
fn default_room() -> Arc<InFlight> {
    Delivery::in_flight(DEFAULT_MAX_OBJECTS_IN_FLIGHT, DEFAULT_MAX_BYTES_IN_FLIGHT)
}

fn harness_with(
    sink: Arc<FakeSink>,
    dead_letter: Option<Arc<FakeSink>>,
    cap: usize,
    max_retries: Option<u32>,
    publish_limit: Option<TokenBucket>,
    in_flight: Arc<InFlight>,
) -> Harness {
    let metrics = Arc::new(Metrics::new());
    let budget = Arc::new(Budget::new(cap));
    let delivery = Arc::new(Delivery {
        sink,
        dead_letter: dead_letter.map(|d| d as Arc<dyn Sink>),
        publish_limit: publish_limit.map(Arc::new),
        max_retries,
        in_flight,
    });
    let encoder = Encoder::new(
        "test",
        &configmaps(),
        &MessageConfig::default(),
        Encoding::Structured,
    );
    // Wired as the service wires a route (pipeline::RouteBuilder), with fast retries.
    let route = RouteBuilder::new("configmap", "test", encoder, delivery, &metrics)
        .budget(budget.clone())
        .retry(fast_retries())
        .build()
        .route;
    let queue = route.queue().clone();
    Harness {
        queue,
        route,
        budget,
        metrics,
    }
}

/// Pushes, per object: add(1), updates 2..=updates+1, and for every third object a delete.
/// Returns per key the (rv, type) sequence pushed.
fn push_load(
    q: &RouteQueue,
    objects: usize,
    updates: u64,
    padding: usize,
) -> HashMap<String, Vec<(u64, String)>> {
    push_load_sampled(q, objects, updates, padding, &mut 0)
}

/// [`push_load`], recording in `peak` the most notifications the queue held after any push.
fn push_load_sampled(
    q: &RouteQueue,
    objects: usize,
    updates: u64,
    padding: usize,
    peak: &mut usize,
) -> HashMap<String, Vec<(u64, String)>> {
    let mut pushed: HashMap<String, Vec<(u64, String)>> = HashMap::new();
    let mut rv = 0;
    for round in 0..=updates {
        for i in 0..objects {
            let name = format!("o{i:04}");
            rv += 1;
            let obj = object(&name, rv, padding);
            let kind = if round == 0 {
                NotificationKind::Add {
                    obj,
                    is_initial_list: false,
                }
            } else {
                let prev = pushed[&format!("ns/{name}")].last().unwrap().0;
                NotificationKind::Update {
                    old: object(&name, prev, padding),
                    new: obj,
                }
            };
            let ty = if round == 0 { "added" } else { "updated" };
            pushed
                .entry(format!("ns/{name}"))
                .or_default()
                .push((rv, ty.into()));
            q.push(Notification::new(kind));
            *peak = (*peak).max(q.held());
        }
    }
    for i in (0..objects).step_by(3) {
        let name = format!("o{i:04}");
        rv += 1;
        pushed
            .entry(format!("ns/{name}"))
            .or_default()
            .push((rv, "deleted".into()));
        q.push(Notification::new(NotificationKind::Delete {
            obj: object(&name, rv, padding),
            final_state_unknown: false,
        }));
        *peak = (*peak).max(q.held());
    }
    pushed
}

/// Waits (up to 60 s, looking every 5 ms) until the route holds no notification.
async fn settled(budget: &Budget) {
    let patience = Patience::of(Duration::from_secs(60)).polling(Duration::from_millis(5));
    if !wait::within(patience, async || budget.held() == 0).await {
        panic!("{} notifications never settled", budget.held());
    }
}

// Retries wait on tokio time: paused, the backoff costs no wall-clock time.
#[tokio::test(start_paused = true)]
async fn with_a_flaky_sink_every_notification_arrives_in_order_per_object() {
    let sink = Arc::new(FakeSink {
        fail_every: 3,
        ..FakeSink::named("test")
    });
    let h = harness(sink.clone(), None, 1_000_000, None);
    let running = pipeline::start(&[(h.route.clone(), 4)]);
    let pushed = push_load(&h.queue, 50, 10, 10);
    settled(&h.budget).await;
    assert_eq!(
        sink.by_key(),
        pushed,
        "all notifications, in order per object, nothing coalesced"
    );
    let failures = h
        .metrics
        .sink_failed
        .with_label_values(&["test", "configmap", "io"])
        .get();
    assert!(failures > 100, "a third of the attempts failed: {failures}");
    assert_eq!(
        h.metrics
            .workqueue
            .for_queue("configmap/test")
            .retries
            .get(),
        failures
    );
    assert!(
        running
            .drain(tokio::time::Instant::now() + Duration::from_secs(5))
            .await
            .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_ten_times_slower_than_the_input_keeps_memory_under_the_cap_by_coalescing() {
    // 2 workers × 1 ms per publish: at most ~2000 notifications/s; the input comes at once.
    let sink = Arc::new(FakeSink {
        delay: Duration::from_millis(1),
        ..FakeSink::named("test")
    });
    let cap = 100;
    let objects = 200;
    let h = harness(sink.clone(), None, cap, None);
    let running = pipeline::start(&[(h.route.clone(), 2)]);
    let mut peak = 0;
    // Adds, then 20 waves of updates of every object, then deletes of every third.
    let pushed = push_load_sampled(&h.queue, objects, 20, 10, &mut peak);
    assert_eq!(
        pushed.values().map(Vec::len).sum::<usize>(),
        objects * 21 + objects.div_ceil(3)
    );
    // Bound: the cap, plus the newest state and the delete of each object.
    assert!(
        peak <= cap + 2 * objects,
        "held {peak} with a cap of {cap} and {objects} objects"
    );
    settled(&h.budget).await;
    let coalesced = h
        .metrics
        .listener_coalesced
        .with_label_values(&["configmap", "test"])
        .get();
    assert!(coalesced > 1000, "coalesced {coalesced}");
    let delivered = sink.by_key();
    for (key, seq) in &delivered {
        assert!(
            seq.windows(2).all(|w| w[0].0 < w[1].0),
            "{key}: out of order {seq:?}"
        );
    }
    // Every object's newest state arrived last (an add merged with later updates stays an
    // add, carrying the newest state); every delete arrived.
    for (key, seq) in &pushed {
        let (last_rv, last_type) = delivered[key].last().unwrap();
        assert_eq!(*last_rv, seq.last().unwrap().0, "{key}");
        if seq.last().unwrap().1 == "deleted" {
            assert_eq!(last_type, "deleted", "{key}");
        }
    }
    assert!(
        running
            .drain(tokio::time::Instant::now() + Duration::from_secs(5))
            .await
            .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_too_large_is_trimmed_to_a_reference_and_one_that_never_fits_is_dead_lettered() {
    let sink = Arc::new(FakeSink {
        max_size: Some(4_000),
        ..FakeSink::named("test")
    });
    let dlq = Arc::new(FakeSink::named("dlq"));
    let h = harness(sink.clone(), Some(dlq.clone()), 1_000, None);
    let running = pipeline::start(&[(h.route.clone(), 2)]);
    let long_name = "l".repeat(5_000);
    h.queue.push(Notification::new(NotificationKind::Add {
        obj: object("small", 1, 10),
        is_initial_list: false,
    }));
    h.queue.push(Notification::new(NotificationKind::Add {
        obj: object("huge", 2, 10_000),
        is_initial_list: false,
    }));
    // Even its reference carries the name: it never fits.
    h.queue.push(Notification::new(NotificationKind::Add {
        obj: object(&long_name, 4, 10),
        is_initial_list: false,
    }));
    h.queue.push(Notification::new(NotificationKind::Update {
        old: object("small", 1, 10),
        new: object("small", 3, 10),
    }));
    settled(&h.budget).await;
    let delivered = sink.by_key();
    assert_eq!(
        delivered["ns/small"],
        [(1, "added".to_string()), (3, "updated".to_string())]
    );
    // The sink refused the whole object at hand-over: it went again as a reference.
    assert_eq!(delivered["ns/huge"], [(2, "added".to_string())]);
    assert!(!delivered.contains_key(&format!("ns/{long_name}")));
    let records = dlq.accepted();
    assert_eq!(records.len(), 1);
    let fake_sink::Accepted {
        key,
        id,
        payload: record,
    } = &records[0];
    assert_eq!(key, &format!("ns/{long_name}"));
    assert_eq!(id, &format!("uid-{long_name}:4:added"));
    assert_eq!(record["reason"], "too_large");
    assert_eq!(record["sink"], "test");
    let m = &h.metrics;
    assert_eq!(
        m.sink_failed
            .with_label_values(&["test", "configmap", "too_large"])
            .get(),
        1
    );
    let degraded = |step: &str| {
        m.message_degraded
            .with_label_values(&["test", "configmap", step])
            .get()
    };
    assert_eq!(["reference", "dead_letter"].map(degraded), [1, 1]);
    assert!(
        running
            .drain(tokio::time::Instant::now() + Duration::from_secs(5))
            .await
            .is_empty()
    );
}

// Retries wait on tokio time: paused, the backoff costs no wall-clock time.
#[tokio::test(start_paused = true)]
async fn max_retries_fails_one_notification_for_good_and_keeps_the_key_going() {
    let sink = Arc::new(FakeSink {
        always_fail: vec!["ns/bad".into()],
        ..FakeSink::named("test")
    });
    let dlq = Arc::new(FakeSink::named("dlq"));
    let h = harness(sink.clone(), Some(dlq.clone()), 1_000, Some(3));
    let running = pipeline::start(&[(h.route.clone(), 2)]);
    h.queue.push(Notification::new(NotificationKind::Add {
        obj: object("bad", 1, 10),
        is_initial_list: false,
    }));
    h.queue.push(Notification::new(NotificationKind::Add {
        obj: object("good", 2, 10),
        is_initial_list: false,
    }));
    settled(&h.budget).await;
    assert_eq!(sink.by_key()["ns/good"].len(), 1);
    let records = dlq.accepted();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].payload["reason"], "max_retries");
    // The key is released: its next notification is tried (and, still failing, given up).
    h.queue.push(Notification::new(NotificationKind::Update {
        old: object("bad", 1, 10),
        new: object("bad", 3, 10),
    }));
    settled(&h.budget).await;
    assert_eq!(dlq.stored(), 2);
    assert_eq!(
        h.metrics
            .sink_failed
            .with_label_values(&["test", "configmap", "io"])
            .get(),
        8,
        "twice 1 try + 3 retries"
    );
    assert!(
        running
            .drain(tokio::time::Instant::now() + Duration::from_secs(5))
            .await
            .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_delivers_everything_pending_within_the_grace_period() {
    let sink = Arc::new(FakeSink {
        delay: Duration::from_micros(200),
        ..FakeSink::named("test")
    });
    let h = harness(sink.clone(), None, 1_000_000, None);
    let running = pipeline::start(&[(h.route.clone(), 4)]);
    let pushed = push_load(&h.queue, 100, 3, 10);
    let total: usize = pushed.values().map(Vec::len).sum();
    // Shut down at once, mid-load.
    let left = running
        .drain(tokio::time::Instant::now() + Duration::from_secs(30))
        .await;
    assert!(left.is_empty(), "{left:?}");
    assert_eq!(sink.by_key(), pushed);
    assert_eq!(sink.stored(), total);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_sink_at_shutdown_is_reported_not_waited_for_forever() {
    let sink = Arc::new(FakeSink {
        stall: true,
        ..FakeSink::named("test")
    });
    let h = harness(sink.clone(), None, 1_000, None);
    let running = pipeline::start(&[(h.route.clone(), 2)]);
    push_load(&h.queue, 10, 0, 10);
    let left = running
        .drain(tokio::time::Instant::now() + Duration::from_millis(200))
        .await;
    assert_eq!(
        left,
        HashMap::from([("configmap/test".to_string(), 14)]),
        "10 adds and 4 deletes"
    );
}

#[tokio::test(start_paused = true)]
async fn the_publish_rate_limit_spaces_publishes() {
    let sink = Arc::new(FakeSink::named("test"));
    let h = harness_with(
        sink.clone(),
        None,
        1_000,
        None,
        Some(TokenBucket::new(10.0, 1)),
        default_room(),
    );
    let running = pipeline::start(&[(h.route.clone(), 4)]);
    let start = tokio::time::Instant::now();
    push_load(&h.queue, 11, 0, 10);
    settled(&h.budget).await;
    // 11 adds and 4 deletes at 10/s with a burst of 1: the 15th publish waits 1.4 s.
    let elapsed = start.elapsed();
    assert!(
        elapsed >= Duration::from_millis(1400) && elapsed < Duration::from_millis(1500),
        "{elapsed:?}"
    );
    assert_eq!(sink.stored(), 15);
    drop(running);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_stalled_workers_are_given_up_on_together_at_the_deadline() {
    let sink = Arc::new(FakeSink {
        stall: true,
        ..FakeSink::named("test")
    });
    let h = harness(sink.clone(), None, 1_000, None);
    let running = pipeline::start(&[(h.route.clone(), 64)]);
    push_load(&h.queue, 64, 0, 10);
    // Every worker's publish started and stuck in the sink.
    wait::until(
        "64 publishes stuck in the sink",
        Patience::of(Duration::from_secs(20)).polling(Duration::from_millis(5)),
        async || {
            sink.attempts.load(Ordering::SeqCst) >= 64
                || sink.publishing.load(Ordering::SeqCst) >= 64
        },
    )
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_millis(200);
    let left = running.drain(deadline).await;
    // Kubernetes kills the pod soon after the grace period: 64 publishes stuck past the
    // deadline must not each add a wait of their own.
    let overrun = tokio::time::Instant::now() - deadline;
    assert!(
        overrun < Duration::from_secs(2),
        "drain overran its deadline by {overrun:?}"
    );
    assert_eq!(
        left,
        HashMap::from([("configmap/test".to_string(), 64 + 22)]),
        "64 adds and 22 deletes"
    );
}

/// After a message trimmed to a reference, consumers lack the object the key's next patch
/// would start from: that update goes without `data.patch` (its `data.object` is the state),
/// and the one after it carries a patch again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_reference_the_next_update_carries_no_patch() {
    let sink = Arc::new(FakeSink {
        max_size: Some(4_000),
        ..FakeSink::named("test")
    });
    let metrics = Arc::new(Metrics::new());
    let delivery = fake_sink::delivery_to(sink.clone(), None);
    let message = MessageConfig {
        include_old_object: false,
        diff: kube_event_bridge::message::DiffMode::Patch,
        ..MessageConfig::default()
    };
    let encoder = Encoder::new("test", &configmaps(), &message, Encoding::Structured);
    let budget = Arc::new(Budget::new(1_000));
    let route = RouteBuilder::new("configmap", "test", encoder, delivery, &metrics)
        .budget(budget.clone())
        .retry(fast_retries())
        .build()
        .route;
    let running = pipeline::start(&[(route.clone(), 1)]);
    let q = route.queue();
    q.push(Notification::new(NotificationKind::Add {
        obj: object("a", 1, 10_000),
        is_initial_list: false,
    }));
    for rv in 2..=3 {
        q.push(Notification::new(NotificationKind::Update {
            old: object("a", rv - 1, if rv == 2 { 10_000 } else { 10 }),
            new: object("a", rv, 10),
        }));
    }
    settled(&budget).await;
    let accepted: Vec<serde_json::Value> = sink.accepted().into_iter().map(|a| a.payload).collect();
    assert_eq!(accepted.len(), 3);
    assert_eq!(accepted[0]["k8struncated"], true);
    assert!(
        accepted[1]["data"].get("patch").is_none(),
        "{}",
        accepted[1]
    );
    assert_eq!(
        accepted[1]["data"]["object"]["metadata"]["resourceVersion"],
        "2"
    );
    assert!(accepted[2]["data"]["patch"].is_array(), "{}", accepted[2]);
    let degraded = |step: &str| {
        metrics
            .message_degraded
            .with_label_values(&["test", "configmap", step])
            .get()
    };
    // Only the reference was a degradation.
    assert_eq!(["reference", "patch"].map(degraded), [1, 0]);
    running
        .drain(tokio::time::Instant::now() + Duration::from_secs(5))
        .await;
}

/// With leader election, a route hands messages over only while the lease is valid by this
/// replica's clock: a leader that wakes from a freeze past its renew deadline holds its
/// messages back (they go once the lease is renewed, or are dropped when the term ends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_lease_holds_messages_back_until_it_is_renewed() {
    let sink = Arc::new(FakeSink::named("test"));
    let metrics = Arc::new(Metrics::new());
    let delivery = fake_sink::delivery_to(sink.clone(), Some(1));
    let encoder = Encoder::new(
        "test",
        &configmaps(),
        &MessageConfig::default(),
        Encoding::Structured,
    );
    let fence = kube_event_bridge::leader::Fence::default();
    let budget = Arc::new(Budget::new(1_000));
    let route = RouteBuilder::new("configmap", "test", encoder, delivery, &metrics)
        .budget(budget.clone())
        .retry(fast_retries())
        .fence(Some(fence.clone()))
        .build()
        .route;
    let running = pipeline::start(&[(route.clone(), 2)]);
    // Renewed, then the deadline passes (a freeze longer than the renew deadline).
    fence.extend_to(tokio::time::Instant::now() + Duration::from_millis(50));
    tokio::time::sleep(Duration::from_millis(100)).await;
    for i in 0..5 {
        route.queue().push(Notification::new(NotificationKind::Add {
            obj: object(&format!("o{i}"), i + 1, 10),
            is_initial_list: false,
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!((sink.stored() == 0));
    assert_eq!(
        budget.held(),
        5,
        "held back, not given up on (max_retries 1)"
    );
    fence.extend_to(tokio::time::Instant::now() + Duration::from_secs(30));
    settled(&budget).await;
    assert_eq!(sink.stored(), 5);
    running
        .drain(tokio::time::Instant::now() + Duration::from_secs(5))
        .await;
}

/// Pushes to each route its own `objects` objects (`{route}-o{i}`, padded with `padding`
/// bytes): adds, then `updates` waves of updates. Returns what each object was sent, in order.
fn push_waves(
    routes: &[Arc<Route>],
    objects: usize,
    updates: usize,
    padding: usize,
) -> HashMap<String, Vec<(u64, String)>> {
    let mut pushed: HashMap<String, Vec<(u64, String)>> = HashMap::new();
    let mut rv = 0;
    for round in 0..=updates {
        for (r, route) in routes.iter().enumerate() {
            for i in 0..objects {
                let name = format!("{r}-o{i:04}");
                rv += 1;
                let kind = match pushed.get(&format!("ns/{name}")) {
                    None => NotificationKind::Add {
                        obj: object(&name, rv, padding),
                        is_initial_list: round == 0,
                    },
                    Some(seq) => NotificationKind::Update {
                        old: object(&name, seq.last().unwrap().0, padding),
                        new: object(&name, rv, padding),
                    },
                };
                let ty = if round == 0 { "added" } else { "updated" };
                route.queue().push(Notification::new(kind));
                pushed
                    .entry(format!("ns/{name}"))
                    .or_default()
                    .push((rv, ty.to_owned()));
            }
        }
    }
    pushed
}

/// `sink` has every notification `pushed`, in order per object, and the pipeline drains.
async fn all_arrived_in_order(
    sink: &FakeSink,
    pushed: HashMap<String, Vec<(u64, String)>>,
    running: pipeline::Running,
) {
    assert_eq!(
        sink.by_key(),
        pushed,
        "every notification, in order per object"
    );
    assert!(
        running
            .drain(tokio::time::Instant::now() + Duration::from_secs(5))
            .await
            .is_empty()
    );
}

/// Two routes share one sink whose acknowledgements take 20 ms, with room for 16 objects in
/// flight (`sinks[].max_objects_in_flight`) and 8 workers each: never more than 16 messages
/// are handed over and unacknowledged at once (one per object at most), the bound is reached,
/// and every notification of both routes arrives, in order per object.
#[tokio::test(start_paused = true)]
async fn a_sinks_objects_in_flight_stay_within_its_bound_across_its_routes() {
    const ROOM: usize = 16;
    let (objects, updates) = (150, 3);
    let sink = Arc::new(FakeSink {
        script: vec![(fake_sink::Outcome::Stored, 20); 2 * objects * (updates + 1)],
        ..FakeSink::named("test")
    });
    let metrics = Arc::new(Metrics::new());
    let budget = Arc::new(Budget::new(1_000_000));
    let delivery = Arc::new(Delivery {
        sink: sink.clone(),
        dead_letter: None,
        publish_limit: None,
        max_retries: None,
        in_flight: Delivery::in_flight(ROOM, DEFAULT_MAX_BYTES_IN_FLIGHT),
    });
    let routes: Vec<Arc<Route>> = ["first", "second"]
        .into_iter()
        .map(|resource| {
            let encoder = Encoder::new(
                resource,
                &configmaps(),
                &MessageConfig::default(),
                Encoding::Structured,
            );
            RouteBuilder::new(resource, "test", encoder, delivery.clone(), &metrics)
                .budget(budget.clone())
                .retry(fast_retries())
                .build()
                .route
        })
        .collect();
    let running = pipeline::start(&routes.iter().map(|r| (r.clone(), 8)).collect::<Vec<_>>());
    let pushed = push_waves(&routes, objects, updates, 10);
    settled(&budget).await;
    let peak = sink.peak_unacknowledged.load(Ordering::SeqCst);
    assert_eq!(peak, ROOM, "the most unacknowledged at once");
    assert_eq!(sink.unacknowledged.load(Ordering::SeqCst), 0);
    all_arrived_in_order(&sink, pushed, running).await;
}

/// One route into a sink whose acknowledgements take 20 ms, with room for `bytes` bytes of
/// messages in flight (`sinks[].max_bytes_in_flight`), objects unbounded and 8 workers: the
/// sink (its most unacknowledged messages at once, their most bytes, the largest message)
/// once every notification arrived, in order per object.
async fn through_room_for_bytes(bytes: usize) -> Arc<FakeSink> {
    let (objects, updates) = (60, 2);
    let sink = Arc::new(FakeSink {
        script: vec![(fake_sink::Outcome::Stored, 20); objects * (updates + 1)],
        ..FakeSink::named("test")
    });
    let h = harness_with(
        sink.clone(),
        None,
        1_000_000,
        None,
        None,
        Delivery::in_flight(usize::MAX, bytes),
    );
    let running = pipeline::start(&[(h.route.clone(), 8)]);
    let pushed = push_waves(&[h.route], objects, updates, 200);
    settled(&h.budget).await;
    assert_eq!(sink.unacknowledged_bytes.load(Ordering::SeqCst), 0);
    all_arrived_in_order(&sink, pushed, running).await;
    sink
}

/// Room for four to ten messages' bytes: never more bytes unacknowledged at once than the
/// room, the room is reached (a message more would not have fitted), and several messages
/// share it.
#[tokio::test(start_paused = true)]
async fn a_sinks_bytes_in_flight_stay_within_its_bound() {
    const ROOM: usize = 5 * 1_000;
    let sink = through_room_for_bytes(ROOM).await;
    let peak = sink.peak_unacknowledged_bytes.load(Ordering::SeqCst);
    let largest = sink.largest.load(Ordering::SeqCst);
    assert!(
        (500..=1_500).contains(&largest),
        "messages of a fifth of the room or so each, not {largest}"
    );
    assert!(peak <= ROOM, "{peak} bytes unacknowledged at once");
    assert!(
        peak + largest > ROOM,
        "the room was reached: {peak} bytes at most"
    );
    assert!(sink.peak_unacknowledged.load(Ordering::SeqCst) >= 4);
    assert!(sink.peak_unacknowledged.load(Ordering::SeqCst) <= 10);
}

/// Room for less than one message: each goes alone, and all go.
#[tokio::test(start_paused = true)]
async fn a_message_larger_than_the_room_for_bytes_goes_alone() {
    let sink = through_room_for_bytes(100).await;
    assert_eq!(sink.peak_unacknowledged.load(Ordering::SeqCst), 1);
}

/// A sink with JetStream's window (`max_in_flight`: a hand-over waits for a permit, which an
/// acknowledgement gives back only once polled to its end) of 2, one worker, and 50 objects:
/// while the worker waits for a permit to hand the next object over, the acknowledgements it
/// holds are still polled, so every object arrives (a worker that stopped polling them while
/// it waited would never get a permit back).
#[tokio::test(start_paused = true)]
async fn one_worker_waiting_on_the_sinks_window_still_settles_what_it_handed_over() {
    let objects = 50;
    let sink = Arc::new(FakeSink {
        script: vec![(fake_sink::Outcome::Stored, 20); objects],
        ack_window: Some(Arc::new(tokio::sync::Semaphore::new(2))),
        ..FakeSink::named("test")
    });
    let h = harness(sink.clone(), None, 1_000, None);
    let running = pipeline::start(&[(h.route.clone(), 1)]);
    for i in 0..objects {
        h.queue.push(Notification::new(NotificationKind::Add {
            obj: object(&format!("o{i:02}"), i as u64 + 1, 10),
            is_initial_list: true,
        }));
    }
    // Every object settles: the worker polls its acknowledgements while it waits.
    settled(&h.budget).await;
    assert_eq!(sink.stored(), objects);
    assert_eq!(
        sink.peak_unacknowledged.load(Ordering::SeqCst),
        2,
        "the window held"
    );
    assert!(
        running
            .drain(tokio::time::Instant::now() + Duration::from_secs(5))
            .await
            .is_empty()
    );
}
