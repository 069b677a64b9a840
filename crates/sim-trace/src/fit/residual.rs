//! The empirical ratio distributions and the states they are kept for.
//!
//! A captured step's ratio is its duration over what the law predicts for it. Ratios are
//! kept as quantiles at [`LEVELS`] — dense in the tails (1 %, 2.5 %, … 99.9 %, and the
//! extremes), because the tail is what a clamped normal would lose — and drawn by
//! interpolating the inverse distribution at a uniform point. They are kept per state:
//!
//! * decode steps per batch-size bin ([`decode_bin`]: each size up to 8, then bins 25 %
//!   wide), and within a bin per mean burst (tokens per decode, rounded: 1 for
//!   autoregressive captures);
//! * steps with prefill work per prefill-size class ([`prefill_class`]: powers of two of
//!   the tokens prefilled per step).
//!
//! A state needs [`MIN_CELL`] steps to keep a distribution; fewer steps say little about a
//! tail, so such a state draws from the nearest one that has them.

/// Quantile levels of the kept distributions.
pub(crate) const LEVELS: [f64; 19] = [
    0.0, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.975, 0.99, 0.995,
    0.999, 1.0,
];
/// Steps a state needs for its own distribution.
pub(crate) const MIN_CELL: usize = 20;

/// The batch-size bin of `decodes`: the size itself up to 8, then bins 25 % wide
/// (9–10, 11–12, 13–15, 16–19, 20–24, …), so a capture with every size up to 256 keeps
/// about 30 bins, not 256.
pub(crate) fn decode_bin(decodes: u32) -> (u32, u32) {
    if decodes <= 8 {
        return (decodes, decodes);
    }
    let (mut lo, mut edge) = (9u32, 8.0f64);
    loop {
        edge *= 1.25;
        let hi = edge.floor() as u32;
        if decodes <= hi {
            return (lo, hi);
        }
        lo = hi + 1;
    }
}

/// The prefill-size class of `tokens` prefilled per step: `[2^k, 2^(k+1) − 1]`.
pub(crate) fn prefill_class(tokens: u32) -> (u32, u32) {
    let t = tokens.max(1);
    let k = 31 - t.leading_zeros();
    let lo = 1u32 << k;
    (lo, lo.saturating_mul(2).saturating_sub(1))
}

/// Quantiles of `v` at [`LEVELS`] (sorts `v`), linear between order statistics, rounded
/// to 4 decimals (ratios near 1: a 0.01 % step).
pub(crate) fn quantiles(v: &mut [f32]) -> Vec<f64> {
    v.sort_unstable_by(f32::total_cmp);
    let n = v.len();
    LEVELS
        .iter()
        .map(|&p| {
            let pos = p * (n - 1) as f64;
            let lo = pos.floor() as usize;
            let hi = (lo + 1).min(n - 1);
            let (a, b) = (f64::from(v[lo]), f64::from(v[hi]));
            ((a + (b - a) * (pos - lo as f64)) * 1e4).round() / 1e4
        })
        .collect()
}

/// The inverse distribution at `u` ∈ [0, 1): piecewise linear through the quantiles.
pub(crate) fn inverse(levels: &[f64], q: &[f64], u: f64) -> f64 {
    let i = levels
        .partition_point(|&l| l <= u)
        .clamp(1, levels.len() - 1);
    let (l0, l1) = (levels[i - 1], levels[i]);
    let f = if l1 > l0 { (u - l0) / (l1 - l0) } else { 0.0 };
    q[i - 1] + (q[i] - q[i - 1]) * f.clamp(0.0, 1.0)
}

/// The median of `v` (sorts it).
pub(crate) fn median(v: &mut [f32]) -> f64 {
    v.sort_unstable_by(f32::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    (f64::from(v[(n - 1) / 2]) + f64::from(v[n / 2])) / 2.0
}

/// The median of `v` (sorts it); NaN when empty.
pub(crate) fn median_f64(v: &mut [f64]) -> f64 {
    v.sort_unstable_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    (v[(n - 1) / 2] + v[n / 2]) / 2.0
}

/// Distance from `x` to the range `[lo, hi]` (0 inside).
pub(crate) fn distance(x: u32, lo: u32, hi: u32) -> u32 {
    if x < lo { lo - x } else { x.saturating_sub(hi) }
}

/// Distance in octaves from `x` to the range `[lo, hi]` (0 inside): prefill sizes are far
/// or near by ratio, not by difference.
pub(crate) fn log_distance(x: u32, lo: u32, hi: u32) -> f64 {
    let x = f64::from(x.max(1));
    if x < f64::from(lo) {
        (f64::from(lo) / x).log2()
    } else if x > f64::from(hi) {
        (x / f64::from(hi)).log2()
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bins_cover_every_size_once() {
        let mut prev = (0, 0);
        for d in 1..2000 {
            let b = decode_bin(d);
            assert!(b.0 <= d && d <= b.1, "{d} in {b:?}");
            if b != prev {
                assert_eq!(b.0, prev.1 + 1, "contiguous at {d}");
                prev = b;
            }
        }
        assert_eq!(decode_bin(8), (8, 8));
        assert_eq!(decode_bin(9), (9, 10));
        assert_eq!(prefill_class(128), (128, 255));
        assert_eq!(prefill_class(896), (512, 1023));
        assert_eq!(prefill_class(1), (1, 1));
    }

    #[test]
    fn inverse_interpolates_the_quantiles() {
        let mut v: Vec<f32> = (0..=1000).map(|i| i as f32 / 1000.0).collect();
        let q = quantiles(&mut v);
        for u in [0.0, 0.005, 0.3, 0.5, 0.97, 0.9995] {
            assert!((inverse(&LEVELS, &q, u) - u).abs() < 1e-3, "{u}");
        }
        assert!((inverse(&LEVELS, &q, 0.999_999) - 1.0).abs() < 1e-3);
    }
}
