//! The protobuf format, decoded independently by Perfetto's own Python classes
//! (`tests/perfetto_decode.py`): the same timeline as the JSON, how the format is chosen,
//! and what it refuses.

use super::*;

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
    a_failed_run_leaves_no_output(&tmp, "format-bad", "format-bad.pftrace");
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
