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

pub mod compare;
mod knobs;
mod steps;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::{Value, json};
use sim_trace::fit::FittedModel;

use super::plot;
use super::simulate::workload::Workload;
use super::simulate::{ArrivalArgs, Counts, RunOptions, engine_for, simulate_map};
use crate::inspect::fit_config::{OtherConfig, fit_set_hashes, other_config};
use crate::io_guard::{Named, check_outputs, named};
use crate::play::EngineArgs;
use compare::{BUCKETS, Cohort, Metric, QUANTILES, SOURCES, Sample, Tolerance};
use knobs::{KnobFit, fit_knobs};

#[derive(Debug, Clone, Args)]
#[command(after_help = "\
The model under test is --latency-trace (a model file from `inspect fit`, or traces to fit \
now, with --latency-steps sidecars); it is required. Every other engine flag applies to \
both simulated runs. Exit status: 0 when every gated cell is within tolerance, 1 when one \
is not (the report is printed first, and the error names the cells) or on bad input.")]
pub struct CalibrateArgs {
    /// The capture to calibrate against (`record --trace-out`, or a trace written by
    /// `inspect simulate --dump-trace`): its records need captured timing (`ttft_ms`,
    /// `itl_ms`) and arrivals (`arrival_ms`).
    pub trace: PathBuf,

    #[command(flatten)]
    pub arrivals: ArrivalArgs,

    /// Calibrate only the first N requests (in arrival order).
    #[arg(long, value_name = "N")]
    pub requests: Option<u64>,

    /// The largest |Δ %| of a gated cell, modelled against captured: `PCT` for every
    /// quantile, or per quantile `p50=PCT,p90=PCT,p99=PCT` (items apply in order over the
    /// default; a trailing `%` is allowed).
    #[arg(
        long,
        value_name = "PCT[,pQ=PCT]",
        default_value = "p50=2,p90=2,p99=5",
        value_parser = compare::parse_tolerance
    )]
    pub tolerance: Tolerance,

    /// Concurrency cohorts with fewer compared requests than this are shown but not gated;
    /// a pooled row with fewer fails the command saying so (its quantiles are noise).
    #[arg(long, value_name = "N", default_value_t = 30)]
    pub min_requests: usize,

    /// Print the comparison as one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,

    /// Write every request's captured, modelled and knob samples (TTFT, request total,
    /// inter-token gaps) here, one row per request in arrival order: JSON lines, or CSV
    /// when the name ends in `.csv` (gaps space-separated).
    #[arg(long, value_name = "PATH")]
    pub dump_samples: Option<PathBuf>,

    /// Write SVG figures into this directory (created if missing): survival curves and
    /// Q-Q plots of TTFT and ITL, pooled and per gated cohort, and the output chunk-size
    /// distribution when the capture has multi-token chunks.
    #[arg(long, value_name = "DIR")]
    pub plot: Option<PathBuf>,

    /// The capture's step-stats sidecar (`record --step-stats-out`): adds the step-level
    /// check, each class of captured step (decode-only, prefill-only, mixed; decode-only
    /// also per batch size) against durations the model draws for the same shapes, at
    /// p10 / p50 / p90 / p99 / p99.9. Reported, not gated; a Q-Q figure per class under
    /// --plot. Needs a fitted model (--latency-trace).
    #[arg(long, value_name = "SIDECAR")]
    pub steps: Option<PathBuf>,

    /// Scale the model to the capture's host speed before simulating: the median of the
    /// capture's step durations over the model's law (from --steps), printed. Captures
    /// taken at different times run at different speeds on a shared machine; scaled, the
    /// comparison judges the model's shape (prefill against decode, batch size, the
    /// carry-over of prefills, scheduling) rather than the host's drift since the fit.
    #[arg(long, requires = "steps")]
    pub match_host_speed: bool,

    #[command(flatten, next_help_heading = "Engine (the flags of `play`)")]
    pub engine: EngineArgs,
}

/// What the capture says about one request.
struct Captured {
    request_id: Option<String>,
    arrival_ms: Option<f64>,
    concurrency: Option<u32>,
    sample: Option<Sample>,
}

/// The model under test, and whether the calibrated trace is among what it was fitted to.
struct FitSet {
    paths: Vec<PathBuf>,
    in_sample: bool,
    why: String,
    /// The fit set's config hashes when one differs from the trace's: the model is
    /// another engine's, so its deltas mix the model's error with the configuration's.
    other_config: Option<OtherConfig>,
}

