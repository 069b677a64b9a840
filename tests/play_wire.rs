//! Wire-level tests: a Rust frontend stand-in drives `play` over real ZMQ sockets and checks
//! what a frontend would observe.

mod support;

use std::time::{Duration, Instant};

use rmpv::Value;
use sim_protocol::{EventType, FinishReason, InputMessage, StopReason, VllmLine};
use support::*;
use vllm_vcr::play::TokenMode;

fn line(s: &str) -> VllmLine {
    VllmLine::parse(s).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_advertises_the_engine() {
    let mut a = args();
    a.max_model_len = 4096;
    a.num_gpu_blocks = 1234;
    a.max_num_seqs = Some(17);
    let w = Wire::start(a).await;
    let e = &w.engines[0];
    assert_eq!(e.rank, Some(0));
    assert!(!e.hello.local && e.hello.headless);
    assert_eq!(e.ready.max_model_len, 4096);
    assert_eq!(e.ready.num_gpu_blocks, 1234);
    assert_eq!(e.ready.max_num_seqs, 17);
    assert_eq!(e.ready.vllm_version, "0.33.0");
    assert_eq!(e.ready.dtype, "bfloat16");
    assert!(e.ready.supports_lora && e.ready.max_loras > 0);
    assert_eq!(
        e.ready_payloads.len(),
        1,
        "one ready response per input socket"
    );
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_streams_to_max_tokens_with_events_and_prefill_stats() {
    let mut w = Wire::start(args()).await;
    w.send(&add("r1", &[10, 11, 12, 13], 5)).await;
    let c = w.collect(&["r1"]).await;
    assert_eq!(c.tokens["r1"].len(), 5);
    assert!(c.tokens["r1"].iter().all(|t| (3..259).contains(t)));
    assert_eq!(c.finished["r1"], (FinishReason::Length, None));
    assert_eq!(
        c.events["r1"],
        vec![EventType::Queued, EventType::Scheduled]
    );
    assert_eq!(c.prefill["r1"].num_prompt_tokens, 4);
    assert_eq!(c.messages["r1"], 5, "one token per step");
    // every step carries stats, and the last says nothing runs
    assert_eq!(c.last_running, Some(0));
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_seed_same_tokens() {
    let mut a = args();
    a.seed = 42;
    let mut w = Wire::start(a.clone()).await;
    w.send(&add("same", &[5, 6], 20)).await;
    let first = w.collect(&["same"]).await.tokens["same"].clone();
    w.stop().await.unwrap();
    let mut w = Wire::start(a).await;
    w.send(&add("same", &[5, 6], 20)).await;
    let second = w.collect(&["same"]).await.tokens["same"].clone();
    w.stop().await.unwrap();
    assert_eq!(first, second);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_stops_at_eos_and_stop_token_ids() {
    let mut a = args();
    a.tokens = Some(TokenMode::Echo);
    let mut w = Wire::start(a).await;
    w.send(&add("eos", &[40, 41, 42], 10)).await;
    let mut stop = request("stopid", &[40, 41, 42], 10);
    stop.sampling_params.as_mut().unwrap().stop_token_ids = vec![0, 41];
    w.send(&InputMessage::Add(Box::new(stop))).await;
    let mut ign = request("ignore", &[40, 41], 5);
    let sp = ign.sampling_params.as_mut().unwrap();
    sp.eos_token_id = None; // what frontends send for ignore_eos
    w.send(&InputMessage::Add(Box::new(ign))).await;
    let c = w.collect(&["eos", "stopid", "ignore"]).await;
    assert_eq!(c.tokens["eos"], vec![40, 41, 42, 2]);
    assert_eq!(c.finished["eos"], (FinishReason::Stop, None));
    assert_eq!(c.tokens["stopid"], vec![40, 41]);
    assert_eq!(
        c.finished["stopid"],
        (FinishReason::Stop, Some(StopReason::Token(41)))
    );
    assert_eq!(c.tokens["ignore"], vec![40, 41, 40, 41, 40]);
    assert_eq!(c.finished["ignore"], (FinishReason::Length, None));
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_length_and_min_tokens() {
    let mut a = args();
    a.tokens = Some(TokenMode::Echo);
    a.max_model_len = 8;
    let mut w = Wire::start(a).await;
    w.send(&add("long", &[40, 41, 42, 43, 44, 45], 100)).await;
    let mut m = request("min", &[40, 2, 41], 6);
    m.sampling_params.as_mut().unwrap().min_tokens = 4;
    w.send(&InputMessage::Add(Box::new(m))).await;
    let c = w.collect(&["long", "min"]).await;
    assert_eq!(
        c.tokens["long"].len(),
        2,
        "6 prompt + 2 output = max_model_len 8"
    );
    assert_eq!(c.finished["long"].0, FinishReason::Length);
    // EOS (2) is masked until 4 tokens were produced
    assert_eq!(c.tokens["min"][..4], [40, 41, 40, 41]);
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_frees_the_request_without_output() {
    let mut a = args();
    a.inter_token_latency = 5.0;
    let mut w = Wire::start(a).await;
    w.send(&add("long", &[10], 1000)).await;
    let mut c = Collected::default();
    while c.tokens.get("long").map_or(0, |t| t.len()) < 3 {
        let env = w.recv().await;
        c.absorb(env);
    }
    w.send(&InputMessage::Abort(vec![
        "long".into(),
        "never-existed".into(),
    ]))
    .await;
    w.send(&InputMessage::Abort(vec!["long".into()])).await;
    // drain: no finish output for the aborted request, and running goes back to 0
    let deadline = Instant::now() + Duration::from_millis(300);
    while let Some(env) = w
        .try_recv(deadline.saturating_duration_since(Instant::now()))
        .await
    {
        c.absorb(env);
    }
    assert!(
        !c.finished.contains_key("long"),
        "aborted requests get no output"
    );
    assert_eq!(c.last_running, Some(0));
    // the engine keeps serving
    w.send(&add("next", &[10], 2)).await;
    let c = w.collect(&["next"]).await;
    assert_eq!(c.tokens["next"].len(), 2);
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_num_seqs_queues_the_rest() {
    let mut a = args();
    a.max_num_seqs = Some(2);
    a.inter_token_latency = 2.0;
    let mut w = Wire::start(a).await;
    let ids: Vec<String> = (0..6).map(|i| format!("q{i}")).collect();
    for id in &ids {
        w.send(&add(id, &[10, 11], 4)).await;
    }
    let refs: Vec<&str> = ids.iter().map(|s| s.as_str()).collect();
    let c = w.collect(&refs).await;
    assert!(c.max_waiting >= 1, "stats showed a waiting queue");
    assert_eq!(c.max_running, 2);
    for id in &ids {
        assert_eq!(c.tokens[id].len(), 4);
        assert_eq!(c.finished[id].0, FinishReason::Length);
    }
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_latency_paces_first_token_and_gaps() {
    let mut a = args();
    a.time_to_first_token = 60.0;
    a.inter_token_latency = 20.0;
    let mut w = Wire::start(a).await;
    let start = Instant::now();
    w.send(&add("t", &[10], 4)).await;
    let mut times = vec![];
    let mut stamps = vec![];
    loop {
        let env = w.recv().await;
        if env.outputs.iter().any(|o| o.request_id == "t") {
            times.push(start.elapsed());
            stamps.push(env.timestamp);
            if env.outputs.iter().any(|o| o.finish_reason.is_some()) {
                break;
            }
        }
    }
    assert_eq!(times.len(), 4);
    assert!(times[0] >= Duration::from_millis(60), "ttft {:?}", times[0]);
    assert!(times[0] < Duration::from_millis(160), "ttft {:?}", times[0]);
    // Steps run on an absolute clock: each emission is its deadline plus the loop's
    // wake-up lateness (well under 10 ms even on a loaded 2-core machine).
    for (i, t) in stamps.iter().enumerate() {
        let since_first = t - stamps[0];
        let planned = 0.020 * i as f64;
        assert!(
            (planned - 0.010..planned + 0.020).contains(&since_first),
            "engine-stamped step {i} at {since_first} s after the first, planned {planned} s"
        );
    }
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_token_chunks() {
    let mut a = args();
    a.output_token_chunk_size = 3;
    let mut w = Wire::start(a).await;
    w.send(&add("c", &[10], 7)).await;
    let c = w.collect(&["c"]).await;
    assert_eq!(c.tokens["c"].len(), 7);
    assert_eq!(c.messages["c"], 3, "3 + 3 + 1 tokens");
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_guard_rejects_a_frontend_of_another_line() {
    // engine configured for 0.25 (20-element ADD); the frontend speaks 0.33 (22 elements)
    let mut a = args();
    a.vllm_version = line("0.25");
    let mut w = Wire::start(a).await;
    w.line = line("0.33");
    w.send(&add("wrong", &[10], 3)).await;
    let env = w.recv().await;
    let o = &env.outputs[0];
    assert_eq!(o.request_id, "wrong");
    assert_eq!(o.finish_reason, Some(FinishReason::Error));
    assert!(o.new_token_ids.is_empty());
    w.stop().await.unwrap();

    // the reverse: a 0.33 engine and a 0.25–0.27 frontend. The reply is laid out so that
    // the frontend's own line can read it: no 0.33-only `error` field (a 19-element output
    // is what made an older vllm-rs fail every later request)
    let mut w = Wire::start(args()).await;
    w.line = line("0.27");
    w.send(&add("old", &[10], 3)).await;
    w.line = line("0.33");
    let env = w.recv().await;
    let o = &env.outputs[0];
    assert_eq!(o.finish_reason, Some(FinishReason::Error));
    assert!(o.new_token_ids.is_empty());
    assert!(
        o.error.is_none(),
        "the reply carries a field a 0.25–0.27 frontend cannot decode: {:?}",
        o.error
    );
    // the right line still works
    w.send(&add("ok", &[10], 2)).await;
    let c = w.collect(&["ok"]).await;
    assert_eq!(c.tokens["ok"].len(), 2);
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_line_round_trips_a_request() {
    for l in sim_protocol::supported_lines() {
        let mut a = args();
        a.vllm_version = l;
        let mut w = Wire::start(a).await;
        w.send(&add("x", &[10, 11], 3)).await;
        let c = w.collect(&["x"]).await;
        assert_eq!(c.tokens["x"].len(), 3, "line {l}");
        assert_eq!(c.prefill["x"].num_prompt_tokens, 2, "line {l}");
        assert_eq!(
            w.call(7, "wake_up", vec![Value::Nil]).await,
            Ok(if l >= line("0.31") {
                Value::Boolean(true)
            } else {
                Value::Nil
            }),
            "wake_up result type on {l}"
        );
        w.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn utilities_answer_like_vllm() {
    let mut w = Wire::start(args()).await;
    let big = u64::MAX - 5;
    assert_eq!(
        w.call(big, "get_supported_tasks", vec![]).await,
        Ok(Value::Array(vec![Value::from("generate")]))
    );
    assert_eq!(w.call(1, "reset_mm_cache", vec![]).await, Ok(Value::Nil));
    assert_eq!(
        w.call(2, "is_sleeping", vec![]).await,
        Ok(Value::Boolean(false))
    );
    assert_eq!(
        w.call(3, "sleep", vec![Value::from(1), Value::from("abort")])
            .await,
        Ok(Value::Nil)
    );
    assert_eq!(
        w.call(4, "is_sleeping", vec![]).await,
        Ok(Value::Boolean(true))
    );
    assert_eq!(
        w.call(5, "wake_up", vec![Value::Nil]).await,
        Ok(Value::Boolean(true))
    );
    assert_eq!(
        w.call(6, "is_sleeping", vec![]).await,
        Ok(Value::Boolean(false))
    );
    let lora = Value::Array(vec![
        Value::from("l1"),
        Value::from(1),
        Value::from("/tmp/l1"),
        Value::Nil,
        Value::Boolean(false),
        Value::Boolean(false),
    ]);
    assert_eq!(
        w.call(7, "add_lora", vec![lora]).await,
        Ok(Value::Boolean(true))
    );
    assert_eq!(
        w.call(8, "list_loras", vec![]).await,
        Ok(Value::Array(vec![Value::from(1)]))
    );
    assert_eq!(
        w.call(9, "pin_lora", vec![Value::from(1)]).await,
        Ok(Value::Boolean(true))
    );
    assert!(w.call(10, "pin_lora", vec![Value::from(99)]).await.is_err());
    assert_eq!(
        w.call(11, "remove_lora", vec![Value::from(1)]).await,
        Ok(Value::Boolean(true))
    );
    assert_eq!(
        w.call(12, "remove_lora", vec![Value::from(1)]).await,
        Ok(Value::Boolean(false))
    );
    assert_eq!(
        w.call(
            13,
            "reset_prefix_cache",
            vec![Value::Boolean(false), Value::Boolean(false)]
        )
        .await,
        Ok(Value::Boolean(true))
    );
    assert_eq!(
        w.call(14, "profile", vec![Value::Boolean(true)]).await,
        Ok(Value::Nil)
    );
    let err = w
        .call(15, "collective_rpc", vec![Value::from("x")])
        .await
        .unwrap_err();
    assert!(
        err.starts_with("Call to collective_rpc method failed:"),
        "{err}"
    );
    let err = w.call(16, "no_such_method", vec![]).await.unwrap_err();
    assert!(err.contains("no_such_method"), "{err}");
    let err = w
        .call(17, "sleep", vec![Value::from("deep")])
        .await
        .unwrap_err();
    assert!(err.contains("level"), "{err}");
    assert_eq!(
        w.call(18, "set_weight_version", vec![Value::from("v2")])
            .await,
        Ok(Value::Nil)
    );
    assert_eq!(
        w.call(19, "get_weight_version", vec![]).await,
        Ok(Value::from("v2"))
    );
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_prefix_cache_refuses_while_running() {
    let mut a = args();
    a.inter_token_latency = 5.0;
    let mut w = Wire::start(a).await;
    w.send(&add("busy", &[10], 200)).await;
    let _ = w.recv().await;
    assert_eq!(
        w.call(
            1,
            "reset_prefix_cache",
            vec![Value::Boolean(false), Value::Boolean(false)]
        )
        .await,
        Ok(Value::Boolean(false))
    );
    assert_eq!(
        w.call(
            2,
            "reset_prefix_cache",
            vec![Value::Boolean(true), Value::Boolean(false)]
        )
        .await,
        Ok(Value::Boolean(true))
    );
    // the running request was preempted and re-admitted
    let mut c = Collected::default();
    while !c
        .events
        .get("busy")
        .is_some_and(|e| e.contains(&EventType::Preempted))
    {
        let env = w.recv().await;
        c.absorb(env);
    }
    w.send(&InputMessage::Abort(vec!["busy".into()])).await;
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_modes() {
    let mut a = args();
    a.inter_token_latency = 5.0;
    let mut w = Wire::start(a).await;

    // keep: requests freeze, resume continues them
    w.send(&add("k", &[10], 6)).await;
    let _ = w.recv().await;
    assert_eq!(
        w.call(
            1,
            "pause_scheduler",
            vec![Value::from("keep"), Value::Boolean(false)]
        )
        .await,
        Ok(Value::Nil)
    );
    assert_eq!(
        w.call(2, "is_scheduler_paused", vec![]).await,
        Ok(Value::Boolean(true))
    );
    // nothing moves while paused; new requests wait
    w.send(&add("held", &[10], 2)).await;
    let quiet = w.try_recv(Duration::from_millis(100)).await;
    assert!(
        quiet.is_none_or(|e| e.outputs.is_empty()),
        "outputs while paused"
    );
    assert_eq!(w.call(3, "resume_scheduler", vec![]).await, Ok(Value::Nil));
    let c = w.collect(&["k", "held"]).await;
    assert_eq!(c.finished["held"].0, FinishReason::Length);

    // abort: in-flight requests finish with ABORT
    w.send(&add("a", &[10], 500)).await;
    let _ = w.recv().await;
    w.send(&InputMessage::Utility(sim_protocol::UtilityCall {
        client_index: 0,
        call_id: sim_protocol::CallId::Unsigned(4),
        method: "pause_generation".into(),
        args: vec![Value::from("abort"), Value::Boolean(true)],
    }))
    .await;
    let mut c = Collected::default();
    let mut replied = false;
    while !(replied && c.finished.contains_key("a")) {
        let env = w.recv().await;
        replied |= env.utility_output.is_some();
        c.absorb(env);
    }
    assert_eq!(c.finished["a"].0, FinishReason::Abort);
    // pause_generation rejects new requests with engine_paused
    w.send(&add("rejected", &[10], 2)).await;
    let c = w.collect(&["rejected"]).await;
    assert_eq!(c.finished["rejected"].0, FinishReason::Error);
    let env = c.envelopes.iter().find(|e| !e.outputs.is_empty()).unwrap();
    assert_eq!(env.outputs[0].error.as_ref().unwrap().code, "engine_paused");
    assert_eq!(w.call(5, "resume_scheduler", vec![]).await, Ok(Value::Nil));

    // wait: the reply comes after the in-flight request finished
    w.send(&add("w", &[10], 4)).await;
    w.send(&InputMessage::Utility(sim_protocol::UtilityCall {
        client_index: 0,
        call_id: sim_protocol::CallId::Unsigned(6),
        method: "pause_scheduler".into(),
        args: vec![Value::from("wait"), Value::Boolean(false)],
    }))
    .await;
    let mut finished_before_reply = false;
    loop {
        let env = w.recv().await;
        if env
            .outputs
            .iter()
            .any(|o| o.request_id == "w" && o.finish_reason.is_some())
        {
            finished_before_reply = true;
        }
        if env.utility_output.is_some() {
            break;
        }
    }
    assert!(
        finished_before_reply,
        "wait mode replies after the in-flight request finished"
    );
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_api_server_clients() {
    let mut w = Wire::start_with_clients(args(), 2).await;
    assert_eq!(
        w.engines[0].ready_payloads.len(),
        2,
        "a ready response per input socket"
    );
    w.send_to(1, 0, &with_client(add("c1", &[10], 3), 1)).await;
    let c = w.collect_on(1, &["c1"]).await;
    assert_eq!(c.tokens["c1"].len(), 3);
    // utility replies go to the caller's client
    w.send_to(
        1,
        0,
        &InputMessage::Utility(sim_protocol::UtilityCall {
            client_index: 1,
            call_id: sim_protocol::CallId::Unsigned(9),
            method: "is_sleeping".into(),
            args: vec![],
        }),
    )
    .await;
    loop {
        let env = w.recv_on(1).await;
        if let Some(u) = env.utility_output {
            assert_eq!(u.outcome, Ok(Value::Boolean(false)));
            break;
        }
    }
    // stats go to client 0 only
    let env = w.recv_on(0).await;
    assert!(env.scheduler_stats.is_some());
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_engines_in_one_process() {
    let mut a = args();
    a.engine_count = 2;
    let mut w = Wire::start(a).await;
    assert_eq!(w.engines.len(), 2);
    assert_eq!(w.engines[0].ready.data_parallel_rank, 0);
    assert_eq!(w.engines[1].ready.data_parallel_rank, 1);
    assert_eq!(w.engines[1].ready.data_parallel_size, 2);
    w.send_to(0, 1, &add("dp", &[10], 2)).await;
    let c = w.collect(&["dp"]).await;
    assert_eq!(c.tokens["dp"].len(), 2);
    let env = c.envelopes.iter().find(|e| !e.outputs.is_empty()).unwrap();
    assert_eq!(env.engine_index, 1);
    // with data parallelism the engine reports finished ids (the frontend balances with them)
    assert!(
        c.envelopes.iter().any(|e| e
            .finished_requests
            .as_ref()
            .is_some_and(|f| f.contains(&"dp".to_string()))),
        "finished_requests carries the finished request"
    );
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_aborts_in_flight_requests() {
    let mut a = args();
    a.inter_token_latency = 20.0;
    a.shutdown_timeout = 0.05;
    let mut w = Wire::start(a).await;
    w.send(&add("inflight", &[10], 1000)).await;
    let _ = w.recv().await;
    w.shutdown.send(true).unwrap();
    let mut c = Collected::default();
    while !c.finished.contains_key("inflight") {
        let env = w.recv().await;
        c.absorb(env);
    }
    assert_eq!(c.finished["inflight"].0, FinishReason::Abort);
    tokio::time::timeout(TIMEOUT, w.task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

/// Issue: `--num-gpu-blocks 48 --block-size 16` with the default `--max-model-len`, and a
/// 1,080-token prompt waited forever. The advertised length is what the KV cache holds, and
/// a prompt that long is refused at once with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_the_kv_cache_cannot_hold_is_refused_not_left_waiting() {
    let mut a = args();
    a.num_gpu_blocks = 48;
    a.block_size = Some(16);
    let mut w = Wire::start(a).await;
    // block 0 is the null block: 47 × 16 tokens
    assert_eq!(w.engines[0].ready.max_model_len, 752);
    let long: Vec<u32> = (0..1080).map(|i| 3 + i % 200).collect();
    let started = std::time::Instant::now();
    w.send(&add("too-long", &long, 16)).await;
    w.send(&add("fits", &long[..700], 16)).await;
    let c = w.collect(&["too-long", "fits"]).await;
    assert!(started.elapsed() < std::time::Duration::from_secs(2));
    assert_eq!(c.finished["too-long"].0, FinishReason::Error);
    assert!(c.tokens.get("too-long").is_none_or(|t| t.is_empty()));
    let err = c
        .envelopes
        .iter()
        .flat_map(|e| &e.outputs)
        .find(|o| o.request_id == "too-long")
        .and_then(|o| o.error.clone())
        .expect("the refusal carries vLLM's RequestError");
    assert!(
        err.message.contains("1080 tokens") && err.message.contains("752"),
        "{}",
        err.message
    );
    // the one that fits runs as usual
    assert_eq!(c.finished["fits"].0, FinishReason::Length);
    assert_eq!(c.tokens["fits"].len(), 16);
    w.stop().await.unwrap();
}

/// The `structured_outputs` map as the frontends send it (`_backend` included).
fn structured(key: &str, value: Value) -> Value {
    Value::Map(vec![
        (Value::from(key), value),
        (Value::from("_backend"), Value::from("xgrammar")),
    ])
}

/// Structured outputs at the wire: a JSON schema is answered with a valid instance and
/// EOS (in the embedded tokenizer's ids: one byte a token), a choice with one of its
/// strings; a structural-tag format the engine cannot generate finishes at once with an
/// error naming it, never with unconstrained text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_outputs_are_valid_instances_or_a_named_error() {
    let mut w = Wire::start(args()).await;
    let schema = r#"{"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 99}, "tag": {"enum": ["a", "b"]}}, "required": ["n", "tag"]}"#;
    let mut j = request("json", &[40, 41, 42], 200);
    j.sampling_params.as_mut().unwrap().structured_outputs =
        Some(structured("json", Value::from(schema)));
    w.send(&InputMessage::Add(Box::new(j))).await;
    let mut c = request("choice", &[40, 41, 43], 50);
    c.sampling_params.as_mut().unwrap().structured_outputs = Some(structured(
        "choice",
        Value::Array(vec![Value::from("yes"), Value::from("no")]),
    ));
    w.send(&InputMessage::Add(Box::new(c))).await;
    let mut bad = request("bad", &[40, 41, 44], 50);
    bad.sampling_params.as_mut().unwrap().structured_outputs = Some(structured(
        "structural_tag",
        Value::from(r#"{"type": "structural_tag", "format": {"type": "any_text"}}"#),
    ));
    w.send(&InputMessage::Add(Box::new(bad))).await;
    let got = w.collect(&["json", "choice", "bad"]).await;
    let text = |id: &str| -> String {
        let ids = &got.tokens[id];
        assert_eq!(ids.last(), Some(&2), "{id} ends with EOS: {ids:?}");
        ids[..ids.len() - 1]
            .iter()
            .map(|t| char::from((t - 3) as u8))
            .collect()
    };
    let v: serde_json::Value = serde_json::from_str(&text("json")).unwrap();
    assert!((1..=99).contains(&v["n"].as_i64().unwrap()), "{v}");
    assert!(v["tag"] == "a" || v["tag"] == "b", "{v}");
    assert_eq!(got.finished["json"], (FinishReason::Stop, None));
    assert!(["yes", "no"].contains(&text("choice").as_str()));
    assert_eq!(got.finished["bad"].0, FinishReason::Error);
    assert!(got.tokens.get("bad").is_none_or(|t| t.is_empty()));
    let err = got
        .envelopes
        .iter()
        .flat_map(|e| &e.outputs)
        .find_map(|o| (o.request_id == "bad").then(|| o.error.clone()).flatten())
        .expect("an error on the bad request's output");
    assert!(
        err.message.contains("structural_tag") && err.message.contains("any_text"),
        "{}",
        err.message
    );
    w.stop().await.unwrap();
}

/// The embedded tokenizer's text of `ids` (one byte a token, after three specials), the
/// final EOS left out.
fn embedded_text(ids: &[u32]) -> String {
    let ids = ids.strip_suffix(&[2]).unwrap_or(ids);
    let bytes: Vec<u8> = ids.iter().map(|t| (t - 3) as u8).collect();
    String::from_utf8(bytes).unwrap()
}

/// The embedded tokenizer's ids of `text`.
fn embedded_ids(text: &str) -> Vec<u32> {
    text.bytes().map(|b| u32::from(b) + 3).collect()
}

/// The error the engine attached to request `id`'s outputs.
fn error_of(got: &Collected, id: &str) -> sim_protocol::RequestError {
    got.envelopes
        .iter()
        .flat_map(|e| &e.outputs)
        .find_map(|o| (o.request_id == id).then(|| o.error.clone()).flatten())
        .map(|e| *e)
        .unwrap_or_else(|| panic!("no error on {id}'s outputs"))
}

/// Issue 22 H1: a constraint the grammar backend cannot follow (`a{300000}` is past
/// llguidance's lexer limits) answered HTTP 200 with "" and `finish_reason: "stop"`. It
/// finishes with the error finish and the reason; a request beside it runs as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grammar_that_cannot_be_followed_finishes_with_an_error_not_stop() {
    let mut w = Wire::start(args()).await;
    let mut r = request("huge", &[40, 41, 42], 50);
    r.sampling_params.as_mut().unwrap().structured_outputs =
        Some(structured("regex", Value::from("a{300000}")));
    w.send(&InputMessage::Add(Box::new(r))).await;
    w.send(&add("plain", &[40, 41, 43], 8)).await;
    let got = w.collect(&["huge", "plain"]).await;
    assert_eq!(got.finished["huge"].0, FinishReason::Error);
    let err = error_of(&got, "huge");
    // the code the frontends pass to the client with its message
    assert_eq!(err.code, "validation_error");
    assert!(
        err.message.starts_with("structured_output_failed: ")
            && err.message.contains("`regex`")
            && err.message.contains("lexer error"),
        "{}",
        err.message
    );
    assert_eq!(got.finished["plain"].0, FinishReason::Length);
    assert_eq!(got.tokens["plain"].len(), 8);
    w.stop().await.unwrap();
}

/// What vLLM 0.33's hermes tool parser sends for one strict function tool under
/// `tool_choice: auto`: a `triggered_tags` structural tag.
fn strict_tool_tag() -> String {
    let params = serde_json::json!({"type": "object", "properties": {"a": {"type": "string"}},
        "required": ["a"], "additionalProperties": false});
    let tags: Vec<serde_json::Value> = [
        ("<tool_call>\n", "}\n</tool_call>"),
        ("<tool_call>", "}</tool_call>"),
    ]
    .iter()
    .map(|(b, e)| {
        serde_json::json!({"type": "tag", "begin": format!("{b}{{\"name\": \"f\", \"arguments\": "),
            "content": {"type": "json_schema", "json_schema": params}, "end": e})
    })
    .collect();
    serde_json::json!({"type": "structural_tag", "format": {"type": "triggered_tags",
        "triggers": ["<tool_call>"], "tags": tags, "at_least_one": false, "stop_after_first": false}})
    .to_string()
}

/// Issue 22 H6: a strict function tool (the OpenAI Agents SDK's default) was a 500: the
/// engine refused the `triggered_tags` structural tag. Under `--tool-call-rate 1` the
/// answer is a call whose arguments follow the tool's schema; at rate 0 it is text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_strict_tool_under_auto_is_answered_with_a_parsed_call() {
    let prompt =
        embedded_ids("<|im_start|>user\nwhat is f of x?<|im_end|>\n<|im_start|>assistant\n");
    for (rate, id) in [(1.0, "call"), (0.0, "text")] {
        let mut a = args();
        a.tool_call_rate = rate;
        a.tokens = Some(TokenMode::Text);
        let mut w = Wire::start(a).await;
        let mut r = request(id, &prompt, 200);
        r.sampling_params.as_mut().unwrap().structured_outputs =
            Some(structured("structural_tag", Value::from(strict_tool_tag())));
        w.send(&InputMessage::Add(Box::new(r))).await;
        let got = w.collect(&[id]).await;
        let text = embedded_text(&got.tokens[id]);
        if rate > 0.0 {
            assert_eq!(got.finished[id], (FinishReason::Stop, None), "{text}");
            let body = text
                .strip_prefix("<tool_call>")
                .and_then(|b| b.split("</tool_call>").next())
                .unwrap_or_else(|| panic!("not a call: {text}"));
            let call: serde_json::Value =
                serde_json::from_str(body.trim()).unwrap_or_else(|e| panic!("{e}: {text}"));
            assert_eq!(call["name"], "f", "{text}");
            assert!(call["arguments"]["a"].is_string(), "{text}");
            assert_eq!(call["arguments"].as_object().unwrap().len(), 1, "{text}");
        } else {
            assert_ne!(got.finished[id].0, FinishReason::Error, "{text}");
            assert!(!text.contains("<tool_call>"), "{text}");
        }
        w.stop().await.unwrap();
    }
}

/// Issue 22 M4: grammars compiled on the engine thread, so a big one stalled every
/// stream (gaps of 346 ms at a 10 ms ITL). They compile off the step loop, as vLLM's do:
/// while two requests with a 60k-entry enum schema wait for their grammars, a stream
/// keeps its 10 ms pace (gaps between the engine's own emission stamps within 50 ms of
/// it; a compile takes hundreds of milliseconds in a debug build), and each grammar
/// request then answers a valid instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_big_grammar_compiles_while_other_streams_keep_their_pace() {
    let mut a = args();
    a.time_to_first_token = 10.0;
    a.inter_token_latency = 10.0;
    let mut w = Wire::start(a).await;
    let words: Vec<String> = (0..60_000)
        .map(|i| format!("option-{i:06}-{}", (i * 7919) % 100_003))
        .collect();
    let schema = serde_json::json!({"type": "object", "properties": {"pick": {"enum": words}},
        "required": ["pick"]})
    .to_string();
    w.send(&add("stream", &[10, 11], 80)).await;
    let mut got = Collected::default();
    let mut stamps = Vec::new();
    let mut sent = false;
    let ids = ["stream", "g0", "g1"];
    let deadline = Instant::now() + Duration::from_secs(60);
    while ids.iter().any(|id| !got.finished.contains_key(*id)) {
        assert!(Instant::now() < deadline, "unfinished: {:?}", got.finished);
        let env = w.recv().await;
        if env.outputs.iter().any(|o| o.request_id == "stream") {
            stamps.push(env.timestamp);
        }
        got.absorb(env);
        if !sent && stamps.len() == 5 {
            for id in ["g0", "g1"] {
                let mut r = request(id, &[10, 12], 60);
                r.sampling_params.as_mut().unwrap().structured_outputs =
                    Some(structured("json", Value::from(schema.clone())));
                w.send(&InputMessage::Add(Box::new(r))).await;
            }
            sent = true;
        }
    }
    assert_eq!(got.tokens["stream"].len(), 80);
    let gaps: Vec<f64> = stamps.windows(2).map(|p| (p[1] - p[0]) * 1e3).collect();
    let worst = gaps.iter().copied().fold(0.0, f64::max);
    assert!(
        worst < 10.0 + 50.0,
        "the stream stalled while grammars compiled: worst gap {worst:.1} ms at a 10 ms ITL ({gaps:?})"
    );
    for id in ["g0", "g1"] {
        assert_eq!(
            got.finished[id],
            (FinishReason::Stop, None),
            "{id}: {:?}",
            error_of(&got, id)
        );
        let v: serde_json::Value = serde_json::from_str(&embedded_text(&got.tokens[id]))
            .unwrap_or_else(|e| panic!("{id}: {e}"));
        let pick = v["pick"].as_str().unwrap_or_default();
        assert!(words.iter().any(|w| w == pick), "{id}: {v}");
    }
    w.stop().await.unwrap();
}

/// `--runner pooling` at the wire: `get_supported_tasks` says embed, and a pooling request
/// (no sampling parameters) ends after its prefill with a float32 vector and no tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooling_engine_answers_with_vectors() {
    let mut a = args();
    a.runner = vllm_vcr::play::content::pooling::Runner::Pooling;
    a.embedding_dim = 16;
    let mut w = Wire::start(a).await;
    let mut p = request("emb", &[40, 41, 42, 43], 1);
    p.sampling_params = None;
    p.pooling_params = Some(Value::Array(vec![Value::from(true)]));
    w.send(&InputMessage::Add(Box::new(p))).await;
    let got = w.collect(&["emb"]).await;
    assert_eq!(got.finished["emb"].0, FinishReason::Stop);
    assert!(got.tokens.get("emb").is_none_or(|t| t.is_empty()));
    let out = got
        .envelopes
        .iter()
        .flat_map(|e| &e.outputs)
        .find(|o| o.request_id == "emb" && o.pooling_output.is_some())
        .expect("a pooling output");
    let t = out.pooling_output.as_ref().unwrap();
    assert_eq!(t[0], Value::from("float32"));
    assert_eq!(t[1], Value::Array(vec![Value::from(16u64)]));
    let Value::Ext(3, bytes) = &t[2] else {
        panic!("raw tensor bytes, got {t}")
    };
    let v: Vec<f32> = bytes
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let norm: f32 = v.iter().map(|x| x * x).sum();
    assert!((norm - 1.0).abs() < 1e-4, "{norm}");
    w.stop().await.unwrap();
}
