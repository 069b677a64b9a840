//! `inspect perfetto`: the output obeys the Chrome Trace Event format (checked event by
//! event), lanes equal the peak concurrency, multi-token chunks and token ids show, records
//! without arrival are reported, the step-stats sidecar becomes per-engine step tracks, and
//! `--open` serves the file to the hosted UI.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::support::{TestDir, fixture, vcr, vcr_command};
use serde_json::{Value, json};

fn read_json(path: &Path) -> Value {
    let bytes = std::fs::read(path).unwrap();
    if path.extension().is_some_and(|e| e == "gz") {
        let mut s = String::new();
        flate2::read::GzDecoder::new(&bytes[..])
            .read_to_string(&mut s)
            .expect("a complete gzip stream");
        serde_json::from_str(&s).unwrap()
    } else {
        serde_json::from_slice(&bytes).unwrap()
    }
}

/// Convert into `out_name` (in the temp dir); return (the JSON summary, the events, stderr).
fn perfetto_to(
    tmp: &TestDir,
    trace: &Path,
    out_name: &str,
    extra: &[&str],
) -> (Value, Vec<Value>, String) {
    let out_path = tmp.path(out_name);
    let out = vcr()
        .args(["inspect", "perfetto", "--json", "-o"])
        .arg(&out_path)
        .arg(trace)
        .args(extra)
        .output();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{stderr}");
    let summary: Value = serde_json::from_slice(&out.stdout).unwrap();
    let doc = read_json(&out_path);
    assert_eq!(doc["displayTimeUnit"], "ms");
    let events = doc["traceEvents"].as_array().unwrap().clone();
    assert_eq!(summary["events"], events.len());
    (summary, events, stderr)
}

fn perfetto(tmp: &TestDir, trace: &Path, extra: &[&str]) -> (Value, Vec<Value>, String) {
    let name = format!("{}.json", trace.file_name().unwrap().to_string_lossy());
    perfetto_to(tmp, trace, &name, extra)
}

/// Every rule of the Chrome Trace Event format this output relies on:
/// - every event has name, ph, ts, pid, tid;
/// - `X` has dur ≥ 0, and the X events of one thread nest (one contains the other or they
///   do not overlap: the Perfetto importer rejects partial overlaps);
/// - `B`/`E` match per (pid, tid), in order;
/// - `C` has a non-empty args object of numbers, and each track's ts never goes back;
/// - `M` is process_name / thread_name with a string args.name.
fn validate(events: &[Value]) {
    let mut open: HashMap<(u64, u64), Vec<String>> = HashMap::new();
    let mut counter_ts: HashMap<(u64, String), f64> = HashMap::new();
    let mut slices: HashMap<(u64, u64), Vec<(f64, f64)>> = HashMap::new();
    for (i, e) in events.iter().enumerate() {
        let ctx = format!("event {i}: {e}");
        let name = e["name"]
            .as_str()
            .unwrap_or_else(|| panic!("no name: {ctx}"));
        let ph = e["ph"].as_str().unwrap_or_else(|| panic!("no ph: {ctx}"));
        let ts = e["ts"].as_f64().unwrap_or_else(|| panic!("no ts: {ctx}"));
        let pid = e["pid"].as_u64().unwrap_or_else(|| panic!("no pid: {ctx}"));
        let tid = e["tid"].as_u64().unwrap_or_else(|| panic!("no tid: {ctx}"));
        assert!(ts >= 0.0 && ts.is_finite(), "{ctx}");
        match ph {
            "X" => {
                let dur = e["dur"]
                    .as_f64()
                    .unwrap_or_else(|| panic!("X without dur: {ctx}"));
                assert!(dur >= 0.0 && dur.is_finite(), "{ctx}");
                slices.entry((pid, tid)).or_default().push((ts, ts + dur));
            }
            "B" => open.entry((pid, tid)).or_default().push(name.to_string()),
            "E" => {
                let top = open.get_mut(&(pid, tid)).and_then(Vec::pop);
                assert!(top.is_some(), "E without B: {ctx}");
            }
            "C" => {
                let args = e["args"]
                    .as_object()
                    .unwrap_or_else(|| panic!("C without args: {ctx}"));
                assert!(
                    !args.is_empty() && args.values().all(Value::is_number),
                    "{ctx}"
                );
                let key = (pid, name.to_string());
                if let Some(prev) = counter_ts.insert(key, ts) {
                    assert!(ts >= prev, "counter {name} goes back in time: {ctx}");
                }
            }
            "M" => {
                assert!(matches!(name, "process_name" | "thread_name"), "{ctx}");
                assert!(e["args"]["name"].is_string(), "{ctx}");
            }
            other => panic!("unexpected ph {other}: {ctx}"),
        }
    }
    assert!(open.values().all(Vec::is_empty), "unmatched B events");
    for ((pid, tid), mut s) in slices {
        // longest first at equal starts, so a parent precedes its children
        s.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.total_cmp(&a.1)));
        let mut stack: Vec<(f64, f64)> = Vec::new();
        for (start, end) in s {
            while stack.last().is_some_and(|&(_, e)| e <= start) {
                stack.pop();
            }
            if let Some(&(ps, pe)) = stack.last() {
                assert!(
                    end <= pe,
                    "pid {pid} tid {tid}: [{start}, {end}] overlaps [{ps}, {pe}] without nesting"
                );
            }
            stack.push((start, end));
        }
    }
}

