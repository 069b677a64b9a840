//! The load generators users run, against `serve` out of the box, each pinned from PyPI
//! into its own cached venv (`vllm_vcr::frontends::load_generators`) and finding the
//! tokenizer by the id the banner prints, with the Hugging Face hub offline: aiperf here,
//! guidellm in [`super::guidellm`], inference-perf in [`super::inference_perf`]. Each run
//! asserts that every request succeeds, that the tool's token counts are the server's, and
//! (at concurrency 1) that its TTFT and ITL read back the configured knobs; the helpers they
//! share are here.

use std::path::Path;

use serde_json::Value;

use super::*;
use crate::support::http::{metric_sum, parse_metrics};
use crate::support::{Disturbance, Suffered};
use vllm_vcr::frontends::load_generators::AIPERF_VERSION;

/// The configured latency knobs of the served engine, ms.
pub(super) const TTFT_MS: f64 = 40.0;
pub(super) const ITL_MS: f64 = 8.0;

/// The knobs as `serve` flags.
fn knob_flags() -> Vec<String> {
    vec![
        "--time-to-first-token".into(),
        TTFT_MS.to_string(),
        "--inter-token-latency".into(),
        ITL_MS.to_string(),
    ]
}

/// `serve` with the knobs and `extra` flags, registering its tokenizer in the hub cache
/// `hub` (the test's own): ready, with its frontend's pid.
pub(super) fn serve_with_knobs(extra: &[&str], hub: &Path) -> (Serve, u32) {
    let mut flags = knob_flags();
    flags.extend(extra.iter().map(|f| f.to_string()));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut serve = Serve::start_with_env(&flags, &[("HF_HUB_CACHE", hub.to_str().unwrap())]);
    let (_, frontend_pid) = serve.wait_ready();
    (serve, frontend_pid)
}

/// A cached venv of a load generator, installed on first use: a test that needs it fails
/// (never skips) when it cannot be installed.
pub(super) fn tool_venv(name: &str, fetch: fn(&Path) -> anyhow::Result<PathBuf>) -> PathBuf {
    let cache = vllm_vcr::frontends::cache_root().unwrap();
    fetch(&cache).unwrap_or_else(|e| panic!("cannot install {name}: {e:#}"))
}

/// aiperf's export: the statistic `stat` (`avg`, `p50`, …) of metric `name`.
fn stat(export: &Value, name: &str, stat: &str) -> f64 {
    export[name][stat]
        .as_f64()
        .unwrap_or_else(|| panic!("no {name}.{stat} in aiperf's export: {export}"))
}

/// The upper edges of the frontend's TTFT histogram buckets up to a second, s.
const TTFT_BUCKETS: [&str; 9] = [
    "0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25",
];

/// What the server counted so far: requests that finished well, prompt and output tokens,
/// and its own time-to-first-token histogram (requests counted, and within each edge of
/// [`TTFT_BUCKETS`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Served {
    pub ok: f64,
    pub prompt: f64,
    pub output: f64,
    pub ttft_count: f64,
    pub ttft_within: [f64; TTFT_BUCKETS.len()],
}

impl Served {
    pub fn read(port: u16) -> Served {
        let samples = parse_metrics(&http_get(port, "/metrics").text());
        let sum =
            |name: &str, filter: &[(&str, &str)]| metric_sum(&samples, name, filter).unwrap_or(0.0);
        Served {
            ok: sum("vllm:request_success_total", &[]),
            prompt: sum("vllm:prompt_tokens_total", &[]),
            output: sum("vllm:generation_tokens_total", &[]),
            ttft_count: sum("vllm:time_to_first_token_seconds_count", &[]),
            ttft_within: TTFT_BUCKETS
                .map(|le| sum("vllm:time_to_first_token_seconds_bucket", &[("le", le)])),
        }
    }

    /// What the server counted since `before`.
    pub fn since(port: u16, before: Served) -> Served {
        let now = Served::read(port);
        Served {
            ok: now.ok - before.ok,
            prompt: now.prompt - before.prompt,
            output: now.output - before.output,
            ttft_count: now.ttft_count - before.ttft_count,
            ttft_within: std::array::from_fn(|i| now.ttft_within[i] - before.ttft_within[i]),
        }
    }

    /// Requests whose first token came within the TTFT knob, by the frontend's histogram
    /// (the knob is one of its bucket edges).
    pub fn ttft_within_knob(&self) -> f64 {
        TTFT_BUCKETS
            .iter()
            .position(|le| le.parse::<f64>().ok() == Some(TTFT_MS / 1e3))
            .map_or(f64::NAN, |i| self.ttft_within[i])
    }

    /// The bucket of the frontend's TTFT histogram that holds the median, as its (lower,
    /// upper) edges in ms (upper infinite past the last of [`TTFT_BUCKETS`]).
    pub fn ttft_median_bucket_ms(&self) -> (f64, f64) {
        let edge = |i: usize| TTFT_BUCKETS[i].parse::<f64>().unwrap_or(0.0) * 1e3;
        let half = self.ttft_count / 2.0;
        match self.ttft_within.iter().position(|&n| n >= half) {
            Some(0) => (0.0, edge(0)),
            Some(i) => (edge(i - 1), edge(i)),
            None => (edge(TTFT_BUCKETS.len() - 1), f64::INFINITY),
        }
    }
}

/// Run a load generator; its output (stdout then stderr), which must say it succeeded.
pub(super) fn run_tool(name: &str, cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {name}: {e}"));
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{name} failed:\n{log}");
    log
}

