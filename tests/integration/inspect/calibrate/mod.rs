//! `inspect calibrate`, through the binary: the comparison table, the gate and its exit
//! status, `--json`, `--plot`, `--dump-samples`, bad input.
//!
//! The gate on captures is checked in [`gate`], the written reports in [`reports`], the
//! command's usage in [`usage`]; running it and the captures and models they share are here.

use std::path::{Path, PathBuf};

use crate::support::svg::check_xml;
use crate::support::{
    TestCommand, TestDir, cohort, cpu_capture, fixture, inspect, number, process_dir, s, texts, vcr,
};
use serde_json::{Value, json};

mod gate;
mod reports;
mod usage;

fn calibrate(args: &[&str]) -> TestCommand {
    inspect("calibrate", args)
}

/// Exit status 1 (out of tolerance, or bad input): what the process printed.
fn exit_1(mut cmd: TestCommand) -> (String, String) {
    let out = cmd.output();
    let (o, e) = texts(&out);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}\nstdout:\n{o}\nstderr:\n{e}",
        cmd.describe()
    );
    (o, e)
}

/// The model `inspect fit` makes of the committed capture (with its sidecar), once per
/// test process.
fn fixture_model() -> PathBuf {
    static MODEL: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    MODEL
        .get_or_init(|| {
            let model = process_dir("inspect-calibrate").join("fixture-model.json");
            inspect(
                "fit",
                &[
                    s(&cpu_capture("trace.jsonl.gz")),
                    "--steps",
                    s(&cpu_capture("steps.jsonl.gz")),
                    "-o",
                    s(&model),
                ],
            )
            .run();
            model
        })
        .clone()
}

/// The fixture calibrated against its own model, with the captured engine's
/// `max_num_seqs` (block size 128 comes from the trace).
fn fixture_args(model: &Path, extra: &[&str]) -> Vec<String> {
    let mut a = vec![
        s(&cpu_capture("trace.jsonl.gz")).to_string(),
        "--latency-trace".into(),
        s(model).to_string(),
        "--max-num-seqs".into(),
        "128".into(),
    ];
    a.extend(extra.iter().map(|x| x.to_string()));
    a
}

fn calibrate_fixture(extra: &[&str]) -> TestCommand {
    let model = fixture_model();
    let a = fixture_args(&model, extra);
    calibrate(&a.iter().map(String::as_str).collect::<Vec<_>>())
}

/// A trace of `n` requests of 64 prompt / 32 output tokens (distinct prompts, blocks of
/// 16), Poisson arrivals at `rate` per second from a fixed generator.
fn hand_trace(tmp: &TestDir, name: &str, n: usize, rate: f64, seed: u64) -> PathBuf {
    let mut x = seed;
    let mut uniform = || {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let mut t = 0.0;
    let mut text = json!({"meta": {"block_size": 16}}).to_string() + "\n";
    for i in 0..n as u64 {
        t += -uniform().ln() / rate * 1000.0;
        let hashes: Vec<u64> = (1..=4).map(|b| seed * 1_000_000 + i * 10 + b).collect();
        let r = json!({"prompt_tokens": 64, "output_tokens": 32,
                       "arrival_ms": (t * 1000.0).round() / 1000.0, "block_hashes": hashes});
        text += &(r.to_string() + "\n");
    }
    let path = tmp.path(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// A synthetic capture: `trace` simulated with knobs, dumped as a trace.
fn synthetic_capture(tmp: &TestDir, trace: &Path, name: &str, knobs: &[&str]) -> PathBuf {
    let dump = tmp.path(name);
    let mut a = vec![s(trace), "--dump-trace", s(&dump)];
    a.extend_from_slice(knobs);
    inspect("simulate", &a).run();
    dump
}

fn fit(tmp: &TestDir, traces: &[&Path], name: &str) -> PathBuf {
    let model = tmp.path(name);
    let mut a: Vec<&str> = traces.iter().map(|t| s(t)).collect();
    a.extend(["-o", s(&model)]);
    inspect("fit", &a).run();
    model
}

/// The table's rows as (metric, cohort, quantile) → the six printed cells.
fn table(out: &str) -> Vec<(String, String, String, Vec<String>)> {
    let mut rows = Vec::new();
    let (mut metric, mut cohort) = (String::new(), String::new());
    for line in out.lines() {
        if line.contains(" captured ") && line.contains(" modelled ") {
            metric = line.split(" (ms)").next().unwrap().to_string();
            continue;
        }
        if line.trim().is_empty() {
            // a table ends with a blank line
            metric.clear();
        }
        if metric.is_empty() {
            continue;
        }
        let toks: Vec<&str> = line.split_whitespace().collect();
        let Some(qi) = toks.iter().position(|t| ["p50", "p90", "p99"].contains(t)) else {
            continue;
        };
        if qi > 0 {
            cohort = toks[0].trim_start_matches("c=").to_string();
        }
        let cells: Vec<String> = toks[qi + 1..]
            .iter()
            .filter(|t| **t != "!")
            .map(|t| t.to_string())
            .collect();
        rows.push((metric.clone(), cohort.clone(), toks[qi].to_string(), cells));
    }
    rows
}

fn num(v: &Value) -> String {
    let x = number(v);
    if x.abs() >= 100.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

/// The modelled Δ % of a pooled cell: `metric` (`ttft_ms`, `itl_ms`,
/// `request_total_ms`), quantile index 0/1/2 (p50/p90/p99).
fn pooled_delta(v: &Value, metric: &str, q: usize) -> f64 {
    number(&cohort(v, "all")[metric]["modelled_delta_pct"][["p50", "p90", "p99"][q]])
}
