//! A subscription's delivery rate limit, per sender process: the generic cell rate algorithm,
//! with a burst of at most one second's worth of deliveries. A message over the limit is handed
//! back with the wait it needs, later ones waiting an interval more each, so a backlog leaves at
//! the limit's pace without spending attempts.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The generic cell rate algorithm's state of one subscription.
#[derive(Debug)]
struct Cell {
    /// When the next delivery would be due were deliveries spaced evenly at the rate.
    theoretical: Instant,
    /// Handed back since the last delivery went: each waits one interval more than the last.
    waiting: u32,
}

#[derive(Debug, Default)]
pub struct RateLimiter {
    cells: Mutex<HashMap<(String, String), Cell>>,
}

impl RateLimiter {
    /// `None`: send now. `Some(wait)`: hand it back for `wait` (it asks again then; nothing is
    /// reserved for it).
    pub fn wait(&self, tenant_id: &str, name: &str, rate: f64) -> Option<Duration> {
        let now = Instant::now();
        let interval = Duration::from_secs_f64(1.0 / rate);
        // One second's worth may go at once (at least one).
        let tolerance = interval.mul_f64((rate.max(1.0) - 1.0).max(0.0));
        let mut cells = self.cells.lock().unwrap_or_else(|p| p.into_inner());
        let cell = cells
            .entry((tenant_id.to_owned(), name.to_owned()))
            .or_insert(Cell {
                theoretical: now,
                waiting: 0,
            });
        let allowed_from = cell.theoretical.checked_sub(tolerance).unwrap_or(now);
        if now >= allowed_from {
            cell.theoretical = cell.theoretical.max(now) + interval;
            cell.waiting = 0;
            return None;
        }
        cell.waiting += 1;
        let wait = (allowed_from - now) + interval.saturating_mul(cell.waiting - 1);
        Some(wait.clamp(Duration::from_millis(1), Duration::from_secs(3600)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_of_a_second_then_waits_that_grow_at_the_rate() {
        let limiter = RateLimiter::default();
        let sent = (0..5)
            .filter(|_| limiter.wait("t", "s", 5.0).is_none())
            .count();
        assert_eq!(sent, 5, "one second's worth goes at once");
        let waits: Vec<Duration> = (0..3)
            .map(|_| limiter.wait("t", "s", 5.0).unwrap())
            .collect();
        assert!(waits[0] < waits[1] && waits[1] < waits[2], "{waits:?}");
        assert!(waits[2] <= Duration::from_millis(700), "{waits:?}");
        assert!(
            limiter.wait("t", "other", 5.0).is_none(),
            "per subscription"
        );
    }
}
