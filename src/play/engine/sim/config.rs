//! [`EngineConfig`]: the engine's settings, checked and derived by `PlayConfig` from the
//! flags; everything a [`SimEngine`](super::SimEngine) needs besides the time, its token
//! source and its latency model.

use std::ops::Range;
use std::time::Duration;

use sim_protocol::VllmLine;

use crate::play::content::constrained::Shaping;
use crate::play::content::failures::FailureInjector;
use crate::play::content::pooling::Runner;
use crate::play::content::spec_decode::{SpecMetricsLevel, SpecModel};
use crate::play::engine::batch::ComposeRules;
use crate::play::engine::offload::OffloadConfig;
use crate::play::pd::PdConfig;

/// Engine settings, validated.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub line: VllmLine,
    /// Data-parallel rank of this engine (`EngineCoreOutputs.engine_index`).
    pub engine_index: u32,
    /// The scheduler rules steps are composed under.
    pub rules: ComposeRules,
    pub max_model_len: u64,
    pub block_size: u64,
    pub num_gpu_blocks: u64,
    /// Tokens per output message per request (≥ 1).
    pub output_token_chunk_size: u32,
    pub log_requests: bool,
    /// Scheduler stats and request events in the outputs (off under `--disable-log-stats`,
    /// as vLLM's `log_stats`).
    pub log_stats: bool,
    /// Speculative decoding: K drafts per decode step and their acceptance model.
    pub spec: Option<SpecModel>,
    pub spec_metrics: SpecMetricsLevel,
    pub failures: Option<FailureInjector>,
    /// Ids random tokens (and logprob alternatives) come from.
    pub token_ids: Range<u32>,
    /// Seed of the per-request randomness.
    pub seed: u64,
    /// Tell the frontend which requests finished (`EngineCoreOutputs.finished_requests`);
    /// vLLM does this with data parallelism, where the frontend balances load with it.
    pub report_finished: bool,
    /// Recorded times (`--replay-steps`) are divided by this (`--time-scale`).
    pub time_scale: f64,
    /// A latency model paces prefills (`--latency-trace`): a scripted request's first
    /// token comes from the model, not from the recorded TTFT.
    pub modeled_prefill: bool,
    /// Structured outputs and tool calls, in the model's vocabulary.
    pub shaping: Shaping,
    /// `--ttft-mode fixed`: each request's first token is due this long (mean, std-dev;
    /// ms, already divided by --time-scale) after its arrival.
    pub fixed_ttft_ms: Option<(f64, f64)>,
    /// The least a step that samples a request's first token costs when it has no decodes:
    /// a forward pass, which a real engine runs even for a fully cached prompt (vLLM
    /// recomputes the last prompt token). The median of a one-decode step of the latency
    /// model; set by [`crate::play::config::PlayConfig::build_engine`].
    pub first_token_floor: Duration,
    /// Generation or pooling (`--runner`), and the embedding length of the latter.
    pub runner: Runner,
    pub embedding_dim: u32,
    /// `--natural-output-len`: the mean length of an answer the client did not bound
    /// (`None`: such answers run to the end of the context).
    pub natural_output_len: Option<u64>,
    /// Prefill/decode disaggregation.
    pub pd: PdConfig,
    /// The KV offload tier behind the prefix cache (`--kv-offload-blocks`), if any.
    pub offload: Option<OffloadConfig>,
}
