//! The engine's flags: everything that decides what the simulated engine does with a
//! request (tokens, latency, scheduler, KV cache, speculative decoding, failures, replay).
//! `play` flattens them next to its socket and handshake flags; `inspect simulate` takes
//! the same struct to drive the engine offline, so both accept the same engine flags from
//! one definition.

use std::path::PathBuf;

use clap::Args;

use super::pd::{LoadFailurePolicy, PdRole};
use crate::play::content::constrained::ToolCallFormat;
use crate::play::content::failures::FailureType;
use crate::play::content::pooling::Runner;
use crate::play::content::reasoning::ReasoningFormat;
use crate::play::content::replay::{MatchMode, MissPolicy};
use crate::play::content::spec_decode::SpecMetricsLevel;
use crate::play::engine::offload::OffloadPolicy;
use crate::play::engine::queue_policy::SchedulingPolicy;

/// `--tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Default)]
pub enum TokenMode {
    /// Random ids, seeded per request (from --seed and the request id, or the request's
    /// own sampling seed and prompt).
    #[default]
    Random,
    /// The prompt's own ids back, then EOS (wraps around under ignore_eos).
    Echo,
    /// Readable sentences of ordinary words in the model's tokens (--tokenizer), seeded
    /// like random ones; runs to max_tokens like random ones.
    Text,
}

/// `--ttft-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum TtftMode {
    /// Prefill cost inside the steps.
    #[default]
    Step,
    /// A per-request delay to the first token.
    Fixed,
}

/// The KV-cache block size when `--block-size` is not given.
pub const DEFAULT_BLOCK_SIZE: u64 = 16;
/// `--max-num-seqs` when not given (vLLM's default on GPUs).
pub const DEFAULT_MAX_NUM_SEQS: u64 = 256;
/// `--max-num-batched-tokens` when not given.
pub const DEFAULT_MAX_NUM_BATCHED_TOKENS: u64 = 8192;

