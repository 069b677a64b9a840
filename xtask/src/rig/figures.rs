//! `cargo xtask figures`: the fidelity tables and figures of docs/fidelity.md, regenerated
//! from the conformance corpus. For each configuration (`config_hash`) with a `gate`
//! capture, one model fitted on its `fit` captures (`inspect fit`); each `gate` capture
//! calibrated against it (`inspect calibrate --json --plot`, arrivals as the manifest's
//! `calibrate_args` say); the engine's own run-to-run distance (`inspect compare` of the
//! `noise` capture and its `fit` twin) and prefix caching on against off (`inspect compare`
//! of the two session captures). Writes `docs/fidelity-table.md` and the pooled figures
//! under `docs/figures/`, then the held-out evaluation of corpus v2 ([`crate::rig::heldout`]:
//! `docs/heldout-table.md`, its heatmap and step-class figures). The fleet figure
//! (`docs/figures/fleet-sessions-ttft-p90.svg`, described in docs/fleet.md): the sessions
//! gate capture under its configuration's model through 1 to 8 replicas behind each
//! router (`inspect simulate --engines N --route R`), TTFT p90 per replica count. The
//! simulation runs on a virtual clock, so the output is the same on every run of the same
//! binary.

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

    // a fleet of replicas behind each router, on the multi-turn sessions
    match gate_of(&captures, FLEET_WORKLOAD) {
        Some(g) => {
            let model = models
                .get(&g.config_hash)
                .context("the fleet figure's capture has no fitted model")?;
            let points = fleet_points(engine, &path(g), model)?;
            let svg = fleet_svg(&points, &g.file);
            std::fs::create_dir_all(&fig_root)?;
            std::fs::write(fig_root.join(FLEET_FIGURE), svg)?;
            eprintln!("figures: {FLEET_FIGURE}: {}", fleet_line(&points));
            let page = docs.join("fleet.md");
            let text = std::fs::read_to_string(&page)
                .with_context(|| format!("reading {}", page.display()))?;
            std::fs::write(&page, splice_fleet_table(&text, &fleet_table(&points))?)
                .with_context(|| format!("writing {}", page.display()))?;
        }
        None => eprintln!("figures: no {FLEET_WORKLOAD} gate capture: {FLEET_FIGURE} skipped"),
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

/// The workload of the fleet figure (multi-turn conversations sharing a prefix), how its
/// sessions are sent (every conversation at once: the capture holds 64), the
/// replica counts and the routes (`inspect simulate --engines N --route R`).
const FLEET_WORKLOAD: &str = "sessions";
const FLEET_ARRIVALS: [&str; 3] = ["--replay-sessions", "--replay-concurrency", "64"];
const FLEET_REPLICAS: std::ops::RangeInclusive<usize> = 1..=8;
const FLEET_ROUTES: [&str; 4] = ["round-robin", "least-loaded", "prefix-aware", "kv-aware"];
const FLEET_FIGURE: &str = "fleet-sessions-ttft-p90.svg";

/// One simulated fleet: its route and size, pooled TTFT p90 (ms) and prefix-cache hit
/// ratio.
struct FleetPoint {
    route: &'static str,
    replicas: usize,
    ttft_p90_ms: f64,
    hit_ratio: f64,
}

/// The gate capture of `workload`, if the corpus has one.
fn gate_of<'a>(captures: &'a [Entry], workload: &str) -> Option<&'a Entry> {
    captures
        .iter()
        .find(|e| e.role == "gate" && e.workload == workload)
}

/// `trace` under `model` through every route at every replica count.
fn fleet_points(engine: &Path, trace: &Path, model: &Path) -> Result<Vec<FleetPoint>> {
    let mut points = Vec::new();
    for route in FLEET_ROUTES {
        for n in FLEET_REPLICAS {
            let mut cmd = Command::new(engine);
            cmd.args(["inspect", "simulate"])
                .arg(trace)
                .arg("--latency-trace")
                .arg(model)
                .args(FLEET_ARRIVALS)
                .args(["--engines", &n.to_string(), "--route", route, "--json"]);
            let v = json_of(&mut cmd, "inspect simulate --engines")?;
            let (Some(p90), Some(hit)) = (
                v["summary"]["ttft_ms"]["p90"].as_f64(),
                v["prefix_cache_hit_ratio"].as_f64(),
            ) else {
                bail!(
                    "inspect simulate --engines {n} --route {route}: no TTFT p90 or hit ratio in {v}"
                );
            };
            points.push(FleetPoint {
                route,
                replicas: n,
                ttft_p90_ms: p90,
                hit_ratio: hit,
            });
        }
    }
    Ok(points)
}

