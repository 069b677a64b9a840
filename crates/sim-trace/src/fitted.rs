//! A step latency model fitted to captures (`play --latency-trace`, `inspect fit`).
//!
//! # What it conditions on, and why
//!
//! The engine composes every step itself (decodes first, prefill chunks in the budget left,
//! queueing from its own scheduler), so the model only has to say how long a step of a given
//! shape takes — never how long a request waits. A step costs
//!
//! ```text
//! duration = decode(b) + prefill(chunks)        (÷ --time-scale)
//! decode(b)          a draw from the captured decode-only steps with b decodes
//! prefill(chunks)    overhead + Σ c0·t + c1·(d1² − d0²)/2 over the chunks (t tokens from depth d0)
//! ```
//!
//! * **Batch size `b`** is what a captured step's duration depends on most: on the real CPU
//!   engine fixture a decode-only step takes 10.4 ms at 4 requests and 12.9 ms at 8 (p50),
//!   and a step that also prefills 7 prompts of 128 tokens 340 ms. The step-stats sidecar
//!   gives every step's duration and running count (`step_ms`, `num_running_reqs`,
//!   `prefill_requests`); without it the per-gap context of the records (`itl_ctx`) gives
//!   the same for the steps that emitted a token.
//! * **Decode draws keep the tail**: each batch size keeps its empirical quantiles (21 of
//!   them, interpolated), not a mean and a clamped spread. A batch size the capture never
//!   saw borrows the nearest one's shape, scaled by a line fitted through the medians
//!   (`a + k·b`); beyond the largest batch seen, that line extrapolates.
//! * **Prefill** is linear in the step's uncached prompt tokens, with a fixed overhead,
//!   fitted by least squares to what prefill steps cost beyond their decodes' median. The
//!   depth term `c1` is part of the law but only fitted when the capture varies the depth
//!   of prefills; the sidecar reports a step's prefilled tokens, not their depths, so it
//!   stays 0 on captures of this rig (documented as a limitation in `docs/latency-model.md`).
//! * **Multi-token chunks** (speculative decoding, block decoding): when the records carry
//!   `itl_tokens`, every batch size keeps its captured `(gap, tokens)` pairs; a step draws one
//!   pair per decode, the first decode's gap is the step's decode time and each decode
//!   delivers its pair's tokens — a 4-token step is one 4-token message after one gap.
//!   `K = largest burst − 1`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::latency::{LatencyModel, StepShape, StepTiming};
use crate::steps::StepStatsReader;
use crate::trace::{TraceError, TraceItem, TraceReader};

/// The `format` field of a model file.
pub const FORMAT: &str = "vllm-vcr-latency-model";
/// The model file version this build writes and reads.
pub const VERSION: u32 = 1;
/// Quantiles kept per batch size (0 %, 5 %, …, 100 %).
const QUANTILES: usize = 21;
/// Steps a batch size needs before its own quantiles are used.
const MIN_BIN: u64 = 8;
/// Joint (gap, tokens) pairs kept per batch size for multi-token captures.
const MAX_PAIRS: usize = 4096;

/// Why a fit or a model file failed.
#[derive(Debug, thiserror::Error)]
pub enum FitError {
    #[error(transparent)]
    Trace(#[from] TraceError),
    #[error("{}: {cause}", path.display())]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("{}: not a latency model file: {cause}", path.display())]
    Parse {
        path: PathBuf,
        cause: serde_json::Error,
    },
    #[error(
        "{}: format {format:?} version {version} is not a vllm-vcr latency model this build reads (format {FORMAT:?}, version {VERSION})",
        path.display()
    )]
    Version {
        path: PathBuf,
        format: String,
        version: u32,
    },
    #[error(
        "nothing to fit: the captures hold no decode step with a duration (a trace from `vllm-vcr record`, ideally with its --step-stats-out sidecar)"
    )]
    NoSteps,
}

