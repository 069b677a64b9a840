//! Small statistics helpers: exact quantiles over a bounded sample.

/// Collects samples (up to a cap, then keeps every k-th so memory stays bounded) and answers
/// quantiles. Good enough for benchmark and pacing reports; not a streaming sketch.
#[derive(Debug, Clone)]
pub struct Samples {
    values: Vec<f64>,
    cap: usize,
    stride: u64,
    seen: u64,
}

impl Default for Samples {
    fn default() -> Self {
        Self::with_capacity(1 << 20)
    }
}

impl Samples {
    pub fn with_capacity(cap: usize) -> Self {
        Self {
            values: Vec::new(),
            cap: cap.max(2),
            stride: 1,
            seen: 0,
        }
    }

    pub fn push(&mut self, v: f64) {
        self.seen += 1;
        if !self.seen.is_multiple_of(self.stride) {
            return;
        }
        if self.values.len() == self.cap {
            // halve the sample and double the stride
            let mut i = 0;
            self.values.retain(|_| {
                i += 1;
                i % 2 == 0
            });
            self.stride *= 2;
        }
        self.values.push(v);
    }

    /// Number of samples pushed (not kept).
    pub fn count(&self) -> u64 {
        self.seen
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The q-quantile (0..=1) by nearest rank; `None` when empty.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let mut v = self.values.clone();
        quantile_of(&mut v, q)
    }

    pub fn mean(&self) -> Option<f64> {
        if self.values.is_empty() {
            None
        } else {
            Some(self.values.iter().sum::<f64>() / self.values.len() as f64)
        }
    }

    pub fn max(&self) -> Option<f64> {
        self.values.iter().copied().reduce(f64::max)
    }
}

/// Nearest-rank quantile of `v` (sorted in place).
pub fn quantile_of(v: &mut [f64], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let q = q.clamp(0.0, 1.0);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_by_nearest_rank() {
        let mut s = Samples::default();
        for i in 1..=100 {
            s.push(i as f64);
        }
        assert_eq!(s.quantile(0.5), Some(50.0));
        assert_eq!(s.quantile(0.99), Some(99.0));
        assert_eq!(s.quantile(1.0), Some(100.0));
        assert_eq!(s.max(), Some(100.0));
        assert_eq!(s.mean(), Some(50.5));
    }

    #[test]
    fn bounded_memory_keeps_the_shape() {
        let mut s = Samples::with_capacity(1000);
        for i in 0..100_000 {
            s.push((i % 100) as f64);
        }
        assert_eq!(s.count(), 100_000);
        let p50 = s.quantile(0.5).unwrap();
        assert!((45.0..=55.0).contains(&p50), "{p50}");
    }
}