fn count_names(events: &[Value]) -> BTreeMap<String, usize> {
    events.iter().fold(BTreeMap::new(), |mut m, e| {
        *m.entry(e["name"].as_str().unwrap().to_string())
            .or_default() += 1;
        m
    })
}

/// The X spans of (pid, tid) in time order never overlap at all.
fn assert_sequential(events: &[Value], pid: u64, tid: u64) -> usize {
    let mut s: Vec<(f64, f64)> = events
        .iter()
        .filter(|e| e["ph"] == "X" && e["pid"] == pid && e["tid"] == tid)
        .map(|e| {
            let ts = e["ts"].as_f64().unwrap();
            (ts, ts + e["dur"].as_f64().unwrap())
        })
        .collect();
    s.sort_by(|a, b| a.0.total_cmp(&b.0));
    for w in s.windows(2) {
        assert!(w[0].1 <= w[1].0, "pid {pid} tid {tid}: {w:?} overlap");
    }
    s.len()
}

fn peak(events: &[Value], counter: &str) -> f64 {
    events
        .iter()
        .filter(|e| e["ph"] == "C" && e["name"] == counter)
        .map(|e| e["args"]["value"].as_f64().unwrap())
        .fold(0.0, f64::max)
}

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

const SMALL: &str = concat!(
    r#"{"meta":{"model":"m"}}"#,
    "\n",
    // three overlapping requests, then one after they all ended
    r#"{"request_id":"a","prompt_tokens":4,"output_tokens":5,"arrival_ms":0,"ttft_ms":10,"itl_ms":[5,5],"itl_tokens":[1,3],"output_token_ids":[1,2,3,4,5],"finish_reason":"length","itl_ctx":{"num_running":[3,3],"prefill_tokens":[4,0]}}"#,
    "\n",
    r#"{"request_id":"b","prompt_tokens":4,"output_tokens":2,"arrival_ms":1,"ttft_ms":10,"itl_ms":[5],"finish_reason":"length","itl_ctx":{"num_running":[3]}}"#,
    "\n",
    r#"{"request_id":"d","prompt_tokens":4,"output_tokens":2,"arrival_ms":100,"ttft_ms":10,"itl_ms":[5],"finish_reason":"stop"}"#,
    "\n",
    // written late (finish order is not arrival order)
    r#"{"request_id":"c","prompt_tokens":4,"output_tokens":2,"arrival_ms":2,"ttft_ms":10,"itl_ms":[5],"incomplete":true,"abort_reason":"capture stopped"}"#,
    "\n",
    r#"{"request_id":"e","prompt_tokens":4,"output_tokens":2,"ttft_ms":10,"itl_ms":[5]}"#,
    "\n",
    // sub-µs times: f ends (rounded) exactly when g arrives, and g takes f's lane; rounding
    // each span's start and duration apart would make f's last span end 1 µs into g's
    r#"{"request_id":"f","prompt_tokens":4,"output_tokens":2,"arrival_ms":200,"ttft_ms":0.0006,"itl_ms":[0.0106]}"#,
    "\n",
    r#"{"request_id":"g","prompt_tokens":4,"output_tokens":2,"arrival_ms":200.0112,"ttft_ms":0.01,"itl_ms":[0.0006]}"#,
    "\n",
);

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

/// Read the `serving URL` line; return (host:port, path).
fn served_url(child: &mut std::process::Child) -> (String, String) {
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let served = lines.next().unwrap().unwrap();
    let url = served.strip_prefix("serving ").expect(&served).to_string();
    let open = lines.next().unwrap().unwrap();
    assert_eq!(open, format!("open https://ui.perfetto.dev/#!/?url={url}"));
    let rest = url.strip_prefix("http://127.0.0.1:").unwrap();
    let (port, path) = rest.split_once('/').unwrap();
    (format!("127.0.0.1:{port}"), format!("/{path}"))
}

fn http_bytes(host: &str, request: &str) -> Vec<u8> {
    let mut s = std::net::TcpStream::connect(host).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut resp = Vec::new();
    if let Err(e) = s.read_to_end(&mut resp) {
        panic!("{e}: {request:?} got {resp:?}");
    }
    resp
}

