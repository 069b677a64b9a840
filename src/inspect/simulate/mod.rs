//! `inspect simulate`: a trace's workload through the engine, offline, on the virtual
//! clock — no frontend, no sockets, no sleeping. The same `SimEngine` `play` runs (built
//! by the same `PlayConfig` from the same engine flags) is driven by the offline driver;
//! requests are synthesized from the trace's records (`workload.rs`) and sent at their
//! recorded offsets (open loop) or as session turns after their parents finished (closed
//! loop); every finished request becomes a record of the simulated trace (`follow.rs`).
//! It replays a capture, and answers what-if questions about a public workload under other
//! engine settings or another latency model.

mod args;
pub mod arrivals;
mod fleet;
mod follow;
mod options;
mod prehash;
mod report;
mod route;
mod stream;
pub mod workload;

use std::io::Write;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use sim_trace::trace::TraceRecord;

use super::summarize::Summary;
use crate::inspect::fit_reach::PromptReach;
use crate::io_guard::{check_outputs, named};
use crate::play::EngineArgs;
use crate::play::artifacts::engine_inputs;
use crate::play::config::PlayConfig;
pub use fleet::run_workload;
pub use follow::Finished;
pub use route::{Fleet, Route};
use workload::Workload;

pub use args::{ArrivalArgs, ReplayConcurrency, SimulateArgs};
pub use options::{Counts, OwnTurnarounds, RunOptions, engine_for, notes};
use report::{Report, Sink};

/// A simulated run held in memory: what each request's record became, by arrival-order
/// index (`None` for a request never sent: a turn whose parent never finished).
pub struct Simulated<T = TraceRecord> {
    pub records: Vec<Option<T>>,
    pub counts: Counts,
}

/// Run `work` through an engine built from `engine` (see [`engine_for`]) and keep the
/// records in memory, indexed by arrival order. What `inspect simulate` does without
/// writing anything.
pub fn simulate_records(
    work: &Workload,
    engine: &EngineArgs,
    opts: &RunOptions,
) -> Result<Simulated> {
    simulate_map(work, engine, opts, |r| r)
}

/// [`simulate_records`], keeping only what `keep` makes of each record as its request
/// finishes (`inspect calibrate` keeps its latencies, not the whole record).
pub fn simulate_map<T>(
    work: &Workload,
    engine: &EngineArgs,
    opts: &RunOptions,
    mut keep: impl FnMut(TraceRecord) -> T,
) -> Result<Simulated<T>> {
    let cfg = PlayConfig::offline(engine)?;
    let mut records: Vec<Option<T>> = std::iter::repeat_with(|| None)
        .take(work.requests())
        .collect();
    let counts = run_workload(work, &cfg, opts, |f| {
        records[f.index] = Some(keep(f.record));
        Ok(())
    })?;
    Ok(Simulated { records, counts })
}

pub fn run(a: &SimulateArgs) -> Result<()> {
    let started = Instant::now();
    let to_stdout = a.dump_trace.as_ref().is_some_and(|p| p.as_os_str() == "-");
    if to_stdout && a.json {
        bail!("--json and `--dump-trace -` both write to standard output: pick one");
    }
    if let Some(out) = &a.dump_trace {
        let mut inputs = vec![named("the trace", &a.trace)];
        inputs.extend(engine_inputs(&a.engine));
        check_outputs(&inputs, &[named("--dump-trace", out)])?;
    }
    // the open loop streams the trace when it can; closed loops need it whole
    let hold = a.arrivals.replay_sessions || a.arrivals.replay_concurrency.is_some();
    let work = stream::open(&a.trace, a.engine.block_size, a.requests, hold)
        .with_context(|| format!("reading {}", a.trace.display()))?;
    let other_config = crate::inspect::fit_config::other_config(
        work.meta.config_hash.as_deref(),
        &crate::inspect::fit_config::fit_set_hashes(&a.engine.latency_trace)?,
    );
    if let Some(o) = &other_config {
        crate::errln!("simulate: WARNING: {}", o.describe());
    }
    let engine = engine_for(&work, &a.engine);
    let block_size = engine.block_size_or_default();
    let fleet = a.fleet.fleet();
    if fleet.engines > 1 && (engine.replay_tokens.is_some() || engine.replay_steps.is_some()) {
        bail!(
            "--engines {} with --replay-tokens or --replay-steps: a recorded run is one engine's; simulate a fleet under a latency model",
            fleet.engines
        );
    }
    let opts = RunOptions {
        hash_blocks: a.dump_trace.is_some().then_some(block_size as usize),
        record_tokens: a.record_tokens,
        fleet,
        ..a.arrivals.options(&work, &engine)?
    };
    let concurrency = opts.concurrency;
    let think = opts.think;
    let cfg = PlayConfig::offline(&engine)?;
    let mut sink = Sink::open(a, &work.meta, &cfg)?;

    let mut summary = Summary::new();
    summary.meta = Some(sink.meta.clone());
    // with more than one engine, each engine's own summary too
    let mut per_engine: Vec<Summary> = (0..fleet.engines)
        .filter(|_| fleet.engines > 1)
        .map(|_| Summary::new())
        .collect();
    let mut reach = cfg.model.as_ref().and_then(PromptReach::of);
    let counts = run_workload(&work, &cfg, &opts, |f| {
        summary.add(&f.record);
        if let Some(r) = reach.as_mut() {
            r.add(f.record.prompt_tokens);
        }
        if let Some(s) = f.record.engine.and_then(|e| per_engine.get_mut(e as usize)) {
            s.add(&f.record);
        }
        sink.write(&f.record)
    })?;
    sink.finish()?;
    if let Some(note) = reach.as_ref().and_then(PromptReach::note) {
        crate::errln!("simulate: note: {note}");
    }
    let wall = started.elapsed().as_secs_f64();

    let report = Report {
        args: a,
        other_config,
        concurrency,
        think,
        own_turnarounds: opts.own_turnarounds,
        work: &work,
        summary: &summary,
        per_engine: &per_engine,
        counts: &counts,
        block_size,
        wall,
    };
    if a.json {
        // one write, so a closed pipe is an io error (`inspect … | head` ends quietly)
        let text = serde_json::to_string_pretty(&report.json())?;
        writeln!(std::io::stdout().lock(), "{text}")?;
    } else if to_stdout {
        report.write_text(&mut std::io::stderr().lock())?;
    } else {
        report.write_text(&mut std::io::stdout().lock())?;
    }
    Ok(())
}
