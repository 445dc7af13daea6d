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
//!   shows as `keb_takeover_wait_seconds{lease}` and in `/readyz`, and its end is logged. Messages the old leader handed over before its fence ended are then
//!   delivered or failed for good before the new leader reads a checkpoint or publishes.
//!   (This rests on timers, like the lease itself; a process frozen between a hand-over and
//!   its producer's write to the socket can still deliver that message late: only the broker
//!   can fence that, as Kafka transactions do.)
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

use std::time::Duration;

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::MicroTime,
};
use kube::{
    Api, Client,
    api::{ObjectMeta, PostParams},
};
use prometheus::IntGauge;
use tokio::{sync::watch, time::Instant};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use serde::{Deserialize, Serialize};

use crate::problems::Section;

/// Leader election on a `coordination.k8s.io/v1` Lease. Durations are client-go's defaults.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LeaderElectionConfig {
    /// Elect one leader among the replicas; only the leader publishes (standbys run their
    /// informers; a new leader lists again before it publishes). Off for a single replica.
    #[serde(default)]
    pub enabled: bool,
    /// Name of the Lease.
    #[serde(default = "default_lease_name")]
    pub lease_name: String,
    /// Namespace of the Lease; unset means `$POD_NAMESPACE`, then the service account's.
    #[serde(default)]
    pub namespace: Option<String>,
    /// This replica's identity in the Lease; unset means `$POD_NAME`, then the host name.
    #[serde(default)]
    pub identity: Option<String>,
    /// How long a lease lasts without renewal before another replica may take it.
    #[serde(default = "default_lease_duration", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub lease_duration: Duration,
    /// How long the leader tries to renew before it stops publishing; below `lease_duration`,
    /// so that it stops before anyone else can start.
    #[serde(default = "default_renew_deadline", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub renew_deadline: Duration,
    /// Pause between attempts to acquire or renew the lease.
    #[serde(default = "default_retry_period", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub retry_period: Duration,
}

impl Default for LeaderElectionConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            lease_name: default_lease_name(),
            namespace: None,
            identity: None,
            lease_duration: default_lease_duration(),
            renew_deadline: default_renew_deadline(),
            retry_period: default_retry_period(),
        }
    }
}

impl LeaderElectionConfig {
    /// Checks what serde cannot: reports into `p` (paths relative to `leader_election`).
    pub fn validate(&self, p: &mut Section) {
        if self.renew_deadline >= self.lease_duration {
            p.add(
                "renew_deadline",
                "must be shorter than lease_duration (fencing)",
            );
        }
        if self.retry_period.is_zero() || self.retry_period >= self.renew_deadline {
            p.add(
                "retry_period",
                "must be above 0 and shorter than renew_deadline",
            );
        }
        if self.lease_duration < Duration::from_secs(1) {
            p.add("lease_duration", "must be at least 1s");
        }
    }
}

fn default_lease_name() -> String {
    "kube-event-bridge".into()
}
// client-go's leader election defaults: 15 s lease, 10 s renew deadline, 2 s retry period.
fn default_lease_duration() -> Duration {
    Duration::from_secs(15)
}
fn default_renew_deadline() -> Duration {
    Duration::from_secs(10)
}
fn default_retry_period() -> Duration {
    Duration::from_secs(2)
}

/// When this replica may hand messages over (see the module docs); shared by the elector,
/// which extends it with each renewal, and the routes and checkpointers, which check it.
#[derive(Debug, Clone, Default)]
pub struct Fence(std::sync::Arc<FenceTimes>);

/// Nanoseconds since [`fence_base`]: valid from `from` (a new leader's takeover wait) until
/// `until` (0: not leading).
#[derive(Debug, Default)]
pub struct FenceTimes {
    from: std::sync::atomic::AtomicU64,
    until: std::sync::atomic::AtomicU64,
    // A deadline shared with other fences that this one never outlasts (see `Fence::capped`).
    cap: Option<FenceCap>,
    // From when another replica may hold the lease (0: unknown): the last renewal's start
    // plus the lease's duration, or a release. Kept when the fence is revoked.
    takeable: std::sync::atomic::AtomicU64,
}

/// A deadline several fences share and never outlast: the sharded replicas' hold on the
/// single-leader Lease (see [`crate::membership`]), which every shard's fence is capped by,
/// so that no shard publishes once a single leader could have taken that Lease over.
#[derive(Debug, Clone, Default)]
pub struct FenceCap(std::sync::Arc<std::sync::atomic::AtomicU64>);

