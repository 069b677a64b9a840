//! The committed capture of a real vLLM engine on CPU (`tests/fixtures/cpu-engine-capture`)
//! loads with the trace reader and holds what its README describes, so later work can fit
//! and gate timing models on it.

use crate::support::cpu_capture;
use sim_trace::config_hash::ConfigFingerprint;
use sim_trace::trace::{TraceItem, TraceReader};

#[test]
fn the_capture_loads_with_its_meta_and_every_request() {
    let mut meta = None;
    let mut records = Vec::new();
    for item in TraceReader::open(cpu_capture("trace.jsonl.gz")).unwrap() {
        match item.unwrap() {
            TraceItem::Meta(m) => meta = Some(m),
            TraceItem::Record(r) => records.push(r),
        }
    }
    let meta = meta.expect("a meta line");
    assert_eq!(meta.vllm_version.as_deref(), Some("0.32.0"));
    assert_eq!(meta.gpu.as_deref(), Some("cpu"));
    assert_eq!(meta.block_size, Some(128));
    let config = "model=tiny-qwen3-4l-512h;dtype=float32;enforce_eager=true;load_format=dummy;max_model_len=2048;seed=0;kv_cache_space_gib=1;tp=1";
    // captured before the host CPU was recorded: stamped under config-fingerprint-v3
    assert_eq!(meta.host_cpu, None);
    assert_eq!(
        meta.config_hash,
        Some(ConfigFingerprint::new("cpu", "v0.32.0", config).hash_v3())
    );
    assert!(meta.ready_response_hex.is_some_and(|h| h.len() > 100));

    assert_eq!(records.len(), 301);
    let load: Vec<_> = records.iter().filter(|r| r.prompt_tokens == 128).collect();
    assert_eq!(load.len(), 300);
    for r in &load {
        assert!(!r.incomplete, "{r:?}");
        assert_eq!(r.output_tokens, 64);
        assert_eq!(r.finish_reason.as_deref(), Some("length"));
        assert_eq!(r.itl_ms.len(), 63, "one gap per token after the first");
        assert_eq!(r.itl_ctx.num_running.len(), 63);
        assert_eq!(r.output_token_ids.as_ref().map(Vec::len), Some(64));
        assert_eq!(r.block_hashes.len(), 1, "one full 128-token block");
        assert!(r.ttft_ms.is_some_and(|t| t > 0.0));
        assert!(r.itl_ms.iter().all(|&g| g > 0.0));
        assert!(r.concurrency.is_some_and(|c| (1..=9).contains(&c)));
    }
    assert!(
        load.iter().any(|r| r.concurrency == Some(8)),
        "the load reached 8"
    );
    // Decode steps of a full batch take about ten milliseconds on the capture machine.
    let mut gaps: Vec<f64> = load.iter().flat_map(|r| r.itl_ms.clone()).collect();
    gaps.sort_by(f64::total_cmp);
    let p50 = gaps[gaps.len() / 2];
    assert!(p50 > 1.0 && p50 < 200.0, "itl p50 {p50}");
}

#[test]
fn the_step_stats_sidecar_is_on_the_trace_clock() {
    let text = {
        use std::io::Read;
        let f = std::fs::File::open(cpu_capture("steps.jsonl.gz")).unwrap();
        let mut s = String::new();
        flate2::read::MultiGzDecoder::new(f)
            .read_to_string(&mut s)
            .unwrap();
        s
    };
    let mut last = f64::MIN;
    let mut n = 0;
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let ts = v["ts_ms"].as_f64().unwrap();
        assert!(ts >= last, "ts_ms goes back: {last} then {ts}");
        last = ts;
        assert!(v["num_running_reqs"].as_u64().unwrap() <= 9);
        assert!(v["kv_cache_usage"].as_f64().unwrap() <= 1.0);
        n += 1;
    }
    assert!(n > 1000, "{n} steps");
}
