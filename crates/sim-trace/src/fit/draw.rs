//! Pacing an engine with a fitted model.
//!
//! Each step: draw each decode's burst (multi-token captures), evaluate the law for the
//! step's shape, draw a ratio from the nearest captured state and divide by the time scale.
//! The nearest state of a decode step is the batch-size bin containing its decodes, else
//! the closest bin (a larger batch than any captured takes the largest bin's ratios, and
//! the law's per-decode term carries the trend), then the closest mean burst within the
//! bin. The nearest state of a step with prefill work is the prefill class of its
//! prefilled tokens, else the closest class by ratio of sizes.
//!
//! Consecutive steps share their conditions (a captured engine's steps drift together:
//! the fit's residuals have a lag-1 autocorrelation of about 0.5), so the ratio's draws
//! are too: a Gaussian AR(1) with the law's `residual_autocorrelation`, mapped through the
//! normal CDF to the uniform that picks the ratio. Each step's ratio keeps the captured
//! distribution; what changes is that slow steps come in runs, as captured, and a request
//! of many steps spreads as far from the median as a captured one does (drawn
//! independently, 63 decode steps average their noise out, and corpus v2's request totals
//! at p90 came out 4–8 % short of the captures').

use super::features::NF;
use super::model::{DecodeBin, FittedModel, PrefillClass};
use super::observe::{AfterPrefill, SeenSizes, mean_burst};
use super::residual;
use crate::latency::{LatencyModel, StepShape, StepTiming};

/// A [`FittedModel`] pacing an engine (`play --latency-trace`).
#[derive(Debug, Clone)]
pub struct FittedLatency {
    model: FittedModel,
    rng: u64,
    time_scale: f64,
    /// Multiplier on the steps with prefill work, beside `time_scale`: 1, or how much
    /// slower a capture's host ran its prefills than its decodes against the law
    /// ([`FittedLatency::with_prefill_speed`]).
    prefill_speed: f64,
    /// Cumulative burst distribution: `burst_cdf[n − 1]` = P(burst ≤ n).
    burst_cdf: Vec<f64>,
    /// The prefills of the steps paced so far, fading.
    after: AfterPrefill,
    /// The step sizes paced so far.
    sizes: SeenSizes,
    /// The AR(1) state behind the ratio's draws, and its lag-1 correlation.
    z: f64,
    rho: f64,
}

impl FittedModel {
    /// The model as the engine drives it: draws seeded by `seed`, every duration divided by
    /// `time_scale` (a non-positive or non-finite scale counts as 1).
    pub fn latency(self, seed: u64, time_scale: f64) -> FittedLatency {
        let burst_cdf = match &self.bursts {
            Some(b) => {
                let total: u64 = b.counts.iter().sum();
                let mut acc = 0;
                b.counts
                    .iter()
                    .map(|&c| {
                        acc += c;
                        acc as f64 / total.max(1) as f64
                    })
                    .collect()
            }
            None => Vec::new(),
        };
        let rho = self.law.residual_autocorrelation;
        FittedLatency {
            after: AfterPrefill::new(self.law.after_prefill_decay),
            sizes: SeenSizes::default(),
            z: 0.0,
            rho: if rho.is_finite() {
                rho.clamp(0.0, MAX_RHO)
            } else {
                0.0
            },
            model: self,
            rng: seed ^ 0x6669_7474_6564_0002,
            time_scale: if time_scale.is_finite() && time_scale > 0.0 {
                time_scale
            } else {
                1.0
            },
            burst_cdf,
            prefill_speed: 1.0,
        }
    }

    /// The law's value for a step of this shape, ms, when its decodes deliver one token
    /// each, no prefill ran before it and the engine ran its size before (before the
    /// ratio is drawn).
    pub fn law_ms(&self, shape: &StepShape) -> f64 {
        self.law.ms(&features(shape, None, [0.0; 2], false))
    }

    /// The median duration of a step of this shape, ms, when its decodes deliver one token
    /// each and no prefill ran before it: the law times the median ratio of the step's
    /// state.
    pub fn expected_ms(&self, shape: &StepShape) -> f64 {
        self.law_ms(shape) * self.ratio(shape, None, 0.5)
    }

    fn decode_bin(&self, decodes: u32) -> Option<&DecodeBin> {
        self.decode.iter().min_by_key(|b| {
            (
                residual::distance(decodes, b.decodes[0], b.decodes[1]),
                std::cmp::Reverse(b.decodes[0]),
            )
        })
    }

