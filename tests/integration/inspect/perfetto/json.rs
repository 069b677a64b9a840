//! The Chrome Trace Event JSON output: every event checked against the format, lanes as the
//! peak concurrency, chunks and token ids, per-engine step tracks, a window of the trace, a
//! big trace, and an output that never overwrites an input.

use super::*;

#[test]
fn the_cpu_engine_capture_with_its_step_stats_is_a_valid_chrome_trace() {
    let tmp = TestDir::new("the_cpu_engine_capture_with_its_step_stats_is_a_valid_chrome_trace");
    let dir = fixture("tests/fixtures/cpu-engine-capture");
    let steps = dir.join("steps.jsonl.gz");
    let (summary, events, _) = perfetto(
        &tmp,
        &dir.join("trace.jsonl.gz"),
        &["--step-stats", steps.to_str().unwrap()],
    );
    validate(&events);
    assert_eq!(summary["requests"], 301);
    assert_eq!(summary["without_arrival"], 0);
    assert_eq!(summary["lanes"], 8, "the load ran 8 requests at a time");
    assert_eq!(summary["engines"], 1);
    assert_eq!(summary["late_samples"], 0);
    let steps = summary["steps"].as_u64().unwrap();
    assert!(steps > 1000);
    let names = count_names(&events);
    for counter in [
        "active_requests",
        "engine_running",
        "prefill_tokens",
        "sched_running_reqs",
        "sched_waiting_reqs",
        "sched_kv_cache_usage",
    ] {
        assert!(names.contains_key(counter), "no {counter} track");
    }
    // the capture did not draft
    assert!(!names.contains_key("sched_accept_rate"));
    let prefills = events
        .iter()
        .filter(|e| e["pid"] == 1 && e["name"] == "prefill")
        .count();
    assert_eq!(prefills, 301);
    // every request's spans, in order, each in its own lane
    for lane in 1..=8 {
        assert_sequential(&events, 1, lane);
    }
    assert_eq!(peak(&events, "active_requests"), 8.0);
    // the steps: one per sidecar line, back to back, classified
    assert_eq!(assert_sequential(&events, 2, 1) as u64, steps);
    let step_names: Vec<&str> = events
        .iter()
        .filter(|e| e["pid"] == 2 && e["ph"] == "X")
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert!(step_names.iter().any(|n| n.starts_with("decode B")));
    assert!(step_names.iter().any(|n| n.starts_with("prefill")));
    assert!(
        events
            .iter()
            .any(|e| e["ph"] == "M" && e["pid"] == 2 && e["args"]["name"] == "scheduler steps")
    );
    // recorded token ids ride the spans: each request's chunks add up to its ids
    let with_ids = events
        .iter()
        .filter(|e| e["pid"] == 1 && e["args"]["token_ids"].is_array())
        .count();
    assert!(with_ids > 301, "{with_ids}");
}

