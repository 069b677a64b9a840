//! The step-level check: a model's step durations against a capture's, per step class.
//!
//! Request-level deltas (TTFT, ITL) mix the step model's error with the scheduler's and the
//! load's. This check isolates the step model: every observation of a capture (a step, or
//! the steps of one chunked prefill, exactly as a fit reads them) gets a duration drawn
//! from the model for its own shape, and the drawn durations are compared with the
//! captured ones, quantile by quantile, per class — decode-only steps, steps that only
//! prefill, and mixed steps (prefill chunks beside decodes). A class whose modelled
//! quantiles sit above the captured ones is a class the model makes too slow.

use std::collections::BTreeMap;

use super::capture;
use super::capture::FitInput;
use super::error::FitError;
use super::features::{Kind, Obs};
use super::model::FittedModel;
use super::observe;
use super::residual;

/// The quantile levels of a [`ClassCheck`].
pub const CHECK_LEVELS: [f64; 5] = [0.1, 0.5, 0.9, 0.99, 0.999];

/// A class of steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum StepClass {
    /// Decodes only.
    DecodeOnly,
    /// Prefill work and no decode.
    PrefillOnly,
    /// Prefill work beside decodes.
    Mixed,
}

impl StepClass {
    /// The class's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::DecodeOnly => "decode-only",
            Self::PrefillOnly => "prefill-only",
            Self::Mixed => "mixed",
        }
    }
    fn of(o: &Obs) -> Self {
        match o.kind {
            Kind::Decode { .. } => Self::DecodeOnly,
            Kind::Prefill { .. } if o.x[1] > 0.0 => Self::Mixed,
            Kind::Prefill { .. } => Self::PrefillOnly,
        }
    }
}

/// One class: the captured and the modelled durations at [`CHECK_LEVELS`], ms.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ClassCheck {
    pub class: StepClass,
    /// Observations of the class (a chunked prefill counts once).
    pub steps: u64,
    /// Mean captured duration, ms.
    pub captured_mean_ms: f64,
    /// Mean modelled duration, ms.
    pub modelled_mean_ms: f64,
    pub captured_ms: Vec<f64>,
    pub modelled_ms: Vec<f64>,
    /// Every captured and every modelled duration, ms, sorted (for figures).
    #[serde(skip)]
    pub samples: [Vec<f64>; 2],
}

impl ClassCheck {
    /// (modelled − captured) / captured, in %, at each of [`CHECK_LEVELS`].
    pub fn delta_pct(&self) -> Vec<f64> {
        self.captured_ms
            .iter()
            .zip(&self.modelled_ms)
            .map(|(c, m)| if *c > 0.0 { (m / c - 1.0) * 100.0 } else { 0.0 })
            .collect()
    }
}

/// The check of one capture: per class, and the decode-only steps per batch-size bin.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StepCheck {
    pub classes: Vec<ClassCheck>,
    /// Decode-only steps by batch-size bin (`[first, last]` decodes).
    pub decode_bins: Vec<([u32; 2], ClassCheck)>,
}

/// Multipliers on a model's durations: the decode-only steps', and the steps with prefill
/// work.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClassScale {
    pub decode: f64,
    pub prefill: f64,
}

impl ClassScale {
    /// Every step alike.
    pub const fn uniform(s: f64) -> Self {
        Self {
            decode: s,
            prefill: s,
        }
    }
}