fn http(host: &str, request: &str) -> String {
    String::from_utf8(http_bytes(host, request)).unwrap()
}

/// The served protobuf file: a GET returns the whole packet stream, as a binary type.
fn check_served_proto(host: &str, path: &str) {
    let resp = http_bytes(
        host,
        &format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nOrigin: https://ui.perfetto.dev\r\n\r\n"),
    );
    let split = resp.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&resp[..split]).to_string();
    let body = &resp[split + 4..];
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.contains("Access-Control-Allow-Origin: https://ui.perfetto.dev"),
        "{head}"
    );
    assert!(
        head.contains("Content-Type: application/octet-stream"),
        "{head}"
    );
    assert!(
        head.contains(&format!("Content-Length: {}", body.len())),
        "{head}"
    );
    assert!(packets(body) > 6);
}

fn check_served(host: &str, path: &str) {
    let resp = http(
        host,
        &format!(
            "OPTIONS {path} HTTP/1.1\r\nHost: {host}\r\nOrigin: https://ui.perfetto.dev\r\n\
             Access-Control-Request-Method: GET\r\n\r\n"
        ),
    );
    assert!(resp.starts_with("HTTP/1.1 204"), "{resp}");
    assert!(
        resp.contains("Access-Control-Allow-Origin: https://ui.perfetto.dev\r\n"),
        "{resp}"
    );
    assert!(resp.contains("Access-Control-Allow-Methods: GET"), "{resp}");

    let resp = http(
        host,
        &format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nOrigin: https://ui.perfetto.dev\r\n\r\n"),
    );
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(
        resp.contains("Access-Control-Allow-Origin: https://ui.perfetto.dev\r\n"),
        "{resp}"
    );
    let (head, body) = resp.split_once("\r\n\r\n").unwrap();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(len, body.len());
    let doc: Value = serde_json::from_str(body).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    assert!(events.len() >= 3);
    validate(events);

    let resp = http(
        host,
        &format!("GET /other.json HTTP/1.1\r\nHost: {host}\r\n\r\n"),
    );
    assert!(resp.starts_with("HTTP/1.1 404"), "{resp}");
}

/// `inspect perfetto --open -o OUT` of the small trace, written as `trace_name`: the
/// server process and the host and path it serves the file at.
fn open_small(tmp: &TestDir, trace_name: &str, out: &str) -> (std::process::Child, String, String) {
    let trace = tmp.path(trace_name);
    std::fs::write(&trace, SMALL).unwrap();
    let mut child = vcr_command()
        .args(["inspect", "perfetto", "--open", "--port", "0", "-o"])
        .arg(tmp.path(out))
        .arg(&trace)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (host, path) = served_url(&mut child);
    (child, host, path)
}

#[test]
fn open_serves_the_file_with_cors_for_the_hosted_ui() {
    let tmp = TestDir::new("open_serves_the_file_with_cors_for_the_hosted_ui");
    let (mut child, host, path) = open_small(&tmp, "open.jsonl", "open out.json");
    // a URL-safe name
    assert_eq!(path, "/open_out.json");
    check_served(&host, &path);
    let _ = child.kill();
    let _ = child.wait();
}

/// A client that sends an endless request line, or headers that never end, gets a 400
/// (or its connection closed) without the server holding what it sent; the file is still
/// served to the next client.
#[test]
fn open_bounds_what_a_client_can_send() {
    let tmp = TestDir::new("open_bounds_what_a_client_can_send");
    let (mut child, host, path) = open_small(&tmp, "open-hostile.jsonl", "open-hostile.json");
    for hostile in [
        format!("GET /{} HTTP/1.1", "a".repeat(1 << 20)),
        format!("GET {path} HTTP/1.1\r\n{}", "X-Pad: y\r\n".repeat(100_000)),
    ] {
        let mut s = std::net::TcpStream::connect(&host).unwrap();
        // the server stops reading at its cap: a write may fail once it has answered
        let _ = s.write_all(hostile.as_bytes());
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        assert!(
            answer.is_empty() || answer.starts_with("HTTP/1.1 400"),
            "{answer}"
        );
    }
    check_served(&host, &path);
    let _ = child.kill();
    let _ = child.wait();
}