/// The points as one line per route (`route: n=p90 ms (hit %), …`), for the log.
fn fleet_line(points: &[FleetPoint]) -> String {
    FLEET_ROUTES
        .iter()
        .map(|r| {
            let cells: Vec<String> = points
                .iter()
                .filter(|p| p.route == *r)
                .map(|p| {
                    format!(
                        "{}: {:.0} ms ({:.0} %)",
                        p.replicas,
                        p.ttft_p90_ms,
                        p.hit_ratio * 100.0
                    )
                })
                .collect();
            format!("{r} [{}]", cells.join(", "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The markers in docs/fleet.md between which the figure's numbers are written.
const FLEET_TABLE_MARKERS: (&str, &str) =
    ("<!-- fleet-table: begin -->", "<!-- fleet-table: end -->");

/// The figure's numbers as a Markdown table: TTFT p90 (ms) and hit % per replica count
/// (rows) and route (columns).
fn fleet_table(points: &[FleetPoint]) -> String {
    let mut s = format!(
        "| replicas | {} |\n|---:|{}\n",
        FLEET_ROUTES.join(" | "),
        "---|".repeat(FLEET_ROUTES.len())
    );
    for n in FLEET_REPLICAS {
        let cells: Vec<String> = FLEET_ROUTES
            .iter()
            .map(|r| {
                points
                    .iter()
                    .find(|p| p.route == *r && p.replicas == n)
                    .map_or("–".to_string(), |p| {
                        format!("{:.0} ({:.0} %)", p.ttft_p90_ms, p.hit_ratio * 100.0)
                    })
            })
            .collect();
        s.push_str(&format!("| {n} | {} |\n", cells.join(" | ")));
    }
    s
}

/// `page` with the text between the fleet table's markers replaced by `table`.
fn splice_fleet_table(page: &str, table: &str) -> Result<String> {
    let (begin, end) = FLEET_TABLE_MARKERS;
    let (Some(b), Some(e)) = (page.find(begin), page.find(end)) else {
        bail!("docs/fleet.md has no {begin} … {end} markers for the fleet table");
    };
    if e < b {
        bail!("docs/fleet.md: {end} comes before {begin}");
    }
    Ok(format!("{}{begin}\n{table}{}", &page[..b], &page[e..]))
}

/// p90 TTFT against replicas, one line per route, with each point's hit ratio beside it.
fn fleet_svg(points: &[FleetPoint], trace: &str) -> String {
    const COLORS: [&str; 4] = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"];
    let (w, h, left, right, top, bottom) = (640.0, 400.0, 64.0, 150.0, 48.0, 48.0);
    let (pw, ph) = (w - left - right, h - top - bottom);
    let (lo, hi) = (*FLEET_REPLICAS.start() as f64, *FLEET_REPLICAS.end() as f64);
    let top_ms = points.iter().map(|p| p.ttft_p90_ms).fold(0.0, f64::max);
    let step = nice_step(top_ms / 5.0);
    let y_max = (top_ms / step).ceil().max(1.0) * step;
    let x = |n: f64| left + (n - lo) / (hi - lo) * pw;
    let y = |ms: f64| top + ph - ms / y_max * ph;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"10\" y=\"18\" font-size=\"13\">TTFT p90 against replicas, per route: {trace}</text>\n<text x=\"10\" y=\"34\">inspect simulate {} --engines N --route R; labels: prefix-cache hit %</text>\n",
        FLEET_ARRIVALS.join(" ")
    );
    let mut ms = 0.0;
    while ms <= y_max + step / 2.0 {
        let _ = writeln!(
            s,
            "<line x1=\"{left}\" y1=\"{yy:.1}\" x2=\"{:.1}\" y2=\"{yy:.1}\" stroke=\"#dddddd\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{ms}</text>",
            left + pw,
            left - 6.0,
            y(ms) + 4.0,
            yy = y(ms)
        );
        ms += step;
    }
    for n in FLEET_REPLICAS {
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{n}</text>",
            x(n as f64),
            top + ph + 16.0
        );
    }
    let _ = writeln!(
        s,
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">replicas</text><text transform=\"translate(16 {:.1}) rotate(-90)\" text-anchor=\"middle\">TTFT p90 (ms)</text>",
        left + pw / 2.0,
        h - 10.0,
        top + ph / 2.0
    );
    for (i, route) in FLEET_ROUTES.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mine: Vec<&FleetPoint> = points.iter().filter(|p| p.route == *route).collect();
        let line: Vec<String> = mine
            .iter()
            .map(|p| format!("{:.1},{:.1}", x(p.replicas as f64), y(p.ttft_p90_ms)))
            .collect();
        let _ = writeln!(
            s,
            "<polyline points=\"{}\" fill=\"none\" stroke=\"{color}\" stroke-width=\"2\"/>",
            line.join(" ")
        );
        for p in &mine {
            let _ = writeln!(
                s,
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{color}\"/><text x=\"{:.1}\" y=\"{:.1}\" fill=\"{color}\" font-size=\"9\">{:.0}</text>",
                x(p.replicas as f64),
                y(p.ttft_p90_ms),
                x(p.replicas as f64) + 4.0,
                y(p.ttft_p90_ms) - 5.0 + 10.0 * i as f64,
                p.hit_ratio * 100.0
            );
        }
        let ly = top + 16.0 * i as f64;
        let _ = writeln!(
            s,
            "<line x1=\"{:.1}\" y1=\"{ly:.1}\" x2=\"{:.1}\" y2=\"{ly:.1}\" stroke=\"{color}\" stroke-width=\"2\"/><text x=\"{:.1}\" y=\"{:.1}\">{route}</text>",
            left + pw + 12.0,
            left + pw + 32.0,
            left + pw + 38.0,
            ly + 4.0
        );
    }
    s.push_str("</svg>\n");
    s
}

/// A round axis step near `raw` (1, 2 or 5 times a power of ten).
fn nice_step(raw: f64) -> f64 {
    if raw.is_nan() || raw <= 0.0 {
        return 1.0;
    }
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * p)
        .find(|&v| v >= raw)
        .unwrap_or(10.0 * p)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A point per route and replica count, TTFT p90 `ttft(n)` at `n` replicas, hits 50 %.
    fn points(ttft: fn(usize) -> f64) -> Vec<FleetPoint> {
        FLEET_ROUTES
            .iter()
            .flat_map(|&route| {
                FLEET_REPLICAS.map(move |n| FleetPoint {
                    route,
                    replicas: n,
                    ttft_p90_ms: ttft(n),
                    hit_ratio: 0.5,
                })
            })
            .collect()
    }

    #[test]
    fn the_fleet_table_is_written_between_its_markers_and_nowhere_else() {
        let points = points(|n| 100.0 + n as f64);
        let table = fleet_table(&points);
        assert!(table.starts_with("| replicas | round-robin | least-loaded | prefix-aware | kv-aware |\n|---:|---|---|---|---|\n"));
        assert!(table.contains("| 3 | 103 (50 %) | 103 (50 %) | 103 (50 %) | 103 (50 %) |\n"));
        let (b, e) = FLEET_TABLE_MARKERS;
        let page = format!("intro\n{b}\nold table\n{e}\nafter\n");
        let out = splice_fleet_table(&page, &table).unwrap();
        assert_eq!(out, format!("intro\n{b}\n{table}{e}\nafter\n"));
        assert!(splice_fleet_table("no markers", &table).is_err());
    }

    #[test]
    fn axis_steps_are_round() {
        assert_eq!(nice_step(40.4), 50.0);
        assert_eq!(nice_step(12.0), 20.0);
        assert_eq!(nice_step(0.3), 0.5);
        assert_eq!(nice_step(0.0), 1.0);
    }

    #[test]
    fn the_fleet_figure_has_a_line_per_route_and_a_point_per_replica_count() {
        let points = points(|n| 200.0 / n as f64);
        let svg = fleet_svg(&points, "t.jsonl");
        assert_eq!(svg.matches("<polyline").count(), FLEET_ROUTES.len());
        assert_eq!(
            svg.matches("<circle").count(),
            FLEET_ROUTES.len() * FLEET_REPLICAS.count()
        );
        assert!(svg.ends_with("</svg>\n"));
        // 200 ms at one replica: the top of a 0..200 axis (drawn at y = 48)
        assert!(svg.contains("points=\"64.0,48.0 "), "{svg}");
        assert!(fleet_line(&points).starts_with("round-robin [1: 200 ms (50 %)"));
    }
}
