//! `vllm-vcr play`: a simulated vLLM engine-core behind a real frontend.

pub mod batch;
pub mod block_hash;
pub mod config;
pub mod emit;
pub mod engine_core;
pub mod failures;
pub mod io;
pub mod kv_cache;
pub mod kv_events;
pub mod logprobs;
pub mod offline;
pub mod queue_policy;
pub mod replay;
pub mod request;
pub mod scripted;
pub mod sim;
pub mod spec_decode;
pub mod timer;
pub mod tokens;
pub mod utility;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use sim_protocol::VllmLine;
use tokio::sync::watch;

use config::PlayConfig;
use failures::FailureType;
use queue_policy::SchedulingPolicy;
use spec_decode::SpecMetricsLevel;

/// The vLLM line this build speaks by default (stamped from compat.toml by build.rs).
pub const DEFAULT_LINE: &str = env!("VLLM_VCR_DEFAULT_LINE");

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum TokenMode {
    /// Random ids, seeded per request (from --seed and the request id, or the request's
    /// own sampling seed and prompt).
    #[default]
    Random,
    /// The prompt's own ids back, then EOS (wraps around under ignore_eos).
    Echo,
}

#[derive(Debug, Clone, Args)]
pub struct PlayArgs {
    /// The frontend's engine handshake socket (vLLM's --data-parallel-address and
    /// --data-parallel-rpc-port; vllm-rs --handshake-host/--handshake-port). `serve` sets
    /// it itself.
    #[arg(
        long,
        default_value = "tcp://127.0.0.1:29550",
        env = "VLLM_VCR_HANDSHAKE_ADDRESS"
    )]
    pub handshake_address: String,

    /// vLLM line of the frontend (0.25 … 0.33; `0.27`, `v0.27.1` and `0.27.1` all work).
    /// It decides the wire layout of every message.
    #[arg(long, default_value = DEFAULT_LINE, value_parser = parse_line)]
    pub vllm_version: VllmLine,

    /// Number of engines to run in this process, for a frontend started with
    /// --data-parallel-size N (ranks --data-parallel-rank … +N-1).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub engine_count: u16,

    /// Data-parallel rank of the first engine (its ZMQ identity and engine_index).
    #[arg(long, default_value_t = 0)]
    pub data_parallel_rank: u16,

    /// Total data-parallel size of the deployment, when engines run in several processes
    /// (default: --data-parallel-rank + --engine-count).
    #[arg(long)]
    pub data_parallel_size: Option<u16>,

    /// Seconds to keep trying to reach the frontend's handshake socket before giving up
    /// (the engine may start before the frontend, as in a pod).
    #[arg(long, default_value_t = 600.0)]
    pub handshake_timeout: f64,

    /// Where output token ids come from.
    #[arg(long, value_enum, default_value_t = TokenMode::Random)]
    pub tokens: TokenMode,

    /// Seed for random tokens (same seed and same requests give the same tokens).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Random token ids are drawn from [--min-token-id, vocab-size). Only ids the
    /// frontend's tokenizer knows may be emitted; the default fits the embedded tiny model
    /// (259 tokens).
    #[arg(long, default_value_t = 259, value_parser = clap::value_parser!(u32).range(1..))]
    pub vocab_size: u32,

    /// Lowest random token id (ids below it are often special tokens).
    #[arg(long, default_value_t = 3)]
    pub min_token_id: u32,

    /// Mean time to first token in milliseconds: what prefilling a request's whole
    /// uncached prompt adds to a step (split over its chunks). 0 = instant.
    #[arg(long, default_value_t = 0.0, value_parser = parse_ms)]
    pub time_to_first_token: f64,

    /// Standard deviation of the time to first token, ms (log-normal, never negative).
    #[arg(long, default_value_t = 0.0, value_parser = parse_ms)]
    pub time_to_first_token_std_dev: f64,

    /// Mean duration of a decode step in milliseconds: the inter-token latency. 0 = instant.
    #[arg(long, default_value_t = 0.0, value_parser = parse_ms)]
    pub inter_token_latency: f64,

    /// Standard deviation of the inter-token latency, ms (log-normal, never negative).
    #[arg(long, default_value_t = 0.0, value_parser = parse_ms)]
    pub inter_token_latency_std_dev: f64,

    /// Fixed cost of a step that prefills, ms.
    #[arg(long, default_value_t = 0.0, value_parser = parse_ms)]
    pub prefill_overhead: f64,

    /// Cost per prefilled (uncached) prompt token, ms.
    #[arg(long, default_value_t = 0.0, value_parser = parse_ms)]
    pub prefill_time_per_token: f64,

    /// Fixed cost, ms, of a step that pulls a decode request's prompt KV from the prefill
    /// engine (P/D: requests with `kv_transfer_params.do_remote_prefill`).
    #[arg(long, default_value_t = 0.0, value_parser = parse_ms)]
    pub kv_transfer_latency: f64,

    /// Cost per pulled KV token, ms.
    #[arg(long, default_value_t = 0.0, value_parser = parse_ms)]
    pub kv_transfer_time_per_token: f64,

    /// Slow-down factor at full load (running = --max-num-seqs), linear in between; 1 = none.
    #[arg(long, default_value_t = 1.0)]
    pub time_factor_under_load: f64,

    /// Divide every duration by this (100 = a hundred times faster than configured).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,

    /// Tokens per request per output message (vLLM emits one per step; more models
    /// speculative or multi-token steps).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub output_token_chunk_size: u32,

    /// Maximum number of requests in the running batch; the rest wait.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_num_seqs: u64,

    /// Token budget of one step: decodes take one token each, prefill chunks the rest.
    #[arg(long, default_value_t = 8192, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_num_batched_tokens: u64,

    /// Largest prefill chunk of one request when several compete for a step (0 = no cap).
    #[arg(long, default_value_t = 0)]
    pub long_prefill_token_threshold: u64,

    /// Prefill a prompt only when it fits one step's budget whole (vLLM's
    /// --no-enable-chunked-prefill).
    #[arg(long)]
    pub no_enable_chunked_prefill: bool,

    /// Turn the prefix cache off (vLLM's --no-enable-prefix-caching).
    #[arg(long)]
    pub no_enable_prefix_caching: bool,

    /// Model context length: requests stop with `length` when prompt plus output reach it.
    /// The frontend uses the smaller of this and its model's own limit.
    #[arg(long, default_value_t = 32768, value_parser = clap::value_parser!(u64).range(2..))]
    pub max_model_len: u64,

    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..))]
    pub block_size: u64,

    /// KV-cache blocks (advertised to the frontend): admission needs free blocks, and a
    /// running request that cannot grow preempts the newest one, as in vLLM.
    #[arg(long, default_value_t = 65536, value_parser = clap::value_parser!(u64).range(2..))]
    pub num_gpu_blocks: u64,

    /// KV-cache capacity in tokens instead of blocks (sets --num-gpu-blocks to hold this
    /// many tokens, plus vLLM's reserved null block).
    #[arg(long, conflicts_with = "num_gpu_blocks", value_parser = clap::value_parser!(u64).range(1..))]
    pub kv_cache_size: Option<u64>,

    /// Waiting-queue order.
    #[arg(long, value_enum, default_value_t = SchedulingPolicy::Fcfs)]
    pub scheduling_policy: SchedulingPolicy,

    /// Distinct LoRA adapters allowed in the running batch (advertised as max_loras;
    /// 0 = no cap).
    #[arg(long, default_value_t = 0)]
    pub max_loras: u32,

    /// Advertise an engine without LoRA support (vllm-rs --lora-modules then refuses to
    /// start, as with a real engine started without --enable-lora).
    #[arg(long)]
    pub disable_lora: bool,

    /// dtype advertised in the ready response.
    #[arg(long, default_value = "bfloat16", value_parser = ["float16", "bfloat16", "float32"])]
    pub dtype: String,

    /// Speculative decoding: draft tokens verified per decode step (0 = off). A step then
    /// delivers 1 + accepted tokens, and the stats carry vLLM's spec-decode counters.
    #[arg(long, default_value_t = 0)]
    pub num_speculative_tokens: u32,

    /// Probability that a draft token is accepted (each position only if all earlier ones
    /// were).
    #[arg(long, default_value_t = 0.7)]
    pub speculative_acceptance_rate: f64,

    /// Per-request spec-decode metrics on final outputs (vLLM's
    /// --per-request-spec-decode-metrics).
    #[arg(long, value_enum, default_value_t = SpecMetricsLevel::Summary)]
    pub per_request_spec_decode_metrics: SpecMetricsLevel,

    /// Fraction of requests (0–1) that fail on purpose, for testing clients.
    #[arg(long, default_value_t = 0.0)]
    pub failure_injection_rate: f64,

    /// How injected failures end a request: `error` (finish_reason error), `length` (cut
    /// short) or `repetition` (vLLM's repetition detection); comma-separated, picked at
    /// random.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "error")]
    pub failure_types: Vec<FailureType>,

    /// Publish KV-cache events (BlockStored / BlockRemoved / AllBlocksCleared) as vLLM
    /// does: a JSON object with vLLM's keys, e.g.
    /// '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557"}'.
    /// The resolved config is advertised to the frontend in the ready response.
    #[arg(long)]
    pub kv_events_config: Option<String>,

    /// Pace steps with a latency model fitted to captured traces (`record --trace-out`,
    /// `.gz` too), or loaded from a model file written by `inspect fit`. Not together
    /// with the TTFT / ITL / prefill knobs; composes with --time-scale.
    #[arg(long, num_args = 1.., value_name = "PATH")]
    pub latency_trace: Vec<std::path::PathBuf>,

    /// The step-stats sidecars (`record --step-stats-out`) of the --latency-trace traces,
    /// in the same order: they give the fit every step, not only those that emitted.
    #[arg(long, num_args = 1.., value_name = "PATH", requires = "latency_trace")]
    pub latency_steps: Vec<std::path::PathBuf>,

    /// Serve recorded output token ids from this trace (captured with
    /// `record --record-tokens`); --replay-match decides which record a request gets.
    #[arg(long, value_name = "TRACE")]
    pub replay_tokens: Option<std::path::PathBuf>,

    /// Replay each matched request's recorded chunk sizes at its recorded gaps (the
    /// first token after the recorded TTFT, unless --latency-trace models it).
    #[arg(long, value_name = "TRACE")]
    pub replay_steps: Option<std::path::PathBuf>,

    /// How requests find their record: `index` (the `replay-<i>` in the request id picks
    /// the i-th record by arrival) or `prefix` (the prompt's block hashes against the
    /// records': the longest shared prefix).
    #[arg(long, value_enum, default_value_t = replay::MatchMode::Index)]
    pub replay_match: replay::MatchMode,

    /// What a request without a record gets: `random` tokens (logged and counted) or
    /// `fail` (it finishes with an error saying why).
    #[arg(long, value_enum, default_value_t = replay::MissPolicy::Random)]
    pub replay_miss: replay::MissPolicy,

    /// Write the replay counts (served, matched by depth, missed by reason) as JSON to
    /// this file when the engine stops.
    #[arg(long, value_name = "PATH")]
    pub replay_summary: Option<std::path::PathBuf>,

    /// Refuse to start unless every trace given to --latency-trace, --replay-tokens and
    /// --replay-steps carries this `config_hash` in its meta (a capture of another engine
    /// configuration is another engine).
    #[arg(long, value_name = "HEX")]
    pub expect_config_hash: Option<String>,

    /// Log every request's arrival, finish and abort.
    #[arg(long)]
    pub log_requests: bool,

    /// Seconds to keep serving admitted requests after SIGINT/SIGTERM before aborting the
    /// rest (vLLM's --shutdown-timeout; 0 aborts at once).
    #[arg(long, default_value_t = 0.0)]
    pub shutdown_timeout: f64,
}

