//! guidellm (0.8.1, pinned from PyPI; torch borrowed from a venv of the cache, see
//! `vllm_vcr::frontends::load_generators`) against `serve`: a synthetic run at concurrency
//! 1 whose TTFT and ITL read back the knobs, and its replay (`--profile kind=replay`) of
//! a Mooncake trace, every request of which reaches the server with the trace's lengths.

use std::path::Path;

use serde_json::Value;

use super::load_generators::{
    MOONCAKE_BLOCK, MOONCAKE_ROWS, Served, assert_knobs_read_back, mooncake_totals, run_tool,
    serve_with_knobs, tool_venv, write_mooncake,
};
use super::*;
use crate::support::Disturbance;
use vllm_vcr::frontends::load_generators::{GUIDELLM_VERSION, fetch_guidellm};

/// guidellm against one server, its tokenizer by hub id from the hub cache `hub`,
/// reports into `dir`.
struct Guidellm<'a> {
    venv: &'a Path,
    port: u16,
    hub: &'a Path,
    dir: &'a TestDir,
}

impl Guidellm<'_> {
    /// `guidellm run`, `args` choosing the data and the profile; the first benchmark of
    /// its JSON report (`<name>.json`).
    fn run(&self, name: &str, args: &[&str]) -> Value {
        let (venv, port, hub) = (self.venv, self.port, self.hub);
        let report = self.dir.path(&format!("{name}.json"));
        let log = run_tool(
            "guidellm",
            Command::new(venv.join("bin").join("guidellm"))
                .arg("run")
                .arg("--backend")
                .arg(format!(
                    "kind=openai_http,target=http://127.0.0.1:{port},model=tiny,request_format=/v1/completions"
                ))
                .args(["--tokenizer", "kind=huggingface_auto,model=vllm-vcr/tiny"])
                .args(args)
                .arg("--output")
                .arg(format!("kind=json,path={}", report.display()))
                .args(["--disable-console-interactive"])
                .env("HF_HUB_CACHE", hub)
                .env("HF_HUB_OFFLINE", "1"),
        );
        let report: Value = serde_json::from_str(
            &std::fs::read_to_string(&report)
                .unwrap_or_else(|e| panic!("no guidellm report ({e}):\n{log}")),
        )
        .unwrap();
        report["benchmarks"][0].clone()
    }
}

/// A metric of a benchmark: `path` under `metrics`, then the statistic of its
/// successful requests.
fn metric(bench: &Value, path: &[&str], stat: &str) -> f64 {
    let mut v = &bench["metrics"];
    for p in path {
        v = &v[p];
    }
    v["successful"][stat]
        .as_f64()
        .unwrap_or_else(|| panic!("no {path:?}.successful.{stat} in guidellm's report"))
}

/// The request totals of a benchmark: (successful, errored, incomplete).
fn totals(bench: &Value) -> (u64, u64, u64) {
    let t = &bench["metrics"]["request_totals"];
    let n = |k: &str| t[k].as_u64().unwrap_or(u64::MAX);
    (n("successful"), n("errored"), n("incomplete"))
}