/// A capture to fit: a trace and, optionally, its step-stats sidecar.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FitInput {
    pub trace: PathBuf,
    pub steps: Option<PathBuf>,
}

/// Where a model came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSource {
    pub trace: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_hash: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    pub records: u64,
    /// Steps with a duration the fit used.
    pub steps_used: u64,
}

/// Decode-only steps of one batch size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecodeBin {
    /// Decodes in the step.
    pub batch: u32,
    /// Steps observed.
    pub n: u64,
    /// Step duration quantiles in ms: 0 %, 5 %, …, 100 %.
    pub quantiles_ms: Vec<f64>,
    /// Captured `(gap ms, tokens)` pairs (multi-token captures only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bursts: Vec<(f64, u32)>,
}

/// The prefill law: `overhead + c0·t + c1·(d1² − d0²)/2` ms per step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PrefillLaw {
    pub overhead_ms: f64,
    pub per_token_ms: f64,
    pub per_token_depth_ms: f64,
    /// Prefill steps the law was fitted to.
    pub n: u64,
}

/// A fitted model, as saved by `inspect fit`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FittedModel {
    pub format: String,
    pub version: u32,
    pub sources: Vec<ModelSource>,
    /// The decode median's trend over batch size: `a + k·b` ms.
    pub decode_trend_ms: (f64, f64),
    pub decode: Vec<DecodeBin>,
    pub prefill: PrefillLaw,
    /// K of the captured bursts (largest − 1); `None` for autoregressive captures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_spec_tokens: Option<u32>,
}

/// One observed step: decodes, uncached prefill tokens, duration.
struct Obs {
    decodes: u32,
    prefill_tokens: u64,
    ms: f64,
}

/// What the fit collects while it streams the captures: decode-only step durations per
/// batch size (`f32`: 0.1 µs at one second, half the memory), the prefill steps (few), and
/// per batch size a bounded uniform sample of the captured (gap, tokens) pairs.
#[derive(Default)]
struct Collected {
    decode: BTreeMap<u32, Vec<f32>>,
    prefill: Vec<Obs>,
    pairs: BTreeMap<u32, (u64, Vec<(f64, u32)>)>,
    rng: u64,
}

impl Collected {
    fn step(&mut self, o: Obs) {
        if o.prefill_tokens > 0 {
            self.prefill.push(o);
        } else if o.decodes > 0 {
            self.decode.entry(o.decodes).or_default().push(o.ms as f32);
        }
    }

    /// Reservoir sampling: every pair seen has the same chance to be kept.
    fn pair(&mut self, b: u32, gap: f64, tokens: u32) {
        let (seen, kept) = self.pairs.entry(b).or_default();
        *seen += 1;
        if kept.len() < MAX_PAIRS {
            kept.push((gap, tokens));
            return;
        }
        self.rng = self
            .rng
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let j = (self.rng >> 33) % *seen;
        if (j as usize) < MAX_PAIRS {
            kept[j as usize] = (gap, tokens);
        }
    }
}

/// Milliseconds kept to 0.1 µs: the file stays readable and nothing measurable is lost.
fn round_ms(v: f64) -> f64 {
    (v * 1e4).round() / 1e4
}

fn quantiles(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    (0..QUANTILES)
        .map(|i| {
            let pos = i as f64 / (QUANTILES - 1) as f64 * (v.len() - 1) as f64;
            let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
            round_ms(v[lo] + (v[hi] - v[lo]) * (pos - lo as f64))
        })
        .collect()
}

