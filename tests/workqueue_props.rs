//! Property tests: random interleavings of add / get / done / add_rate_limited with several
//! workers never hand one key to two workers, never lose an added key, and (through the route
//! queue) keep every notification of a key, in order, across failures and retries.

#[path = "support/objects.rs"]
mod objects;

use std::{
    collections::{HashMap, HashSet, VecDeque},
    sync::Arc,
    time::Duration,
};

use k8s_openapi::api::core::v1::ConfigMap;
use kube_event_bridge::{
    informer::{Notification, NotificationKind, resource_version},
    pipeline::{Budget, RouteQueue},
    workqueue::{Queue, QueueMetrics, RateLimiter, RateLimitingQueue},
};
use objects::{Meta, cached, named};
use prometheus::{IntCounter, IntGauge};
use proptest::prelude::*;

const WORKERS: usize = 4;

/// Retries at once, so that the properties need no clock.
struct NoDelay;
impl<T> RateLimiter<T> for NoDelay {
    fn when(&self, _: &T) -> Duration {
        Duration::ZERO
    }
    fn forget(&self, _: &T) {}
    fn num_requeues(&self, _: &T) -> u32 {
        0
    }
}

#[derive(Debug, Clone)]
enum QueueOp {
    Add(u8),
    AddRateLimited(u8),
    Get(usize),
    Done(usize),
}