#[test]
fn lanes_chunks_token_ids_and_records_without_arrival() {
    let tmp = TestDir::new("lanes_chunks_token_ids_and_records_without_arrival");
    let trace = tmp.path("small.jsonl");
    std::fs::write(&trace, SMALL).unwrap();
    let (summary, events, stderr) = perfetto(&tmp, &trace, &[]);
    validate(&events);
    assert_eq!(summary["lanes"], 3, "peak concurrency is 3");
    assert_eq!(summary["requests"], 6);
    assert_eq!(summary["without_arrival"], 1);
    assert_eq!(summary["incomplete"], 1);
    assert!(
        stderr.contains("1 record(s) have no arrival_ms"),
        "{stderr}"
    );
    assert_eq!(peak(&events, "active_requests"), 3.0);
    // the 3-token chunk, with its tokens, on the shared clock (µs)
    let x3 = events
        .iter()
        .find(|e| e["name"] == "decode x3")
        .expect("a 3-token chunk");
    assert_eq!(x3["args"]["token_ids"], json!([3, 4, 5]));
    assert_eq!(x3["ts"], 15000);
    assert_eq!(x3["dur"], 5000);
    let a_prefill = events
        .iter()
        .find(|e| e["name"] == "prefill" && e["args"]["request_id"] == "a")
        .unwrap();
    assert_eq!(a_prefill["args"]["token_ids"], json!([1]));
    assert_eq!(a_prefill["dur"], 10000);
    let first_decode = events
        .iter()
        .find(|e| e["name"] == "decode" && e["args"]["token_ids"].is_array())
        .unwrap();
    assert_eq!(first_decode["args"]["token_ids"], json!([2]));
    assert_eq!(first_decode["ts"], 10000);
    // prefill vs decode colours
    assert_ne!(a_prefill["cname"], first_decode["cname"]);
    let lane_of = |id: &str| {
        events
            .iter()
            .find(|e| e["name"] == "prefill" && e["args"]["request_id"] == id)
            .unwrap()["tid"]
            .as_u64()
            .unwrap()
    };
    assert!(lane_of("d") <= 3);
    assert_eq!(lane_of("f"), lane_of("g"), "g reuses the lane f freed");
    let c = events
        .iter()
        .find(|e| e["name"] == "prefill" && e["args"]["request_id"] == "c")
        .unwrap();
    assert_eq!(c["args"]["incomplete"], true);
    assert_eq!(c["args"]["abort_reason"], "capture stopped");
    assert_eq!(events[0]["args"]["name"], "m");
    // the per-gap engine context, in time order
    let running: Vec<(i64, f64)> = events
        .iter()
        .filter(|e| e["name"] == "engine_running")
        .map(|e| {
            (
                e["ts"].as_i64().unwrap(),
                e["args"]["value"].as_f64().unwrap(),
            )
        })
        .collect();
    assert_eq!(running, vec![(15000, 3.0), (16000, 3.0), (20000, 3.0)]);
    let active: Vec<(i64, f64)> = events
        .iter()
        .filter(|e| e["name"] == "active_requests")
        .map(|e| {
            (
                e["ts"].as_i64().unwrap(),
                e["args"]["value"].as_f64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        &active[..6],
        &[
            (0, 1.0),
            (1000, 2.0),
            (2000, 3.0),
            (16000, 2.0),
            (17000, 1.0),
            (20000, 0.0)
        ]
    );
    assert_eq!(active.last().unwrap().1, 0.0);

    // one row per request, gzip output
    let (summary, events, _) = perfetto_to(
        &tmp,
        &trace,
        "small-rows.json.gz",
        &["--track-per-request", "--name", "mine"],
    );
    validate(&events);
    assert_eq!(summary["lanes"], 6);
    assert!(
        events
            .iter()
            .any(|e| e["ph"] == "M" && e["name"] == "thread_name" && e["args"]["name"] == "b")
    );
    assert_eq!(events[0]["args"]["name"], "mine");
}

/// Without `-o` the trace goes to stdout: Perfetto's protobuf format by default (piped,
/// not a terminal), JSON with `--format json`.
#[test]
fn stdout_is_the_default_output() {
    let tmp = TestDir::new("stdout_is_the_default_output");
    let trace = tmp.path("stdout.jsonl");
    std::fs::write(&trace, SMALL).unwrap();
    let out = vcr().args(["inspect", "perfetto"]).arg(&trace).output();
    assert!(out.status.success());
    assert!(packets(&out.stdout) > 6, "a stream of TracePackets");
    let out = vcr()
        .args(["inspect", "perfetto", "--format", "json"])
        .arg(&trace)
        .output();
    assert!(out.status.success());
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    validate(doc["traceEvents"].as_array().unwrap());
}

#[test]
fn step_stats_of_two_engines_with_drafting() {
    let tmp = TestDir::new("step_stats_of_two_engines_with_drafting");
    let trace = tmp.path("dp.jsonl");
    std::fs::write(&trace, SMALL).unwrap();
    let steps = tmp.path("dp-steps.jsonl");
    let spec = |acc: u32| json!({"num_spec_tokens": 2, "num_drafts": 2, "num_draft_tokens": 4, "num_accepted_tokens": acc});
    let lines = [
        json!({"ts_ms": 10.0, "engine": 0, "step_ms": null, "num_running_reqs": 1, "num_waiting_reqs": 2, "kv_cache_usage": 0.1, "prefill_requests": 1, "prefill_tokens": 4}),
        json!({"ts_ms": 10.5, "engine": 1, "step_ms": null, "num_running_reqs": 3, "num_waiting_reqs": 0, "kv_cache_usage": 0.5, "prefill_requests": 1, "prefill_tokens": 8}),
        json!({"ts_ms": 15.0, "engine": 0, "step_ms": 5.0, "num_running_reqs": 2, "num_waiting_reqs": 0, "kv_cache_usage": 0.2, "prefill_requests": 0, "prefill_tokens": 0, "spec_decoding": spec(3)}),
        // a step_ms longer than the gap since the previous step: clamped, no overlap
        json!({"ts_ms": 16.0, "engine": 0, "step_ms": 3.0, "num_running_reqs": 2, "num_waiting_reqs": 0, "kv_cache_usage": 0.2, "prefill_requests": 0, "prefill_tokens": 0, "spec_decoding": spec(1)}),
        // slightly out of order across engines
        json!({"ts_ms": 14.0, "engine": 1, "step_ms": 3.5, "num_running_reqs": 3, "num_waiting_reqs": 0, "kv_cache_usage": 0.5, "prefill_requests": 0, "prefill_tokens": 0}),
    ];
    std::fs::write(
        &steps,
        lines.iter().map(|l| format!("{l}\n")).collect::<String>(),
    )
    .unwrap();
    let (summary, events, _) = perfetto(&tmp, &trace, &["--step-stats", steps.to_str().unwrap()]);
    validate(&events);
    assert_eq!(summary["steps"], 5);
    assert_eq!(summary["engines"], 2);
    assert_eq!(summary["late_samples"], 0);
    assert_eq!(assert_sequential(&events, 2, 1), 3);
    assert_eq!(assert_sequential(&events, 3, 1), 2);
    let step = |pid: u64, ts_end: i64| {
        events
            .iter()
            .find(|e| {
                e["ph"] == "X"
                    && e["pid"] == pid
                    && e["ts"].as_i64().unwrap() + e["dur"].as_i64().unwrap() == ts_end
            })
            .unwrap_or_else(|| panic!("no step of pid {pid} ending at {ts_end}"))
            .clone()
    };
    assert_eq!(step(2, 10000)["name"], "prefill");
    assert_eq!(step(3, 10500)["name"], "prefill+decode B2 (+1r 8t)");
    let s = step(2, 15000);
    assert_eq!(s["name"], "decode B2");
    assert_eq!(s["ts"], 10000);
    assert_eq!(s["args"]["spec_accepted"], 3);
    assert_eq!(s["args"]["spec_draft"], 4);
    assert_eq!(s["args"]["spec_drafts"], 2);
    assert_eq!(s["args"]["running"], 2);
    assert_eq!(s["args"]["waiting"], 0);
    assert_eq!(s["args"]["kv_cache_usage"], 0.2);
    assert_eq!(s["args"]["step_ms"], 5.0);
    assert_eq!(
        step(2, 16000)["ts"],
        15000,
        "clamped to the previous step's end"
    );
    // counters per engine process
    let counter = |pid: u64, name: &str| -> Vec<(i64, f64)> {
        events
            .iter()
            .filter(|e| e["ph"] == "C" && e["pid"] == pid && e["name"] == name)
            .map(|e| {
                (
                    e["ts"].as_i64().unwrap(),
                    e["args"]["value"].as_f64().unwrap(),
                )
            })
            .collect()
    };
    assert_eq!(
        counter(2, "sched_accept_rate"),
        vec![(15000, 0.75), (16000, 0.25)]
    );
    assert!(counter(3, "sched_accept_rate").is_empty());
    assert_eq!(
        counter(3, "sched_running_reqs"),
        vec![(10500, 3.0), (14000, 3.0)]
    );
    assert_eq!(
        counter(2, "sched_waiting_reqs"),
        vec![(10000, 2.0), (15000, 0.0), (16000, 0.0)]
    );
    assert_eq!(counter(3, "sched_kv_cache_usage").len(), 2);
}

/// The benchmark's input (docs/performance.md): a 2,500-request trace converts into a
/// valid file with one span per token chunk. Set `PERFETTO_BENCH_TRACE=path` to keep the
/// generated trace for timing the release binary.
#[test]
fn a_2500_request_trace() {
    let tmp = TestDir::new("a_2500_request_trace");
    let trace = match std::env::var_os("PERFETTO_BENCH_TRACE") {
        Some(p) => PathBuf::from(p),
        None => tmp.path("synthetic-2500.jsonl"),
    };
    let peak_concurrency = write_synthetic_trace(&trace, 2500);
    let (summary, events, _) = perfetto(&tmp, &trace, &[]);
    validate(&events);
    assert_eq!(summary["requests"], 2500);
    assert_eq!(summary["lanes"], peak_concurrency);
    assert_eq!(peak(&events, "active_requests"), peak_concurrency as f64);
    let names = count_names(&events);
    assert_eq!(names["prefill"], 2500);
    let decodes: usize = names
        .iter()
        .filter(|(n, _)| n.starts_with("decode"))
        .map(|(_, c)| c)
        .sum();
    assert!(decodes > 2500 * 100, "{decodes}");
    assert!(names.contains_key("decode x3"));
    // the counters are deduplicated per time
    assert!(names["engine_running"] <= decodes);
    assert_eq!(
        names["active_requests"],
        events
            .iter()
            .filter(|e| e["name"] == "active_requests")
            .map(|e| e["ts"].as_i64().unwrap())
            .collect::<std::collections::BTreeSet<_>>()
            .len()
    );
}

/// `-o` naming an input (the trace, a hard link to it, the step stats) is refused before
/// anything is written, and a run that fails removes its partial output.
#[test]
fn the_output_never_overwrites_an_input_and_a_failure_leaves_nothing() {
    let tmp = TestDir::new("the_output_never_overwrites_an_input_and_a_failure_leaves_nothing");
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/cpu-engine-capture"
    );
    let trace = tmp.path("own-trace.jsonl.gz");
    let steps = tmp.path("own-steps.jsonl.gz");
    std::fs::copy(format!("{fixture}/trace.jsonl.gz"), &trace).unwrap();
    std::fs::copy(format!("{fixture}/steps.jsonl.gz"), &steps).unwrap();
    let link = tmp.path("own-link.jsonl.gz");
    let _ = std::fs::remove_file(&link);
    std::fs::hard_link(&trace, &link).unwrap();
    let before = std::fs::read(&trace).unwrap();
    let before_steps = std::fs::read(&steps).unwrap();
    for (out, what) in [
        (&trace, "the trace"),
        (&link, "the trace"),
        (&steps, "--step-stats"),
    ] {
        let o = vcr()
            .args(["inspect", "perfetto"])
            .arg(&trace)
            .arg("--step-stats")
            .arg(&steps)
            .arg("-o")
            .arg(out)
            .output();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{}: {err}", out.display());
        assert!(
            err.contains("would destroy the input") && err.contains(what),
            "{err}"
        );
    }
    assert_eq!(
        std::fs::read(&trace).unwrap(),
        before,
        "the trace is intact"
    );
    assert_eq!(
        std::fs::read(&steps).unwrap(),
        before_steps,
        "the step stats are intact"
    );

    // a trace that fails mid-way (not gzip at all): no output is left
    a_failed_run_leaves_no_output(&tmp, "own-bad", "own-bad-out.json");
    // a missing input: no output either
    let out = tmp.path("own-bad-out.json");
    let o = vcr()
        .args(["inspect", "perfetto"])
        .arg(tmp.path("own-missing.jsonl"))
        .arg("-o")
        .arg(&out)
        .output();
    assert!(!o.status.success());
    assert!(!out.exists());
}

/// `--from-ms/--to-ms` and `--max-requests` draw a window of a big trace: only the requests
/// arriving in it, at most N of them, and the steps ending in it.
#[test]
fn a_window_and_a_request_cap_draw_part_of_the_trace() {
    let tmp = TestDir::new("a_window_and_a_request_cap_draw_part_of_the_trace");
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/cpu-engine-capture"
    );
    let trace = format!("{fixture}/trace.jsonl.gz");
    let steps = format!("{fixture}/steps.jsonl.gz");
    let run = |extra: &[&str]| -> Value {
        let out = tmp.path(&format!(
            "window-{}.json",
            extra.join("_").replace(['-', '.'], "")
        ));
        let o = vcr()
            .args([
                "inspect",
                "perfetto",
                &trace,
                "--step-stats",
                &steps,
                "--json",
                "-o",
            ])
            .arg(&out)
            .args(extra)
            .output();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let all = run(&[]);
    let total = all["requests"].as_u64().unwrap();
    let capped = run(&["--max-requests", "10"]);
    assert_eq!(capped["requests"], 10);
    assert!(total > 10);
    let first_half = run(&["--to-ms", "1000"]);
    let second_half = run(&["--from-ms", "1000"]);
    assert_eq!(
        first_half["requests"].as_u64().unwrap() + second_half["requests"].as_u64().unwrap(),
        total,
        "the two windows split the requests"
    );
    assert!(first_half["steps"].as_u64().unwrap() < all["steps"].as_u64().unwrap());
}