fn parse_line(s: &str) -> Result<VllmLine, String> {
    VllmLine::parse(s).map_err(|e| e.to_string())
}

fn parse_ms(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of milliseconds"))?;
    if !v.is_finite() || v < 0.0 {
        return Err(format!("milliseconds must be ≥ 0, got {s}"));
    }
    Ok(v)
}

impl PlayArgs {
    /// Default arguments (as if no flag was given).
    pub fn defaults() -> Self {
        #[derive(clap::Parser)]
        struct Wrap {
            #[command(flatten)]
            play: PlayArgs,
        }
        <Wrap as clap::Parser>::parse_from(["play"]).play
    }

    /// The latency knobs as flags set them (validated by [`PlayConfig::try_from`]).
    pub fn knobs(&self) -> sim_trace::latency::Knobs {
        sim_trace::latency::Knobs {
            ttft_ms: self.time_to_first_token,
            ttft_std_ms: self.time_to_first_token_std_dev,
            itl_ms: self.inter_token_latency,
            itl_std_ms: self.inter_token_latency_std_dev,
            prefill_overhead_ms: self.prefill_overhead,
            prefill_per_token_ms: self.prefill_time_per_token,
            kv_transfer_ms: self.kv_transfer_latency,
            kv_transfer_per_token_ms: self.kv_transfer_time_per_token,
            time_factor_under_load: self.time_factor_under_load,
            time_scale: self.time_scale,
        }
    }
}

