//! `inspect convert`: Mooncake timed traces both ways (lossless round trip; exports that
//! `vllm-rs bench serve --dataset-name timed_trace` replays with the recorded lengths), and
//! real guidellm reports whose converted numbers agree with guidellm's own.

use std::collections::HashSet;
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::{
    TestCommand, TestDir, TestProcess, fixture, http_get_ok, read_trace, vcr, vcr_command,
};
use serde_json::{Value, json};
use sim_trace::trace::{BlockHash, TraceRecord};

/// `vllm-vcr inspect convert ARGS… -o OUTPUT INPUT`.
pub(super) fn convert(args: &[&str], output: &Path, input: &Path) -> TestCommand {
    let mut c = vcr();
    c.args(["inspect", "convert"])
        .args(args)
        .arg("-o")
        .arg(output)
        .arg(input);
    c
}

/// As [`convert`], expecting success; returns stdout.
fn convert_ok(args: &[&str], output: &Path, input: &Path) -> String {
    let out = convert(args, output, input).run();
    String::from_utf8(out.stdout).unwrap()
}

/// As [`convert`], expecting exit code 1 (an error, not a panic); returns stderr.
pub(super) fn convert_err(args: &[&str], output: &Path, input: &Path) -> String {
    let out = convert(args, output, input).output();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "convert {args:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

/// The lines of a JSONL file (`.gz` by name), each as JSON.
pub(super) fn jsonl(path: &Path) -> Vec<Value> {
    let mut text = String::new();
    let f = std::fs::File::open(path).unwrap();
    if path.extension().is_some_and(|e| e == "gz") {
        flate2::read::MultiGzDecoder::new(f)
            .read_to_string(&mut text)
            .unwrap();
    } else {
        std::io::BufReader::new(f)
            .read_to_string(&mut text)
            .unwrap();
    }
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Numbers compared by value (`31000.0` equals `31000`).
fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => match (x.as_u64(), y.as_u64()) {
            (Some(x), Some(y)) => x == y,
            _ => x.as_f64() == y.as_f64(),
        },
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same_value(a, b))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| same_value(v, w)))
        }
        _ => a == b,
    }
}

// ---------------------------------------------------------------- Mooncake

#[test]
fn the_hand_made_mooncake_file_round_trips_byte_for_byte() {
    let tmp = TestDir::new("the_hand_made_mooncake_file_round_trips_byte_for_byte");
    let src = fixture("tests/fixtures/mooncake/sample.jsonl");
    let trace = tmp.path("sample-trace.jsonl");
    let back = tmp.path("sample-back.jsonl");
    let summary: Value =
        serde_json::from_str(&convert_ok(&["--from", "mooncake", "--json"], &trace, &src)).unwrap();
    assert_eq!(summary["written"], 8);
    assert_eq!(summary["skipped"]["total"], 0);
    let notes = summary["notes"].to_string();
    assert!(notes.contains("delay, session_id"), "{notes}");

    // The values the format carried, and the block size, are in the trace.
    let (meta, records) = read_trace(&trace);
    assert_eq!(meta.unwrap().block_size, Some(512));
    assert_eq!(records.len(), 8);
    assert_eq!(records[3].arrival_ms, Some(1022.5));
    assert_eq!(records[2].prompt_tokens, 1536);
    assert_eq!(records[2].output_tokens, 301);
    assert_eq!(
        records[4].block_hashes[..3],
        [BlockHash::Int(0), BlockHash::Int(1), BlockHash::Int(5)]
    );
    assert!(
        records
            .iter()
            .all(|r| r.ttft_ms.is_none() && r.itl_ms.is_empty())
    );
    // Extra keys ride along under "mooncake".
    let lines = jsonl(&trace);
    assert_eq!(
        lines[6]["mooncake"],
        json!({"delay": 250, "session_id": "s-7"})
    );

    convert_ok(&["--to", "mooncake"], &back, &trace);
    assert_eq!(
        std::fs::read_to_string(&back).unwrap(),
        std::fs::read_to_string(&src).unwrap()
    );
}

