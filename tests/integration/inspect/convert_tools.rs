//! `inspect convert` on files the load generators wrote (`vllm-rs bench serve`, aiperf,
//! inference-perf; `tests/fixtures/convert/README.md` says how each was made): the trace's
//! counts, lengths and latencies equal the tool's own figures in the same file or the
//! summary it wrote beside it. The public CSV traces (Azure, BurstGPT) as workloads that
//! `simulate` and `calibrate-e2e` take, `--to azure` as inference-perf reads it, and
//! guidellm reports split per benchmark.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use super::convert::{convert, convert_err, jsonl};
use crate::support::{TestDir, fixture, read_trace, vcr};
use serde_json::Value;
use sim_trace::trace::TraceRecord;

/// Convert with `--json`; returns the summary.
fn convert_json(args: &[&str], output: &Path, input: &Path) -> Value {
    let mut a = args.to_vec();
    a.push("--json");
    serde_json::from_slice(&convert(&a, output, input).run().stdout).unwrap()
}

/// As [`convert_err`], and the failed conversion left no output.
fn refused(args: &[&str], output: &Path, input: &Path) -> String {
    let err = convert_err(args, output, input);
    assert!(!output.exists(), "a failed conversion leaves no output");
    err
}

fn fx(rel: &str) -> PathBuf {
    fixture(&format!("tests/fixtures/convert/{rel}"))
}

/// A (possibly gzipped) JSON fixture.
fn json_fixture(rel: &str) -> Value {
    if rel.ends_with(".gz") {
        super::convert::report(&format!("convert/{rel}"))
    } else {
        serde_json::from_str(&std::fs::read_to_string(fx(rel)).unwrap()).unwrap()
    }
}

/// The record lines as JSON (with the tool's extra keys the schema does not read).
fn lines(path: &Path) -> Vec<Value> {
    jsonl(path).split_off(1)
}

/// `src` gzipped into `dst`; returns `dst`.
fn gzipped(src: &Path, dst: &Path) -> PathBuf {
    let mut enc = flate2::write::GzEncoder::new(
        std::fs::File::create(dst).unwrap(),
        flate2::Compression::fast(),
    );
    enc.write_all(&std::fs::read(src).unwrap()).unwrap();
    enc.finish().unwrap();
    dst.to_path_buf()
}

fn mean(v: impl IntoIterator<Item = f64>) -> f64 {
    let v: Vec<f64> = v.into_iter().collect();
    v.iter().sum::<f64>() / v.len() as f64
}

/// Latencies are written to 1 µs: a mean is off by at most half of that.
fn same_ms(ours: f64, theirs: f64, what: &str) {
    assert!(
        (ours - theirs).abs() <= 0.0005,
        "{what}: ours {ours} ms, the tool's {theirs} ms"
    );
}

fn complete(records: &[TraceRecord]) -> Vec<&TraceRecord> {
    records.iter().filter(|r| !r.incomplete).collect()
}

fn gaps<'a>(records: impl IntoIterator<Item = &'a &'a TraceRecord>) -> Vec<f64> {
    records
        .into_iter()
        .flat_map(|r| r.itl_ms.iter().copied())
        .collect()
}

// ---------------------------------------------------------------- vllm bench serve

