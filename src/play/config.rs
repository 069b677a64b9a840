//! `play`'s flags, validated once into a [`PlayConfig`] the rest of the program trusts,
//! and the one builder that makes an engine from it (used by the live loop, the offline
//! driver and the tests).

use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use sim_protocol::VllmLine;
use sim_protocol::kv_events::KvEventsConfig;
use sim_trace::fit::{FitInput, FittedModel};
use sim_trace::latency::{self, Knobs, LatencyModel};

use super::engine_args::TtftMode;
use super::pd::PdConfig;
use super::{EngineArgs, PlayArgs, TokenMode};
use crate::io_guard::{Named, check_outputs, named};
use crate::play::content::constrained::{Shaping, ToolCalls};
use crate::play::content::failures::FailureInjector;
use crate::play::content::pooling::Runner;
use crate::play::content::replay::ReplaySetup;
use crate::play::content::spec_decode::{SpecMetricsLevel, SpecModel};
use crate::play::content::text::TextTokens;
use crate::play::content::tokens::{EchoTokens, RandomTokens, TokenSource};
use crate::play::content::vocab::{self, Vocabulary};
use crate::play::engine::batch::ComposeRules;
use crate::play::engine::queue_policy::SchedulingPolicy;
use crate::play::engine::sim::SimEngine;

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
    /// model; set by [`PlayConfig::build_engine`].
    pub first_token_floor: Duration,
    /// Generation or pooling (`--runner`), and the embedding length of the latter.
    pub runner: Runner,
    pub embedding_dim: u32,
    /// Prefill/decode disaggregation.
    pub pd: PdConfig,
}

/// Everything `play` needs, checked.
#[derive(Debug, Clone)]
pub struct PlayConfig {
    pub handshake_address: String,
    pub line: VllmLine,
    /// DP ranks served by this process.
    pub ranks: Range<u16>,
    /// The deployment's data-parallel size.
    pub dp_size: u16,
    pub handshake_timeout: Duration,
    pub shutdown_timeout: Duration,
    /// What a request frame may claim before it is decoded.
    pub decode_limits: sim_protocol::decode::DecodeLimits,
    /// The engine of the first rank (the builder sets `engine_index` per rank).
    pub engine: EngineConfig,
    pub tokens: TokenMode,
    /// The model's vocabulary (`--tokenizer`, else the embedded tiny model's).
    pub vocab: Arc<Vocabulary>,
    pub random: RandomTokens,
    pub knobs: Knobs,
    pub policy: SchedulingPolicy,
    pub kv_events: Option<KvEventsConfig>,
    /// Advertised in the ready response.
    pub dtype: String,
    pub disable_lora: bool,
    pub max_loras: u32,
    pub max_num_seqs: u64,
    pub max_num_batched_tokens: u64,
    /// Recorded content and timing to serve (`--replay-tokens`, `--replay-steps`).
    pub replay: Option<ReplaySetup>,
    /// The latency model fitted to a capture (`--latency-trace`); the knobs otherwise.
    pub model: Option<FittedModel>,
}