/// What a run under the model under test gives: every request's sample by arrival-order
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
    let fit_set = FitSet::of(
        &a.trace,
        &engine.latency_trace,
        work.meta.config_hash.as_deref(),
    )?;
    if let Some(o) = &fit_set.other_config {
        crate::errln!("calibrate: WARNING: {}", o.describe());
    }
    let (step_check, speed) = match &a.steps {
        Some(sidecar) => {
            let m = crate::play::artifacts::load_latency_model(
                &engine.latency_trace,
                &engine.latency_steps,
            )?
            .context("--steps checks a fitted model: --latency-trace gives none")?;
            let speed = steps::host_speed(&m, &a.trace, sidecar, a.match_host_speed)?;
            let scale = if speed.applied { speed.factor } else { 1.0 };
            let check = steps::check(&m, &a.trace, sidecar, scale, engine.seed)?;
            (Some(check), Some(speed))
        }
        None => (None, None),
    };
    // the model's run only: the knobs are fitted to the capture as it is
    let mut model_engine = engine.clone();
    if let Some(s) = speed.as_ref().filter(|s| s.applied) {
        model_engine.time_scale = engine.time_scale / s.factor;
        crate::errln!(
            "calibrate: host speed: the capture's steps ran {:.3}× the model's law (median over {} steps); the model is scaled by it",
            s.factor,
            s.steps
        );
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
        let turn = work.turn_numbers(&work.sessions());
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

use crate::inspect::output::same_file;

/// The output guard of `calibrate` (and of `calibrate-e2e`, with its own inputs and
/// outputs added): no output may be the trace, a file the engine flags read, or another
/// output.
pub fn check_calibrate_outputs(
    a: &CalibrateArgs,
    more_inputs: &[Named],
    more_outputs: &[Named],
) -> Result<()> {
    let mut inputs = vec![named("the trace", &a.trace)];
    inputs.extend(a.steps.iter().map(|p| named("--steps", p)));
    inputs.extend(crate::play::artifacts::engine_inputs(&a.engine));
    inputs.extend(more_inputs.iter().cloned());
    let mut outputs: Vec<Named> = a
        .dump_samples
        .iter()
        .map(|p| named("--dump-samples", p))
        .collect();
    outputs.extend(more_outputs.iter().cloned());
    check_outputs(&inputs, &outputs)
}

/// Two files with the same bytes (a copy of the trace counts as the trace).
fn same_content(a: &Path, b: &Path) -> bool {
    let len = |p: &Path| std::fs::metadata(p).map(|m| m.len()).ok();
    if len(a).is_none() || len(a) != len(b) {
        return false;
    }
    match (std::fs::read(a), std::fs::read(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

impl FitSet {
    /// Which fit set `paths` is, and whether `trace` is in it: a trace given as itself
    /// (or a byte-identical copy), or a model whose sources are this trace (the same file or
    /// the same bytes). The captures of a corpus share their `config_hash` and often their
    /// record count, so neither says which trace a model saw.
    fn of(trace: &Path, paths: &[PathBuf], trace_hash: Option<&str>) -> Result<FitSet> {
        let mut why = None;
        let other_config = other_config(trace_hash, &fit_set_hashes(paths)?);
        for p in paths {
            if FittedModel::is_model_file(p) {
                let m = FittedModel::load(p)
                    .with_context(|| format!("--latency-trace {}", p.display()))?;
                for s in &m.meta.sources {
                    let src = Path::new(&s.trace);
                    if same_file(src, trace) || same_content(src, trace) {
                        why = Some(format!(
                            "the model {} was fitted to this trace",
                            p.display()
                        ));
                    }
                }
            } else if same_file(p, trace) || same_content(p, trace) {
                why = Some(format!("{} is in the fit set", p.display()));
            }
            if why.is_some() {
                break;
            }
        }
        Ok(FitSet {
            paths: paths.to_vec(),
            in_sample: why.is_some(),
            why: why.unwrap_or_else(|| {
                "the trace is not in the fit set: an out-of-sample check".to_string()
            }),
            other_config,
        })
    }

    fn relation(&self) -> &'static str {
        if self.in_sample {
            "in-sample"
        } else {
            "counterfactual"
        }
    }
}

/// A gated cell out of tolerance.
struct Failure<'a> {
    metric: Metric,
    cohort: &'a str,
    qi: usize,
    captured: Option<f64>,
    modelled: Option<f64>,
    delta: Option<f64>,
    tolerance: f64,
}

impl Failure<'_> {
    fn describe(&self) -> String {
        format!(
            "{} {} {} {} ({} vs captured {}, tolerance {} %)",
            self.metric.name(),
            QUANTILES[self.qi].1,
            cohort_name(self.cohort),
            pct(self.delta),
            num(self.modelled),
            num(self.captured),
            self.tolerance
        )
    }

    fn json(&self) -> Value {
        json!({
            "metric": self.metric.key(),
            "cohort": self.cohort,
            "quantile": QUANTILES[self.qi].1,
            "captured": self.captured,
            "modelled": self.modelled,
            "delta_pct": self.delta,
            "tolerance_pct": self.tolerance,
        })
    }
}

fn cohort_name(label: &str) -> String {
    if label == "all" {
        "all".into()
    } else {
        format!("c={label}")
    }
}

fn num(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(x) if x.abs() >= 100.0 => format!("{x:.1}"),
        Some(x) => format!("{x:.2}"),
    }
}

