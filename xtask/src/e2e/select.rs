//! What `cargo xtask e2e`'s flags select: the options, which groups of legs run, and the
//! frontends those legs run (each checked to be in the cache before anything starts).

use std::path::PathBuf;

use anyhow::{Result, bail};
use vcr_host::frontends;

use crate::compat::{Compat, Line};
use crate::fetch;

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

/// The groups of legs that run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Groups {
    pub(crate) basic: bool,
    pub(crate) scheduler: bool,
    pub(crate) record: bool,
    pub(crate) replay: bool,
    /// Only with `--cpu-engine` (the leg runs the real CPU engine).
    pub(crate) parity: bool,
}

impl Groups {
    /// With any `--X-only`, the groups named so run; otherwise every group not skipped.
    pub(crate) fn of(opts: &Options) -> Result<Groups> {
        let picks = [opts.scheduler, opts.record, opts.replay, opts.parity];
        let any_only = picks.contains(&GroupPick::Only);
        let with = |g: GroupPick| {
            if any_only {
                g == GroupPick::Only
            } else {
                g != GroupPick::Skip
            }
        };
        if opts.parity == GroupPick::Only && !opts.cpu_engine {
            bail!("--parity-only needs --cpu-engine (the leg runs the real CPU engine)");
        }
        Ok(Groups {
            basic: !any_only,
            scheduler: with(opts.scheduler),
            record: with(opts.record),
            replay: with(opts.replay),
            parity: with(opts.parity) && opts.cpu_engine,
        })
    }
}

/// The Python frontend (`vllm serve` of compat.toml's `[python_frontend]`).
pub(crate) struct Python {
    pub(crate) venv: PathBuf,
    /// Its release, e.g. `0.32.0`.
    pub(crate) version: String,
    /// Its line, e.g. `0.32`.
    pub(crate) line: String,
}

/// The frontends the selected legs run.
pub(crate) struct Frontends {
    pub(crate) cache: PathBuf,
    /// The selected lines whose vllm-rs runs (none with `--python-only`).
    pub(crate) rs_lines: Vec<Line>,
    /// With `--python` or `--python-only`.
    pub(crate) python: Option<Python>,
}

impl Frontends {
    /// The frontends `opts` select, each checked to be fetched: vllm-rs of every selected
    /// line when the basic legs run (else of the default line, the only one the other legs
    /// use), and the Python frontend when asked for.
    pub(crate) fn find(compat: &Compat, opts: &Options, basic: bool) -> Result<Frontends> {
        let cache = frontends::cache_root()?;
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
        let py = &compat.python_frontend;
        let venv = frontends::python_venv(&cache, &py.package, &py.version);
        let python = if opts.python || opts.python_only {
            if !venv.join(".installed").is_file() {
                bail!(
                    "the Python frontend is not installed ({}); run `cargo xtask fetch --python` first",
                    venv.display()
                );
            }
            Some(Python {
                venv,
                version: py.version.clone(),
                line: py.version.split('.').take(2).collect::<Vec<_>>().join("."),
            })
        } else {
            None
        };
        Ok(Frontends {
            cache,
            rs_lines,
            python,
        })
    }

    /// The default line, when selected.
    pub(crate) fn rs_default(&self) -> Option<&Line> {
        self.rs_lines.iter().find(|l| l.default)
    }

    /// The vllm-rs binary of `line` in the cache.
    pub(crate) fn rs_bin(&self, line: &Line) -> PathBuf {
        frontends::vllm_rs_path(&self.cache, &line.tag)
    }

    /// The real CPU engine's venv (`fetch --cpu-engine`), or why it cannot run.
    pub(crate) fn cpu_engine(&self) -> Result<PathBuf> {
        let cpu = frontends::python_venv(
            &self.cache,
            fetch::CPU_ENGINE_PACKAGE,
            fetch::CPU_ENGINE_VERSION,
        );
        if !cpu.join(".installed").is_file() {
            bail!(
                "the real CPU engine is not installed ({}); run `cargo xtask fetch --cpu-engine` first",
                cpu.display()
            );
        }
        Ok(cpu)
    }
}
