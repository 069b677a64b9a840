//! The held-out evaluation of corpus v2 (`conformance/v2`), part of `cargo xtask figures`.
//!
//! The model is fitted on the calibration suite alone (the `fit` and `gate` captures —
//! seeds 0 and 1, as `inspect suite` runs them — of the workloads `sim_trace::loads`
//! marks as the suite, with their sidecars); every other workload is a shape it has not
//! seen, and the suite's own rows judge its first-round seed-0 run, which it was not fitted
//! on. Each workload's `gate` capture is calibrated
//! against that model (`inspect calibrate --steps --json`, arrivals as the manifest says),
//! and against a model fitted on every other workload's `fit` capture (leave one shape
//! out); beside each cell, the workload's own repeat distance (`inspect compare` of its
//! `fit` capture and the seed-0 repeat). A cell holds when |Δ| ≤ max(3 %, distance) at
//! p50 and p90, max(8 %, distance) at p99. Writes `docs/heldout-table.md`, the heatmap
//! `docs/figures/heldout/heatmap.svg` and the step-class Q-Q figures of every workload.
//! Everything runs on the virtual clock: the same binary gives the same numbers.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;
use sim_trace::loads::{CALIBRATION_SUITE, SUITE_FIT_ROLES, WORKLOADS};

use crate::rig::corpus::{self, Entry};

use crate::rig::tool::{json_of, run_quiet};

pub const METRICS: [(&str, &str); 3] = [
    ("ttft_ms", "TTFT"),
    ("itl_ms", "ITL"),
    ("request_total_ms", "request total"),
];
pub const QS: [&str; 3] = ["p50", "p90", "p99"];

/// The goal's floor per quantile, %: a cell holds within max(floor, the workload's own
/// repeat distance).
pub const FLOOR: [f64; 3] = [3.0, 3.0, 8.0];

/// One workload's results.
pub struct Row {
    pub workload: String,
    pub suite: bool,
    pub requests: Value,
    /// Δ % against the suite's model scaled to the capture's host speed
    /// (`--match-host-speed`), `[metric][quantile]`: what the cells are judged on.
    pub suite_delta: [[Option<f64>; 3]; 3],
    /// Δ % against the suite's model as fitted (the host's drift since the fit included).
    pub raw_delta: [[Option<f64>; 3]; 3],
    /// The capture's host speed against the suite's model.
    pub host_speed: Option<f64>,
    /// Δ % against the leave-one-shape-out model (held-out workloads only).
    pub loo_delta: [[Option<f64>; 3]; 3],
    /// The workload's own repeat distance, %, at one host speed ([`at_one_speed`]).
    pub noise: [[Option<f64>; 3]; 3],
    /// The host speed of the workload's seed-0 capture and of its repeat.
    pub repeat_speeds: Option<(Option<f64>, Option<f64>)>,
    /// `calibrate`'s `steps` section against the suite's model.
    pub steps: Value,
}

impl Row {
    /// |Δ| over the cell's tolerance (≤ 1 holds), against the suite's model.
    pub fn score(&self, m: usize, q: usize) -> Option<f64> {
        let d = self.suite_delta[m][q]?;
        Some(d.abs() / tolerance(self.noise[m][q], q))
    }
}

/// The median over the held-out workloads of each metric's |Δ| at p50 and p90: one number
/// per metric to set beside what other simulators publish (a median absolute percentage
/// error over held-out runs).
fn medians(s: &mut String, rows: &[Row]) {
    let held: Vec<&Row> = rows.iter().filter(|r| !r.suite).collect();
    let column = |pick: &dyn Fn(&Row) -> Option<f64>| -> String {
        let mut v: Vec<f64> = held.iter().filter_map(|r| pick(r)).map(f64::abs).collect();
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => "–".to_string(),
            n if n % 2 == 1 => format!("{:.1}", v[n / 2]),
            n => format!("{:.1}", (v[n / 2 - 1] + v[n / 2]) / 2.0),
        }
    };
    let _ = writeln!(
        s,
        "\nThe median |Δ| % over the {} held-out workloads (p50 / p90):\n\n\
         | metric | speed-matched | as fitted | loo |\n|---|---|---|---|",
        held.len()
    );
    for (m, (_, label)) in METRICS.iter().enumerate() {
        let cells: Vec<String> = [
            &(|r: &Row, q: usize| r.suite_delta[m][q]) as &dyn Fn(&Row, usize) -> Option<f64>,
            &|r: &Row, q: usize| r.raw_delta[m][q],
            &|r: &Row, q: usize| r.loo_delta[m][q],
        ]
        .iter()
        .map(|f| format!("{} / {}", column(&|r| f(r, 0)), column(&|r| f(r, 1))))
        .collect();
        let _ = writeln!(s, "| {label} | {} |", cells.join(" | "));
    }
}