fn pct(v: Option<f64>) -> String {
    v.map_or("-".into(), |d| format!("{d:+.1} %"))
}

/// Everything the report shows.
struct Report<'a> {
    args: &'a CalibrateArgs,
    /// `--replay-concurrency`, resolved.
    concurrency: Option<usize>,
    /// The closed loop's turnaround, resolved.
    think: Duration,
    records: usize,
    timed: usize,
    compared: usize,
    unbucketed: usize,
    concurrency_from_records: bool,
    fit_set: &'a FitSet,
    modelled: &'a Counts,
    /// The live engine's pacing lateness (a run through a frontend).
    pacing: Option<crate::play::io::Pacing>,
    knobs: &'a KnobFit,
    cohorts: &'a [Cohort],
    plots: &'a [PathBuf],
    /// The step-level check and its sidecar (`--steps`).
    steps: Option<(&'a sim_trace::fit::StepCheck, &'a Path)>,
    /// The capture's host speed against the model (`--steps`), and whether it was applied.
    speed: Option<&'a steps::HostSpeed>,
    wall: f64,
}

impl Report<'_> {
    fn failures(&self) -> Vec<Failure<'_>> {
        let mut out = Vec::new();
        for c in self.cohorts {
            for cell in &c.cells {
                for &qi in &cell.out {
                    out.push(Failure {
                        metric: cell.metric,
                        cohort: &c.label,
                        qi,
                        captured: cell.q[0][qi],
                        modelled: cell.q[1][qi],
                        delta: cell.delta(1, qi),
                        tolerance: self.args.tolerance.pct[qi],
                    });
                }
            }
        }
        out
    }

    /// Gated cells with a value on both sides.
    fn gated_cells(&self) -> usize {
        self.cohorts
            .iter()
            .filter(|c| c.gated)
            .flat_map(|c| &c.cells)
            .map(|cell| (0..3).filter(|&qi| cell.delta(1, qi).is_some()).count())
            .sum()
    }

    fn simulations(&self) -> usize {
        1 + self.knobs.rounds
    }

    fn json(&self) -> Value {
        let k = self.knobs;
        let failures: Vec<Value> = self.failures().iter().map(Failure::json).collect();
        let cohorts: Vec<Value> = self.cohorts.iter().map(cohort_json).collect();
        json!({
            "trace": self.args.trace,
            "records": self.records,
            "timed": self.timed,
            "compared": self.compared,
            "arrivals": self.args.arrivals.mode(self.concurrency),
            "replay_concurrency": self.concurrency,
            "cold_prompts": self.args.arrivals.cold_prompts,
            "fit_set": {
                "paths": self.fit_set.paths,
                "relation": self.fit_set.relation(),
                "in_sample": self.fit_set.in_sample,
                "why": self.fit_set.why,
                "other_configuration": self.fit_set.other_config.is_some(),
                "config_hashes": self.fit_set.other_config.as_ref().map(OtherConfig::json),
            },
            "engine": self.modelled.describe,
            "engine_pacing": self.pacing,
            "knobs": {
                "time_to_first_token": k.ttft_ms,
                "time_to_first_token_std_dev": k.ttft_std_ms,
                "inter_token_latency": k.itl_ms,
                "inter_token_latency_std_dev": k.itl_std_ms,
                "flags": k.flags(),
                "rounds": k.rounds,
                "converged": k.converged(),
                "median_miss_pct": k.miss * 100.0,
                "method": "log-normal, fitted by simulation: medians matched to the captured p50, sigma to 1.4826 x the MAD of the captured logs (the spread the queue already adds taken off in variance)",
            },
            "concurrency": if self.concurrency_from_records { "records" } else { "computed" },
            "without_cohort": self.unbucketed,
            "tolerance_pct": self.args.tolerance.to_json(),
            "min_requests": self.args.min_requests,
            "cohorts": cohorts,
            "gated_cells": self.gated_cells(),
            "failures": failures,
            "pass": failures.is_empty(),
            "plots": self.plots,
            "steps": self.steps.map(|(c, p)| steps::json(c, p)),
            "host_speed": self.speed.map(|s| json!({
                "factor": s.factor, "steps": s.steps, "applied": s.applied,
            })),
            "dump_samples": self.args.dump_samples,
            "preemptions": {
                "modelled": self.modelled.preemptions,
                "knobs": k.counts.preemptions,
            },
            "simulations": self.simulations(),
            "wall_s": self.wall,
        })
    }

    fn write_text(&self, out: &mut impl Write) -> std::io::Result<()> {
        let a = self.args;
        let how = if let Some(c) = self.concurrency {
            a.arrivals.describe(c, self.think)
        } else if a.arrivals.replay_sessions {
            "session turns after their parents".to_string()
        } else {
            "arrivals at their recorded offsets".to_string()
        };
        writeln!(
            out,
            "calibrate: {} ({} records, {} with captured timing, {} compared; {how}{})",
            a.trace.display(),
            self.records,
            self.timed,
            self.compared,
            if a.arrivals.cold_prompts {
                "; cold prompts"
            } else {
                ""
            }
        )?;
        let paths: Vec<String> = self
            .fit_set
            .paths
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        writeln!(
            out,
            "fit set: {} — {}: {}{}",
            paths.join(" "),
            self.fit_set.relation(),
            self.fit_set.why,
            match &self.fit_set.other_config {
                Some(o) => format!("; WARNING: {}", o.describe()),
                None => String::new(),
            }
        )?;
        writeln!(out, "modelled: {}", self.modelled.describe)?;
        if let Some(p) = &self.pacing {
            writeln!(
                out,
                "engine pacing: emissions late by p50 {:.3} / p99 {:.3} / max {:.3} ms over {} (the disturbance this wall-clock run suffered)",
                p.p50_ms, p.p99_ms, p.max_ms, p.steps
            )?;
        }
        let k = self.knobs;
        writeln!(out, "knobs: {}", k.flags())?;
        if k.converged() {
            writeln!(
                out,
                "       (log-normal, fitted by simulation in {} rounds: medians matched to the captured p50, spread to the captured MAD of the logs)",
                k.rounds
            )?;
        } else {
            writeln!(
                out,
                "       (log-normal, fitted by simulation: did NOT converge in {} rounds — the closest run's TTFT or ITL p50 is {:.1} % off the captured one; under heavy load no knob setting may match)",
                k.rounds,
                k.miss * 100.0
            )?;
        }
        writeln!(
            out,
            "cohorts: concurrency at arrival ({}), itself included{}",
            if self.concurrency_from_records {
                "the records' `concurrency`"
            } else {
                "computed from the captured arrivals and ends"
            },
            if self.unbucketed > 0 {
                format!(
                    "; {} request(s) without an arrival are pooled only",
                    self.unbucketed
                )
            } else {
                String::new()
            }
        )?;
        let t = a.tolerance.pct;
        for metric in Metric::ALL {
            writeln!(
                out,
                "\n{:<32} {:>10} {:>10} {:>9} {:>10} {:>9}",
                format!("{} (ms)", metric.name()),
                "captured",
                "modelled",
                "Δ %",
                "knobs",
                "Δ %"
            )?;
            for c in self.cohorts {
                let cell = c.cells.iter().find(|x| x.metric == metric).expect("cell");
                let mut label = format!("{:<6} n={}", cohort_name(&c.label), c.requests);
                if metric == Metric::Itl {
                    label += &format!(" ({} gaps)", cell.samples[0]);
                }
                if !c.gated {
                    label += " *";
                }
                for (qi, (_, q)) in QUANTILES.iter().enumerate() {
                    let mark = if cell.out.contains(&qi) { " !" } else { "  " };
                    writeln!(
                        out,
                        "{:<28} {:<3} {:>10} {:>10} {:>7}{mark} {:>10} {:>7}",
                        if qi == 0 { label.as_str() } else { "" },
                        q,
                        num(cell.q[0][qi]),
                        num(cell.q[1][qi]),
                        cell.delta(1, qi).map_or("-".into(), |d| format!("{d:+.1}")),
                        num(cell.q[2][qi]),
                        cell.delta(2, qi).map_or("-".into(), |d| format!("{d:+.1}")),
                    )?;
                }
            }
        }
        writeln!(
            out,
            "\n* not gated (fewer than {} requests); ! out of tolerance: |Δ| > {} % at p50, {} % at p90, {} % at p99 (modelled against captured; the knobs are for reference)",
            a.min_requests, t[0], t[1], t[2]
        )?;
        if let Some((c, p)) = self.steps {
            steps::write_text(out, c, p)?;
        }
        if let Some(s) = self.speed {
            writeln!(
                out,
                "host speed: the capture's steps ran {:.3}× the model's law (median over {} steps){}",
                s.factor,
                s.steps,
                if s.applied {
                    "; the model was scaled by it (--match-host-speed)"
                } else {
                    ""
                }
            )?;
        }
        let failures = self.failures();
        if failures.is_empty() {
            writeln!(
                out,
                "result: pass ({} gated cells within tolerance)",
                self.gated_cells()
            )?;
        } else {
            writeln!(
                out,
                "result: FAIL — {} of {} gated cells out of tolerance",
                failures.len(),
                self.gated_cells()
            )?;
        }
        if !self.plots.is_empty() {
            writeln!(
                out,
                "plots: {} SVG files in {}",
                self.plots.len(),
                a.plot
                    .as_ref()
                    .map_or(String::new(), |p| p.display().to_string())
            )?;
        }
        if let Some(p) = &a.dump_samples {
            writeln!(out, "samples: {}", p.display())?;
        }
        writeln!(
            out,
            "wall: {:.2} s ({} simulations)",
            self.wall,
            self.simulations()
        )?;
        Ok(())
    }
}