/// Fuzz: whatever bytes clients send the viewer server (random bytes, request lines with
/// junk, cut-off headers), each gets an answer or a closed connection and the server
/// keeps serving the file. 128 cases, about a second.
#[test]
fn open_survives_any_bytes_a_client_sends() {
    let tmp = TestDir::new("open_survives_any_bytes_a_client_sends");
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};
    let (mut child, host, path) = open_small(&tmp, "open-fuzz.jsonl", "open-fuzz.json");
    let nasty = prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..4096),
        "[A-Z]{0,8} [ -~]{0,200}( HTTP/1\\.[01])?(\r\n[ -~]{0,60}){0,8}(\r\n\r\n)?"
            .prop_map(String::into_bytes),
    ];
    let mut runner = TestRunner::new(Config {
        cases: 128,
        ..Config::default()
    });
    runner
        .run(&nasty, |bytes| {
            let mut s = std::net::TcpStream::connect(&host).unwrap();
            s.set_read_timeout(Some(std::time::Duration::from_secs(15)))
                .unwrap();
            let _ = s.write_all(&bytes);
            let _ = s.shutdown(std::net::Shutdown::Write);
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink);
            Ok(())
        })
        .unwrap();
    assert!(child.try_wait().unwrap().is_none(), "the server died");
    check_served(&host, &path);
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn open_without_output_leaves_no_file_behind() {
    let tmp = TestDir::new("open_without_output_leaves_no_file_behind");
    let trace = tmp.path("open-temp.jsonl");
    std::fs::write(&trace, SMALL).unwrap();
    let mut child = vcr_command()
        .args(["inspect", "perfetto", "--open", "--port", "0"])
        .arg(&trace)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (host, path) = served_url(&mut child);
    // without -o, the default format: protobuf
    assert!(path.ends_with(".pftrace"), "{path}");
    check_served_proto(&host, &path);
    let file = std::env::temp_dir().join(path.trim_start_matches('/'));
    assert!(!file.exists(), "{} left behind", file.display());
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn open_started_in_the_background_stops_on_sigint() {
    let tmp = TestDir::new("open_started_in_the_background_stops_on_sigint");
    // what `vllm-vcr inspect perfetto t --open &` gets from a shell: SIGINT ignored
    use std::os::unix::process::CommandExt;
    let trace = tmp.path("open-bg.jsonl");
    std::fs::write(&trace, SMALL).unwrap();
    let mut cmd = vcr_command();
    cmd.args(["inspect", "perfetto", "--open", "--port", "0"])
        .arg(&trace)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    // SAFETY: only an async-signal-safe call between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_IGN);
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    let (host, path) = served_url(&mut child);
    check_served_proto(&host, &path);
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if std::time::Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let _ = child.kill();
    let _ = child.wait();
    let status = status.expect("the server ignored SIGINT");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGINT), "{status:?}");
}

/// A deterministic synthetic capture: Poisson-ish arrivals at 20/s, heavy-ish output
/// lengths, ~15 ms gaps with some multi-token chunks, per-gap engine context and token
/// ids, written in finish order like the tap does. Returns the peak concurrency.
pub fn write_synthetic_trace(path: &Path, requests: usize) -> usize {
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut rand = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 11) as f64) / ((1u64 << 53) as f64)
    };
    let mut records: Vec<(f64, f64, String)> = Vec::with_capacity(requests);
    let mut arrival = 0.0f64;
    for i in 0..requests {
        arrival += -(1.0 - rand()).ln() * 50.0; // mean 50 ms between arrivals
        let prompt = 64 + (rand() * 2000.0) as u32;
        let output = (16.0 + (-(1.0 - rand()).ln() * 144.0)).min(1024.0) as u32;
        let ttft = 20.0 + rand() * 200.0;
        let mut itl = Vec::new();
        let mut itl_tokens = Vec::new();
        let mut left = output - 1;
        while left > 0 {
            let n = if rand() < 0.1 { left.min(3) } else { 1 };
            itl.push(((10.0 + rand() * 10.0) * 1000.0).round() / 1000.0);
            itl_tokens.push(n);
            left -= n;
        }
        let end = arrival + ttft + itl.iter().sum::<f64>();
        let num_running: Vec<u32> = itl.iter().map(|_| 40 + (rand() * 40.0) as u32).collect();
        let prefill: Vec<u32> = itl
            .iter()
            .map(|_| if rand() < 0.2 { 512 } else { 0 })
            .collect();
        let ids: Vec<u32> = (0..output).map(|k| (i as u32 * 7 + k) % 32000).collect();
        let line = json!({
            "request_id": format!("req-{i}"),
            "prompt_tokens": prompt,
            "output_tokens": output,
            "arrival_ms": (arrival * 1000.0).round() / 1000.0,
            "ttft_ms": (ttft * 1000.0).round() / 1000.0,
            "itl_ms": itl,
            "itl_tokens": itl_tokens,
            "itl_ctx": {"num_running": num_running, "prefill_tokens": prefill},
            "output_token_ids": ids,
            "finish_reason": "length",
        });
        records.push((arrival, end, line.to_string()));
    }
    let mut sweep: Vec<(f64, i32)> = records.iter().flat_map(|r| [(r.0, 1), (r.1, -1)]).collect();
    sweep.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut now, mut peak) = (0i32, 0i32);
    for (_, d) in sweep {
        now += d;
        peak = peak.max(now);
    }
    records.sort_by(|a, b| a.1.total_cmp(&b.1));
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    writeln!(out, "{}", json!({"meta": {"model": "synthetic"}})).unwrap();
    for (_, _, line) in records {
        writeln!(out, "{line}").unwrap();
    }
    out.flush().unwrap();
    peak as usize
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
    let bad = tmp.path("own-bad.jsonl.gz");
    std::fs::write(&bad, b"this is not gzip").unwrap();
    let out = tmp.path("own-bad-out.json");
    let _ = std::fs::remove_file(&out);
    let o = vcr()
        .args(["inspect", "perfetto"])
        .arg(&bad)
        .arg("-o")
        .arg(&out)
        .output();
    assert!(!o.status.success());
    assert!(!out.exists(), "a failed run left {}", out.display());
    // a missing input: no output either
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