#[test]
fn a_file_with_python_spacing_and_float_timestamps_round_trips_value_for_value() {
    let tmp =
        TestDir::new("a_file_with_python_spacing_and_float_timestamps_round_trips_value_for_value");
    let src = fixture("tests/fixtures/mooncake/spaced.jsonl");
    let trace = tmp.path("spaced-trace.jsonl.gz");
    let back = tmp.path("spaced-back.jsonl.gz");
    convert_ok(&["--from", "mooncake"], &trace, &src);
    convert_ok(&["--to", "mooncake"], &back, &trace);
    let (a, b) = (jsonl(&src), jsonl(&back));
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert!(same_value(x, y), "{x} vs {y}");
    }
    // Integer timestamps stay integers (and 31000.0 becomes 31000).
    assert!(b.iter().all(|l| l["timestamp"].is_u64()), "{b:?}");
}

/// A Mooncake file in the compact form, some requests sharing prefixes, with fractional
/// timestamps and extra keys here and there.
fn mooncake_lines(n: usize, block: usize) -> String {
    let mut s = String::new();
    let mut t = 0u64;
    for i in 0..n {
        let input = 20 + (i * 37) % 280;
        let output = 4 + (i * 7) % 20;
        let blocks = input.div_ceil(block);
        let shared: Vec<u64> = if i % 2 == 0 {
            vec![1, 2, 3]
        } else {
            vec![4, 5]
        };
        let ids: Vec<u64> = shared
            .into_iter()
            .chain((0..).map(|k| 100 + (i * 50 + k) as u64))
            .take(blocks)
            .collect();
        let ts = if i % 5 == 3 {
            format!("{t}.5")
        } else {
            t.to_string()
        };
        let extra = if i % 7 == 0 {
            format!(",\"session_id\":\"c{}\"", i / 7)
        } else {
            String::new()
        };
        s.push_str(&format!(
            "{{\"timestamp\":{ts},\"input_length\":{input},\"output_length\":{output},\"hash_ids\":{}{extra}}}\n",
            serde_json::to_string(&ids).unwrap()
        ));
        t += (i as u64 * 31) % 200;
    }
    s
}

#[test]
fn a_few_hundred_generated_lines_round_trip_byte_for_byte() {
    let tmp = TestDir::new("a_few_hundred_generated_lines_round_trip_byte_for_byte");
    let src = tmp.path("gen.jsonl");
    std::fs::write(&src, mooncake_lines(400, 16)).unwrap();
    let trace = tmp.path("gen-trace.jsonl.gz");
    let back = tmp.path("gen-back.jsonl");
    let summary: Value = serde_json::from_str(&convert_ok(
        &["--from", "mooncake", "--block-size", "16", "--json"],
        &trace,
        &src,
    ))
    .unwrap();
    assert_eq!(summary["written"], 400);
    convert_ok(&["--to", "mooncake"], &back, &trace);
    assert_eq!(
        std::fs::read_to_string(&back).unwrap(),
        std::fs::read_to_string(&src).unwrap()
    );
    let (meta, _) = read_trace(&trace);
    assert_eq!(meta.unwrap().block_size, Some(16));
}

#[test]
fn bad_mooncake_lines_name_file_and_line_and_leave_no_output() {
    let tmp = TestDir::new("bad_mooncake_lines_name_file_and_line_and_leave_no_output");
    let good = "{\"timestamp\":0,\"input_length\":5,\"output_length\":1,\"hash_ids\":[1]}";
    for (bad, what) in [
        (
            "{\"timestamp\":1,\"input_length\":-5,\"output_length\":1,\"hash_ids\":[1]}",
            "input_length",
        ),
        ("{\"timestamp\":1,\"input_length\":5", "invalid"),
        (
            "{\"timestamp\":1,\"input_length\":5,\"output_length\":1,\"hash_ids\":[\"a\"]}",
            "hash_ids",
        ),
        ("{\"input_length\":5,\"output_length\":1}", "timestamp"),
        ("[1, 2]", "JSON object"),
    ] {
        let src = tmp.path("bad.jsonl");
        std::fs::write(&src, format!("{good}\n\n{bad}\n{good}\n")).unwrap();
        let out = tmp.path("bad-trace.jsonl");
        let err = convert_err(&["--from", "mooncake"], &out, &src);
        assert!(err.contains(&format!("{}:3", src.display())), "{err}");
        assert!(err.contains(what), "{what}: {err}");
        assert!(
            !out.exists(),
            "a failed conversion leaves no half-written output"
        );
    }

    // A bad trace line on the way back names file and line too.
    let trace = tmp.path("bad-back.jsonl");
    std::fs::write(
        &trace,
        "{\"meta\":{\"block_size\":16}}\n{\"prompt_tokens\":3,\"arrival_ms\":1}\n{\"prompt_tokens\":\"x\"}\n",
    )
    .unwrap();
    let err = convert_err(
        &["--to", "mooncake"],
        &tmp.path("bad-back-out.jsonl"),
        &trace,
    );
    assert!(err.contains(&format!("{}:3", trace.display())), "{err}");

    // The input is never the output.
    let src = tmp.path("self.jsonl");
    std::fs::write(&src, format!("{good}\n")).unwrap();
    let err = convert_err(&["--from", "mooncake"], &src, &src);
    assert!(err.contains("is the same file as the input file"), "{err}");
    assert_eq!(std::fs::read_to_string(&src).unwrap(), format!("{good}\n"));
}