    fn prefill_class(&self, tokens: u64) -> Option<&PrefillClass> {
        let t = tokens.min(u64::from(u32::MAX)) as u32;
        self.prefill.iter().min_by(|a, b| {
            residual::log_distance(t, a.tokens[0], a.tokens[1]).total_cmp(&residual::log_distance(
                t,
                b.tokens[0],
                b.tokens[1],
            ))
        })
    }

    /// The ratio at `u` of the state an observation of this kind belongs to (decodes of
    /// `burst` tokens each for a decode step).
    pub(crate) fn ratio_of(&self, kind: super::features::Kind, burst: Option<u32>, u: f64) -> f64 {
        use super::features::Kind;
        match kind {
            Kind::Decode { decodes, .. } => {
                let Some(b) = self.decode_bin(decodes) else {
                    return 1.0;
                };
                self.bin_ratio(b, burst.unwrap_or(1), u)
            }
            Kind::Prefill { per_step } => match self.prefill_class(u64::from(per_step)) {
                Some(c) => residual::inverse(&self.levels, &c.ratio, u),
                None => 1.0,
            },
        }
    }

    /// The ratio at `u` of the cell of bin `b` nearest to a mean burst of `burst` tokens.
    fn bin_ratio(&self, b: &DecodeBin, burst: u32, u: f64) -> f64 {
        let cell = b
            .cells
            .iter()
            .min_by_key(|c| (c.burst.abs_diff(burst), c.burst))
            .expect("a bin has cells");
        residual::inverse(&self.levels, &cell.ratio, u)
    }

    /// The ratio at `u` of the state nearest to this step, whose decodes deliver `tokens`
    /// (`None`: one each); 1 when the model has no state of either kind.
    fn ratio(&self, shape: &StepShape, tokens: Option<&[u32]>, u: f64) -> f64 {
        let decodes = shape.decodes.len() as u32;
        let prefill: u64 = shape.prefills.iter().map(|c| c.tokens).sum();
        let from_class = |c: &PrefillClass| residual::inverse(&self.levels, &c.ratio, u);
        let from_bin = |b: &DecodeBin| {
            let m = tokens.map_or(1, |t| mean_burst(t.iter().sum(), decodes));
            self.bin_ratio(b, m, u)
        };
        if prefill > 0 {
            if let Some(c) = self.prefill_class(prefill) {
                return from_class(c);
            }
        } else if let Some(b) = self.decode_bin(decodes) {
            return from_bin(b);
        }
        // the other kind's nearest state, rather than no spread at all
        match (
            self.decode_bin(decodes.max(1)),
            self.prefill_class(prefill.max(1)),
        ) {
            (Some(b), _) => from_bin(b),
            (None, Some(c)) => from_class(c),
            (None, None) => 1.0,
        }
    }
}

/// The largest lag-1 correlation the draws take: a model file claiming more (1 would
/// freeze the ratio) is held to it.
const MAX_RHO: f64 = 0.95;

/// The standard normal CDF (Abramowitz and Stegun 26.2.17, absolute error < 7.5e-8).
fn normal_cdf(z: f64) -> f64 {
    let x = z.abs();
    let t = 1.0 / (1.0 + 0.231_641_9 * x);
    let poly = t
        * (0.319_381_530
            + t * (-0.356_563_782
                + t * (1.781_477_937 + t * (-1.821_255_978 + t * 1.330_274_429))));
    let tail = (-x * x / 2.0).exp() / (std::f64::consts::TAU).sqrt() * poly;
    if z >= 0.0 { 1.0 - tail } else { tail }
}

/// The law's features for a step of this shape whose decodes deliver `tokens` (`None`:
/// one each), carrying `after` from the steps before it ([`AfterPrefill::sums`]), the
/// engine's first of its size or not.
fn features(
    shape: &StepShape,
    tokens: Option<&[u32]>,
    after: [f64; 2],
    new_size: bool,
) -> [f64; NF] {
    let decodes = shape.decodes.len() as f64;
    let delivered: f64 = tokens.map_or(decodes, |t| t.iter().map(|&n| f64::from(n)).sum());
    let ctx: f64 = shape.decodes.iter().map(|d| d.context as f64).sum();
    let prefill: f64 = shape.prefills.iter().map(|c| c.tokens as f64).sum();
    let depth: f64 = shape
        .prefills
        .iter()
        .map(|c| {
            let (d0, d1) = (c.context as f64, (c.context + c.tokens) as f64);
            (d1 * d1 - d0 * d0) / 2.0
        })
        .sum();
    let prefill_step = if shape.prefills.is_empty() { 0.0 } else { 1.0 };
    [
        1.0,
        decodes,
        prefill,
        prefill_step,
        ctx,
        (delivered - decodes).max(0.0),
        depth,
        after[0],
        after[1],
        if new_size { 1.0 } else { 0.0 },
        if shape.after_idle { 1.0 } else { 0.0 },
        shape
            .prefills
            .iter()
            .filter(|c| c.context + c.tokens >= c.uncached_prompt)
            .count() as f64,
    ]
}

