//! `inspect perfetto` output formats (`cargo bench --bench perfetto`): the same timeline
//! written as Perfetto's protobuf trace and as Chrome Trace Event JSON, from one synthetic
//! trace in the same run. Reports each format's size and time to write, and their ratios.
//! A report, not a timed test.
//!
//! The input is `inspect gen-demo --arrival-rate 50` (log-normal prompt / output lengths,
//! median 128 output tokens; no token ids), written once into a temporary directory.
//! `PERFETTO_BENCH_REQUESTS=N` sets its size (default 20,000; `BENCH_QUICK=1`: 2,000).

use std::path::PathBuf;
use std::time::Instant;

use vllm_vcr::inspect::gen_demo::{GenDemoArgs, run as gen_demo};
use vllm_vcr::inspect::perfetto::{Format, PerfettoArgs, write};

fn main() {
    let requests: u64 = std::env::var("PERFETTO_BENCH_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if std::env::var_os("BENCH_QUICK").is_some() {
            2_000
        } else {
            20_000
        });
    let dir = std::env::temp_dir().join(format!("vllm-vcr-bench-perfetto-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let trace = dir.join("demo.jsonl");
    gen_demo(&GenDemoArgs {
        output: trace.clone(),
        records: requests,
        seed: 0,
        fast: false,
        arrival_rate: Some(50.0),
        json: false,
    })
    .expect("gen-demo");
    let trace_bytes = std::fs::metadata(&trace).map(|m| m.len()).unwrap_or(0);
    println!(
        "inspect perfetto: {requests} requests of gen-demo --arrival-rate 50 ({:.1} MB of JSONL)",
        trace_bytes as f64 / 1e6
    );
    println!(
        "{:<8} {:>10} {:>12} {:>10} {:>10}",
        "format", "events", "bytes", "wall s", "MB/s in"
    );
    let mut results = Vec::new();
    for (format, name) in [(Format::Proto, "out.pftrace"), (Format::Json, "out.json")] {
        let out: PathBuf = dir.join(name);
        let args = PerfettoArgs::to_file(trace.clone(), out.clone(), format);
        let file = std::fs::File::create(&out).expect("creating the output");
        let started = Instant::now();
        let summary = write(&args, format, Some(file), false).expect("inspect perfetto");
        let wall = started.elapsed().as_secs_f64();
        println!(
            "{:<8} {:>10} {:>12} {:>10.2} {:>10.1}",
            format.name(),
            summary.events,
            summary.bytes,
            wall,
            trace_bytes as f64 / 1e6 / wall
        );
        results.push((summary.bytes as f64, wall));
        let _ = std::fs::remove_file(&out);
    }
    let ((pb, pt), (jb, jt)) = (results[0], results[1]);
    println!(
        "protobuf / JSON: size {:.3} ({:.1}x smaller), time {:.2}",
        pb / jb,
        jb / pb,
        pt / jt
    );
    let _ = std::fs::remove_dir_all(&dir);
}