/// A trace as the tap writes it: block size 16, hashes of full blocks only (no partial
/// tail), records in completion order, one without hashes, one without an arrival.
fn tap_like_trace(path: &Path) {
    let big = u64::MAX - 10;
    let lines = [
        json!({"meta": {"version": 1, "block_size": 16}}),
        // 40 tokens: 2 full blocks hashed, the partial third not.
        json!({"prompt_tokens": 40, "output_tokens": 5, "arrival_ms": 120.25,
               "ttft_ms": 10.0, "block_hashes": [7, 8]}),
        // Shares the first block with the record above; 32 tokens, both blocks full.
        json!({"prompt_tokens": 32, "output_tokens": 3, "arrival_ms": 0.5,
               "block_hashes": [7, 9]}),
        // No hashes at all (prefix caching off).
        json!({"prompt_tokens": 20, "output_tokens": 2, "arrival_ms": 60.0}),
        // String hashes (a converted workload), 3 full blocks + partial.
        json!({"prompt_tokens": 50, "output_tokens": 4, "arrival_ms": 90.0,
               "block_hashes": ["a", "b", "c"], "incomplete": true}),
        json!({"prompt_tokens": 10, "output_tokens": 1}),
        json!({"prompt_tokens": 64, "output_tokens": 6, "arrival_ms": 200.0,
               "block_hashes": [7, 9, big, 11]}),
    ];
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(path, text).unwrap();
}

