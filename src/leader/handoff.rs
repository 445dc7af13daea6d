//! What passes from one holder of a Lease to the next: the takeover wait, the holder's
//! `delivered-within` and `fenced-by` annotations, and the Lease's duration in whole seconds.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;

use super::settings::LeaderElectionConfig;

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

/// The annotation a holder writes on its Lease at each renewal beside
/// [`DELIVERED_WITHIN_ANNOTATION`]: what fences its messages other than timers (see
/// [`FencedBy`]), as JSON. A taker whose own transactional producers include every one of
/// these ids fences the holder's transactional messages itself when its term begins
/// (`init_transactions`), so it waits only for what the holder sends otherwise.
pub const FENCED_BY_ANNOTATION: &str = "kube-event-bridge.io/fenced-by";

/// What a holder announces in [`FENCED_BY_ANNOTATION`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FencedBy {
    /// The identity that wrote it: a value another holder left is not the current one's.
    pub holder: String,
    /// The renew time it wrote with it: a value left from an earlier renewal (renewed since
    /// by a release that keeps annotations it does not know, under the same identity) is not
    /// the current one's either.
    pub renewed: jiff::Timestamp,
    /// The `transactional.id`s of its producers under this Lease: every message they send is
    /// in a transaction, which the next producer of the same id aborts (or lets commit before
    /// it starts), and their later commits are refused.
    pub transactional_ids: Vec<String>,
    /// How long after a renewal began a message it handed over under the Lease *otherwise*
    /// (sinks without `exactly_once`, dead letters) can still be delivered: `renew_deadline`
    /// plus their longest delivery, or more while its own takeover wait still covers an
    /// earlier holder's. `0s`: nothing but the transactions (and never before a renewal's
    /// deadline, which the lease's margin covers).
    #[serde(with = "humantime_serde")]
    pub unfenced_within: Duration,
}

impl FencedBy {
    /// What `lease`'s [`FENCED_BY_ANNOTATION`] says, if `holder` wrote it with the Lease's
    /// current renew time (compared to the microsecond, as the API server keeps it). Anything
    /// else (a value that does not parse, of another holder or renewal) counts as absent: the
    /// taker waits as for a holder that announced nothing.
    pub fn of(lease: &Lease, holder: &str) -> Option<Self> {
        let text = lease
            .metadata
            .annotations
            .as_ref()?
            .get(FENCED_BY_ANNOTATION)?;
        let announced: Self = serde_json::from_str(text).ok()?;
        let renewed = lease.spec.as_ref()?.renew_time.as_ref()?.0;
        (announced.holder == holder
            && announced.renewed.as_microsecond() == renewed.as_microsecond())
        .then_some(announced)
    }

    /// The annotation's value (`unfenced_within` rounded up to whole seconds).
    pub fn text(&self) -> String {
        let mut rounded = self.clone();
        rounded.unfenced_within =
            Duration::from_millis(self.unfenced_within.as_millis().div_ceil(1000) as u64 * 1000);
        serde_json::to_string(&rounded).expect("plain data serializes")
    }

    /// Whether a taker whose transactional producers have `own` ids fences what this holder's
    /// transactions may still bring (each of its ids is one of `own`): then only what it
    /// sends otherwise (`unfenced_within`) needs a wait.
    pub fn covered_by(&self, own: &[String]) -> bool {
        self.transactional_ids.iter().all(|id| own.contains(id))
    }
}

/// The longest takeover wait a configuration may imply (see [`takeover_wait`]): longer, and
/// a failover publishes nothing for minutes.
pub const MAX_TAKEOVER_WAIT: Duration = Duration::from_secs(300);

/// `leaseDurationSeconds` for `duration`: whole seconds, rounded up (at least 1). Rounding
/// down would let the others take the lease over before the holder's own deadline (a 4.5 s
/// lease read as 4 s eats half a second of the margin `lease_duration - renew_deadline`).
pub fn lease_seconds(duration: Duration) -> i32 {
    let whole = duration.as_secs() + u64::from(duration.subsec_nanos() > 0);
    whole.clamp(1, i32::MAX as u64) as i32
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
    fn a_holders_announcement_is_read_back_only_for_that_holder() {
        let renewed: jiff::Timestamp = "2026-12-02T10:00:00.123456789Z".parse().unwrap();
        let announced = FencedBy {
            holder: "pod-a".into(),
            renewed,
            transactional_ids: vec!["kube-event-bridge.prod.kafka".into()],
            unfenced_within: Duration::from_millis(10_200),
        };
        let text = announced.text();
        assert_eq!(
            text,
            r#"{"holder":"pod-a","renewed":"2026-12-02T10:00:00.123456789Z","transactionalIds":["kube-event-bridge.prod.kafka"],"unfencedWithin":"11s"}"#
        );
        let mut lease = Lease::default();
        lease.metadata.annotations = Some([(FENCED_BY_ANNOTATION.to_owned(), text)].into());
        let renew = |lease: &mut Lease, at: &str| {
            lease.spec.get_or_insert_default().renew_time = Some(
                k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(at.parse().unwrap()),
            )
        };
        // The renew time as the API server keeps it: to the microsecond.
        renew(&mut lease, "2026-12-02T10:00:00.123456Z");
        let read = FencedBy::of(&lease, "pod-a").expect("pod-a's");
        assert_eq!(read.unfenced_within, Duration::from_secs(11));
        assert!(FencedBy::of(&lease, "pod-b").is_none(), "another holder's");
        assert!(read.covered_by(&[
            "kube-event-bridge.prod.kafka".into(),
            "kube-event-bridge.prod.other".into()
        ]));
        assert!(!read.covered_by(&["kube-event-bridge.prod.other".into()]));
        renew(&mut lease, "2026-12-02T10:00:02.5Z");
        assert!(
            FencedBy::of(&lease, "pod-a").is_none(),
            "renewed since by a release that does not write it"
        );
        lease.metadata.annotations =
            Some([(FENCED_BY_ANNOTATION.to_owned(), "not json".to_owned())].into());
        assert!(
            FencedBy::of(&lease, "pod-a").is_none(),
            "unreadable: absent"
        );
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
}
