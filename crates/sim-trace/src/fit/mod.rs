//! The step latency model fitted to tap captures (`play --latency-trace`, `inspect fit`).
//!
//! The engine composes every step itself — decodes first, prefill chunks in the token
//! budget left, chunked prefill, queueing from its own scheduler — and asks a
//! [`LatencyModel`](crate::latency::LatencyModel) once per step how long that step takes.
//! This module answers from what a real engine was seen to do. It never samples a TTFT or
//! an ITL: a request's wait comes from the simulated scheduler, so load is not counted
//! twice.
//!
//! # The model
//!
//! ```text
//! duration = law(step) × ratio                                           ÷ time_scale
//! law      = step_ms + per_decode_ms·D + per_burst_token_ms·(T − D)
//!          + per_context_token_ms·ΣC
//!          + [prefill] prefill_step_ms + per_prefill_token_ms·P + per_prefill_depth_ms·Q
//!          + after_prefill_ms·A + per_after_prefill_token_ms·AP
//! ratio    = a draw from the empirical distribution of captured duration / law, in the
//!            nearest state the capture saw (decode steps: the batch-size bin and the
//!            step's mean burst; steps with prefill: the prefill-size class)
//! ```
//!
//! `D` decodes, `T` tokens they deliver, `ΣC` their summed contexts, `P` prefilled tokens,
//! `Q = Σ (d1² − d0²)/2` over the chunks (a chunk from depth `d0` to `d1` attends over the
//! context below it). `A = Σ γ^k` and `AP = Σ P_j·γ^k` carry the prefills of earlier
//! steps (`k` steps ago, `P_j` tokens) into this one: a prefill slows the steps after it,
//! fading; the discount `γ` is the one (of a few tried) whose law fits best. The law is
//! fitted by weighted least squares over every captured step (relative errors, as the
//! noise is multiplicative), and a term is kept only when the captures identify it: a term
//! they never vary, or vary only together with other terms, is dropped; so is a term whose
//! coefficient is negative or less than 3 standard errors from zero (standard errors
//! widened for the residuals' autocorrelation). Why each term was kept
//! or dropped is written into the model file. `docs/latency-model.md` has the numbers
//! measured on the real CPU-engine fixture and the fallbacks for unseen states.
//!
//! # Reading captures
//!
//! `capture` turns a trace (and its step-stats sidecar) into engine steps; `observe` turns
//! steps into observations (durations corrected for idle time, chunked prefills summed over
//! the steps that computed them); `regress` selects and fits the law; `residual` keeps the
//! ratio distributions; `estimate` builds the model from them; `model` is the file;
//! `draw` paces an engine. The leaves they share sit below them all: `features` (the
//! law's terms and one observation), `format` (the model file's identity) and `error`.

mod capture;
mod check;
mod draw;
mod error;
mod estimate;
mod features;
mod format;
mod model;
mod observe;
mod regress;
mod residual;

pub use capture::FitInput;
pub use check::{
    CHECK_LEVELS, ClassCheck, ClassScale, HostSpeeds, MIN_CLASS_STEPS, StepCheck, StepClass,
    check_steps, host_speeds,
};
pub use draw::FittedLatency;
pub use error::FitError;
pub use format::{FORMAT, VERSION};
pub use model::{
    Bursts, DecodeBin, FittedModel, InputKind, ModelMeta, ModelSource, PrefillClass, RatioCell,
    StepLaw, sniff,
};
pub use regress::TermFit;

/// Fit a model to captures: read every trace (and sidecar), reconstruct the engine steps,
/// fit the law and keep the ratio distributions. Memory grows with the captured steps
/// (under 100 bytes each), not with the number of tokens.
pub fn fit(inputs: &[FitInput]) -> Result<FittedModel, FitError> {
    fit_with(inputs, &FitOptions::default())
}

/// How a fit reads its captures.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FitOptions {
    /// One host speed per capture ([`ModelSource::speed`]): for captures taken at
    /// different times whose shapes vary *within* each capture (the calibration suite).
    /// Not for captures that each hold one shape (one concurrency, one prompt length):
    /// their speeds would absorb exactly what differs between them.
    pub per_capture_speed: bool,
}

