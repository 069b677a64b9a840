//! `cargo xtask figures`: the fidelity tables and figures of docs/fidelity.md, regenerated
//! from the conformance corpus. For each configuration (`config_hash`) with a `gate`
//! capture, one model fitted on its `fit` captures (`inspect fit`); each `gate` capture
//! calibrated against it (`inspect calibrate --json --plot`, arrivals as the manifest's
//! `calibrate_args` say); the engine's own run-to-run distance (`inspect compare` of the
//! `noise` capture and its `fit` twin) and prefix caching on against off (`inspect compare`
//! of the two session captures). Writes `docs/fidelity-table.md` and the pooled figures
//! under `docs/figures/`, then the held-out evaluation of corpus v2 ([`crate::rig::heldout`]:
//! `docs/heldout-table.md`, its heatmap and step-class figures). The simulation runs on a virtual clock, so the output is the same
//! on every run of the same binary.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::rig::corpus::{self, Entry};
use crate::rig::tool::{json_of, run_quiet};

/// The figures kept per calibrated workload (the pooled cohort; calibrate also draws the
/// per-cohort ones, left out to keep the repository small).
const KEPT: [&str; 6] = [
    "ttft-survival-all.svg",
    "ttft-qq-all.svg",
    "itl-survival-all.svg",
    "itl-qq-all.svg",
    "chunk-sizes.svg",
    "ttft-per-turn.svg",
];