/// The tolerance of a cell: max(the floor, the repeat distance).
pub fn tolerance(noise: Option<f64>, q: usize) -> f64 {
    noise.map_or(FLOOR[q], |n| n.abs().max(FLOOR[q]))
}

/// A repeat distance with the host's drift between the two captures taken out: each
/// capture's latencies divided by its host speed against the suite's model (the median of
/// its step durations over the law), as the speed-matched cells are judged. On a host
/// whose speed moves by tens of percent within an hour (corpus v2's), the raw distance
/// measures the host; this one measures how far the engine repeats a workload's shape.
/// Latencies scale with step durations exactly in a closed loop, approximately in an
/// open one (queueing grows faster than the steps).
fn at_one_speed(
    raw: [[Option<f64>; 3]; 3],
    speeds: (Option<f64>, Option<f64>),
) -> [[Option<f64>; 3]; 3] {
    let (Some(a), Some(b)) = speeds else {
        return raw;
    };
    raw.map(|m| m.map(|d| d.map(|d| ((1.0 + d / 100.0) * a / b - 1.0) * 100.0)))
}

fn pooled(v: &Value, path: &dyn Fn(&Value, &str) -> Value) -> [[Option<f64>; 3]; 3] {
    let mut out = [[None; 3]; 3];
    for (m, (key, _)) in METRICS.iter().enumerate() {
        for (q, qn) in QS.iter().enumerate() {
            out[m][q] = path(v, key)[qn].as_f64();
        }
    }
    out
}

fn all_cohort(v: &Value) -> &Value {
    v["cohorts"]
        .as_array()
        .and_then(|c| c.iter().find(|x| x["cohort"] == "all"))
        .unwrap_or(&Value::Null)
}

fn fit(engine: &Path, dir: &Path, fit: &[&Entry], out: &Path) -> Result<()> {
    let mut cmd = Command::new(engine);
    cmd.args(["inspect", "fit", "--per-capture-speed"])
        .args(fit.iter().map(|e| dir.join(&e.file)))
        .arg("--steps")
        .args(fit.iter().map(|e| dir.join(&e.steps)))
        .arg("-o")
        .arg(out);
    run_quiet(&mut cmd, "inspect fit")
}

fn calibrate(
    engine: &Path,
    dir: &Path,
    g: &Entry,
    model: &Path,
    matched: bool,
    plot: Option<&Path>,
) -> Result<Value> {
    let mut cmd = Command::new(engine);
    cmd.args(["inspect", "calibrate"])
        .arg(dir.join(&g.file))
        .arg("--latency-trace")
        .arg(model)
        .arg("--steps")
        .arg(dir.join(&g.steps))
        .arg("--json")
        .args(g.calibrate_args.split_whitespace());
    if matched {
        cmd.arg("--match-host-speed");
    }
    if let Some(p) = plot {
        cmd.arg("--plot").arg(p);
    }
    json_of(&mut cmd, "inspect calibrate")
}

