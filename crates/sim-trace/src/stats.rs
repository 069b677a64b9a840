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

/// A streaming histogram with logarithmic buckets: constant memory whatever the number of
/// values, quantiles within [`Histogram::RELATIVE_ERROR`] of the exact nearest-rank value,
/// exact count, sum (mean), min and max. Values ≤ 0 are counted in one zero bucket.
#[derive(Debug, Clone, Default)]
pub struct Histogram {
    /// Bucket `i` holds values in `[GAMMA^(i-OFFSET), GAMMA^(i-OFFSET+1))`.
    buckets: Vec<u64>,
    zeros: u64,
    count: u64,
    sum: f64,
    min: f64,
    max: f64,
    /// Every value is an integer: quantiles are rounded to one.
    integers: bool,
}

impl Histogram {
    /// Bucket width ratio: quantiles are reported at the bucket's geometric centre, so the
    /// relative error is at most `(GAMMA - 1) / 2`.
    const GAMMA: f64 = 1.01;
    /// Covers 1e-9 .. 1e12 (in whatever unit is pushed) with 4,900 buckets.
    const OFFSET: i64 = 2083;
    const LEN: usize = 4900;
    pub const RELATIVE_ERROR: f64 = 0.005;

    pub fn new() -> Self {
        Self {
            min: f64::INFINITY,
            max: f64::NEG_INFINITY,
            ..Self::default()
        }
    }

    pub fn push(&mut self, v: f64) {
        if !v.is_finite() {
            return;
        }
        if self.count == 0 {
            self.min = v;
            self.max = v;
        } else {
            self.min = self.min.min(v);
            self.max = self.max.max(v);
        }
        self.count += 1;
        self.sum += v;
        if v <= 0.0 {
            self.zeros += 1;
            return;
        }
        if self.buckets.is_empty() {
            self.buckets = vec![0; Self::LEN];
        }
        self.buckets[Self::bucket(v)] += 1;
    }

    /// The bucket of `v` (> 0) by its definition: `floor(ln v / ln GAMMA) + OFFSET`, clamped
    /// to the buckets there are.
    #[cfg(test)]
    fn bucket_by_log(v: f64) -> usize {
        let i = floor_i64(v.ln() / Self::GAMMA.ln()) + Self::OFFSET;
        i.clamp(0, Self::LEN as i64 - 1) as usize
    }

    /// The bucket of `v` (> 0), the same as [`bucket_by_log`](Self::bucket_by_log) but
    /// without its logarithm and division (a quarter of `inspect summarize`'s time, one per
    /// inter-token gap): a cheap estimate from the float's bits, corrected against the
    /// table of bucket boundaries, which were found with that very formula.
    #[inline]
    fn bucket(v: f64) -> usize {
        let bounds = bucket_bounds();
        // log2(v) = exponent + log2(mantissa); log2(1 + t) ≈ t (1.3466 − 0.3466 t) on
        // [0, 1), within 0.0077, 0.54 of a bucket (a bucket is 1/69.7 of a power of two).
        // Less 0.54, the estimate is the bucket or one of the two below it; two steps up
        // without branches (a mispredicted loop cost as much as the logarithm) finish it.
        let bits = v.to_bits();
        let exponent = ((bits >> 52) & 0x7ff) as i64 - 1023;
        let t = f64::from_bits((bits & ((1 << 52) - 1)) | (1023 << 52)) - 1.0;
        let log2 = exponent as f64 + t * (1.346_555_3 - 0.346_555_3 * t);
        let below = log2 * (std::f64::consts::LN_2 / Self::GAMMA.ln()) - 0.54;
        let mut i = (floor_i64(below) + Self::OFFSET).clamp(0, Self::LEN as i64 - 3) as usize;
        i += usize::from(bounds[i + 1] <= v);
        i += usize::from(bounds[i + 1] <= v);
        i
    }

    /// A histogram of integer values (token counts, concurrency): quantiles are rounded to
    /// the nearest integer, so small values are exact.
    pub fn for_integers() -> Self {
        Self {
            integers: true,
            ..Self::new()
        }
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    pub fn mean(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum / self.count as f64)
    }

    pub fn sum(&self) -> f64 {
        self.sum
    }

    pub fn min(&self) -> Option<f64> {
        (self.count > 0).then_some(self.min)
    }

    pub fn max(&self) -> Option<f64> {
        (self.count > 0).then_some(self.max)
    }

    /// The nearest-rank q-quantile (0..=1), within the relative error; the extremes are
    /// exact.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let q = q.clamp(0.0, 1.0);
        let rank = ((q * self.count as f64).ceil() as u64).clamp(1, self.count);
        if rank == self.count {
            return Some(self.max);
        }
        if rank == 1 {
            return Some(self.min);
        }
        let mut seen = self.zeros;
        if seen >= rank {
            return Some(self.min.min(0.0));
        }
        for (i, &n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                let lo = Self::GAMMA.powf((i as i64 - Self::OFFSET) as f64);
                let mid = (lo * (1.0 + Self::GAMMA) / 2.0).clamp(self.min, self.max);
                return Some(if self.integers { mid.round() } else { mid });
            }
        }
        Some(self.max)
    }
}

