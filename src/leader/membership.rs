//! Which replicas share the shards, and which shards each one should own: every replica
//! renews a membership Lease (`{lease_name}-member-{identity}`, labelled
//! [`MEMBER_LABEL`]`={lease_name}`), lists the others' and counts those it has seen renewed
//! within `lease_duration` (judged by when this replica *saw* a renewal, never by comparing
//! clocks, as the elector judges a lease). From the same view every replica computes the same
//! assignment ([`assign`]): each shard goes to the member that ranks it highest (rendezvous
//! hashing) among those holding fewer than ⌈M/N⌉, so a change of membership moves few
//! shards. A replica campaigns for the shards assigned to it and stops renewing the others;
//! the shard Leases (see [`crate::leader`]) decide who actually owns each one, so replicas
//! whose views differ for a moment cannot both publish a shard.
//!
//! Membership Leases are named after pods, which a Deployment renames at every rollout: a
//! replica that leaves deletes its own, and every replica deletes those it has seen
//! unrenewed for [`forgotten_after`] (with the resourceVersion it read as a precondition, so
//! a renewal in between wins; a replica whose Lease was deleted while it lived creates it
//! again at its next renewal).

use std::{
    collections::{BTreeSet, HashMap},
    time::Duration,
};

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::MicroTime,
};
use kube::{
    Api, Client,
    api::{DeleteParams, ListParams, ObjectMeta, PostParams, Preconditions},
};
use prometheus::IntGauge;
use tokio::{sync::watch, time::Instant};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::{
    leader::{FenceCap, LeaderElectionConfig},
    shard::{Shard, fnv1a64},
};

/// The label every membership Lease carries, with the shard leases' base name as its value.
pub const MEMBER_LABEL: &str = "kube-event-bridge.io/members-of";

/// The annotation on a membership Lease naming its replica's number of shards: replicas
/// with another number (a rollout that changes `sharding.shards`) split the objects
/// differently, and both publishing would interleave two publishers per key.
pub const SHARDS_ANNOTATION: &str = "kube-event-bridge.io/shards";

/// The single-leader Lease's holder while sharded replicas publish: this, then their shard
/// count (`kube-event-bridge.io/shards-12`). No pod is named so.
pub const GROUP_HOLDER_PREFIX: &str = "kube-event-bridge.io/shards-";

/// On the single-leader Lease, written by the sharded replica that took it over from an
/// expired holder: how long every member waits, from when it first sees this, before it
/// claims shards (the last holder's messages may still be on their way).
pub const GROUP_WAIT_ANNOTATION: &str = "kube-event-bridge.io/group-takeover-wait";

/// How long a replica that just started looks at the membership before it claims shards:
/// two `retry_period`s (replicas started with it write their Leases at their first pass),
/// at most `lease_duration`. Every live member's Lease is counted from the first list (a
/// Lease seen for the first time counts as renewed then), so waiting longer would only
/// leave the shards the others hand it unowned: with the default settings a scale-out took
/// a whole lease duration (15 s) before; now about 4 s. A claim made too early costs a
/// hand-over later (drained, so nothing is sent twice, unless the drain outlasts
/// `shutdown.grace_period`: then the Lease expires as after a crash), and the shard Leases
/// keep two replicas from ever publishing one shard.
pub fn settle_time(lease_duration: Duration, retry_period: Duration) -> Duration {
    (retry_period * 2).min(lease_duration)
}

/// At most this many unrenewed membership Leases are deleted per pass.
const FORGET_PER_PASS: usize = 5;

/// How long a membership Lease must have gone unrenewed (as this replica saw it) before it
/// deletes it: ten lease durations (its replica was counted out after one; a live replica
/// whose Lease goes creates it again at its next renewal).
pub fn forgotten_after(lease_duration: Duration) -> Duration {
    lease_duration * 10
}