/// [`fit`] with options.
pub fn fit_with(inputs: &[FitInput], opts: &FitOptions) -> Result<FittedModel, FitError> {
    let mut caps = Vec::with_capacity(inputs.len());
    let mut bursts = Vec::new();
    for input in inputs {
        let cap = capture::read(input)?;
        for (n, &c) in cap.bursts.iter().enumerate() {
            if bursts.len() <= n {
                bursts.resize(n + 1, 0);
            }
            bursts[n] += c;
        }
        caps.push(cap);
    }
    // the carry-over of a prefill into the steps after it fades at a rate the captures
    // choose: the discount whose fitted law leaves the smallest relative residuals
    let mut best: Option<(f64, FittedModel)> = None;
    for decay in AFTER_PREFILL_DECAYS {
        let mut obs = Vec::new();
        let mut spans = Vec::with_capacity(caps.len());
        for cap in &caps {
            let before = obs.len();
            observe::observations(cap, decay, &mut obs);
            spans.push(before..obs.len());
        }
        if obs.is_empty() {
            return Err(FitError::NoSteps);
        }
        let model = fit_speeds(
            &caps,
            &spans,
            &mut obs,
            &bursts,
            decay,
            opts.per_capture_speed,
        );
        let score = estimate::relative_rss(&model.law, &obs);
        // a longer carry-over must earn its place: ties go to the shorter one
        if best.as_ref().is_none_or(|(b, _)| score < b * (1.0 - 1e-3)) {
            best = Some((score, model));
        }
    }
    let (_, model) = best.ok_or(FitError::NoSteps)?;
    // what a model file may not hold, a fit may not produce either (inputs are bounded,
    // so this only catches a fit that went numerically wrong)
    model.check().map_err(|why| FitError::Invalid {
        path: inputs.first().map(|i| i.trace.clone()).unwrap_or_default(),
        why: format!("the fit of these captures gives an unusable model: {why}"),
    })?;
    Ok(model)
}

/// Fit the law, with one speed per capture when `per_capture_speed`: captures taken at different times run at
/// different speeds (a host's load and clocks drift by tens of percent over an hour on a
/// shared machine), and a law fitted across them would read that drift as the cost of
/// whatever the captures' shapes differ in. Each capture's durations are divided by its
/// speed — the median of its captured / law ratios, normalised so the speeds' geometric
/// mean over the observations is 1 — and the law refitted, a few rounds. The model then
/// describes the fit set's average host; each source keeps its speed. `obs` is left
/// scaled by the final speeds.
fn fit_speeds(
    caps: &[capture::Capture],
    spans: &[std::ops::Range<usize>],
    obs: &mut [features::Obs],
    bursts: &[u64],
    decay: f64,
    per_capture_speed: bool,
) -> FittedModel {
    let raw: Vec<f32> = obs.iter().map(|o| o.y).collect();
    let mut speed = vec![1.0f64; caps.len()];
    let rounds = if caps.len() > 1 && per_capture_speed {
        SPEED_ROUNDS
    } else {
        0
    };
    let sources = |speed: &[f64], with: bool| -> Vec<ModelSource> {
        caps.iter()
            .zip(spans)
            .zip(speed)
            .map(|((cap, span), &s)| ModelSource {
                observations: span.len() as u64,
                speed: with.then_some((s * 1e4).round() / 1e4),
                ..cap.source.clone()
            })
            .collect()
    };
    let mut model = estimate::build(sources(&speed, false), obs, bursts.to_vec(), decay);
    for _ in 0..rounds {
        let mut log_sum = 0.0;
        for (c, span) in spans.iter().enumerate() {
            let pairs = span.clone().map(|i| (raw[i], &obs[i]));
            speed[c] = estimate::median_speed(&model.law, pairs).map_or(1.0, |(s, _)| s);
            log_sum += speed[c].ln() * span.len() as f64;
        }
        let mean = (log_sum / obs.len() as f64).exp();
        for (c, span) in spans.iter().enumerate() {
            speed[c] /= mean;
            for i in span.clone() {
                obs[i].y = (f64::from(raw[i]) / speed[c]) as f32;
            }
        }
        model = estimate::build(sources(&speed, true), obs, bursts.to_vec(), decay);
    }
    model
}

/// Rounds of [`fit_speeds`]: the speeds settle in two.
const SPEED_ROUNDS: usize = 3;

/// The discounts per step a fit tries for the carry-over of prefills (0: none).
const AFTER_PREFILL_DECAYS: [f64; 8] = [0.0, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9];