#[test]
fn a_vllm_rs_bench_result_agrees_with_bench_own_figures() {
    let tmp = TestDir::new("a_vllm_rs_bench_result_agrees_with_bench_own_figures");
    let src = fx("vllm-bench/vllm-rs-bench.json");
    let trace = tmp.path("bench.jsonl");
    let summary = convert_json(&["--from", "vllm-bench"], &trace, &src);
    let bench = json_fixture("vllm-bench/vllm-rs-bench.json");
    assert_eq!(summary["written"], 16, "{summary}");
    let (meta, records) = read_trace(&trace);
    assert_eq!(meta.unwrap().model.as_deref(), Some("tiny"));

    // The two requests the server refused: counted, kept, out of the quantiles.
    let failed: Vec<&TraceRecord> = records.iter().filter(|r| r.incomplete).collect();
    assert_eq!(failed.len() as u64, bench["failed"].as_u64().unwrap());
    assert!(failed.iter().all(|r| {
        r.prompt_tokens == 40000
            && r.ttft_ms.is_none()
            && r.itl_ms.is_empty()
            && r.error
                .as_deref()
                .is_some_and(|e| e.contains("maximum context length"))
    }));
    assert!(
        summary["notes"].to_string().contains("2 request(s)"),
        "{summary}"
    );

    check_bench("vllm-bench/vllm-rs-bench.json", &records);

    // The same result gzipped converts the same.
    let gz = gzipped(&src, &tmp.path("bench.json.gz"));
    let again = tmp.path("bench-gz.jsonl");
    convert(&["--from", "vllm-bench"], &again, &gz).run();
    assert_eq!(lines(&again), lines(&trace));
}

/// The Python `vllm bench serve` writes the same keys, its start times on
/// `time.perf_counter()`'s clock.
#[test]
fn a_python_vllm_bench_result_agrees_with_bench_own_figures() {
    let tmp = TestDir::new("a_python_vllm_bench_result_agrees_with_bench_own_figures");
    let trace = tmp.path("bench.jsonl");
    let rel = "vllm-bench/vllm-py-bench.json";
    convert(&["--from", "vllm-bench"], &trace, &fx(rel)).run();
    let (meta, records) = read_trace(&trace);
    assert_eq!(meta.unwrap().created_unix_ms, None);
    assert_eq!(records.len(), 12);
    check_bench(rel, &records);
}

/// The trace's complete records against the result's own totals and means, and its
/// arrivals against the result's send times.
fn check_bench(rel: &str, records: &[TraceRecord]) {
    let bench = json_fixture(rel);
    let ok = complete(records);
    assert_eq!(ok.len() as u64, bench["completed"].as_u64().unwrap());
    let sum = |f: fn(&TraceRecord) -> u32| ok.iter().map(|r| u64::from(f(r))).sum::<u64>();
    assert_eq!(
        sum(|r| r.prompt_tokens),
        bench["total_input_tokens"].as_u64().unwrap()
    );
    assert_eq!(
        sum(|r| r.output_tokens),
        bench["total_output_tokens"].as_u64().unwrap()
    );
    same_ms(
        mean(ok.iter().map(|r| r.ttft_ms.unwrap())),
        bench["mean_ttft_ms"].as_f64().unwrap(),
        "mean TTFT",
    );
    same_ms(
        mean(gaps(&ok)),
        bench["mean_itl_ms"].as_f64().unwrap(),
        "mean ITL",
    );

    // Arrivals: the send times from the first, in order.
    let starts: Vec<f64> = bench["start_times"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let first = starts.iter().copied().fold(f64::INFINITY, f64::min);
    let mut want: Vec<f64> = starts.iter().map(|s| (s - first) * 1000.0).collect();
    want.sort_by(f64::total_cmp);
    for (r, w) in records.iter().zip(&want) {
        assert!((r.arrival_ms.unwrap() - w).abs() <= 0.0005, "{r:?} vs {w}");
    }
}

#[test]
fn results_of_the_wrong_kind_or_size_are_clear_errors() {
    let tmp = TestDir::new("results_of_the_wrong_kind_or_size_are_clear_errors");
    let src = tmp.path("summary-only.json");
    std::fs::write(
        &src,
        r#"{"completed": 3, "failed": 0, "mean_ttft_ms": 12.5}"#,
    )
    .unwrap();
    let err = refused(&["--from", "vllm-bench"], &tmp.path("x.jsonl"), &src);
    assert!(err.contains("--save-detailed"), "{err}");
    std::fs::write(&src, "{\"input_lens\": [1, 2], \"start_times\": [0.1]").unwrap();
    let err = refused(&["--from", "vllm-bench"], &tmp.path("x.jsonl"), &src);
    assert!(err.contains("not a `bench serve` result"), "{err}");

    // a bench result is not inference-perf's array of requests
    let bench = fx("vllm-bench/vllm-rs-bench.json");
    let err = refused(&["--from", "inference-perf"], &tmp.path("x.jsonl"), &bench);
    assert!(err.contains("not inference-perf's"), "{err}");
    // a document past --max-line-bytes is refused, not read whole
    let out = vcr()
        .args([
            "--max-line-bytes",
            "2048",
            "inspect",
            "convert",
            "--from",
            "vllm-bench",
        ])
        .arg(&bench)
        .arg("-o")
        .arg(tmp.path("x.jsonl"))
        .output();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("larger than 2048 bytes"), "{err}");
}

