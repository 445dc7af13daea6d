//! Leader election on a `coordination.k8s.io/v1` Lease, after client-go's `leaderelection`.
//!
//! # Contract
//! - At most one replica believes it leads, provided `renew_deadline < lease_duration`: a
//!   leader that could not renew for `renew_deadline` steps down (stops publishing) before the
//!   lease can expire for the others, who wait `lease_duration` after they last *saw* the lease
//!   change. Expiry is judged by the local time of that observation, never by comparing
//!   clocks across machines.
//! - Writes use the Lease's resourceVersion: two candidates racing for it cannot both win
//!   (the loser gets 409 Conflict).
//! - Publishing is guarded locally too: the [`Fence`] a leader's workers check before each
//!   hand-over is valid until the *start* of its last successful renewal plus
//!   `renew_deadline`, so a leader frozen past that (a stall, SIGSTOP) hands nothing over when
//!   it wakes, before its elector even runs; its checkpointer writes nothing then either.
//! - A new leader that took the lease over (not one released or never held) waits
//!   [`takeover_wait`] before its fence is valid: the longest delivery time of the sinks
//!   (`kafka.delivery_timeout`, `nats.ack_timeout`) beyond the margin `lease_duration -
//!   renew_deadline`. The holder's own timing travels with the lease: each renewal writes
//!   [`DELIVERED_WITHIN_ANNOTATION`] (its `renew_deadline` plus its longest delivery), and a
//!   taker waits the longer of its own wait and what that implies beyond the lease's
//!   duration, so replicas with other settings (a rolling update that lowers
//!   `delivery_timeout`) still wait out the old holder's messages. A lease without it
//!   (written by an older release) is waited out with the taker's own settings. The wait
//!   shows as `keb_takeover_wait_seconds{lease}` and in `/readyz`, and its end is logged.
//!   Messages the old leader handed over before its fence ended are then delivered or failed
//!   for good before the new leader reads a checkpoint or publishes. (This rests on timers,
//!   like the lease itself; a process frozen between a hand-over and its producer's write to
//!   the socket can still deliver that message late: only the broker can fence that, as
//!   Kafka transactions do.)
//! - Where transactions fence, the timers are not needed for them: each renewal also writes
//!   [`FENCED_BY_ANNOTATION`] (the holder's transactional ids under the lease, and when what
//!   it sends otherwise is delivered, tied to that renewal), and a taker whose own
//!   transactional producers cover every announced id begins its sinks' terms at once (their
//!   `init_transactions` aborts the holder's open transaction and refuses its later
//!   commits); once they all began, [`Fence::holder_fenced`] shortens its wait to what the
//!   rest needs (its own wait for those sinks, or the holder's announcement's). Until then the
//!   full wait stands, is what it announces as owed, and keeps the lease from being
//!   released.
//! - On shutdown the leader releases the lease (empty holder), so a standby takes over at
//!   once instead of waiting for expiry.
//! - A lease lost while leading (renewals failed past the deadline, or another holder found
//!   on it), not released or handed on, is reported through [`LeaderElector::deposals`] once
//!   another identity is seen holding it, with the instant from which another could take
//!   it: that holder's term fences this replica's transactional producers of the lease that
//!   were not closed by then, whether or not the broker ever tells them.
//! - A shard lease this replica should no longer own (see [`LeaderElector::campaign_while`])
//!   is handed on the same way when it has a follower for [`LeaderElector::handovers`]: it
//!   goes on renewing while the follower stops publishing, waits for what it handed over and
//!   writes its checkpoints, and is released once the follower answers that nothing is left
//!   on its way (the next owner then starts at once, without a takeover wait, from a
//!   checkpoint that holds everything published). A drain that fails or times out lets the
//!   lease expire instead, as before, and the next owner waits its takeover wait.
//!
//! The elector only decides; `App` acts on [`LeaderElector::subscribe`], which changes only
//! when leadership does (renewals are silent): standbys keep their informers running but
//! their listeners and route queues hold nothing; a new leader lists every informer again and
//! hands that state on once (compared with its checkpoints).
//!
//! # Layout
//! `settings` (the `leader_election` section), `fence` (what the workers check), `handoff`
//! (the takeover wait and what a holder writes for the next), `elector` (the campaign), and
//! `membership` (which replicas share the shards), which builds on the first three.

mod elector;
mod fence;
mod handoff;
pub mod membership;
mod settings;

pub use elector::{Deposal, Handover, LeaderElector};
pub use fence::{Fence, FenceCap, FenceTimes};
pub use handoff::{
    DELIVERED_WITHIN_ANNOTATION, FENCED_BY_ANNOTATION, FencedBy, MAX_TAKEOVER_WAIT,
    delivered_within_of, delivered_within_text, holders_wait, lease_seconds, takeover_wait,
};
pub use settings::{LeaderElectionConfig, default_identity, default_namespace};
