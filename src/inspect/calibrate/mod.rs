//! `inspect calibrate`: how well a latency model reproduces a capture, at the model level.
//!
//! The capture's workload is simulated twice through `inspect simulate`'s engine (the same
//! requests, arrivals and engine flags): once paced by the model under test
//! (`--latency-trace FIT…`), once by the best-fit latency knobs (TTFT and ITL with their
//! log-normal spread). Every request's TTFT, inter-token gaps and request total are then
//! compared with what was captured for it, pooled and per concurrency cohort (the requests
//! in flight when it arrived), at p50 / p90 / p99 — exact nearest-rank quantiles over the
//! samples, which are held in memory (one entry per request plus 8 bytes per gap).
//!
//! **The knob model** (`knobs.rs`) is fitted to the capture by simulation, not chosen, so
//! its p50s agree by construction and its p90 / p99 errors show how far a
//! constant-plus-log-normal model's spread reaches.
//!
//! **The gate** covers the modelled column only: the pooled cohort, and every cohort with
//! at least `--min-requests` requests (a pooled row with fewer fails the run saying so);
//! a cell is out when |Δ %| exceeds the quantile's tolerance. Out of tolerance, the report is printed and the command fails (exit 1)
//! naming the cells.

mod args;
pub mod compare;
mod fit_set;
mod knobs;
mod plots;
mod report;
mod samples;
mod steps;

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Instant;

use anyhow::{Context, Result, bail};

use super::plot;
use super::simulate::workload::Workload;
use super::simulate::{Counts, RunOptions, engine_for, simulate_map};
use crate::play::EngineArgs;
use compare::{BUCKETS, Sample};
use knobs::fit_knobs;

pub use args::{CalibrateArgs, check_calibrate_outputs};
use fit_set::FitSet;
use plots::write_plots;
use report::Report;
use samples::{Captured, Rows};

/// index (`None`: not finished), the output chunk sizes, and the run's counts.
pub struct ModelRun {
    pub samples: Vec<Option<Sample>>,
    pub chunks: BTreeMap<u32, u64>,
    pub counts: Counts,
    /// Requests that failed (HTTP errors of a run through a frontend): the calibration
    /// is reported, then fails.
    pub failed: Vec<String>,
    /// How late the live engine paced its steps (a run through a frontend): the run's
    /// disturbance, which its deltas are judged against. `None` offline.
    pub pacing: Option<crate::play::io::Pacing>,
}

pub fn run(a: &CalibrateArgs) -> Result<()> {
    run_with(a, |work, engine, opts| {
        // records become samples as they finish: memory holds latencies, not records
        let mut chunks: BTreeMap<u32, u64> = BTreeMap::new();
        let modelled = simulate_map(work, engine, opts, |r| {
            for (k, v) in compare::chunk_sizes(std::iter::once(&r)) {
                *chunks.entry(k).or_default() += v;
            }
            Sample::of(&r)
        })
        .context("simulating under the latency model")?;
        Ok(ModelRun {
            samples: modelled.records.into_iter().map(Option::flatten).collect(),
            chunks,
            counts: modelled.counts,
            failed: Vec::new(),
            pacing: None,
        })
    })
}

