//! The KV offload tier as a frontend's `/metrics` shows it: `vllm-rs` and vLLM's Python
//! server export the tier's hits as `vllm:external_prefix_cache_queries` / `_hits`, from the
//! scheduler stats' `connector_prefix_cache_stats` (the path vLLM's offloading connector
//! uses).

use super::*;
use crate::support::http::{metric_sum, parse_metrics};

/// A 100-token prompt (six full blocks and four tokens) of the tiny vocabulary's ids,
/// starting at `first`.
fn prompt(first: u32) -> String {
    (0..100u32)
        .map(|i| (3 + (first + i) % 250).to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn complete(port: u16, prompt: &str) {
    let (status, body) = post(
        port,
        "/v1/completions",
        &format!(r#"{{"model":"tiny","prompt":[{prompt}],"max_tokens":2}}"#),
    );
    assert_eq!(status, 200, "{body}");
}

/// `vllm:external_prefix_cache_{queries,hits}_total`, summed over the engine labels.
fn external(port: u16) -> (u64, u64) {
    let samples = parse_metrics(&http_get(port, "/metrics").text());
    let sum = |name| metric_sum(&samples, name, &[]).unwrap_or(0.0) as u64;
    (
        sum("vllm:external_prefix_cache_queries_total"),
        sum("vllm:external_prefix_cache_hits_total"),
    )
}

#[test]
fn vllm_rs_counts_offload_tier_hits_as_external_prefix_cache_hits() {
    external_hits_in_metrics(&[]);
}

#[test]
fn the_python_frontend_counts_offload_tier_hits_as_external_prefix_cache_hits() {
    external_hits_in_metrics(&PythonFrontend::of("vllm", "0.33.0").args());
}

/// Three prompts through 11 device blocks and a 64-block tier, then the first again: the
/// frontend's counters say what the tier was asked and found.
fn external_hits_in_metrics(frontend: &[&str]) {
    // 11 usable device blocks: a 7-block request evicts most of the one before it, the
    // second after it the rest; the 64-block tier keeps every block
    let mut args = vec![
        "--num-gpu-blocks",
        "12",
        "--block-size",
        "16",
        "--kv-offload-blocks",
        "64",
    ];
    args.extend(frontend);
    let mut serve = Serve::start(&args);
    let (_, frontend_pid) = serve.wait_ready();
    let (a, b, c) = (prompt(0), prompt(80), prompt(160));
    for p in [&a, &b, &c] {
        complete(serve.port, p);
    }
    // nothing was in the tier for them: 3 × 100 tokens asked, none found
    wait_until(Duration::from_secs(10), || external(serve.port) == (300, 0));
    assert_eq!(external(serve.port), (300, 0), "{}", serve.stderr());
    // the first prompt again: gone from the device, its 6 full blocks in the tier (the
    // last prompt token is always computed, so 99 tokens can hit: 6 blocks)
    complete(serve.port, &a);
    wait_until(Duration::from_secs(10), || {
        external(serve.port) == (400, 96)
    });
    assert_eq!(external(serve.port), (400, 96), "{}", serve.stderr());
    assert_ctrl_c_stops_everything(&mut serve, frontend_pid);
}

/// vLLM's Python server started with the offloading connector's config (its CPU backend,
/// as a GPU host would run it) turns the tier's `kv_connector_stats` into
/// `vllm:kv_offload_*`.
#[test]
fn the_python_frontend_with_the_offloading_connector_counts_the_tiers_transfers() {
    let python = PythonFrontend::of("vllm", "0.33.0");
    let mut serve = Serve::start(&python.with(&[
        "--num-gpu-blocks",
        "12",
        "--block-size",
        "16",
        "--kv-offload-blocks",
        "64",
        "--kv-block-bytes",
        "1000000",
        "--kv-offload-connector-stats",
        "--",
        "--kv-transfer-config",
        r#"{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"cpu_bytes_to_use":64000000}}"#,
    ]));
    let (_, frontend_pid) = serve.wait_ready();
    let (a, b, c) = (prompt(0), prompt(80), prompt(160));
    for p in [&a, &b, &c, &a] {
        complete(serve.port, p);
    }
    // each prompt stored its 6 full blocks once; the first, sent again, loaded them
    let counters = |port| {
        let samples = parse_metrics(&http_get(port, "/metrics").text());
        let sum = |name| metric_sum(&samples, name, &[]).unwrap_or(0.0) as u64;
        (
            sum("vllm:kv_offload_store_bytes_total"),
            sum("vllm:kv_offload_load_bytes_total"),
            sum("vllm:kv_offload_load_size_count"),
        )
    };
    let want = (18_000_000, 6_000_000, 1);
    wait_until(Duration::from_secs(10), || counters(serve.port) == want);
    assert_eq!(counters(serve.port), want, "{}", serve.stderr());
    assert_ctrl_c_stops_everything(&mut serve, frontend_pid);
}
