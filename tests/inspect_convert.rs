//! `inspect convert`: Mooncake timed traces both ways (lossless, accepted by
//! `vllm-rs bench serve`), and a real guidellm report.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_vllm-vcr"))
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vllm-vcr-convert-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn run_ok(args: &[&str], paths: &[&Path]) -> String {
    let mut cmd = bin();
    cmd.arg("inspect").arg("convert").args(args);
    for p in paths {
        cmd.arg(p);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// A Mooncake file in the compact form (what `--to mooncake` writes), some of its
/// requests sharing prefixes.
fn mooncake_lines(n: usize) -> String {
    let mut s = String::new();
    let mut t = 0u64;
    for i in 0..n {
        let input = 20 + (i * 37) % 280;
        let output = 4 + (i * 7) % 20;
        let blocks = input.div_ceil(16);
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
            format!("{}.5", t)
        } else {
            t.to_string()
        };
        s.push_str(&format!(
            "{{\"timestamp\":{ts},\"input_length\":{input},\"output_length\":{output},\"hash_ids\":{}}}\n",
            serde_json::to_string(&ids).unwrap()
        ));
        t += (i as u64 * 31) % 200;
    }
    s
}

#[test]
fn mooncake_round_trips_losslessly() {
    let src = tmp("mc.jsonl");
    std::fs::write(&src, mooncake_lines(300)).unwrap();
    let trace = tmp("mc-trace.jsonl.gz");
    let back = tmp("mc-back.jsonl");
    let summary = run_ok(
        &["--from", "mooncake", "--block-size", "16", "--json", "-o"],
        &[&trace, &src],
    );
    let summary: Value = serde_json::from_str(&summary).unwrap();
    assert_eq!(summary["written"], 300);
    run_ok(&["--to", "mooncake", "-o"], &[&back, &trace]);
    // Byte for byte: same keys in the same order, integers stay integers.
    assert_eq!(
        std::fs::read_to_string(&back).unwrap(),
        std::fs::read_to_string(&src).unwrap()
    );
    // The trace holds the values (and the block size) the format carried.
    let mut reader = sim_trace::trace::TraceReader::open(&trace).unwrap();
    let (meta, _) = reader.read_header().unwrap();
    assert_eq!(meta.unwrap().block_size, Some(16));
    let first = reader.records().next().unwrap().unwrap();
    assert_eq!(first.prompt_tokens, 20);
    assert_eq!(first.arrival_ms, Some(0.0));
    assert_eq!(first.block_hashes.len(), 2);

    // A block size that contradicts the trace's is refused.
    let out = bin()
        .args([
            "inspect",
            "convert",
            "--to",
            "mooncake",
            "--block-size",
            "512",
            "-o",
        ])
        .arg(tmp("wrong.jsonl"))
        .arg(&trace)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--block-size 16"));
}

#[test]
fn the_public_mooncake_layout_converts_with_spaces_and_512_token_blocks() {
    let src = tmp("public.jsonl");
    std::fs::write(
        &src,
        "{\"timestamp\": 0, \"input_length\": 6955, \"output_length\": 52, \"hash_ids\": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 2353, 2354]}\n\
         {\"timestamp\": 27482, \"input_length\": 6472, \"output_length\": 26, \"hash_ids\": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 2366]}\n",
    )
    .unwrap();
    let trace = tmp("public-trace.jsonl");
    let back = tmp("public-back.jsonl");
    run_ok(&["--from", "mooncake", "-o"], &[&trace, &src]);
    run_ok(&["--to", "mooncake", "-o"], &[&back, &trace]);
    let values = |p: &Path| -> Vec<Value> {
        std::fs::read_to_string(p)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    assert_eq!(values(&back), values(&src));
    let meta = std::fs::read_to_string(&trace).unwrap();
    assert!(meta.lines().next().unwrap().contains("\"block_size\":512"));
}

#[test]
fn a_bad_mooncake_line_names_file_and_line() {
    let src = tmp("bad.jsonl");
    std::fs::write(
        &src,
        "{\"timestamp\":0,\"input_length\":5,\"output_length\":1,\"hash_ids\":[1]}\n\
         {\"timestamp\":1,\"input_length\":-5,\"output_length\":1,\"hash_ids\":[1]}\n",
    )
    .unwrap();
    let out = bin()
        .args(["inspect", "convert", "--from", "mooncake", "-o"])
        .arg(tmp("bad-trace.jsonl"))
        .arg(&src)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("{}:2", src.display())), "{err}");
    assert!(err.contains("input_length"), "{err}");
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn report() -> Value {
    let f = std::fs::File::open(fixture("guidellm/report.json.gz")).unwrap();
    let mut s = String::new();
    flate2::read::MultiGzDecoder::new(f)
        .read_to_string(&mut s)
        .unwrap();
    serde_json::from_str(&s).unwrap()
}

#[test]
fn a_real_guidellm_report_converts_and_agrees_with_guidellm_within_one_percent() {
    let trace = tmp("guidellm.jsonl");
    run_ok(
        &["--from", "guidellm", "-o"],
        &[&trace, &fixture("guidellm/report.json.gz")],
    );
    let out = bin()
        .args(["inspect", "summarize", "--json"])
        .arg(&trace)
        .output()
        .unwrap();
    assert!(out.status.success());
    let s: Value = serde_json::from_slice(&out.stdout).unwrap();

    let r = report();
    let m = &r["benchmarks"][0]["metrics"];
    let ok = |k: &str| m[k]["successful"]["mean"].as_f64().unwrap();
    assert_eq!(
        s["records"].as_u64(),
        m["request_totals"]["total"].as_u64(),
        "request count"
    );
    assert_eq!(s["incomplete"], 0);
    let within = |ours: f64, theirs: f64, what: &str| {
        assert!(
            (ours - theirs).abs() <= 0.01 * theirs,
            "{what}: ours {ours}, guidellm {theirs}"
        );
    };
    within(
        s["ttft_ms"]["mean"].as_f64().unwrap(),
        ok("time_to_first_token_ms"),
        "mean TTFT",
    );
    within(
        s["itl_ms"]["mean"].as_f64().unwrap(),
        ok("inter_token_latency_ms"),
        "mean ITL",
    );
    within(
        s["request_total_ms"]["mean"].as_f64().unwrap(),
        ok("request_latency") * 1000.0,
        "mean request latency",
    );
    within(
        s["output_tokens"]["mean"].as_f64().unwrap(),
        ok("output_token_count"),
        "mean output tokens",
    );
    assert_eq!(s["finish_reasons"]["length"], 50, "max_tokens reached");
}

#[test]
fn not_a_guidellm_report_is_a_clear_error() {
    let src = tmp("notreport.json");
    std::fs::write(&src, "{\"hello\": 1}").unwrap();
    let out = bin()
        .args(["inspect", "convert", "--from", "guidellm", "-o"])
        .arg(tmp("x.jsonl"))
        .arg(&src)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a guidellm report"));
}

fn http_get_ok(port: u16, path: &str) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .is_err()
    {
        return false;
    }
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    buf.starts_with("HTTP/1.1 200")
}