/// Run `play` until shutdown (or until the frontend goes away).
pub async fn run(args: PlayArgs, shutdown: watch::Receiver<bool>) -> Result<()> {
    let cfg = std::sync::Arc::new(PlayConfig::try_from(&args)?);
    let mut tasks = Vec::new();
    for rank in cfg.ranks.clone() {
        let cfg = cfg.clone();
        let shutdown = shutdown.clone();
        tasks.push(tokio::spawn(async move {
            io::run_engine(&cfg, rank, shutdown)
                .await
                .with_context(|| format!("engine {rank}"))
        }));
    }
    let mut first_err = None;
    let mut summaries = Vec::new();
    for (rank, t) in cfg.ranks.clone().zip(tasks) {
        match t.await {
            Ok(Ok(summary)) => summaries.extend(summary.map(|s| (rank, s))),
            Ok(Err(e)) => {
                tracing::error!("{e:#}");
                first_err.get_or_insert(e);
            }
            Err(e) => {
                first_err.get_or_insert(anyhow::anyhow!("engine task failed: {e}"));
            }
        }
    }
    // every engine of the process serves from the same shared index: one set of counts
    if let (Some(path), Some((_, counts))) = (&args.replay_summary, summaries.pop()) {
        let text = serde_json::to_string_pretty(&counts)?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("writing --replay-summary {}", path.display()))?;
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
