//! `vllm-vcr record`: a transparent tap between a real vLLM frontend and a real
//! engine-core that relays every frame and writes a trace of what it saw.
//!
//! Two halves: the relay ([`relay`], speaking ZMTP itself on the data plane through
//! [`sim_protocol::zmtp`]) owns the connections and forwards frames unchanged on a runtime of its own;
//! the observer ([`observe`]) decodes copies on its own low-priority thread and writes the
//! trace, so observation can never delay the relay. The supervisor
//! here ends the capture on SIGINT/SIGTERM, when the engine dies (`ENGINE_CORE_DEAD`, or
//! its connection closes) or when the frontend goes away, and always closes the trace
//! cleanly: finished requests are kept, in-flight ones are written as incomplete, and a
//! `.gz` trace gets its footer.

pub mod handoff;
pub mod observe;
pub mod relay;

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use sim_trace::config_hash::ConfigFingerprint;
use sim_trace::host::{HostCpu, parse_cpuinfo};
use tokio::sync::{mpsc, watch};

use crate::play::content::reasoning_count::ThinkingMarkers;
use handoff::Seen;
use observe::{MetaOverrides, Observer, ObserverConfig, Summary};
use relay::{Event, RelayConfig};

/// Sit between a real vLLM frontend and a real engine-core, relay every frame unchanged,
/// and write a JSONL trace of every request (and optionally of every engine step).
#[derive(Debug, Clone, Args)]
#[command(after_long_help = RECORD_EXAMPLE)]
pub struct RecordArgs {
    /// The frontend's handshake address. The tap joins it as an engine would, so start the
    /// frontend in external-engine mode on this address (vllm-rs `--handshake-host/-port`;
    /// `vllm serve --data-parallel-size-local 0 --data-parallel-address/-rpc-port`).
    /// The tap keeps trying until the frontend is there: either side may start first.
    #[arg(long, value_name = "tcp://HOST:PORT")]
    pub frontend_handshake: String,

    /// The address the tap binds for the engine's handshake. Point the engine at it as if
    /// it were the frontend (`vllm serve --headless --data-parallel-address HOST
    /// --data-parallel-rpc-port PORT`, or `vllm-vcr play --handshake-address`). Data
    /// sockets are bound on the same host, on ephemeral ports.
    #[arg(long, value_name = "tcp://HOST:PORT")]
    pub engine_handshake: String,

    /// Write the trace here: a meta line, then one JSON record per request. Gzip when the
    /// name ends in `.gz`. Records are flushed at least every half second.
    #[arg(long, value_name = "PATH")]
    pub trace_out: PathBuf,

    /// Also record each request's output token ids (`output_token_ids`), so `play` can
    /// replay the engine's exact output. The trace then holds model output: treat it
    /// like the prompts it answers.
    #[arg(long)]
    pub record_tokens: bool,

    /// Count each answer's thinking (its record's `reasoning_tokens`): the tokens between
    /// the markers of this `--reasoning-format` (the names of `play`'s flag), as a
    /// frontend's usage counts them, found in the output ids through `--tokenizer`.
    /// `play --replay-steps` then makes each replayed answer think that long. Default: not
    /// counted.
    #[arg(long, value_enum, value_name = "FORMAT")]
    pub reasoning_format: Option<crate::play::content::reasoning::ReasoningFormat>,

    /// The model the engine serves, for `--reasoning-format`: a directory with its
    /// tokenizer.json (or the file). Default: the tiny model embedded in this binary (what
    /// `play` and `serve` serve by default).
    #[arg(long, value_name = "DIR", requires = "reasoning_format")]
    pub tokenizer: Option<PathBuf>,

    /// Also write one JSON line per engine step with the `SchedulerStats` the engine
    /// reported (running/waiting, KV usage, prefix-cache and spec-decode counters), on the
    /// trace's clock (`ts_ms`). Gzip when the name ends in `.gz`.
    #[arg(long, value_name = "PATH")]
    pub step_stats_out: Option<PathBuf>,

    /// Overwrite `--trace-out` / `--step-stats-out` if they exist (default: refuse, so a
    /// capture is never lost to a repeated command).
    #[arg(long)]
    pub force: bool,

    /// Model name for the trace meta (the wire does not carry it).
    #[arg(long, value_name = "NAME")]
    pub model: Option<String>,

