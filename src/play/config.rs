//! `play`'s flags, validated once into a [`PlayConfig`] the rest of the program trusts,
//! and the one builder that makes an engine from it (used by the live loop, the offline
//! driver and the tests). The checks and derived values here read no file: the files the
//! flags name are loaded by `artifacts.rs`, once.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use sim_protocol::VllmLine;
use sim_protocol::kv_events::KvEventsConfig;
use sim_trace::fit::FittedModel;
use sim_trace::latency::{self, Knobs, LatencyModel};

use super::args::PlayArgs;
use super::artifacts::Artifacts;
use super::engine_args::{EngineArgs, TokenMode, TtftMode};
use super::pd::PdConfig;
use crate::play::content::constrained::{Shaping, ToolCalls};
use crate::play::content::failures::FailureInjector;
use crate::play::content::reasoning::{AnswerLength, Reasoning};
use crate::play::content::replay::ReplaySetup;
use crate::play::content::spec_decode::SpecModel;
use crate::play::content::text::TextTokens;
use crate::play::content::tokens::{EchoTokens, RandomTokens, TokenSource};
use crate::play::content::vocab::Vocabulary;
use crate::play::engine::batch::ComposeRules;
use crate::play::engine::offload::OffloadConfig;
use crate::play::engine::queue_policy::SchedulingPolicy;
use crate::play::engine::sim::{EngineConfig, SimEngine};

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
    /// Multiplier on the model's steps with prefill work ([`EngineArgs::prefill_speed`]).
    pub prefill_speed: f64,
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

impl TryFrom<&PlayArgs> for PlayConfig {
    type Error = anyhow::Error;

    /// In three steps: the flags on their own ([`check_flags`]), the files they name, each
    /// read once ([`Artifacts::load`]), and the values derived from both ([`PlayConfig::new`]).
    fn try_from(a: &PlayArgs) -> Result<Self> {
        check_flags(a)?;
        let artifacts = Artifacts::load(a)?;
        Self::new(a, artifacts)
    }
}

