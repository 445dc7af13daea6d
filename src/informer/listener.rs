//! client-go's `processorListener`: one consumer of a shared informer (one resource route to
//! one sink), with its own event-type filter and resync period.
//!
//! # Contract
//! - `add` never blocks: the informer calls it while it holds its FIFO, so the handler behind
//!   a listener must buffer (the delivery pipeline's route queue does, bounded; see
//!   `pipeline::RouteQueue`). client-go's listener instead holds an unbounded ring buffer that
//!   grows "until we OOM"; here the bound lives in the handler.
//! - Notification types the route did not ask for are dropped on entry.
//! - The listener has its own resync period; the informer asks `should_resync` on each tick
//!   of its check period, and resync notifications reach only listeners that are due.
//! - A listener can be switched off (a standby replica's): it then drops everything. It is
//!   switched back on only by its informer: [`SharedIndexInformer::activate_listeners`] hands
//!   it the cache under the FIFO lock, and
//!   [`SharedIndexInformer::activate_listeners_after_relist`] streams a fresh list into it, so
//!   that it gets each object exactly once either way.
//!
//! [`SharedIndexInformer::activate_listeners`]: super::SharedIndexInformer::activate_listeners
//! [`SharedIndexInformer::activate_listeners_after_relist`]: super::SharedIndexInformer::activate_listeners_after_relist

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use tokio::time::Instant;

use super::EventType;
use super::Notification;

/// Receives a listener's notifications. Must not block.
pub trait NotificationHandler: Send + Sync {
    /// Takes one notification; called in informer order.
    fn on_notification(&self, n: Notification);

    /// Every object of the informer's first list (or, for a listener switched on later, of
    /// the cache it was handed) has been passed on. Called once per activation, in order with
    /// the notifications. `namespace` is the one namespace the informer watches (`None`: all);
    /// `listed_at` the resourceVersion of the list that state is from (`None`: unknown, or
    /// an idle informer's empty list), at which an object it lacks was gone.
    fn on_synced(&self, _namespace: Option<&str>, _listed_at: Option<&str>) {}

    /// From a route's resume: the consumers have the object at `key` (the checkpoint holds
    /// it); `unchanged` is the informer's object when it is the version the checkpoint knows
    /// (no notification follows for it). Filters use it to know what was published.
    fn on_known(&self, _key: &str, _unchanged: Option<&super::ObjectRef>) {}

    /// Returns once everything passed on so far reached the route's queue (a stage that
    /// evaluates on tasks of its own, like a filter's lanes, runs them out). Called at
    /// shutdown after the informers stopped, before the queues drain.
    fn flush(&self) {}
}

/// See the module docs for the contract.
pub struct ProcessorListener {
    name: String,
    accepts: [bool; 4],
    resync_period: Option<Duration>,
    resync: Mutex<ResyncState>,
    active: AtomicBool,
    handler: Arc<dyn NotificationHandler>,
    namespace: Option<String>,
}

struct ResyncState {
    next: Instant,
    syncing: bool,
}