    /// Accelerator label for the trace meta and the config hash (e.g. `H200`). For an
    /// engine that computes on the CPU (vLLM's CPU backend) pass `cpu`: the hardware is
    /// then the host CPU, which `--host-cpu` identifies.
    #[arg(long, value_name = "GPU")]
    pub gpu: Option<String>,

    /// Which host CPU to stamp into the meta (`host_cpu`: model name, vendor family/model,
    /// vector flags such as avx2/avx512_bf16/amx_bf16, logical CPU count) and into the
    /// config hash (a capture from another CPU is another configuration). `auto`: this
    /// host's /proc/cpuinfo (nothing where there is none); `none`: record no CPU (e.g. the
    /// engine runs on another host whose CPU you do not know); a file path: a copy of the
    /// engine host's /proc/cpuinfo, for an engine on another host.
    #[arg(long, value_name = "auto|none|CPUINFO", default_value = "auto")]
    pub host_cpu: String,

    /// A note for the meta's `notes` map, `KEY=VALUE` (repeatable): how the capture was
    /// made, e.g. `--note rig="tcmalloc preloaded; engine pinned to CPU 1"`. Not hashed.
    #[arg(long, value_name = "KEY=VALUE")]
    pub note: Vec<String>,

    /// Tensor-parallel size for the meta (default: what the engine's ready response says).
    #[arg(long, value_name = "N")]
    pub tp: Option<u32>,

    /// KV block size in tokens, the unit of the records' `block_hashes` (default: the
    /// engine's, from its ready response).
    #[arg(long, value_name = "TOKENS")]
    pub block_size: Option<u32>,

    /// `--max-num-seqs` of the engine for the meta (default: from the ready response).
    #[arg(long, value_name = "N")]
    pub max_num_seqs: Option<u32>,

    /// The vLLM line tag the engine runs (e.g. `v0.32.0`), an input of the config hash.
    /// The engine's own version string is stamped separately as `vllm_version`.
    #[arg(long, value_name = "TAG")]
    pub vllm_version: Option<String>,

    /// The canonical engine-config string (the deployed behavioural engine flags), an
    /// input of the config hash. With `--gpu` and `--vllm-version` the tap computes
    /// `config_hash` (sha256, scheme `config-fingerprint-v4`, with the `--host-cpu`
    /// identity) and stamps it in the meta.
    #[arg(long, value_name = "CANONICAL")]
    pub engine_config: Option<String>,

    /// Stamp this `config_hash` instead of computing one.
    #[arg(long, value_name = "HEX")]
    pub config_hash: Option<String>,

    /// Host to advertise to engines for the tap's data sockets (default: the
    /// `--engine-handshake` host, or 127.0.0.1 when that is a wildcard such as 0.0.0.0).
    #[arg(long, value_name = "HOST")]
    pub advertise_host: Option<String>,

    /// Give engines Unix-domain (`ipc://`) data sockets in DIR instead of TCP ones, for an
    /// engine on this host that sees DIR (the same filesystem, not only the same network):
    /// a relayed message costs less than over loopback TCP. Without it the tap does so only
    /// when the frontend's own data sockets are `ipc://` (beside them).
    #[arg(long, value_name = "DIR", conflicts_with = "advertise_host")]
    pub engine_ipc_dir: Option<PathBuf>,

    /// Seconds to keep trying to reach the frontend's sockets (at most a day).
    #[arg(long, value_name = "SECONDS", default_value_t = 600.0, value_parser = crate::flag_ranges::seconds)]
    pub connect_timeout: f64,

    /// Largest data-plane message the tap buffers and decodes for the trace, MiB. A larger
    /// one from the frontend is still relayed unchanged, streamed through without being
    /// buffered or decoded (counted as undecodable); an engine-side connection sending a
    /// larger one is dropped before any of it is relayed (engines' outputs share one
    /// stream to the frontend, which a half-relayed message would corrupt). Either way a
    /// hostile frame cannot make the tap allocate gigabytes.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub max_frame_size: u64,

    /// How far the trace's observer may fall behind the relay, MiB of relayed messages
    /// not yet decoded. The observer decodes off the relay's path and normally keeps up
    /// (a GPU engine sends a few hundred messages a second; it decodes tens of thousands);
    /// an engine that outruns it for long, such as a simulated one with no latency, would
    /// otherwise grow the tap's memory without end. Past this the tap reads nothing more
    /// from the frontend or the engines until the observer is back within it: the engine
    /// is slowed to the observer's pace, as by a slow frontend, and nothing is dropped. The end-of-capture line says
    /// how long the relay waited.
    #[arg(long, value_name = "MIB", default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    pub max_observer_backlog: u64,
}

