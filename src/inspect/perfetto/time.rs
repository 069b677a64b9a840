//! The timeline's clock: a trace's milliseconds as the whole microseconds both formats
//! write.

/// µs on the trace's clock, rounded half away from zero as `f64::round`.
///
/// `round` is a libm call on the baseline x86-64 target (no SSE4.1 `roundsd`), and this
/// runs for every token boundary: below 2^52 the truncation is an exact integer
/// conversion and the fraction left over is exact too, so rounding from them gives
/// `round`'s result inline.
pub(super) fn us(ms: f64) -> i64 {
    let x = ms * 1000.0;
    if x.abs() < (1u64 << 52) as f64 {
        let t = x as i64;
        let frac = x - t as f64;
        if frac >= 0.5 {
            t + 1
        } else if frac <= -0.5 {
            t - 1
        } else {
            t
        }
    } else {
        x.round() as i64
    }
}

#[cfg(test)]
mod tests {
    use super::us;

    /// The inline rounding is `f64::round`'s, halves and the float just below one included.
    #[test]
    fn us_rounds_as_round_does() {
        let below_half = 0.5 - f64::EPSILON / 4.0;
        for x in [
            0.0,
            -0.0,
            0.5,
            -0.5,
            1.5,
            2.5,
            -2.5,
            below_half,
            -below_half,
            1e15 + 0.5,
            4.6e15,
            -4.6e15,
            9.3e18,
            1e300,
            -1e300,
            f64::NAN,
            f64::INFINITY,
        ] {
            assert_eq!(us(x / 1000.0), (x / 1000.0 * 1000.0).round() as i64, "{x}");
        }
        let mut v = 0.000_123_4f64;
        while v < 1e12 {
            for x in [v, -v, v + 0.0005, v * 1.0000001] {
                assert_eq!(us(x), (x * 1000.0).round() as i64, "{x}");
            }
            v *= 1.37;
        }
    }
}
