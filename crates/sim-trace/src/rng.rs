//! SplitMix64: the one small seeded generator of the crate (latency draws, fitted-model
//! pacing, corpus datasets), so a seeded run draws the same numbers on every host.

/// Advance `state` and return the next 64 random bits.
#[inline]
pub(crate) fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A standard normal draw from `state` (Box–Muller, on uniforms strictly inside (0, 1)).
pub(crate) fn standard_normal(state: &mut u64) -> f64 {
    let mut open_unit = || ((splitmix64(state) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let (u1, u2) = (open_unit(), open_unit());
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}
