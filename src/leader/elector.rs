//! The elector: campaigns for a Lease, renews it, hands it on, and reports its loss.

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

use super::{
    fence::Fence,
    handoff::{
        DELIVERED_WITHIN_ANNOTATION, FENCED_BY_ANNOTATION, FencedBy, delivered_within_of,
        delivered_within_text, holders_wait, lease_seconds, takeover_wait,
    },
    settings::LeaderElectionConfig,
};

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

/// One candidate for the lease. See [`crate::leader`].
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
    // What fences its messages besides timers (see `announcing_transactions`).
    fencing: Option<Fencing>,
    // `keb_takeover_wait_seconds` of this lease.
    wait_gauge: Option<prometheus::Gauge>,
    // Where deposals go (see `deposals`), and a lease lost while leading waiting to be seen
    // held by another: from when another could take it.
    deposals: Option<tokio::sync::mpsc::UnboundedSender<Deposal>>,
    lost: Option<Instant>,
}

/// What a holder's transactions fence (see [`LeaderElector::announcing_transactions`]).
struct Fencing {
    /// The `transactional.id`s of its producers under the lease.
    ids: Vec<String>,
    /// The takeover wait its own settings give what those do not fence.
    unfenced_wait: Duration,
    /// What it announces as `unfencedWithin` (before what its own wait still owes).
    unfenced_within: Duration,
}

/// What identifies a lease record for expiry: its holder and renew time.
type LeaseRecord = (Option<String>, Option<jiff::Timestamp>);

/// The wait a taker owes the last holder's messages.
#[derive(Debug, Clone, Copy, Default)]
struct Takeover {
    wait: Duration,
    /// The shorter wait once this taker's producers fenced the holder's transactions, when
    /// they can (see [`LeaderElector::announcing_transactions`]): what it sent otherwise.
    fenced: Option<Duration>,
}

