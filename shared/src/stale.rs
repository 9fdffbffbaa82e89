//! Stale-if-error: how a warm process keeps verifying deliveries while the database or Secrets
//! Manager cannot answer.
//!
//! The source cache ([`crate::sources::SourceRegistry`]) and the secret cache
//! ([`crate::secrets::AwsSecrets`]) hold each entry for a TTL. When a refresh fails in a way that
//! may pass (the database unreachable or timing out, Secrets Manager throttled or unreachable),
//! the entry is served past its TTL for at most `stale_if_error` more
//! (`STALE_IF_ERROR_SECONDS`), counted in the `StaleServed` metric, and logged at most once a
//! minute per entry. While it fails, the store is asked again at most once per
//! [`RETRY_INTERVAL`] per entry, and that attempt may take at most [`REFRESH_TIMEOUT`]: the
//! requests in between are answered from the cache at once instead of each waiting for a
//! connection that will not come. A failure that will not pass (a source row that no longer
//! parses, a secret deleted) is never answered stale, and an entry whose refresh succeeds is
//! replaced at once (a source disabled during the outage is refused from the first read after).
//!
//! A cold process has nothing to serve: a delivery to a source it never read cannot be verified
//! while the database cannot answer, and is answered 503 (the buffer cannot take what cannot be
//! verified).

use std::time::{Duration, Instant};

/// How long past its TTL a warm ingest serves its last-known source or secret when the database
/// or Secrets Manager cannot answer (`STALE_IF_ERROR_SECONDS`; see [`crate::stale`]).
pub const DEFAULT_STALE_IF_ERROR: Duration = Duration::from_secs(3600);

/// How often an entry served stale is asked for again.
pub const RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// How long a refresh may take when a stale copy could be served instead: past it the refresh
/// counts as failed (the pool would otherwise retry a refused connect until its acquire timeout,
/// 3 s, for every such request). A refresh with nothing to fall back on is not bounded here.
pub const REFRESH_TIMEOUT: Duration = Duration::from_secs(1);

/// At most one warning per entry this often while it is served stale.
pub const WARN_INTERVAL: Duration = Duration::from_secs(60);

/// How long entries are fresh, and how long past that they may be served when a refresh fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    pub ttl: Duration,
    /// Zero: never served stale.
    pub stale_if_error: Duration,
}

impl Policy {
    /// Whether an entry fetched at `fetched_at` may still be served at `now` after a failed
    /// refresh.
    pub fn servable(&self, fetched_at: Instant, now: Instant) -> bool {
        now.saturating_duration_since(fetched_at) < self.ttl.saturating_add(self.stale_if_error)
    }

    fn fresh(&self, fetched_at: Instant, now: Instant) -> bool {
        now.saturating_duration_since(fetched_at) < self.ttl
    }
}

/// What a lookup does with a cached entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    /// Within its TTL: served.
    Fresh,
    /// Past its TTL while another lookup is refreshing it (no failure known yet): served as it
    /// is, not counted as stale.
    Refreshing,
    /// Past its TTL, the last refresh failed less than [`RETRY_INTERVAL`] ago, still within the
    /// bound: served stale without asking.
    Stale,
    /// Ask the store; the entry is claimed, so lookups until [`RETRY_INTERVAL`] from now do not
    /// ask too.
    Ask,
}

/// When one cached entry was read, and how its refreshes are going.
#[derive(Debug, Clone, Copy)]
pub struct Freshness {
    fetched_at: Instant,
    retry_after: Option<Instant>,
    /// The last refresh failed (and nothing succeeded since).
    failing: bool,
    warned_at: Option<Instant>,
}

impl Freshness {
    /// An entry read at `fetched_at` (taken before the read, so the TTL never runs long).
    pub fn new(fetched_at: Instant) -> Self {
        Self {
            fetched_at,
            retry_after: None,
            failing: false,
            warned_at: None,
        }
    }

    pub fn fetched_at(&self) -> Instant {
        self.fetched_at
    }

