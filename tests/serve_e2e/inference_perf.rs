//! inference-perf (0.7.0, pinned from PyPI; it declares Python 3.12 and runs on the 3.11
//! the cache installs with, see `vllm_vcr::frontends::load_generators`) against `serve`:
//! its `random` generator at concurrency 1, whose TTFT and ITL read back the knobs, and
//! its `trace_replay` of the Azure CSV that `inspect convert --to azure` writes from a
//! Mooncake trace. `random` builds prompts of an exact length from random ids, which
//! round-trip only in the `--tiny-vocab chars` vocabulary, so serve runs with it.

use std::path::Path;

use serde_json::Value;

use super::load_generators::{
    MOONCAKE_BLOCK, MOONCAKE_ROWS, Served, assert_knobs_read_back, mooncake_totals, run_tool,
    serve_with_knobs, tool_venv, write_mooncake,
};
use super::*;
use crate::support::{Disturbance, inspect};
use vllm_vcr::frontends::load_generators::{INFERENCE_PERF_VERSION, fetch_inference_perf};

/// The tokenizer of `serve --tiny-vocab chars`, by its hub id.
const TOKENIZER: &str = "vllm-vcr/tiny-chars";

/// Run inference-perf with the configuration whose `data:` and `load:` sections are
/// `workload` (YAML), against the server on `port`; its summary lifecycle metrics.
fn inference_perf(venv: &Path, port: u16, hub: &Path, dir: &Path, workload: &str) -> Value {
    let reports = dir.join("reports");
    let config = format!(
        "api:\n  type: completion\n  streaming: true\n{workload}\
         server:\n  type: vllm\n  model_name: tiny\n  base_url: http://127.0.0.1:{port}\n  ignore_eos: true\n\
         tokenizer:\n  pretrained_model_name_or_path: {TOKENIZER}\n\
         report:\n  request_lifecycle:\n    summary: true\n    per_request: true\n\
         storage:\n  local_storage:\n    path: {}\n",
        reports.display()
    );
    std::fs::create_dir_all(dir).unwrap();
    let file = dir.join("config.yml");
    std::fs::write(&file, config).unwrap();
    let log = run_tool(
        "inference-perf",
        Command::new(venv.join("bin").join("inference-perf"))
            .arg("--config_file")
            .arg(&file)
            .env("HF_HUB_CACHE", hub)
            .env("HF_HUB_OFFLINE", "1"),
    );
    let summary = reports.join("summary_lifecycle_metrics.json");
    serde_json::from_str(
        &std::fs::read_to_string(&summary)
            .unwrap_or_else(|e| panic!("no {} ({e}):\n{log}", summary.display())),
    )
    .unwrap()
}

/// `successes.<path>` of the summary, a number.
fn success(summary: &Value, path: &[&str]) -> f64 {
    let mut v = &summary["successes"];
    for p in path {
        v = &v[p];
    }
    v.as_f64()
        .unwrap_or_else(|| panic!("no successes.{path:?} in inference-perf's summary"))
}

/// Every request succeeded, and inference-perf's counts are the server's: its tokenizer
/// (found by id) agreed with the server's usage on every request, and the totals are what
/// the server's counters moved by. Returns the number of requests.
fn assert_counts_are_the_servers(summary: &Value, served: Served) -> f64 {
    let n = success(summary, &["count"]);
    assert!(n > 0.0, "no request succeeded");
    assert_eq!(summary["failures"]["count"], 0, "{}", summary["failures"]);
    assert_eq!(served.ok, n);
    assert_eq!(success(summary, &["token_count_mismatches"]), 0.0);
    for side in ["prompt", "output"] {
        assert_eq!(
            success(summary, &["client_fallback_requests", side]),
            0.0,
            "inference-perf counted {side} tokens itself"
        );
    }
    assert_eq!(success(summary, &["prompt_tokens", "total"]), served.prompt);
    assert_eq!(success(summary, &["output_tokens", "total"]), served.output);
    n
}

#[test]
fn inference_perf_runs_random_and_replays_an_azure_trace_against_serve() {
    let venv = tool_venv("inference-perf", fetch_inference_perf);
    let tmp = TestDir::new("serve-inference-perf");
    let hub = tmp.path("hub");
    let (mut serve, frontend_pid) = serve_with_knobs(&["--tiny-vocab", "chars"], &hub);

    // random prompts of exactly 48 tokens, 16 out, one request at a time
    let before = Served::read(serve.port);
    let probe = Disturbance::start();
    let summary = inference_perf(
        &venv,
        serve.port,
        &hub,
        &tmp.path("random"),
        "data:\n  type: random\n  \
         input_distribution: {min: 48, max: 48, mean: 48, std_dev: 0}\n  \
         output_distribution: {min: 16, max: 16, mean: 16, std_dev: 0}\n\
         load:\n  type: concurrent\n  stages:\n  - {num_requests: 12, concurrency_level: 1}\n",
    );
    let suffered = probe.finish();
    let served = Served::since(serve.port, before);
    assert_eq!(assert_counts_are_the_servers(&summary, served), 12.0);
    assert_eq!((served.prompt, served.output), (12.0 * 48.0, 12.0 * 16.0));
    let (ttft, itl) = (
        latency_of(&summary, "time_to_first_token"),
        latency_of(&summary, "inter_token_latency"),
    );
    assert_knobs_read_back("inference-perf", ttft, itl, served, suffered);
    eprintln!("inference-perf {INFERENCE_PERF_VERSION} random: 12 of 12 requests");

    // the Mooncake trace as a trace, then as the Azure CSV trace_replay reads: its
    // arrivals drive the load, its lengths the prompts
    let mooncake = tmp.path("mooncake.jsonl");
    write_mooncake(&mooncake);
    let (trace, azure) = (tmp.path("trace.jsonl"), tmp.path("azure.csv"));
    inspect("convert", &["--from", "mooncake", "--block-size"])
        .arg(MOONCAKE_BLOCK.to_string())
        .arg(&mooncake)
        .arg("-o")
        .arg(&trace)
        .run();
    inspect("convert", &["--to", "azure"])
        .arg(&trace)
        .arg("-o")
        .arg(&azure)
        .run();
    let before = Served::read(serve.port);
    let azure = azure.display();
    let summary = inference_perf(
        &venv,
        serve.port,
        &hub,
        &tmp.path("replay"),
        &format!(
            "data:\n  type: random\n  trace:\n    file: {azure}\n\
             load:\n  type: trace_replay\n  trace:\n    file: {azure}\n  \
             stages:\n  - {{rate: 1, duration: 1}}\n"
        ),
    );
    let served = Served::since(serve.port, before);
    let n = assert_counts_are_the_servers(&summary, served);
    // every row of the trace, with its lengths
    assert_eq!(n, MOONCAKE_ROWS.len() as f64);
    assert_eq!((served.prompt, served.output), mooncake_totals());
    eprintln!(
        "inference-perf {INFERENCE_PERF_VERSION} trace_replay: {n} of {} requests, TTFT p50 {:.2} ms, ITL p50 {:.2} ms",
        MOONCAKE_ROWS.len(),
        latency_of(&summary, "time_to_first_token"),
        latency_of(&summary, "inter_token_latency"),
    );
    assert_ctrl_c_stops_everything(&mut serve, frontend_pid);
}

/// The median of latency `name` of a summary, ms.
fn latency_of(summary: &Value, name: &str) -> f64 {
    success(summary, &["latency", name, "median"]) * 1e3
}
