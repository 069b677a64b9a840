//! The engine's KV-cache events, checked by a real subscriber using vLLM's own decoder and
//! vLLM's own block-hash function: the stored blocks are the prompts' blocks with the
//! hashes a real engine would report; eviction and `reset_prefix_cache` are reported.
//! Needs the Python frontend venv (`cargo xtask fetch --python`); fails without it.

use std::process::Stdio;
use std::time::Duration;

use crate::support::*;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_subscriber_matches_stored_and_removed_blocks_to_the_prompts() {
    let python =
        vllm_python("this test needs vLLM's own Python code; run `cargo xtask fetch --python`");
    let port = vllm_vcr::child::free_ports(1).unwrap()[0];
    let mut a = args();
    a.block_size = Some(16);
    a.num_gpu_blocks = 9; // 8 usable blocks: the third prompt evicts the first
    a.kv_events_config = Some(format!(
        r#"{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{port}"}}"#
    ));
    let mut w = Wire::start(a).await;
    let cfg = w.engines[0]
        .ready
        .kv_events_config
        .clone()
        .expect("kv_events_config advertised");
    assert!(format!("{cfg}").contains(&format!(":{port}")), "{cfg}");

    let prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|p| (0..48u32).map(|i| 3 + (p * 50 + i) % 250).collect())
        .collect();
    let mut sub = tokio::process::Command::new(&python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/kv_events_engine.py"
        ))
        .arg(format!("tcp://127.0.0.1:{port}"))
        .arg("16")
        .arg(serde_json::to_string(&prompts).unwrap())
        .env("VLLM_TARGET_DEVICE", "cpu")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(sub.stdout.take().unwrap()).lines();
    let ready = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
        .await
        .expect("subscriber did not start")
        .unwrap()
        .expect("subscriber exited");
    assert!(ready.contains("ready"), "{ready}");

    for (i, p) in prompts.iter().enumerate() {
        let id = format!("kv{i}");
        w.send(&add(&id, p, 2)).await;
        w.collect(&[&id]).await;
    }
    assert_eq!(
        w.reset_prefix_cache(9, false).await,
        Ok(rmpv::Value::Boolean(true))
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    sub.stdin
        .as_mut()
        .unwrap()
        .write_all(b"quit\n")
        .await
        .unwrap();
    let result: Value = loop {
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .unwrap()
            .unwrap()
            .expect("subscriber exited without a result");
        let v: Value = serde_json::from_str(&line).unwrap();
        if v["kind"] == "result" {
            break v;
        }
    };
    w.stop().await.unwrap();

    assert_eq!(result["mismatches"], serde_json::json!([]), "{result}");
    assert_eq!(result["seq_ordered"], true);
    // 3 prompts × 3 full blocks (48 tokens) were stored; only 8 blocks fit, so the first
    // prompt's blocks were evicted (BlockRemoved) when the third arrived
    let first: Vec<String> = result["expected"][0]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_str().unwrap().to_string())
        .collect();
    let removed: Vec<String> = result["removed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_str().unwrap().to_string())
        .collect();
    assert!(first.iter().any(|h| removed.contains(h)), "{result}");
    assert_eq!(
        result["cleared"], 1,
        "reset_prefix_cache → AllBlocksCleared"
    );
}
