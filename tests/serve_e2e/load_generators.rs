//! The load generators users run, against `serve` out of the box: aiperf (NVIDIA's, pinned
//! from PyPI into its own cached venv) finds the tokenizer by the id the banner prints, with
//! the Hugging Face hub offline; every request succeeds, its token counts are the server's,
//! and its TTFT and ITL read back the configured knobs.

use serde_json::Value;

use super::*;
use crate::support::Disturbance;
use crate::support::http::{metric_sum, parse_metrics};

const AIPERF_PACKAGE: &str = "aiperf";
const AIPERF_VERSION: &str = "0.13.0";

/// The configured latency knobs of the served engine, ms.
const TTFT_MS: f64 = 40.0;
const ITL_MS: f64 = 8.0;

/// aiperf's export: the statistic `stat` (`avg`, `p50`, …) of metric `name`.
fn stat(export: &Value, name: &str, stat: &str) -> f64 {
    export[name][stat]
        .as_f64()
        .unwrap_or_else(|| panic!("no {name}.{stat} in aiperf's export: {export}"))
}

/// The server's counter `name`, summed over its labels.
fn counter(port: u16, name: &str) -> f64 {
    metric_sum(
        &parse_metrics(&http_get(port, "/metrics").text()),
        name,
        &[],
    )
    .unwrap_or(0.0)
}

#[test]
fn aiperf_runs_against_serve_with_the_banners_tokenizer_id() {
    let cache = vllm_vcr::frontends::cache_root().unwrap();
    let venv = vllm_vcr::frontends::fetch_tool(&cache, AIPERF_PACKAGE, AIPERF_VERSION, |v| {
        v.join("bin").join("aiperf").is_file()
    })
    .unwrap_or_else(|e| panic!("cannot install {AIPERF_PACKAGE}=={AIPERF_VERSION}: {e:#}"));
    let tmp = TestDir::new("serve-aiperf");
    let hub = tmp.path("hub");
    let hub_env = [("HF_HUB_CACHE", hub.to_str().unwrap())];
    let (ttft, itl) = (TTFT_MS.to_string(), ITL_MS.to_string());
    let mut serve = Serve::start_with_env(
        &[
            "--time-to-first-token",
            &ttft,
            "--inter-token-latency",
            &itl,
        ],
        &hub_env,
    );
    let (_, frontend_pid) = serve.wait_ready();
    let (prompt0, gen0) = (
        counter(serve.port, "vllm:prompt_tokens_total"),
        counter(serve.port, "vllm:generation_tokens_total"),
    );

    let out_dir = tmp.path("aiperf");
    let probe = Disturbance::start();
    let out = Command::new(venv.join("bin").join("aiperf"))
        .args(["profile", "--model", "tiny", "--url"])
        .arg(format!("http://127.0.0.1:{}", serve.port))
        .args(["--endpoint-type", "completions", "--streaming"])
        .args(["--tokenizer", "vllm-vcr/tiny"])
        .args(["--synthetic-input-tokens-mean", "48"])
        .args(["--synthetic-input-tokens-stddev", "8"])
        .args(["--output-tokens-mean", "16", "--output-tokens-stddev", "4"])
        .args(["--request-count", "12", "--concurrency", "1"])
        .args(["--random-seed", "7", "--ui-type", "none"])
        .arg("--output-artifact-dir")
        .arg(&out_dir)
        .envs(hub_env)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    let worst = probe.worst_ms();
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "aiperf failed:\n{log}");
    let export: Value = serde_json::from_str(
        &std::fs::read_to_string(out_dir.join("profile_export_aiperf.json"))
            .unwrap_or_else(|e| panic!("no export ({e}):\n{log}")),
    )
    .unwrap();

    // every request succeeded
    assert_eq!(stat(&export, "request_count", "avg"), 12.0, "{export}");
    assert!(
        export["error_summary"]
            .as_array()
            .is_none_or(|e| e.is_empty()),
        "{}",
        export["error_summary"]
    );
    // aiperf's token counts are the server's: per request (its own diff metrics) and in
    // total (the frontend's counters moved by exactly what aiperf sent and received)
    assert_eq!(stat(&export, "usage_prompt_tokens_diff_pct", "max"), 0.0);
    assert_eq!(
        stat(&export, "usage_completion_tokens_diff_pct", "max"),
        0.0
    );
    assert_eq!(
        counter(serve.port, "vllm:prompt_tokens_total") - prompt0,
        stat(&export, "total_isl", "avg")
    );
    assert_eq!(
        counter(serve.port, "vllm:generation_tokens_total") - gen0,
        stat(&export, "total_osl", "avg")
    );
    // the knobs read back at concurrency 1: TTFT is the prefill plus the frontend's
    // turnaround (a few ms), ITL the pacing; both judged against how much this run's
    // machine stalled a 1 ms sleep (`worst`)
    let (ttft_p50, itl_p50) = (
        stat(&export, "time_to_first_token", "p50"),
        stat(&export, "inter_token_latency", "p50"),
    );
    assert!(
        (TTFT_MS..TTFT_MS + 25.0 + worst).contains(&ttft_p50),
        "TTFT p50 {ttft_p50:.2} ms, knob {TTFT_MS} ms (worst stall {worst:.1} ms)"
    );
    assert!(
        (itl_p50 - ITL_MS).abs() <= 0.8 + worst,
        "ITL p50 {itl_p50:.2} ms, knob {ITL_MS} ms (worst stall {worst:.1} ms)"
    );
    eprintln!(
        "aiperf {AIPERF_VERSION}: 12 of 12 requests, TTFT p50 {ttft_p50:.2} ms (knob {TTFT_MS}), ITL p50 {itl_p50:.2} ms (knob {ITL_MS}), worst stall {worst:.1} ms"
    );
    assert_ctrl_c_stops_everything(&mut serve, frontend_pid);
}