/// The checks the flags pass on their own, before any file is read (flags parsed by clap
/// are range-checked already; `PlayArgs` built in code are checked here).
pub fn check_flags(a: &PlayArgs) -> Result<()> {
    if a.min_token_id >= a.vocab_size {
        bail!(
            "--min-token-id ({}) must be below --vocab-size ({})",
            a.min_token_id,
            a.vocab_size
        );
    }
    a.knobs().validate().map_err(|e| anyhow!(e))?;
    crate::play::pd::layout::check_block_size(a.kv_peer_layout.as_ref(), a.block_size)
        .map_err(|e| anyhow!(e))?;
    if a.ttft_mode == TtftMode::Fixed && a.uses_latency_model() {
        bail!(
            "--ttft-mode fixed applies to the knobs; a --latency-trace model times prefills itself"
        );
    }
    if a.uses_latency_model() {
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
    if a.expect_config_hash
        .as_deref()
        .is_some_and(|h| h.trim().is_empty())
    {
        bail!("--expect-config-hash needs a hash (the `config_hash` of a trace's meta line)");
    }
    Ok(())
}

/// The random ids `--min-token-id` .. `--vocab-size` must be ids of the model's vocabulary,
/// and at least one of them text.
fn check_vocab_range(a: &PlayArgs, vocab: &Vocabulary) -> Result<()> {
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
    Ok(())
}

impl PlayConfig {
    /// The configuration of the flags `a` and the files they name (loaded by
    /// [`Artifacts::load`]): the checks and the derived values, no file read. `serve`
    /// loads the artifacts once and builds twice, before and after it starts the frontend.
    pub fn new(a: &PlayArgs, artifacts: Artifacts) -> Result<Self> {
        check_flags(a)?;
        let Artifacts {
            vocab,
            model,
            replay,
        } = artifacts;
        let knobs = a.knobs();
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
        if !(0.0..=1.0).contains(&a.reasoning_share) {
            bail!(
                "--reasoning-share must be between 0 and 1, got {}",
                a.reasoning_share
            );
        }
        if !(0.0..=1.0).contains(&a.tool_call_rate) {
            bail!(
                "--tool-call-rate must be between 0 and 1, got {}",
                a.tool_call_rate
            );
        }
        check_vocab_range(a, &vocab)?;
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
            log_stats: !a.disable_log_stats,
            spec,
            spec_metrics: a.per_request_spec_decode_metrics,
            failures,
            token_ids: a.min_token_id..a.vocab_size,
            seed: a.seed,
            report_finished: dp_size > 1,
            time_scale: knobs.time_scale,
            modeled_prefill: a.uses_latency_model(),
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
            natural_output_len: (a.natural_output_len > 0).then_some(a.natural_output_len),
            pd: PdConfig {
                role: a.pd_role,
                engine_id: a.engine_id.clone().unwrap_or_else(fresh_engine_id),
                side_channel_host: a.side_channel_host.clone(),
                side_channel_port: a.side_channel_port,
                lease_s: a.kv_lease_duration,
                failure_policy: a.kv_load_failure_policy,
                block_bytes: a.kv_block_bytes,
                registration_generation: a.vllm_version >= VllmLine::new(0, 33),
                peer_layout: a.kv_peer_layout.clone(),
                connector_stats: a.nixl_connector_stats,
            },
            offload: OffloadConfig::from_flags(
                a.kv_offload_blocks,
                a.kv_offload_policy,
                a.kv_offload_load_us,
                (a.kv_block_bytes, a.kv_offload_connector_stats),
                !a.no_enable_prefix_caching,
            )?,
            shaping: Shaping {
                vocab: vocab.clone(),
                tool_calls: ToolCalls {
                    rate: a.tool_call_rate,
                    format: a.tool_call_format.unwrap_or_default(),
                },
                reasoning: Reasoning {
                    format: a.reasoning_format.unwrap_or_default(),
                    share: a.reasoning_share,
                },
                length: AnswerLength {
                    max_model_len,
                    natural_mean: (a.natural_output_len > 0).then_some(a.natural_output_len),
                    seed: a.seed,
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
            prefill_speed: a.prefill_speed.unwrap_or(1.0),
        })
    }
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
        let source: Box<dyn TokenSource> = match self.tokens {
            TokenMode::Random => Box::new(self.random.clone()),
            TokenMode::Echo => Box::new(EchoTokens {
                fallback: Some(self.random.clone()),
            }),
            TokenMode::Text => Box::new(TextTokens {
                seed: self.random.seed,
                vocab: self.vocab.clone(),
            }),
        };
        let shaping = &self.engine.shaping;
        (shaping.reasoning).wrap(source, self.vocab.clone(), shaping.length)
    }

    /// The engine of DP rank `rank`: the one way an engine is made, for the live loop, the
    /// offline driver and the tests.
    pub fn build_engine(&self, rank: u16) -> SimEngine {
        let mut cfg = self.engine.clone();
        cfg.engine_index = u32::from(rank);
        let seed = self.random.seed.wrapping_add(u64::from(rank));
        let latency: Box<dyn LatencyModel> = match &self.model {
            Some(m) => Box::new(
                m.clone()
                    .latency(seed, self.knobs.time_scale)
                    .with_prefill_speed(self.prefill_speed),
            ),
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

/// A P/D engine id unique across hosts and containers, as vLLM's default (a UUID) is: two
/// engines in two containers are both pid 1, and NIXL refuses a peer whose agent has its
/// own name. The process's random hasher keys are the randomness (no extra crate).
fn fresh_engine_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    format!("vcr-{:x}-{:016x}", std::process::id(), h.finish())
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

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
    /// A configuration built from `a` and in-memory artifacts: no file is read.
    fn without_files(a: &PlayArgs) -> Result<PlayConfig> {
        PlayConfig::new(a, Artifacts::embedded())
    }

    #[test]
    fn flags_are_checked_before_any_file_is_read() {
        let missing = PathBuf::from("/nonexistent/capture.jsonl");
        let e = PlayConfig::try_from(&args(|a| {
            a.latency_trace = vec![missing.clone()];
            a.ttft_mode = TtftMode::Fixed;
        }))
        .unwrap_err();
        assert!(e.to_string().contains("--ttft-mode fixed"), "{e}");
        let e = PlayConfig::try_from(&args(|a| {
            a.latency_trace = vec![missing.clone()];
            a.inter_token_latency = 5.0;
        }))
        .unwrap_err();
        assert!(e.to_string().contains("--inter-token-latency"), "{e}");
    }

    #[test]
    fn an_empty_expected_hash_is_refused() {
        let e = check_flags(&args(|a| a.expect_config_hash = Some("  ".into()))).unwrap_err();
        assert!(e.to_string().contains("needs a hash"), "{e}");
    }

    #[test]
    fn a_latency_model_paces_prefills_and_the_knobs_do_not() {
        let knobs = without_files(&args(|_| {})).unwrap();
        assert!(!knobs.engine.modeled_prefill);
        let modeled = args(|a| a.latency_trace = vec![PathBuf::from("model.json")]);
        assert!(without_files(&modeled).unwrap().engine.modeled_prefill);
    }

    #[test]
    fn a_vocab_size_past_the_tokenizer_is_refused() {
        let e = without_files(&args(|a| {
            a.tokenizer = Some(PathBuf::from("tiny"));
            a.vocab_size = 100_000;
        }))
        .unwrap_err();
        assert!(
            e.to_string().contains("--vocab-size 100000 is larger"),
            "{e}"
        );
    }

    #[test]
    fn random_ids_of_only_special_tokens_are_refused() {
        let e = without_files(&args(|a| {
            a.min_token_id = 0;
            a.vocab_size = 1;
        }))
        .unwrap_err();
        assert!(e.to_string().contains("only special tokens"), "{e}");
    }

    #[test]
    fn a_fixed_ttft_is_divided_by_the_time_scale() {
        let c = without_files(&args(|a| {
            a.ttft_mode = TtftMode::Fixed;
            a.time_to_first_token = 100.0;
            a.time_scale = 2.0;
        }))
        .unwrap();
        assert_eq!(c.engine.fixed_ttft_ms, Some((50.0, 0.0)));
    }
}
