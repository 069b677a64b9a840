//! The command line: parse, set up logging and signals, dispatch.

use std::io::Write;

use anyhow::Result;
use clap::{CommandFactory, Parser, Subcommand};
use clap_complete::Shell;
use tokio::sync::watch;

use crate::inspect::InspectArgs;
use crate::play::PlayArgs;
use crate::record::RecordArgs;
use crate::serve::ServeArgs;

/// A CPU stand-in for vLLM's engine-core: run the real vLLM frontend (vllm-rs or
/// `vllm serve`) against a simulated engine, without GPUs or model weights.
#[derive(Debug, Parser)]
#[command(name = "vllm-vcr", version = version(), about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,

    /// The longest line a trace reader accepts, in bytes (also the largest whole JSON
    /// document read, such as a guidellm report). A longer line is refused with its
    /// number instead of being read whole, so one line in a small `.gz` cannot take the
    /// host's memory; raise it only for a real trace with such lines. Any subcommand.
    #[arg(
        long,
        global = true,
        value_name = "BYTES",
        default_value_t = sim_trace::trace::DEFAULT_MAX_LINE_BYTES,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1024..=(1u64 << 40))
    )]
    pub max_line_bytes: usize,
}

fn version() -> &'static str {
    concat!(
        env!("CARGO_PKG_VERSION"),
        " (default vLLM line ",
        env!("VLLM_VCR_DEFAULT_LINE"),
        "; speaks 0.25–0.33; ",
        env!("VLLM_VCR_BUILD_INFO"),
        ")"
    )
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Start a real vLLM frontend (vllm-rs, or the Python `vllm serve`) with a simulated
    /// engine behind it, and print its OpenAI base URL.
    Serve(Box<ServeArgs>),
    /// Run a simulated engine-core that joins a vLLM frontend's handshake socket.
    Play(Box<PlayArgs>),
    /// Tap the wire between a real vLLM frontend and a real engine-core: relay every frame
    /// unchanged and write a trace of every request.
    Record(Box<RecordArgs>),
    /// Trace tools: summaries, Perfetto timelines, conversions, demo traces, latency-model
    /// fits, offline simulation.
    Inspect(Box<InspectArgs>),
    /// A prefill/decode proxy: each completion is prefilled on one frontend (max_tokens 1,
    /// do_remote_decode) and decoded on another with the KV location it returned.
    PdProxy(Box<crate::pd_proxy::PdProxyArgs>),
    /// Print a shell completion script for this binary to stdout.
    Completions {
        /// The shell to generate for.
        #[arg(value_enum)]
        shell: Shell,
    },
}

/// Parse the command line and run it; returns the process exit code.
pub fn main() -> i32 {
    let cli = Cli::parse();
    init_tracing();
    sim_trace::trace::set_max_line_bytes(cli.max_line_bytes);
    let result = match cli.command {
        Command::Completions { shell } => {
            // clap_complete panics when its writer fails (`completions bash | head -1`):
            // build the script in memory, then write it where a broken pipe is an error
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "vllm-vcr", &mut script);
            let mut out = std::io::stdout().lock();
            out.write_all(&script)
                .and_then(|()| out.flush())
                .map_err(Into::into)
        }
        Command::Serve(args) => runtime().and_then(|rt| {
            rt.block_on(async move {
                let shutdown = shutdown_on_signals();
                crate::serve::run(*args, shutdown).await
            })
        }),
        Command::Record(args) => current_thread_runtime().and_then(|rt| {
            rt.block_on(async move {
                let shutdown = shutdown_on_signals();
                crate::record::run(*args, shutdown).await
            })
        }),
        Command::Inspect(args) => crate::inspect::run(*args),
        Command::PdProxy(args) => runtime().and_then(|rt| {
            rt.block_on(async move {
                let shutdown = shutdown_on_signals();
                crate::pd_proxy::run(*args, shutdown).await
            })
        }),
        Command::Play(args) => runtime().and_then(|rt| {
            rt.block_on(async move {
                let shutdown = shutdown_on_signals();
                crate::play::run(*args, shutdown).await
            })
        }),
    };
    match result {
        Ok(()) => 0,
        // `… | head`: the reader left; not an error worth a message
        Err(e) if is_broken_pipe(&e) => 0,
        Err(e) => {
            crate::errln!("error: {e:#}");
            // `serve` ends with the status of a frontend that ended on its own
            e.downcast_ref::<crate::serve::FrontendExited>()
                .map_or(1, |f| f.code)
        }
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            || c.downcast_ref::<serde_json::Error>()
                .and_then(|j| j.io_error_kind())
                .is_some_and(|k| k == std::io::ErrorKind::BrokenPipe)
    })
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// The tap relays on one thread: the zeromq crate's round trip is about 3x faster on a
/// current-thread runtime (DEALER→ROUTER echo over ipc, p50 about 16 µs against 52 µs on
/// the multi-thread runtime); the observer has its own thread.
fn current_thread_runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // colours only for a terminal (and never under NO_COLOR): a log file or a pipe gets
    // plain text that grep can read
    use std::io::IsTerminal;
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(|| QuietStderr)
        .with_ansi(ansi)
        .try_init();
}

/// stderr for the log: a write that fails (the reader of a `2>&1 | tee` pipe is gone) is
/// dropped. tracing-subscriber reports a failed write with `eprintln!`, which panics on
/// the same closed pipe.
struct QuietStderr;

impl std::io::Write for QuietStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = std::io::stderr().write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        Ok(())
    }
}

/// A second signal within this of the first is the same Ctrl-C, forwarded twice.
const REPEATED_SIGNAL: std::time::Duration = std::time::Duration::from_secs(1);

/// A watch that turns true on the first SIGINT/SIGTERM; a second signal (a second later
/// or more) exits at once.
pub fn shutdown_on_signals() -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut int), Ok(mut term)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) else {
            tracing::warn!("cannot install signal handlers");
            return;
        };
        let mut first: Option<std::time::Instant> = None;
        loop {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
            match first {
                None => {
                    first = Some(std::time::Instant::now());
                    // set before it is said: whoever reads the line may rely on it
                    let _ = tx.send(true);
                    tracing::info!("signal received: shutting down (again to force)");
                }
                // a wrapper that forwards SIGINT (`uv run`, many runners) delivers one
                // Ctrl-C twice within a millisecond: a repeat that close is the same one
                Some(t) if t.elapsed() < REPEATED_SIGNAL => {
                    tracing::debug!("the same signal again within {REPEATED_SIGNAL:?}: ignored");
                }
                Some(_) => {
                    tracing::warn!("second signal: exiting now");
                    std::process::exit(130);
                }
            }
        }
    });
    rx
}