// ---------------------------------------------------------------- aiperf

#[test]
fn an_aiperf_profile_export_agrees_with_aiperf_own_summary() {
    let tmp = TestDir::new("an_aiperf_profile_export_agrees_with_aiperf_own_summary");
    let trace = tmp.path("aiperf.jsonl");
    let summary = convert_json(
        &["--from", "aiperf"],
        &trace,
        &fx("aiperf/profile_export.jsonl.gz"),
    );
    let theirs = json_fixture("aiperf/profile_export_aiperf.json.gz");
    let avg = |k: &str| theirs[k]["avg"].as_f64().unwrap();
    let (meta, records) = read_trace(&trace);
    assert_eq!(records.len(), 16);

    let failed: Vec<&TraceRecord> = records.iter().filter(|r| r.incomplete).collect();
    assert_eq!(failed.len() as f64, avg("error_request_count"));
    assert!(failed.iter().all(|r| {
        r.ttft_ms.is_none()
            && r.error
                .as_deref()
                .is_some_and(|e| e.contains("InvalidInferenceResultError"))
    }));

    let ok = complete(&records);
    assert_eq!(ok.len() as f64, avg("request_count"));
    same_ms(
        mean(ok.iter().map(|r| r.ttft_ms.unwrap())),
        avg("time_to_first_token"),
        "mean TTFT",
    );
    let g = gaps(&ok);
    assert_eq!(
        g.len() as u64,
        theirs["inter_chunk_latency"]["count"].as_u64().unwrap()
    );
    same_ms(
        mean(g),
        avg("inter_chunk_latency"),
        "mean inter-chunk latency",
    );
    // Lengths are the server's: the chat template's tokens are in the prompt, and noted.
    assert!(
        (mean(ok.iter().map(|r| f64::from(r.prompt_tokens))) - avg("usage_prompt_tokens")).abs()
            < 1e-9
    );
    assert!(
        (mean(ok.iter().map(|r| f64::from(r.output_tokens))) - avg("output_sequence_length")).abs()
            < 1e-9
    );
    assert!(
        summary["notes"].to_string().contains("chat template"),
        "{summary}"
    );

    // The zero is the first send, a date on aiperf's Unix clock.
    let mut export = String::new();
    flate2::read::MultiGzDecoder::new(
        std::fs::File::open(fx("aiperf/profile_export.jsonl.gz")).unwrap(),
    )
    .read_to_string(&mut export)
    .unwrap();
    let first_ns = export
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["metadata"]["request_start_ns"]
                .as_u64()
                .unwrap()
        })
        .min()
        .unwrap();
    assert_eq!(
        meta.unwrap().created_unix_ms,
        Some((first_ns as f64 / 1e6).round() as u64)
    );
    assert_eq!(records[0].arrival_ms, Some(0.0));
    // Each record says which conversation it was.
    assert!(
        lines(&trace)
            .iter()
            .all(|l| l["aiperf"]["conversation_id"].is_string())
    );
}

