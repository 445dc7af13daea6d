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
    leader::LeaderElectionConfig,
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
    // The single-leader Lease (`lease_name`) as last seen, and when it was first seen so.
    group_seen: Option<(Record, Instant)>,
    // How long a replica waits before it claims shards after another count's or a single
    // leader's replicas stopped publishing (their messages may still be on their way).
    takeover_wait: Duration,
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
        }
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
    /// replicas of its shard count), so that a single-leader replica (`sharding.shards: 1`, of
    /// this release or an older one, whose elector reads that Lease) stands by while they
    /// publish, and they stand by while it leads. Returns the live holder of another
    /// group or a single leader, if any; an expired one is taken over (then this replica
    /// waits its takeover wait before claiming, see [`Self::takeover_wait`]).
    async fn hold_group(&mut self) -> Result<Option<String>, kube::Error> {
        let now = Instant::now();
        let ours = self.group_holder();
        let current = self.api.get_opt(&self.group).await?;
        let record: Record = current
            .as_ref()
            .and_then(|l| l.spec.as_ref())
            .map(|s| {
                (
                    s.holder_identity.clone().filter(|h| !h.is_empty()),
                    s.renew_time.as_ref().map(|t| t.0),
                )
            })
            .unwrap_or_default();
        let at = match self.group_seen.take() {
            Some((r, at)) if r == record => at,
            _ => now,
        };
        self.group_seen = Some((record.clone(), at));
        let unrenewed = now.duration_since(at);
        let foreign = record.0.as_ref().filter(|h| **h != ours).cloned();
        if let Some(holder) = &foreign
            && unrenewed < self.lease_duration
        {
            return Ok(Some(holder.clone()));
        }
        // Ours already, free, or expired: renewed (by any member of the group: once per
        // third of a lease duration is enough).
        if foreign.is_none() && record.0.is_some() && unrenewed < self.lease_duration / 3 {
            return Ok(None);
        }
        let spec = LeaseSpec {
            holder_identity: Some(ours.clone()),
            lease_duration_seconds: Some(crate::leader::lease_seconds(self.lease_duration)),
            renew_time: Some(MicroTime(jiff::Timestamp::now())),
            ..Default::default()
        };
        let result = match current {
            Some(mut lease) => {
                lease.spec = Some(spec);
                self.api
                    .replace(&self.group, &PostParams::default(), &lease)
                    .await
                    .map(|_| ())
            }
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.group.clone()),
                        ..Default::default()
                    },
                    spec: Some(spec),
                };
                self.api
                    .create(&PostParams::default(), &lease)
                    .await
                    .map(|_| ())
            }
        };
        match result {
            Ok(()) => {
                if let Some(holder) = foreign {
                    info!(lease = %self.group, previous = %holder, wait = ?self.takeover_wait, "Took the single-leader Lease over for this replica's shard count after its holder stopped renewing it");
                }
                Ok(None)
            }
            // Another member renewed it at the same moment: still ours.
            Err(kube::Error::Api(s)) if s.code == 409 && record.0.as_deref() == Some(&ours) => {
                Ok(None)
            }
            // Taken by someone else at the same moment (it was free or expired): looked at
            // again at the next pass.
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(Some(String::new())),
            Err(err) => Err(err),
        }
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
        // Claims wait until then after a conflict ended (see `takeover_wait`).
        let mut claim_after = started;
        let mut conflicted = false;
        loop {
            match self.members().await {
                Ok((members, other)) => {
                    list_failed = false;
                    // Renewed only while this replica sees the others: one that cannot list
                    // them (RBAC without `list`) would be counted by the others and assigned
                    // shards it never campaigns for.
                    if let Err(err) = self.renew().await {
                        warn!(error = %err, "Cannot renew the membership lease; retrying");
                    }
                    self.replicas.set(members.len() as i64);
                    let other = match self.hold_group().await {
                        Ok(None) => other,
                        // Taken by someone else at the moment it was free: nothing changes
                        // until the next pass tells who.
                        Ok(Some(holder)) if holder.is_empty() => {
                            tokio::select! {
                                _ = cancel.cancelled() => break,
                                _ = tokio::time::sleep(self.retry_period) => {}
                            }
                            continue;
                        }
                        Ok(Some(holder)) => Some((holder, format!("lease {}", self.group))),
                        Err(err) => {
                            warn!(error = %err, lease = %self.group, "Cannot read or renew the single-leader Lease: claiming nothing until it can (does the Role allow get and update on it?)");
                            Some((String::new(), format!("lease {}", self.group)))
                        }
                    };
                    if other.is_some() {
                        conflicted = true;
                    } else if conflicted {
                        conflicted = false;
                        claim_after = Instant::now() + self.takeover_wait;
                        info!(wait = ?self.takeover_wait, "No replica of another shard count or single leader publishes any more: claiming shards after the takeover wait");
                    }
                    // Until replicas started with it had a moment to write their Leases, a
                    // replica that just started would count itself alone and claim every
                    // shard (see `settle_time`).
                    if started.elapsed() >= settle_time(self.lease_duration, self.retry_period)
                        && (other.is_some() || Instant::now() >= claim_after)
                    {
                        let mine = match &other {
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
                    if !list_failed {
                        warn!(error = %err, "Cannot list the membership leases: not renewing this replica's, so the others count it out and share the shards it does not hold (does its Role allow list on leases?)");
                    }
                    list_failed = true;
                }
            }
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep(self.retry_period) => {}
            }
        }
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