/// The knobs read back at concurrency 1. The time to first token is the prefill knob plus
/// turnarounds that are CPU work: the frontend's (it tokenizes each prompt, on a thread it
/// may first have to start) and the tool's own (Python), a few ms on a quiet machine,
/// bounded here by 10 ms + 15 ms for each runnable task per core the run suffered on
/// average. So the frontend's own TTFT histogram has no request under the knob and its
/// median bucket starts within the knob plus that turnaround; the tool's TTFT p50 is not
/// under the knob and not past that bucket's end plus the turnaround. The tool's ITL p50
/// is the pacing within 0.8 ms. Every bound is widened by how much this run's machine
/// stalled a 1 ms sleep.
pub(super) fn assert_knobs_read_back(
    tool: &str,
    ttft_p50: f64,
    itl_p50: f64,
    served: Served,
    suffered: Suffered,
) {
    let Suffered {
        worst_ms: worst,
        cpu_stretch,
    } = suffered;
    let turnaround = 10.0 + 15.0 * cpu_stretch + worst;
    let (median_from, median_to) = served.ttft_median_bucket_ms();
    let said = format!(
        "{tool}: TTFT p50 {ttft_p50:.2} ms, knob {TTFT_MS} ms, the frontend's median TTFT of \
         {} requests in ({median_from}, {median_to}] ms, {} under the knob; ITL p50 \
         {itl_p50:.2} ms, knob {ITL_MS} ms; turnaround allowed {turnaround:.1} ms (worst stall \
         {worst:.1} ms, CPU work stretched {cpu_stretch:.2}×)",
        served.ttft_count,
        served.ttft_within_knob(),
    );
    assert!(
        served.ttft_count > 0.0
            && served.ttft_within_knob() == 0.0
            && median_from <= TTFT_MS + turnaround,
        "the frontend's TTFT is not the knob: {said}"
    );
    assert!(
        (TTFT_MS..median_to + turnaround).contains(&ttft_p50),
        "the tool's TTFT is not the frontend's: {said}"
    );
    assert!(
        (itl_p50 - ITL_MS).abs() <= 0.8 + worst,
        "the tool's ITL is not the knob: {said}"
    );
    eprintln!("{said}");
}

/// The replayed workload, as a Mooncake trace (what `vllm bench serve --dataset-name
/// timed_trace` and guidellm replay): eight requests 150 ms apart, block size 16, every
/// other one sharing its first block with the first (a prefix-cache hit), the last block
/// of most of them partial. Rows are (input tokens, output tokens).
pub(super) const MOONCAKE_BLOCK: u32 = 16;
pub(super) const MOONCAKE_ROWS: [(u32, u32); 8] = [
    (40, 12),
    (24, 8),
    (64, 16),
    (33, 10),
    (48, 6),
    (17, 14),
    (56, 9),
    (30, 11),
];

/// Write [`MOONCAKE_ROWS`] to `path` as Mooncake JSONL (timestamps in ms).
pub(super) fn write_mooncake(path: &Path) {
    let mut next = 0u32;
    let mut lines = String::new();
    for (i, (input, output)) in MOONCAKE_ROWS.iter().enumerate() {
        let blocks = input.div_ceil(MOONCAKE_BLOCK);
        let ids: Vec<u32> = (0..blocks)
            .map(|b| if b == 0 && i % 2 == 1 { 0 } else { next + b })
            .collect();
        next += blocks;
        lines += &serde_json::json!({
            "timestamp": i * 150,
            "input_length": input,
            "output_length": output,
            "hash_ids": ids,
        })
        .to_string();
        lines.push('\n');
    }
    std::fs::write(path, lines).unwrap();
}

/// The totals of [`MOONCAKE_ROWS`]: (prompt tokens, output tokens).
pub(super) fn mooncake_totals() -> (f64, f64) {
    MOONCAKE_ROWS.iter().fold((0.0, 0.0), |(p, o), (i, out)| {
        (p + f64::from(*i), o + f64::from(*out))
    })
}

#[test]
fn aiperf_runs_against_serve_with_the_banners_tokenizer_id() {
    let venv = tool_venv("aiperf", vllm_vcr::frontends::load_generators::fetch_aiperf);
    let tmp = TestDir::new("serve-aiperf");
    let hub = tmp.path("hub");
    let hub_env = [("HF_HUB_CACHE", hub.to_str().unwrap())];
    let (mut serve, frontend_pid) = serve_with_knobs(&[], &hub);
    let before = Served::read(serve.port);

    let out_dir = tmp.path("aiperf");
    let probe = Disturbance::start();
    let log = run_tool(
        "aiperf",
        Command::new(venv.join("bin").join("aiperf"))
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
            .env("HF_HUB_OFFLINE", "1"),
    );
    let suffered = probe.finish();
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
    let served = Served::since(serve.port, before);
    assert_eq!(served.ok, 12.0);
    assert_eq!(served.prompt, stat(&export, "total_isl", "avg"));
    assert_eq!(served.output, stat(&export, "total_osl", "avg"));
    let (ttft_p50, itl_p50) = (
        stat(&export, "time_to_first_token", "p50"),
        stat(&export, "inter_token_latency", "p50"),
    );
    assert_knobs_read_back("aiperf", ttft_p50, itl_p50, served, suffered);
    eprintln!("aiperf {AIPERF_VERSION}: 12 of 12 requests");
    assert_ctrl_c_stops_everything(&mut serve, frontend_pid);
}
