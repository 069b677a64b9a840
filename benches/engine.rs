//! Engine benchmarks (`cargo bench --bench engine`): not timed tests, a report.
//!
//! 1. Throughput: a Rust client acting as the frontend drives `vllm-vcr play` (a separate
//!    process, instant latency) over ZMQ at several concurrencies and reports output
//!    tokens/s and the engine's CPU seconds per million tokens.
//! 2. Pacing: fixed 10 ms inter-token latency, many concurrent streams; the engine reports
//!    its step emission lateness against the scheduled deadlines.
//! 3. Through a real frontend: `vllm-rs` + `play`, loaded by `vllm-rs bench serve`; reports
//!    frontend-limited throughput and the engine's share of CPU.
//!
//! 4. Replay cost: engine CPU per token serving recorded ids against random ones.
//! 5. Offline simulation: `inspect simulate` on the CPU-engine capture, a Mooncake-shaped
//!    trace (or the public one, `BENCH_MOONCAKE=PATH`) and synthetic workloads; simulated
//!    seconds per wall second (must be ≥ 100) and per CPU second of the command.
//! 6. Grammars off the step loop: a 10 ms-ITL stream's gaps while six requests with huge
//!    JSON schemas compile their grammars, against the same stream alone.
//!
//! Environment: `BENCH_QUICK=1` shrinks every run (smoke mode); `BENCH_SKIP_FRONTEND=1`
//! skips part 3; `BENCH_ONLY=throughput,pacing,grammar,soak,replay,simulate,frontend` runs only those;
//! `BENCH_CONCURRENCY=N` runs only that row of part 1; `BENCH_BIN=PATH` runs another build;
//! `BENCH_BEFORE=PATH` runs part 3 with that build and this one alternating, `BENCH_PAIRS`
//! pairs per row (default 2).

#[path = "common/cpu.rs"]
mod cpu;
#[path = "engine/direct.rs"]
mod direct;
#[path = "engine/frontend.rs"]
mod frontend;
#[path = "engine/process.rs"]
mod process;
#[path = "engine/workloads.rs"]
mod workloads;

use crate::direct::{direct_run, grammar_run};
use crate::frontend::frontend_part;
use crate::process::{log_field, part, quick};
use crate::workloads::{simulate_part, write_model, write_replay_trace};