enum Outcome {
    /// Holds the lease; `took_over` when it was another's (or an earlier run's of this
    /// identity), not released.
    Leading {
        took_over: bool,
        /// How long to wait before publishing, when taken over (see [`Takeover`]).
        takeover: Takeover,
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
    /// (see [`super::takeover_wait`]) before the fence is valid.
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
            fencing: None,
            wait_gauge: None,
            deposals: None,
            lost: None,
        }
    }

    /// This holder's messages are delivered within `longest` of their hand-over (the
    /// longest delivery of its sinks): what its renewals tell the next holder (see the
    /// docs of [`crate::leader`]). Without it, what its own takeover wait implies.
    pub fn delivering_within(mut self, cfg: &LeaderElectionConfig, longest: Duration) -> Self {
        self.delivered_within = cfg.renew_deadline + longest;
        self
    }

    /// This holder's messages under the lease go through transactional producers of `ids`
    /// (every one of them in a transaction: see [`crate::sinks::kafka`]'s `exactly_once`)
    /// and otherwise through sinks delivered within `longest_unfenced` of their hand-over.
    /// Each renewal announces that ([`FENCED_BY_ANNOTATION`]); taking over from a holder
    /// whose ids are all among `ids`, this candidate's producers fence that holder's
    /// transactions when its term begins, and from then on it waits only for the rest: its
    /// own takeover wait for `longest_unfenced`, or longer if the holder's announcement says
    /// so. Until its producers started (see [`super::Fence::holder_fenced`]) the full wait
    /// stands, and is what it announces as owed. A holder that announced other ids, or
    /// nothing (an older release), is waited out in full.
    pub fn announcing_transactions(
        mut self,
        cfg: &LeaderElectionConfig,
        ids: Vec<String>,
        longest_unfenced: Duration,
    ) -> Self {
        self.fencing = Some(Fencing {
            ids,
            unfenced_wait: takeover_wait(cfg, longest_unfenced),
            unfenced_within: cfg.renew_deadline + longest_unfenced,
        });
        self
    }

    /// What taking the lease over from a holder owes it, by what the holder wrote
    /// (`holders_wait`: its [`DELIVERED_WITHIN_ANNOTATION`]'s; `announced`: its
    /// [`FENCED_BY_ANNOTATION`]) for a lease of `duration`.
    fn takeover(
        &self,
        holders_wait: Option<Duration>,
        announced: Option<FencedBy>,
        duration: Duration,
    ) -> Takeover {
        let wait = self.takeover_wait.max(holders_wait.unwrap_or_default());
        let fenced = match (&self.fencing, announced) {
            (Some(own), Some(announced)) if announced.covered_by(&own.ids) => Some(
                own.unfenced_wait
                    .max(super::holders_wait(announced.unfenced_within, duration))
                    .min(wait),
            ),
            _ => None,
        };
        Takeover { wait, fenced }
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

    /// Requests to hand the lease on (see [`crate::leader`]): answer each once this replica
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
                    takeover,
                } => {
                    let mut shown = false;
                    if last_renewal.is_none() {
                        let takeover = if took_over {
                            takeover
                        } else {
                            Takeover::default()
                        };
                        let wait = takeover.wait;
                        if let Some(fenced_wait) = takeover.fenced.filter(|_| !wait.is_zero()) {
                            info!(lease = %self.name, wait = ?wait, fenced_wait = ?fenced_wait, "Took the lease over; publishing after the takeover wait, or after fenced_wait once this replica's producers fenced the last leader's transactions (its other messages may still be delivered until then)");
                        } else if !wait.is_zero() {
                            info!(lease = %self.name, wait = ?wait, own = ?self.takeover_wait, "Took the lease over; publishing after the takeover wait (the last leader's messages may still be delivered until then)");
                        }
                        shown = !wait.is_zero();
                        // From when the lease was judged expired (after the read), not
                        // from when the attempt began.
                        self.fence
                            .not_before(now + wait, takeover.fenced.map(|w| now + w));
                    }
                    last_renewal = Some(started);
                    self.lost = None;
                    self.fence.takeable_from(started + self.lease_duration);
                    self.fence.extend_to(started + self.renew_deadline);
                    // Once the fence is extended: a count started before would find no wait
                    // under way (a first term's fence had no deadline yet) and end at once.
                    if shown {
                        self.show_wait();
                    }
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
                    annotations: Some(self.annotations(Duration::ZERO, now).into_iter().collect()),
                    ..Default::default()
                },
                spec: Some(self.spec(now, now, 0)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Outcome::Leading {
                    took_over: false,
                    takeover: Takeover::default(),
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
        // What the last holder said of its deliveries, if it said it (an earlier run of this
        // identity counts: its messages may still be on their way too; a holder of another
        // release: nothing).
        let holders_wait = holder
            .as_deref()
            .and_then(|h| delivered_within_of(&lease, h))
            .map(|within| holders_wait(within, duration));
        let announced = holder.as_deref().and_then(|h| FencedBy::of(&lease, h));
        // Taking it over, this holder waits for the last one's messages: the wait it owes
        // is part of what it writes from the start.
        let takeover = if holder.is_some() && !*self.leading.borrow() {
            self.takeover(holders_wait, announced, duration)
        } else {
            Takeover::default()
        };
        // The full wait until this term's producers fenced the holder's (the fence then says
        // what is left of the shorter one).
        let owed = if holder.is_some() && !*self.leading.borrow() {
            takeover.wait
        } else {
            self.fence.takeover_left().unwrap_or_default()
        };
        lease.spec = Some(self.spec(acquired, now, transitions));
        lease
            .metadata
            .annotations
            .get_or_insert_default()
            .extend(self.annotations(owed, now));
        // `replace` sends the resourceVersion we read: a concurrent writer makes it fail with 409.
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Outcome::Leading {
                took_over: holder.is_some(),
                takeover,
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

    /// The annotations a renewal writes: this holder's own bounds, or longer while the
    /// takeover wait it `owed` (from this renewal on) still covers an earlier holder's
    /// messages, so that the wait still owed travels on to whoever takes the Lease next
    /// (rounded up to seconds); with [`Self::announcing_transactions`], what its
    /// transactions fence, tied to this renewal's `renewed` time.
    fn annotations(&self, owed: Duration, renewed: jiff::Timestamp) -> Vec<(String, String)> {
        let mut written = vec![(
            DELIVERED_WITHIN_ANNOTATION.to_owned(),
            delivered_within_text(self.delivered_within.max(owed), &self.identity),
        )];
        if let Some(own) = &self.fencing {
            let announced = FencedBy {
                holder: self.identity.clone(),
                renewed,
                transactional_ids: own.ids.clone(),
                unfenced_within: own.unfenced_within.max(owed),
            };
            written.push((FENCED_BY_ANNOTATION.to_owned(), announced.text()));
        }
        written
    }

    /// Counts `keb_takeover_wait_seconds` down while the fence waits (a wait that the term's
    /// producers shortened shows shorter from then on), and logs the end of the wait.
    fn show_wait(&self) {
        let (fence, name) = (self.fence.clone(), self.name.clone());
        let gauge = self.wait_gauge.clone();
        tokio::spawn(async move {
            loop {
                let left = fence.takeover_left().unwrap_or_default();
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