/// The number of `TracePacket`s in a protobuf trace: the bytes are exactly a sequence of
/// `Trace.packet` fields (key 0x0a, a varint length, that many bytes). Panics otherwise.
fn packets(bytes: &[u8]) -> usize {
    let (mut at, mut n) = (0usize, 0usize);
    while at < bytes.len() {
        assert_eq!(bytes[at], 0x0a, "byte {at}: not a Trace.packet field");
        at += 1;
        let (mut len, mut shift) = (0usize, 0);
        loop {
            let b = bytes[at];
            at += 1;
            len |= usize::from(b & 0x7f) << shift;
            shift += 7;
            if b < 0x80 {
                break;
            }
        }
        at += len;
        n += 1;
    }
    assert_eq!(at, bytes.len(), "the last packet runs past the end");
    n
}

/// Python with Perfetto's own generated trace protos (the `perfetto` package from PyPI,
/// installed into the cache on first use; a failed install fails the test).
fn perfetto_python() -> PathBuf {
    static PYTHON: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PYTHON
        .get_or_init(|| {
            let cache = vllm_vcr::frontends::cache_root().unwrap();
            let venv = vllm_vcr::frontends::fetch_perfetto_python(&cache)
                .expect("installing Perfetto's Python package for the independent decoder");
            venv.join("bin").join("python")
        })
        .clone()
}

/// Decode a protobuf trace with `tests/perfetto_decode.py` (Perfetto's generated classes).
fn decode_proto(path: &Path) -> Value {
    let script = fixture("tests/perfetto_decode.py");
    let out = Command::new(perfetto_python())
        .arg(script)
        .arg(path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "decoding {}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// What a timeline shows, format-free: slices as (process, track, name, category, start
/// ns, duration ns, args), counter samples as (process, counter, ns, value), track names per
/// process. Sorted, so two formats compare as sets with their multiplicities.
#[derive(Debug, PartialEq)]
struct Drawn {
    slices: Vec<(String, String, String, String, i64, i64, String)>,
    counters: Vec<(String, String, i64, String)>,
    tracks: Vec<(String, String)>,
}

fn drawn_from_json(events: &[Value]) -> Drawn {
    let mut processes: HashMap<u64, String> = HashMap::new();
    let mut threads: HashMap<(u64, u64), String> = HashMap::new();
    for e in events.iter().filter(|e| e["ph"] == "M") {
        let name = e["args"]["name"].as_str().unwrap().to_string();
        let pid = e["pid"].as_u64().unwrap();
        if e["name"] == "process_name" {
            processes.insert(pid, name);
        } else {
            threads.insert((pid, e["tid"].as_u64().unwrap()), name);
        }
    }
    let mut d = Drawn {
        slices: Vec::new(),
        counters: Vec::new(),
        tracks: Vec::new(),
    };
    let mut counter_tracks = std::collections::BTreeSet::new();
    for e in events {
        let pid = e["pid"].as_u64().unwrap();
        let process = processes[&pid].clone();
        match e["ph"].as_str().unwrap() {
            "X" => d.slices.push((
                process,
                threads[&(pid, e["tid"].as_u64().unwrap())].clone(),
                e["name"].as_str().unwrap().to_string(),
                e["cat"].as_str().unwrap().to_string(),
                e["ts"].as_i64().unwrap() * 1000,
                e["dur"].as_i64().unwrap() * 1000,
                canonical_args(&e["args"]),
            )),
            "C" => {
                let name = e["name"].as_str().unwrap().to_string();
                counter_tracks.insert((process.clone(), name.clone()));
                d.counters.push((
                    process,
                    name,
                    e["ts"].as_i64().unwrap() * 1000,
                    format!("{}", e["args"]["value"].as_f64().unwrap()),
                ))
            }
            _ => {}
        }
    }
    d.tracks = threads
        .iter()
        .map(|((pid, _), n)| (processes[pid].clone(), n.clone()))
        .chain(counter_tracks)
        .collect();
    d.slices.sort();
    d.counters.sort();
    d.tracks.sort();
    d
}

fn drawn_from_proto(doc: &Value) -> Drawn {
    let processes = doc["processes"].as_object().unwrap();
    let process = |v: &Value| processes[&v.to_string()].as_str().unwrap().to_string();
    let mut d = Drawn {
        slices: doc["slices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                (
                    s["process"].as_str().unwrap().to_string(),
                    s["track"].as_str().unwrap().to_string(),
                    s["name"].as_str().unwrap().to_string(),
                    s["category"].as_str().unwrap().to_string(),
                    s["ts_ns"].as_i64().unwrap(),
                    s["dur_ns"].as_i64().unwrap(),
                    canonical_args(&s["args"]),
                )
            })
            .collect(),
        counters: doc["counters"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                (
                    c["process"].as_str().unwrap().to_string(),
                    c["track"].as_str().unwrap().to_string(),
                    c["ts_ns"].as_i64().unwrap(),
                    format!("{}", c["value"].as_f64().unwrap()),
                )
            })
            .collect(),
        tracks: doc["tracks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                (
                    process(&t["process"]),
                    t["name"].as_str().unwrap().to_string(),
                )
            })
            .collect(),
    };
    d.slices.sort();
    d.counters.sort();
    d.tracks.sort();
    d
}