/// The shards assigned to `me` when `members` (sorted, `me` among them) share `shards`: each
/// shard, in order, goes to the member with the highest rendezvous weight for it among those
/// that have fewer than ⌈M/N⌉ so far.
pub fn assign(shards: &[Shard], members: &[String], me: &str) -> BTreeSet<u32> {
    if members.is_empty() {
        return shards.iter().map(|s| s.index).collect();
    }
    let cap = shards.len().div_ceil(members.len());
    let mut held: HashMap<&str, usize> = HashMap::new();
    let mut mine = BTreeSet::new();
    for shard in shards {
        let weight = |m: &str| mix(fnv1a64(format!("{}\u{0}{m}", shard.index).as_bytes()));
        let owner = members
            .iter()
            .filter(|m| held.get(m.as_str()).copied().unwrap_or(0) < cap)
            .max_by_key(|m| (weight(m), std::cmp::Reverse(m.as_str())))
            .expect("the caps add up to at least the number of shards");
        *held.entry(owner.as_str()).or_default() += 1;
        if owner == me {
            mine.insert(shard.index);
        }
    }
    mine
}

/// SplitMix64's finaliser: FNV-1a alone hardly moves its high bits for names that differ
/// at the end (`replica-1`, `replica-2`), which would make the ranking the same for every
/// shard and move most shards at each change of membership.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One replica's membership: renews its Lease, watches the others', and publishes which
/// shards it should own.
pub struct Membership {
    api: Api<Lease>,
    group: String,
    identity: String,
    lease_duration: Duration,
    retry_period: Duration,
    shards: Vec<Shard>,
    wanted: watch::Sender<BTreeSet<u32>>,
    replicas: IntGauge,
    // Per member lease name: the last record seen and when it was first seen.
    observed: HashMap<String, (Record, Instant)>,
    // Unrenewed leases are deleted (until the API server refuses it: RBAC without delete).
    collect: bool,
    // How long a lease stays unrenewed before it is deleted (see `forgotten_after`).
    forget_after: Duration,
    // The single-leader Lease (`lease_name`) as last seen, when it was first seen so, and
    // when the read that saw it started.
    group_seen: Option<(Record, Instant, Instant)>,
    // How long a replica waits before it claims shards after another count's or a single
    // leader's replicas stopped publishing (their messages may still be on their way).
    takeover_wait: Duration,
    // What this replica writes as the group's `delivered-within` (renew deadline plus its
    // longest delivery): a single leader taking the Lease over waits it out.
    delivered_within: Duration,
    renew_deadline: Duration,
    // The deadline every shard's fence is capped by: a confirmed hold on the group Lease
    // plus `renew_deadline`.
    cap: FenceCap,
    // No shard is claimed before then (a takeover wait of the group, or after a conflict).
    claim_after: Option<Instant>,
    // The tag of the group's takeover wait last applied.
    group_wait_tag: Option<String>,
    // What `/readyz` and `keb_takeover_wait_seconds{lease}` show of `claim_after`.
    claim_view: ClaimWait,
    wait_gauge: Option<prometheus::Gauge>,
    // Whether a wait was shown (its end is logged).
    wait_shown: bool,
}

/// Until when a sharded replica claims no shard (a takeover wait of its group: the replicas
/// of another shard count or a single leader stopped publishing, and their messages may
/// still be on their way); `None` when it does not wait.
pub type ClaimWait = std::sync::Arc<std::sync::Mutex<Option<Instant>>>;

/// The group's hold on the single-leader Lease, as one pass found it.
#[derive(Debug, PartialEq)]
enum Group {
    /// Held for this group, and confirmed (the fences' cap extended).
    Ours,
    /// Held, live, by a single leader or another count's group.
    Held(String),
    /// Not known this pass (an error, or a write that lost a race): claims stay as they
    /// are, and the fences' cap lapses unless a later pass confirms the hold in time.
    Unknown(String),
}

/// What identifies a membership lease's renewal: its holder and renew time.
type Record = (Option<String>, Option<jiff::Timestamp>);