/// A seconds flag set in code (flags parsed by clap are range-checked already).
fn seconds(v: f64, flag: &str, allow_zero: bool) -> Result<Duration> {
    let max = crate::flag_ranges::MAX_SECONDS;
    let ok = v.is_finite() && (v > 0.0 || (allow_zero && v == 0.0)) && v <= max;
    if !ok {
        let what = if allow_zero { "≥ 0" } else { "positive" };
        bail!("{flag} must be a {what} number of seconds up to {max} (a day), got {v}");
    }
    Ok(Duration::from_secs_f64(v))
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

impl TryFrom<&PlayArgs> for PlayConfig {
    type Error = anyhow::Error;

    fn try_from(a: &PlayArgs) -> Result<Self> {
        Self::build(a, None)
    }
}

impl PlayConfig {
    /// The configuration of `a` with the replay indexes an earlier configuration of the
    /// same flags loaded (`serve` checks the flags before it starts anything, then runs
    /// the engine: the traces are read and logged once).
    pub fn with_replay(a: &PlayArgs, replay: Option<ReplaySetup>) -> Result<Self> {
        Self::build(a, Some(replay))
    }

    fn build(a: &PlayArgs, preloaded: Option<Option<ReplaySetup>>) -> Result<Self> {
        if let Some(summary) = &a.replay_summary {
            check_outputs(&engine_inputs(a), &[named("--replay-summary", summary)])?;
        }
        if a.min_token_id >= a.vocab_size {
            bail!(
                "--min-token-id ({}) must be below --vocab-size ({})",
                a.min_token_id,
                a.vocab_size
            );
        }
        let knobs = a.knobs();
        // (flags are range-checked by clap; PlayArgs built in code are checked here)
        knobs.validate().map_err(|e| anyhow!(e))?;
        if a.ttft_mode == TtftMode::Fixed && !a.latency_trace.is_empty() {
            bail!(
                "--ttft-mode fixed applies to the knobs; a --latency-trace model times prefills itself"
            );
        }
        if !a.latency_trace.is_empty() {
            let set: Vec<&str> = [
                (a.time_to_first_token, "--time-to-first-token"),
                (
                    a.time_to_first_token_std_dev,
                    "--time-to-first-token-std-dev",
                ),
                (a.inter_token_latency, "--inter-token-latency"),
                (
                    a.inter_token_latency_std_dev,
                    "--inter-token-latency-std-dev",
                ),
                (a.prefill_overhead, "--prefill-overhead"),
                (a.prefill_time_per_token, "--prefill-time-per-token"),
            ]
            .into_iter()
            .filter(|(v, _)| *v > 0.0)
            .map(|(_, f)| f)
            .collect();
            if !set.is_empty() {
                bail!(
                    "--latency-trace paces every step with the model fitted to the capture; it does not combine with {} (drop those, or drop --latency-trace)",
                    set.join(", ")
                );
            }
            if a.time_factor_under_load != 1.0 {
                bail!(
                    "--latency-trace already conditions step times on the batch; --time-factor-under-load does not combine with it"
                );
            }
        }
        let model = load_latency_model(&a.latency_trace, &a.latency_steps)?;
        if let (Some(expected), Some(m)) = (&a.expect_config_hash, &model) {
            let expected = expected.trim().to_ascii_lowercase();
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
        }
        if let Some(expected) = &a.expect_config_hash {
            let mut paths: Vec<&std::path::Path> = a
                .latency_trace
                .iter()
                .map(|p| p.as_path())
                .filter(|p| !FittedModel::is_model_file(p))
                .collect();
            paths.extend(a.replay_tokens.as_deref());
            paths.extend(a.replay_steps.as_deref());
            if paths.is_empty() {
                bail!(
                    "--expect-config-hash checks the traces given to --latency-trace, --replay-tokens or --replay-steps, and none was given"
                );
            }
            crate::play::content::replay::check_config_hash(expected, &paths)?;
        }
        let vocab = match &a.tokenizer {
            Some(p) => Arc::new(Vocabulary::load(&vocab::model_dir_of(p))?),
            None => Vocabulary::embedded(),
        };
        let replay = match preloaded {
            Some(r) => r,
            None => ReplaySetup::load(
                a.replay_tokens.as_deref(),
                a.replay_steps.as_deref(),
                a.replay_match,
                a.replay_miss,
                &vocab,
                a.replay_allow_mismatch,
            )?,
        };
        if let (Some(expected), Some(r)) = (&a.expect_config_hash, &replay) {
            // concatenated captures carry several meta lines: every one must agree
            r.check_config_hashes(expected)?;
        }
        if let (None, Some(m), Some(r)) = (&a.expect_config_hash, &model, &replay) {
            warn_other_config(m, r);
        }
        let kv_events = a
            .kv_events_config
            .as_deref()
            .map(crate::play::pd::kv_events::parse_kv_events_config)
            .transpose()
            .context("--kv-events-config")?;
        let spec = (a.num_speculative_tokens > 0)
            .then(|| SpecModel::new(a.num_speculative_tokens, a.speculative_acceptance_rate))
            .transpose()
            .map_err(|e| anyhow!("--num-speculative-tokens: {e}"))?;
        let failures = (a.failure_injection_rate != 0.0)
            .then(|| FailureInjector::new(a.failure_injection_rate, a.failure_types.clone()))
            .transpose()
            .map_err(|e| anyhow!("--failure-injection-rate: {e}"))?;
        if a.output_token_chunk_size == 0 {
            bail!("--output-token-chunk-size must be at least 1");
        }
        let handshake_timeout = seconds(a.handshake_timeout, "--handshake-timeout", false)?;
        let shutdown_timeout = seconds(a.shutdown_timeout, "--shutdown-timeout", true)?;
        let last = a
            .data_parallel_rank
            .checked_add(a.engine_count)
            .context("--data-parallel-rank + --engine-count overflows a u16 rank")?;
        let dp_size = a.data_parallel_size.unwrap_or(last).max(last);
        let num_gpu_blocks = match a.kv_cache_size {
            Some(tokens) => tokens.div_ceil(a.block_size_or_default()) + 1,
            None => a.num_gpu_blocks,
        };
        // one request of max_model_len tokens must fit the KV cache (block 0 is vLLM's
        // null block), or a request that long would wait forever
        let kv_tokens = num_gpu_blocks.saturating_sub(1) * a.block_size_or_default();
        let max_model_len = if a.max_model_len > kv_tokens {
            tracing::warn!(
                "--max-model-len {} does not fit the KV cache ({} blocks of {} tokens hold {kv_tokens}): serving at most {kv_tokens} tokens per request (the frontend refuses longer ones); raise --num-gpu-blocks (or --kv-cache-size) to serve longer contexts",
                a.max_model_len,
                num_gpu_blocks.saturating_sub(1),
                a.block_size_or_default()
            );
            kv_tokens.max(1)
        } else {
            a.max_model_len
        };
        seconds(a.kv_lease_duration, "--kv-lease-duration", false)?;
        if !(0.0..=1.0).contains(&a.tool_call_rate) {
            bail!(
                "--tool-call-rate must be between 0 and 1, got {}",
                a.tool_call_rate
            );
        }
        if a.tokenizer.is_some() && a.vocab_size > vocab.size() {
            bail!(
                "--vocab-size {} is larger than the {} tokens of --tokenizer {}",
                a.vocab_size,
                vocab.size(),
                vocab.source
            );
        }
        if a.tokenizer.is_some() || a.vocab_size <= vocab.size() {
            // ids the tokenizer knows: the random range must hold one that is text
            let end = a.vocab_size.min(vocab.size());
            let specials: Vec<u32> = (a.min_token_id..end)
                .filter(|t| vocab.is_special(*t))
                .collect();
            if specials.len() as u32 == end.saturating_sub(a.min_token_id) {
                bail!(
                    "--min-token-id {} and --vocab-size {} leave random tokens only special tokens of {} (ids {specials:?}), which decode to nothing: raise --vocab-size",
                    a.min_token_id,
                    a.vocab_size,
                    vocab.source
                );
            }
        }
        let engine = EngineConfig {
            line: a.vllm_version,
            engine_index: u32::from(a.data_parallel_rank),
            rules: ComposeRules {
                max_num_seqs: a.max_num_seqs_or_default() as usize,
                max_num_batched_tokens: a.max_num_batched_tokens_or_default(),
                long_prefill_token_threshold: a.long_prefill_token_threshold,
                enable_chunked_prefill: !a.no_enable_chunked_prefill,
                enable_prefix_caching: !a.no_enable_prefix_caching,
                max_loras: a.max_loras as usize,
                priority_preemption: a.scheduling_policy == SchedulingPolicy::Priority,
            },
            max_model_len,
            block_size: a.block_size_or_default(),
            num_gpu_blocks,
            output_token_chunk_size: a.output_token_chunk_size,
            log_requests: a.log_requests,
            spec,
            spec_metrics: a.per_request_spec_decode_metrics,
            failures,
            token_ids: a.min_token_id..a.vocab_size,
            seed: a.seed,
            report_finished: dp_size > 1,
            time_scale: knobs.time_scale,
            modeled_prefill: !a.latency_trace.is_empty(),
            fixed_ttft_ms: (a.ttft_mode == TtftMode::Fixed && a.time_to_first_token > 0.0).then(
                || {
                    (
                        a.time_to_first_token / knobs.time_scale,
                        a.time_to_first_token_std_dev / knobs.time_scale,
                    )
                },
            ),
            first_token_floor: Duration::ZERO,
            runner: a.runner,
            embedding_dim: a.embedding_dim,
            pd: PdConfig {
                role: a.pd_role,
                engine_id: a
                    .engine_id
                    .clone()
                    .unwrap_or_else(|| format!("vcr-{:x}-{:x}", std::process::id(), a.seed)),
                side_channel_host: a.side_channel_host.clone(),
                side_channel_port: a.side_channel_port,
                lease_s: a.kv_lease_duration,
                failure_policy: a.kv_load_failure_policy,
                block_bytes: a.kv_block_bytes,
                registration_generation: a.vllm_version >= VllmLine::new(0, 33),
            },
            shaping: Shaping {
                vocab: vocab.clone(),
                tool_calls: ToolCalls {
                    rate: a.tool_call_rate,
                },
            },
        };
        Ok(Self {
            handshake_address: a.handshake_address.clone(),
            line: a.vllm_version,
            ranks: a.data_parallel_rank..last,
            dp_size,
            handshake_timeout,
            shutdown_timeout,
            decode_limits: sim_protocol::decode::DecodeLimits {
                max_prompt_tokens: usize::try_from(max_model_len).unwrap_or(usize::MAX),
                max_frame_bytes: usize::try_from(a.max_frame_size << 20).unwrap_or(usize::MAX),
            },
            engine,
            tokens: a.tokens.unwrap_or_default(),
            vocab,
            random: RandomTokens {
                seed: a.seed,
                min_id: a.min_token_id,
                vocab_size: a.vocab_size,
            },
            knobs,
            policy: a.scheduling_policy,
            kv_events,
            dtype: a.dtype.clone(),
            disable_lora: a.disable_lora,
            max_loras: a.max_loras,
            max_num_seqs: a.max_num_seqs_or_default(),
            max_num_batched_tokens: a.max_num_batched_tokens_or_default(),
            replay,
            model,
        })
    }
}

/// `--latency-trace` / `--latency-steps`: a saved model file, or traces (with their
/// sidecars, in order) to fit now.
pub(crate) fn load_latency_model(
    traces: &[PathBuf],
    steps: &[PathBuf],
) -> Result<Option<FittedModel>> {
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
        return Ok(Some(m));
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
    Ok(Some(m))
}

impl PlayConfig {
    /// The configuration `play` runs with when no flag is given.
    pub fn defaults() -> Self {
        Self::try_from(&PlayArgs::defaults()).expect("the default flags are valid")
    }

    /// The configuration of an engine driven offline (`inspect simulate`): these engine
    /// flags, and play's defaults for everything around the engine (one engine of rank 0,
    /// no sockets, no KV-event publisher).
    pub fn offline(engine: &EngineArgs) -> Result<Self> {
        let mut a = PlayArgs::defaults();
        a.engine = engine.clone();
        Self::try_from(&a)
    }

    /// Where output token ids come from.
    pub fn token_source(&self) -> Box<dyn TokenSource> {
        match self.tokens {
            TokenMode::Random => Box::new(self.random.clone()),
            TokenMode::Echo => Box::new(EchoTokens {
                fallback: Some(self.random.clone()),
            }),
            TokenMode::Text => Box::new(TextTokens {
                seed: self.random.seed,
                vocab: self.vocab.clone(),
            }),
        }
    }

    /// The engine of DP rank `rank`: the one way an engine is made, for the live loop, the
    /// offline driver and the tests.
    pub fn build_engine(&self, rank: u16) -> SimEngine {
        let mut cfg = self.engine.clone();
        cfg.engine_index = u32::from(rank);
        let seed = self.random.seed.wrapping_add(u64::from(rank));
        let latency: Box<dyn LatencyModel> = match &self.model {
            Some(m) => Box::new(m.clone().latency(seed, self.knobs.time_scale)),
            None => latency::from_knobs(self.knobs, seed),
        };
        cfg.first_token_floor = self.decode_step_floor();
        let mut engine = SimEngine::new(cfg, self.token_source(), latency, self.policy.build());
        if let Some(r) = &self.replay {
            engine.set_replay(r.engine_replay());
        }
        engine
    }

    /// The median duration of a step that decodes one token for one request: the knob ITL,
    /// or the fitted model's law and median ratio for such a step (divided by the time
    /// scale either way).
    fn decode_step_floor(&self) -> Duration {
        let ms = match &self.model {
            Some(m) => {
                let shape = latency::StepShape {
                    decodes: vec![latency::DecodeSlot::default()],
                    running: 1,
                    max_num_seqs: self.engine.rules.max_num_seqs as u64,
                    max_num_batched_tokens: self.engine.rules.max_num_batched_tokens,
                    ..Default::default()
                };
                m.expected_ms(&shape)
            }
            None => self.knobs.itl_ms,
        } / self.knobs.time_scale;
        // a model that yields no sane duration adds no floor (load-time checks refuse such
        // models; this only must not panic)
        Duration::try_from_secs_f64(ms / 1e3).unwrap_or(Duration::ZERO)
    }

    /// The ready response of DP rank `rank` (what the engine advertises at the handshake).
    pub fn ready_response(&self, rank: u16) -> sim_protocol::ready::ReadyResponse {
        let max_loras = if self.disable_lora {
            0
        } else if self.max_loras == 0 {
            self.max_num_seqs
        } else {
            u64::from(self.max_loras)
        };
        let e = &self.engine;
        sim_protocol::ready::ReadyResponse {
            max_model_len: e.max_model_len,
            num_gpu_blocks: e.num_gpu_blocks,
            block_size: e.block_size,
            dp_stats_address: None,
            dtype: self.dtype.clone(),
            vllm_version: crate::compat::tag_for(self.line),
            world_size: 1,
            data_parallel_size: u64::from(self.dp_size),
            tensor_parallel_size: 1,
            pipeline_parallel_size: 1,
            decode_context_parallel_size: 1,
            data_parallel_rank: u64::from(rank),
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            instance_id: format!("vllm-vcr-{}-{rank}", std::process::id()),
            supports_lora: !self.disable_lora,
            max_loras,
            kv_cache_size_tokens: Some((e.num_gpu_blocks - 1) * e.block_size),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(f: impl FnOnce(&mut PlayArgs)) -> PlayArgs {
        let mut a = PlayArgs::defaults();
        f(&mut a);
        a
    }

    #[test]
    fn bad_values_are_refused_not_dropped() {
        let e = PlayConfig::try_from(&args(|a| {
            a.num_speculative_tokens = 3;
            a.speculative_acceptance_rate = 1.5;
        }))
        .unwrap_err();
        assert!(e.to_string().contains("--num-speculative-tokens"), "{e}");
        let e = PlayConfig::try_from(&args(|a| a.failure_injection_rate = 2.0)).unwrap_err();
        assert!(e.to_string().contains("--failure-injection-rate"), "{e}");
        let e = PlayConfig::try_from(&args(|a| a.min_token_id = 300)).unwrap_err();
        assert!(e.to_string().contains("--min-token-id"), "{e}");
        let e = PlayConfig::try_from(&args(|a| a.shutdown_timeout = -1.0)).unwrap_err();
        assert!(e.to_string().contains("--shutdown-timeout"), "{e}");
    }

    #[test]
    fn ranks_and_blocks_are_derived_once() {
        let c = PlayConfig::try_from(&args(|a| {
            a.data_parallel_rank = 2;
            a.engine_count = 2;
            a.kv_cache_size = Some(100);
            a.block_size = Some(16);
        }))
        .unwrap();
        assert_eq!(c.ranks, 2..4);
        assert_eq!(c.dp_size, 4);
        assert!(c.engine.report_finished);
        assert_eq!(c.engine.num_gpu_blocks, 7 + 1);
        assert_eq!(c.build_engine(3).engine_index(), 3);
        // 100 tokens of KV (7 blocks of 16 = 112) cannot hold the default 32,768
        assert_eq!(c.engine.max_model_len, 112);
        assert_eq!(c.ready_response(2).max_model_len, 112);
    }

    #[test]
    fn vllm_flag_forms_the_later_wins() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            play: PlayArgs,
        }
        let parse = |flags: &[&str]| {
            let mut argv = vec!["play"];
            argv.extend_from_slice(flags);
            let c = PlayConfig::try_from(&Cli::try_parse_from(argv).unwrap().play).unwrap();
            (
                c.engine.rules.enable_prefix_caching,
                c.engine.rules.enable_chunked_prefill,
            )
        };
        assert_eq!(parse(&[]), (true, true));
        assert_eq!(parse(&["--enable-prefix-caching"]), (true, true));
        assert_eq!(
            parse(&["--no-enable-prefix-caching", "--no-enable-chunked-prefill"]),
            (false, false)
        );
        assert_eq!(
            parse(&["--no-enable-prefix-caching", "--enable-prefix-caching"]),
            (true, true)
        );
        assert_eq!(
            parse(&["--enable-chunked-prefill", "--no-enable-chunked-prefill"]),
            (true, false)
        );
    }
}