/// Args as sorted JSON text (an absent object and an empty one are the same).
fn canonical_args(args: &Value) -> String {
    match args.as_object() {
        Some(m) => serde_json::to_string(&m.iter().collect::<BTreeMap<_, _>>()).unwrap(),
        None => "{}".to_string(),
    }
}

/// Convert `trace` to both formats with the same flags; the protobuf one, decoded by
/// Perfetto's own classes, shows exactly what the JSON one shows. Returns (JSON summary,
/// protobuf summary, what is drawn).
fn both_formats(tmp: &TestDir, trace: &Path, stem: &str, extra: &[&str]) -> (Value, Value, Drawn) {
    let (json_summary, events, _) = perfetto_to(tmp, trace, &format!("{stem}.json"), extra);
    validate(&events);
    let proto = tmp.path(&format!("{stem}.pftrace"));
    let out = vcr()
        .args(["inspect", "perfetto", "--json", "-o"])
        .arg(&proto)
        .arg(trace)
        .args(extra)
        .output();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let proto_summary: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(proto_summary["format"], "proto");
    assert_eq!(json_summary["format"], "json");
    let bytes = std::fs::read(&proto).unwrap();
    assert_eq!(proto_summary["bytes"], bytes.len());
    assert!(packets(&bytes) > 0);
    let from_json = drawn_from_json(&events);
    let from_proto = drawn_from_proto(&decode_proto(&proto));
    assert_eq!(from_proto.tracks, from_json.tracks);
    assert_eq!(from_proto.slices.len(), from_json.slices.len());
    for (p, j) in from_proto.slices.iter().zip(&from_json.slices) {
        assert_eq!(p, j);
    }
    assert_eq!(from_proto.counters, from_json.counters);
    for k in [
        "events",
        "lanes",
        "requests",
        "without_arrival",
        "incomplete",
        "steps",
    ] {
        assert_eq!(proto_summary[k], json_summary[k], "{k}");
    }
    (json_summary, proto_summary, from_json)
}

/// The real CPU-engine capture and its step stats: the protobuf trace, decoded by
/// Perfetto's own Python classes, holds every slice (name, category, track, start,
/// duration, arguments, token ids), every counter sample and every track of the JSON one,
/// in a third of the bytes or less.
#[test]
fn the_protobuf_trace_decodes_to_the_same_timeline_as_the_json() {
    let tmp = TestDir::new("the_protobuf_trace_decodes_to_the_same_timeline_as_the_json");
    let dir = fixture("tests/fixtures/cpu-engine-capture");
    let steps = dir.join("steps.jsonl.gz");
    let (json_summary, proto_summary, drawn) = both_formats(
        &tmp,
        &dir.join("trace.jsonl.gz"),
        "both-capture",
        &["--step-stats", steps.to_str().unwrap()],
    );
    let prefills = drawn
        .slices
        .iter()
        .filter(|s| s.2 == "prefill" && s.3 == "request")
        .count();
    assert_eq!(prefills, 301);
    assert!(drawn.slices.iter().any(|s| s.3 == "step"));
    assert!(drawn.slices.iter().any(|s| s.6.contains("token_ids")));
    assert!(drawn.counters.iter().any(|c| c.1 == "sched_kv_cache_usage"));
    let (j, p) = (
        json_summary["bytes"].as_u64().unwrap(),
        proto_summary["bytes"].as_u64().unwrap(),
    );
    assert!(p * 3 <= j, "protobuf {p} bytes against JSON {j}");
}