fn cohort_json(c: &Cohort) -> Value {
    let mut m = serde_json::Map::new();
    m.insert("cohort".into(), json!(c.label));
    m.insert("requests".into(), json!(c.requests));
    m.insert("gated".into(), json!(c.gated));
    for cell in &c.cells {
        let qs = |src: usize| -> Value {
            let mut o = serde_json::Map::new();
            for (qi, (_, q)) in QUANTILES.iter().enumerate() {
                o.insert((*q).into(), json!(cell.q[src][qi]));
            }
            Value::Object(o)
        };
        let ds = |src: usize| -> Value {
            let mut o = serde_json::Map::new();
            for (qi, (_, q)) in QUANTILES.iter().enumerate() {
                o.insert((*q).into(), json!(cell.delta(src, qi)));
            }
            Value::Object(o)
        };
        let out: Vec<&str> = cell.out.iter().map(|&qi| QUANTILES[qi].1).collect();
        m.insert(
            cell.metric.key().into(),
            json!({
                "samples": {
                    "captured": cell.samples[0],
                    "modelled": cell.samples[1],
                    "knobs": cell.samples[2],
                },
                "captured": qs(0),
                "modelled": qs(1),
                "modelled_delta_pct": ds(1),
                "knobs": qs(2),
                "knobs_delta_pct": ds(2),
                "out_of_tolerance": out,
            }),
        );
    }
    Value::Object(m)
}