impl std::fmt::Debug for ProcessorListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessorListener")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl ProcessorListener {
    /// A listener named `name` (for logs) passing notifications of the `accepted` types to
    /// `handler`, resyncing every `resync_period` if set.
    pub fn new(
        name: impl Into<String>,
        accepted: &[EventType],
        resync_period: Option<Duration>,
        handler: Arc<dyn NotificationHandler>,
    ) -> Self {
        let mut accepts = [false; 4];
        for t in accepted {
            accepts[*t as usize] = true;
        }
        let resync_period = resync_period.filter(|p| !p.is_zero());
        Self {
            name: name.into(),
            accepts,
            resync_period,
            resync: Mutex::new(ResyncState {
                next: Instant::now() + resync_period.unwrap_or_default(),
                syncing: false,
            }),
            active: AtomicBool::new(true),
            handler,
            namespace: None,
        }
    }

    /// The listener of an informer that watches only `namespace` (told to the handler with
    /// the sync).
    pub fn for_namespace(mut self, namespace: Option<String>) -> Self {
        self.namespace = namespace;
        self
    }

    /// The listener's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Passes a notification to the handler if the listener is on and its type was asked
    /// for. Never blocks.
    pub fn add(&self, n: Notification) {
        if self.is_active() && self.accepts[n.event_type() as usize] {
            self.handler.on_notification(n);
        }
    }

    /// Tells the handler that the initial state has been passed on, if the listener is on;
    /// it is from the list at `listed_at`.
    pub fn synced(&self, listed_at: Option<&str>) {
        if self.is_active() {
            self.handler.on_synced(self.namespace.as_deref(), listed_at);
        }
    }

    /// Whether the listener passes notifications on (listeners start on).
    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::SeqCst)
    }

    /// Switches the listener on or off; returns whether it was on. The informer calls it
    /// under its FIFO lock (see the module docs).
    pub(crate) fn set_active(&self, active: bool) -> bool {
        self.active.swap(active, Ordering::SeqCst)
    }

    /// The listener's resync period, if it resyncs.
    pub fn resync_period(&self) -> Option<Duration> {
        self.resync_period
    }

    /// client-go's `shouldResync` for one listener: due when `now` has reached its next resync;
    /// a due listener's next resync moves to `now + period`. Sets the flag `is_syncing` reads.
    pub fn should_resync(&self, now: Instant) -> bool {
        let mut r = self.resync.lock().unwrap_or_else(|e| e.into_inner());
        let Some(period) = self.resync_period else {
            r.syncing = false;
            return false;
        };
        r.syncing = now >= r.next;
        if r.syncing {
            r.next = now + period;
        }
        r.syncing
    }

    /// Whether resync notifications are currently delivered to this listener.
    ///
    /// Unlike client-go, where every listener starts with this flag set (so that the unchanged
    /// objects of a relist reach every listener while resync is off), it starts unset: a relist
    /// never produces phantom updates.
    pub fn is_syncing(&self) -> bool {
        self.resync
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .syncing
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::informer::{NotificationKind, testing::obj};

    #[derive(Default)]
    struct Collect(Mutex<Vec<EventType>>);
    impl NotificationHandler for Collect {
        fn on_notification(&self, n: Notification) {
            self.0.lock().unwrap().push(n.event_type());
        }
    }

    const ALL: &[EventType] = &[
        EventType::Added,
        EventType::Updated,
        EventType::Deleted,
        EventType::Synced,
    ];

    fn listener(
        accepted: &[EventType],
        resync: Option<Duration>,
    ) -> (ProcessorListener, Arc<Collect>) {
        let c = Arc::new(Collect::default());
        (
            ProcessorListener::new("test", accepted, resync, c.clone()),
            c,
        )
    }

    #[test]
    fn unrequested_types_are_dropped() {
        let (l, c) = listener(&[EventType::Deleted, EventType::Synced], None);
        l.add(Notification::new(NotificationKind::Add {
            obj: obj("ns", "a", "1"),
            is_initial_list: true,
        }));
        l.add(Notification::new(NotificationKind::Update {
            old: obj("ns", "a", "1"),
            new: obj("ns", "a", "2"),
        }));
        l.add(Notification::new(NotificationKind::Update {
            old: obj("ns", "a", "2"),
            new: obj("ns", "a", "2"),
        }));
        l.add(Notification::new(NotificationKind::Delete {
            obj: obj("ns", "a", "3"),
            final_state_unknown: false,
        }));
        assert_eq!(
            *c.0.lock().unwrap(),
            [EventType::Synced, EventType::Deleted]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn resync_is_due_at_the_listeners_own_period() {
        let (fast, _) = listener(ALL, Some(Duration::from_secs(2)));
        let (slow, _) = listener(ALL, Some(Duration::from_secs(5)));
        let (off, _) = listener(ALL, None);
        assert!(
            !fast.is_syncing(),
            "no listener starts syncing (no phantom updates on relist)"
        );
        let mut due = (0, 0, 0);
        for _ in 0..10 {
            tokio::time::advance(Duration::from_secs(1)).await;
            let now = Instant::now();
            due.0 += fast.should_resync(now) as u32;
            due.1 += slow.should_resync(now) as u32;
            due.2 += off.should_resync(now) as u32;
        }
        assert_eq!(due, (5, 2, 0));
    }
}
