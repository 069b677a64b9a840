//! The engine's KV-cache events, checked by a real subscriber using vLLM's own decoder and
//! vLLM's own block-hash function: the stored blocks are the prompts' blocks with the
//! hashes a real engine would report; eviction and `reset_prefix_cache` are reported; the
//! KV offload tier's stores and evictions come with medium `CPU` in vLLM's placeholder form.
//! Needs the Python frontend venv (`cargo xtask fetch --python`); fails without it.

use std::process::Stdio;
use std::time::Duration;

use crate::support::*;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

/// The engine-side consumer (`tests/kv_events_engine.py`) subscribed to `port`, checking
/// the stores against `prompts` (blocks of `block_size` tokens).
struct Consumer {
    child: tokio::process::Child,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

impl Consumer {
    async fn start(python: &std::path::Path, port: u16, prompts: &[Vec<u32>]) -> Self {
        let mut child = tokio::process::Command::new(python)
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/kv_events_engine.py"
            ))
            .arg(format!("tcp://127.0.0.1:{port}"))
            .arg("16")
            .arg(serde_json::to_string(prompts).unwrap())
            .env("VLLM_TARGET_DEVICE", "cpu")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let ready = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
            .await
            .expect("subscriber did not start")
            .unwrap()
            .expect("subscriber exited");
        assert!(ready.contains("ready"), "{ready}");
        Self { child, lines }
    }

    /// Let the last batches arrive, stop it, and read what it saw.
    async fn result(mut self) -> Value {
        tokio::time::sleep(Duration::from_millis(500)).await;
        self.child
            .stdin
            .as_mut()
            .unwrap()
            .write_all(b"quit\n")
            .await
            .unwrap();
        loop {
            let line = tokio::time::timeout(Duration::from_secs(30), self.lines.next_line())
                .await
                .unwrap()
                .unwrap()
                .expect("subscriber exited without a result");
            let v: Value = serde_json::from_str(&line).unwrap();
            if v["kind"] == "result" {
                return v;
            }
        }
    }
}

/// Three 48-token prompts (three full blocks each), distinct.
fn prompts() -> Vec<Vec<u32>> {
    (0..3u32)
        .map(|p| (0..48u32).map(|i| 3 + (p * 50 + i) % 250).collect())
        .collect()
}

/// Each prompt in turn (`kv<i>`, two tokens), to its end.
async fn send_each(w: &mut Wire, prompts: &[Vec<u32>]) {
    for (i, p) in prompts.iter().enumerate() {
        let id = format!("kv{i}");
        w.send(&add(&id, p, 2)).await;
        w.collect(&[&id]).await;
    }
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_str().unwrap().to_string())
        .collect()
}

/// vLLM's Python, and play args publishing KV events on a free port, 16-token blocks.
fn publishing() -> (std::path::PathBuf, vllm_vcr::play::PlayArgs, u16) {
    let python =
        vllm_python("this test needs vLLM's own Python code; run `cargo xtask fetch --python`");
    let port = vllm_vcr::child::free_ports(1).unwrap()[0];
    let mut a = args();
    a.block_size = Some(16);
    a.kv_events_config = Some(format!(
        r#"{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{port}"}}"#
    ));
    (python, a, port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_subscriber_matches_stored_and_removed_blocks_to_the_prompts() {
    let (python, mut a, port) = publishing();
    a.num_gpu_blocks = 9; // 8 usable blocks: the third prompt evicts the first
    let mut w = Wire::start(a).await;
    let cfg = w.engines[0]
        .ready
        .kv_events_config
        .clone()
        .expect("kv_events_config advertised");
    assert!(format!("{cfg}").contains(&format!(":{port}")), "{cfg}");

    let prompts = prompts();
    let sub = Consumer::start(&python, port, &prompts).await;
    send_each(&mut w, &prompts).await;
    assert_eq!(
        w.reset_prefix_cache(9, false).await,
        Ok(rmpv::Value::Boolean(true))
    );
    let result = sub.result().await;
    w.stop().await.unwrap();

    assert_eq!(result["mismatches"], serde_json::json!([]), "{result}");
    assert_eq!(result["seq_ordered"], true);
    // 3 prompts × 3 full blocks (48 tokens) were stored; only 8 blocks fit, so the first
    // prompt's blocks were evicted (BlockRemoved) when the third arrived
    let first = strings(&result["expected"][0]);
    let removed = strings(&result["removed"]);
    assert!(first.iter().any(|h| removed.contains(h)), "{result}");
    assert_eq!(
        result["cleared"], 1,
        "reset_prefix_cache → AllBlocksCleared"
    );
    assert_eq!(
        result["cpu_stored"],
        serde_json::json!([]),
        "no offload tier"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_offload_tier_publishes_its_stores_and_evictions_with_medium_cpu() {
    let (python, mut a, port) = publishing();
    a.num_gpu_blocks = 5; // 4 usable blocks: each prompt evicts the one before
    a.max_model_len = 64;
    a.kv_offload_blocks = 7; // the third prompt's stores evict two of the first's
    let mut w = Wire::start(a).await;
    let prompts = prompts();
    let sub = Consumer::start(&python, port, &prompts).await;
    send_each(&mut w, &prompts).await;
    // the first prompt again: gone from the device, its first block still in the tier
    // (the tier's LRU evicted its tail first)
    w.send(&add("again", &prompts[0], 2)).await;
    let c = w.collect(&["again"]).await;
    let result = sub.result().await;
    w.stop().await.unwrap();

    let p = &c.prefill["again"];
    assert_eq!(
        (p.num_cached_tokens, p.num_external_cached_tokens),
        (16, 16),
        "one block loaded from the tier: {p:?}"
    );
    // the device's own events still match the prompts, with vLLM's hashes
    assert_eq!(result["mismatches"], serde_json::json!([]), "{result}");
    let expected: Vec<Vec<String>> = (0..3).map(|i| strings(&result["expected"][i])).collect();
    let cpu_stored = strings(&result["cpu_stored"]);
    for (i, blocks) in expected.iter().enumerate() {
        for h in blocks {
            assert!(
                cpu_stored.contains(h),
                "prompt {i} block {h} never stored on CPU: {result}"
            );
        }
    }
    // 9 blocks through 7 places: the third prompt's stores evicted the first prompt's two
    // tail blocks, least recent first
    let cpu_removed = strings(&result["cpu_removed"]);
    assert_eq!(
        cpu_removed[..2],
        [expected[0][2].clone(), expected[0][1].clone()],
        "{result}"
    );
}