/// `--plot DIR`: the figures, pooled and per gated cohort.
#[allow(clippy::too_many_arguments)]
fn write_plots(
    dir: &Path,
    trace: &Path,
    cohorts: &[Cohort],
    all: &[usize],
    by_bucket: &[Vec<usize>],
    triples: &[[&Sample; 3]],
    captured_chunks: &BTreeMap<u32, u64>,
    model_chunks: &BTreeMap<u32, u64>,
) -> Result<Vec<PathBuf>> {
    let name = trace.file_name().map_or_else(
        || trace.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let mut written = Vec::new();
    for c in cohorts.iter().filter(|c| c.gated) {
        let members: &[usize] = if c.label == "all" {
            all
        } else {
            let b = BUCKETS
                .iter()
                .position(|x| x.2 == c.label)
                .expect("a bucket");
            &by_bucket[b]
        };
        let who = if c.label == "all" {
            format!("all requests (n = {})", c.requests)
        } else {
            format!("{} in flight at arrival (n = {})", c.label, c.requests)
        };
        for metric in [Metric::Ttft, Metric::Itl] {
            let per: Vec<Vec<f64>> = (0..SOURCES.len())
                .map(|src| {
                    let mut v = Vec::new();
                    for &i in members {
                        metric.extend(triples[i][src], &mut v);
                    }
                    v
                })
                .collect();
            let samples: Vec<(&str, &[f64])> = SOURCES
                .iter()
                .zip(&per)
                .map(|(s, v)| (*s, v.as_slice()))
                .collect();
            let stem = format!(
                "{}-{{}}-{}.svg",
                metric.name().to_ascii_lowercase(),
                compare::slug(&c.label)
            );
            let path = plot::file(dir, &stem.replace("{}", "survival"))?;
            plot::survival(
                &path,
                &format!("{} survival — {name}, {who}", metric.name()),
                metric.name(),
                &samples,
            )
            .with_context(|| format!("writing {}", path.display()))?;
            written.push(path);
            let path = plot::file(dir, &stem.replace("{}", "qq"))?;
            plot::qq(
                &path,
                &format!("{} Q-Q — {name}, {who}", metric.name()),
                metric.name(),
                ("captured", "simulated"),
                &samples,
            )
            .with_context(|| format!("writing {}", path.display()))?;
            written.push(path);
        }
    }
    if captured_chunks.keys().any(|&k| k > 1) {
        let path = plot::file(dir, "chunk-sizes.svg")?;
        plot::chunk_sizes(
            &path,
            &format!("output chunk sizes — {name}"),
            &[("captured", captured_chunks), ("modelled", model_chunks)],
        )
        .with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

/// `--dump-samples`: one row per request, in arrival order.
struct Rows<'a> {
    cap: &'a [&'a Captured],
    concurrency: &'a [Option<u32>],
    runs: [&'a [Option<Sample>]; 2],
}

impl Rows<'_> {
    fn write(&self, path: &Path) -> Result<()> {
        let csv = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("csv"));
        let file = std::fs::File::create(path)?;
        let mut w = std::io::BufWriter::new(file);
        if csv {
            let mut head = vec![
                "index",
                "request_id",
                "arrival_ms",
                "concurrency",
                "cohort",
                "compared",
            ];
            let cols: Vec<String> = ["ttft_ms", "total_ms", "itl_ms"]
                .iter()
                .flat_map(|m| SOURCES.iter().map(move |s| format!("{s}_{m}")))
                .collect();
            head.extend(cols.iter().map(String::as_str));
            writeln!(w, "{}", head.join(","))?;
        }
        for (i, c) in self.cap.iter().enumerate() {
            let srcs = [
                c.sample.as_ref(),
                self.runs[0][i].as_ref(),
                self.runs[1][i].as_ref(),
            ];
            let compared = srcs.iter().all(Option::is_some);
            let cohort = self.concurrency[i].map(|x| BUCKETS[compare::bucket(x)].2);
            if csv {
                let opt = |v: Option<f64>| v.map_or(String::new(), |x| x.to_string());
                let mut row = vec![
                    i.to_string(),
                    csv_field(c.request_id.as_deref().unwrap_or("")),
                    opt(c.arrival_ms),
                    self.concurrency[i].map_or(String::new(), |x| x.to_string()),
                    cohort.unwrap_or("").to_string(),
                    compared.to_string(),
                ];
                row.extend(srcs.iter().map(|s| opt(s.map(|s| s.ttft_ms))));
                row.extend(srcs.iter().map(|s| opt(s.map(|s| s.total_ms))));
                row.extend(srcs.iter().map(|s| {
                    s.map_or(String::new(), |s| {
                        let g: Vec<String> = s.itl_ms.iter().map(f64::to_string).collect();
                        g.join(" ")
                    })
                }));
                writeln!(w, "{}", row.join(","))?;
            } else {
                let sample = |s: Option<&Sample>| {
                    s.map(|s| json!({"ttft_ms": s.ttft_ms, "total_ms": s.total_ms, "itl_ms": s.itl_ms}))
                };
                let row = json!({
                    "index": i,
                    "request_id": c.request_id,
                    "arrival_ms": c.arrival_ms,
                    "concurrency": self.concurrency[i],
                    "cohort": cohort,
                    "compared": compared,
                    "captured": sample(srcs[0]),
                    "modelled": sample(srcs[1]),
                    "knobs": sample(srcs[2]),
                });
                writeln!(w, "{row}")?;
            }
        }
        w.flush()?;
        Ok(())
    }
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}
