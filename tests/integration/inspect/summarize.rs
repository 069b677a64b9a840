//! `inspect summarize` and `inspect gen-demo`, through the binary.

use std::path::Path;

use crate::support::{TestDir, cpu_capture, vcr, vcr_command};
use serde_json::Value;

fn summarize_json(path: &Path) -> Value {
    let out = vcr()
        .args(["inspect", "summarize", "--json"])
        .arg(path)
        .run();
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn summarize_reports_what_the_records_hold() {
    let tmp = TestDir::new("summarize_reports_what_the_records_hold");
    let trace = tmp.path("hand.jsonl");
    std::fs::write(
        &trace,
        concat!(
            r#"{"meta":{"version":1,"model":"m","block_size":16}}"#,
            "\n",
            r#"{"request_id":"a","prompt_tokens":100,"cached_tokens":50,"output_tokens":4,"arrival_ms":0,"ttft_ms":10,"itl_ms":[5,5,5],"concurrency":1,"finish_reason":"length"}"#,
            "\n",
            r#"{"request_id":"b","prompt_tokens":100,"cached_tokens":0,"output_tokens":5,"arrival_ms":1000,"ttft_ms":20,"itl_ms":[4,4],"itl_tokens":[2,2],"concurrency":2,"finish_reason":"stop"}"#,
            "\n",
            r#"{"request_id":"c","prompt_tokens":10,"output_tokens":0,"arrival_ms":2000,"incomplete":true,"abort_reason":"capture stopped"}"#,
            "\n",
            r#"{"request_id":"d","prompt_tokens":10,"output_tokens":1,"ttft_ms":30,"finish_reason":"length"}"#,
            "\n",
        ),
    )
    .unwrap();
    let s = summarize_json(&trace);
    assert_eq!(s["records"], 4);
    assert_eq!(s["incomplete"], 1);
    assert_eq!(s["without_arrival"], 1);
    assert_eq!(s["meta"]["model"], "m");
    // first arrival 0, last end 2000 (c has no timing), b ends at 1028
    assert_eq!(s["duration_ms"], 2000.0);
    assert_eq!(s["arrival_rate_per_s"], 1.0);
    assert_eq!(s["ttft_ms"]["count"], 3);
    assert_eq!(s["ttft_ms"]["max"], 30.0);
    assert!((s["ttft_ms"]["mean"].as_f64().unwrap() - 20.0).abs() < 1e-9);
    assert_eq!(s["itl_ms"]["count"], 5);
    assert_eq!(s["finish_reasons"]["length"], 2);
    assert_eq!(s["finish_reasons"]["stop"], 1);
    assert_eq!(s["finish_reasons"]["(none)"], 1);
    // 50 cached of 200 prompt tokens with cache info
    assert_eq!(s["prefix_cache_hit_ratio"], 0.25);
    // a: 4 one-token chunks; b: first chunk 1, then two 2-token chunks; d: one chunk
    assert_eq!(s["chunk_sizes"]["1"], 6);
    assert_eq!(s["chunk_sizes"]["2"], 2);
    assert_eq!(s["output_tokens"]["p50"], 1.0, "nearest rank of 0, 1, 4, 5");
    assert_eq!(s["concurrency_at_arrival"]["max"], 2.0);

    let table = vcr().args(["inspect", "summarize"]).arg(&trace).output();
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(
        text.contains("requests: 4 (1 incomplete, 1 without arrival time)"),
        "{text}"
    );
    assert!(text.contains("prefix-cache hit ratio: 25.0 %"), "{text}");
}

#[test]
fn summarize_of_the_cpu_capture_matches_exact_quantiles() {
    let path = cpu_capture("trace.jsonl.gz");
    let s = summarize_json(&path);
    assert_eq!(s["records"], 301);
    let mut gaps: Vec<f64> = sim_trace::trace::TraceReader::open(&path)
        .unwrap()
        .records()
        .flat_map(|r| r.unwrap().itl_ms)
        .collect();
    gaps.sort_by(f64::total_cmp);
    for (q, key) in [(0.5, "p50"), (0.9, "p90"), (0.99, "p99")] {
        let exact = sim_trace::stats::quantile_of(&mut gaps, q).unwrap();
        let got = s["itl_ms"][key].as_f64().unwrap();
        assert!(
            (got - exact).abs() <= exact * 0.005 + 1e-9,
            "{key}: {got} vs exact {exact}"
        );
    }
    assert_eq!(s["itl_ms"]["count"].as_u64().unwrap() as usize, gaps.len());
}

#[test]
fn a_bad_line_is_an_error_naming_file_and_line() {
    let tmp = TestDir::new("a_bad_line_is_an_error_naming_file_and_line");
    let trace = tmp.path("bad.jsonl");
    std::fs::write(
        &trace,
        "{\"meta\":{}}\n{\"prompt_tokens\":1,\"output_tokens\":1}\n{not json\n",
    )
    .unwrap();
    let out = vcr().args(["inspect", "summarize"]).arg(&trace).output();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("{}:3", trace.display())), "{err}");
    let out = vcr()
        .args(["inspect", "summarize", "/nonexistent/trace.jsonl"])
        .output();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/trace.jsonl"), "{err}");
    // the cause is said once, not repeated by the error chain
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
}