fn queue_op() -> impl Strategy<Value = QueueOp> {
    prop_oneof![
        (0u8..6).prop_map(QueueOp::Add),
        (0u8..6).prop_map(QueueOp::AddRateLimited),
        (0..WORKERS).prop_map(QueueOp::Get),
        (0..WORKERS).prop_map(QueueOp::Done),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    #[test]
    fn queue_never_shares_a_key_and_never_loses_one(ops in proptest::collection::vec(queue_op(), 1..200)) {
        let q: RateLimitingQueue<String> = RateLimitingQueue::new(Box::new(NoDelay), QueueMetrics::unregistered());
        let mut held: [Option<String>; WORKERS] = Default::default();
        // Keys added since they were last handed out: each must be handed out again.
        let mut owed: HashSet<String> = HashSet::new();
        let get = |held: &mut [Option<String>; WORKERS], owed: &mut HashSet<String>, w: usize| -> Result<(), TestCaseError> {
            if held[w].is_some() { return Ok(()); }
            if let Some(k) = q.try_get() {
                prop_assert!(!held.iter().flatten().any(|h| *h == k), "{k} handed to two workers");
                owed.remove(&k);
                held[w] = Some(k);
            }
            Ok(())
        };
        for op in ops {
            match op {
                QueueOp::Add(k) => { q.add(k.to_string()); owed.insert(k.to_string()); }
                QueueOp::AddRateLimited(k) => { q.add_rate_limited(k.to_string()); owed.insert(k.to_string()); }
                QueueOp::Get(w) => get(&mut held, &mut owed, w)?,
                QueueOp::Done(w) => if let Some(k) = held[w].take() { q.done(&k) },
            }
        }
        for k in held.iter_mut().filter_map(Option::take) {
            q.done(&k);
        }
        while let Some(k) = q.try_get() {
            owed.remove(&k);
            q.done(&k);
        }
        prop_assert!(owed.is_empty(), "keys added but never handed out again: {owed:?}");
        prop_assert_eq!(q.len(), 0);
    }
}

#[derive(Debug, Clone)]
enum RouteOp {
    Push(u8),
    /// A worker's turn: if idle, take a key; if holding one, publish up to `n` of its
    /// notifications, then fail (retry) or finish.
    Turn {
        worker: usize,
        n: usize,
        fail: bool,
    },
}

fn route_op() -> impl Strategy<Value = RouteOp> {
    prop_oneof![
        (0u8..5).prop_map(RouteOp::Push),
        (0..WORKERS, 0usize..4, any::<bool>()).prop_map(|(worker, n, fail)| RouteOp::Turn {
            worker,
            n,
            fail
        }),
    ]
}

/// An update of object `ns/o{key}` to resourceVersion `rv`.
fn update(key: u8, rv: u64) -> Notification {
    let obj =
        |rv: u64| cached(named::<ConfigMap>(Some("ns"), &format!("o{key}")).resource_version(rv));
    Notification::new(NotificationKind::Update {
        old: obj(0),
        new: obj(rv),
    })
}

struct Worker {
    key: kube_event_bridge::pipeline::route_queue::Key,
    batch: VecDeque<Notification>,
    term: u64,
}

fn turn(
    q: &RouteQueue,
    slot: &mut Option<Worker>,
    n: usize,
    fail: bool,
    delivered: &mut HashMap<String, Vec<u64>>,
) -> Result<(), TestCaseError> {
    let Some(w) = slot.as_mut() else {
        if let Some(key) = q.queue().try_get() {
            let (batch, term) = q.take(&key);
            *slot = Some(Worker { key, batch, term });
        }
        return Ok(());
    };
    for _ in 0..n {
        let Some(note) = w.batch.pop_front() else {
            break;
        };
        delivered
            .entry(w.key.to_string())
            .or_default()
            .push(resource_version(note.object()).parse().unwrap());
        q.settle(1);
    }
    let w = slot.take().unwrap();
    if fail && !w.batch.is_empty() {
        q.retry(&w.key, w.batch, w.term);
    } else if w.batch.is_empty() {
        prop_assert!(q.finish(&w.key).is_none());
        q.queue().forget(&w.key);
    } else {
        // Not failed, not finished: put the rest back like a retry (a worker never drops any).
        q.retry(&w.key, w.batch, w.term);
    }
    q.queue().done(&w.key);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    #[test]
    fn route_queue_delivers_every_notification_in_order_per_key(ops in proptest::collection::vec(route_op(), 1..300)) {
        let q = RouteQueue::new(
            "r/s".into(),
            Box::new(NoDelay),
            QueueMetrics::unregistered(),
            Arc::new(Budget::new(1_000_000)),
            IntGauge::new("b", "b").unwrap(),
            IntCounter::new("c", "c").unwrap(),
        );
        let mut slots: Vec<Option<Worker>> = (0..WORKERS).map(|_| None).collect();
        let mut pushed: HashMap<String, Vec<u64>> = HashMap::new();
        let mut delivered: HashMap<String, Vec<u64>> = HashMap::new();
        let mut rv = 0;
        for op in ops {
            match op {
                RouteOp::Push(k) => {
                    rv += 1;
                    pushed.entry(format!("ns/o{k}")).or_default().push(rv);
                    q.push(update(k, rv));
                }
                RouteOp::Turn { worker, n, fail } => {
                    turn(&q, &mut slots[worker], n, fail, &mut delivered)?;
                    let held: Vec<&str> = slots.iter().flatten().map(|w| &*w.key).collect();
                    let distinct: HashSet<&&str> = held.iter().collect();
                    prop_assert_eq!(held.len(), distinct.len(), "a key held by two workers");
                }
            }
        }
        // Let every worker finish, then drain with one worker that never fails.
        for slot in slots.iter_mut() {
            while slot.is_some() {
                turn(&q, slot, usize::MAX, false, &mut delivered)?;
            }
        }
        let mut last = None;
        loop {
            turn(&q, &mut last, 0, false, &mut delivered)?;
            if last.is_none() { break; }
            turn(&q, &mut last, usize::MAX, false, &mut delivered)?;
        }
        prop_assert_eq!(delivered, pushed);
        prop_assert_eq!(q.held(), 0);
    }
}

#[test]
fn queue_is_usable_without_rate_limiting() {
    let q: Queue<String> = Queue::new(QueueMetrics::unregistered());
    q.add("a".into());
    assert_eq!(q.try_get().as_deref(), Some("a"));
}