impl FenceCap {
    /// Fences capped by it are valid until `deadline` at most (until extended again).
    pub fn extend_to(&self, deadline: Instant) {
        self.0.fetch_max(
            since_base(deadline).max(1),
            std::sync::atomic::Ordering::SeqCst,
        );
    }

    fn get(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// The instant fence deadlines count from.
fn fence_base() -> Instant {
    static BASE: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *BASE.get_or_init(Instant::now)
}

fn since_base(t: Instant) -> u64 {
    t.duration_since(fence_base()).as_nanos() as u64
}

impl Fence {
    /// A fence that is never valid past `cap`'s deadline (held back, not lost, while it has
    /// lapsed).
    pub fn capped(cap: FenceCap) -> Self {
        Self(std::sync::Arc::new(FenceTimes {
            cap: Some(cap),
            ..FenceTimes::default()
        }))
    }

    /// Whether a message may be handed over (or a checkpoint written) now.
    pub fn is_valid(&self) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        // `until` first: the elector stores `from` before `until`, so a new `until` comes
        // with its `from`.
        let until = self.0.until.load(SeqCst);
        let from = self.0.from.load(SeqCst);
        let now = since_base(Instant::now());
        until > 0 && from <= now && now < until && self.0.cap.as_ref().is_none_or(|c| now < c.get())
    }

    /// Whether the lease is held and past its takeover wait, whatever the cap says: a lapsed
    /// cap holds publishing back but loses nothing.
    pub fn is_held(&self) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        let until = self.0.until.load(SeqCst);
        let from = self.0.from.load(SeqCst);
        let now = since_base(Instant::now());
        until > 0 && from <= now && now < until
    }

    /// Until when it is valid, if it is valid now.
    pub fn valid_until(&self) -> Option<Instant> {
        let until = self.0.until.load(std::sync::atomic::Ordering::SeqCst);
        let until = self.0.cap.as_ref().map_or(until, |c| until.min(c.get()));
        self.is_valid()
            .then(|| fence_base() + Duration::from_nanos(until))
    }

    /// Valid until `deadline`.
    pub fn extend_to(&self, deadline: Instant) {
        self.0.until.store(
            since_base(deadline).max(1),
            std::sync::atomic::Ordering::SeqCst,
        );
    }

    /// Not valid before `start` (a new leader's takeover wait).
    pub fn not_before(&self, start: Instant) {
        self.0
            .from
            .store(since_base(start), std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether a takeover wait is under way (leading, not valid yet).
    pub fn in_takeover_wait(&self) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        let until = self.0.until.load(SeqCst);
        until > 0 && since_base(Instant::now()) < self.0.from.load(SeqCst)
    }

    /// What is left of a takeover wait under way, if one is.
    pub fn takeover_left(&self) -> Option<Duration> {
        use std::sync::atomic::Ordering::SeqCst;
        let until = self.0.until.load(SeqCst);
        let from = self.0.from.load(SeqCst);
        let now = since_base(Instant::now());
        (until > 0 && now < from).then(|| Duration::from_nanos(from - now))
    }

    /// Another replica may take the lease from `from` on (a renewal's start plus the lease's
    /// duration; a release: now).
    pub fn takeable_from(&self, from: Instant) {
        self.0
            .takeable
            .store(since_base(from).max(1), std::sync::atomic::Ordering::SeqCst);
    }

    /// From when another replica may hold the lease, if this replica ever led.
    pub fn takeable_at(&self) -> Option<Instant> {
        let from = self.0.takeable.load(std::sync::atomic::Ordering::SeqCst);
        (from > 0).then(|| fence_base() + Duration::from_nanos(from))
    }

    /// Whether another replica may hold the lease by now (the last renewal's lease ran out,
    /// or it was released), as far as this replica can tell; `false` before it ever led. A
    /// deposed producer must not abort its transaction then: librdkafka bumps the epoch after
    /// an abortable error's abort, and Kafka can take that bump from an older epoch for a
    /// retry, fencing the new holder's producer instead.
    pub fn may_be_taken(&self) -> bool {
        let from = self.0.takeable.load(std::sync::atomic::Ordering::SeqCst);
        from > 0 && since_base(Instant::now()) >= from
    }

    /// Not valid from now on.
    pub fn revoke(&self) {
        self.0.until.store(0, std::sync::atomic::Ordering::SeqCst);
    }

    /// Waits out a takeover wait: `true` once valid, `false` as soon as leadership is lost.
    pub async fn wait_valid(&self) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        loop {
            if self.is_valid() {
                return true;
            }
            let until = self.0.until.load(SeqCst);
            let from = self.0.from.load(SeqCst);
            let now = since_base(Instant::now());
            if until == 0 || now >= until {
                return false;
            }
            // Short steps: a loss (revoke) ends the wait within one. Past `from`, only a
            // lapsed cap holds it back: it is looked at again every 100 ms.
            let left = match from.saturating_sub(now) {
                0 => Duration::from_millis(100),
                n => Duration::from_nanos(n),
            };
            tokio::time::sleep(left.clamp(Duration::from_millis(1), Duration::from_millis(100)))
                .await;
        }
    }
}

