//! The calibration report: the gate's failures, the text table and the JSON.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};

use super::args::CalibrateArgs;
use super::compare::{Cohort, Metric, QUANTILES};
use super::fit_set::FitSet;
use super::knobs::KnobFit;
use super::steps;
use crate::inspect::fit_config::OtherConfig;
use crate::inspect::simulate::{Counts, OwnTurnarounds};

/// A gated cell out of tolerance.
pub(super) struct Failure<'a> {
    pub(super) metric: Metric,
    pub(super) cohort: &'a str,
    pub(super) qi: usize,
    pub(super) captured: Option<f64>,
    pub(super) modelled: Option<f64>,
    pub(super) delta: Option<f64>,
    pub(super) tolerance: f64,
}

impl Failure<'_> {
    pub(super) fn describe(&self) -> String {
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

    pub(super) fn json(&self) -> Value {
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

pub(super) fn pct(v: Option<f64>) -> String {
    v.map_or("-".into(), |d| format!("{d:+.1} %"))
}

/// Everything the report shows.
pub(super) struct Report<'a> {
    pub(super) args: &'a CalibrateArgs,
    /// `--replay-concurrency`, resolved.
    pub(super) concurrency: Option<usize>,
    /// The closed loop's turnaround, resolved.
    pub(super) think: Duration,
    /// Each request after its own recorded turnaround, resolved.
    pub(super) own_turnarounds: Option<OwnTurnarounds>,
    pub(super) records: usize,
    pub(super) timed: usize,
    pub(super) compared: usize,
    pub(super) unbucketed: usize,
    pub(super) concurrency_from_records: bool,
    pub(super) fit_set: &'a FitSet,
    pub(super) modelled: &'a Counts,
    /// The live engine's pacing lateness (a run through a frontend).
    pub(super) pacing: Option<crate::play::io::Pacing>,
    pub(super) knobs: &'a KnobFit,
    pub(super) cohorts: &'a [Cohort],
    pub(super) plots: &'a [PathBuf],
    /// The step-level check and its sidecar (`--steps`).
    pub(super) steps: Option<(&'a sim_trace::fit::StepCheck, &'a Path)>,
    /// The capture's host speed against the model (`--steps`), and whether it was applied.
    pub(super) speed: Option<&'a steps::HostSpeed>,
    pub(super) wall: f64,
}

impl Report<'_> {
    pub(super) fn failures(&self) -> Vec<Failure<'_>> {
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
    pub(super) fn gated_cells(&self) -> usize {
        self.cohorts
            .iter()
            .filter(|c| c.gated)
            .flat_map(|c| &c.cells)
            .map(|cell| (0..3).filter(|&qi| cell.delta(1, qi).is_some()).count())
            .sum()
    }

    pub(super) fn simulations(&self) -> usize {
        1 + self.knobs.rounds
    }

    pub(super) fn json(&self) -> Value {
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
                "factor": s.speeds.all.0, "steps": s.speeds.all.1, "applied": s.applied,
                "per_class": s.per_class,
                "decode": s.speeds.decode.map(|(f, n)| json!({"factor": f, "steps": n})),
                "prefill": s.speeds.prefill.map(|(f, n)| json!({"factor": f, "steps": n})),
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

    pub(super) fn write_text(&self, out: &mut impl Write) -> std::io::Result<()> {
        let a = self.args;
        let how = if let Some(c) = self.concurrency {
            a.arrivals.describe(c, self.think, self.own_turnarounds)
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
            let class = |c: Option<(f64, u64)>| {
                c.map_or("too few steps".to_string(), |(f, n)| {
                    format!("{f:.3}× over {n}")
                })
            };
            writeln!(
                out,
                "host speed: the capture's steps ran {:.3}× the model's law (median over {} steps; decode-only {}, with prefill work {}){}",
                s.speeds.all.0,
                s.speeds.all.1,
                class(s.speeds.decode),
                class(s.speeds.prefill),
                match (s.applied, s.per_class) {
                    (true, false) => "; the model was scaled by it (--match-host-speed)",
                    (true, true) =>
                        "; each class of the model's steps was scaled by its own (--host-speed-per-class)",
                    _ => "",
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