#[test]
fn not_an_aiperf_export_nor_a_writable_format_is_a_clear_error() {
    let tmp = TestDir::new("not_an_aiperf_export_nor_a_writable_format_is_a_clear_error");
    let mooncake = fixture("tests/fixtures/mooncake/sample.jsonl");
    let err = refused(&["--from", "aiperf"], &tmp.path("x.jsonl"), &mooncake);
    assert!(err.contains("no `metadata`"), "{err}");
    assert!(err.contains("sample.jsonl:1"), "{err}");
    let err = refused(&["--to", "aiperf"], &tmp.path("x.jsonl"), &mooncake);
    assert!(err.contains("--to mooncake and --to azure"), "{err}");
}

// ---------------------------------------------------------------- inference-perf

#[test]
fn inference_perf_per_request_metrics_agree_with_its_summary() {
    let tmp = TestDir::new("inference_perf_per_request_metrics_agree_with_its_summary");
    let trace = tmp.path("ip.jsonl");
    let summary = convert_json(
        &["--from", "inference-perf"],
        &trace,
        &fx("inference-perf/per_request_lifecycle_metrics.json.gz"),
    );
    let theirs = json_fixture("inference-perf/summary_lifecycle_metrics.json.gz");
    let (s, failures) = (&theirs["successes"], &theirs["failures"]);
    let (_, records) = read_trace(&trace);
    assert_eq!(
        records.len() as u64,
        s["count"].as_u64().unwrap() + failures["count"].as_u64().unwrap()
    );

    // The prompts past the server's context: 400s, out of the quantiles. inference-perf
    // records no prompt length for a failed request, and the note says so.
    let failed: Vec<&TraceRecord> = records.iter().filter(|r| r.incomplete).collect();
    assert_eq!(failed.len() as u64, failures["count"].as_u64().unwrap());
    assert!(failed.iter().all(|r| {
        r.ttft_ms.is_none()
            && r.prompt_tokens == 0
            && r.error
                .as_deref()
                .is_some_and(|e| e.starts_with("HTTP Error 400"))
    }));
    assert!(
        summary["notes"].to_string().contains("no prompt length"),
        "{summary}"
    );

    let ok = complete(&records);
    assert_eq!(ok.len() as u64, s["count"].as_u64().unwrap());
    let total = |f: fn(&TraceRecord) -> u32| ok.iter().map(|r| f64::from(f(r))).sum::<f64>();
    assert_eq!(
        total(|r| r.prompt_tokens),
        s["prompt_tokens"]["total"].as_f64().unwrap()
    );
    assert_eq!(
        total(|r| r.output_tokens),
        s["output_tokens"]["total"].as_f64().unwrap()
    );

    // inference-perf times the first token only of requests with two or more.
    let streamed: Vec<&TraceRecord> = ok
        .iter()
        .copied()
        .filter(|r| !r.itl_ms.is_empty())
        .collect();
    let latency = &s["latency"];
    same_ms(
        mean(streamed.iter().map(|r| r.ttft_ms.unwrap())),
        latency["time_to_first_token"]["mean"].as_f64().unwrap() * 1000.0,
        "mean TTFT",
    );
    same_ms(
        mean(gaps(&streamed)),
        latency["inter_token_latency"]["mean"].as_f64().unwrap() * 1000.0,
        "mean ITL",
    );
    // The other success streamed no token (the injected engine error ended its stream
    // before the first, which inference-perf did not count as an error): no TTFT.
    let rest: Vec<&&TraceRecord> = ok.iter().filter(|r| r.itl_ms.is_empty()).collect();
    assert_eq!(rest.len(), 1);
    assert_eq!((rest[0].output_tokens, rest[0].ttft_ms), (0, None));
}

// ---------------------------------------------------------------- Azure and BurstGPT