/// Least squares `y = a + k·x` with weights; `(mean, 0)` when x does not vary.
fn line(points: &[(f64, f64, f64)]) -> (f64, f64) {
    let w: f64 = points.iter().map(|p| p.2).sum();
    if w <= 0.0 {
        return (0.0, 0.0);
    }
    let mx = points.iter().map(|p| p.0 * p.2).sum::<f64>() / w;
    let my = points.iter().map(|p| p.1 * p.2).sum::<f64>() / w;
    let sxx: f64 = points.iter().map(|p| p.2 * (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| p.2 * (p.0 - mx) * (p.1 - my)).sum();
    if sxx <= f64::EPSILON {
        return (my, 0.0);
    }
    let k = sxy / sxx;
    (my - k * mx, k)
}

/// Fit a model to captures.
pub fn fit(inputs: &[FitInput]) -> Result<FittedModel, FitError> {
    let mut c = Collected::default();
    let mut sources = Vec::new();
    let mut max_burst = 1u32;
    for input in inputs {
        let reader = TraceReader::open(&input.trace)?;
        let mut src = ModelSource {
            trace: input.trace.display().to_string(),
            steps: input.steps.as_ref().map(|p| p.display().to_string()),
            config_hash: None,
            block_size: None,
            records: 0,
            steps_used: 0,
        };
        let from_records = input.steps.is_none();
        for item in reader {
            match item? {
                TraceItem::Meta(m) => {
                    src.config_hash = src.config_hash.or(m.config_hash);
                    src.block_size = src.block_size.or(m.block_size);
                }
                TraceItem::Record(r) => {
                    src.records += 1;
                    for (i, &gap) in r.itl_ms.iter().enumerate() {
                        let running = r.itl_ctx.num_running.get(i).copied();
                        let prefill = r.itl_ctx.prefill_tokens.get(i).copied().unwrap_or(0);
                        let b = running.or(r.concurrency).unwrap_or(1).max(1);
                        let n = r.itl_tokens.get(i).copied().unwrap_or(1);
                        max_burst = max_burst.max(n);
                        if prefill == 0 {
                            c.pair(b, gap, n);
                        }
                        if from_records {
                            // a gap with a prefill in its step: b − 1 decodes besides it
                            let decodes = if prefill > 0 { b.saturating_sub(1) } else { b };
                            c.step(Obs {
                                decodes,
                                prefill_tokens: u64::from(prefill),
                                ms: gap,
                            });
                            src.steps_used += 1;
                        }
                    }
                }
            }
        }
        if let Some(steps) = &input.steps {
            for s in StepStatsReader::open(steps)? {
                let s = s?;
                let Some(ms) = s.step_ms.filter(|m| m.is_finite() && *m > 0.0) else {
                    continue;
                };
                // the requests that produced tokens in the step, less the first tokens of
                // finished prefills (the running count after the step misses the requests
                // that finished in it)
                let produced = if s.outputs > 0 {
                    s.outputs
                } else {
                    s.num_running_reqs
                };
                let decodes = produced.saturating_sub(u64::from(s.prefill_requests)) as u32;
                c.step(Obs {
                    decodes,
                    prefill_tokens: s.prefill_tokens,
                    ms,
                });
                src.steps_used += 1;
            }
        }
        sources.push(src);
    }
    if c.decode.is_empty() {
        return Err(FitError::NoSteps);
    }
    let spec = max_burst > 1;
    let mut pairs = std::mem::take(&mut c.pairs);
    let decode: Vec<DecodeBin> = std::mem::take(&mut c.decode)
        .into_iter()
        .map(|(batch, v)| DecodeBin {
            batch,
            n: v.len() as u64,
            quantiles_ms: quantiles(v.into_iter().map(f64::from).collect()),
            bursts: if spec {
                pairs.remove(&batch).map(|p| p.1).unwrap_or_default()
            } else {
                Vec::new()
            },
        })
        .collect();
    let medians: Vec<(f64, f64, f64)> = decode
        .iter()
        .map(|d| {
            (
                f64::from(d.batch),
                d.quantiles_ms[QUANTILES / 2],
                d.n as f64,
            )
        })
        .collect();
    let (a, k) = line(&medians);
    let decode_trend_ms = ((a * 1e6).round() / 1e6, (k * 1e6).round() / 1e6);
    let mut model = FittedModel {
        format: FORMAT.into(),
        version: VERSION,
        sources,
        decode_trend_ms,
        decode,
        prefill: PrefillLaw {
            overhead_ms: 0.0,
            per_token_ms: 0.0,
            per_token_depth_ms: 0.0,
            n: 0,
        },
        num_spec_tokens: spec.then_some(max_burst - 1),
    };
    // prefill: what a prefill step costs beyond its decodes' median, against its tokens
    let excess: Vec<(f64, f64, f64)> = c
        .prefill
        .iter()
        .map(|o| {
            let base = if o.decodes > 0 {
                model.decode_median(o.decodes)
            } else {
                0.0
            };
            (o.prefill_tokens as f64, (o.ms - base).max(0.0), 1.0)
        })
        .collect();
    if !excess.is_empty() {
        let (a, k) = line(&excess);
        let (a, k) = if k > 0.0 && a >= 0.0 {
            (a, k)
        } else {
            // one prompt size only, or a negative intercept: cost per token through 0
            let t: f64 = excess.iter().map(|p| p.0).sum();
            let y: f64 = excess.iter().map(|p| p.1).sum();
            (0.0, y / t.max(1.0))
        };
        model.prefill = PrefillLaw {
            overhead_ms: (a * 1e6).round() / 1e6,
            per_token_ms: (k * 1e6).round() / 1e6,
            per_token_depth_ms: 0.0,
            n: excess.len() as u64,
        };
    }
    Ok(model)
}

impl FittedModel {
    /// Write the model as pretty JSON.
    pub fn save(&self, path: &Path) -> Result<(), FitError> {
        let text = serde_json::to_string_pretty(self).map_err(|cause| FitError::Parse {
            path: path.to_path_buf(),
            cause,
        })?;
        let io = |cause| FitError::Io {
            path: path.to_path_buf(),
            cause,
        };
        if path.as_os_str() == "-" {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            return writeln!(out, "{text}").map_err(io);
        }
        std::fs::write(path, text + "\n").map_err(io)
    }

    /// Read a model file, checking its format and version.
    pub fn load(path: &Path) -> Result<Self, FitError> {
        let text = std::fs::read_to_string(path).map_err(|cause| FitError::Io {
            path: path.to_path_buf(),
            cause,
        })?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|cause| FitError::Parse {
                path: path.to_path_buf(),
                cause,
            })?;
        let format = v.get("format").and_then(|f| f.as_str()).unwrap_or("");
        let version = v.get("version").and_then(|f| f.as_u64()).unwrap_or(0) as u32;
        if format != FORMAT || version != VERSION {
            return Err(FitError::Version {
                path: path.to_path_buf(),
                format: format.to_string(),
                version,
            });
        }
        serde_json::from_value(v).map_err(|cause| FitError::Parse {
            path: path.to_path_buf(),
            cause,
        })
    }

    /// Whether `path` holds a model file rather than a trace (its JSON has our `format`).
    pub fn is_model_file(path: &Path) -> bool {
        let Ok(head) = std::fs::read(path) else {
            return false;
        };
        let head = &head[..head.len().min(256)];
        head.first() != Some(&0x1f) // not gzip
            && std::str::from_utf8(head).is_ok_and(|s| s.contains(FORMAT))
    }

    fn trend(&self, b: f64) -> f64 {
        (self.decode_trend_ms.0 + self.decode_trend_ms.1 * b).max(0.0)
    }

    /// The bin to draw a batch of `b` from and the factor to scale it by: the batch's own
    /// bin when it holds enough steps for a shape, else the nearest bin that does.
    fn bin(&self, b: u32) -> (&DecodeBin, f64) {
        let enough = self.decode.iter().any(|d| d.n >= MIN_BIN);
        let near = self
            .decode
            .iter()
            .filter(|d| !enough || d.n >= MIN_BIN)
            .min_by_key(|d| (d.batch.abs_diff(b), d.batch))
            .expect("a model has at least one decode bin");
        if near.batch == b {
            return (near, 1.0);
        }
        let (want, have) = (self.trend(f64::from(b)), self.trend(f64::from(near.batch)));
        let scale = if have > 0.0 { want / have } else { 1.0 };
        (near, scale.clamp(0.1, 10.0))
    }

    /// The median decode step of `b` decodes, ms.
    pub fn decode_median(&self, b: u32) -> f64 {
        let (bin, scale) = self.bin(b);
        bin.quantiles_ms[QUANTILES / 2] * scale
    }

    /// The model as the engine drives it.
    pub fn latency(self, seed: u64, time_scale: f64) -> FittedLatency {
        FittedLatency {
            model: self,
            rng: seed ^ 0x6d6f_6465_6c00_0001,
            time_scale: if time_scale > 0.0 { time_scale } else { 1.0 },
        }
    }
}