impl Membership {
    /// A member named `identity` of the replicas sharing `shards` under the leases of `cfg`
    /// (its name, durations) in `namespace`.
    pub fn new(
        client: Client,
        cfg: &LeaderElectionConfig,
        namespace: &str,
        identity: String,
        shards: Vec<Shard>,
        replicas: IntGauge,
    ) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            group: cfg.lease_name.clone(),
            identity,
            lease_duration: cfg.lease_duration,
            retry_period: cfg.retry_period,
            shards,
            wanted: watch::channel(BTreeSet::new()).0,
            replicas,
            observed: HashMap::new(),
            collect: true,
            forget_after: forgotten_after(cfg.lease_duration),
            group_seen: None,
            takeover_wait: Duration::ZERO,
            delivered_within: cfg.renew_deadline,
            renew_deadline: cfg.renew_deadline,
            cap: FenceCap::default(),
            claim_after: None,
            group_wait_tag: None,
            claim_view: ClaimWait::default(),
            wait_gauge: None,
            wait_shown: false,
        }
    }

    /// Counts the group's takeover wait down in `gauge` (`keb_takeover_wait_seconds` of the
    /// single-leader Lease).
    pub fn takeover_gauge(mut self, gauge: prometheus::Gauge) -> Self {
        self.wait_gauge = Some(gauge);
        self
    }

    /// The single-leader Lease's name, and until when this replica claims no shard as each
    /// pass finds it (for `/readyz`).
    pub fn claim_wait(&self) -> (String, ClaimWait) {
        (self.group.clone(), self.claim_view.clone())
    }

    /// Shows the group's takeover wait (see [`ClaimWait`]) and logs its end.
    fn show_claim_wait(&mut self) {
        let now = Instant::now();
        let until = self.claim_after.filter(|c| *c > now);
        *self.claim_view.lock().unwrap_or_else(|e| e.into_inner()) = until;
        if let Some(g) = &self.wait_gauge {
            g.set(until.map_or(0.0, |u| (u - now).as_secs_f64()));
        }
        if until.is_some() {
            self.wait_shown = true;
        } else if std::mem::take(&mut self.wait_shown) {
            info!(lease = %self.group, "The group's takeover wait is over: claiming shards");
        }
    }

    /// Caps every shard's fence: valid only while this replica's group is confirmed to hold
    /// the single-leader Lease (see [`Self::hold_group`]).
    pub fn capping(mut self, cap: FenceCap) -> Self {
        self.cap = cap;
        self
    }

    /// Writes `within` (renew deadline plus the longest delivery) as the group's
    /// `delivered-within`, which a single leader taking the Lease over waits out.
    pub fn delivering_within(mut self, within: Duration) -> Self {
        self.delivered_within = within;
        self
    }

    /// After the replicas of another shard count or a single leader stop publishing, claims
    /// shards only `wait` later (the longest a message of theirs may still be on its way: the
    /// takeover wait).
    pub fn takeover_wait(mut self, wait: Duration) -> Self {
        self.takeover_wait = wait;
        self
    }

    /// The holder the sharded replicas write into the single-leader Lease: their group.
    fn group_holder(&self) -> String {
        format!("{GROUP_HOLDER_PREFIX}{}", self.shards.len())
    }

    /// Holds the single-leader Lease (`lease_name`) for this replica's group (the sharded
    /// replicas of its shard count), so that a single-leader replica (`sharding.shards: 1`,
    /// of this release or an older one, whose elector reads that Lease) stands by while they
    /// publish, and they stand by while it leads.
    ///
    /// - A live foreign holder (its record seen unchanged for less than its
    ///   `leaseDurationSeconds`, timed from when the read that first showed it returned) is
    ///   [`Group::Held`]: claim nothing.
    /// - Otherwise the hold is confirmed: by seeing another member's renewal since the last
    ///   look (with linearizable reads it was written after that look started), or by
    ///   renewing it (written after the request started). Each confirmation extends every
    ///   shard fence's cap to that start plus `renew_deadline`: a single leader takes the
    ///   Lease over at the earliest `lease_duration` after the last renewal, so no shard of
    ///   this replica publishes by then. A member renews when no other did since its last
    ///   look, when the confirmation it saw would lapse before its next look, or when its own
    ///   `delivered-within` is longer than the one on the Lease.
    /// - Taking it over from an expired holder writes [`GROUP_WAIT_ANNOTATION`] (the
    ///   takeover wait, or the last holder's `delivered-within` beyond the lease duration if
    ///   longer), tagged with the takeover. Every member waits that long from when it first
    ///   sees a tag before it claims shards or extends the cap, and one whose wait is over
    ///   removes it.
    async fn hold_group(&mut self) -> Group {
        let ours = self.group_holder();
        for attempt in 0..2 {
            let start = Instant::now();
            let current = match tokio::time::timeout(
                self.renew_deadline,
                self.api.get_opt(&self.group),
            )
            .await
            {
                Ok(Ok(lease)) => lease,
                Ok(Err(err)) => return Group::Unknown(err.to_string()),
                Err(_) => return Group::Unknown("the read timed out".into()),
            };
            let seen = Instant::now();
            let spec = current
                .as_ref()
                .and_then(|l| l.spec.clone())
                .unwrap_or_default();
            let record: Record = (
                spec.holder_identity.clone().filter(|h| !h.is_empty()),
                spec.renew_time.as_ref().map(|t| t.0),
            );
            let previous = self.group_seen.take();
            let at = match &previous {
                Some((r, at, _)) if *r == record => *at,
                _ => seen,
            };
            self.group_seen = Some((record.clone(), at, start));
            let duration = spec
                .lease_duration_seconds
                .map_or(
                    self.lease_duration,
                    |s| Duration::from_secs(s.max(1) as u64),
                );
            let foreign = record.0.clone().filter(|h| *h != ours);
            if let Some(holder) = &foreign
                && seen.duration_since(at) < duration
            {
                return Group::Held(holder.clone());
            }
            // The group's takeover wait, under this group only (another holder's is stale).
            let wait = current
                .as_ref()
                .and_then(|l| l.metadata.annotations.as_ref()?.get(GROUP_WAIT_ANNOTATION))
                .filter(|_| foreign.is_none() && record.0.is_some())
                .and_then(|w| {
                    let (wait, tag) = w.split_once(';')?;
                    let wait = humantime_serde::re::humantime::parse_duration(wait).ok()?;
                    Some((wait.min(crate::leader::MAX_TAKEOVER_WAIT), tag.to_owned()))
                });
            if let Some((wait, tag)) = &wait {
                self.note_group_wait(*wait, tag, seen);
            }
            let wait_over = self.group_wait_over(Instant::now());
            // Another member renewed it since this replica's last look.
            if let Some((before, _, looked)) = &previous
                && *before != record
                && foreign.is_none()
                && record.0.is_some()
                && self.renewed_by_another(current.as_ref(), *looked, wait.is_some(), wait_over)
            {
                return Group::Ours;
            }
            let owed = foreign.as_deref().map(|h| {
                let holders = current
                    .as_ref()
                    .and_then(|l| crate::leader::delivered_within_of(l, h))
                    .map(|w| crate::leader::holders_wait(w, duration))
                    .unwrap_or_default()
                    .min(crate::leader::MAX_TAKEOVER_WAIT);
                self.takeover_wait.max(holders)
            });
            let remove_wait = foreign.is_some() || record.0.is_none() || wait_over;
            let (lease, now, tag) = self.group_lease(current, &spec, &record, owed, remove_wait);
            match self.write_group(&lease).await {
                Ok(Ok(())) => {
                    self.group_seen =
                        Some(((Some(ours.clone()), Some(now)), Instant::now(), start));
                    if let (Some(holder), Some(owed)) = (&foreign, owed) {
                        info!(lease = %self.group, previous = %holder, wait = ?owed, "Took the single-leader Lease over for this replica's shard count after its holder stopped renewing it: claiming shards after the wait");
                        self.note_group_wait(owed, &tag, seen);
                    }
                    if self.group_wait_over(Instant::now()) {
                        self.cap.extend_to(start + self.renew_deadline);
                    }
                    return Group::Ours;
                }
                // Written by someone else since the read: read again, once.
                Ok(Err(kube::Error::Api(s))) if s.code == 409 && attempt == 0 => continue,
                Ok(Err(err)) => return Group::Unknown(err.to_string()),
                Err(_) => return Group::Unknown("the write timed out".into()),
            }
        }
        Group::Unknown("the Lease changed under two writes in a row".into())
    }

    /// Another member renewed the group's Lease (`current`) since this replica's look at
    /// `looked`: the cap extends from that look (once the group's wait is over), and this
    /// replica need not renew it itself if the renewal lasts past its next look, announces a
    /// `delivered-within` as long as its own, and no wait annotation is to be removed.
    fn renewed_by_another(
        &self,
        current: Option<&Lease>,
        looked: Instant,
        waiting: bool,
        wait_over: bool,
    ) -> bool {
        if wait_over {
            self.cap.extend_to(looked + self.renew_deadline);
        }
        let lasts = looked + self.renew_deadline
            > Instant::now() + self.retry_period * 2 + self.renew_deadline / 10;
        let theirs = current
            .and_then(|l| crate::leader::delivered_within_of(l, &self.group_holder()))
            .unwrap_or_default();
        let remove = waiting && wait_over;
        lasts && theirs >= self.delivered_within && !remove
    }

    /// The group's Lease as this replica writes it over `current` (read with `spec` and
    /// `record`): held by this replica, renewed now, with its `delivered-within`, and the
    /// group's wait annotation set to `owed` (a takeover) or removed when `remove_wait`.
    /// Returns it, the renew time written and the takeover's tag.
    fn group_lease(
        &self,
        current: Option<Lease>,
        spec: &LeaseSpec,
        record: &Record,
        owed: Option<Duration>,
        remove_wait: bool,
    ) -> (Lease, jiff::Timestamp, String) {
        let ours = self.group_holder();
        let mut lease = current.unwrap_or_else(|| Lease {
            metadata: ObjectMeta {
                name: Some(self.group.clone()),
                ..Default::default()
            },
            spec: None,
        });
        // Microseconds, as the API server keeps it: the next look compares it exactly.
        let now = jiff::Timestamp::from_microsecond(jiff::Timestamp::now().as_microsecond())
            .expect("now is in range");
        let transitions =
            spec.lease_transitions.unwrap_or(0) + i32::from(record.0.as_deref() != Some(&ours));
        let within = crate::leader::delivered_within_of(&lease, &ours)
            .unwrap_or_default()
            .max(self.delivered_within);
        lease.spec = Some(LeaseSpec {
            holder_identity: Some(ours.clone()),
            lease_duration_seconds: Some(crate::leader::lease_seconds(self.lease_duration)),
            renew_time: Some(MicroTime(now)),
            acquire_time: if record.0.as_deref() == Some(ours.as_str()) {
                spec.acquire_time.clone()
            } else {
                Some(MicroTime(now))
            },
            lease_transitions: Some(transitions),
            ..Default::default()
        });
        let annotations = lease.metadata.annotations.get_or_insert_default();
        annotations.insert(
            crate::leader::DELIVERED_WITHIN_ANNOTATION.to_owned(),
            crate::leader::delivered_within_text(within, &ours),
        );
        let tag = transitions.to_string();
        match owed {
            Some(owed) => {
                annotations.insert(
                    GROUP_WAIT_ANNOTATION.to_owned(),
                    format!("{}s;{tag}", owed.as_millis().div_ceil(1000)),
                );
            }
            None if remove_wait => {
                annotations.remove(GROUP_WAIT_ANNOTATION);
            }
            None => {}
        }
        (lease, now, tag)
    }

    /// Writes the group's Lease (creates it if it has no version), within the renew deadline.
    async fn write_group(
        &self,
        lease: &Lease,
    ) -> Result<kube::Result<()>, tokio::time::error::Elapsed> {
        let write = async {
            if lease.metadata.resource_version.is_some() {
                self.api
                    .replace(&self.group, &PostParams::default(), lease)
                    .await
                    .map(|_| ())
            } else {
                self.api
                    .create(&PostParams::default(), lease)
                    .await
                    .map(|_| ())
            }
        };
        tokio::time::timeout(self.renew_deadline, write).await
    }

    /// Notes the group's takeover wait `wait`, tagged `tag`, first seen at `at`: no shard is
    /// claimed (and the cap not extended) until it has passed from this replica's first
    /// sighting of the tag.
    fn note_group_wait(&mut self, wait: Duration, tag: &str, at: Instant) {
        if self.group_wait_tag.as_deref() != Some(tag) {
            let after = at + wait;
            self.claim_after = Some(self.claim_after.map_or(after, |c| c.max(after)));
            self.group_wait_tag = Some(tag.to_owned());
        }
    }

    /// Whether this replica's wait for the group's takeover is over.
    fn group_wait_over(&self, now: Instant) -> bool {
        self.claim_after.is_none_or(|c| now >= c)
    }

    /// The shards this replica should own, now and on every change (empty until it has
    /// looked at the others for [`settle_time`]).
    pub fn subscribe(&self) -> watch::Receiver<BTreeSet<u32>> {
        self.wanted.subscribe()
    }

    fn lease_name(&self) -> String {
        // A Lease name is a DNS subdomain: identities are pod names, which are.
        format!("{}-member-{}", self.group, self.identity)
    }

    /// Renews and looks until `cancel` fires; then leaves (empties its holder, so that the
    /// others count it out at once).
    pub async fn run(mut self, cancel: CancellationToken) {
        let started = Instant::now();
        let mut list_failed = false;
        let mut conflict_logged = false;
        let mut unknown_logged = false;
        let mut unknown_since: Option<Instant> = None;
        let mut conflicted = false;
        loop {
            // First, and bounded: the shards' fences are capped by it, whatever the rest does.
            let group = self.hold_group().await;
            let held = matches!(group, Group::Held(_));
            let members = tokio::time::timeout(self.renew_deadline, self.members())
                .await
                .unwrap_or_else(|_| {
                    Err(kube::Error::Service(
                        "listing the membership leases timed out".into(),
                    ))
                });
            match members {
                Ok((members, other)) => {
                    list_failed = false;
                    // Renewed only while this replica sees the others: one that cannot list
                    // them (RBAC without `list`) would be counted by the others and assigned
                    // shards it never campaigns for.
                    match tokio::time::timeout(self.renew_deadline, self.renew()).await {
                        Ok(Ok(())) => {}
                        Ok(Err(err)) => {
                            warn!(error = %err, "Cannot renew the membership lease; retrying")
                        }
                        Err(_) => warn!("Renewing the membership lease timed out; retrying"),
                    }
                    self.replicas.set(members.len() as i64);
                    let now = Instant::now();
                    let (other, own_trouble) = match group {
                        Group::Ours => {
                            (unknown_since, unknown_logged) = (None, false);
                            (other, false)
                        }
                        Group::Held(holder) => {
                            (unknown_since, unknown_logged) = (None, false);
                            (Some((holder, format!("lease {}", self.group))), false)
                        }
                        Group::Unknown(why) => {
                            let since = *unknown_since.get_or_insert(now);
                            if now.duration_since(since) < self.renew_deadline {
                                // Claims stay as they are (their fences' cap lapses if this
                                // lasts): a moment's error hands nothing over.
                                if !unknown_logged {
                                    warn!(lease = %self.group, error = %why, "Cannot confirm this replica's group holds the single-leader Lease; its shards publish nothing until it can");
                                    unknown_logged = true;
                                }
                                self.show_claim_wait();
                                tokio::select! {
                                    _ = cancel.cancelled() => break,
                                    _ = tokio::time::sleep(self.retry_period) => {}
                                }
                                continue;
                            }
                            // For longer: its shards go to replicas that can (does the Role
                            // allow get and update on it?).
                            (
                                Some((
                                    format!("unconfirmed: {why}"),
                                    format!("lease {}", self.group),
                                )),
                                true,
                            )
                        }
                    };
                    if own_trouble {
                        // This replica's own trouble: no takeover wait once it is over.
                    } else if other.is_some() {
                        conflicted = true;
                    } else if conflicted {
                        conflicted = false;
                        let after = now + self.takeover_wait;
                        self.claim_after = Some(self.claim_after.map_or(after, |c| c.max(after)));
                        info!(wait = ?self.takeover_wait, "No replica of another shard count or single leader publishes any more: claiming shards after the takeover wait");
                    }
                    // Until replicas started with it had a moment to write their Leases, a
                    // replica that just started would count itself alone and claim every
                    // shard (see `settle_time`).
                    if started.elapsed() >= settle_time(self.lease_duration, self.retry_period)
                        && (other.is_some() || self.group_wait_over(Instant::now()))
                    {
                        let mine = match &other {
                            Some((why, lease)) if own_trouble => {
                                if !conflict_logged {
                                    warn!(lease = %lease, reason = %why, "This replica cannot confirm its group holds the single-leader Lease: handing its shards on");
                                    conflict_logged = true;
                                }
                                BTreeSet::new()
                            }
                            Some((who, count)) => {
                                if !conflict_logged {
                                    warn!(replica = %who, shards = count, ours = self.shards.len(), "A live replica of another shard count, or a single leader, publishes: claiming nothing until it is gone (its routes' checkpoints are then taken over)");
                                    conflict_logged = true;
                                }
                                BTreeSet::new()
                            }
                            None => {
                                conflict_logged = false;
                                assign(&self.shards, &members, &self.identity)
                            }
                        };
                        self.wanted.send_if_modified(|w| {
                            let changed = *w != mine;
                            if changed {
                                info!(members = ?members, shards = ?mine, "Shards assigned to this replica");
                                *w = mine;
                            }
                            changed
                        });
                    }
                }
                Err(err) => {
                    if held {
                        // Whatever the membership says, a live foreign holder means none.
                        self.wanted.send_if_modified(|w| {
                            let changed = !w.is_empty();
                            w.clear();
                            changed
                        });
                    }
                    if !list_failed {
                        warn!(error = %err, "Cannot list the membership leases: not renewing this replica's, so the others count it out and share the shards it does not hold (does its Role allow list on leases?)");
                    }
                    list_failed = true;
                }
            }
            self.show_claim_wait();
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep(self.retry_period) => {}
            }
        }
        // Stopping: no wait shown, and no "claiming shards" logged.
        (self.claim_after, self.wait_shown) = (None, false);
        self.show_claim_wait();
        self.leave().await;
    }

    async fn renew(&self) -> Result<(), kube::Error> {
        let name = self.lease_name();
        let spec = LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(crate::leader::lease_seconds(self.lease_duration)),
            renew_time: Some(MicroTime(jiff::Timestamp::now())),
            ..Default::default()
        };
        let annotations =
            Some([(SHARDS_ANNOTATION.to_owned(), self.shards.len().to_string())].into());
        match self.api.get_opt(&name).await? {
            Some(mut lease) => {
                lease.spec = Some(spec);
                lease.metadata.annotations = annotations;
                self.api
                    .replace(&name, &PostParams::default(), &lease)
                    .await?;
            }
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(name),
                        labels: Some([(MEMBER_LABEL.to_owned(), self.group.clone())].into()),
                        annotations,
                        ..Default::default()
                    },
                    spec: Some(spec),
                };
                self.api.create(&PostParams::default(), &lease).await?;
            }
        }
        Ok(())
    }

    /// The live members, sorted: itself, and every other whose lease names a holder and
    /// changed within `lease_duration` of when this replica saw it change; and a live one
    /// with another number of shards, if any.
    async fn members(&mut self) -> Result<(Vec<String>, Option<(String, String)>), kube::Error> {
        let leases = self
            .api
            .list(&ListParams::default().labels(&format!("{MEMBER_LABEL}={}", self.group)))
            .await?;
        let now = Instant::now();
        let mut live = BTreeSet::from([self.identity.clone()]);
        let mut seen = HashMap::new();
        let mut other = None;
        let mine = self.lease_name();
        let mut forgotten = Vec::new();
        for lease in leases {
            let Some(name) = lease.metadata.name.clone() else {
                continue;
            };
            let rv = lease.metadata.resource_version.clone();
            let count = lease
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(SHARDS_ANNOTATION))
                .cloned();
            let spec = lease.spec.unwrap_or_default();
            let record = (
                spec.holder_identity.clone().filter(|h| !h.is_empty()),
                spec.renew_time.map(|t| t.0),
            );
            let at = match self.observed.remove(&name) {
                Some((r, at)) if r == record => at,
                _ => now,
            };
            if let Some(holder) = &record.0
                && now.duration_since(at) < self.lease_duration
            {
                match count {
                    Some(c) if c != self.shards.len().to_string() => {
                        other = Some((holder.clone(), c));
                    }
                    _ => {
                        live.insert(holder.clone());
                    }
                }
            }
            if name != mine && now.duration_since(at) >= self.forget_after {
                forgotten.push((name.clone(), rv));
            }
            seen.insert(name, (record, at));
        }
        self.observed = seen;
        // A few per pass: the first pass after an upgrade may find many, and the deletes share
        // the Lease requests' token bucket with the renewals.
        for (name, rv) in forgotten.into_iter().take(FORGET_PER_PASS) {
            self.forget(&name, rv).await;
        }
        Ok((live.into_iter().collect(), other))
    }

    /// Deletes the membership Lease `name`, left unrenewed (its replica is gone), unless it
    /// changed since it was read at `rv`.
    async fn forget(&mut self, name: &str, rv: Option<String>) {
        if !self.collect {
            return;
        }
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                resource_version: rv,
                uid: None,
            }),
            ..Default::default()
        };
        match self.api.delete(name, &params).await {
            Ok(_) => {
                info!(lease = %name, unrenewed_for = ?self.forget_after, "Deleted the membership Lease of a replica gone for good");
                self.observed.remove(name);
            }
            Err(kube::Error::Api(s)) if s.code == 403 => {
                warn!(lease = %name, "Cannot delete membership Leases (does the Role allow delete on leases?): those of replicas gone stay behind");
                self.collect = false;
            }
            // Renewed or deleted meanwhile: looked at again at the next pass.
            Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {}
            Err(err) => {
                debug!(lease = %name, error = %err, "Could not delete an unrenewed membership Lease; retrying later")
            }
        }
    }

    /// Deletes this replica's Lease (the others count it out at once); where the Role does
    /// not allow that, empties its holder instead.
    async fn leave(&self) {
        let name = self.lease_name();
        match self.api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => return,
            Err(kube::Error::Api(s)) if s.code == 404 => return,
            Err(err) => {
                debug!(error = %err, "Could not delete the membership Lease; emptying its holder instead");
            }
        }
        let Ok(Some(mut lease)) = self.api.get_opt(&name).await else {
            return;
        };
        let spec = lease.spec.get_or_insert_default();
        spec.holder_identity = None;
        if let Err(err) = self
            .api
            .replace(&name, &PostParams::default(), &lease)
            .await
        {
            warn!(error = %err, "Could not leave the membership; the others count this replica out after its lease expires");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::ShardingConfig;

    fn members(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("replica-{i}")).collect()
    }

    #[test]
    fn every_shard_has_one_owner_and_none_more_than_the_ceiling() {
        for m in [1, 5, 12, 64] {
            let shards = ShardingConfig { shards: m }.all();
            for n in 1..=7 {
                let ms = members(n);
                let mut owners = vec![0; m as usize];
                for me in &ms {
                    let mine = assign(&shards, &ms, me);
                    assert!(mine.len() <= (m as usize).div_ceil(n), "{m} over {n}");
                    mine.iter().for_each(|&s| owners[s as usize] += 1);
                }
                assert!(owners.iter().all(|&o| o == 1), "{m} over {n}: {owners:?}");
            }
        }
    }

    #[test]
    fn a_new_member_moves_few_shards() {
        let shards = ShardingConfig { shards: 12 }.all();
        let (three, four) = (members(3), members(4));
        let moved: usize = three
            .iter()
            .map(|me| {
                assign(&shards, &three, me)
                    .difference(&assign(&shards, &four, me))
                    .count()
            })
            .sum();
        // The newcomer needs 3; a rebalance that moved most of them would relist them all.
        assert!(moved <= 5, "{moved} shards moved");
        // Pod-like names (a shared prefix, differing at the end), 4 → 5 and 5 → 6.
        let pods = |n: usize| -> Vec<String> {
            (0..n)
                .map(|i| {
                    format!(
                        "kube-event-bridge-7d9f8c6b5-{}",
                        ["x2k4p", "b7wqz", "m9d3t", "q5hnv", "t8rjc", "z1fgl"][i]
                    )
                })
                .collect()
        };
        for n in [4, 5] {
            let (before, after) = (pods(n), pods(n + 1));
            let moved: usize = before
                .iter()
                .map(|me| {
                    assign(&shards, &before, me)
                        .difference(&assign(&shards, &after, me))
                        .count()
                })
                .sum();
            assert!(moved <= 5, "{n} → {}: {moved} shards moved", n + 1);
        }
    }
}
