//! `inspect perfetto`: the output obeys the Chrome Trace Event format (checked event by
//! event), lanes equal the peak concurrency, multi-token chunks and token ids show, records
//! without arrival are reported, the step-stats sidecar becomes per-engine step tracks, and
//! `--open` serves the file to the hosted UI.
//!
//! The JSON output is checked in [`json`], the served file in [`open`], the protobuf
//! format in [`proto`]; what they share (running the command, checking events, the small
//! and the synthetic traces, counting protobuf packets) is here.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::support::{TestDir, fixture, vcr, vcr_command};
use serde_json::{Value, json};

mod json;
mod open;
mod proto;

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

/// The number of `TracePacket`s in a protobuf trace: the bytes are exactly a sequence of
/// `Trace.packet` fields (key 0x0a, a varint length, that many bytes). Panics otherwise.
/// A trace that fails mid-way (`<stem>.jsonl.gz` that is not gzip at all) leaves no output
/// file `out_name` behind.
fn a_failed_run_leaves_no_output(tmp: &TestDir, stem: &str, out_name: &str) {
    let bad = tmp.path(&format!("{stem}.jsonl.gz"));
    std::fs::write(&bad, b"this is not gzip").unwrap();
    let out = tmp.path(out_name);
    let _ = std::fs::remove_file(&out);
    let o = vcr()
        .args(["inspect", "perfetto"])
        .arg(&bad)
        .arg("-o")
        .arg(&out)
        .output();
    assert!(!o.status.success());
    assert!(!out.exists(), "a failed run left {}", out.display());
}

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