#[test]
fn guidellm_runs_synthetic_and_replays_a_mooncake_trace_against_serve() {
    let venv = tool_venv("guidellm", fetch_guidellm);
    let tmp = TestDir::new("serve-guidellm");
    let hub = tmp.path("hub");
    let (mut serve, frontend_pid) = serve_with_knobs(&[], &hub);
    let tool = Guidellm {
        venv: &venv,
        port: serve.port,
        hub: &hub,
        dir: &tmp,
    };

    // synthetic, one request at a time: 12 prompts of 48 tokens, 16 out
    let before = Served::read(serve.port);
    let probe = Disturbance::start();
    let bench = tool.run(
        "synthetic",
        &[
            "--data",
            "kind=synthetic_text,prompt_tokens=48,output_tokens=16",
            "--profile",
            "kind=synchronous",
            "--constraint",
            "kind=max_requests,count=12",
        ],
    );
    let suffered = probe.finish();
    assert_eq!(totals(&bench), (12, 0, 0), "every request succeeded");
    // guidellm counts what the server's usage says; its prompts are exactly as long as
    // asked in the tokenizer it loaded by id, so the server counts the same
    let served = Served::since(serve.port, before);
    assert_eq!(served.ok, 12.0);
    assert_eq!(served.prompt, 12.0 * 48.0);
    assert_eq!(served.output, 12.0 * 16.0);
    assert_eq!(
        metric(&bench, &["text", "tokens", "input"], "total_sum"),
        served.prompt
    );
    assert_eq!(
        metric(&bench, &["text", "tokens", "output"], "total_sum"),
        served.output
    );
    let (ttft, itl) = (
        metric(&bench, &["time_to_first_token_ms"], "median"),
        metric(&bench, &["inter_token_latency_ms"], "median"),
    );
    assert_knobs_read_back("guidellm", ttft, itl, served, suffered);
    eprintln!("guidellm {GUIDELLM_VERSION} synthetic: 12 of 12 requests");

    // the Mooncake replay: arrivals at the trace's times (ms, hence time_scale 0.001)
    let trace = tmp.path("mooncake.jsonl");
    write_mooncake(&trace);
    let before = Served::read(serve.port);
    let data = serde_json::json!({
        "kind": "mooncake",
        "source": {"kind": "json_file", "path": trace},
        "hash_id_block_size": MOONCAKE_BLOCK,
    })
    .to_string();
    let bench = tool.run(
        "replay",
        &[
            "--data",
            &data,
            "--profile",
            "kind=replay,time_scale=0.001,schedule_turn=timestamp",
        ],
    );
    // every request of the trace reached the server and succeeded, with the trace's
    // prompt (guidellm built each from the hash-id blocks, in the tokenizer) and output
    // lengths
    let served = Served::since(serve.port, before);
    let (prompt, output) = mooncake_totals();
    assert_eq!(served.ok, MOONCAKE_ROWS.len() as f64);
    assert_eq!((served.prompt, served.output), (prompt, output));
    // guidellm 0.8.1 ends the benchmark when it sends the trace's last request: that request
    // (served: see above) is in its report only when its answer was back before guidellm
    // wrapped up, which a loaded host's slower wrap-up lets happen; none errored
    let (ok, errored, incomplete) = totals(&bench);
    let all = MOONCAKE_ROWS.len() as u64;
    assert!(
        (ok == all || ok == all - 1) && (errored, incomplete) == (0, 0),
        "guidellm reports {ok} successful, {errored} errored, {incomplete} incomplete of {all}"
    );
    // each request it reports has the lengths of a row of the trace, as the server counted
    let mut rows = MOONCAKE_ROWS.to_vec();
    for r in bench["requests"]["successful"].as_array().unwrap() {
        let lens = (
            r["input_metrics"]["text_tokens"].as_u64().unwrap() as u32,
            r["output_metrics"]["text_tokens"].as_u64().unwrap() as u32,
        );
        let at = rows
            .iter()
            .position(|row| *row == lens)
            .unwrap_or_else(|| panic!("guidellm reports {lens:?}, not a row of {rows:?}"));
        rows.remove(at);
    }
    // and the one it may leave out is the last
    assert!(
        rows.is_empty() || rows == MOONCAKE_ROWS[MOONCAKE_ROWS.len() - 1..],
        "guidellm left out {rows:?}"
    );
    eprintln!(
        "guidellm {GUIDELLM_VERSION} replay: {} of {} requests served, {ok} reported, TTFT p50 {:.2} ms, ITL p50 {:.2} ms",
        served.ok,
        MOONCAKE_ROWS.len(),
        metric(&bench, &["time_to_first_token_ms"], "median"),
        metric(&bench, &["inter_token_latency_ms"], "median"),
    );
    assert_ctrl_c_stops_everything(&mut serve, frontend_pid);
}
