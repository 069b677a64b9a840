//! What the lookups did, for the exit log and the summary file.

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;

/// Counts of an index's lookups. `Display` is the one-line summary; `Serialize` gives
/// `{"records":…, "served":…, "reserved":…, "missed":{"partial_prefix":…}, "prefix_depth":{"3":…}}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ReplayStats {
    /// Records indexed.
    pub records: usize,
    /// Lookups that served a record, re-serves included.
    pub served: u64,
    /// Of `served`, those that served a record already served before.
    pub reserved: u64,
    /// Misses by [`kind`](super::MissReason::kind).
    pub missed: BTreeMap<&'static str, u64>,
    /// Prefix lookups by matched depth in blocks (hits and misses; 0 for a prompt that
    /// matched nothing or was shorter than a block).
    pub prefix_depth: BTreeMap<usize, u64>,
}

impl ReplayStats {
    /// Every lookup so far.
    pub fn lookups(&self) -> u64 {
        self.served + self.missed_total()
    }

    /// Misses of every kind.
    pub fn missed_total(&self) -> u64 {
        self.missed.values().sum()
    }

    /// The matched depth at quantile `q` of the prefix lookups.
    fn depth_quantile(&self, q: f64) -> Option<usize> {
        let n: u64 = self.prefix_depth.values().sum();
        if n == 0 {
            return None;
        }
        let target = ((n as f64 * q).ceil() as u64).max(1);
        let mut seen = 0;
        for (&d, &c) in &self.prefix_depth {
            seen += c;
            if seen >= target {
                return Some(d);
            }
        }
        self.prefix_depth.keys().next_back().copied()
    }

    /// The one-line human summary (same as `Display`), e.g. `980 served (12 re-served,
    /// 968 of 1000 records used), 20 missed (partial_prefix 15, short_prompt 5); prefix
    /// depth min 0 / median 8 / max 12 blocks`.
    pub fn summary(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for ReplayStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.lookups() == 0 {
            return write!(f, "no lookups ({} records indexed)", self.records);
        }
        write!(
            f,
            "{} served ({} re-served, {} of {} records used), {} missed",
            self.served,
            self.reserved,
            self.served - self.reserved,
            self.records,
            self.missed_total()
        )?;
        if !self.missed.is_empty() {
            let kinds: Vec<String> = self
                .missed
                .iter()
                .map(|(k, n)| format!("{k} {n}"))
                .collect();
            write!(f, " ({})", kinds.join(", "))?;
        }
        if let (Some(min), Some(med), Some(max)) = (
            self.prefix_depth.keys().next().copied(),
            self.depth_quantile(0.5),
            self.prefix_depth.keys().next_back().copied(),
        ) {
            write!(
                f,
                "; prefix depth min {min} / median {med} / max {max} blocks"
            )?;
        }
        Ok(())
    }
}
