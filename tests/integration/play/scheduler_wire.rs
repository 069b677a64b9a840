//! The step scheduler as a frontend sees it over the wire: prefix-cache hits, chunked
//! prefill, KV-capacity preemption and step-batched outputs.

use crate::support::*;
use sim_protocol::{EventType, FinishReason};

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
    a.max_num_batched_tokens = Some(64);
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
    a.block_size = Some(4);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_have_the_sampled_token_first_and_k_alternatives() {
    let mut w = Wire::start(args()).await;
    let mut r = request("lp", &[10, 11, 12], 4);
    let sp = r.sampling_params.as_mut().unwrap();
    sp.logprobs = Some(3);
    sp.prompt_logprobs = Some(2);
    w.send(&sim_protocol::InputMessage::Add(Box::new(r))).await;
    let c = w.collect(&["lp"]).await;
    let outs: Vec<_> = c.envelopes.iter().flat_map(|e| e.outputs.iter()).collect();
    assert!(
        outs[0].new_prompt_logprobs_tensors.is_some(),
        "prompt logprobs on the first output"
    );
    for o in &outs {
        let lp = o
            .new_logprobs
            .as_ref()
            .expect("logprobs on every token output");
        assert_eq!(lp.rows, o.new_token_ids.len());
        assert_eq!(lp.cols, 4, "the sampled token + 3 alternatives");
        for (row, t) in o.new_token_ids.iter().enumerate() {
            assert_eq!(
                lp.token_ids[row * 4] as u32,
                *t,
                "column 0 is the sampled token"
            );
            let vals = &lp.logprobs[row * 4 + 1..row * 4 + 4];
            assert!(vals.windows(2).all(|w| w[0] >= w[1]), "sorted: {vals:?}");
            assert!(vals.iter().all(|v| *v <= 0.0));
        }
    }
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_steps_deliver_several_tokens_and_report_acceptance() {
    let mut a = args();
    a.num_speculative_tokens = 3;
    a.speculative_acceptance_rate = 0.8;
    let mut w = Wire::start(a).await;
    w.send(&add("spec", &[10, 11], 60)).await;
    let c = w.collect(&["spec"]).await;
    assert_eq!(
        c.tokens["spec"].len(),
        60,
        "the stop checks still cut at max_tokens"
    );
    assert!(
        c.messages["spec"] < 60,
        "multi-token steps: {} messages",
        c.messages["spec"]
    );
    let outs: Vec<_> = c.envelopes.iter().flat_map(|e| e.outputs.iter()).collect();
    assert!(
        outs.iter().all(|o| o.new_token_ids.len() <= 4),
        "at most 1 + K per step"
    );
    let (drafts, draft_tokens, accepted) = c
        .envelopes
        .iter()
        .filter_map(|e| e.scheduler_stats.as_ref()?.spec_decoding_stats.as_ref())
        .fold((0, 0, 0), |a, s| {
            (
                a.0 + s.num_drafts,
                a.1 + s.num_draft_tokens,
                a.2 + s.num_accepted_tokens,
            )
        });
    assert!(drafts > 0 && draft_tokens == 3 * drafts && accepted <= draft_tokens);
    let last = outs.last().unwrap();
    let m = last
        .spec_decode_metrics
        .as_ref()
        .expect("per-request metrics on the final output");
    assert_eq!(m.num_spec_tokens, 3);
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn injected_failures_finish_requests_the_chosen_way() {
    let mut a = args();
    a.failure_injection_rate = 1.0;
    a.failure_types = vec![vllm_vcr::play::content::failures::FailureType::Length];
    let mut w = Wire::start(a).await;
    w.send(&add("cut", &[10], 50)).await;
    let c = w.collect(&["cut"]).await;
    assert_eq!(c.finished["cut"].0, FinishReason::Length);
    assert!(c.tokens["cut"].len() < 50, "cut short");
    w.stop().await.unwrap();

    let mut a = args();
    a.failure_injection_rate = 1.0;
    a.failure_types = vec![vllm_vcr::play::content::failures::FailureType::Error];
    let mut w = Wire::start(a).await;
    for id in ["e0", "e1", "e2", "e3"] {
        w.send(&add(id, &[10], 50)).await;
    }
    let c = w.collect(&["e0", "e1", "e2", "e3"]).await;
    for id in ["e0", "e1", "e2", "e3"] {
        assert_eq!(c.finished[id].0, FinishReason::Error, "{id}");
    }
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_prefix_cache_forgets_cached_blocks() {
    let mut w = Wire::start(args()).await;
    let prompt: Vec<u32> = (10..50).collect();
    w.send(&add("a", &prompt, 2)).await;
    w.collect(&["a"]).await;
    assert_eq!(
        w.reset_prefix_cache(1, false).await,
        Ok(rmpv::Value::Boolean(true))
    );
    w.send(&add("b", &prompt, 2)).await;
    let c = w.collect(&["b"]).await;
    assert_eq!(c.prefill["b"].num_cached_tokens, 0, "the cache was emptied");
    assert!(
        c.envelopes
            .iter()
            .filter_map(|e| e.scheduler_stats.as_ref())
            .any(|s| s.prefix_cache_stats.reset),
        "the reset is reported in the stats"
    );
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_prefill_request_pulls_its_kv_instead_of_computing_it() {
    let mut a = args();
    a.time_to_first_token = 400.0;
    a.kv_transfer_latency = 30.0;
    let mut w = Wire::start(a).await;
    let mut r = request("pd", &vec![7; 100], 3);
    r.sampling_params.as_mut().unwrap().extra_args = Some(rmpv::Value::Map(vec![(
        "kv_transfer_params".into(),
        rmpv::Value::Map(vec![("do_remote_prefill".into(), true.into())]),
    )]));
    let start = std::time::Instant::now();
    w.send(&sim_protocol::InputMessage::Add(Box::new(r))).await;
    let c = w.collect(&["pd"]).await;
    let elapsed = start.elapsed();
    let p = c.prefill["pd"];
    // vLLM's connector matches the whole prompt as external, then recomputes the last
    // token to sample (`_update_waiting_for_remote_kv`)
    assert_eq!(
        p.num_external_cached_tokens, 100,
        "the whole prompt counts as pulled"
    );
    // as in vLLM's prefill stats: nothing of the prompt counts as computed here (the one
    // recomputed token is the sampling pass)
    assert_eq!(p.num_computed_tokens, 0);
    // 30 ms transfer + 1/100 of the 400 ms TTFT, far below a cold prefill
    assert!(
        elapsed < std::time::Duration::from_millis(300),
        "{elapsed:?}"
    );
    assert!(
        elapsed >= std::time::Duration::from_millis(30),
        "{elapsed:?}"
    );
    w.stop().await.unwrap();
}

/// A prefill engine reads `kv_transfer_params.do_remote_decode` as vLLM's connector does
/// (Python truthiness): `"yes"`, `1`, even `"false"` keep the KV for a decode engine and
/// answer with where it is; `0` and `""` do not. Non-booleans used to be taken as false
/// without a word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_engine_reads_do_remote_decode_with_pythons_truthiness() {
    let mut a = args();
    a.pd_role = vllm_vcr::play::pd::PdRole::Prefill;
    a.side_channel_port = vllm_vcr::child::free_ports(1).unwrap()[0];
    let mut w = Wire::start(a).await;
    let cases = [
        ("bool", rmpv::Value::from(true), true),
        ("yes", rmpv::Value::from("yes"), true),
        ("one", rmpv::Value::from(1), true),
        ("false-string", rmpv::Value::from("false"), true),
        ("zero", rmpv::Value::from(0), false),
        ("empty", rmpv::Value::from(""), false),
    ];
    for (id, v, _) in &cases {
        let mut r = request(id, &[5; 40], 1);
        r.sampling_params.as_mut().unwrap().extra_args = Some(rmpv::Value::Map(vec![(
            "kv_transfer_params".into(),
            rmpv::Value::Map(vec![("do_remote_decode".into(), v.clone())]),
        )]));
        w.send(&sim_protocol::InputMessage::Add(Box::new(r))).await;
    }
    let ids: Vec<&str> = cases.iter().map(|c| c.0).collect();
    let c = w.collect(&ids).await;
    for (id, v, keeps) in &cases {
        let params = c
            .envelopes
            .iter()
            .flat_map(|e| &e.outputs)
            .find(|o| o.request_id.as_str() == *id && o.finish_reason.is_some())
            .and_then(|o| o.kv_transfer_params.as_ref());
        assert_eq!(params.is_some(), *keeps, "do_remote_decode {v}: {params:?}");
    }
    w.stop().await.unwrap();
}
