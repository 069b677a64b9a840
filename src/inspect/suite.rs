//! `inspect suite`: drive the calibration suite's load against a frontend, so that a
//! `record` tap in front of the engine captures what a model for that engine is fitted on.
//!
//! The suite is a short fixed set of `bench serve` loads ([`sim_trace::loads`]: lengths
//! from short to near a 2,048-token context at 2 in flight, a batch of 12, a prefix-cache
//! mix at 6 requests a second, fixed lengths 6 at a time), the same the project's own fidelity table is fitted on.
//! Each load's command is printed before it runs, so it can be reproduced with `vllm bench
//! serve` (Python) as well as with `vllm-rs bench serve`; `--dry-run` only prints them.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::Args;
use sim_trace::loads::{CALIBRATION_SUITE, SUITE_SEEDS, workload};

#[derive(Debug, Clone, Args)]
pub struct SuiteArgs {
    /// The frontend to load: its base URL (`http://host:port`), as `bench serve` takes it.
    #[arg(long, value_name = "URL")]
    pub base_url: String,

    /// The model name the frontend serves.
    #[arg(long)]
    pub model: String,

    /// The model's tokenizer (a local model directory or a Hugging Face id), for
    /// `bench serve` to make prompts of the suite's lengths.
    #[arg(long, value_name = "DIR_OR_ID")]
    pub tokenizer: String,

    /// The `vllm-rs` binary whose `bench serve` sends the load (default: `vllm-rs` on
    /// $PATH, else the one of the default vLLM line from the cache, downloaded once).
    #[arg(long, value_name = "PATH")]
    pub bench_bin: Option<PathBuf>,

    /// Seeds of the loads' prompts and lengths: every load runs once per seed, in turn
    /// (comma-separated). A model fitted on two seeds' runs tells its terms apart better
    /// than one fitted on one: with one run, whether the cost of a prompt's attention over
    /// its earlier tokens is told apart from its per-token cost depends on which run it
    /// was, and short prompts are then modelled too slow. One seed halves the time.
    #[arg(long = "seeds", alias = "seed", value_delimiter = ',', value_name = "N,…",
          default_values_t = SUITE_SEEDS)]
    pub seeds: Vec<u64>,

    /// Only these workloads of the suite (comma-separated names).
    #[arg(long, value_delimiter = ',', value_name = "NAME,…")]
    pub only: Vec<String>,

    /// Print the commands without running them.
    #[arg(long)]
    pub dry_run: bool,
}

/// One load of the suite to send.
pub struct SuiteLoad {
    pub name: &'static str,
    pub seed: u64,
    /// What it is, for the comment above its command.
    pub what: String,
    /// The arguments after `bench serve`.
    pub args: Vec<String>,
}

/// The `bench serve` loads of the selected suite workloads, every seed's in turn.
pub fn commands(a: &SuiteArgs) -> Result<Vec<SuiteLoad>> {
    for name in &a.only {
        if !CALIBRATION_SUITE.contains(&name.as_str()) {
            bail!(
                "--only {name}: not a workload of the calibration suite ({})",
                CALIBRATION_SUITE.join(", ")
            );
        }
    }
    let mut out = Vec::new();
    for (&seed, name) in a
        .seeds
        .iter()
        .flat_map(|s| CALIBRATION_SUITE.iter().map(move |n| (s, n)))
    {
        if !a.only.is_empty() && !a.only.iter().any(|o| o == name) {
            continue;
        }
        let w = workload(name).with_context(|| format!("the suite names {name}, not declared"))?;
        let mut args: Vec<String> = [
            "--base-url",
            &a.base_url,
            "--model",
            &a.model,
            "--tokenizer",
            &a.tokenizer,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(w.bench_args(w.requests, seed, &dataset_dir()));
        out.push(SuiteLoad {
            name,
            seed,
            what: w.describe(),
            args,
        });
    }
    Ok(out)
}

/// Where a prefix-cache mix's `timed_trace` dataset is written before its load runs.
fn dataset_dir() -> PathBuf {
    std::env::temp_dir().join("vllm-vcr-suite-datasets")
}

/// A shell word: quoted when it holds anything a shell would read.
fn shell_word(w: &str) -> String {
    let plain = !w.is_empty()
        && w.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=,@%+".contains(c));
    if plain {
        w.to_string()
    } else {
        format!("'{}'", w.replace('\'', r"'\''"))
    }
}

pub fn run(a: &SuiteArgs) -> Result<()> {
    let commands = commands(a)?;
    let bench = match (&a.bench_bin, a.dry_run) {
        (Some(p), _) => p.clone(),
        (None, true) => PathBuf::from("vllm-rs"),
        (None, false) => vcr_host::frontends::find_vllm_rs(None, env!("VLLM_VCR_DEFAULT_TAG"))?,
    };
    crate::outln!(
        "# the calibration suite: {} load(s); run `vllm-vcr record` between the frontend and the engine while they run",
        commands.len()
    );
    for SuiteLoad {
        name,
        seed,
        what,
        args,
    } in &commands
    {
        let line = std::iter::once(bench.display().to_string())
            .chain(["bench".into(), "serve".into()])
            .chain(args.iter().cloned())
            .map(|w| shell_word(&w))
            .collect::<Vec<_>>()
            .join(" ");
        crate::outln!("\n# {name}, seed {seed}: {what}\n{line}");
        if a.dry_run {
            continue;
        }
        if let Some(w) = workload(name) {
            let dir = dataset_dir();
            w.write_dataset(w.requests, *seed, &dir)
                .with_context(|| format!("writing {name}'s dataset into {}", dir.display()))?;
        }
        let status = Command::new(&bench)
            .args(["bench", "serve"])
            .args(args)
            .status()
            .with_context(|| format!("running {}", bench.display()))?;
        if !status.success() {
            bail!("the suite's {name} load failed ({status}); the command is above");
        }
    }
    crate::outln!(
        "\n# then stop the tap and fit: vllm-vcr inspect fit --per-capture-speed TRACE --steps SIDECAR -o model.json"
    );
    Ok(())
}