const RECORD_EXAMPLE: &str = "\
Example (the frontend, the tap and the engine may start in any order):
  vllm-rs serve MODEL_DIR --handshake-host 127.0.0.1 --handshake-port 29550 ...
  vllm-vcr record --frontend-handshake tcp://127.0.0.1:29550 \\
      --engine-handshake tcp://127.0.0.1:29551 --trace-out trace.jsonl.gz \\
      --step-stats-out steps.jsonl.gz --model my-model --gpu H200
  vllm serve MODEL_DIR --headless --data-parallel-size 1 --data-parallel-size-local 1 \\
      --data-parallel-address 127.0.0.1 --data-parallel-rpc-port 29551 ...

On the wire the tap changes exactly one thing: the input/output addresses in INIT, so the
engine connects its data sockets to the tap. Every other frame is relayed byte for byte.";

impl RecordArgs {
    /// The host CPU to stamp (`--host-cpu`).
    fn resolve_host_cpu(&self) -> Result<Option<HostCpu>> {
        match self.host_cpu.as_str() {
            "none" => Ok(None),
            "auto" => {
                let cpu = HostCpu::detect();
                if cpu.is_none() {
                    tracing::info!("no /proc/cpuinfo here: the trace records no host CPU");
                }
                Ok(cpu)
            }
            path => {
                // bounded like a trace line: a cpuinfo copy is a few KB
                let raw = sim_trace::trace::read_capped(
                    std::path::Path::new(path),
                    sim_trace::trace::max_line_bytes(),
                )
                .with_context(|| format!("--host-cpu: reading {path}"))?;
                let text = String::from_utf8_lossy(&raw);
                match parse_cpuinfo(&text) {
                    Some(cpu) => Ok(Some(cpu)),
                    None => bail!(
                        "--host-cpu: {path} names no CPU (expected a copy of a /proc/cpuinfo; \
                         or pass auto or none)"
                    ),
                }
            }
        }
    }

    /// What `--reasoning-format` counts each answer's thinking by, in `--tokenizer`'s
    /// tokens.
    fn resolve_thinking(&self) -> Result<Option<Arc<ThinkingMarkers>>> {
        use crate::play::content::vocab::{Vocabulary, model_dir_of};
        let Some(format) = self.reasoning_format else {
            return Ok(None);
        };
        let vocab = match &self.tokenizer {
            Some(dir) => Arc::new(Vocabulary::load(&model_dir_of(dir))?),
            None => Vocabulary::embedded(),
        };
        Ok(ThinkingMarkers::new(format, vocab).map(Arc::new))
    }

    /// The `--note KEY=VALUE` pairs.
    fn resolve_notes(&self) -> Result<BTreeMap<String, String>> {
        self.note
            .iter()
            .map(|n| match n.split_once('=') {
                Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.to_string())),
                _ => bail!("--note {n:?}: expected KEY=VALUE"),
            })
            .collect()
    }

    /// The config hash to stamp: given, computed, or none.
    fn resolve_config_hash(&self, host_cpu: Option<&HostCpu>) -> Result<Option<String>> {
        if let Some(h) = &self.config_hash {
            return Ok(Some(h.clone()));
        }
        match (&self.gpu, &self.vllm_version, &self.engine_config) {
            (Some(gpu), Some(tag), Some(cfg)) => Ok(Some(
                ConfigFingerprint::new(gpu, tag, cfg)
                    .with_host_cpu(host_cpu)
                    .hash(),
            )),
            (_, None, None) => Ok(None),
            _ => bail!(
                "computing config_hash needs all of --gpu, --vllm-version and --engine-config \
                 (or pass --config-hash)"
            ),
        }
    }

    fn check_outputs(&self) -> Result<()> {
        // one file by any name (`x.jsonl` and `./x.jsonl`, a link): refused even with
        // --force, as each writer would destroy the other's lines
        let mut named = vec![crate::io_guard::named("--trace-out", &self.trace_out)];
        named.extend(
            self.step_stats_out
                .iter()
                .map(|s| crate::io_guard::named("--step-stats-out", s)),
        );
        let host_cpu = std::path::Path::new(&self.host_cpu);
        let inputs = match self.host_cpu.as_str() {
            "auto" | "none" => Vec::new(),
            _ => vec![crate::io_guard::named("--host-cpu", host_cpu)],
        };
        crate::io_guard::check_outputs(&inputs, &named)?;
        let mut outs = vec![&self.trace_out];
        outs.extend(self.step_stats_out.iter());
        for p in outs {
            if p.is_dir() {
                bail!("{} is a directory", p.display());
            }
            if !self.force && std::fs::metadata(p).is_ok_and(|m| m.len() > 0) {
                bail!(
                    "{} already exists; choose another name or pass --force to overwrite it",
                    p.display()
                );
            }
        }
        Ok(())
    }
}

