//! `vllm-vcr play`: a simulated vLLM engine-core behind a real frontend.
//!
//! Three rooms and the edge around them: `engine/` is the clock-free engine (the steps,
//! the batch, the KV cache, the outputs), `content/` decides what a request's tokens are
//! (random, echo, text, replayed, constrained, with logprobs, pooled, failed), `pd/` is
//! what the engines say to their peers (P/D transfer, side channel, data plane, KV events).
//! At the top: the flags, the checked configuration and the sockets' I/O loop.

pub mod args;
pub mod artifacts;
pub mod config;
pub mod content;
pub mod engine;
pub mod engine_args;
pub mod io;
mod outlet;
pub mod pd;

use anyhow::{Context, Result};
use tokio::sync::watch;

pub use args::{DEFAULT_HANDSHAKE_ADDRESS, DEFAULT_LINE, PlayArgs};
use config::PlayConfig;
pub use engine_args::{EngineArgs, TokenMode};

/// Run `play` until shutdown (or until the frontend goes away).
pub async fn run(args: PlayArgs, shutdown: watch::Receiver<bool>) -> Result<()> {
    run_config(PlayConfig::try_from(&args)?, &args, shutdown).await
}

/// [`run`] with the configuration already built from `args` (`serve` builds it to check
/// the flags before it starts the frontend, and keeps its loaded traces).
pub async fn run_config(
    cfg: PlayConfig,
    args: &PlayArgs,
    shutdown: watch::Receiver<bool>,
) -> Result<()> {
    let cfg = std::sync::Arc::new(cfg);
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
