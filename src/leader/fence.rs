//! The fence: when this replica may hand messages over, and when the lease could be another's.

use std::time::Duration;

use tokio::time::Instant;

/// When this replica may hand messages over (see [`crate::leader`]); shared by the elector,
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
    // Where a takeover wait may end instead of `from` once this term's producers fenced the
    // last holder's transactions (0: it may not; see `Fence::holder_fenced`).
    fenced_from: std::sync::atomic::AtomicU64,
}

/// A takeover wait as it was when a term's producers began to start (see
/// [`Fence::holder_fenced`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TakeoverToken(u64);

/// A deadline several fences share and never outlast: the sharded replicas' hold on the
/// single-leader Lease (see [`crate::leader::membership`]), which every shard's fence is capped by,
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

    /// Until when the lease is held, if it is held now, whether or not a takeover wait or a
    /// lapsed cap holds publishing back: what a term may do that publishes nothing (start the
    /// producers that fence the last holder's) is bounded by it.
    pub fn held_until(&self) -> Option<Instant> {
        let until = self.0.until.load(std::sync::atomic::Ordering::SeqCst);
        let deadline = fence_base() + Duration::from_nanos(until);
        (until > 0 && Instant::now() < deadline).then_some(deadline)
    }

    /// Valid until `deadline`.
    pub fn extend_to(&self, deadline: Instant) {
        self.0.until.store(
            since_base(deadline).max(1),
            std::sync::atomic::Ordering::SeqCst,
        );
    }

    /// Not valid before `start` (a new leader's takeover wait), or before `fenced_start` once
    /// the term's producers fenced the last holder's transactions (see
    /// [`Self::holder_fenced`]).
    pub fn not_before(&self, start: Instant, fenced_start: Option<Instant>) {
        use std::sync::atomic::Ordering::SeqCst;
        // Before `from`: whoever reads the new `from` reads this too.
        self.0
            .fenced_from
            .store(fenced_start.map_or(0, |s| since_base(s).max(1)), SeqCst);
        self.0.from.store(since_base(start), SeqCst);
    }

    /// The takeover wait under way now, to hand back to [`Self::holder_fenced`].
    pub fn takeover_token(&self) -> TakeoverToken {
        TakeoverToken(self.0.from.load(std::sync::atomic::Ordering::SeqCst))
    }

    /// The term's producers fenced the last holder's transactions: the takeover wait of
    /// `token` (if it is still the one under way: a later takeover set another) ends where the
    /// elector allowed for that, if it did. Returns what is left of the wait then.
    pub fn holder_fenced(&self, token: TakeoverToken) -> Option<Duration> {
        use std::sync::atomic::Ordering::SeqCst;
        let fenced = self.0.fenced_from.load(SeqCst);
        if fenced == 0 || fenced >= token.0 {
            return None;
        }
        self.0
            .from
            .compare_exchange(token.0, fenced, SeqCst, SeqCst)
            .ok()?;
        Some(Duration::from_nanos(
            fenced.saturating_sub(since_base(Instant::now())),
        ))
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
        self.takeable_at().is_some_and(|t| Instant::now() >= t)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_fence_is_valid_from_the_takeover_wait_until_the_deadline() {
        let fence = Fence::default();
        assert!(!fence.is_valid(), "not leading");
        let now = Instant::now();
        fence.extend_to(now + Duration::from_secs(10));
        fence.not_before(now + Duration::from_secs(3), None);
        assert!(!fence.is_valid(), "waiting");
        assert!(fence.wait_valid().await);
        assert!(now.elapsed() >= Duration::from_secs(3));
        tokio::time::sleep(Duration::from_secs(7)).await;
        assert!(!fence.is_valid(), "past the deadline");
        // A loss ends a takeover wait at once.
        let now = Instant::now();
        fence.extend_to(now + Duration::from_secs(10));
        fence.not_before(now + Duration::from_secs(5), None);
        let waiting = tokio::spawn({
            let fence = fence.clone();
            async move { fence.wait_valid().await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        fence.revoke();
        assert!(!waiting.await.unwrap());
        assert!(now.elapsed() < Duration::from_secs(2));
    }

    /// A takeover wait shortens to what the elector allowed once the term's producers fenced
    /// the last holder's, and only the wait they began under: not one without that allowance,
    /// nor a later takeover's.
    #[tokio::test(start_paused = true)]
    async fn producers_that_fenced_the_last_holder_shorten_only_their_own_takeover_wait() {
        let fence = Fence::default();
        let now = Instant::now();
        fence.extend_to(now + Duration::from_secs(30));
        fence.not_before(now + Duration::from_secs(19), None);
        let token = fence.takeover_token();
        assert_eq!(fence.holder_fenced(token), None, "no shorter wait allowed");
        fence.not_before(
            now + Duration::from_secs(19),
            Some(now + Duration::from_secs(5)),
        );
        let token = fence.takeover_token();
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(fence.holder_fenced(token), Some(Duration::from_secs(4)));
        assert_eq!(fence.takeover_left(), Some(Duration::from_secs(4)));
        assert!(fence.wait_valid().await);
        assert_eq!(now.elapsed(), Duration::from_secs(5));
        // A later takeover set its own wait meanwhile: the old token shortens nothing.
        let now = Instant::now();
        let stale = fence.takeover_token();
        fence.not_before(
            now + Duration::from_secs(19),
            Some(now + Duration::from_secs(2)),
        );
        assert_eq!(fence.holder_fenced(stale), None);
        assert_eq!(fence.takeover_left(), Some(Duration::from_secs(19)));
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
