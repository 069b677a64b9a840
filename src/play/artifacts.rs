//! The files `play`'s flags name, each read once: the model's vocabulary (`--tokenizer`),
//! the latency model (`--latency-trace`: a model file from `inspect fit`, or captures fitted
//! now) and the replay indexes (`--replay-tokens`, `--replay-steps`). Each checks
//! `--expect-config-hash` against the headers it reads itself. Nothing here derives a
//! setting: `config.rs` turns the flags and these into a [`PlayConfig`](super::config::PlayConfig).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use sim_trace::fit::{FitInput, FittedModel};

use super::args::PlayArgs;
use super::engine_args::EngineArgs;
use crate::io_guard::{Named, check_outputs, named};
use crate::play::content::replay::ReplaySetup;
use crate::play::content::vocab::{self, Vocabulary};

/// What the flags' files hold, loaded and checked.
#[derive(Debug, Clone)]
pub struct Artifacts {
    /// The model's vocabulary (`--tokenizer`, else the embedded tiny model's).
    pub vocab: Arc<Vocabulary>,
    /// The latency model fitted to a capture (`--latency-trace`); the knobs otherwise.
    pub model: Option<FittedModel>,
    /// Recorded content and timing to serve (`--replay-tokens`, `--replay-steps`).
    pub replay: Option<ReplaySetup>,
}

/// The files the engine flags read (`--latency-trace`, `--latency-steps`,
/// `--replay-tokens`, `--replay-steps`, `--tokenizer`), for the output guard of every
/// command that takes them.
pub fn engine_inputs(e: &EngineArgs) -> Vec<Named<'_>> {
    let mut inputs = Vec::new();
    inputs.extend(e.latency_trace.iter().map(|p| named("--latency-trace", p)));
    inputs.extend(e.latency_steps.iter().map(|p| named("--latency-steps", p)));
    inputs.extend(e.replay_tokens.iter().map(|p| named("--replay-tokens", p)));
    inputs.extend(e.replay_steps.iter().map(|p| named("--replay-steps", p)));
    inputs.extend(e.tokenizer.iter().map(|p| named("--tokenizer", p)));
    inputs
}

impl Artifacts {
    /// What a configuration that names no file has: the embedded model's vocabulary.
    pub fn embedded() -> Self {
        Self {
            vocab: Vocabulary::embedded(),
            model: None,
            replay: None,
        }
    }

    /// Read every file `a` names, once, checking each against `--expect-config-hash`.
    pub fn load(a: &PlayArgs) -> Result<Self> {
        if let Some(summary) = &a.replay_summary {
            check_outputs(&engine_inputs(a), &[named("--replay-summary", summary)])?;
        }
        let expected = a.expect_config_hash.as_deref().map(normal_hash);
        let latency = read_latency_model(&a.latency_trace, &a.latency_steps)?;
        if let (Some(expected), Some((m, _))) = (&expected, &latency) {
            check_model_hash(m, expected)?;
        }
        let fitted_here = latency
            .as_ref()
            .is_some_and(|(_, from)| *from == Fitted::Now);
        let replayed = a.replay_tokens.is_some() || a.replay_steps.is_some();
        if expected.is_some() && !fitted_here && !replayed {
            bail!(
                "--expect-config-hash checks the traces given to --latency-trace, --replay-tokens or --replay-steps, and none was given"
            );
        }
        let model = latency.map(|(m, _)| m);
        let vocab = match &a.tokenizer {
            Some(p) => Arc::new(Vocabulary::load(&vocab::model_dir_of(p))?),
            None => Vocabulary::embedded(),
        };
        let replay = ReplaySetup::load(
            a.replay_tokens.as_deref(),
            a.replay_steps.as_deref(),
            a.replay_match,
            a.replay_miss,
            &vocab,
            a.replay_allow_mismatch,
            expected.as_deref(),
        )?;
        if let (None, Some(m), Some(r)) = (&expected, &model, &replay) {
            warn_other_config(m, r);
        }
        Ok(Self {
            vocab,
            model,
            replay,
        })
    }
}

/// `--expect-config-hash` as hashes are compared: trimmed, lower case.
fn normal_hash(h: &str) -> String {
    h.trim().to_ascii_lowercase()
}

/// Every capture the latency model was fitted to must carry the expected config hash.
fn check_model_hash(m: &FittedModel, expected: &str) -> Result<()> {
    for src in &m.meta.sources {
        match &src.config_hash {
            Some(h) if h.to_ascii_lowercase() == expected => {}
            other => bail!(
                "the latency model was fitted to {} (config_hash {}), not to a capture with the expected {expected}",
                src.trace,
                other.as_deref().unwrap_or("none")
            ),
        }
    }
    Ok(())
}

/// A latency model fitted under another configuration (host, rig, engine flags: the
/// `config_hash`) than the capture being replayed paces that capture's requests with
/// another engine's step times: say so loudly (`--expect-config-hash` makes it an error).
fn warn_other_config(model: &FittedModel, replay: &ReplaySetup) {
    let replayed = replay.config_hashes();
    let fit: Vec<String> = model
        .meta
        .sources
        .iter()
        .filter_map(|s| s.config_hash.as_ref().map(|h| h.to_ascii_lowercase()))
        .collect();
    if replayed.is_empty() || fit.is_empty() || fit.iter().any(|h| replayed.contains(h)) {
        return;
    }
    tracing::warn!(
        "the latency model was fitted on another configuration (config_hash {}) than the replayed capture ({}): its step times are another engine's; pass --expect-config-hash to refuse such a pairing",
        fit.join(", "),
        replayed.join(", ")
    );
}

/// Where a latency model came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fitted {
    /// A model file `inspect fit` wrote.
    Before,
    /// Captures fitted at load.
    Now,
}

/// `--latency-trace` / `--latency-steps`: a saved model file, or traces (with their
/// sidecars, in order) to fit now.
pub(crate) fn load_latency_model(
    traces: &[PathBuf],
    steps: &[PathBuf],
) -> Result<Option<FittedModel>> {
    Ok(read_latency_model(traces, steps)?.map(|(m, _)| m))
}

fn read_latency_model(
    traces: &[PathBuf],
    steps: &[PathBuf],
) -> Result<Option<(FittedModel, Fitted)>> {
    if traces.is_empty() {
        return Ok(None);
    }
    let models = traces
        .iter()
        .filter(|p| FittedModel::is_model_file(p))
        .count();
    if models > 0 {
        if traces.len() > 1 || !steps.is_empty() {
            bail!(
                "--latency-trace takes one model file (from `inspect fit`) or traces to fit, not both; fit several captures into one model with `vllm-vcr inspect fit A B -o model.json`"
            );
        }
        let m = FittedModel::load(&traces[0]).context("--latency-trace")?;
        return Ok(Some((m, Fitted::Before)));
    }
    if steps.len() > traces.len() {
        bail!(
            "--latency-steps gives {} sidecars for {} traces: they pair with the --latency-trace traces in order",
            steps.len(),
            traces.len()
        );
    }
    let inputs: Vec<FitInput> = traces
        .iter()
        .enumerate()
        .map(|(i, t)| FitInput {
            trace: t.clone(),
            steps: steps.get(i).cloned(),
        })
        .collect();
    let t = std::time::Instant::now();
    let m = sim_trace::fit::fit(&inputs).context("--latency-trace: fitting the capture")?;
    tracing::info!(
        secs = format!("{:.2}", t.elapsed().as_secs_f64()),
        "--latency-trace: fitted {} capture(s)",
        inputs.len()
    );
    Ok(Some((m, Fitted::Now)))
}