#[test]
fn traces_can_be_written_to_a_pipe() {
    // `-o -` is standard output; a pipe cannot be fsynced, which must not fail the write
    for target in ["-", "/dev/stdout"] {
        let out = vcr_command()
            .args(["inspect", "gen-demo", "--records", "4", "-o", target])
            .stdout(std::process::Stdio::piped())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{target}: {err}");
        let text = String::from_utf8(out.stdout).unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 5, "{target}: meta + 4 records");
        assert!(lines[0].get("meta").is_some());
        assert_eq!(lines[4]["request_id"], "demo-3");
    }
    assert!(!Path::new("-").exists(), "no file named `-` was created");

    // a reader that goes away early (`| head -1`) is not an error
    use std::io::BufRead;
    let mut child = vcr_command()
        .args(["inspect", "gen-demo", "--records", "200000", "-o", "-"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(first.starts_with("{\"meta\""), "{first}");
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn gen_demo(path: &Path, extra: &[&str]) {
    vcr()
        .args(["inspect", "gen-demo", "-o"])
        .arg(path)
        .args(extra)
        .run();
}

#[test]
fn gen_demo_is_deterministic_and_heavy_tailed() {
    let tmp = TestDir::new("gen_demo_is_deterministic_and_heavy_tailed");
    let (a, b, c) = (
        tmp.path("d1.jsonl"),
        tmp.path("d2.jsonl"),
        tmp.path("d3.jsonl"),
    );
    gen_demo(&a, &["--records", "500", "--seed", "7"]);
    gen_demo(&b, &["--records", "500", "--seed", "7"]);
    gen_demo(&c, &["--records", "500", "--seed", "8"]);
    // created_unix_ms differs; compare the records
    let body = |p: &Path| {
        std::fs::read_to_string(p)
            .unwrap()
            .lines()
            .skip(1)
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(body(&a), body(&b));
    assert_ne!(body(&a), body(&c));
    let s = summarize_json(&a);
    assert_eq!(s["records"], 500);
    assert_eq!(s["without_arrival"], 500, "no arrivals unless asked");
    let ttft50 = s["ttft_ms"]["p50"].as_f64().unwrap();
    let itl50 = s["itl_ms"]["p50"].as_f64().unwrap();
    let itl99 = s["itl_ms"]["p99"].as_f64().unwrap();
    assert!((90.0..160.0).contains(&ttft50), "{ttft50}");
    assert!((14.0..23.0).contains(&itl50), "{itl50}");
    // heavier than a [0.3, 1.7] x mean clamp can produce
    assert!(itl99 / itl50 > 1.7, "itl p99/p50 {}", itl99 / itl50);
    assert!(
        s["ttft_ms"]["p99"].as_f64().unwrap() / ttft50 > 1.7,
        "ttft tail"
    );
}

#[test]
fn gen_demo_fast_and_arrivals() {
    let tmp = TestDir::new("gen_demo_fast_and_arrivals");
    let p = tmp.path("fast.jsonl.gz");
    gen_demo(&p, &["--fast", "--records", "400", "--arrival-rate", "50"]);
    let s = summarize_json(&p);
    let ttft50 = s["ttft_ms"]["p50"].as_f64().unwrap();
    let itl50 = s["itl_ms"]["p50"].as_f64().unwrap();
    assert!((15.0..40.0).contains(&ttft50), "{ttft50}");
    assert!((3.0..10.0).contains(&itl50), "{itl50}");
    assert_eq!(s["without_arrival"], 0);
    let rate = s["arrival_rate_per_s"].as_f64().unwrap();
    assert!((40.0..60.0).contains(&rate), "{rate}");
}

/// What a killed or disk-full capture leaves: a gzip cut short. Every complete record is
/// summarized, with a warning; an empty file gets a warning too; records without timing (a
/// converted Mooncake trace) feed no chunk histogram and no mean concurrency.
#[test]
fn a_cut_trace_an_empty_one_and_one_without_timing_are_summarized_honestly() {
    let tmp =
        TestDir::new("a_cut_trace_an_empty_one_and_one_without_timing_are_summarized_honestly");
    let full = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/cpu-engine-capture/trace.jsonl.gz"
    ))
    .unwrap();
    let cut = tmp.path("cut.jsonl.gz");
    std::fs::write(&cut, &full[..full.len() / 2]).unwrap();
    let out = vcr()
        .args(["inspect", "summarize", "--json"])
        .arg(&cut)
        .output();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("ends early"), "{err}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let n = v["records"].as_u64().unwrap();
    assert!(n > 10, "the complete records are summarized: {n}");
    assert!(
        v["warnings"][0]
            .as_str()
            .unwrap()
            .contains("truncated gzip"),
        "{v}"
    );

    let empty = tmp.path("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let out = vcr().args(["inspect", "summarize"]).arg(&empty).output();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("the trace is empty"));

    // a Mooncake trace converted to ours: lengths and arrivals, no timing
    let mc = tmp.path("mc.jsonl");
    let lines: String = (0..300)
        .map(|i| format!("{{\"timestamp\": {}, \"input_length\": 100, \"output_length\": {}, \"hash_ids\": [{i}]}}\n", i * 10, 1 + i))
        .collect();
    std::fs::write(&mc, lines).unwrap();
    let conv = tmp.path("mc-trace.jsonl");
    let _ = std::fs::remove_file(&conv);
    vcr()
        .args(["inspect", "convert", "--from", "mooncake"])
        .arg(&mc)
        .arg("-o")
        .arg(&conv)
        .run();
    let out = vcr().args(["inspect", "summarize"]).arg(&conv).output();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("output chunks: - (no timing in the trace)"),
        "{text}"
    );
    assert!(text.contains("mean concurrency -"), "{text}");
    let v = summarize_json(&conv);
    assert!(v["mean_concurrency"].is_null());
}

/// Many distinct chunk sizes are bucketed in power-of-two ranges.
#[test]
fn long_chunk_histograms_are_bucketed() {
    let tmp = TestDir::new("long_chunk_histograms_are_bucketed");
    let trace = tmp.path("chunks.jsonl");
    let mut s = String::from("{\"type\":\"meta\",\"format_version\":1}\n");
    for i in 1..40u32 {
        s.push_str(&format!(
            "{{\"request_id\":\"r{i}\",\"arrival_ms\":{i},\"prompt_tokens\":4,\"output_tokens\":{},\"ttft_ms\":5.0,\"itl_ms\":[1.0],\"itl_tokens\":[{i}]}}\n",
            i + 1
        ));
    }
    std::fs::write(&trace, s).unwrap();
    let out = vcr().args(["inspect", "summarize"]).arg(&trace).output();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("output chunks:"))
        .unwrap();
    assert!(
        line.contains("2-3 tokens") && line.contains("32-63 tokens"),
        "{line}"
    );
    assert!(line.len() < 200, "{line}");
}

