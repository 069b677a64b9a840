//! The step scheduler as a frontend sees it over the wire: prefix-cache hits, chunked
//! prefill, KV-capacity preemption and step-batched outputs.

mod support;

use sim_protocol::{EventType, FinishReason};
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_is_served_from_the_prefix_cache() {
    let mut w = Wire::start(args()).await;
    let prompt: Vec<u32> = (10..50).collect(); // 40 tokens: 2 full blocks of 16
    w.send(&add("first", &prompt, 3)).await;
    let c1 = w.collect(&["first"]).await;
    w.send(&add("second", &prompt, 3)).await;
    let c2 = w.collect(&["second"]).await;
    assert_eq!(c1.prefill["first"].num_cached_tokens, 0);
    assert_eq!(c1.prefill["first"].num_computed_tokens, 40);
    assert_eq!(c2.prefill["second"].num_cached_tokens, 32);
    assert_eq!(c2.prefill["second"].num_computed_tokens, 8);
    let (q, h): (u64, u64) = c2
        .envelopes
        .iter()
        .filter_map(|e| e.scheduler_stats.as_ref())
        .map(|s| (s.prefix_cache_stats.queries, s.prefix_cache_stats.hits))
        .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    assert_eq!((q, h), (40, 32), "stats carry per-step deltas");
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prompt_is_prefilled_in_chunks() {
    let mut a = args();
    a.max_num_batched_tokens = 64;
    let mut w = Wire::start(a).await;
    w.send(&add("long", &vec![7; 200], 2)).await;
    let c = w.collect(&["long"]).await;
    // 64 + 64 + 64 + 8: three steps without a token (stats only), then the first token
    let before_first = c
        .envelopes
        .iter()
        .take_while(|e| e.outputs.is_empty())
        .filter(|e| e.scheduler_stats.is_some())
        .count();
    assert_eq!(before_first, 3);
    assert_eq!(c.tokens["long"].len(), 2);
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_out_of_kv_blocks_preempts_and_everything_completes() {
    let mut a = args();
    a.block_size = 4;
    a.num_gpu_blocks = 9; // 8 usable blocks = 32 tokens
    a.inter_token_latency = 1.0;
    let mut w = Wire::start(a).await;
    for id in ["p0", "p1", "p2"] {
        w.send(&add(id, &[20, 21, 22, 23, 24, 25, 26], 12)).await;
    }
    let c = w.collect(&["p0", "p1", "p2"]).await;
    let preempted: usize = c
        .events
        .values()
        .map(|e| e.iter().filter(|k| **k == EventType::Preempted).count())
        .sum();
    assert!(preempted > 0, "3 × 19 tokens do not fit 32");
    for id in ["p0", "p1", "p2"] {
        assert_eq!(c.tokens[id].len(), 12, "{id}");
        assert_eq!(c.finished[id].0, FinishReason::Length);
    }
    let usage: Vec<f64> = c
        .envelopes
        .iter()
        .filter_map(|e| e.scheduler_stats.as_ref().map(|s| s.kv_cache_usage))
        .collect();
    assert!(
        usage.iter().any(|u| *u > 0.5),
        "the cache filled up: {usage:?}"
    );
    assert_eq!(*usage.last().unwrap(), 0.0, "all blocks free at the end");
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_decoding_together_share_one_message_per_step() {
    let mut a = args();
    a.inter_token_latency = 5.0;
    let mut w = Wire::start(a).await;
    for id in ["a", "b", "c"] {
        w.send(&add(id, &[9, 9], 6)).await;
    }
    let c = w.collect(&["a", "b", "c"]).await;
    let full = c.envelopes.iter().filter(|e| e.outputs.len() == 3).count();
    assert!(
        full >= 4,
        "decode steps batch every running request ({full})"
    );
    w.stop().await.unwrap();
}
