//! The law's features and one observation of them: what `observe` produces and the
//! regression, the estimate and the model file consume.

/// Features of the law, in selection order: when the captures vary two terms only
/// together, the later one is dropped.
pub(crate) const NF: usize = 12;
/// Names of the features, as the model file calls their coefficients.
pub(crate) const TERMS: [&str; NF] = [
    "step_ms",
    "per_decode_ms",
    "per_prefill_token_ms",
    "prefill_step_ms",
    "per_context_token_ms",
    "per_burst_token_ms",
    "per_prefill_depth_ms",
    "after_prefill_ms",
    "per_after_prefill_token_ms",
    "new_shape_ms",
    "after_idle_ms",
    "per_first_token_ms",
];

/// Which residual distribution an observation belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A step with decodes only: `decodes` of them, `burst` tokens each on average.
    Decode { decodes: u32, burst: u32 },
    /// One or more steps with prefill work, `per_step` prefilled tokens per step.
    Prefill { per_step: u32 },
}

/// One observation: a step, or the steps of one chunked prefill.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Obs {
    /// Features, in [`TERMS`] order (summed over the steps of the observation).
    pub x: [f32; NF],
    /// Duration, ms.
    pub y: f32,
    /// Weight: 1, or `1/decodes` for a gap seen from one of the step's decodes (a step of
    /// `D` decodes is seen `D` times).
    pub weight: f32,
    pub kind: Kind,
}

impl Obs {
    /// The features as f64, for the sums.
    pub fn xf(&self) -> [f64; NF] {
        self.x.map(f64::from)
    }
}
