//! The model file: what a fit keeps, how it is saved, loaded and recognised.
//!
//! A small pretty-printed JSON object (a few KB): `format` and `version` first (so a file
//! is recognised by its head), `meta` (where the model came from), `law` (the coefficients
//! and why each term was kept or dropped), `levels` (the quantile levels of every ratio
//! list), `decode` bins, `prefill` classes and, for multi-token captures, `bursts`.
//! Loading checks the format and version before anything else, then the contents.

use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::error::FitError;
use super::features::NF;
use super::format::{FORMAT, VERSION};
use super::regress::{self, TermFit};
use crate::latency::{MAX_DURATION_MS, is_sane_ms, show_number};

/// The largest model file read: fitted models are a few KB.
const MAX_MODEL_BYTES: usize = 16 << 20;

/// The largest ratio a model file may hold: a step a billion times slower than its law
/// says is a damaged or hostile file, not a capture.
pub const MAX_RATIO: f64 = 1e9;

/// A capture a model was fitted to.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ModelSource {
    /// The trace's path, as given.
    pub trace: String,
    /// The sidecar's path, as given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<String>,
    /// `config_hash` of the trace's meta line (`play --expect-config-hash` checks it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_hash: Option<String>,
    /// KV block size of the captured engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// `max_num_seqs` of the captured engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_num_seqs: Option<u32>,
    /// The captured engine's vLLM version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vllm_version: Option<String>,
    /// Request records read.
    pub records: u64,
    /// Sidecar lines read (0 without a sidecar).
    #[serde(default)]
    pub sidecar_steps: u64,
    /// Observations the fit took from this capture (a step, or the steps of a chunked
    /// prefill).
    pub observations: u64,
    /// How fast this capture's host ran against the law (its median captured / law
    /// ratio; the fit set's speeds average 1): the law describes the fit set's average
    /// host, each capture keeps its own drift here. Absent for a fit of one capture.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speed: Option<f64>,
    /// The shortest and the longest prompt among the capture's records, tokens: the
    /// prompts whose prefill the model has seen (`simulate` and `calibrate` say when a
    /// trace's prompts run past them). Absent in models fitted before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<[u32; 2]>,
}

/// Where a model came from.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ModelMeta {
    /// `vllm-vcr`.
    pub tool: String,
    /// The version of the build that fitted it.
    pub tool_version: String,
    /// The captures, in the order given.
    pub sources: Vec<ModelSource>,
}

/// The law: what a step costs before its ratio is drawn, in ms.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct StepLaw {
    /// Fixed cost of any step.
    pub step_ms: f64,
    /// Per decode in the step.
    pub per_decode_ms: f64,
    /// Per prefilled (uncached) token.
    pub per_prefill_token_ms: f64,
    /// Fixed cost of a step with prefill work.
    pub prefill_step_ms: f64,
    /// Per token of context the decodes attend over (summed over decodes).
    pub per_context_token_ms: f64,
    /// Per token a decode delivers beyond its first (speculative or block decoding).
    pub per_burst_token_ms: f64,
    /// Per prefilled token per token of depth below it: a chunk from depth `d0` to `d1`
    /// costs this × `(d1² − d0²)/2`.
    pub per_prefill_depth_ms: f64,
    /// Per earlier step with prefill work, discounted by `after_prefill_decay` per step
    /// since (a prefill slows the steps after it).
    #[serde(default)]
    pub after_prefill_ms: f64,
    /// Per token those steps prefilled, discounted the same way.
    #[serde(default)]
    pub per_after_prefill_token_ms: f64,
    /// The discount per step of the two terms above (0: no carry-over), chosen by the fit.
    #[serde(default)]
    pub after_prefill_decay: f64,
    /// Per step of a size (tokens scheduled) the engine has not run since it started: the
    /// CPU engine prepares kernels per shape.
    #[serde(default)]
    pub new_shape_ms: f64,
    /// Per step the engine starts from idle (nothing running or waiting before it).
    #[serde(default)]
    pub after_idle_ms: f64,
    /// Per request whose prefill completes in the step (its first token sampled).
    #[serde(default)]
    pub per_first_token_ms: f64,
    /// No step is predicted faster than the fastest captured one.
    pub floor_ms: f64,
    /// Lag-1 autocorrelation of the fit's relative residuals in capture order (the
    /// standard errors behind each term's `t` are widened by `√((1 + ρ)/(1 − ρ))`).
    pub residual_autocorrelation: f64,
    /// Every term, kept or not, and why.
    pub terms: Vec<TermFit>,
    /// How the law was completed where the captures say nothing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