#[test]
fn the_azure_trace_is_a_workload_and_comes_back_to_the_microsecond() {
    let tmp = TestDir::new("the_azure_trace_is_a_workload_and_comes_back_to_the_microsecond");
    let src = fx("azure/AzureLLMInferenceTrace_conv-head.csv");
    let trace = tmp.path("azure.jsonl");
    convert_json(&["--from", "azure"], &trace, &src);
    let (meta, records) = read_trace(&trace);
    // 2023-11-16 18:15:46.680 UTC, the first row's millisecond
    assert_eq!(meta.unwrap().created_unix_ms, Some(1_700_158_546_680));
    assert_eq!(records.len(), 12);
    assert_eq!(records[0].arrival_ms, Some(0.59));
    assert_eq!(records[1].arrival_ms, Some(4315.169));
    assert_eq!(records[11].arrival_ms, Some(10623.038));
    assert_eq!(
        (records[6].prompt_tokens, records[6].output_tokens),
        (1313, 142)
    );
    assert!(records.iter().all(|r| r.ttft_ms.is_none()));

    // a gzipped CSV reads the same
    let gz = gzipped(&src, &tmp.path("azure.csv.gz"));
    let from_gz = tmp.path("azure-gz.jsonl");
    convert(&["--from", "azure"], &from_gz, &gz).run();
    assert_eq!(read_trace(&from_gz).1, records);

    let back = tmp.path("azure-back.csv");
    convert(&["--to", "azure"], &back, &trace).run();
    assert_eq!(
        std::fs::read_to_string(&back).unwrap(),
        std::fs::read_to_string(&src).unwrap()
    );

    let bad = tmp.path("bad.csv");
    std::fs::write(&bad, "time,in,out\n1,2,3\n").unwrap();
    let err = refused(&["--from", "azure"], &tmp.path("x.jsonl"), &bad);
    assert!(
        err.contains("TIMESTAMP,ContextTokens,GeneratedTokens"),
        "{err}"
    );
    std::fs::write(
        &bad,
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,2\n2023-11-16 18:15:45.0,10,2\n",
    )
    .unwrap();
    let err = refused(&["--from", "azure"], &tmp.path("x.jsonl"), &bad);
    assert!(
        err.contains("bad.csv:3") && err.contains("time order"),
        "{err}"
    );
}

#[test]
fn burstgpt_rows_become_a_workload_without_the_failed_ones() {
    let tmp = TestDir::new("burstgpt_rows_become_a_workload_without_the_failed_ones");
    let trace = tmp.path("burstgpt.jsonl.gz");
    let summary = convert_json(
        &["--from", "burstgpt"],
        &trace,
        &fx("burstgpt/BurstGPT-head.csv"),
    );
    assert_eq!(summary["written"], 8, "{summary}");
    assert_eq!(summary["skipped"]["total"], 2, "{summary}");
    let (meta, records) = read_trace(&trace);
    assert_eq!(meta.unwrap().created_unix_ms, None);
    let arrivals: Vec<f64> = records.iter().map(|r| r.arrival_ms.unwrap()).collect();
    assert_eq!(
        arrivals,
        [
            5000.0, 45000.0, 118000.0, 147000.0, 166000.0, 191000.0, 207000.0, 228000.0
        ]
    );
    assert_eq!(
        (records[4].prompt_tokens, records[4].output_tokens),
        (2130, 350)
    );

    // --to azure writes what inference-perf's trace_replay reads: dated from 1970 (no date
    // in BurstGPT), in arrival order, to the byte.
    let csv = tmp.path("burstgpt.csv");
    convert(&["--to", "azure"], &csv, &trace).run();
    let text = std::fs::read_to_string(&csv).unwrap();
    let mut rows = text.lines();
    assert_eq!(rows.next(), Some("TIMESTAMP,ContextTokens,GeneratedTokens"));
    assert_eq!(rows.next(), Some("1970-01-01 00:00:05.0000000,472,18"));
    assert_eq!(rows.last(), Some("1970-01-01 00:03:48.0000000,157,66"));
    assert_eq!(text.lines().count(), 9);
}