fn main() {
    // `cargo bench` passes `--bench`; ignore arguments.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = std::env::temp_dir().join(format!("vllm-vcr-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let q = quick();

    if part("throughput") {
        println!(
            "## Engine throughput (direct ZMQ client, instant latency, 256 tokens per request)\n"
        );
        println!(
            "| concurrency | requests | output tokens | wall s | tokens/s | engine CPU s | engine CPU s per 1M tokens |"
        );
        println!("|---:|---:|---:|---:|---:|---:|---:|");
        // BENCH_CONCURRENCY=4096 runs one row (e.g. to profile it)
        let only: Option<usize> = std::env::var("BENCH_CONCURRENCY")
            .ok()
            .and_then(|v| v.parse().ok());
        for &(c, total) in &[(1usize, 200usize), (64, 2000), (1024, 8192), (4096, 16384)] {
            if only.is_some_and(|o| o != c) {
                continue;
            }
            let total = if q { total / 10 } else { total }.max(c);
            let (r, _) = rt.block_on(direct_run(
                c,
                total,
                256,
                &[],
                &dir.join(format!("engine-{c}.log")),
            ));
            println!(
                "| {} | {} | {} | {:.2} | {:.0} | {:.2} | {:.2} |",
                r.concurrency,
                total,
                r.tokens,
                r.wall,
                r.tokens as f64 / r.wall,
                r.engine_cpu,
                r.engine_cpu / (r.tokens as f64 / 1e6)
            );
        }
    }
    if part("pacing") {
        println!("\n## Pacing precision (fixed 10 ms inter-token latency)\n");
        println!(
            "| concurrent streams | steps | lateness p50 µs | lateness p99 µs | lateness max µs |"
        );
        println!("|---:|---:|---:|---:|---:|");
        for &streams in &[100usize, 1000] {
            let tokens = if q { 50 } else { 200 };
            let (_, log) = rt.block_on(direct_run(
                streams,
                streams,
                tokens,
                &["--inter-token-latency", "10", "--time-to-first-token", "10"],
                &dir.join(format!("pacing-{streams}.log")),
            ));
            println!(
                "| {} | {} | {:.0} | {:.0} | {:.0} |",
                streams,
                log_field(&log, "steps").unwrap_or(f64::NAN),
                log_field(&log, "lateness_p50_us").unwrap_or(f64::NAN),
                log_field(&log, "lateness_p99_us").unwrap_or(f64::NAN),
                log_field(&log, "lateness_max_us").unwrap_or(f64::NAN),
            );
        }
    }
    if part("grammar") {
        println!(
            "\n## A stream's pace while grammars compile (10 ms ITL; 60,000-entry enum schemas)\n"
        );
        println!(
            "| grammar requests | stream gaps | gap p50 ms | gap p99 ms | gap max ms | grammars done after s |"
        );
        println!("|---:|---:|---:|---:|---:|---:|");
        for &g in &[0usize, 6] {
            let (mut gaps, done) =
                rt.block_on(grammar_run(g, &dir.join(format!("grammar-{g}.log"))));
            gaps.sort_by(f64::total_cmp);
            let q = |p: f64| gaps[((gaps.len() - 1) as f64 * p).round() as usize];
            println!(
                "| {g} | {} | {:.1} | {:.1} | {:.1} | {} |",
                gaps.len(),
                q(0.5),
                q(0.99),
                q(1.0),
                if g == 0 {
                    "-".to_string()
                } else {
                    format!("{done:.2}")
                }
            );
        }
    }
    if part("soak") {
        println!(
            "\n## Memory over a soak (concurrency 64, 64 tokens per request, instant latency)\n"
        );
        println!("| requests | engine RSS after 1/4 | after 1/2 | at the end | growth 1/4 → end |");
        println!("|---:|---:|---:|---:|---:|");
        let soak = if q { 4000 } else { 40_000 };
        let (r, _) = rt.block_on(direct_run(64, soak, 64, &[], &dir.join("soak.log")));
        let [a, b, c] = r.rss_kib;
        println!(
            "| {soak} | {:.1} MiB | {:.1} MiB | {:.1} MiB | {:+.1} % |",
            a as f64 / 1024.0,
            b as f64 / 1024.0,
            c as f64 / 1024.0,
            100.0 * (c as f64 - a as f64) / a.max(1) as f64
        );
    }
    if part("replay") {
        println!(
            "\n## Replay cost (concurrency 64, 256 tokens per request, instant latency; engine CPU s per 1M tokens)\n"
        );
        println!(
            "| tokens | requests | output tokens | engine CPU s | per 1M tokens | vs random |"
        );
        println!("|---|---:|---:|---:|---:|---:|");
        let n = if q { 1000 } else { 8000 };
        let trace = dir.join("replay.jsonl.gz");
        write_replay_trace(&trace, n, 256);
        let trace_arg = trace.to_str().unwrap();
        let mut base = f64::NAN;
        let model = dir.join("model.json");
        write_model(&model);
        let model_arg = model.to_str().unwrap();
        for (label, extra) in [
            ("random", vec![]),
            (
                "--replay-tokens (index)",
                vec!["--replay-tokens", trace_arg],
            ),
            (
                "random, knobs (ITL 45 ms = the model's step at 64, time scale 100)",
                vec!["--inter-token-latency", "45", "--time-scale", "100"],
            ),
            (
                "random, --latency-trace (fixture model, time scale 100)",
                vec!["--latency-trace", model_arg, "--time-scale", "100"],
            ),
        ] {
            let (r, _) = rt.block_on(direct_run(
                64,
                n,
                256,
                &extra,
                &dir.join(format!("replay-{}.log", label.len())),
            ));
            let per_m = r.engine_cpu / (r.tokens as f64 / 1e6);
            if extra.is_empty() {
                base = per_m;
            }
            println!(
                "| {label} | {n} | {} | {:.2} | {:.2} | {:.2}× |",
                r.tokens,
                r.engine_cpu,
                per_m,
                per_m / base
            );
        }
    }
    if part("simulate") {
        simulate_part(&dir, q);
    }
    if part("frontend") && std::env::var_os("BENCH_SKIP_FRONTEND").is_none() {
        frontend_part(&dir, q);
    }
    eprintln!("logs in {}", dir.display());
}
