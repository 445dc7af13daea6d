//! Where a route's filter evaluates: on the caller's thread, or on lanes of its own.
//!
//! # Contract
//! - A key always goes to the same lane (by its hash), and a lane evaluates what it is given
//!   in the order given: per key, the filter sees notifications (and a resume's `on_known`)
//!   in informer order, as without lanes. Keys of different lanes evaluate in parallel.
//! - Each lane owns the filter state of its keys (what their consumers have); a lane's state
//!   is touched only under its own lock, by its task or by a caller running it.
//! - Passing never waits for an evaluation except when the lane holds more than [`RING`]
//!   items: the caller then runs the lane itself (everything it holds, then returns). A lane
//!   holds at most `RING + 1` waiting items per caller passing at once (one per informer of
//!   the route) plus a batch of as many being evaluated: about `2 × RING` per lane beyond
//!   the queue's cap.
//! - [`Lanes::flush`] returns once everything passed before it was evaluated; shutdown calls
//!   it after the informers stopped.
//! - An item passed in one leadership term and evaluated in another is dropped: the new term
//!   starts from the informer's cache, as the queue's own contract says. An item is evaluated
//!   as of the term it was passed in (the lane's state is that term's), and the queue takes
//!   the result only if that term is still current
//!   ([`RouteQueue::push_in`](crate::pipeline::RouteQueue::push_in)), checked under the lock
//!   the term changes under.
//! - An evaluation that panics (a bug) drops its item, is logged with its key and counted as
//!   a filter error; the lane goes on with the next item.

use std::{
    collections::VecDeque,
    hash::BuildHasher,
    sync::{Arc, Mutex, MutexGuard},
};

use tokio::sync::Notify;
use tracing::error;

use super::stage::{Stage, State};
use crate::{
    informer::{Key, Notification, ObjectRef},
    workqueue::queue::FastHash,
};

/// Items a lane holds before the caller runs it itself.
pub(super) const RING: usize = 1024;

/// What a lane evaluates.
pub(super) enum Item {
    /// A notification.
    Notification(Notification),
    /// A resume's `on_known`.
    Known(Key, Option<ObjectRef>),
}

impl Item {
    fn key(&self) -> &Key {
        match self {
            Self::Notification(n) => n.key(),
            Self::Known(key, _) => key,
        }
    }
}

/// One lane: what waits, and what its evaluation owns (that lock is the lane's: whoever
/// evaluates holds it).
#[derive(Default)]
struct Lane {
    ring: Mutex<Ring>,
    wake: Notify,
    owned: Mutex<Owned>,
}

/// What a lane's evaluation owns.
#[derive(Default)]
struct Owned {
    /// The filter state of the lane's keys.
    state: State,
    /// The batch being evaluated; it trades places with the ring's buffer, so neither
    /// allocates again once grown.
    batch: VecDeque<(u64, Item)>,
}

#[derive(Default)]
struct Ring {
    /// Items with the term they were passed in.
    items: VecDeque<(u64, Item)>,
    closed: bool,
}

impl Lane {
    fn ring(&self) -> MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn owned(&self) -> MutexGuard<'_, Owned> {
        self.owned.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Evaluates everything the lane holds, in order, until it holds nothing. Returns whether
    /// the lane is closed.
    fn run(&self, stage: &Stage) -> bool {
        let mut owned = self.owned();
        let Owned { state, batch } = &mut *owned;
        loop {
            {
                let mut ring = self.ring();
                if ring.items.is_empty() {
                    return ring.closed;
                }
                std::mem::swap(&mut ring.items, batch);
            }
            for (term, item) in batch.drain(..) {
                evaluate(stage, state, term, item);
            }
        }
    }
}

/// Evaluates `item`, passed in `term`, with `st`; a panic drops the item (see the module
/// docs).
fn evaluate(stage: &Stage, st: &mut State, term: u64, item: Item) {
    if term != stage.queue.term() {
        // Passed in an ended term.
        return;
    }
    let key = item.key().clone();
    let evaluated = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match item {
        Item::Notification(n) => stage.notify(st, term, n),
        Item::Known(key, unchanged) => stage.known(st, term, &key, unchanged.as_ref()),
    }));
    if evaluated.is_err() {
        stage.metrics.errors.inc();
        error!(route = %stage.route, key = %key, "Evaluating the filter panicked; the notification is dropped");
    }
}

/// Where a route filter evaluates (see the module docs).
pub(super) struct Lanes(Place);

enum Place {
    /// On the caller's thread, at once: all keys' state, under its lock.
    Inline(Mutex<State>),
    /// On lanes of their own; keys hashed to them.
    Spawned {
        lanes: Box<[Arc<Lane>]>,
        hash: FastHash,
    },
}

impl Lanes {
    /// No lanes: each item is evaluated by the caller, at once.
    pub(super) fn inline() -> Self {
        Self(Place::Inline(Mutex::default()))
    }

    /// `count` lanes, each a task on the current Tokio runtime (panics outside one).
    pub(super) fn spawn(stage: &Arc<Stage>, count: usize) -> Self {
        let lanes: Box<[Arc<Lane>]> = (0..count).map(|_| Arc::new(Lane::default())).collect();
        for lane in &lanes {
            let (stage, lane) = (stage.clone(), lane.clone());
            tokio::spawn(async move {
                loop {
                    lane.wake.notified().await;
                    if lane.run(&stage) {
                        break;
                    }
                }
            });
        }
        Self(Place::Spawned {
            lanes,
            hash: FastHash::default(),
        })
    }

    /// The lanes (none inline).
    fn lanes(&self) -> &[Arc<Lane>] {
        match &self.0 {
            Place::Inline(_) => &[],
            Place::Spawned { lanes, .. } => lanes,
        }
    }

    /// Evaluates `item` on its key's lane (or at once, without lanes).
    pub(super) fn pass(&self, stage: &Stage, item: Item) {
        let (lanes, hash) = match &self.0 {
            Place::Inline(state) => {
                let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
                return evaluate(stage, &mut st, stage.queue.term(), item);
            }
            Place::Spawned { lanes, hash } => (lanes, hash.hash_one(item.key())),
        };
        let lane = &lanes[(hash % lanes.len() as u64) as usize];
        let term = stage.queue.term();
        let (was_empty, full) = {
            let mut ring = lane.ring();
            let was_empty = ring.items.is_empty();
            ring.items.push_back((term, item));
            (was_empty, ring.items.len() > RING)
        };
        if full {
            // The lane's task is behind: run it here (it keeps the order).
            lane.run(stage);
        } else if was_empty {
            lane.wake.notify_one();
        }
    }

    /// Returns once everything passed so far was evaluated.
    pub(super) fn flush(&self, stage: &Stage) {
        for lane in self.lanes() {
            lane.run(stage);
        }
    }
}

impl Drop for Lanes {
    /// The tasks evaluate what their lanes still hold, then end.
    fn drop(&mut self) {
        for lane in self.lanes() {
            lane.ring().closed = true;
            lane.wake.notify_one();
        }
    }
}