#[test]
fn the_csv_workloads_run_through_simulate_and_calibrate_e2e() {
    let tmp = TestDir::new("the_csv_workloads_run_through_simulate_and_calibrate_e2e");
    let azure = tmp.path("azure.jsonl");
    convert(
        &["--from", "azure"],
        &azure,
        &fx("azure/AzureLLMInferenceTrace_conv-head.csv"),
    )
    .run();
    let burst = tmp.path("burstgpt.jsonl");
    convert(
        &["--from", "burstgpt"],
        &burst,
        &fx("burstgpt/BurstGPT-head.csv"),
    )
    .run();
    let knobs = [
        "--time-to-first-token",
        "30",
        "--inter-token-latency",
        "5",
        "--json",
    ];
    for (trace, n) in [(&burst, 8), (&azure, 12)] {
        let out = vcr()
            .args(["inspect", "simulate"])
            .arg(trace)
            .args(knobs)
            .run();
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["requests"], n, "{v}");
        assert_eq!(v["not_finished"], 0, "{v}");
        assert_eq!(v["rejected"], 0, "{v}");
    }

    // calibrate-e2e needs captured latencies: the workload's simulation under a fitted
    // model gives them, and its 12 requests go through vllm-rs and the tap.
    let model = tmp.path("model.json");
    let c = crate::support::corpus;
    crate::support::fit_model(
        c("concurrency-8-s0.trace.jsonl.gz"),
        c("concurrency-8-s0.steps.jsonl.gz"),
        &model,
    );
    let simulated = tmp.path("azure-simulated.jsonl");
    vcr()
        .args(["inspect", "simulate"])
        .arg(&azure)
        .arg("--latency-trace")
        .arg(&model)
        .arg("--dump-trace")
        .arg(&simulated)
        .run();
    let out = vcr()
        .args(["inspect", "calibrate-e2e"])
        .arg(&simulated)
        .arg("--latency-trace")
        .arg(&model)
        .args(["--tolerance", "1000", "--min-requests", "1", "--json"])
        .run();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["records"], 12, "{v}");
    assert_eq!(v["compared"], 12, "{v}");
}

// ---------------------------------------------------------------- guidellm per benchmark

#[test]
fn a_guidellm_report_splits_per_benchmark() {
    let tmp = TestDir::new("a_guidellm_report_splits_per_benchmark");
    let src = fixture("tests/fixtures/guidellm/report-errors.json.gz");
    let all = tmp.path("all.jsonl");
    convert(&["--from", "guidellm"], &all, &src).run();
    let lines_all = lines(&all);
    // summarize's TTFT quantiles are over guidellm's successful requests: 12 + 26, not the
    // 43 requests with a TTFT that counting the errored and cancelled ones would give
    let out = vcr()
        .args(["inspect", "summarize", "--json"])
        .arg(&all)
        .run();
    let s: Value = serde_json::from_slice(&out.stdout).unwrap();
    let report = super::convert::report("guidellm/report-errors.json.gz");
    let successful: u64 = report["benchmarks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            b["metrics"]["time_to_first_token_ms"]["successful"]["count"]
                .as_u64()
                .unwrap()
        })
        .sum();
    assert_eq!(successful, 38);
    assert_eq!(s["ttft_ms"]["count"], successful, "{s}");
    assert_eq!(s["records"], 45, "{s}");
    // Every record names its benchmark and strategy.
    for l in &lines_all {
        let g = &l["guidellm"];
        assert_eq!(g["strategy"], "concurrent", "{l}");
        let b = g["benchmark"].as_u64().unwrap();
        assert_eq!(g["streams"].as_u64(), Some([1, 4][b as usize]), "{l}");
    }

    let second = tmp.path("second.jsonl");
    let summary = convert_json(&["--from", "guidellm", "--benchmark", "1"], &second, &src);
    let (_, records) = read_trace(&second);
    // guidellm's request totals of the second benchmark: 26 successful, 4 errored, 3
    // incomplete; its successful TTFT mean is 65.035 ms over the 26.
    assert_eq!(records.len(), 33, "{summary}");
    assert_eq!(records.iter().filter(|r| r.incomplete).count(), 7);
    let ok = complete(&records);
    assert_eq!(ok.len(), 26);
    let theirs = &report["benchmarks"][1]["metrics"]["time_to_first_token_ms"]["successful"];
    assert!(
        (mean(ok.iter().map(|r| r.ttft_ms.unwrap())) - theirs["mean"].as_f64().unwrap()).abs()
            < 0.01
    );
    assert!(
        lines(&second)
            .iter()
            .all(|l| l["guidellm"]["benchmark"] == 1)
    );
    assert_eq!(
        lines_all
            .iter()
            .filter(|l| l["guidellm"]["benchmark"] == 1)
            .count(),
        33
    );

    let err = refused(
        &["--from", "guidellm", "--benchmark", "2"],
        &tmp.path("x.jsonl"),
        &src,
    );
    assert!(err.contains("2 benchmark(s)"), "{err}");
    let err = refused(
        &["--from", "aiperf", "--benchmark", "0"],
        &tmp.path("x.jsonl"),
        &fx("aiperf/profile_export.jsonl.gz"),
    );
    assert!(err.contains("guidellm only"), "{err}");
}