    /// How old the entry is at `now`.
    pub fn age(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.fetched_at)
    }

    /// Whether a refresh has failed since the entry was read.
    pub fn failing(&self) -> bool {
        self.failing
    }

    /// What a lookup at `now` does; [`Use::Ask`] claims the entry for this lookup.
    pub fn lookup(&mut self, policy: &Policy, now: Instant) -> Use {
        if policy.fresh(self.fetched_at, now) {
            return Use::Fresh;
        }
        if policy.servable(self.fetched_at, now) && self.retry_after.is_some_and(|at| now < at) {
            return if self.failing {
                Use::Stale
            } else {
                Use::Refreshing
            };
        }
        self.retry_after = Some(now + RETRY_INTERVAL);
        Use::Ask
    }

    /// Whether the refresh a lookup is about to make should be bounded by [`REFRESH_TIMEOUT`]:
    /// there is a stale copy to fall back on.
    pub fn bounded(&self, policy: &Policy, now: Instant) -> bool {
        !policy.stale_if_error.is_zero() && policy.servable(self.fetched_at, now)
    }

    /// A refresh failed transiently at `now`: the next is not tried before [`RETRY_INTERVAL`].
    /// True when the entry may still be served.
    pub fn failed(&mut self, policy: &Policy, now: Instant) -> bool {
        self.failing = true;
        self.retry_after = Some(now + RETRY_INTERVAL);
        policy.servable(self.fetched_at, now)
    }

    /// Whether serving it stale at `now` should be logged (at most once per [`WARN_INTERVAL`]).
    pub fn warn_now(&mut self, now: Instant) -> bool {
        let due = self
            .warned_at
            .is_none_or(|at| now.saturating_duration_since(at) >= WARN_INTERVAL);
        if due {
            self.warned_at = Some(now);
        }
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: Policy = Policy {
        ttl: Duration::from_secs(30),
        stale_if_error: Duration::from_secs(3600),
    };

    #[test]
    fn an_entry_is_fresh_then_asked_for_once_per_interval() {
        let t0 = Instant::now();
        let mut f = Freshness::new(t0);
        assert_eq!(f.lookup(&POLICY, t0 + Duration::from_secs(29)), Use::Fresh);
        let expired = t0 + Duration::from_secs(31);
        assert_eq!(f.lookup(&POLICY, expired), Use::Ask);
        // Claimed: a concurrent lookup serves it while the refresh runs.
        assert_eq!(f.lookup(&POLICY, expired), Use::Refreshing);
        assert!(f.failed(&POLICY, expired));
        assert_eq!(f.lookup(&POLICY, expired), Use::Stale);
        assert_eq!(
            f.lookup(&POLICY, expired + Duration::from_millis(999)),
            Use::Stale
        );
        assert_eq!(f.lookup(&POLICY, expired + RETRY_INTERVAL), Use::Ask);
    }

    #[test]
    fn past_the_bound_every_lookup_asks_and_nothing_is_servable() {
        let t0 = Instant::now();
        let mut f = Freshness::new(t0);
        let late = t0 + POLICY.ttl + POLICY.stale_if_error;
        assert_eq!(f.lookup(&POLICY, late), Use::Ask);
        assert!(!f.failed(&POLICY, late));
        assert_eq!(f.lookup(&POLICY, late), Use::Ask);
        assert!(!f.bounded(&POLICY, late));
    }

    #[test]
    fn no_stale_if_error_is_the_plain_ttl() {
        let policy = Policy {
            stale_if_error: Duration::ZERO,
            ..POLICY
        };
        let t0 = Instant::now();
        let mut f = Freshness::new(t0);
        let expired = t0 + POLICY.ttl;
        assert_eq!(f.lookup(&policy, expired), Use::Ask);
        assert!(!f.bounded(&policy, expired));
        assert!(!f.failed(&policy, expired));
        assert_eq!(f.lookup(&policy, expired), Use::Ask);
    }

    #[test]
    fn warnings_are_at_most_once_a_minute() {
        let t0 = Instant::now();
        let mut f = Freshness::new(t0);
        assert!(f.warn_now(t0));
        assert!(!f.warn_now(t0 + Duration::from_secs(59)));
        assert!(f.warn_now(t0 + WARN_INTERVAL));
    }
}