/// The engine's flags (validated by `PlayConfig`).
#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// Where output token ids come from. Default: `random` under `play`, `text` under
    /// `serve`. Structured outputs and tool calls follow their grammar whatever this says.
    #[arg(long, value_enum)]
    pub tokens: Option<TokenMode>,

    /// Seed for random tokens (same seed and same requests give the same tokens).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// What --time-to-first-token means: `step` (prefill cost inside the engine's steps, as
    /// a real engine spends it: TTFT grows with load) or `fixed` (a request is admitted that
    /// long after its arrival and its prefill costs nothing, so its first token comes after
    /// the knob plus at most the step in flight and the step that samples it; prefills never
    /// stretch steps and TTFT does not grow with concurrency, close to what
    /// llm-d-inference-sim's TTFT knob means).
    #[arg(long, value_enum, default_value_t = TtftMode::Step)]
    pub ttft_mode: TtftMode,

    /// The model the frontend serves: a directory with its tokenizer.json (or the file).
    /// `--tokens text`, structured outputs and tool calls are written in its tokens.
    /// Default: the tiny model embedded in this binary (what `serve` serves by default).
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,

    /// What kind of model the engine is (vLLM's --runner): `generate`, or `pooling` for an
    /// embedding model whose requests get a vector of --embedding-dim (start the Python
    /// frontend with `--runner pooling` too; `serve --runner pooling` does).
    #[arg(long, value_enum, default_value_t = Runner::Generate)]
    pub runner: Runner,

    /// With --runner pooling: the length of the embeddings (the model's hidden size; the
    /// embedded tiny model's is 64). A request's `dimensions` truncates it.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub embedding_dim: u32,

    /// Under `tool_choice: auto`, the share of requests whose prompt shows tools (a
    /// `<tools>` block, as hermes-style chat templates render them) that are answered with
    /// a call to one of them (in the --tool-call-format), with arguments valid for its schema; the others get
    /// text. A request whose last message is a tool result is always answered with text.
    #[arg(long, default_value_t = 0.5)]
    pub tool_call_rate: f64,

    /// How a tool call under `tool_choice: auto` is written: in the format the frontend's
    /// `--tool-call-parser` of this name reads (`serve` starts the frontend with it, or,
    /// given only a `--tool-call-parser` after `--`, writes that parser's format). Default:
    /// hermes. llama3_json, mistral, deepseek_v3, deepseek_v31, jamba and lfm2 need a model
    /// whose tokenizer has their markers as tokens (`serve --model DIR`): their parsers
    /// refuse the embedded one.
    #[arg(long, value_enum, value_name = "PARSER")]
    pub tool_call_format: Option<ToolCallFormat>,

    /// Free-text answers open with a thinking block in the format the frontend's
    /// `--reasoning-parser` of this name reads, so clients get it as `reasoning`
    /// (`reasoning_content` on older lines; `serve` starts the frontend with that parser,
    /// or, given only a `--reasoning-parser` after `--`, writes that parser's format).
    /// Default: none. deepseek_r1, ernie45, step3 and mistral, and any behind vllm-rs, need
    /// a model whose tokenizer has their tags (`<think>`, `</think>`, `[THINK]`, …) as
    /// single tokens (`serve --model DIR`).
    #[arg(long, value_enum, value_name = "PARSER")]
    pub reasoning_format: Option<ReasoningFormat>,

    /// With a --reasoning-format, the share of each free-text answer's output tokens spent
    /// in its thinking block (tags included; of `max_tokens`, or of the natural length of
    /// an unbounded answer). Also sizes the think block a frontend's structural tag opens
    /// with (`tool_choice: required` behind a reasoning parser), at most half of
    /// `max_tokens` so the calls after it fit. Usage counts every token, thinking included.
    /// A request replayed with generated tokens (--replay-steps) whose record has a
    /// `reasoning_tokens` count (`record --reasoning-format`, or a converted client report)
    /// thinks for that many instead (between the tags, as the frontend's usage counts
    /// them; at most its recorded length).
    #[arg(long, default_value_t = 0.25, value_name = "F")]
    pub reasoning_share: f64,

    /// The mean length, in tokens, of an answer the client did not bound: a request whose
    /// `max_tokens` reaches the end of the context (the client gave none, so the frontend
    /// filled in what is left) ends with EOS (`stop`) after a length drawn per request
    /// (exponential with this mean, seeded like its tokens), as a model ends its answer,
    /// instead of running to the context length. Random and `--tokens text` answers only
    /// (structures, echoes and recordings end by themselves); never under `ignore_eos` or
    /// before `min_tokens`. 0: such requests run to the end of the context.
    #[arg(long, default_value_t = 256)]
    pub natural_output_len: u64,

    /// Random token ids are drawn from [--min-token-id, vocab-size). Only ids the
    /// frontend's tokenizer knows may be emitted; the default fits the embedded tiny model
    /// (259 tokens).
    #[arg(long, default_value_t = 259, value_parser = clap::value_parser!(u32).range(1..))]
    pub vocab_size: u32,

    /// Lowest random token id (ids below it are often special tokens).
    #[arg(long, default_value_t = 3)]
    pub min_token_id: u32,

    /// Mean time to first token in milliseconds. Under `--ttft-mode step` (the default) it
    /// is what prefilling a request's whole uncached prompt adds to a step (split over its
    /// chunks), as an engine spends it: a new request also waits for the step in flight,
    /// and its prefill stretches the step the running requests decode in, so the TTFT
    /// measured under load is larger than the knob (see docs/play.md for a measured table).
    /// Under `--ttft-mode fixed` it is a per-request delay to the first token. 0 = instant.
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

    /// Prefill/decode role (vLLM's NixlConnector, pull mode): `prefill` keeps the KV of
    /// `do_remote_decode` requests for a decode engine and returns where it is in
    /// `kv_transfer_params`; `decode` pulls the KV of `do_remote_prefill` requests from
    /// their prefill engine before decoding; `both` does either (as a single engine).
    #[arg(long, value_enum, default_value_t = PdRole::Both)]
    pub pd_role: PdRole,

    /// This engine's id in `kv_transfer_params` (vLLM's kv_transfer_config.engine_id).
    /// Default: a fresh one per process.
    #[arg(long)]
    pub engine_id: Option<String>,

    /// The host decode engines reach this engine's side channel at (vLLM's
    /// VLLM_NIXL_SIDE_CHANNEL_HOST).
    #[arg(long, default_value = "127.0.0.1")]
    pub side_channel_host: String,

    /// The side-channel port of DP rank 0; rank r listens on this + r (vLLM's
    /// VLLM_NIXL_SIDE_CHANNEL_PORT). A prefill engine listens there.
    #[arg(long, default_value_t = 5600)]
    pub side_channel_port: u16,

    /// Seconds a prefill engine keeps a finished request's KV for its decode engine before
    /// freeing it unread (vLLM's kv_lease_duration); at most a day.
    #[arg(long, default_value_t = 30.0, value_parser = crate::flag_ranges::seconds)]
    pub kv_lease_duration: f64,

    /// What a decode engine does when a KV pull fails (vLLM's kv_load_failure_policy):
    /// `fail` the request with `error`, or `recompute` the prompt locally.
    #[arg(long, value_enum, default_value_t = LoadFailurePolicy::Fail)]
    pub kv_load_failure_policy: LoadFailurePolicy,

    /// Bytes per KV block in the pool a `--pd-role prefill|decode` engine registers with
    /// NIXL (builds with the `nixl` feature): the prefill engine writes that many bytes
    /// per block, the decode engine reads and checks them. The pool holds
    /// --num-gpu-blocks blocks (at most 16 GiB).
    #[arg(long, default_value_t = 4096, value_parser = parse_block_bytes)]
    pub kv_block_bytes: u64,

    /// Lay the NIXL pool out as the KV cache of the vLLM engine this engine pairs with
    /// (`nixl` builds), so that engine handshakes without `enforce_handshake_compat:
    /// false`: a JSON object (or `@FILE`) with `vllm_version`, `model` (as the peer was
    /// given it), `dtype`, `num_hidden_layers`, `num_kv_heads`, `head_size`, optionally
    /// `block_size` (128; --block-size must match), `attn_backend_name` (CPU_ATTN),
    /// `kv_cache_layout` (LBHNC), `cache_dtype` (auto), `is_hma_enabled` (true),
    /// `nixl_connector_version` (14), `layer_name` (model.layers.{}.self_attn.attn).
    /// Replaces --kv-block-bytes. See docs/pd.md.
    #[arg(long, value_parser = crate::play::pd::layout::parse)]
    pub kv_peer_layout: Option<crate::play::pd::layout::KvLayout>,

    /// Slow-down factor at full load (running = --max-num-seqs), linear in between; 1 = none
    /// (at most 1000).
    #[arg(long, default_value_t = 1.0, value_parser = crate::flag_ranges::time_factor)]
    pub time_factor_under_load: f64,

    /// Divide every duration by this (100 = a hundred times faster than configured; from
    /// 0.001 to 1000000).
    #[arg(long, default_value_t = 1.0, value_parser = crate::flag_ranges::time_scale)]
    pub time_scale: f64,

    /// A fitted model's steps with prefill work take this many times as long as its law
    /// says (`calibrate --match-host-speed` sets it from the capture's own steps; not a
    /// flag).
    #[arg(skip)]
    pub prefill_speed: Option<f64>,

    /// Tokens per request per output message (vLLM emits one per step; more models
    /// speculative or multi-token steps).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub output_token_chunk_size: u32,

    /// Maximum number of requests in the running batch; the rest wait [default: 256;
    /// `inspect simulate`/`calibrate`: the capture's, from its engine's ready response].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_num_seqs: Option<u64>,

    /// Token budget of one step: decodes take one token each, prefill chunks the rest
    /// [default: 8192; `inspect simulate`/`calibrate`: the capture's].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_num_batched_tokens: Option<u64>,

    /// Largest prefill chunk of one request when several compete for a step (0 = no cap).
    #[arg(long, default_value_t = 0)]
    pub long_prefill_token_threshold: u64,

    /// Chunked prefill on (vLLM's --enable-chunked-prefill; the default). The later of
    /// this and --no-enable-chunked-prefill wins, as in vLLM.
    #[arg(long, overrides_with = "no_enable_chunked_prefill")]
    pub enable_chunked_prefill: bool,

    /// Prefill a prompt only when it fits one step's budget whole (vLLM's
    /// --no-enable-chunked-prefill).
    #[arg(long, overrides_with = "enable_chunked_prefill")]
    pub no_enable_chunked_prefill: bool,

    /// The prefix cache on (vLLM's --enable-prefix-caching; the default, and it keeps
    /// `inspect simulate`/`calibrate` from turning it off for a capture that shows none).
    /// The later of this and --no-enable-prefix-caching wins, as in vLLM.
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,

    /// Turn the prefix cache off (vLLM's --no-enable-prefix-caching).
    #[arg(long, overrides_with = "enable_prefix_caching")]
    pub no_enable_prefix_caching: bool,

    /// Model context length: requests stop with `length` when prompt plus output reach it.
    /// `vllm-rs` takes the length from the engine's ready response, so it accepts prompts up
    /// to this whatever its model says; the Python frontend applies its own model's limit
    /// (`serve` writes its model with this length, so both agree). Capped at what the
    /// KV cache holds ((--num-gpu-blocks − 1) × --block-size), with a warning: one request
    /// of this length must fit, or it would wait forever (vLLM refuses to start instead).
    #[arg(long, default_value_t = 32768, value_parser = clap::value_parser!(u64).range(2..))]
    pub max_model_len: u64,

    /// Tokens per KV-cache block [default: 16; `inspect simulate`: the trace's block
    /// size].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub block_size: Option<u64>,

    /// KV-cache blocks (advertised to the frontend): admission needs free blocks, and a
    /// running request that cannot grow preempts the newest one, as in vLLM.
    #[arg(long, default_value_t = 65536, value_parser = clap::value_parser!(u64).range(2..))]
    pub num_gpu_blocks: u64,

    /// KV-cache capacity in tokens instead of blocks (sets --num-gpu-blocks to hold this
    /// many tokens, plus vLLM's reserved null block).
    #[arg(long, conflicts_with = "num_gpu_blocks", value_parser = clap::value_parser!(u64).range(1..))]
    pub kv_cache_size: Option<u64>,

    /// Blocks of host memory behind the prefix cache, as vLLM's OffloadingConnector with
    /// its CPU backend keeps them (0 = no tier; docs/offload.md). Every full block a step computes
    /// is stored there too; a new request loads the run of its blocks found there after
    /// its device-cache hit and counts them as cached (external) tokens. Needs the prefix
    /// cache. KV events report the tier's stores and evictions with medium `CPU`.
    #[arg(long, default_value_t = 0, help_heading = "KV offload tier")]
    pub kv_offload_blocks: u64,

    /// Which idle block the offload tier evicts when it is full: `lru` or `arc` (vLLM's
    /// `eviction_policy`).
    #[arg(long, value_enum, default_value_t = OffloadPolicy::Lru, help_heading = "KV offload tier")]
    pub kv_offload_policy: OffloadPolicy,

    /// Microseconds loading one block from the offload tier adds to the step that admits
    /// its request (default: a 2 MiB block, 16 tokens of an 8B model, over ~40 GB/s).
    /// Stores cost no step time: vLLM overlaps them with compute.
    #[arg(
        long,
        default_value_t = 50.0,
        value_name = "US",
        help_heading = "KV offload tier"
    )]
    pub kv_offload_load_us: f64,

    /// Also send the tier's transfers (bytes and sizes of loads and stores, load time,
    /// allocation failures; blocks of --kv-block-bytes) as vLLM's offloading connector
    /// does, in the stats' `kv_connector_stats`, which a frontend shows as
    /// `vllm:kv_offload_*`. Only for a frontend started with a `--kv-transfer-config`
    /// naming the OffloadingConnector (vLLM's Python server): without it, that frontend
    /// fails every request; vllm-rs ignores them.
    #[arg(long, requires = "kv_offload_blocks", help_heading = "KV offload tier")]
    pub kv_offload_connector_stats: bool,

    /// Report a `--pd-role decode` engine's NIXL reads (duration, bytes, descriptors, failed
    /// reads) as vLLM's NixlConnector does, in the stats' `kv_connector_stats`, which a
    /// frontend shows as `vllm:nixl_*`. Only for a frontend started with a
    /// `--kv-transfer-config` naming the NixlConnector (vLLM's Python server): without it,
    /// that frontend fails every request; vllm-rs ignores them. Reads move bytes only in
    /// `nixl` builds.
    #[arg(long, conflicts_with = "kv_offload_connector_stats")]
    pub nixl_connector_stats: bool,

    /// Waiting-queue order.
    #[arg(long, value_enum, default_value_t = SchedulingPolicy::Fcfs)]
    pub scheduling_policy: SchedulingPolicy,

    /// Distinct LoRA adapters allowed in the running batch (advertised as max_loras;
    /// 0 = no cap).
    #[arg(long, default_value_t = 0)]
    pub max_loras: u32,

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

    /// Pace steps with a latency model fitted to captured traces (`record --trace-out`,
    /// `.gz` too), or loaded from a model file written by `inspect fit`. Not together
    /// with the TTFT / ITL / prefill knobs; composes with --time-scale.
    #[arg(long, num_args = 1.., value_name = "PATH")]
    pub latency_trace: Vec<PathBuf>,

    /// The step-stats sidecars (`record --step-stats-out`) of the --latency-trace traces,
    /// in the same order: they give the fit every step, not only those that emitted.
    #[arg(long, num_args = 1.., value_name = "PATH", requires = "latency_trace")]
    pub latency_steps: Vec<PathBuf>,

    /// Serve recorded output token ids from this trace (captured with
    /// `record --record-tokens`); --replay-match decides which record a request gets.
    #[arg(long, value_name = "TRACE")]
    pub replay_tokens: Option<PathBuf>,

    /// Replay each matched request's recorded chunk sizes at its recorded gaps (the
    /// first token after the recorded TTFT, unless --latency-trace models it). Without
    /// --replay-tokens the tokens are generated, and with a --reasoning-format a record's
    /// `reasoning_tokens` sets how long its answer thinks.
    #[arg(long, value_name = "TRACE")]
    pub replay_steps: Option<PathBuf>,

    /// How requests find their record: `index` (the `replay-<i>` in the request id picks
    /// the i-th record by arrival) or `prefix` (the prompt's block hashes against the
    /// records': the longest shared prefix).
    #[arg(long, value_enum, default_value_t = MatchMode::Index)]
    pub replay_match: MatchMode,

    /// What a request without a record gets: `random` tokens (logged and counted) or
    /// `fail` (it finishes with an error saying why).
    #[arg(long, value_enum, default_value_t = MissPolicy::Random)]
    pub replay_miss: MissPolicy,

    /// Pair --replay-tokens and --replay-steps files of different captures anyway
    /// (different config_hash, block size, record count or request ids): start with a
    /// warning instead of refusing.
    #[arg(long)]
    pub replay_allow_mismatch: bool,

    /// Refuse to start unless every trace given to --latency-trace, --replay-tokens and
    /// --replay-steps carries this `config_hash` in its meta (a capture of another engine
    /// configuration is another engine).
    #[arg(long, value_name = "HEX")]
    pub expect_config_hash: Option<String>,
}