impl StepLaw {
    /// The coefficients in the features' order.
    pub(crate) fn coef(&self) -> [f64; NF] {
        [
            self.step_ms,
            self.per_decode_ms,
            self.per_prefill_token_ms,
            self.prefill_step_ms,
            self.per_context_token_ms,
            self.per_burst_token_ms,
            self.per_prefill_depth_ms,
            self.after_prefill_ms,
            self.per_after_prefill_token_ms,
            self.new_shape_ms,
            self.after_idle_ms,
            self.per_first_token_ms,
        ]
    }

    /// The law's value for features `x`, floored.
    pub(crate) fn ms(&self, x: &[f64; NF]) -> f64 {
        regress::predict(&self.coef(), x).max(self.floor_ms)
    }
}

/// The ratio distribution of one state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RatioCell {
    /// Mean tokens per decode of the state's steps (1 for autoregressive captures).
    pub burst: u32,
    /// Captured steps in the state.
    pub steps: u64,
    /// Quantiles of captured duration / law at the model's `levels`.
    pub ratio: Vec<f64>,
}

/// Decode-only steps of a batch-size bin.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecodeBin {
    /// Decodes in the step: first and last size of the bin.
    pub decodes: [u32; 2],
    /// Captured steps in the bin.
    pub steps: u64,
    /// Their median duration (for reading; draws use the law and the ratios).
    pub median_ms: f64,
    /// One ratio distribution per burst state, by `burst`.
    pub cells: Vec<RatioCell>,
}

/// Steps with prefill work of a prefill-size class.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrefillClass {
    /// Tokens prefilled per step: first and last of the class.
    pub tokens: [u32; 2],
    /// Captured observations in the class.
    pub steps: u64,
    /// Their median duration (for reading).
    pub median_ms: f64,
    /// Quantiles of captured duration / law at the model's `levels`.
    pub ratio: Vec<f64>,
}

/// Multi-token decode chunks (speculative decoding, block decoding).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Bursts {
    /// K: the largest captured burst − 1.
    pub num_spec_tokens: u32,
    /// `counts[n − 1]`: decode chunks of `n` tokens.
    pub counts: Vec<u64>,
}

/// A fitted model, as `inspect fit` saves it and `play --latency-trace` loads it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FittedModel {
    /// [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u32,
    /// Where it came from.
    pub meta: ModelMeta,
    /// The law.
    pub law: StepLaw,
    /// Quantile levels of every `ratio` list.
    pub levels: Vec<f64>,
    /// Decode bins, by batch size.
    pub decode: Vec<DecodeBin>,
    /// Prefill classes, by size.
    pub prefill: Vec<PrefillClass>,
    /// Multi-token chunks; absent for autoregressive captures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bursts: Option<Bursts>,
}

impl FittedModel {
    /// K of the captured bursts (largest − 1); `None` for autoregressive captures.
    pub fn num_spec_tokens(&self) -> Option<u32> {
        self.bursts.as_ref().map(|b| b.num_spec_tokens)
    }

    /// The model file's text: pretty JSON with lists of numbers and small flat objects on
    /// one line each, so the file reads top to bottom in a screen or two.
    pub fn to_text(&self) -> Result<String, FitError> {
        let pretty = serde_json::to_string_pretty(self).map_err(FitError::Encode)?;
        Ok(compact(&pretty) + "\n")
    }

    /// Write the model file ([`FittedModel::to_text`]); `-` is standard output.
    pub fn save(&self, path: &Path) -> Result<(), FitError> {
        let text = self.to_text()?;
        let io = |cause| FitError::Io {
            path: path.to_path_buf(),
            cause,
        };
        if path.as_os_str() == "-" {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            return out
                .write_all(text.as_bytes())
                .and_then(|()| out.flush())
                .map_err(io);
        }
        std::fs::write(path, text).map_err(io)
    }