/// Evaluate the corpus under `dir`; figures of each workload go to `plots/<workload>`.
pub fn evaluate(engine: &Path, dir: &Path, work: &Path, plots: Option<&Path>) -> Result<Vec<Row>> {
    let captures = corpus::captures(dir)?;
    let of = |w: &str, role: &str| -> Option<&Entry> {
        captures.iter().find(|e| e.workload == w && e.role == role)
    };
    let suite_fit: Vec<&Entry> = CALIBRATION_SUITE
        .iter()
        .flat_map(|w| SUITE_FIT_ROLES.iter().filter_map(move |r| of(w, r)))
        .collect();
    if suite_fit.len() != CALIBRATION_SUITE.len() * SUITE_FIT_ROLES.len() {
        bail!(
            "{}: the calibration suite needs a fit and a gate capture (its two seeds) of each of {}",
            dir.display(),
            CALIBRATION_SUITE.join(", ")
        );
    }
    std::fs::create_dir_all(work)?;
    let suite_model = work.join("suite-model.json");
    fit(engine, dir, &suite_fit, &suite_model)?;
    let mut rows = Vec::new();
    for w in WORKLOADS {
        let suite = CALIBRATION_SUITE.contains(&w.name);
        // the suite's model is fitted on both its seeds: its own row judges the run of
        // seed 0 it was not fitted on (the first round's)
        let judged = if suite { "noise" } else { "gate" };
        let (Some(gate), Some(fit_e)) = (of(w.name, judged), of(w.name, "fit")) else {
            continue;
        };
        let plot_dir = plots.map(|p| p.join(w.name));
        let v = calibrate(engine, dir, gate, &suite_model, true, plot_dir.as_deref())?;
        let suite_delta = pooled(all_cohort(&v), &|c, k| c[k]["modelled_delta_pct"].clone());
        let raw = calibrate(engine, dir, gate, &suite_model, false, None)?;
        let raw_delta = pooled(all_cohort(&raw), &|c, k| c[k]["modelled_delta_pct"].clone());
        let others: Vec<&Entry> = captures
            .iter()
            .filter(|e| {
                e.role == "fit" && e.workload != w.name && e.config_hash == gate.config_hash
            })
            .collect();
        // a workload with engine flags of its own has no other shape of its configuration
        let loo_delta = if suite || others.is_empty() {
            [[None; 3]; 3]
        } else {
            let model = work.join(format!("loo-{}.json", w.name));
            fit(engine, dir, &others, &model)?;
            let l = calibrate(engine, dir, gate, &model, true, None)?;
            pooled(all_cohort(&l), &|c, k| c[k]["modelled_delta_pct"].clone())
        };
        let noise = match captures
            .iter()
            .find(|e| e.workload == w.name && e.role == "noise")
        {
            Some(rep) => {
                let mut cmd = Command::new(engine);
                cmd.args(["inspect", "compare"])
                    .arg(dir.join(&fit_e.file))
                    .arg(dir.join(&rep.file))
                    .arg("--json");
                let c = json_of(&mut cmd, "inspect compare")?;
                let raw = pooled(all_cohort(&c), &|c, k| {
                    c["traces"][1][k]["delta_pct"].clone()
                });
                let speed = |e: &Entry| -> Result<Option<f64>> {
                    let v = calibrate(engine, dir, e, &suite_model, true, None)?;
                    Ok(v["host_speed"]["factor"].as_f64())
                };
                let speeds = (speed(fit_e)?, speed(rep)?);
                (at_one_speed(raw, speeds), Some(speeds))
            }
            None => ([[None; 3]; 3], None),
        };
        let (noise, repeat_speeds) = noise;
        eprintln!("heldout: {}", w.name);
        rows.push(Row {
            workload: w.name.to_string(),
            suite,
            requests: all_cohort(&v)["requests"].clone(),
            suite_delta,
            raw_delta,
            host_speed: v["host_speed"]["factor"].as_f64(),
            loo_delta,
            noise,
            repeat_speeds,
            steps: v["steps"].clone(),
        });
    }
    Ok(rows)
}

fn pct(v: Option<f64>) -> String {
    v.map_or("–".into(), |x| format!("{x:+.1}").replace('-', "−"))
}