/// A latency knob in ms: from 0 to a day (a larger one used to panic the engine when a
/// step was timed).
fn parse_ms(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of milliseconds"))?;
    let max = sim_trace::latency::MAX_DURATION_MS;
    if !v.is_finite() || v < 0.0 {
        return Err(format!("milliseconds must be ≥ 0, got {s}"));
    }
    if v > max {
        return Err(format!(
            "{s} is out of range: milliseconds must be between 0 and {max} (a day)"
        ));
    }
    Ok(v)
}

impl EngineArgs {
    /// Default arguments (as if no flag was given).
    pub fn defaults() -> Self {
        #[derive(clap::Parser)]
        struct Wrap {
            #[command(flatten)]
            engine: EngineArgs,
        }
        <Wrap as clap::Parser>::parse_from(["engine"]).engine
    }

    /// Whether a latency model paces the steps (`--latency-trace`: a fitted model, or
    /// captures to fit) instead of the knobs.
    pub fn uses_latency_model(&self) -> bool {
        !self.latency_trace.is_empty()
    }

    /// Tokens per KV-cache block: `--block-size`, else [`DEFAULT_BLOCK_SIZE`].
    pub fn block_size_or_default(&self) -> u64 {
        self.block_size.unwrap_or(DEFAULT_BLOCK_SIZE)
    }