/// Check `model` against the steps of `input` (a trace with its sidecar: without one, only
/// the decode gaps of the trace's records are seen), every modelled duration multiplied by
/// `scale` (1, or the capture's [`host_speeds`] to judge the model's shape). Draws are
/// seeded by `seed`.
pub fn check_steps(
    model: &FittedModel,
    input: &FitInput,
    scale: ClassScale,
    seed: u64,
) -> Result<StepCheck, FitError> {
    let cap = capture::read(input)?;
    let mut obs = Vec::new();
    observe::observations(&cap, model.law.after_prefill_decay, &mut obs);
    let mut pacer = model.clone().latency(seed, 1.0);
    type Samples = (Vec<f64>, Vec<f64>);
    let mut by: BTreeMap<StepClass, Samples> = BTreeMap::new();
    let mut bins: BTreeMap<(u32, u32), Samples> = BTreeMap::new();
    for o in &obs {
        let u = pacer.uniform();
        let burst = match o.kind {
            Kind::Decode { burst, .. } => Some(burst),
            Kind::Prefill { .. } => None,
        };
        let s = match o.kind {
            Kind::Decode { .. } => scale.decode,
            Kind::Prefill { .. } => scale.prefill,
        };
        let modelled = s * model.law.ms(&o.xf()) * model.ratio_of(o.kind, burst, u);
        let e = by.entry(StepClass::of(o)).or_default();
        e.0.push(f64::from(o.y));
        e.1.push(modelled);
        if let Kind::Decode { decodes, .. } = o.kind {
            let e = bins.entry(residual::decode_bin(decodes)).or_default();
            e.0.push(f64::from(o.y));
            e.1.push(modelled);
        }
    }
    let row = |class, (mut c, mut m): Samples| ClassCheck {
        class,
        steps: c.len() as u64,
        captured_mean_ms: mean(&c),
        modelled_mean_ms: mean(&m),
        captured_ms: quantiles(&mut c),
        modelled_ms: quantiles(&mut m),
        samples: [c, m],
    };
    Ok(StepCheck {
        classes: by.into_iter().map(|(k, v)| row(k, v)).collect(),
        decode_bins: bins
            .into_iter()
            .map(|((lo, hi), v)| ([lo, hi], row(StepClass::DecodeOnly, v)))
            .collect(),
    })
}

/// How fast the host of a capture ran against a model's law ([`host_speeds`]), with the
/// observations each speed rests on: over every observation, and apart over the
/// decode-only steps and over the steps with prefill work (`None` for a class of fewer
/// than [`MIN_CLASS_STEPS`] observations).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostSpeeds {
    pub all: (f64, u64),
    pub decode: Option<(f64, u64)>,
    pub prefill: Option<(f64, u64)>,
}

/// The fewest observations a step class's own speed rests on.
pub const MIN_CLASS_STEPS: u64 = 20;

/// How fast the host of `input` (a trace with its sidecar) ran against `model`'s law: the
/// median of its captured / law ratios, as a fit measures each of its captures
/// ([`super::ModelSource::speed`]), over every observation and per step class. A model
/// scaled by it describes that capture's host; what is left between them is the model's
/// shape (batch size, carry-over, scheduling, and prefill against decode unless scaled
/// per class).
pub fn host_speeds(model: &FittedModel, input: &FitInput) -> Result<HostSpeeds, FitError> {
    let cap = capture::read(input)?;
    let mut obs = Vec::new();
    observe::observations(&cap, model.law.after_prefill_decay, &mut obs);
    let of = |decode: Option<bool>| {
        super::estimate::median_speed(
            &model.law,
            obs.iter()
                .filter(|o| decode.is_none_or(|d| matches!(o.kind, Kind::Decode { .. }) == d))
                .map(|o| (o.y, o)),
        )
    };
    let class = |d| of(Some(d)).filter(|&(_, n)| n >= MIN_CLASS_STEPS);
    Ok(HostSpeeds {
        all: of(None).ok_or(FitError::NoSteps)?,
        decode: class(true),
        prefill: class(false),
    })
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

fn quantiles(v: &mut [f64]) -> Vec<f64> {
    v.sort_unstable_by(f64::total_cmp);
    let n = v.len();
    CHECK_LEVELS
        .iter()
        .map(|&p| {
            if n == 0 {
                return 0.0;
            }
            let pos = p * (n - 1) as f64;
            let lo = pos.floor() as usize;
            let hi = (lo + 1).min(n - 1);
            v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_between_order_statistics() {
        let mut v: Vec<f64> = (0..=100).map(f64::from).collect();
        let q = quantiles(&mut v);
        assert_eq!(q[0], 10.0);
        assert_eq!(q[1], 50.0);
        assert_eq!(q[2], 90.0);
        assert!((q[3] - 99.0).abs() < 1e-9);
    }
}