// ---------------------------------------------------------------- reasoning tokens

/// The server's count of thinking tokens, where the tool kept it (aiperf's
/// `usage_reasoning_tokens`, inference-perf's `completion_tokens_details`), becomes each
/// record's `reasoning_tokens`, which replay thinks for. The fixtures' tiny model thought
/// for none; one request of each is given 12 here.
#[test]
fn the_servers_reasoning_token_counts_reach_the_records() {
    let tmp = TestDir::new("the_servers_reasoning_token_counts_reach_the_records");
    let json = |rel: &str| {
        let mut text = String::new();
        flate2::read::MultiGzDecoder::new(std::fs::File::open(fx(rel)).unwrap())
            .read_to_string(&mut text)
            .unwrap();
        text
    };
    let mut export: Vec<Value> = json("aiperf/profile_export.jsonl.gz")
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let ok = export
        .iter()
        .position(|l| l["error"].is_null() && l["metadata"]["benchmark_phase"] == "profiling")
        .unwrap();
    let id = export[ok]["metadata"]["x_request_id"].clone();
    export[ok]["metrics"]["usage_reasoning_tokens"]["value"] = 12.into();
    let input = tmp.path("aiperf-in.jsonl");
    let text: Vec<String> = export.iter().map(Value::to_string).collect();
    std::fs::write(&input, text.join("\n")).unwrap();
    let trace = tmp.path("aiperf.jsonl");
    convert_json(&["--from", "aiperf"], &trace, &input);
    let (_, records) = read_trace(&trace);
    let ok = complete(&records);
    assert!(ok.len() > 1);
    for r in ok {
        let want = if r.request_id.as_deref() == id.as_str() {
            12
        } else {
            0
        };
        assert_eq!(r.reasoning_tokens, Some(want), "{r:?}");
    }

    let mut entries: Value = serde_json::from_str(&json(
        "inference-perf/per_request_lifecycle_metrics.json.gz",
    ))
    .unwrap();
    let usage = &mut entries[0]["info"]["response_metrics"]["server_usage"];
    usage["completion_tokens_details"]["reasoning_tokens"] = 12.into();
    let input = tmp.path("ip-in.json");
    std::fs::write(&input, entries.to_string()).unwrap();
    let trace = tmp.path("ip.jsonl");
    convert_json(&["--from", "inference-perf"], &trace, &input);
    let (_, records) = read_trace(&trace);
    let counts: Vec<Option<u32>> = complete(&records)
        .iter()
        .map(|r| r.reasoning_tokens)
        .collect();
    assert_eq!(
        counts.iter().filter(|c| **c == Some(12)).count(),
        1,
        "{counts:?}"
    );
    // a request the server sent no usage for has no count
    assert!(
        counts.iter().all(|c| matches!(c, None | Some(0 | 12))),
        "{counts:?}"
    );
}