/// How long a new leader waits after taking the lease over before it publishes (or reads a
/// checkpoint): an old leader's last message may be delivered up to `longest_delivery` after
/// it was handed over, and the old leader hands over only until `renew_deadline` after its
/// last renewal began, which the others see at least `lease_duration` before they take over.
pub fn takeover_wait(cfg: &LeaderElectionConfig, longest_delivery: Duration) -> Duration {
    longest_delivery.saturating_sub(cfg.lease_duration.saturating_sub(cfg.renew_deadline))
}

/// The annotation a holder writes on its Lease at each renewal: how long after a renewal
/// began a message handed over under the Lease can still be delivered (`renew_deadline`
/// plus its longest delivery, or more while its own takeover wait still covers an earlier
/// holder's), as a humantime duration followed by `;` and the holder's identity
/// (`35s;pod-a`): a value another holder left (a release without this annotation renewed the
/// Lease since) is not taken for the current holder's.
pub const DELIVERED_WITHIN_ANNOTATION: &str = "kube-event-bridge.io/delivered-within";

/// How long a taker waits after taking a lease over from a holder whose messages may be
/// delivered until `delivered_within` after its last renewal began, when the lease lasts
/// `lease_duration` (the taker judged it expired at least that long after that renewal).
pub fn holders_wait(delivered_within: Duration, lease_duration: Duration) -> Duration {
    delivered_within.saturating_sub(lease_duration)
}

/// What `lease`'s [`DELIVERED_WITHIN_ANNOTATION`] says, if `holder` wrote it.
pub fn delivered_within_of(lease: &Lease, holder: &str) -> Option<Duration> {
    let (within, by) = lease
        .metadata
        .annotations
        .as_ref()?
        .get(DELIVERED_WITHIN_ANNOTATION)?
        .rsplit_once(';')?;
    (by == holder).then_some(())?;
    humantime_serde::re::humantime::parse_duration(within.trim()).ok()
}

/// The [`DELIVERED_WITHIN_ANNOTATION`] value `holder` writes: `within` rounded up to whole
/// seconds, tagged with it.
pub fn delivered_within_text(within: Duration, holder: &str) -> String {
    let whole = Duration::from_millis(within.as_millis().div_ceil(1000) as u64 * 1000);
    format!(
        "{};{holder}",
        humantime_serde::re::humantime::format_duration(whole)
    )
}

/// A request to hand a lease on: the follower stops publishing, drains what it handed over and
/// writes its checkpoints, then answers whether nothing is left on its way (see the module
/// docs).
pub type Handover = tokio::sync::oneshot::Sender<bool>;

/// A lease this replica lost while leading is held by another now (see
/// [`LeaderElector::deposals`]).
#[derive(Debug, Clone)]
pub struct Deposal {
    /// The terms begun here when it was seen (see [`LeaderElector::terms`]): a later term
    /// of this replica makes it stale.
    pub term: u64,
    /// The identity holding the lease.
    pub holder: String,
    /// From when another could take it: the start of this replica's last renewal plus the
    /// lease's duration. A producer of the lost term closed cleanly before then was closed
    /// before any taker's could fence it.
    pub takeable_from: Instant,
}

/// The longest takeover wait a configuration may imply (see [`takeover_wait`]): longer, and
/// a failover publishes nothing for minutes.
pub const MAX_TAKEOVER_WAIT: Duration = Duration::from_secs(300);