/// `docs/heldout-table.md`.
pub fn render(rows: &[Row], heatmap: &str, step_figures: &dyn Fn(&str) -> Vec<String>) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# Held-out fidelity (corpus v2)\n\n\
         Written by `cargo xtask figures` (xtask/src/rig/heldout.rs) from `conformance/v2`; do not\n\
         edit by hand. What the corpus and the suite are: [fidelity.md](fidelity.md).\n\n\
         The model is fitted on the calibration suite alone, both seeds of it (`inspect fit\n\
         --per-capture-speed` on its `fit` and `gate` captures); every other workload is a\n\
         shape it never saw. Each cell is the pooled Δ % of the workload's `gate` capture (the\n\
         suite's: its `noise` run, which the model was not fitted on) simulated under that\n\
         model against the capture\n\
         (p50 / p90 / p99). *Speed-matched*: the model scaled to the capture's host speed\n\
         (`calibrate --match-host-speed`: the median of the capture's step durations over the\n\
         law, the *host speed* column; in brackets the speeds of the workload's seed-0 capture\n\
         and of its repeat), which takes out the host's drift between the fit captures and\n\
         this one and leaves the model's shape to judge; *as fitted*: without it. *Noise* is\n\
         the workload's own repeat distance (its seed-0 capture against the seed-0 repeat),\n\
         at one host speed like the cells it judges: each capture's latencies divided by its\n\
         host speed; *loo* is the speed-matched Δ under a model fitted on every other\n\
         workload (leave one shape out). A cell holds (✓) within max(3 %, noise) at p50 and\n\
         p90, max(8 %, noise) at p99, speed-matched.\n\n\
         ![heatmap]({heatmap})\n"
    );
    let mut held = 0;
    let mut total = 0;
    for part in [false, true] {
        let _ = writeln!(
            s,
            "\n## {}\n",
            if part {
                "The suite itself (its other run of seed 0: in-family)"
            } else {
                "Held-out workloads"
            }
        );
        let _ = writeln!(
            s,
            "| workload | n | host speed | metric | speed-matched Δ | noise | ✓ | as fitted Δ | loo Δ |"
        );
        let _ = writeln!(s, "|---|---:|---:|---|---|---|---|---|---|");
        for r in rows.iter().filter(|r| r.suite == part) {
            for (m, (_, label)) in METRICS.iter().enumerate() {
                let d: Vec<String> = (0..3).map(|q| pct(r.suite_delta[m][q])).collect();
                let raw: Vec<String> = (0..3).map(|q| pct(r.raw_delta[m][q])).collect();
                let n: Vec<String> = (0..3).map(|q| pct(r.noise[m][q])).collect();
                let l: Vec<String> = (0..3).map(|q| pct(r.loo_delta[m][q])).collect();
                let ok: String = (0..3)
                    .map(|q| match r.score(m, q) {
                        Some(x) if x <= 1.0 => '✓',
                        Some(_) => '✗',
                        None => '–',
                    })
                    .collect();
                if !part {
                    total += ok.chars().filter(|c| *c != '–').count();
                    held += ok.chars().filter(|c| *c == '✓').count();
                }
                let first = m == 0;
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {label} | {} | {} | {ok} | {} | {} |",
                    if first { r.workload.as_str() } else { "" },
                    if first {
                        r.requests.to_string()
                    } else {
                        String::new()
                    },
                    match (first, r.host_speed, r.repeat_speeds) {
                        (true, Some(x), Some((Some(a), Some(b)))) => {
                            format!("{x:.2} ({a:.2}, {b:.2})")
                        }
                        (true, Some(x), _) => format!("{x:.2}"),
                        _ => String::new(),
                    },
                    d.join(" / "),
                    n.join(" / "),
                    raw.join(" / "),
                    if part {
                        "–".to_string()
                    } else {
                        l.join(" / ")
                    }
                );
            }
        }
    }
    let _ = writeln!(s, "\nHeld-out cells within the goal: {held} of {total}.");
    medians(&mut s, rows);
    let _ = writeln!(
        s,
        "\n## Step classes\n\n\
         `calibrate --steps`: each class of captured step against durations the suite's\n\
         model draws for the same shapes, speed-matched, Δ % at p10 / p50 / p90 / p99 /\n\
         p99.9 (n steps).\n"
    );
    let _ = writeln!(s, "| workload | decode-only | prefill-only | mixed |");
    let _ = writeln!(s, "|---|---|---|---|");
    for r in rows {
        let class = |name: &str| -> String {
            r.steps["classes"]
                .as_array()
                .and_then(|c| c.iter().find(|x| x["class"] == name))
                .map_or("–".into(), |c| {
                    let d: Vec<String> = c["delta_pct"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|x| pct(x.as_f64()))
                        .collect();
                    format!("{} ({})", d.join(" / "), c["steps"])
                })
        };
        let figs = step_figures(&r.workload);
        let _ = writeln!(
            s,
            "| {}{} | {} | {} | {} |",
            r.workload,
            if figs.is_empty() {
                String::new()
            } else {
                format!(" ({})", figs.join(", "))
            },
            class("decode-only"),
            class("prefill-only"),
            class("mixed")
        );
    }
    s
}

/// The heatmap: workloads × cells, colour by |Δ| / tolerance, Δ written in each cell.
pub fn heatmap(rows: &[Row]) -> String {
    let (cw, ch, left, top) = (62.0, 22.0, 190.0, 58.0);
    let w = left + cw * 9.0 + 20.0;
    let h = top + ch * rows.len() as f64 + 40.0;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"10\" y=\"18\" font-size=\"13\">Δ % under the suite's model, speed-matched; colour: |Δ| / max(floor, the workload's repeat distance)</text>\n"
    );
    for (m, (_, label)) in METRICS.iter().enumerate() {
        for (q, qn) in QS.iter().enumerate() {
            let x = left + cw * (m * 3 + q) as f64 + cw / 2.0;
            let _ = writeln!(
                s,
                "<text x=\"{x}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
                top - 8.0,
                if q == 0 {
                    format!("{label} {qn}")
                } else {
                    qn.to_string()
                }
            );
        }
    }
    for (i, r) in rows.iter().enumerate() {
        let y = top + ch * i as f64;
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}{}</text>",
            left - 6.0,
            y + ch * 0.7,
            r.workload,
            if r.suite { " (suite)" } else { "" }
        );
        for m in 0..3 {
            for q in 0..3 {
                let x = left + cw * (m * 3 + q) as f64;
                let (fill, text) = match (r.score(m, q), r.suite_delta[m][q]) {
                    (Some(sc), Some(d)) => (color(sc), format!("{d:+.1}")),
                    _ => ("#eeeeee".to_string(), "–".to_string()),
                };
                let _ = writeln!(
                    s,
                    "<rect x=\"{x}\" y=\"{y}\" width=\"{cw}\" height=\"{ch}\" fill=\"{fill}\" stroke=\"white\"/><text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{text}</text>",
                    x + cw / 2.0,
                    y + ch * 0.7
                );
            }
        }
    }
    let _ = writeln!(
        s,
        "<text x=\"10\" y=\"{}\">green: within the goal (≤ 1); yellow: up to 2×; red: beyond</text>\n</svg>",
        h - 12.0
    );
    s
}