    /// The running-batch cap: `--max-num-seqs`, else [`DEFAULT_MAX_NUM_SEQS`].
    pub fn max_num_seqs_or_default(&self) -> u64 {
        self.max_num_seqs.unwrap_or(DEFAULT_MAX_NUM_SEQS)
    }

    /// The step's token budget: `--max-num-batched-tokens`, else
    /// [`DEFAULT_MAX_NUM_BATCHED_TOKENS`].
    pub fn max_num_batched_tokens_or_default(&self) -> u64 {
        self.max_num_batched_tokens
            .unwrap_or(DEFAULT_MAX_NUM_BATCHED_TOKENS)
    }

    /// The latency knobs as flags set them (validated by `PlayConfig::try_from`).
    pub fn knobs(&self) -> sim_trace::latency::Knobs {
        // a fixed TTFT is a per-request delay, not a cost of the steps
        let step_ttft = self.ttft_mode == TtftMode::Step;
        sim_trace::latency::Knobs {
            ttft_ms: if step_ttft {
                self.time_to_first_token
            } else {
                0.0
            },
            ttft_std_ms: if step_ttft {
                self.time_to_first_token_std_dev
            } else {
                0.0
            },
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

/// `--kv-block-bytes`: a positive multiple of 8 up to 64 MiB.
fn parse_block_bytes(s: &str) -> Result<u64, String> {
    let n: u64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number of bytes"))?;
    if n == 0 || !n.is_multiple_of(8) || n > 64 << 20 {
        return Err(format!(
            "{n} bytes: a KV block is a positive multiple of 8 bytes, at most 64 MiB"
        ));
    }
    Ok(n)
}