impl FittedLatency {
    /// Every step with prefill work takes `factor` times as long (a non-positive or
    /// non-finite factor counts as 1). A host's speed drifts unevenly: between two runs of
    /// the same workload the decode-only steps (memory-bound) moved up to 25 % against the
    /// law where the steps with prefills (compute-bound) moved 5–10 %, so a capture's
    /// speed is matched per class ([`crate::fit::host_speeds`]).
    pub fn with_prefill_speed(mut self, factor: f64) -> Self {
        self.prefill_speed = if factor.is_finite() && factor > 0.0 {
            factor
        } else {
            1.0
        };
        self
    }

    /// The model this pacer draws from.
    pub fn model(&self) -> &FittedModel {
        &self.model
    }

    /// A uniform draw in [0, 1) (SplitMix64).
    pub(crate) fn uniform(&mut self) -> f64 {
        self.unit()
    }

    fn unit(&mut self) -> f64 {
        (crate::rng::splitmix64(&mut self.rng) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The uniform that picks this step's ratio: the next value of the AR(1) state, through
    /// the normal CDF (see the module docs).
    fn correlated_unit(&mut self) -> f64 {
        let e = crate::rng::standard_normal(&mut self.rng);
        self.z = self.rho * self.z + (1.0 - self.rho * self.rho).sqrt() * e;
        normal_cdf(self.z)
    }

    fn burst(&mut self) -> u32 {
        let u = self.unit();
        self.burst_cdf
            .partition_point(|&c| c <= u)
            .min(self.burst_cdf.len() - 1) as u32
            + 1
    }
}

impl LatencyModel for FittedLatency {
    fn step(&mut self, shape: &StepShape) -> StepTiming {
        let decode_tokens: Vec<u32> = if self.burst_cdf.is_empty() {
            Vec::new()
        } else {
            (0..shape.decodes.len()).map(|_| self.burst()).collect()
        };
        let tokens = (!decode_tokens.is_empty()).then_some(decode_tokens.as_slice());
        let u = self.correlated_unit();
        let m = &self.model;
        let new_size = self
            .sizes
            .first(shape.prefill_tokens() + shape.decodes.len() as u64);
        let x = features(shape, tokens, self.after.sums(), new_size);
        let mut ms = m.law.ms(&x) * m.ratio(shape, tokens, u);
        if !shape.prefills.is_empty() {
            ms *= self.prefill_speed;
        }
        self.after.after_step(shape.prefill_tokens());
        StepTiming {
            duration: crate::latency::duration_from_ms(ms / self.time_scale),
            decode_tokens,
        }
    }

    fn describe(&self) -> String {
        let m = &self.model;
        let l = &m.law;
        let mut law = format!("{:.3}", l.step_ms);
        for (c, what) in [
            (l.per_decode_ms, "decode"),
            (l.per_prefill_token_ms, "prefill token"),
            (l.prefill_step_ms, "prefill step"),
            (l.per_context_token_ms, "context token"),
            (l.per_burst_token_ms, "burst token"),
            (l.per_prefill_depth_ms, "prefill token·depth"),
            (l.after_prefill_ms, "earlier prefill step"),
            (l.per_after_prefill_token_ms, "earlier prefill token"),
            (l.new_shape_ms, "new step size"),
            (l.after_idle_ms, "step from idle"),
            (l.per_first_token_ms, "first token"),
        ] {
            if c != 0.0 {
                law += &format!(" + {c:.4e}/{what}");
            }
        }
        let bins: Vec<String> = m
            .decode
            .iter()
            .map(|b| match b.decodes {
                [lo, hi] if lo == hi => lo.to_string(),
                [lo, hi] => format!("{lo}-{hi}"),
            })
            .collect();
        format!(
            "fitted (step {law} ms; decode batches {} seen; {} prefill classes{}{})",
            bins.join(","),
            m.prefill.len(),
            m.num_spec_tokens()
                .map(|k| format!("; bursts up to {}", k + 1))
                .unwrap_or_default(),
            if self.time_scale != 1.0 {
                format!("; time scale {}", self.time_scale)
            } else {
                String::new()
            }
        )
    }

    fn num_spec_tokens(&self) -> Option<u32> {
        self.model.num_spec_tokens()
    }
}
