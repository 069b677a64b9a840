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
//! ratio    = a draw from the empirical distribution of captured duration / law, in the
//!            nearest state the capture saw (decode steps: the batch-size bin and the
//!            step's mean burst; steps with prefill: the prefill-size class)
//! ```
//!
//! `D` decodes, `T` tokens they deliver, `ΣC` their summed contexts, `P` prefilled tokens,
//! `Q = Σ (d1² − d0²)/2` over the chunks (a chunk from depth `d0` to `d1` attends over the
//! context below it). The law is fitted by weighted least squares over every captured step
//! (relative errors, as the noise is multiplicative), and a term is kept only when the
//! captures identify it: a term they never vary, or vary only together with other terms, is
//! dropped; so is a term whose coefficient is negative or less than 3 standard errors from
//! zero (standard errors widened for the residuals' autocorrelation). Why each term was kept
//! or dropped is written into the model file. `docs/latency-model.md` has the numbers
//! measured on the real CPU-engine fixture and the fallbacks for unseen states.
//!
//! # Reading captures
//!
//! `capture` turns a trace (and its step-stats sidecar) into engine steps; `observe` turns
//! steps into observations (durations corrected for idle time, chunked prefills summed over
//! the steps that computed them); `regress` selects and fits the law; `residual` keeps the
//! ratio distributions; `estimate` builds the model from them; `model` is the file;
//! `draw` paces an engine.

mod capture;
mod draw;
mod estimate;
mod model;
mod observe;
mod regress;
mod residual;

use std::path::PathBuf;

use crate::trace::TraceError;

pub use draw::FittedLatency;
pub use model::{
    Bursts, DecodeBin, FORMAT, FittedModel, InputKind, ModelMeta, ModelSource, PrefillClass,
    RatioCell, StepLaw, VERSION, sniff,
};
pub use regress::TermFit;

/// A capture to fit: a trace (`record --trace-out`) and, optionally, its step-stats sidecar
/// (`record --step-stats-out`). `.gz` files are read transparently.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FitInput {
    /// The request trace.
    pub trace: PathBuf,
    /// The step-stats sidecar written by the same capture, if any.
    pub steps: Option<PathBuf>,
}

/// Why a fit, or reading or writing a model file, failed.
#[derive(Debug, thiserror::Error)]
pub enum FitError {
    /// A trace or sidecar could not be read.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// A model file could not be read or written.
    #[error("{}: {cause}", path.display())]
    Io {
        /// The model file.
        path: PathBuf,
        /// What the OS said.
        cause: std::io::Error,
    },
    /// The file is not JSON of a model's shape.
    #[error("{}: not a vllm-vcr latency model file: {cause}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// What serde said.
        cause: serde_json::Error,
    },
    /// The file is of another format or version.
    #[error(
        "{}: {found} is not a latency model this build reads (it reads format {FORMAT:?} version {VERSION}; refit with `vllm-vcr inspect fit TRACE --steps SIDECAR -o MODEL`)",
        path.display()
    )]
    Version {
        /// The file.
        path: PathBuf,
        /// What the file claims to be.
        found: String,
    },
    /// The file has the right format but impossible contents.
    #[error("{}: invalid latency model: {why}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// A sidecar that does not belong to its trace: their steps do not line up.
    #[error(
        "{}: only {matched} of the {total} token times of {} fall on one of its steps: it is not that trace's step-stats sidecar (--steps pairs with the traces in order)",
        steps.display(),
        trace.display()
    )]
    Mismatch {
        /// The trace.
        trace: PathBuf,
        /// The sidecar given with it.
        steps: PathBuf,
        /// Token times of the trace that fell on a sidecar step.
        matched: u64,
        /// Token times of the trace.
        total: u64,
    },
    /// The captures hold no step with a usable duration.
    #[error(
        "nothing to fit: the captures hold no engine step with a duration (a trace from `vllm-vcr record`, ideally with its --step-stats-out sidecar)"
    )]
    NoSteps,
    /// The model could not be encoded (never happens with finite numbers).
    #[error("encoding the model: {0}")]
    Encode(serde_json::Error),
}

/// Fit a model to captures: read every trace (and sidecar), reconstruct the engine steps,
/// fit the law and keep the ratio distributions. Memory grows with the captured steps
/// (under 100 bytes each), not with the number of tokens.
pub fn fit(inputs: &[FitInput]) -> Result<FittedModel, FitError> {
    let mut sources = Vec::with_capacity(inputs.len());
    let mut obs = Vec::new();
    let mut bursts = Vec::new();
    for input in inputs {
        let cap = capture::read(input)?;
        let before = obs.len();
        observe::observations(&cap, &mut obs);
        for (n, &c) in cap.bursts.iter().enumerate() {
            if bursts.len() <= n {
                bursts.resize(n + 1, 0);
            }
            bursts[n] += c;
        }
        let mut source = cap.source;
        source.observations = (obs.len() - before) as u64;
        sources.push(source);
    }
    if obs.is_empty() {
        return Err(FitError::NoSteps);
    }
    let model = estimate::build(sources, &obs, bursts);
    // what a model file may not hold, a fit may not produce either (inputs are bounded,
    // so this only catches a fit that went numerically wrong)
    model.check().map_err(|why| FitError::Invalid {
        path: inputs.first().map(|i| i.trace.clone()).unwrap_or_default(),
        why: format!("the fit of these captures gives an unusable model: {why}"),
    })?;
    Ok(model)
}
