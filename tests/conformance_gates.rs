//! Timing fidelity against the real engine, gated: the latency model fitted on the
//! corpus's `fit` captures (`conformance/`, seed 0), then each gated `gate` capture (seed 1)
//! simulated under it by `inspect calibrate` — counterfactual: the model never saw the trace.
//!
//! Tolerances come from the engine itself: the corpus captures concurrency 8 twice with the
//! same seed (`concurrency-8-s0` and its `noise` repeat), and the distance between the two
//! runs is how well the real engine reproduces itself on this machine class. A modelled cell
//! passes within 1.5 × that distance for its metric and quantile (at least 2 %, the goal where
//! the engine is steadier than that). Gated: TTFT and ITL at p50 and p90 of the closed-loop
//! concurrency captures the model reproduces today (8 and 16). What is not gated yet, and
//! why, is in docs/fidelity.md ("First counterfactual numbers").

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_vllm-vcr"))
}

fn corpus(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("conformance/0.32")
        .join(name)
}

fn json_of(args: &[&str]) -> Value {
    let out = bin().args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "{args:?}: not JSON ({e}): {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

const METRICS: [&str; 2] = ["ttft_ms", "itl_ms"];
const QUANTILES: [&str; 2] = ["p50", "p90"];

/// |a − b| / b in %, per gated metric and quantile, of two `inspect summarize --json`.
fn distance(a: &Value, b: &Value) -> Vec<(&'static str, &'static str, f64)> {
    let mut out = Vec::new();
    for m in METRICS {
        for q in QUANTILES {
            let (x, y) = (a[m][q].as_f64().unwrap(), b[m][q].as_f64().unwrap());
            out.push((m, q, ((x - y) / y * 100.0).abs()));
        }
    }
    out
}

#[test]
fn the_fitted_model_reproduces_unseen_captures_within_the_engines_own_noise() {
    let dir = std::env::temp_dir().join(format!("vllm-vcr-gates-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    // the noise floor
    let summarize = |name: &str| {
        json_of(&[
            "inspect",
            "summarize",
            corpus(name).to_str().unwrap(),
            "--json",
        ])
    };
    let noise = distance(
        &summarize("concurrency-8-s0-repeat.trace.jsonl.gz"),
        &summarize("concurrency-8-s0.trace.jsonl.gz"),
    );
    let tolerance = |m: &str, q: &str| {
        let d = noise.iter().find(|(a, b, _)| *a == m && *b == q).unwrap().2;
        (1.5 * d).max(2.0)
    };

    // the fit set: every `fit` capture (seed 0) with its step-stats sidecar
    let mut fit: Vec<String> = Vec::new();
    let mut steps: Vec<String> = Vec::new();
    for e in std::fs::read_dir(corpus("")).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        if name.ends_with("-s0.trace.jsonl.gz") {
            fit.push(p.to_str().unwrap().to_string());
            steps.push(
                p.to_str()
                    .unwrap()
                    .replace(".trace.jsonl.gz", ".steps.jsonl.gz"),
            );
        }
    }
    fit.sort();
    steps.sort();
    assert!(fit.len() >= 5, "the fit set is too small: {fit:?}");
    let model = dir.join("corpus-fit.json");
    let mut cmd = bin();
    cmd.args(["inspect", "fit"])
        .args(&fit)
        .arg("--steps")
        .args(&steps);
    let out = cmd.arg("-o").arg(&model).output().unwrap();
    assert!(
        out.status.success(),
        "inspect fit: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let mut report = Vec::new();
    let mut failed = Vec::new();
    for c in [8, 16] {
        let gate = corpus(&format!("concurrency-{c}-s1.trace.jsonl.gz"));
        let n = c.to_string();
        let v = json_of(&[
            "inspect",
            "calibrate",
            gate.to_str().unwrap(),
            "--latency-trace",
            model.to_str().unwrap(),
            "--max-num-seqs",
            "128",
            "--replay-concurrency",
            &n,
            "--json",
        ]);
        assert_eq!(
            v["fit_set"]["in_sample"], false,
            "the gate trace must not be in the fit set: {}",
            v["fit_set"]
        );
        let all = v["cohorts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["cohort"] == "all")
            .unwrap();
        for m in METRICS {
            for q in QUANTILES {
                let d = all[m]["modelled_delta_pct"][q].as_f64().unwrap();
                let tol = tolerance(m, q);
                let cell = format!("c={c} {m} {q}: {d:+.1} % (tolerance ±{tol:.1} %)");
                if d.abs() > tol {
                    failed.push(cell.clone());
                }
                report.push(cell);
            }
        }
    }
    eprintln!("noise floor (c=8 run against its repeat): {noise:?}");
    eprintln!("{}", report.join("\n"));
    assert!(
        failed.is_empty(),
        "out of tolerance:\n  {}\nall cells:\n  {}",
        failed.join("\n  "),
        report.join("\n  ")
    );
}
