//! `play`'s command line: the flags of the sockets, the handshake and the process around
//! the engine, with the engine's own flags ([`EngineArgs`]) flattened in. Parsed by clap
//! and nothing more: [`PlayConfig`](super::config::PlayConfig) checks them and derives
//! the values the engine runs with.

use clap::Args;
use sim_protocol::VllmLine;

use super::engine_args::EngineArgs;

/// The vLLM line this build speaks by default (stamped from compat.toml by build.rs).
pub const DEFAULT_LINE: &str = env!("VLLM_VCR_DEFAULT_LINE");

/// Where `play` finds the frontend's handshake socket by default (vLLM's default RPC port).
pub const DEFAULT_HANDSHAKE_ADDRESS: &str = "tcp://127.0.0.1:29550";

/// `play`'s flags: the engine's ([`EngineArgs`], also reachable as `args.<flag>` through
/// `Deref`) and those of the sockets, the handshake and the process around it.
#[derive(Debug, Clone, Args)]
pub struct PlayArgs {
    /// The frontend's engine handshake socket (vLLM's --data-parallel-address and
    /// --data-parallel-rpc-port; vllm-rs --handshake-host/--handshake-port). `serve` sets
    /// it from its --handshake-port (an address given here must be tcp://127.0.0.1:PORT).
    #[arg(
        long,
        default_value = DEFAULT_HANDSHAKE_ADDRESS,
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
    /// (the engine may start before the frontend, as in a pod); at most a day.
    #[arg(long, default_value_t = 600.0, value_parser = crate::flag_ranges::seconds)]
    pub handshake_timeout: f64,

    /// The engine's own flags (shared with `inspect simulate`).
    #[command(flatten)]
    pub engine: EngineArgs,

    /// Advertise an engine without LoRA support (vllm-rs --lora-modules then refuses to
    /// start, as with a real engine started without --enable-lora).
    #[arg(long)]
    pub disable_lora: bool,

    /// dtype advertised in the ready response.
    #[arg(long, default_value = "bfloat16", value_parser = ["float16", "bfloat16", "float32"])]
    pub dtype: String,

    /// Publish KV-cache events (BlockStored / BlockRemoved / AllBlocksCleared) as vLLM
    /// does: a JSON object with vLLM's keys, e.g.
    /// '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557"}'.
    /// The resolved config is advertised to the frontend in the ready response.
    #[arg(long)]
    pub kv_events_config: Option<String>,

    /// Write the replay counts (served, matched by depth, missed by reason) as JSON to
    /// this file when the engine stops.
    #[arg(long, value_name = "PATH")]
    pub replay_summary: Option<std::path::PathBuf>,

    /// Log every request's arrival, finish and abort.
    #[arg(long)]
    pub log_requests: bool,

    /// Make no scheduler stats and no request events, as vLLM's engine started with
    /// `--disable-log-stats`: outputs carry no `scheduler_stats` (the frontend's engine
    /// gauges and prefix-cache counters stay empty) and no queued/scheduled/preempted
    /// timestamps. Saves the engine the per-step stats. Under `serve` this flag, or
    /// `--disable-log-stats` given to the frontend after `--`, turns stats off on both
    /// sides, as `vllm serve --disable-log-stats` does.
    #[arg(long)]
    pub disable_log_stats: bool,

    /// Seconds to keep serving admitted requests after SIGINT/SIGTERM before aborting the
    /// rest (vLLM's --shutdown-timeout; 0 aborts at once). Under `serve` the frontend
    /// drains instead (vllm-rs gets the same --shutdown-timeout) while the engine serves it.
    /// At most a day.
    #[arg(long, default_value_t = 0.0, value_parser = crate::flag_ranges::seconds_or_zero)]
    pub shutdown_timeout: f64,

    /// Largest request payload frame accepted, MiB (the msgpack frame; tensor aux frames
    /// are not counted). A larger one is refused undecoded with a clear error, and a
    /// prompt with more ids than --max-model-len is refused before its ids are read, so a
    /// hostile frame cannot make the engine allocate gigabytes. A whole input message
    /// (its frames together, aux tensors included) past twice this plus 1 MiB is not read
    /// at all: the engine logs it and closes that input socket (with one frontend client,
    /// it stops), as an engine whose peer broke the protocol.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub max_frame_size: u64,
}

fn parse_line(s: &str) -> Result<VllmLine, String> {
    VllmLine::parse(s).map_err(|e| e.to_string())
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
}

impl std::ops::Deref for PlayArgs {
    type Target = EngineArgs;

    fn deref(&self) -> &EngineArgs {
        &self.engine
    }
}

impl std::ops::DerefMut for PlayArgs {
    fn deref_mut(&mut self) -> &mut EngineArgs {
        &mut self.engine
    }
}