/// Calibrate the first `a.requests` requests of `a.trace` against the samples `model`
/// produces for them — the offline simulation (`calibrate`) or a run through a
/// real frontend (`calibrate-e2e`) — with the same knob model, report, gate and files.
pub fn run_with(
    a: &CalibrateArgs,
    model: impl FnOnce(&Workload, &EngineArgs, &RunOptions) -> Result<ModelRun>,
) -> Result<()> {
    let started = Instant::now();
    if a.engine.latency_trace.is_empty() {
        bail!(
            "calibrate compares a capture with a latency model: pass --latency-trace MODEL (from `inspect fit`) or --latency-trace TRACE… to fit"
        );
    }
    check_calibrate_outputs(a, &[], &[])?;
    let mut captured: Vec<Captured> = Vec::new();
    let mut captured_chunks: BTreeMap<u32, u64> = BTreeMap::new();
    let work = Workload::load_with(&a.trace, a.engine.block_size, a.requests, |_, r| {
        for (k, v) in compare::chunk_sizes(std::iter::once(r)) {
            *captured_chunks.entry(k).or_default() += v;
        }
        captured.push(Captured {
            request_id: r.request_id.clone(),
            arrival_ms: r.arrival_ms.filter(|t| t.is_finite()),
            concurrency: r.concurrency,
            sample: Sample::of(r),
        });
    })
    .with_context(|| format!("reading {}", a.trace.display()))?;
    // in arrival order, as the simulated records are
    let cap: Vec<&Captured> = work
        .reqs
        .iter()
        .map(|p| &captured[p.source as usize])
        .collect();
    let timed = cap.iter().filter(|c| c.sample.is_some()).count();
    if timed == 0 {
        bail!(
            "{}: no complete record has captured timing (ttft_ms): calibrate compares a capture's latencies with a model's, and this trace has none to compare (a converted workload such as a Mooncake trace records only arrivals and lengths; `inspect simulate` runs it under a model)",
            a.trace.display()
        );
    }
    if cap.iter().all(|c| c.arrival_ms.is_none()) {
        bail!(
            "{}: no record has an arrival_ms: calibrate replays the captured arrivals, and without them every request would arrive at once",
            a.trace.display()
        );
    }
    let engine = engine_for(&work, &a.engine);
    // the model's run and every knob-fitting run use the same arrivals
    let opts = a.arrivals.options(&work, &engine)?;
    let replay_concurrency = opts.concurrency;
    let think = opts.think;
    let own_turnarounds = opts.own_turnarounds;
    let fit_set = FitSet::of(
        &a.trace,
        &engine.latency_trace,
        work.meta.config_hash.as_deref(),
    )?;
    if let Some(o) = &fit_set.other_config {
        crate::errln!("calibrate: WARNING: {}", o.describe());
    }
    if let Some(mut reach) = fit_set.reach.clone() {
        for p in &work.reqs {
            reach.add(p.prompt_tokens);
        }
        if let Some(note) = reach.note() {
            crate::errln!("calibrate: note: {note}");
        }
    }
    let (step_check, speed) = match &a.steps {
        Some(sidecar) => {
            let m = crate::play::artifacts::load_latency_model(
                &engine.latency_trace,
                &engine.latency_steps,
            )?
            .context("--steps checks a fitted model: --latency-trace gives none")?;
            let speed = steps::host_speed(
                &m,
                &a.trace,
                sidecar,
                a.match_host_speed,
                a.host_speed_per_class,
            )?;
            let check = steps::check(&m, &a.trace, sidecar, speed.scale(), engine.seed)?;
            (Some(check), Some(speed))
        }
        None => (None, None),
    };
    // the model's run only: the knobs are fitted to the capture as it is
    let mut model_engine = engine.clone();
    if let Some(s) = speed.as_ref().filter(|s| s.applied) {
        let scale = s.scale();
        model_engine.time_scale = engine.time_scale / scale.decode;
        model_engine.prefill_speed = Some(scale.prefill / scale.decode);
        if s.per_class {
            crate::errln!(
                "calibrate: host speed: the capture's decode-only steps ran {:.3}× the model's law, its steps with prefill work {:.3}×; each class of the model's steps is scaled by its own",
                scale.decode,
                scale.prefill
            );
        } else {
            crate::errln!(
                "calibrate: host speed: the capture's steps ran {:.3}× the model's law (median over {} steps); the model is scaled by it",
                s.speeds.all.0,
                s.speeds.all.1
            );
        }
    }
    let ModelRun {
        samples: mod_samples,
        chunks: model_chunks,
        counts: model_counts,
        failed,
        pacing,
    } = model(&work, &model_engine, &opts)?;
    let cap_samples: Vec<Option<&Sample>> = cap.iter().map(|c| c.sample.as_ref()).collect();
    let knobs = fit_knobs(&work, &engine, &opts, &cap_samples)?;
    let knob_samples = &knobs.samples;

    // concurrency at arrival: the records' own, else from the captured arrivals and ends
    let from_records = cap
        .iter()
        .filter(|c| c.arrival_ms.is_some())
        .all(|c| c.concurrency.is_some());
    let concurrency: Vec<Option<u32>> = if from_records {
        cap.iter().map(|c| c.concurrency).collect()
    } else {
        let spans: Vec<Option<(f64, f64)>> = cap
            .iter()
            .map(|c| {
                let a = c.arrival_ms?;
                Some((a, c.sample.as_ref().map_or(0.0, |s| s.total_ms)))
            })
            .collect();
        compare::concurrency_from_timing(&spans)
    };

    let mut compared: Vec<usize> = Vec::new();
    let mut triples: Vec<[&Sample; 3]> = Vec::new();
    for i in 0..cap.len() {
        if let (Some(c), Some(m), Some(k)) = (&cap[i].sample, &mod_samples[i], &knob_samples[i]) {
            compared.push(i);
            triples.push([c, m, k]);
        }
    }
    if triples.is_empty() {
        bail!(
            "no request finished in both simulations among the {timed} captured with timing: nothing to compare"
        );
    }
    let all: Vec<usize> = (0..triples.len()).collect();
    // quantiles of a handful of requests are noise: the pooled row is gated only when it
    // holds --min-requests, and the command then fails saying so (below)
    let pooled_gated = triples.len() >= a.min_requests;
    let mut cohorts = vec![compare::cohort(
        "all",
        &all,
        &triples,
        pooled_gated,
        &a.tolerance,
    )];
    let mut by_bucket: Vec<Vec<usize>> = vec![Vec::new(); BUCKETS.len()];
    let mut unbucketed = 0usize;
    for (k, &i) in compared.iter().enumerate() {
        match concurrency[i] {
            Some(c) => by_bucket[compare::bucket(c)].push(k),
            None => unbucketed += 1,
        }
    }
    for (b, members) in by_bucket.iter().enumerate() {
        if !members.is_empty() {
            let gated = members.len() >= a.min_requests;
            cohorts.push(compare::cohort(
                BUCKETS[b].2,
                members,
                &triples,
                gated,
                &a.tolerance,
            ));
        }
    }

    let mut plots = Vec::new();
    if let Some(dir) = &a.plot {
        plots = write_plots(
            dir,
            &a.trace,
            &cohorts,
            &all,
            &by_bucket,
            &triples,
            &captured_chunks,
            &model_chunks,
        )?;
        // TTFT per session turn, when the hash chains show conversations
        let turn = Workload::turn_numbers(&work.sessions());
        let of = |src: usize| {
            compare::per_turn(
                compared
                    .iter()
                    .zip(&triples)
                    .map(|(&i, t)| (turn[i], t[src].ttft_ms)),
                a.min_requests.min(10),
            )
        };
        if let Some(c) = &step_check {
            plots.extend(steps::plots(dir, &a.trace, c)?);
        }
        let (cap_turns, mod_turns) = (of(0), of(1));
        if !cap_turns.is_empty() {
            let path = plot::file(dir, "ttft-per-turn.svg")?;
            let name = a.trace.file_name().unwrap_or_default().to_string_lossy();
            plot::per_turn(
                &path,
                &format!("TTFT per session turn — {name}"),
                "TTFT",
                &[("captured", &cap_turns), ("modelled", &mod_turns)],
            )
            .with_context(|| format!("writing {}", path.display()))?;
            plots.push(path);
        }
    }
    if let Some(path) = &a.dump_samples {
        let rows = Rows {
            cap: &cap,
            concurrency: &concurrency,
            runs: [&mod_samples, knob_samples],
        };
        rows.write(path)
            .with_context(|| format!("writing --dump-samples {}", path.display()))?;
    }

    let report = Report {
        args: a,
        concurrency: replay_concurrency,
        think,
        own_turnarounds,
        records: cap.len(),
        timed,
        compared: triples.len(),
        unbucketed,
        concurrency_from_records: from_records,
        fit_set: &fit_set,
        modelled: &model_counts,
        pacing,
        knobs: &knobs,
        cohorts: &cohorts,
        plots: &plots,
        steps: step_check.as_ref().zip(a.steps.as_deref()),
        speed: speed.as_ref(),
        wall: started.elapsed().as_secs_f64(),
    };
    if a.json {
        let text = serde_json::to_string_pretty(&report.json())?;
        writeln!(std::io::stdout().lock(), "{text}")?;
    } else {
        report.write_text(&mut std::io::stdout().lock())?;
    }
    if !failed.is_empty() {
        bail!(
            "{} of {} requests failed, so the run does not speak for the model: {}",
            failed.len(),
            cap.len(),
            failed
                .iter()
                .take(3)
                .cloned()
                .collect::<Vec<_>>()
                .join("; ")
        );
    }
    if !pooled_gated {
        bail!(
            "only {} request(s) compared, fewer than --min-requests {}: the quantiles of so few requests are noise, so nothing was gated; calibrate against a capture with at least {} requests with timing (or lower --min-requests)",
            triples.len(),
            a.min_requests,
            a.min_requests
        );
    }
    let failures = report.failures();
    if !failures.is_empty() {
        const NAMED: usize = 6;
        let mut names: Vec<String> = failures.iter().take(NAMED).map(|f| f.describe()).collect();
        if failures.len() > NAMED {
            names.push(format!(
                "and {} more (marked ! in the table; `failures` in --json)",
                failures.len() - NAMED
            ));
        }
        bail!(
            "{} of {} gated cells out of tolerance: {}",
            failures.len(),
            report.gated_cells(),
            names.join("; ")
        );
    }
    Ok(())
}