/// A `.gz` of a few MB that inflates to one 1.5 GiB line: every reader refuses the line by
/// number at the cap (64 MiB) with a clean error, in bounded memory — under a 1 GiB
/// address-space limit the binary used to die of SIGABRT reading it whole. `--max-line-bytes`
/// sets the cap.
#[test]
fn one_huge_line_is_refused_in_bounded_memory() {
    let tmp = TestDir::new("one_huge_line_is_refused_in_bounded_memory");
    use std::io::Write;
    use std::os::unix::process::CommandExt;
    // one gzip member of 1 MiB of `a` (no newline), repeated: the reader sees one stream
    let mut member = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    member.write_all(&vec![b'a'; 1 << 20]).unwrap();
    let member = member.finish().unwrap();
    let path = tmp.path("one-huge-line.jsonl.gz");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    for _ in 0..1536 {
        f.write_all(&member).unwrap();
    }
    f.into_inner().unwrap().sync_all().unwrap();

    let limited = |args: &[&str]| {
        let mut cmd = vcr_command();
        cmd.args(args).arg(&path);
        unsafe {
            cmd.pre_exec(|| {
                let lim = libc::rlimit {
                    rlim_cur: 1 << 30,
                    rlim_max: 1 << 30,
                };
                if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd.output().unwrap()
    };
    for args in [
        &["inspect", "summarize"][..],
        &["play", "--handshake-timeout", "1", "--replay-tokens"][..],
    ] {
        let out = limited(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{args:?}: {:?}\n{err}",
            out.status
        );
        assert!(
            err.contains("one-huge-line.jsonl.gz:1: line longer than 67108864 bytes")
                && err.contains("--max-line-bytes"),
            "{args:?}: {err}"
        );
    }

    // the cap is a flag: a real trace whose lines exceed a small cap is refused by line
    let fixture = cpu_capture("trace.jsonl.gz");
    let out = vcr()
        .args(["inspect", "summarize", "--max-line-bytes", "1024"])
        .arg(&fixture)
        .output();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("line longer than 1024 bytes"),
        "{err}"
    );
    std::fs::remove_file(&path).ok();
}

/// A gzip file named `.jsonl` is read as gzip (it was "invalid trace line: expected
/// value"), and a flipped byte inside a `.gz` is reported as damage, not as a JSON error.
#[test]
fn gzip_by_content_and_damage_by_name() {
    let tmp = TestDir::new("gzip_by_content_and_damage_by_name");
    let fixture = cpu_capture("trace.jsonl.gz");
    let renamed = tmp.path("renamed-gzip.jsonl");
    std::fs::copy(&fixture, &renamed).unwrap();
    let v = summarize_json(&renamed);
    assert_eq!(v, summarize_json(&fixture));

    let mut bytes = std::fs::read(&fixture).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x55;
    let damaged = tmp.path("damaged.jsonl.gz");
    std::fs::write(&damaged, &bytes).unwrap();
    let out = vcr().args(["inspect", "summarize"]).arg(&damaged).output();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("corrupt gzip data")
            && err.contains("the file is damaged")
            && !err.contains("invalid trace line"),
        "{err}"
    );
}

/// A meta line of a newer schema than this build reads is read, with a warning (it was
/// accepted without a word).
#[test]
fn a_newer_schema_is_read_with_a_warning() {
    let tmp = TestDir::new("a_newer_schema_is_read_with_a_warning");
    let trace = tmp.path("v999.jsonl");
    std::fs::write(
        &trace,
        "{\"meta\": {\"version\": 999}}\n{\"request_id\": \"a\", \"prompt_tokens\": 4, \"output_tokens\": 1, \"ttft_ms\": 3}\n",
    )
    .unwrap();
    let v = summarize_json(&trace);
    assert!(
        v["warnings"]
            .to_string()
            .contains("meta version 999 is newer than the schema"),
        "{}",
        v["warnings"]
    );
}