#[test]
fn a_tap_trace_exports_sorted_with_ids_covering_every_prompt() {
    let tmp = TestDir::new("a_tap_trace_exports_sorted_with_ids_covering_every_prompt");
    let trace = tmp.path("tap.jsonl");
    tap_like_trace(&trace);
    let out = tmp.path("tap-mooncake.jsonl");
    let summary: Value =
        serde_json::from_str(&convert_ok(&["--to", "mooncake", "--json"], &out, &trace)).unwrap();
    assert_eq!(summary["written"], 5);
    assert_eq!(summary["skipped"]["total"], 1);
    assert!(
        summary["skipped"]["examples"][0]
            .as_str()
            .unwrap()
            .contains(&format!("{}:6", trace.display())),
        "{summary}"
    );
    let lines = jsonl(&out);
    let ts: Vec<f64> = lines
        .iter()
        .map(|l| l["timestamp"].as_f64().unwrap())
        .collect();
    assert_eq!(ts, [0.5, 60.0, 90.0, 120.25, 200.0], "sorted by arrival");
    let ids = |i: usize| -> Vec<u64> {
        lines[i]["hash_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect()
    };
    // ceil(prompt / 16) ids each.
    for (i, l) in lines.iter().enumerate() {
        let p = l["input_length"].as_u64().unwrap();
        assert_eq!(ids(i).len() as u64, p.div_ceil(16), "{l}");
    }
    assert_eq!(ids(0), [7, 9]);
    assert_eq!(ids(3)[..2], [7, 8]);
    assert_eq!(ids(4), [7, 9, u64::MAX - 10, 11]);
    // Fresh ids (the partial tail of line 3, all of line 1, the strings and the partial
    // tail of line 2) are above every hash of the trace and used once.
    let max = u64::MAX - 10;
    let fresh: Vec<u64> = [ids(1), ids(2), vec![ids(3)[2]]].concat();
    assert!(fresh.iter().all(|&id| id > max), "{fresh:?}");
    assert_eq!(fresh.iter().collect::<HashSet<_>>().len(), fresh.len());
    let notes = summary["notes"].to_string();
    assert!(notes.contains("fresh ids"), "{notes}");
    assert!(notes.contains("sorted by arrival"), "{notes}");

    // Coarser ids: a multiple of 16 merges hashes, keeping exactly what is shared.
    let coarse = tmp.path("tap-32.jsonl");
    convert_ok(&["--to", "mooncake", "--block-size", "32"], &coarse, &trace);
    let c = jsonl(&coarse);
    let cid = |i: usize| -> Vec<u64> {
        c[i]["hash_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect()
    };
    assert_eq!(cid(0), [9], "32 tokens: the hash of blocks 0-1");
    assert_eq!(cid(4), [9, 11], "64 tokens");
    assert_eq!(cid(3)[0], 8, "40 tokens: blocks 0-1, then a partial block");
    assert!(cid(3)[1] > max);

    // A finer or non-multiple block size cannot be derived: refused, naming the sizes.
    for bs in ["8", "24"] {
        let err = convert_err(
            &["--to", "mooncake", "--block-size", bs],
            &tmp.path("tap-bad.jsonl"),
            &trace,
        );
        assert!(err.contains("16 tokens each"), "{err}");
    }
    // Hashes without a block size in the meta line: the user must say.
    let bare = tmp.path("bare.jsonl");
    std::fs::write(
        &bare,
        "{\"prompt_tokens\":20,\"arrival_ms\":0,\"block_hashes\":[3]}\n",
    )
    .unwrap();
    let err = convert_err(&["--to", "mooncake"], &tmp.path("bare-out.jsonl"), &bare);
    assert!(err.contains("--block-size"), "{err}");
    convert_ok(
        &["--to", "mooncake", "--block-size", "16"],
        &tmp.path("bare-out.jsonl"),
        &bare,
    );
    // Flags of another format are refused.
    let err = convert_err(
        &["--to", "mooncake", "--all-requests"],
        &tmp.path("x.jsonl"),
        &trace,
    );
    assert!(err.contains("guidellm only"), "{err}");
}

// ---------------------------------------------------------------- guidellm

pub(super) fn report(name: &str) -> Value {
    let f = std::fs::File::open(fixture(&format!("tests/fixtures/{name}"))).unwrap();
    let mut s = String::new();
    flate2::read::MultiGzDecoder::new(f)
        .read_to_string(&mut s)
        .unwrap();
    serde_json::from_str(&s).unwrap()
}

/// guidellm's mean of `metric` for `status` over all benchmarks of the report (each
/// benchmark's mean weighted by its count), and that count.
fn guidellm_mean(r: &Value, metric: &str, status: &str) -> (f64, u64) {
    let (mut sum, mut n) = (0.0, 0);
    for b in r["benchmarks"].as_array().unwrap() {
        let s = &b["metrics"][metric][status];
        let c = s["count"].as_u64().unwrap();
        sum += s["mean"].as_f64().unwrap() * c as f64;
        n += c;
    }
    (sum / n as f64, n)
}

fn guidellm_count(r: &Value, status: &str) -> u64 {
    r["benchmarks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["metrics"]["request_totals"][status].as_u64().unwrap())
        .sum()
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

fn within_one_percent(ours: f64, theirs: f64, what: &str) {
    assert!(
        (ours - theirs).abs() <= 0.01 * theirs.abs(),
        "{what}: ours {ours}, guidellm {theirs}"
    );
}

/// The converted trace's request count, mean TTFT, mean ITL (over all gaps) and mean
/// request latency (TTFT + gaps, complete records) against the report's own figures.
fn check_against_report(name: &str, records: &[TraceRecord]) {
    let r = report(name);
    assert_eq!(
        records.len() as u64,
        guidellm_count(&r, "total"),
        "requests"
    );
    let incomplete = records.iter().filter(|x| x.incomplete).count() as u64;
    assert_eq!(
        incomplete,
        guidellm_count(&r, "errored") + guidellm_count(&r, "incomplete"),
        "errored + incomplete"
    );

    // Incomplete records carry no latencies: the quantiles are over successful requests,
    // as guidellm's headline figures are.
    let ttft: Vec<f64> = records.iter().filter_map(|x| x.ttft_ms).collect();
    let (theirs, n) = guidellm_mean(&r, "time_to_first_token_ms", "successful");
    assert_eq!(ttft.len() as u64, n, "requests with a TTFT");
    within_one_percent(mean(&ttft), theirs, "mean TTFT");

    let gaps: Vec<f64> = records.iter().flat_map(|x| x.itl_ms.clone()).collect();
    let (theirs, n) = guidellm_mean(&r, "inter_token_latency_ms", "successful");
    assert_eq!(gaps.len() as u64, n, "inter-token gaps");
    within_one_percent(mean(&gaps), theirs, "mean ITL");

    let latency: Vec<f64> = records
        .iter()
        .filter(|x| !x.incomplete)
        .map(|x| x.ttft_ms.unwrap() + x.itl_ms.iter().sum::<f64>())
        .collect();
    let (theirs, n) = guidellm_mean(&r, "request_latency", "successful");
    assert_eq!(latency.len() as u64, n, "successful requests");
    within_one_percent(mean(&latency), theirs * 1000.0, "mean request latency");

    let out: Vec<f64> = records
        .iter()
        .filter(|x| !x.incomplete)
        .map(|x| f64::from(x.output_tokens))
        .collect();
    let (theirs, _) = guidellm_mean(&r, "output_token_count", "successful");
    within_one_percent(mean(&out), theirs, "mean output tokens");
}

#[test]
fn a_real_guidellm_report_agrees_with_guidellm_within_one_percent() {
    let tmp = TestDir::new("a_real_guidellm_report_agrees_with_guidellm_within_one_percent");
    let trace = tmp.path("guidellm.jsonl");
    convert_ok(
        &["--from", "guidellm"],
        &trace,
        &fixture("tests/fixtures/guidellm/report.json.gz"),
    );
    let (meta, records) = read_trace(&trace);
    assert_eq!(meta.unwrap().model.as_deref(), Some("tiny"));
    check_against_report("guidellm/report.json.gz", &records);
    assert_eq!(records.len(), 50);
    assert!(records.iter().all(|r| r.prompt_tokens == 64));
    // Every request produced its max_tokens.
    assert!(
        records
            .iter()
            .all(|r| r.finish_reason.as_deref() == Some("length"))
    );
    // Arrivals from the first request, in order.
    assert_eq!(records[0].arrival_ms, Some(0.0));
    assert!(
        records
            .windows(2)
            .all(|w| w[0].arrival_ms <= w[1].arrival_ms)
    );

    // `summarize` reads the result.
    let out = vcr()
        .args(["inspect", "summarize", "--json"])
        .arg(&trace)
        .run();
    let s: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(s["records"], 50);
}

#[test]
fn errored_and_cancelled_requests_of_a_two_benchmark_report_become_incomplete_records() {
    let tmp = TestDir::new(
        "errored_and_cancelled_requests_of_a_two_benchmark_report_become_incomplete_records",
    );
    let name = "guidellm/report-errors.json.gz";
    let trace = tmp.path("guidellm-errors.jsonl.gz");
    let summary: Value = serde_json::from_str(&convert_ok(
        &["--from", "guidellm", "--json"],
        &trace,
        &fixture(&format!("tests/fixtures/{name}")),
    ))
    .unwrap();
    let (_, records) = read_trace(&trace);
    check_against_report(name, &records);
    // Two requests were started as their benchmark stopped: outside guidellm's window.
    assert_eq!(summary["skipped"]["total"], 2, "{summary}");

    let errored: Vec<&TraceRecord> = records
        .iter()
        .filter(|r| {
            r.abort_reason
                .as_deref()
                .is_some_and(|a| a.contains("errored"))
        })
        .collect();
    assert_eq!(errored.len(), 4);
    assert!(errored.iter().all(|r| {
        r.incomplete
            && r.finish_reason.is_none()
            && r.error
                .as_deref()
                .is_some_and(|e| e.contains("Internal server error"))
    }));
    // None carries latencies (out of the quantiles); two failed before their first
    // token: no output, still there.
    assert!(
        errored
            .iter()
            .all(|r| r.ttft_ms.is_none() && r.itl_ms.is_empty())
    );
    assert_eq!(errored.iter().filter(|r| r.output_tokens == 0).count(), 2);
    let cancelled = records
        .iter()
        .filter(|r| r.error.as_deref() == Some("Request was cancelled"))
        .count();
    assert_eq!(cancelled, 3);
    // Successful requests cut short by the server (ignore_eos, fewer than max_tokens)
    // have no finish reason the report can tell.
    assert!(
        records
            .iter()
            .any(|r| !r.incomplete && r.output_tokens < 32 && r.finish_reason.is_none())
    );

    // --all-requests keeps the two outside the window as well.
    let all = tmp.path("guidellm-all.jsonl");
    convert_ok(
        &["--from", "guidellm", "--all-requests"],
        &all,
        &fixture(&format!("tests/fixtures/{name}")),
    );
    assert_eq!(read_trace(&all).1.len(), records.len() + 2);
}

#[test]
fn not_a_guidellm_report_is_a_clear_error() {
    let tmp = TestDir::new("not_a_guidellm_report_is_a_clear_error");
    let src = tmp.path("notreport.json");
    std::fs::write(&src, "{\"hello\": 1}").unwrap();
    let err = convert_err(&["--from", "guidellm"], &tmp.path("x.jsonl"), &src);
    assert!(err.contains("not a guidellm report"), "{err}");

    let src = tmp.path("broken.json");
    std::fs::write(&src, "{\"benchmarks\": [\n  {\"requests\": }\n]}").unwrap();
    let err = convert_err(&["--from", "guidellm"], &tmp.path("x.jsonl"), &src);
    assert!(err.contains(&format!("{}:2:", src.display())), "{err}");

    let src = tmp.path("report.yaml");
    std::fs::write(&src, "benchmarks:\n- config: {}\n").unwrap();
    let err = convert_err(&["--from", "guidellm"], &tmp.path("x.jsonl"), &src);
    assert!(err.contains("guidellm export"), "{err}");

    let err = convert_err(
        &["--from", "guidellm", "--block-size", "16"],
        &tmp.path("x.jsonl"),
        &fixture("tests/fixtures/guidellm/report.json.gz"),
    );
    assert!(err.contains("Mooncake format only"), "{err}");
}

// ---------------------------------------------------------------- vllm-rs bench serve

/// `vllm-vcr serve` on `ports` (HTTP, handshake) with `extra`, answering /health; stopped
/// with SIGINT when the test ends, however it ends.
fn serve(ports: &[u16], extra: &[&str]) -> TestProcess {
    let mut cmd = vcr_command();
    cmd.args(["serve", "--port", &ports[0].to_string()])
        .args(["--handshake-port", &ports[1].to_string()])
        .args(extra)
        .stdout(Stdio::null());
    let serve = TestProcess::start("convert-serve", cmd).with_grace(Duration::from_secs(30));
    let deadline = Instant::now() + Duration::from_secs(120);
    while !http_get_ok(ports[0], "/health") {
        assert!(Instant::now() < deadline, "vllm-vcr serve did not come up");
        std::thread::sleep(Duration::from_millis(200));
    }
    serve
}

/// `vllm-rs bench serve --dataset-name timed_trace` replays exported files against
/// `vllm-vcr serve`: every request is sent, with the recorded prompt and output lengths
/// (a tap trace's partial tail blocks need the fresh ids for that).
#[test]
fn vllm_rs_bench_serve_replays_exported_timed_traces() {
    let tmp = TestDir::new("vllm_rs_bench_serve_replays_exported_timed_traces");
    let rs = vllm_vcr::frontends::ensure_vllm_rs("0.33.0").unwrap_or_else(|e| {
        panic!("vllm-rs 0.33.0 is not available (run `cargo xtask fetch` first): {e:#}")
    });
    // A Mooncake file through the round trip, and a tap-like trace.
    let src = tmp.path("replay.jsonl");
    std::fs::write(&src, mooncake_lines(20, 16)).unwrap();
    let trace = tmp.path("replay-trace.jsonl");
    let round_trip = tmp.path("replay-export.jsonl");
    convert_ok(&["--from", "mooncake", "--block-size", "16"], &trace, &src);
    convert_ok(&["--to", "mooncake"], &round_trip, &trace);
    let tap = tmp.path("replay-tap.jsonl");
    tap_like_trace(&tap);
    let tap_export = tmp.path("replay-tap-export.jsonl");
    convert_ok(&["--to", "mooncake"], &tap_export, &tap);

    let ports = vllm_vcr::child::free_ports(2).unwrap();
    let model = tmp.path("model");
    vllm_vcr::tiny_model::write_to(&model).unwrap();
    let _serve = serve(&ports, &[]);
    for exported in [&round_trip, &tap_export] {
        let lines = jsonl(exported);
        let sum = |k: &str| -> u64 { lines.iter().map(|l| l[k].as_u64().unwrap()).sum() };
        let bench = Command::new(&rs)
            .args(["bench", "serve", "--port", &ports[0].to_string()])
            .args(["--model", "tiny", "--tokenizer"])
            .arg(&model)
            .args(["--dataset-name", "timed_trace", "--dataset-path"])
            .arg(exported)
            .args(["--timed-trace-chunk-hash-size", "16"])
            .args(["--timed-trace-sec-multiplier", "0.001"])
            .args(["--num-prompts", &lines.len().to_string()])
            .args(["--disable-tqdm", "--ignore-eos"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&bench.stdout);
        assert!(
            bench.status.success(),
            "{text}\n{}",
            String::from_utf8_lossy(&bench.stderr)
        );
        let field = |name: &str| -> u64 {
            text.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().last())
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no `{name}` in:\n{text}"))
        };
        let what = exported.display();
        assert_eq!(
            field("Successful requests:"),
            lines.len() as u64,
            "{what}\n{text}"
        );
        assert_eq!(field("Failed requests:"), 0, "{what}\n{text}");
        assert_eq!(
            field("Total input tokens:"),
            sum("input_length"),
            "{what}\n{text}"
        );
        assert_eq!(
            field("Total generated tokens:"),
            sum("output_length"),
            "{what}\n{text}"
        );
    }
}

/// A public-trace-shaped Mooncake file of long contexts (20k–60k-token prompts, 512-token
/// blocks with shared prefixes) replayed by `vllm-rs bench serve --dataset-name
/// timed_trace` against `serve --max-model-len 131072`: every request succeeds (the
/// embedded model once capped the context at 2,048 and 236 of 300 such requests failed).
#[test]
fn a_long_context_mooncake_trace_replays_against_serve_with_no_failures() {
    let tmp = TestDir::new("a_long_context_mooncake_trace_replays_against_serve_with_no_failures");
    let rs = vllm_vcr::frontends::ensure_vllm_rs("0.33.0").unwrap_or_else(|e| {
        panic!("vllm-rs 0.33.0 is not available (run `cargo xtask fetch` first): {e:#}")
    });
    let src = tmp.path("long.jsonl");
    let mut lines = String::new();
    let (mut total_in, mut total_out) = (0u64, 0u64);
    let n: usize = 10;
    for i in 0..n {
        let input = 20_000 + (i * 4_441) % 40_001;
        let output = 8 + (i * 5) % 24;
        let blocks = input.div_ceil(512);
        // half the requests share a 16-block (8k-token) system prefix
        let ids: Vec<String> = (0..blocks)
            .map(|k| {
                if i % 2 == 0 && k < 16 {
                    k
                } else {
                    1_000 + i * 200 + k
                }
            })
            .map(|k| k.to_string())
            .collect();
        lines.push_str(&format!(
            "{{\"timestamp\": {}, \"input_length\": {input}, \"output_length\": {output}, \"hash_ids\": [{}]}}\n",
            i * 150,
            ids.join(", ")
        ));
        total_in += input as u64;
        total_out += output as u64;
    }
    std::fs::write(&src, lines).unwrap();
    let ports = vllm_vcr::child::free_ports(2).unwrap();
    let model = tmp.path("long-model");
    vllm_vcr::tiny_model::write_to(&model).unwrap();
    let _serve = serve(&ports, &["--max-model-len", "131072"]);
    let bench = Command::new(&rs)
        .args(["bench", "serve", "--port", &ports[0].to_string()])
        .args(["--model", "tiny", "--tokenizer"])
        .arg(&model)
        .args(["--dataset-name", "timed_trace", "--dataset-path"])
        .arg(&src)
        .args(["--timed-trace-chunk-hash-size", "512"])
        .args(["--timed-trace-sec-multiplier", "0.001"])
        .args(["--num-prompts", &n.to_string()])
        .args(["--disable-tqdm", "--ignore-eos"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&bench.stdout);
    assert!(
        bench.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&bench.stderr)
    );
    let field = |name: &str| -> u64 {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no `{name}` in:\n{text}"))
    };
    assert_eq!(field("Successful requests:"), n as u64, "{text}");
    assert_eq!(field("Failed requests:"), 0, "{text}");
    assert_eq!(field("Total input tokens:"), total_in, "{text}");
    assert_eq!(field("Total generated tokens:"), total_out, "{text}");
}