    /// Read a model file: its format and version first, then its contents.
    pub fn load(path: &Path) -> Result<Self, FitError> {
        let io = |cause| FitError::Io {
            path: path.to_path_buf(),
            cause,
        };
        // a model file is a few KB: a huge one is not a model, and is not read whole
        let raw = crate::trace::read_capped(path, MAX_MODEL_BYTES).map_err(io)?;
        let text = String::from_utf8(raw)
            .map_err(|e| io(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|cause| FitError::Parse {
                path: path.to_path_buf(),
                cause,
            })?;
        let format = v.get("format").and_then(|f| f.as_str());
        let version = v.get("version").and_then(|f| f.as_u64());
        if format != Some(FORMAT) || version != Some(u64::from(VERSION)) {
            let found = match (format, version) {
                (None, _) => "a JSON file without a \"format\" field".to_string(),
                (Some(f), None) => format!("format {f:?} without a version"),
                (Some(f), Some(n)) if f == FORMAT && n < u64::from(VERSION) => {
                    format!("format {f:?} version {n} (written by an older vllm-vcr)")
                }
                (Some(f), Some(n)) => format!("format {f:?} version {n}"),
            };
            return Err(FitError::Version {
                path: path.to_path_buf(),
                found,
            });
        }
        let m: FittedModel = serde_json::from_value(v).map_err(|cause| FitError::Parse {
            path: path.to_path_buf(),
            cause,
        })?;
        m.check().map_err(|why| FitError::Invalid {
            path: path.to_path_buf(),
            why,
        })?;
        Ok(m)
    }

    /// What a hand-edited or damaged file could get wrong.
    pub(crate) fn check(&self) -> Result<(), String> {
        let l = &self.levels;
        if l.len() < 2 || l[0] != 0.0 || l[l.len() - 1] != 1.0 || l.windows(2).any(|w| w[0] >= w[1])
        {
            return Err("levels must rise strictly from 0 to 1".into());
        }
        let ratio = |what: &str, r: &[f64]| -> Result<(), String> {
            if r.len() != l.len() {
                return Err(format!("{what}: {} ratios for {} levels", r.len(), l.len()));
            }
            if let Some(x) = r
                .iter()
                .find(|x| !(x.is_finite() && (0.0..=MAX_RATIO).contains(*x)))
            {
                return Err(format!(
                    "{what}: ratio {} is out of range (a ratio is a step's duration over the law's: 0 … {MAX_RATIO})",
                    show_number(*x)
                ));
            }
            if r.windows(2).any(|w| w[0] > w[1]) {
                return Err(format!("{what}: ratios must rise with the levels"));
            }
            Ok(())
        };
        for b in &self.decode {
            let what = format!("decode bin {}–{}", b.decodes[0], b.decodes[1]);
            if b.decodes[0] > b.decodes[1] || b.cells.is_empty() {
                return Err(format!("{what}: empty"));
            }
            for c in &b.cells {
                ratio(&what, &c.ratio)?;
            }
        }
        for p in &self.prefill {
            let what = format!("prefill class {}–{}", p.tokens[0], p.tokens[1]);
            if p.tokens[0] > p.tokens[1] {
                return Err(format!("{what}: empty"));
            }
            ratio(&what, &p.ratio)?;
        }
        let l = &self.law;
        let coefficients = [
            ("law.step_ms", l.step_ms),
            ("law.per_decode_ms", l.per_decode_ms),
            ("law.per_prefill_token_ms", l.per_prefill_token_ms),
            ("law.prefill_step_ms", l.prefill_step_ms),
            ("law.per_context_token_ms", l.per_context_token_ms),
            ("law.per_burst_token_ms", l.per_burst_token_ms),
            ("law.per_prefill_depth_ms", l.per_prefill_depth_ms),
            ("law.after_prefill_ms", l.after_prefill_ms),
            (
                "law.per_after_prefill_token_ms",
                l.per_after_prefill_token_ms,
            ),
            ("law.new_shape_ms", l.new_shape_ms),
            ("law.after_idle_ms", l.after_idle_ms),
            ("law.per_first_token_ms", l.per_first_token_ms),
        ];
        for (name, c) in coefficients {
            if !is_sane_ms(c) {
                return Err(format!(
                    "{name} is {}: a coefficient must be finite and at most {MAX_DURATION_MS} ms (a day) in size",
                    show_number(c)
                ));
            }
        }
        if !(0.0..=0.99).contains(&l.after_prefill_decay) {
            return Err(format!(
                "law.after_prefill_decay is {}: a discount per step must be between 0 and 0.99",
                show_number(l.after_prefill_decay)
            ));
        }
        if !(l.floor_ms.is_finite() && (0.0..=MAX_DURATION_MS).contains(&l.floor_ms)) {
            return Err(format!(
                "law.floor_ms is {}: the floor must be between 0 and {MAX_DURATION_MS} ms (a day)",
                show_number(l.floor_ms)
            ));
        }
        if let Some(b) = &self.bursts
            && (b.counts.len() < 2 || b.num_spec_tokens as usize != b.counts.len() - 1)
        {
            return Err("bursts: num_spec_tokens must be the number of counts − 1".into());
        }
        Ok(())
    }

    /// Whether `path` holds a model file rather than a trace (see [`sniff`]); false when
    /// it cannot be read.
    pub fn is_model_file(path: &Path) -> bool {
        matches!(sniff(path), Ok(InputKind::Model))
    }
}

/// Put every container of `pretty` (serde_json's pretty output) that holds no other
/// container on one line: always for lists, for objects when the line stays short.
fn compact(pretty: &str) -> String {
    // (index in `out` of the opening line, holds a container, is a list)
    let mut stack: Vec<(usize, bool, bool)> = Vec::new();
    let mut out: Vec<String> = Vec::new();
    for line in pretty.lines() {
        let t = line.trim();
        if t.ends_with('[') || t.ends_with('{') {
            if let Some(parent) = stack.last_mut() {
                parent.1 = true;
            }
            stack.push((out.len(), false, t.ends_with('[')));
            out.push(line.to_string());
        } else if matches!(t.trim_end_matches(','), "]" | "}") && !stack.is_empty() {
            let (start, nested, list) = stack.pop().expect("checked");
            let items: Vec<&str> = out[start + 1..].iter().map(|l| l.trim()).collect();
            let joined = format!("{}{}{t}", out[start], items.join(" "));
            if !nested && (list || joined.len() <= 100) {
                out.truncate(start);
                out.push(joined);
            } else {
                out.push(line.to_string());
            }
        } else {
            out.push(line.to_string());
        }
    }
    out.join("\n")
}

/// What a `--latency-trace` path holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputKind {
    /// A model file (`inspect fit -o`).
    Model,
    /// A trace to fit.
    Trace,
    /// A step-stats sidecar (`record --step-stats-out`): it goes with a trace, not in its
    /// place.
    Sidecar,
}