/// A [`FittedModel`] pacing an engine.
pub struct FittedLatency {
    model: FittedModel,
    rng: u64,
    time_scale: f64,
}

impl FittedLatency {
    fn unit(&mut self) -> f64 {
        // SplitMix64
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A decode-step draw for `b` decodes: the bin's quantile curve at a uniform point.
    fn draw_decode(&mut self, b: u32) -> f64 {
        let u = self.unit();
        let (bin, scale) = self.model.bin(b);
        let q = &bin.quantiles_ms;
        let pos = u * (q.len() - 1) as f64;
        let lo = pos.floor() as usize;
        let hi = (lo + 1).min(q.len() - 1);
        (q[lo] + (q[hi] - q[lo]) * (pos - lo as f64)) * scale
    }

    /// The model this pacer draws from.
    pub fn model(&self) -> &FittedModel {
        &self.model
    }
}

impl LatencyModel for FittedLatency {
    fn step(&mut self, shape: &StepShape) -> StepTiming {
        let b = shape.decodes.len() as u32;
        let mut ms = 0.0;
        let mut decode_tokens = Vec::new();
        if b > 0 {
            let (bin, scale) = self.model.bin(b);
            if self.model.num_spec_tokens.is_some() && !bin.bursts.is_empty() {
                // joint (gap, tokens): the first decode's pair paces the step
                let n = bin.bursts.len();
                let picks: Vec<usize> = (0..b)
                    .map(|_| ((self.unit() * n as f64) as usize).min(n - 1))
                    .collect();
                let bursts = &self.model.bin(b).0.bursts;
                ms += bursts[picks[0]].0 * scale;
                decode_tokens = picks.iter().map(|&i| bursts[i].1.max(1)).collect();
            } else {
                ms += self.draw_decode(b);
            }
        }
        if !shape.prefills.is_empty() {
            let p = self.model.prefill;
            ms += p.overhead_ms;
            for c in &shape.prefills {
                let (d0, d1) = (c.context as f64, (c.context + c.tokens) as f64);
                ms += p.per_token_ms * c.tokens as f64
                    + p.per_token_depth_ms * (d1 * d1 - d0 * d0) / 2.0;
            }
        }
        StepTiming {
            duration: Duration::from_secs_f64((ms / self.time_scale).max(0.0) / 1e3),
            decode_tokens,
        }
    }

    fn describe(&self) -> String {
        let m = &self.model;
        let batches: Vec<String> = m.decode.iter().map(|d| d.batch.to_string()).collect();
        format!(
            "fitted (decode batches {} seen, median {:.2} + {:.3}·b ms; prefill {:.1} ms + {:.4} ms/token{}{})",
            batches.join(","),
            m.decode_trend_ms.0,
            m.decode_trend_ms.1,
            m.prefill.overhead_ms,
            m.prefill.per_token_ms,
            m.num_spec_tokens
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
        self.model.num_spec_tokens
    }
}