/// One candidate for the lease. See the module docs.
pub struct LeaderElector {
    api: Api<Lease>,
    name: String,
    identity: String,
    lease_duration: Duration,
    renew_deadline: Duration,
    retry_period: Duration,
    leading: watch::Sender<bool>,
    // Terms begun so far (each change to leading), counted before the change is sent.
    terms: std::sync::Arc<std::sync::atomic::AtomicU64>,
    fence: Fence,
    takeover_wait: Duration,
    gauge: IntGauge,
    // The last lease record seen and when it was first seen.
    observed: Option<(LeaseRecord, Instant)>,
    // With sharding: whether to campaign for (and keep renewing) this lease now.
    campaign: Option<watch::Receiver<bool>>,
    // Where requests to hand the lease on go (see `handovers`).
    handovers: Option<tokio::sync::mpsc::UnboundedSender<Handover>>,
    // What this holder writes as `DELIVERED_WITHIN_ANNOTATION`.
    delivered_within: Duration,
    // `keb_takeover_wait_seconds` of this lease.
    wait_gauge: Option<prometheus::Gauge>,
    // Where deposals go (see `deposals`), and a lease lost while leading waiting to be seen
    // held by another: from when another could take it.
    deposals: Option<tokio::sync::mpsc::UnboundedSender<Deposal>>,
    lost: Option<Instant>,
}

/// What identifies a lease record for expiry: its holder and renew time.
type LeaseRecord = (Option<String>, Option<jiff::Timestamp>);

enum Outcome {
    /// Holds the lease; `took_over` when it was another's (or an earlier run's of this
    /// identity), not released.
    Leading {
        took_over: bool,
        /// What the last holder's annotation implies (see [`holders_wait`]).
        holders_wait: Option<Duration>,
    },
    /// Another holds it (`holder`, when the read said whom).
    NotLeading {
        holder: Option<String>,
    },
    Failed(String),
}

impl LeaderElector {
    /// A candidate for the lease described by `cfg` (namespace and identity already resolved),
    /// extending `fence` while it leads; after taking a lease over it waits `takeover_wait`
    /// (see [`takeover_wait`]) before the fence is valid.
    pub fn new(
        client: Client,
        cfg: &LeaderElectionConfig,
        namespace: &str,
        identity: String,
        fence: Fence,
        takeover_wait: Duration,
        gauge: IntGauge,
    ) -> Self {
        fence.revoke();
        gauge.set(0);
        Self {
            api: Api::namespaced(client, namespace),
            name: cfg.lease_name.clone(),
            identity,
            lease_duration: cfg.lease_duration,
            renew_deadline: cfg.renew_deadline,
            retry_period: cfg.retry_period,
            leading: watch::channel(false).0,
            terms: Default::default(),
            fence,
            takeover_wait,
            gauge,
            observed: None,
            campaign: None,
            handovers: None,
            delivered_within: cfg.lease_duration + takeover_wait,
            wait_gauge: None,
            deposals: None,
            lost: None,
        }
    }

    /// This holder's messages are delivered within `longest` of their hand-over (the
    /// longest delivery of its sinks): what its renewals tell the next holder (see the
    /// module docs). Without it, what its own takeover wait implies.
    pub fn delivering_within(mut self, cfg: &LeaderElectionConfig, longest: Duration) -> Self {
        self.delivered_within = cfg.renew_deadline + longest;
        self
    }

    /// Shows the takeover wait's remaining seconds in `gauge`.
    pub fn takeover_gauge(mut self, gauge: prometheus::Gauge) -> Self {
        self.wait_gauge = Some(gauge);
        self
    }

    /// The same candidate for Lease `name` instead of `leader_election.lease_name` (a
    /// shard's).
    pub fn for_lease(mut self, name: String) -> Self {
        self.name = name;
        self
    }

    /// Campaigns only while `campaign` says so: when it turns false a candidate stops
    /// trying, and a leader hands the lease on through [`handovers`](Self::handovers) if
    /// something follows them; otherwise (or when that drain fails) it stops renewing and
    /// publishing at once, and the lease expires for the others (it is not released, as
    /// messages may still be on their way).
    pub fn campaign_while(mut self, campaign: watch::Receiver<bool>) -> Self {
        self.campaign = Some(campaign);
        self
    }