/// Why the capture ended.
enum Outcome {
    Signal,
    FrontendGone(String),
    EngineGone,
    EngineDead,
    Failed(anyhow::Error),
}

impl Outcome {
    /// The `abort_reason` of requests still in flight.
    fn reason(&self) -> String {
        match self {
            Outcome::Signal => "capture stopped".into(),
            Outcome::FrontendGone(_) => "frontend disconnected".into(),
            Outcome::EngineGone => "engine disconnected".into(),
            Outcome::EngineDead => "engine core dead".into(),
            Outcome::Failed(_) => "tap failed".into(),
        }
    }
}

/// Run the tap until a signal, or until either side goes away.
pub async fn run(args: RecordArgs, mut shutdown: watch::Receiver<bool>) -> Result<()> {
    let host_cpu = args.resolve_host_cpu()?;
    let notes = args.resolve_notes()?;
    let config_hash = args.resolve_config_hash(host_cpu.as_ref())?;
    let thinking = args.resolve_thinking()?;
    args.check_outputs()?;
    if let Some(cpu) = &host_cpu {
        tracing::info!("host CPU: {}", cpu.describe());
    }
    let observer = Observer::create(ObserverConfig {
        trace_out: args.trace_out.clone(),
        step_stats_out: args.step_stats_out.clone(),
        record_tokens: args.record_tokens,
        thinking,
        max_frame_bytes: usize::try_from(args.max_frame_size << 20).unwrap_or(usize::MAX),
        meta: MetaOverrides {
            model: args.model.clone(),
            gpu: args.gpu.clone(),
            tp: args.tp,
            block_size: args.block_size,
            max_num_seqs: args.max_num_seqs,
            config_hash,
            host_cpu,
            notes,
        },
    })?;
    let bound = usize::try_from(args.max_observer_backlog << 20).unwrap_or(usize::MAX);
    let (seen_tx, seen_rx) = handoff::channel(bound);
    let observer = std::thread::Builder::new()
        .name("record-observer".into())
        .spawn(move || {
            lower_this_threads_priority();
            observer.run(seen_rx)
        })
        .context("starting the observer thread")?;
    let (ev_tx, mut ev_rx) = mpsc::unbounded_channel::<Event>();
    let cfg = RelayConfig {
        frontend_handshake: args.frontend_handshake.clone(),
        engine_handshake: args.engine_handshake.clone(),
        advertise_host: args.advertise_host.clone(),
        engine_ipc_dir: args.engine_ipc_dir.clone(),
        connect_timeout: sim_trace::latency::secs_to_duration(args.connect_timeout.max(0.1)),
        max_message_bytes: args.max_frame_size << 20,
    };
    let outcome = match relay::start(cfg, seen_tx.clone(), ev_tx).await {
        Err(e) => Outcome::Failed(e),
        Ok(tap) => {
            tracing::info!(
                engine_handshake = %tap.engine_handshake(),
                frontend_handshake = %args.frontend_handshake,
                trace = %args.trace_out.display(),
                "record: waiting for the engine and the frontend"
            );
            let outcome = supervise(&mut ev_rx, &mut shutdown).await;
            if matches!(outcome, Outcome::EngineGone) {
                // the engine vanished without a word: say it for it, so the frontend
                // fails its requests instead of leaving its clients waiting
                tap.tell_frontend_engine_dead();
            }
            if matches!(outcome, Outcome::EngineDead | Outcome::EngineGone) {
                // Let the relayed ENGINE_CORE_DEAD reach the frontend before the sockets
                // close (the zeromq crate has no LINGER).
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            tap.stop();
            drop(tap);
            outcome
        }
    };
    seen_tx.send(Seen::Stop {
        reason: outcome.reason(),
    });
    let waited = seen_tx.waited();
    drop(seen_tx);
    let summary = observer
        .join()
        .map_err(|_| anyhow!("the observer thread panicked; the trace may be incomplete"))??;
    report(&args, &summary, waited);
    if let Some(e) = &summary.write_error {
        return Err(anyhow!(
            "{e}: {} request records could not be written ({} were)",
            summary.dropped,
            summary.records
        ));
    }
    match outcome {
        Outcome::Signal => Ok(()),
        Outcome::FrontendGone(what) => {
            tracing::info!("the frontend went away ({what}); capture ended");
            Ok(())
        }
        Outcome::EngineGone => Err(anyhow!(
            "the engine disconnected; the frontend was sent ENGINE_CORE_DEAD and the trace was closed with every finished request"
        )),
        Outcome::EngineDead => Err(anyhow!(
            "the engine sent ENGINE_CORE_DEAD (relayed to the frontend); the trace was closed"
        )),
        Outcome::Failed(e) => Err(e),
    }
}

/// Make the calling thread (the observer) yield the CPU to everything else of normal
/// priority, the relay first: on a busy host a burst of outputs then queues for the
/// observer (up to `--max-observer-backlog`) instead of the observer's decoding and gzip taking
/// CPU time from relaying. It still runs whenever a core is free, and never starves
/// outright (nice 19 is a small share, not SCHED_IDLE).
fn lower_this_threads_priority() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid has no preconditions; setpriority on our own thread id changes
        // only this thread's nice value (Linux threads are scheduled individually).
        let rc = unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            libc::setpriority(libc::PRIO_PROCESS, tid, 19)
        };
        if rc != 0 {
            tracing::debug!(
                "could not lower the observer's priority: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

async fn supervise(
    ev_rx: &mut mpsc::UnboundedReceiver<Event>,
    shutdown: &mut watch::Receiver<bool>,
) -> Outcome {
    let mut attached: HashSet<bytes::Bytes> = HashSet::new();
    loop {
        tokio::select! {
            _ = shutdown.wait_for(|v| *v) => return Outcome::Signal,
            ev = ev_rx.recv() => match ev {
                None => return Outcome::Failed(anyhow!("the relay stopped")),
                Some(Event::EngineReady(id)) => {
                    attached.insert(id.clone());
                    tracing::info!(engine = ?id.as_ref(), engines = attached.len(), "engine attached; relaying");
                }
                Some(Event::EngineGone(id)) => {
                    if attached.remove(&id) {
                        tracing::warn!(engine = ?id.as_ref(), "the engine disconnected");
                        if attached.is_empty() {
                            return Outcome::EngineGone;
                        }
                    }
                }
                Some(Event::FrontendGone(what)) => {
                    if !attached.is_empty() {
                        return Outcome::FrontendGone(what);
                    }
                }
                Some(Event::EngineDead) => return Outcome::EngineDead,
                Some(Event::Failed(e)) => return Outcome::Failed(e),
            }
        }
    }
}

/// The end-of-capture line; `waited`: how often and how long the relay waited for the
/// observer (`--max-observer-backlog`).
fn report(args: &RecordArgs, s: &Summary, waited: (u64, Duration)) {
    let mut line = format!(
        "record: wrote {} ({} request records, {} incomplete",
        args.trace_out.display(),
        s.records,
        s.incomplete
    );
    if let Some(p) = &args.step_stats_out {
        line.push_str(&format!("; {} steps to {}", s.steps, p.display()));
    }
    line.push(')');
    if s.undecodable > 0 {
        line.push_str(&format!(
            "; {} relayed messages could not be decoded",
            s.undecodable
        ));
    }
    if waited.0 > 0 {
        line.push_str(&format!(
            "; the relay waited {} times ({:.1} s in all) for the observer to catch up \
             (--max-observer-backlog)",
            waited.0,
            waited.1.as_secs_f64()
        ));
    }
    if s.dropped > 0 || s.dropped_steps > 0 || s.write_error.is_some() {
        line.push_str(&format!(
            "; {} request records and {} step lines could NOT be written",
            s.dropped, s.dropped_steps
        ));
    }
    crate::errln!("{line}");
}
