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
mod follow;
mod options;
mod report;
pub mod workload;

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use sim_protocol::{EngineCoreRequest, SamplingParams, VllmLine};
use sim_trace::trace::TraceRecord;

use super::progress::Progress;
use super::summarize::Summary;
use crate::io_guard::{check_outputs, named};
use crate::play::EngineArgs;
use crate::play::artifacts::engine_inputs;
use crate::play::config::PlayConfig;
use crate::play::engine::offline::OfflineDriver;
use arrivals::Arrivals;
pub use follow::Finished;
use follow::Follower;
use workload::{Turn, Workload};

pub use args::{ArrivalArgs, ReplayConcurrency, SimulateArgs};
pub use options::{Counts, RunOptions, engine_for, notes};
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
        .take(work.reqs.len())
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
    let work = Workload::load(&a.trace, a.engine.block_size, a.requests)
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
    let opts = RunOptions {
        hash_blocks: a.dump_trace.is_some().then_some(block_size as usize),
        record_tokens: a.record_tokens,
        ..a.arrivals.options(&work, &engine)?
    };
    let concurrency = opts.concurrency;
    let think = opts.think;
    let cfg = PlayConfig::offline(&engine)?;
    let mut sink = Sink::open(a, &work.meta, &cfg)?;

    let mut summary = Summary::new();
    summary.meta = Some(sink.meta.clone());
    let counts = run_workload(&work, &cfg, &opts, |f| {
        summary.add(&f.record);
        sink.write(&f.record)
    })?;
    sink.finish()?;
    let wall = started.elapsed().as_secs_f64();

    let report = Report {
        args: a,
        other_config,
        concurrency,
        think,
        work: &work,
        summary: &summary,
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

/// The run itself: send every request when it is due, drive the engine from event to
/// event, and hand every record to `on_record` as its request finishes (refused and
/// abandoned requests too, as incomplete records).
pub fn run_workload(
    work: &Workload,
    cfg: &PlayConfig,
    opts: &RunOptions,
    mut on_record: impl FnMut(Finished) -> Result<()>,
) -> Result<Counts> {
    let n = work.reqs.len();
    let line = cfg.line;
    let ids = cfg.engine.token_ids.clone();
    let mut arrivals = Arrivals::new(work, opts);

    let mut driver = OfflineDriver::new(cfg.build_engine(0));
    let mut follower = Follower::new(
        opts.hash_blocks,
        opts.record_tokens,
        crate::play::engine::timer::instant_to_monotonic(driver.origin()),
    );
    let mut finished = Vec::new();
    let mut progress = Progress::new("simulate:");
    let mut done = 0usize;
    let mut rejected = 0u64;
    let limits = Limits {
        max_model_len: cfg.engine.max_model_len,
        kv_tokens: cfg.engine.num_gpu_blocks.saturating_sub(1) * cfg.engine.block_size,
    };
    let mut record = |f: Finished, arrivals: &mut Arrivals| -> Result<()> {
        arrivals.finished(f.index, f.at);
        on_record(f)
    };
    loop {
        let next = match (arrivals.next_due(), driver.next_event()) {
            (Some(x), Some(y)) => x.min(y),
            (x, y) => match x.or(y) {
                Some(t) => t,
                None => break,
            },
        };
        while let Some((at, i)) = arrivals.pop_due(next) {
            let p = &work.reqs[i];
            if let Some(why) = limits.refuse(p.prompt_tokens.max(1), p.output_tokens.max(1)) {
                rejected += 1;
                done += 1;
                let f = follow::rejected(i, at, p.prompt_tokens.max(1), why);
                record(f, &mut arrivals)?;
                continue;
            }
            let prompt = work.prompt(i, ids.clone(), opts.cold_prompts);
            let req = request(i, prompt, work.reqs[i].output_tokens, line, at);
            follower.arrive(i, at, &req);
            driver.add(at, 0, req);
        }
        for out in driver.run_until(next) {
            follower.absorb(&out, &mut finished);
        }
        for f in finished.drain(..) {
            done += 1;
            record(f, &mut arrivals)?;
        }
        progress.status(|| {
            format!(
                "{done}/{n} requests, {} in flight, {:.1} s simulated",
                follower.in_flight(),
                driver.now().as_secs_f64()
            )
        });
    }
    // Requests the engine could not finish (nothing left to happen, yet they are still
    // in flight): written incomplete; turns that continue them are never sent.
    let not_finished = follower.in_flight() as u64;
    if not_finished > 0 {
        let why = "the engine could not finish it";
        follower.abandon_all(driver.now(), why, &mut finished);
        for f in finished.drain(..) {
            done += 1;
            on_record(f)?;
        }
        crate::errln!(
            "warning: {not_finished} request(s) never finished; they are written incomplete"
        );
    }
    if rejected > 0 {
        crate::errln!(
            "warning: {rejected} request(s) refused before the engine (longer than --max-model-len, or than the KV cache); they are written incomplete with the reason"
        );
    }
    progress.finish_status(&format!("{done}/{n} requests"));
    let turns = arrivals.turns();
    let sessions = opts.replay_sessions.then(|| {
        let roots = turns.iter().filter(|t| **t == Turn::Root).count();
        let untimed = turns
            .iter()
            .filter(|t| matches!(t, Turn::NotBefore { .. }))
            .count();
        (roots, n - roots, untimed)
    });
    let engine = driver.into_engine();
    let counts = Counts {
        requests: n,
        sessions,
        preemptions: follower.preemptions,
        not_finished,
        never_sent: (n - done) as u64,
        rejected,
        describe: engine.describe(),
        replay: engine.replay_summary(),
    };
    Ok(counts)
}

/// What a request may ask for. A frontend refuses a request longer than the model's
/// context (`--max-model-len`, prompt plus `max_tokens`), and vLLM does not start with a
/// context longer than its KV cache, so no request it serves is longer than that either:
/// the engine would queue it forever (first come, first served: with everything behind
/// it).
struct Limits {
    max_model_len: u64,
    kv_tokens: u64,
}

impl Limits {
    fn refuse(&self, prompt: u32, output: u32) -> Option<String> {
        let total = u64::from(prompt) + u64::from(output);
        if total > self.max_model_len {
            return Some(format!(
                "refused as a frontend would: {prompt} prompt + {output} output tokens exceed the maximum model length {} (--max-model-len, capped at what the KV cache holds)",
                self.max_model_len
            ));
        }
        (total > self.kv_tokens).then(|| {
            format!(
                "refused: {prompt} prompt + {output} output tokens do not fit the KV cache of {} tokens ((--num-gpu-blocks − 1) × --block-size; vLLM does not start with a --max-model-len above it)",
                self.kv_tokens
            )
        })
    }
}

/// The engine-side request a record becomes: named `replay-<i>` (its arrival-order
/// index, what `--replay-match index` looks up), generating exactly the recorded number
/// of tokens (`ignore_eos`; at least one, as vLLM requires).
fn request(
    i: usize,
    prompt: Vec<u32>,
    output_tokens: u32,
    line: VllmLine,
    at: Duration,
) -> EngineCoreRequest {
    let id = format!("replay-{i}");
    EngineCoreRequest {
        request_id: id.clone(),
        prompt_token_ids: Some(prompt),
        sampling_params: Some(SamplingParams {
            max_tokens: Some(output_tokens.max(1)),
            ignore_eos: true,
            output_kind: 1,
            ..Default::default()
        }),
        arrival_time: at.as_secs_f64(),
        external_req_id: Some(id),
        wire_len: line.request_len(),
        ..Default::default()
    }
}
