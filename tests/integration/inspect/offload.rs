//! `inspect simulate --kv-offload-blocks`: the KV offload tier on the virtual clock, through
//! the binary — prefixes the device cache cannot keep are found in the tier (a higher hit
//! rate, a lower TTFT), and each loaded block costs the step that admits its request.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::simulate::{SMALL_ENGINE, group_trace, records, simulate, simulate_json};
use crate::support::{TestDir, number, s};

/// Prompt blocks every request of a group shares (block size 16: 256 tokens).
const SHARED_BLOCKS: u64 = 16;
const GROUPS: u64 = 8;
const REQUESTS: u64 = 64;

/// Eight groups taking turns (request i is in group i mod 8), each sharing a 16-block
/// prefix, plus two blocks of its own per request; one request every 400 ms, so each runs
/// alone and its TTFT is its own prefill.
fn cyclic_groups(tmp: &TestDir) -> PathBuf {
    let groups: Vec<u64> = (0..REQUESTS).map(|i| i % GROUPS).collect();
    group_trace(tmp, "cyclic.jsonl", &groups, (SHARED_BLOCKS, 400, 4))
}

/// 80 device blocks hold four groups' prefixes at most; the eight taken in turn evict
/// each other before they come back. A prefill of a whole prompt takes 200 ms.
const ENGINE: [&str; 6] = SMALL_ENGINE;

fn run(trace: &Path, extra: &[&str], dump: &Path) -> (f64, f64, Value) {
    let mut a = vec![s(trace)];
    a.extend(ENGINE);
    a.extend(extra);
    a.extend(["--dump-trace", s(dump)]);
    let v = simulate_json(&a);
    assert_eq!(v["not_finished"], 0, "{v}");
    (
        number(&v["prefix_cache_hit_ratio"]),
        number(&v["summary"]["ttft_ms"]["p50"]),
        v,
    )
}

#[test]
fn the_offload_tier_keeps_prefixes_the_device_cache_cannot() {
    let tmp = TestDir::new("the_offload_tier_keeps_prefixes_the_device_cache_cannot");
    let trace = cyclic_groups(&tmp);
    let (cold_hit, cold_ttft, _) = run(&trace, &[], &tmp.path("none.jsonl"));
    // 400 blocks hold every prefix and every request's own blocks (8 × 16 + 64 × 2)
    let dump = tmp.path("tier.jsonl");
    let (hit, ttft, v) = run(&trace, &["--kv-offload-blocks", "400"], &dump);
    // without the tier nothing survives a cycle (measured 0 %); with it every request
    // after the first eight of a cycle finds its 16 shared blocks there: 56 × 256 of
    // 64 × 288 prompt tokens = 77.8 %
    assert!(cold_hit < 0.05, "no tier: hit rate {cold_hit:.3}");
    assert!(
        (hit - 56.0 * 256.0 / (64.0 * 288.0)).abs() < 0.01,
        "tier: hit rate {hit:.3} {v}"
    );
    // a request finding 16 of its 18 blocks prefills 2/18 of its prompt: TTFT falls from
    // about 200 ms to about 22 ms plus 16 loads of 50 µs
    assert!(
        ttft < cold_ttft / 3.0,
        "TTFT p50: tier {ttft} ms, none {cold_ttft} ms"
    );
    // the hits are the connector's: external cached tokens in each record
    let recs = records(&dump);
    let warm = recs
        .values()
        .filter(|r| r["cached_tokens"].as_u64() == Some(256))
        .count();
    assert_eq!(warm as u64, REQUESTS - GROUPS, "{:?}", recs.values().next());
}

#[test]
fn each_block_loaded_from_the_tier_costs_the_admitting_step() {
    let tmp = TestDir::new("each_block_loaded_from_the_tier_costs_the_admitting_step");
    let trace = cyclic_groups(&tmp);
    let tier = ["--kv-offload-blocks", "400", "--kv-offload-policy", "arc"];
    let (_, fast, _) = run(
        &trace,
        &[&tier[..], &["--kv-offload-load-us", "0"]].concat(),
        &tmp.path("fast.jsonl"),
    );
    let (_, slow, _) = run(
        &trace,
        &[&tier[..], &["--kv-offload-load-us", "2000"]].concat(),
        &tmp.path("slow.jsonl"),
    );
    // 16 blocks × 2 ms each, added to the step that admits a warm request
    assert!(
        (slow - fast - 32.0).abs() < 1.0,
        "TTFT p50: 2 ms per block {slow} ms, free loads {fast} ms"
    );
}

#[test]
fn bad_offload_flags_are_refused_with_a_reason() {
    let tmp = TestDir::new("bad_offload_flags_are_refused_with_a_reason");
    let trace = cyclic_groups(&tmp);
    let out = simulate(&[
        s(&trace),
        "--kv-offload-blocks",
        "10",
        "--no-enable-prefix-caching",
    ])
    .run_failing();
    assert!(
        out.contains("--kv-offload-blocks needs the prefix cache"),
        "{out}"
    );
    let out = simulate(&[
        s(&trace),
        "--kv-offload-blocks",
        "10",
        "--kv-offload-load-us=-1",
    ])
    .run_failing();
    assert!(out.contains("--kv-offload-load-us must be"), "{out}");
}