/// Tell a model file, a trace and a step-stats sidecar apart by their heads, so `--latency-trace PATH…` takes either.
/// A trace's first line is a whole JSON object (its meta line or a record; `.gz` is
/// opened); a model file is one JSON object with a `format` field, pretty-printed (its
/// first line is `{`) or on one line.
pub fn sniff(path: &Path) -> Result<InputKind, FitError> {
    let io = |cause| FitError::Io {
        path: path.to_path_buf(),
        cause,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let mut raw = Vec::new();
    (&mut file)
        .take(64 * 1024)
        .read_to_end(&mut raw)
        .map_err(io)?;
    let head = if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        // a gzip head may end mid-stream: what was inflated is enough
        let _ = flate2::read::GzDecoder::new(&raw[..])
            .take(64 * 1024)
            .read_to_end(&mut out);
        out
    } else {
        raw
    };
    let text = String::from_utf8_lossy(&head);
    let first = text.trim_start().lines().next().unwrap_or("");
    if let Ok(serde_json::Value::Object(o)) = serde_json::from_str::<serde_json::Value>(first) {
        return Ok(if o.contains_key("format") {
            InputKind::Model
        } else if o.contains_key("step_counter") && o.contains_key("num_running_reqs") {
            InputKind::Sidecar
        } else {
            InputKind::Trace
        });
    }
    Ok(if first.trim() == "{" && text.contains("\"format\"") {
        InputKind::Model
    } else {
        InputKind::Trace
    })
}