/// `bounds[i]` (i ≥ 1): the smallest positive float whose bucket by the formula
/// ([`Histogram::bucket_by_log`], unclamped) is `i` or more; `bounds[0]` is 0. Computed
/// once: an estimate, then moved one float at a time to where the formula's result
/// changes (a few steps per boundary, about 1 ms in all).
fn bucket_bounds() -> &'static [f64] {
    static BOUNDS: std::sync::OnceLock<Vec<f64>> = std::sync::OnceLock::new();
    BOUNDS.get_or_init(|| {
        let raw = |v: f64| floor_i64(v.ln() / Histogram::GAMMA.ln()) + Histogram::OFFSET;
        let mut bounds = vec![0.0; Histogram::LEN];
        for (i, b) in bounds.iter_mut().enumerate().skip(1) {
            let i = i as i64;
            let mut x = ((i - Histogram::OFFSET) as f64 * Histogram::GAMMA.ln()).exp();
            while raw(x) < i {
                x = x.next_up();
            }
            while raw(x.next_down()) >= i {
                x = x.next_down();
            }
            *b = x;
        }
        bounds
    })
}

/// `x.floor() as i64`, without `floor`: on the baseline x86-64 target (no SSE4.1) that is a
/// call into libm, which cost as much as the rest of [`Histogram::push`].
#[inline]
fn floor_i64(x: f64) -> i64 {
    let t = x as i64; // rounds toward zero (saturating; NaN gives 0, as `floor() as i64`)
    if (t as f64) > x {
        t.saturating_sub(1)
    } else {
        t
    }
}

#[cfg(test)]
mod histogram_tests {
    use super::*;

    #[test]
    fn quantiles_within_the_stated_error() {
        let mut h = Histogram::new();
        let mut exact = Vec::new();
        let mut x = 0.37_f64;
        for i in 0..20_000 {
            // a spread of magnitudes, heavy tail
            x = (x * 7919.0 + 0.123).fract();
            let v = 0.05 * (1.0 + 40.0 * x * x) * (1.0 + (i % 7) as f64);
            h.push(v);
            exact.push(v);
        }
        for q in [0.01, 0.5, 0.9, 0.99] {
            let e = quantile_of(&mut exact, q).unwrap();
            let a = h.quantile(q).unwrap();
            assert!(
                (a - e).abs() <= e * Histogram::RELATIVE_ERROR + 1e-12,
                "q{q}: {a} vs {e}"
            );
        }
        assert_eq!(h.quantile(1.0), exact.iter().copied().reduce(f64::max));
        assert_eq!(h.count(), 20_000);
        let mean = exact.iter().sum::<f64>() / exact.len() as f64;
        assert!((h.mean().unwrap() - mean).abs() < 1e-9 * mean);
    }

    #[test]
    fn buckets_by_table_are_buckets_by_log() {
        let bounds = bucket_bounds();
        // every boundary, and the floats either side of it
        for &b in &bounds[1..] {
            for v in [b.next_down(), b, b.next_up()] {
                assert_eq!(Histogram::bucket(v), Histogram::bucket_by_log(v), "{v:e}");
            }
        }
        // a spread of values, the ends of the range and past them
        let mut x = 0.123_f64;
        for _ in 0..200_000 {
            x = (x * 7919.0 + 0.377).fract();
            let v = 10f64.powf(-12.0 + 27.0 * x);
            assert_eq!(Histogram::bucket(v), Histogram::bucket_by_log(v), "{v:e}");
        }
        for v in [
            f64::MIN_POSITIVE,
            f64::MIN_POSITIVE / 4.0,
            1e-300,
            1e-9,
            1.0,
            18.5,
            1e12,
            1e300,
            f64::MAX,
        ] {
            assert_eq!(Histogram::bucket(v), Histogram::bucket_by_log(v), "{v:e}");
        }
    }

    #[test]
    fn floor_i64_is_floor() {
        for x in [
            0.0,
            -0.0,
            0.5,
            -0.5,
            1.0,
            -1.0,
            1.999,
            -1.001,
            2083.0,
            -2083.0,
            1e-300,
            -1e-300,
            f64::NAN,
            1e30,
            -1e30,
        ] {
            assert_eq!(floor_i64(x), x.floor() as i64, "{x}");
        }
    }

    #[test]
    fn empty_zero_and_single() {
        let mut h = Histogram::new();
        assert_eq!(h.quantile(0.5), None);
        h.push(0.0);
        assert_eq!(h.quantile(0.5), Some(0.0));
        let mut h = Histogram::new();
        h.push(42.0);
        assert_eq!(h.quantile(0.5), Some(42.0));
        assert_eq!(h.min(), Some(42.0));
        let mut h = Histogram::for_integers();
        for v in [63.0, 64.0, 64.0, 64.0, 128.0] {
            h.push(v);
        }
        assert_eq!(h.quantile(0.5), Some(64.0));
    }
}
