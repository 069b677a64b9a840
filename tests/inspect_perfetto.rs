//! `inspect perfetto`: the output obeys the Chrome Trace Event format (checked event by
//! event), lanes equal the peak concurrency, multi-token chunks and token ids show, records
//! without arrival are reported, and `--open` serves the file to the hosted UI.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_vllm-vcr"))
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vllm-vcr-perfetto-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// Convert and return (the JSON summary, the events).
fn perfetto(trace: &Path, extra: &[&str]) -> (Value, Vec<Value>, String) {
    let out_path = tmp(&format!(
        "{}.json",
        trace.file_name().unwrap().to_string_lossy()
    ));
    let out = bin()
        .args(["inspect", "perfetto", "--json", "-o"])
        .arg(&out_path)
        .arg(trace)
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: Value = serde_json::from_slice(&out.stdout).unwrap();
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&out_path).unwrap()).unwrap();
    let events = doc["traceEvents"].as_array().unwrap().clone();
    (
        summary,
        events,
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// Every rule of the Chrome Trace Event format this output relies on.
fn validate(events: &[Value]) {
    let mut open: HashMap<(u64, u64), Vec<String>> = HashMap::new();
    let mut counter_ts: HashMap<(u64, String), f64> = HashMap::new();
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
                assert!(dur >= 0.0, "{ctx}");
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
}

#[test]
fn the_cpu_engine_capture_with_its_step_stats_is_a_valid_chrome_trace() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/cpu-engine-capture");
    let steps = dir.join("steps.jsonl.gz");
    let (summary, events, _) = perfetto(
        &dir.join("trace.jsonl.gz"),
        &["--step-stats", steps.to_str().unwrap()],
    );
    validate(&events);
    assert_eq!(summary["requests"], 301);
    assert_eq!(summary["lanes"], 8, "the load ran 8 requests at a time");
    assert!(summary["steps"].as_u64().unwrap() > 1000);
    let names: BTreeMap<&str, usize> = events.iter().fold(BTreeMap::new(), |mut m, e| {
        *m.entry(e["name"].as_str().unwrap()).or_default() += 1;
        m
    });
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
    let prefills = events
        .iter()
        .filter(|e| e["pid"] == 1 && e["name"] == "prefill")
        .count();
    assert_eq!(prefills, 301);
    // the peak of active_requests is the lane count
    let peak = events
        .iter()
        .filter(|e| e["name"] == "active_requests")
        .map(|e| e["args"]["value"].as_f64().unwrap())
        .fold(0.0, f64::max);
    assert_eq!(peak, 8.0);
    assert!(events.iter().any(|e| e["pid"] == 2
        && e["ph"] == "X"
        && e["name"].as_str().unwrap().starts_with("decode B")));
}

#[test]
fn lanes_chunks_token_ids_and_records_without_arrival() {
    let trace = tmp("small.jsonl");
    std::fs::write(
        &trace,
        concat!(
            r#"{"meta":{"model":"m"}}"#, "\n",
            // three overlapping requests, then one after they all ended
            r#"{"request_id":"a","prompt_tokens":4,"output_tokens":5,"arrival_ms":0,"ttft_ms":10,"itl_ms":[5,5],"itl_tokens":[1,3],"output_token_ids":[1,2,3,4,5],"finish_reason":"length"}"#, "\n",
            r#"{"request_id":"b","prompt_tokens":4,"output_tokens":2,"arrival_ms":1,"ttft_ms":10,"itl_ms":[5],"finish_reason":"length"}"#, "\n",
            r#"{"request_id":"c","prompt_tokens":4,"output_tokens":2,"arrival_ms":2,"ttft_ms":10,"itl_ms":[5],"incomplete":true,"abort_reason":"capture stopped"}"#, "\n",
            r#"{"request_id":"d","prompt_tokens":4,"output_tokens":2,"arrival_ms":100,"ttft_ms":10,"itl_ms":[5],"finish_reason":"stop"}"#, "\n",
            r#"{"request_id":"e","prompt_tokens":4,"output_tokens":2,"ttft_ms":10,"itl_ms":[5]}"#, "\n",
        ),
    )
    .unwrap();
    let (summary, events, stderr) = perfetto(&trace, &[]);
    validate(&events);
    assert_eq!(summary["lanes"], 3);
    assert_eq!(summary["requests"], 4);
    assert_eq!(summary["without_arrival"], 1);
    assert!(
        stderr.contains("1 record(s) have no arrival_ms"),
        "{stderr}"
    );
    let x3 = events
        .iter()
        .find(|e| e["name"] == "decode x3")
        .expect("a 3-token chunk");
    assert_eq!(x3["args"]["token_ids"], serde_json::json!([3, 4, 5]));
    assert_eq!(x3["ts"], 15000.0);
    assert_eq!(x3["dur"], 5000.0);
    let first_decode = events
        .iter()
        .find(|e| e["name"] == "decode" && e["args"]["token_ids"].is_array())
        .unwrap();
    assert_eq!(first_decode["args"]["token_ids"], serde_json::json!([2]));
    // d reuses a freed lane
    let lane_of = |id: &str| {
        events
            .iter()
            .find(|e| e["name"] == "prefill" && e["args"]["request_id"] == id)
            .unwrap()["tid"]
            .as_u64()
            .unwrap()
    };
    assert!(lane_of("d") <= 3);
    let c = events
        .iter()
        .find(|e| e["name"] == "prefill" && e["args"]["request_id"] == "c")
        .unwrap();
    assert_eq!(c["args"]["incomplete"], true);
    assert_eq!(events[0]["args"]["name"], "m");

    // one row per request
    let (summary, events, _) = perfetto(&trace, &["--track-per-request", "--name", "mine"]);
    validate(&events);
    assert_eq!(summary["lanes"], 4);
    assert!(
        events
            .iter()
            .any(|e| e["ph"] == "M" && e["args"]["name"] == "b")
    );
    assert_eq!(events[0]["args"]["name"], "mine");
}

#[test]
fn open_serves_the_file_with_cors_for_the_hosted_ui() {
    let trace = tmp("open.jsonl");
    std::fs::write(
        &trace,
        "{\"request_id\":\"a\",\"prompt_tokens\":1,\"output_tokens\":1,\"arrival_ms\":0,\"ttft_ms\":1}\n",
    )
    .unwrap();
    let mut child = bin()
        .args(["inspect", "perfetto", "--open", "--port", "0", "-o"])
        .arg(tmp("open.json"))
        .arg(&trace)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let served = lines.next().unwrap().unwrap();
    let url = served.strip_prefix("serving ").expect(&served).to_string();
    let open = lines.next().unwrap().unwrap();
    assert_eq!(open, format!("open https://ui.perfetto.dev/#!/?url={url}"));
    let rest = url.strip_prefix("http://").unwrap();
    let (host, path) = rest.split_once('/').unwrap();
    let mut s = std::net::TcpStream::connect(host).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "GET /{path} HTTP/1.1\r\nHost: {host}\r\nOrigin: https://ui.perfetto.dev\r\n\r\n"
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(
        resp.contains("Access-Control-Allow-Origin: https://ui.perfetto.dev"),
        "{resp}"
    );
    let body = resp.split("\r\n\r\n").nth(1).unwrap();
    let doc: Value = serde_json::from_str(body).unwrap();
    assert!(doc["traceEvents"].as_array().unwrap().len() >= 3);
}