/// `vllm-rs bench serve --dataset-name timed_trace` replays an exported file against
/// `vllm-vcr serve`: every request is sent with the recorded lengths.
#[test]
fn vllm_rs_bench_serve_replays_an_exported_timed_trace() {
    let rs = vllm_vcr::frontends::ensure_vllm_rs("0.33.0").unwrap_or_else(|e| {
        panic!("cannot obtain vllm-rs 0.33.0 (run `cargo xtask fetch`): {e:#}")
    });
    let src = tmp("replay.jsonl");
    std::fs::write(&src, mooncake_lines(20)).unwrap();
    let trace = tmp("replay-trace.jsonl");
    let exported = tmp("replay-export.jsonl");
    run_ok(
        &["--from", "mooncake", "--block-size", "16", "-o"],
        &[&trace, &src],
    );
    run_ok(&["--to", "mooncake", "-o"], &[&exported, &trace]);
    let lines: Vec<Value> = std::fs::read_to_string(&exported)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let input: u64 = lines
        .iter()
        .map(|l| l["input_length"].as_u64().unwrap())
        .sum();
    let output: u64 = lines
        .iter()
        .map(|l| l["output_length"].as_u64().unwrap())
        .sum();

    let ports = vllm_vcr::child::free_ports(2).unwrap();
    let model = tmp("model");
    vllm_vcr::tiny_model::write_to(&model).unwrap();
    let mut serve = bin()
        .args(["serve", "--port", &ports[0].to_string()])
        .args(["--handshake-port", &ports[1].to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while !http_get_ok(ports[0], "/health") {
        assert!(Instant::now() < deadline, "serve did not come up");
        std::thread::sleep(Duration::from_millis(200));
    }
    let bench = Command::new(&rs)
        .args(["bench", "serve", "--port", &ports[0].to_string()])
        .args(["--model", "tiny", "--tokenizer"])
        .arg(&model)
        .args(["--dataset-name", "timed_trace", "--dataset-path"])
        .arg(&exported)
        .args(["--timed-trace-chunk-hash-size", "16"])
        .args(["--timed-trace-sec-multiplier", "0.001"])
        .args(["--num-prompts", "20", "--disable-tqdm", "--ignore-eos"])
        .output()
        .unwrap();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(serve.id() as i32, libc::SIGINT) };
    let _ = serve.wait();
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
    assert_eq!(field("Successful requests:"), 20, "{text}");
    assert_eq!(field("Failed requests:"), 0, "{text}");
    assert_eq!(field("Total input tokens:"), input, "{text}");
    assert_eq!(field("Total generated tokens:"), output, "{text}");
}