fn color(score: f64) -> String {
    if score <= 1.0 {
        "#8fd19e".into()
    } else if score <= 2.0 {
        "#ffe08a".into()
    } else {
        "#f4a3a3".into()
    }
}

/// The workloads whose step-class figures are kept.
const STEP_FIGURES: [&str; 6] = [
    "suite-batch-c12",
    "varlen-c6",
    "long-c4",
    "concurrency-16",
    "poisson",
    "preempt-small-kv-c16",
];

/// Run the evaluation and write the table and figures under `docs`.
pub fn write(engine: &Path, root: &Path, work: &Path) -> Result<Option<PathBuf>> {
    let dir = root.join("conformance").join("v2");
    if !dir.join("manifest.toml").exists() {
        eprintln!(
            "figures: no corpus v2 ({}), held-out table skipped",
            dir.display()
        );
        return Ok(None);
    }
    let docs = root.join("docs");
    let fig = docs.join("figures").join("heldout");
    let plots = work.join("heldout-plots");
    let rows = evaluate(engine, &dir, &work.join("heldout"), Some(&plots))?;
    std::fs::create_dir_all(&fig)?;
    std::fs::write(fig.join("heatmap.svg"), heatmap(&rows))?;
    // the step-class Q-Q figures of a few workloads that differ most (the tables have
    // every workload's quantiles; the figures of all of them would weigh megabytes)
    for r in rows
        .iter()
        .filter(|r| STEP_FIGURES.contains(&r.workload.as_str()))
    {
        for class in ["decode-only", "prefill-only", "mixed"] {
            let name = format!("steps-{class}-qq.svg");
            let from = plots.join(&r.workload).join(&name);
            if from.exists() {
                let to = fig.join(&r.workload);
                std::fs::create_dir_all(&to)?;
                std::fs::copy(&from, to.join(&name))?;
            }
        }
    }
    let figs = |w: &str| -> Vec<String> {
        ["decode-only", "prefill-only", "mixed"]
            .iter()
            .filter(|c| fig.join(w).join(format!("steps-{c}-qq.svg")).exists())
            .map(|c| format!("[{c}](figures/heldout/{w}/steps-{c}-qq.svg)"))
            .collect()
    };
    let out = docs.join("heldout-table.md");
    std::fs::write(&out, render(&rows, "figures/heldout/heatmap.svg", &figs))
        .with_context(|| format!("writing {}", out.display()))?;
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(workload: &str, suite: bool, ttft_p50: Option<f64>) -> Row {
        let mut delta = [[None; 3]; 3];
        delta[0][0] = ttft_p50;
        Row {
            workload: workload.into(),
            suite,
            requests: Value::Null,
            suite_delta: delta,
            raw_delta: [[None; 3]; 3],
            host_speed: None,
            loo_delta: [[None; 3]; 3],
            noise: [[None; 3]; 3],
            repeat_speeds: None,
            steps: Value::Null,
        }
    }

    #[test]
    fn the_medians_take_the_held_out_workloads_absolute_deltas_only() {
        let rows = [
            row("a", false, Some(-8.0)),
            row("b", false, Some(2.0)),
            row("c", false, Some(4.0)),
            row("d", false, None),
            row("suite", true, Some(50.0)),
        ];
        let mut s = String::new();
        medians(&mut s, &rows);
        assert!(s.contains("over the 4 held-out workloads"), "{s}");
        // |−8|, 2, 4 → 4.0; the suite's own row and the missing cell left out
        assert!(s.contains("| TTFT | 4.0 / – | – / – | – / – |"), "{s}");
    }
}