pub fn run(root: &Path, engine: &Path) -> Result<()> {
    let t0 = Instant::now();
    let corpus_dir = root.join("conformance");
    let docs = root.join("docs");
    let fig_root = docs.join("figures");
    let captures = corpus::captures(&corpus_dir)?;
    if captures.is_empty() {
        bail!(
            "{} lists no captures (capture the corpus first: cargo xtask corpus)",
            corpus_dir.join("manifest.toml").display()
        );
    }
    let path = |e: &Entry| corpus_dir.join(&e.file);
    let work = std::env::temp_dir().join(format!("vllm-vcr-figures-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let _ = std::fs::remove_dir_all(&fig_root);

    // one model per configuration
    let mut models: BTreeMap<String, PathBuf> = BTreeMap::new();
    for g in captures.iter().filter(|e| e.role == "gate") {
        if models.contains_key(&g.config_hash) {
            continue;
        }
        let fit: Vec<&Entry> = captures
            .iter()
            .filter(|e| e.role == "fit" && e.config_hash == g.config_hash)
            .collect();
        if fit.is_empty() {
            bail!("no fit capture shares the configuration of {}", g.file);
        }
        let model = work.join(format!("fit-{}.json", &g.config_hash[..12]));
        let mut cmd = Command::new(engine);
        cmd.args(["inspect", "fit"]);
        cmd.args(fit.iter().map(|e| path(e)));
        cmd.arg("--steps");
        cmd.args(fit.iter().map(|e| corpus_dir.join(&e.steps)));
        cmd.arg("-o").arg(&model);
        run_quiet(&mut cmd, "inspect fit")?;
        eprintln!(
            "figures: fitted {} on {}",
            &g.config_hash[..12],
            fit.iter()
                .map(|e| e.workload.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
        models.insert(g.config_hash.clone(), model);
    }

    // every gate capture, calibrated, in the corpus's order of workloads
    let rank = |w: &str| {
        corpus::WORKLOADS
            .iter()
            .position(|x| x.name == w)
            .unwrap_or(usize::MAX)
    };
    let mut gates: Vec<&Entry> = captures.iter().filter(|e| e.role == "gate").collect();
    gates.sort_by_key(|e| (rank(&e.workload), e.file.clone()));
    let mut results: Vec<(&Entry, Value)> = Vec::new();
    for g in gates {
        let dir = work.join(&g.workload);
        let mut cmd = Command::new(engine);
        cmd.args(["inspect", "calibrate"])
            .arg(path(g))
            .arg("--latency-trace")
            .arg(&models[&g.config_hash])
            .arg("--json")
            .arg("--plot")
            .arg(&dir)
            .args(g.calibrate_args.split_whitespace());
        let v = json_of(&mut cmd, "inspect calibrate")?;
        keep_figures(&dir, &fig_root.join(&g.workload))?;
        eprintln!("figures: calibrated {}", g.workload);
        results.push((g, v));
    }

    // the engine against itself, and prefix caching on against off
    let find = |stem: &str| {
        captures
            .iter()
            .find(|e| e.file.ends_with(&format!("/{stem}.trace.jsonl.gz")))
    };
    let mut comparisons: Vec<(String, String, Value)> = Vec::new();
    for (name, title, pair, labels) in [
        (
            "noise-concurrency-8",
            "The engine against itself: concurrency 8, seed 0, captured twice",
            ["concurrency-8-s0", "concurrency-8-s0-repeat"],
            ["seed 0", "seed 0, again"],
        ),
        (
            "sessions-prefix-caching",
            "Multi-turn sessions with and without prefix caching (gate captures)",
            ["sessions-s1", "sessions-no-prefix-cache-s1"],
            ["prefix caching", "no prefix caching"],
        ),
    ] {
        let (Some(a), Some(b)) = (find(pair[0]), find(pair[1])) else {
            eprintln!(
                "figures: {name}: {} or {} not in the corpus, skipped",
                pair[0], pair[1]
            );
            continue;
        };
        let dir = work.join(name);
        let mut cmd = Command::new(engine);
        cmd.args(["inspect", "compare"])
            .arg(path(a))
            .arg(path(b))
            .args([
                "--label", labels[0], "--label", labels[1], "--json", "--plot",
            ])
            .arg(&dir);
        let v = json_of(&mut cmd, "inspect compare")?;
        keep_figures(&dir, &fig_root.join(name))?;
        comparisons.push((name.to_string(), title.to_string(), v));
    }

    let table = render(&results, &comparisons, &fig_root, &docs);
    let out = docs.join("fidelity-table.md");
    std::fs::write(&out, table).with_context(|| format!("writing {}", out.display()))?;
    if let Some(held) = crate::rig::heldout::write(engine, root, &work)? {
        eprintln!("figures: wrote {}", held.display());
    }
    let _ = std::fs::remove_dir_all(&work);
    let (files, bytes) = dir_size(&fig_root);
    eprintln!(
        "figures: wrote {} and {files} figures ({:.0} KB) under {} in {:.1} s",
        out.display(),
        bytes as f64 / 1024.0,
        fig_root.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Move the [`KEPT`] figures of `from` into `to`.
fn keep_figures(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for name in KEPT {
        let f = from.join(name);
        if f.exists() {
            std::fs::copy(&f, to.join(name)).with_context(|| format!("copying {}", f.display()))?;
        }
    }
    Ok(())
}

/// Files and bytes under `dir` (none when it does not exist).
pub(crate) fn dir_size(dir: &Path) -> (usize, u64) {
    let mut n = 0;
    let mut bytes = 0;
    for d in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = d.path();
        if p.is_dir() {
            let (a, b) = dir_size(&p);
            n += a;
            bytes += b;
        } else {
            n += 1;
            bytes += p.metadata().map_or(0, |m| m.len());
        }
    }
    (n, bytes)
}

const METRICS: [(&str, &str); 3] = [
    ("ttft_ms", "TTFT"),
    ("itl_ms", "ITL"),
    ("request_total_ms", "request total"),
];
const QS: [&str; 3] = ["p50", "p90", "p99"];

fn num(v: &Value) -> String {
    match v.as_f64() {
        Some(x) if x.abs() >= 100.0 => format!("{x:.1}"),
        Some(x) => format!("{x:.2}"),
        None => "–".into(),
    }
}

fn pct(v: &Value) -> String {
    v.as_f64()
        .map_or("–".into(), |x| format!("{x:+.1}").replace('-', "−"))
}

fn render(
    results: &[(&Entry, Value)],
    comparisons: &[(String, String, Value)],
    fig_root: &Path,
    docs: &Path,
) -> String {
    let rel = |p: &Path| p.strip_prefix(docs).unwrap_or(p).display().to_string();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# Fidelity tables\n\n\
         Written by `cargo xtask figures` (xtask/src/rig/figures.rs) from the conformance corpus;\n\
         do not edit by hand. How the corpus was captured and what the numbers mean:\n\
         [fidelity.md](fidelity.md).\n\n\
         Every `gate` capture (seed 1) is simulated by `inspect calibrate` under a model\n\
         fitted on the `fit` captures (seed 0) of its configuration: **modelled** is that\n\
         simulation, **knobs** the best-fit constant-plus-log-normal latency knobs, Δ % is\n\
         against the capture. n is requests (TTFT, request total) or gaps (ITL); cohorts\n\
         group requests by the requests in flight when they arrived.\n"
    );
    let _ = writeln!(
        s,
        "## Pooled, Δ % modelled against captured (p50 / p90 / p99)\n"
    );
    let _ = writeln!(
        s,
        "| gate capture | arrivals | n | TTFT | ITL | request total |"
    );
    let _ = writeln!(s, "|---|---|---:|---|---|---|");
    for (e, v) in results {
        let all = cohort(v, "all");
        let cell = |m: &str| {
            QS.iter()
                .map(|q| pct(&all[m]["modelled_delta_pct"][q]))
                .collect::<Vec<_>>()
                .join(" / ")
        };
        let arrivals = if e.calibrate_args.is_empty() {
            "recorded".to_string()
        } else {
            format!("`{}`", e.calibrate_args)
        };
        let _ = writeln!(
            s,
            "| {} | {arrivals} | {} | {} | {} | {} |",
            e.workload,
            all["requests"],
            cell("ttft_ms"),
            cell("itl_ms"),
            cell("request_total_ms")
        );
    }
    for (name, title, v) in comparisons {
        let _ = writeln!(s, "\n## {title}\n");
        let labels: Vec<String> = v["traces"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| t["label"].as_str().unwrap_or("").to_string())
            .collect();
        let _ = writeln!(
            s,
            "`inspect compare` of {}; Δ % of the second against the first.\n",
            labels.join(" and ")
        );
        let _ = writeln!(
            s,
            "| cohort | metric | n | {} p50 / p90 / p99 | {} p50 / p90 / p99 | Δ % |",
            labels.first().map_or("", |x| x),
            labels.get(1).map_or("", |x| x)
        );
        let _ = writeln!(s, "|---|---|---:|---|---|---|");
        for c in v["cohorts"].as_array().into_iter().flatten() {
            let ts = c["traces"].as_array().cloned().unwrap_or_default();
            if ts.iter().any(|t| t["small"] == true) || ts.len() < 2 {
                continue;
            }
            for (key, label) in METRICS {
                let q = |t: &Value| {
                    QS.iter()
                        .map(|x| num(&t[key]["quantiles"][x]))
                        .collect::<Vec<_>>()
                        .join(" / ")
                };
                let d = QS
                    .iter()
                    .map(|x| pct(&ts[1][key]["delta_pct"][x]))
                    .collect::<Vec<_>>()
                    .join(" / ");
                let _ = writeln!(
                    s,
                    "| {} | {label} | {} | {} | {} | {d} |",
                    c["cohort"].as_str().unwrap_or(""),
                    ts[0][key]["samples"],
                    q(&ts[0]),
                    q(&ts[1])
                );
            }
        }
        let turns = v["turns"].as_array().cloned().unwrap_or_default();
        if !turns.is_empty() {
            let _ = writeln!(s, "\nTTFT per session turn, p50 / p90 ms:\n");
            for t in &turns {
                let cells: Vec<String> = t["ttft_ms"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|x| {
                        format!(
                            "turn {}: {} / {}",
                            x["turn"],
                            num(&x["p50"]),
                            num(&x["p90"])
                        )
                    })
                    .collect();
                let _ = writeln!(
                    s,
                    "- {}: {}",
                    t["label"].as_str().unwrap_or(""),
                    cells.join(", ")
                );
            }
        }
        figure_links(&mut s, &fig_root.join(name), &rel);
    }
    for (e, v) in results {
        let _ = writeln!(s, "\n## {}\n", e.workload);
        let _ = writeln!(
            s,
            "`{}` ({} records; load: {}), {}.\n",
            e.file,
            v["records"],
            e.load,
            v["fit_set"]["why"].as_str().unwrap_or("")
        );
        let _ = writeln!(
            s,
            "| cohort | metric | q | n | captured | modelled | Δ % | knobs | Δ % |"
        );
        let _ = writeln!(s, "|---|---|---|---:|---:|---:|---:|---:|---:|");
        for c in v["cohorts"].as_array().into_iter().flatten() {
            if c["gated"] != true {
                continue;
            }
            for (key, label) in METRICS {
                for q in QS {
                    let m = &c[key];
                    let _ = writeln!(
                        s,
                        "| {} | {label} | {q} | {} | {} | {} | {} | {} | {} |",
                        c["cohort"].as_str().unwrap_or(""),
                        m["samples"]["captured"],
                        num(&m["captured"][q]),
                        num(&m["modelled"][q]),
                        pct(&m["modelled_delta_pct"][q]),
                        num(&m["knobs"][q]),
                        pct(&m["knobs_delta_pct"][q])
                    );
                }
            }
        }
        let _ = writeln!(
            s,
            "\nKnobs: `{}`. Cohorts with fewer than {} requests are left out.",
            v["knobs"]["flags"].as_str().unwrap_or(""),
            v["min_requests"]
        );
        figure_links(&mut s, &fig_root.join(&e.workload), &rel);
    }
    s
}

fn cohort<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["cohorts"]
        .as_array()
        .and_then(|c| c.iter().find(|x| x["cohort"] == name))
        .unwrap_or(&Value::Null)
}

fn figure_links(s: &mut String, dir: &Path, rel: &dyn Fn(&Path) -> String) {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|d| d.file_name().to_str().map(String::from))
        .filter(|n| n.ends_with(".svg"))
        .collect();
    names.sort();
    if names.is_empty() {
        return;
    }
    let links: Vec<String> = names
        .iter()
        .map(|n| format!("[{}]({})", n.trim_end_matches(".svg"), rel(&dir.join(n))))
        .collect();
    let _ = writeln!(s, "\nFigures: {}.", links.join(", "));
}