    /// Requests to hand the lease on (see the module docs): answer each once this replica
    /// publishes nothing more under the lease, `true` if nothing it handed over is still on
    /// its way.
    pub fn handovers(&mut self) -> tokio::sync::mpsc::UnboundedReceiver<Handover> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        self.handovers = Some(tx);
        rx
    }

    /// Deposals: a lease this replica lost while leading (not released, not handed on) seen
    /// held by another identity, reported once per loss.
    pub fn deposals(&mut self) -> tokio::sync::mpsc::UnboundedReceiver<Deposal> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        self.deposals = Some(tx);
        rx
    }

    /// The lease was read held by `holder` (`None`: released or unknown): a loss waiting for
    /// its taker is reported (see [`Self::deposals`]).
    fn seen_held_by(&mut self, holder: Option<&str>) {
        let Some(holder) = holder.filter(|h| *h != self.identity) else {
            return;
        };
        let Some(takeable_from) = self.lost.take() else {
            return;
        };
        warn!(lease = %self.name, holder, "The lease this replica lost is held by another now: its transactional producers of the lease count as fenced");
        if let Some(tx) = &self.deposals {
            let _ = tx.send(Deposal {
                term: self.terms.load(std::sync::atomic::Ordering::SeqCst),
                holder: holder.to_owned(),
                takeable_from,
            });
        }
    }

    /// The Lease it campaigns for.
    pub fn lease_name(&self) -> &str {
        &self.name
    }

    /// Whether this replica leads, now and on every change.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.leading.subscribe()
    }

    /// How many terms (changes to leading) have begun so far, counted before each change is
    /// sent: a subscriber that sees a count more than one past the last it saw missed a whole
    /// term (a loss and a regain reported as one change).
    pub fn terms(&self) -> std::sync::Arc<std::sync::atomic::AtomicU64> {
        self.terms.clone()
    }

    /// The fence this candidate extends while it leads.
    pub fn fence(&self) -> Fence {
        self.fence.clone()
    }

    /// This candidate's identity.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Records the outcome of an attempt. Subscribers hear only of *changes*: a renewal of
    /// a lease already held says nothing (each `send` would wake `changed()`, and the
    /// follower replays its cache on every wake-up).
    fn set_leading(&self, leading: bool) {
        self.gauge.set(leading as i64);
        let changed = self.leading.send_if_modified(|current| {
            let changed = *current != leading;
            if changed && leading {
                self.terms.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            *current = leading;
            changed
        });
        if changed {
            if leading {
                info!(lease = %self.name, identity = %self.identity, "Became the leader");
            } else {
                warn!(lease = %self.name, identity = %self.identity, "Stopped leading");
            }
        }
    }

    /// Campaigns and renews until `cancel` fires; then releases the lease if it leads.
    pub async fn run(mut self, cancel: CancellationToken) {
        let mut last_renewal: Option<Instant> = None;
        let mut last_observed: Option<Instant> = None;
        // A hand-over under way (the follower's answer), and whether the last one failed.
        let mut draining: Option<tokio::sync::oneshot::Receiver<bool>> = None;
        let mut handover_failed = false;
        loop {
            let campaigning = self
                .campaign
                .as_mut()
                .is_none_or(|c| *c.borrow_and_update());
            if campaigning {
                handover_failed = false;
            } else if draining.is_none()
                && !handover_failed
                && last_renewal.is_some()
                // Still waiting to publish: nothing to drain, and a released lease would let
                // the next holder skip the wait the last one's messages need.
                && !self.fence.in_takeover_wait()
                && let Some(handovers) = &self.handovers
            {
                let (answer, answered) = tokio::sync::oneshot::channel();
                if handovers.send(answer).is_ok() {
                    info!(lease = %self.name, "Handing the lease on: renewing it while what was handed over drains");
                    draining = Some(answered);
                }
            }
            if !campaigning && draining.is_none() {
                if last_renewal.take().is_some() {
                    info!(lease = %self.name, "Handing the lease on: no longer renewing it");
                }
                self.fence.revoke();
                self.set_leading(false);
                // Keeps watching the lease (a read every third of its duration), so that a
                // later campaign judges its expiry from when a renewal was last seen, not
                // from when the campaign began.
                if last_observed.is_none_or(|t: Instant| t.elapsed() >= self.lease_duration / 3) {
                    self.observe().await;
                    last_observed = Some(Instant::now());
                }
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = tokio::time::sleep(self.retry_period) => {}
                }
                continue;
            }
            // An attempt may take long (the client retries 5xx itself): bound it, so that a
            // leader steps down by the renew deadline whatever the API server does.
            let deadline = last_renewal.map_or(Instant::now() + self.renew_deadline, |t| {
                t + self.renew_deadline
            });
            // A renewal counts from when its request started: the lease's new renew time is
            // no later than that, as the others see it.
            let started = Instant::now();
            let outcome = tokio::time::timeout_at(deadline, self.try_acquire_or_renew())
                .await
                .unwrap_or_else(|_| Outcome::Failed("no answer before the renew deadline".into()));
            let now = Instant::now();
            match outcome {
                Outcome::Leading {
                    took_over,
                    holders_wait,
                } => {
                    if last_renewal.is_none() {
                        let wait = if took_over {
                            self.takeover_wait.max(holders_wait.unwrap_or_default())
                        } else {
                            Duration::ZERO
                        };
                        if !wait.is_zero() {
                            info!(lease = %self.name, wait = ?wait, own = ?self.takeover_wait, holders = ?holders_wait, "Took the lease over; publishing after the takeover wait (the last leader's messages may still be delivered until then)");
                        }
                        // From when the lease was judged expired (after the read), not
                        // from when the attempt began.
                        self.fence.not_before(now + wait);
                        if !wait.is_zero() {
                            self.show_wait(now + wait);
                        }
                    }
                    last_renewal = Some(started);
                    self.lost = None;
                    self.fence.takeable_from(started + self.lease_duration);
                    self.fence.extend_to(started + self.renew_deadline);
                    self.set_leading(true);
                }
                Outcome::NotLeading { holder } => {
                    // Found held by another while leading: lost, and another's already.
                    if let Some(t) = last_renewal {
                        self.lost = Some(t + self.lease_duration);
                        self.fence.takeable_from(now);
                    }
                    last_renewal = None;
                    draining = None;
                    self.fence.revoke();
                    self.set_leading(false);
                    self.seen_held_by(holder.as_deref());
                }
                Outcome::Failed(reason) => {
                    debug!(lease = %self.name, reason, "Lease update failed");
                    // Step down once renewals have failed for the renew deadline: before the
                    // lease can expire for the others.
                    if last_renewal.is_some_and(|t| now.duration_since(t) >= self.renew_deadline) {
                        warn!(lease = %self.name, reason, "Could not renew the lease in time");
                        self.lost = last_renewal.take().map(|t| t + self.lease_duration);
                        draining = None;
                        self.fence.revoke();
                        self.set_leading(false);
                    }
                }
            }
            let answer = async {
                match draining.as_mut() {
                    Some(answered) => answered.await.unwrap_or(false),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep(self.retry_period) => {}
                drained = answer => {
                    draining = None;
                    if drained {
                        // Nothing of this replica is on its way: the next owner may start
                        // at once.
                        self.release().await;
                        last_renewal = None;
                    } else {
                        // The follower stopped publishing: the term ends whatever the campaign
                        // says now (wanted again, the lease is taken up again as after a
                        // takeover, with its wait).
                        warn!(lease = %self.name, "What was handed over did not drain; the lease expires instead of being released");
                        handover_failed = true;
                        last_renewal = None;
                        self.fence.revoke();
                        self.set_leading(false);
                    }
                }
            }
        }
        self.release().await;
    }

    /// Reads the lease without writing and notes when its record (holder, renew time) was
    /// first seen, as an attempt does.
    async fn observe(&mut self) {
        let Ok(Some(lease)) = self.api.get_opt(&self.name).await else {
            return;
        };
        let spec = lease.spec.unwrap_or_default();
        let record = (
            spec.holder_identity.filter(|h| !h.is_empty()),
            spec.renew_time.map(|t| t.0),
        );
        self.seen_held_by(record.0.as_deref());
        if self.observed.as_ref().is_none_or(|(r, _)| *r != record) {
            self.observed = Some((record, Instant::now()));
        }
    }

    async fn try_acquire_or_renew(&mut self) -> Outcome {
        let now = jiff::Timestamp::now();
        let existing = match self.api.get_opt(&self.name).await {
            Ok(l) => l,
            Err(e) => return Outcome::Failed(format!("get lease: {e}")),
        };
        let Some(mut lease) = existing else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    annotations: Some(
                        [(
                            DELIVERED_WITHIN_ANNOTATION.to_owned(),
                            self.delivered_within_text(Duration::ZERO),
                        )]
                        .into(),
                    ),
                    ..Default::default()
                },
                spec: Some(self.spec(now, now, 0)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Outcome::Leading {
                    took_over: false,
                    holders_wait: None,
                },
                Err(kube::Error::Api(s)) if s.code == 409 => Outcome::NotLeading { holder: None },
                Err(e) => Outcome::Failed(format!("create lease: {e}")),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let record = (holder.clone(), spec.renew_time.as_ref().map(|t| t.0));
        let seen_at = match &self.observed {
            Some((r, at)) if *r == record => *at,
            _ => {
                let at = Instant::now();
                self.observed = Some((record, at));
                at
            }
        };
        let ours = holder.as_deref() == Some(self.identity.as_str());
        let duration = spec
            .lease_duration_seconds
            .map_or(
                self.lease_duration,
                |s| Duration::from_secs(s.max(1) as u64),
            );
        if !ours && holder.is_some() && seen_at.elapsed() < duration {
            return Outcome::NotLeading { holder };
        }
        let (acquired, transitions) = if ours {
            (
                spec.acquire_time.map_or(now, |t| t.0),
                spec.lease_transitions.unwrap_or(0),
            )
        } else {
            (now, spec.lease_transitions.unwrap_or(0) + 1)
        };
        // What the last holder said of its deliveries (a holder of another release: nothing).
        // What the last holder said of its deliveries, if it said it (an earlier run of this
        // identity counts: its messages may still be on their way too).
        let holders_wait = holder
            .as_deref()
            .and_then(|h| delivered_within_of(&lease, h))
            .map(|within| holders_wait(within, duration));
        // Taking it over, this holder waits for the last one's messages: the wait it owes
        // is part of what it writes from the start.
        let owed = if holder.is_some() && !*self.leading.borrow() {
            self.takeover_wait.max(holders_wait.unwrap_or_default())
        } else {
            self.fence.takeover_left().unwrap_or_default()
        };
        lease.spec = Some(self.spec(acquired, now, transitions));
        lease.metadata.annotations.get_or_insert_default().insert(
            DELIVERED_WITHIN_ANNOTATION.to_owned(),
            self.delivered_within_text(owed),
        );
        // `replace` sends the resourceVersion we read: a concurrent writer makes it fail with 409.
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Outcome::Leading {
                took_over: holder.is_some(),
                holders_wait,
            },
            Err(kube::Error::Api(s)) if s.code == 409 => {
                if ours {
                    Outcome::Failed("conflict while renewing".into())
                } else {
                    Outcome::NotLeading { holder: None }
                }
            }
            Err(e) => Outcome::Failed(format!("update lease: {e}")),
        }
    }

    /// The annotation's value: this holder's own bound, or longer while the takeover wait it
    /// `owed` (from this renewal on) still covers an earlier holder's messages, so that the
    /// wait still owed travels on to whoever takes the Lease next. Rounded up to seconds.
    fn delivered_within_text(&self, owed: Duration) -> String {
        delivered_within_text(self.delivered_within.max(owed), &self.identity)
    }

    /// Counts `keb_takeover_wait_seconds` down to `until` while the fence waits for it, and
    /// logs the end of the wait.
    fn show_wait(&self, until: Instant) {
        let (fence, name) = (self.fence.clone(), self.name.clone());
        let gauge = self.wait_gauge.clone();
        tokio::spawn(async move {
            loop {
                let left = until.saturating_duration_since(Instant::now());
                if let Some(g) = &gauge {
                    g.set(left.as_secs_f64());
                }
                if left.is_zero() || !fence.in_takeover_wait() {
                    break;
                }
                tokio::time::sleep(left.min(Duration::from_millis(500))).await;
            }
            if let Some(g) = &gauge {
                g.set(0.0);
            }
            if fence.is_valid() {
                info!(lease = %name, "The takeover wait is over: publishing");
            }
        });
    }

    fn spec(
        &self,
        acquired: jiff::Timestamp,
        renewed: jiff::Timestamp,
        transitions: i32,
    ) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(lease_seconds(self.lease_duration)),
            acquire_time: Some(MicroTime(acquired)),
            renew_time: Some(MicroTime(renewed)),
            lease_transitions: Some(transitions),
            ..Default::default()
        }
    }

    /// Gives the lease up if held, so that a standby takes over without waiting for expiry.
    async fn release(&self) {
        if !*self.leading.borrow() {
            return;
        }
        // Taken over and still waiting: the last holder's messages may still arrive, and a
        // released lease would let the next holder publish without waiting.
        let waiting = self.fence.in_takeover_wait();
        self.fence.revoke();
        if !waiting {
            // Released below (even when its answer is lost): another may hold it at once.
            self.fence.takeable_from(Instant::now());
        }
        self.set_leading(false);
        if waiting {
            info!(lease = %self.name, "Not releasing the lease during its takeover wait; it expires");
            return;
        }
        let Ok(Some(mut lease)) = self.api.get_opt(&self.name).await else {
            return;
        };
        let spec = lease.spec.get_or_insert_default();
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return;
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(jiff::Timestamp::now()));
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => info!(lease = %self.name, "Released the lease"),
            Err(e) => {
                warn!(lease = %self.name, error = %e, "Could not release the lease; it will expire")
            }
        }
    }
}

