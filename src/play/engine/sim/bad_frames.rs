//! Keeps a flood of undecodable frames from flooding the log.

use std::time::{Duration, Instant};

/// Keeps a flood of undecodable frames from flooding the log.
#[derive(Debug, Default)]
pub(super) struct BadFrames {
    total: u64,
    unreported: u64,
    last_report: Option<Instant>,
}

impl BadFrames {
    /// Logged one by one, up to this many.
    const LOUD: u64 = 10;

    /// Count a bad frame at `now`; `true` when it should be logged in full. Past the first
    /// [`Self::LOUD`], a summary line comes at most once a second.
    pub(super) fn note(&mut self, now: Instant) -> bool {
        self.total += 1;
        if self.total <= Self::LOUD {
            if self.total == Self::LOUD {
                tracing::warn!(
                    "{} undecodable frames so far: from now on they are counted, and reported once a second",
                    self.total
                );
                self.last_report = Some(now);
            }
            return true;
        }
        self.unreported += 1;
        if self
            .last_report
            .is_none_or(|t| now.saturating_duration_since(t) >= Duration::from_secs(1))
        {
            tracing::error!(
                total = self.total,
                "{} more undecodable frames dropped or rejected since the last report",
                self.unreported
            );
            self.unreported = 0;
            self.last_report = Some(now);
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_of_bad_frames_logs_ten_then_a_count_a_second() {
        let mut b = BadFrames::default();
        let t0 = Instant::now();
        // 20,000 garbage frames within half a second: ten logged in full
        let loud = (0..20_000u64)
            .filter(|i| b.note(t0 + Duration::from_micros(i * 25)))
            .count();
        assert_eq!(loud, BadFrames::LOUD as usize);
        assert_eq!(b.total, 20_000);
        // the summary of the rest comes once the second is over
        assert!(!b.note(t0 + Duration::from_millis(1500)));
        assert_eq!(b.unreported, 0, "reported and reset");
    }
}