/// Lanes and rows, multi-token chunks, incomplete records, two engines with drafting, and
/// `--from-ms` / `--to-ms` / `--max-requests`: the same in both formats.
#[test]
fn both_formats_agree_on_rows_chunks_steps_and_windows() {
    let tmp = TestDir::new("both_formats_agree_on_rows_chunks_steps_and_windows");
    let trace = tmp.path("both-small.jsonl");
    std::fs::write(&trace, SMALL).unwrap();
    let (summary, _, drawn) = both_formats(&tmp, &trace, "both-small", &[]);
    assert_eq!(summary["requests"], 6);
    let x3 = drawn.slices.iter().find(|s| s.2 == "decode x3").unwrap();
    assert_eq!((x3.4, x3.5), (15_000_000, 5_000_000));
    assert_eq!(x3.6, r#"{"token_ids":[3,4,5]}"#);
    let c = drawn
        .slices
        .iter()
        .find(|s| s.2 == "prefill" && s.6.contains(r#""request_id":"c""#))
        .unwrap();
    assert!(
        c.6.contains(r#""abort_reason":"capture stopped""#),
        "{}",
        c.6
    );
    assert!(c.6.contains(r#""incomplete":true"#));

    let (_, _, rows) = both_formats(
        &tmp,
        &trace,
        "both-rows",
        &["--track-per-request", "--name", "mine"],
    );
    assert!(rows.tracks.contains(&("mine".to_string(), "b".to_string())));

    let steps = tmp.path("both-steps.jsonl");
    let spec = json!({"num_spec_tokens": 2, "num_drafts": 2, "num_draft_tokens": 4, "num_accepted_tokens": 3});
    let lines = [
        json!({"ts_ms": 10.0, "engine": 0, "step_ms": null, "num_running_reqs": 1, "num_waiting_reqs": 2, "kv_cache_usage": 0.1, "prefill_requests": 1, "prefill_tokens": 4}),
        json!({"ts_ms": 10.5, "engine": 1, "step_ms": null, "num_running_reqs": 3, "num_waiting_reqs": 0, "kv_cache_usage": 0.5, "prefill_requests": 1, "prefill_tokens": 8}),
        json!({"ts_ms": 15.0, "engine": 0, "step_ms": 5.0, "num_running_reqs": 2, "num_waiting_reqs": 0, "kv_cache_usage": 0.2, "prefill_requests": 0, "prefill_tokens": 0, "spec_decoding": spec}),
        json!({"ts_ms": 150.0, "engine": 1, "step_ms": 3.5, "num_running_reqs": 3, "num_waiting_reqs": 0, "kv_cache_usage": 0.5, "prefill_requests": 0, "prefill_tokens": 0}),
    ];
    std::fs::write(
        &steps,
        lines.iter().map(|l| format!("{l}\n")).collect::<String>(),
    )
    .unwrap();
    let (summary, _, drawn) = both_formats(
        &tmp,
        &trace,
        "both-steps",
        &["--step-stats", steps.to_str().unwrap()],
    );
    assert_eq!(summary["engines"], 2);
    assert!(
        drawn
            .slices
            .iter()
            .any(|s| s.1 == "engine 1 steps" && s.2 == "prefill+decode B2 (+1r 8t)")
    );
    assert!(
        drawn
            .counters
            .iter()
            .any(|c| c.1 == "sched_accept_rate" && c.3 == "0.75")
    );

    // a window: only requests arriving in [1, 150) ms, and steps ending in it, at most 2
    let (summary, _, drawn) = both_formats(
        &tmp,
        &trace,
        "both-window",
        &[
            "--step-stats",
            steps.to_str().unwrap(),
            "--from-ms",
            "1",
            "--to-ms",
            "150",
            "--max-requests",
            "2",
        ],
    );
    assert_eq!(summary["requests"], 2);
    assert_eq!(summary["steps"], 3);
    let prefills: Vec<i64> = drawn
        .slices
        .iter()
        .filter(|s| s.2 == "prefill" && s.3 == "request")
        .map(|s| s.4)
        .collect();
    assert_eq!(prefills.len(), 2);
    assert!(
        prefills
            .iter()
            .all(|&t| (1_000_000..150_000_000).contains(&t))
    );
}

/// The format follows `--format`, else the name: `.json` (and `.json.gz`) JSON, anything
/// else protobuf; `.gz` compresses either; a failed protobuf run leaves no file behind.
#[test]
fn the_output_name_or_the_flag_chooses_the_format() {
    let tmp = TestDir::new("the_output_name_or_the_flag_chooses_the_format");
    let trace = tmp.path("format.jsonl");
    std::fs::write(&trace, SMALL).unwrap();
    let run = |name: &str, extra: &[&str]| -> (Vec<u8>, String) {
        let out = tmp.path(name);
        let o = vcr()
            .args(["inspect", "perfetto"])
            .arg(&trace)
            .arg("-o")
            .arg(&out)
            .args(extra)
            .output();
        let stderr = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(o.status.success(), "{stderr}");
        let mut bytes = std::fs::read(&out).unwrap();
        if name.ends_with(".gz") {
            let mut plain = Vec::new();
            flate2::read::GzDecoder::new(&bytes[..])
                .read_to_end(&mut plain)
                .unwrap();
            bytes = plain;
        }
        (bytes, stderr)
    };
    let is_json = |b: &[u8]| serde_json::from_slice::<Value>(b).is_ok();
    for name in [
        "f.pftrace",
        "f.perfetto-trace",
        "f",
        "f.trace",
        "f.pftrace.gz",
    ] {
        let (b, stderr) = run(name, &[]);
        assert!(packets(&b) > 6, "{name}");
        assert!(stderr.contains("(proto, "), "{stderr}");
    }
    for name in ["f.json", "f.JSON", "f.perfetto.json.gz"] {
        let (b, _) = run(name, &[]);
        assert!(is_json(&b), "{name}");
    }
    let (b, stderr) = run("g.pftrace", &["--format", "json"]);
    assert!(is_json(&b));
    assert!(stderr.contains("its name suggests the other"), "{stderr}");
    let (b, _) = run("g.json", &["--format", "proto"]);
    assert!(packets(&b) > 6);
    // the gzip protobuf decodes too (the trace processor reads gzip)
    let drawn = drawn_from_proto(&decode_proto(&tmp.path("f.pftrace.gz")));
    assert_eq!(drawn.slices.iter().filter(|s| s.2 == "prefill").count(), 6);

    // a trace that fails mid-way: no protobuf file is left either
    let bad = tmp.path("format-bad.jsonl.gz");
    std::fs::write(&bad, b"this is not gzip").unwrap();
    let out = tmp.path("format-bad.pftrace");
    let _ = std::fs::remove_file(&out);
    let o = vcr()
        .args(["inspect", "perfetto"])
        .arg(&bad)
        .arg("-o")
        .arg(&out)
        .output();
    assert!(!o.status.success());
    assert!(!out.exists(), "a failed run left {}", out.display());
    // a bad --format value is a clear error
    let o = vcr()
        .args(["inspect", "perfetto", "--format", "xml"])
        .arg(&trace)
        .output();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("proto") && err.contains("json"), "{err}");
}

/// Perfetto's protobuf timestamps are unsigned: a request before the trace's zero is a
/// clear error that points to JSON (and leaves no file), while JSON still draws it.
#[test]
fn a_time_before_zero_is_refused_by_the_protobuf_format_only() {
    let tmp = TestDir::new("a_time_before_zero_is_refused_by_the_protobuf_format_only");
    let trace = tmp.path("negative.jsonl");
    std::fs::write(
        &trace,
        r#"{"request_id":"early","prompt_tokens":4,"output_tokens":2,"arrival_ms":-5,"ttft_ms":10,"itl_ms":[5]}
"#,
    )
    .unwrap();
    let out = tmp.path("negative.pftrace");
    let _ = std::fs::remove_file(&out);
    let o = vcr()
        .args(["inspect", "perfetto"])
        .arg(&trace)
        .arg("-o")
        .arg(&out)
        .output();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("-5000 µs") && err.contains("--format json"),
        "{err}"
    );
    assert!(!out.exists(), "a failed run left {}", out.display());
    let json = tmp.path("negative.json");
    let o = vcr()
        .args(["inspect", "perfetto"])
        .arg(&trace)
        .arg("-o")
        .arg(&json)
        .output();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        std::fs::read_to_string(&json)
            .unwrap()
            .contains("\"ts\":-5000")
    );
}

/// The binary format is not written to a terminal (run under `script`, util-linux's
/// pseudo-terminal wrapper): the error says what to do instead, and JSON still goes there.
#[test]
fn the_protobuf_format_is_not_written_to_a_terminal() {
    let tmp = TestDir::new("the_protobuf_format_is_not_written_to_a_terminal");
    let trace = tmp.path("tty.jsonl");
    std::fs::write(&trace, SMALL).unwrap();
    let on_a_terminal = |extra: &str| {
        let cmd = format!(
            "{} inspect perfetto {} {extra}",
            env!("CARGO_BIN_EXE_vllm-vcr"),
            trace.display()
        );
        let o = Command::new("script")
            .args(["-qec", &cmd, "/dev/null"])
            .output()
            .expect("util-linux's script runs the command on a pseudo-terminal");
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stdout).to_string(),
        )
    };
    let (ok, screen) = on_a_terminal("");
    assert!(!ok);
    assert!(
        screen.contains("stdout is a terminal") && screen.contains("--format json"),
        "{screen}"
    );
    let (ok, screen) = on_a_terminal("--format json");
    assert!(ok, "{screen}");
    assert!(screen.contains("\"traceEvents\""), "{screen}");
}