/// `leaseDurationSeconds` for `duration`: whole seconds, rounded up (at least 1). Rounding
/// down would let the others take the lease over before the holder's own deadline (a 4.5 s
/// lease read as 4 s eats half a second of the margin `lease_duration - renew_deadline`).
pub fn lease_seconds(duration: Duration) -> i32 {
    let whole = duration.as_secs() + u64::from(duration.subsec_nanos() > 0);
    whole.clamp(1, i32::MAX as u64) as i32
}

/// This replica's identity: the configured one, else `$POD_NAME`, else the host name.
pub fn default_identity(cfg: &LeaderElectionConfig) -> String {
    cfg.identity
        .clone()
        .or_else(|| std::env::var("POD_NAME").ok())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
        })
        .unwrap_or_else(|| format!("kube-event-bridge-{}", std::process::id()))
}

/// The lease's namespace: the configured one, else `$POD_NAMESPACE`, else the service
/// account's namespace, else `default`.
pub fn default_namespace(cfg: &LeaderElectionConfig) -> String {
    cfg.namespace
        .clone()
        .or_else(|| std::env::var("POD_NAMESPACE").ok())
        .or_else(|| {
            std::fs::read_to_string("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
                .ok()
                .map(|n| n.trim().to_owned())
        })
        .unwrap_or_else(|| "default".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_seconds_round_up() {
        assert_eq!(lease_seconds(Duration::from_millis(4500)), 5);
        assert_eq!(lease_seconds(Duration::from_secs(15)), 15);
        assert_eq!(lease_seconds(Duration::from_millis(300)), 1);
        assert_eq!(lease_seconds(Duration::ZERO), 1);
    }

    #[test]
    fn the_takeover_wait_is_the_longest_delivery_beyond_the_lease_margin() {
        let cfg = LeaderElectionConfig::default();
        // 15 s lease, 10 s renew deadline: 5 s pass between the old leader's last hand-over
        // and the takeover at the least.
        assert_eq!(
            takeover_wait(&cfg, Duration::from_secs(30)),
            Duration::from_secs(25)
        );
        assert_eq!(takeover_wait(&cfg, Duration::from_secs(3)), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_fence_is_valid_from_the_takeover_wait_until_the_deadline() {
        let fence = Fence::default();
        assert!(!fence.is_valid(), "not leading");
        let now = Instant::now();
        fence.extend_to(now + Duration::from_secs(10));
        fence.not_before(now + Duration::from_secs(3));
        assert!(!fence.is_valid(), "waiting");
        assert!(fence.wait_valid().await);
        assert!(now.elapsed() >= Duration::from_secs(3));
        tokio::time::sleep(Duration::from_secs(7)).await;
        assert!(!fence.is_valid(), "past the deadline");
        // A loss ends a takeover wait at once.
        let now = Instant::now();
        fence.extend_to(now + Duration::from_secs(10));
        fence.not_before(now + Duration::from_secs(5));
        let waiting = tokio::spawn({
            let fence = fence.clone();
            async move { fence.wait_valid().await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        fence.revoke();
        assert!(!waiting.await.unwrap());
        assert!(now.elapsed() < Duration::from_secs(2));
    }

    /// The lease may be another's once the last renewal's duration ran out, revoked or not.
    #[tokio::test(start_paused = true)]
    async fn the_lease_may_be_taken_once_the_last_renewals_duration_ran_out() {
        let fence = Fence::default();
        assert!(!fence.may_be_taken(), "never led");
        let renewed = Instant::now();
        fence.extend_to(renewed + Duration::from_secs(10));
        fence.takeable_from(renewed + Duration::from_secs(15));
        tokio::time::sleep(Duration::from_secs(11)).await;
        fence.revoke();
        assert!(
            !fence.may_be_taken(),
            "past the renew deadline, within the lease"
        );
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert!(fence.may_be_taken());
        assert_eq!(fence.takeable_at(), Some(renewed + Duration::from_secs(15)));
    }
}
