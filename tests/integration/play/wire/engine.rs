//! The engine as a frontend's peer: the vLLM line it speaks, utility calls, the prefix-cache
//! reset, pause modes, several API-server clients, several engines in one process, pooling.

use super::*;

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
        w.reset_prefix_cache(13, false).await,
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
        w.reset_prefix_cache(1, false).await,
        Ok(Value::Boolean(false))
    );
    assert_eq!(
        w.reset_prefix_cache(2, true).await,
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disable_log_stats_sends_no_scheduler_stats_and_no_request_events() {
    // as vLLM's engine with log_stats off: the same tokens, prefill stats still there
    let mut a = args();
    a.disable_log_stats = true;
    let mut w = Wire::start(a).await;
    w.send(&add("quiet", &[10, 11, 12], 4)).await;
    let c = w.collect(&["quiet"]).await;
    assert_eq!(c.tokens["quiet"].len(), 4);
    assert_eq!(c.prefill["quiet"].num_prompt_tokens, 3);
    assert!(
        c.envelopes.iter().all(|e| e.scheduler_stats.is_none()),
        "an envelope carried scheduler stats"
    );
    assert!(
        c.events.get("quiet").is_none_or(Vec::is_empty),
        "request events were sent: {:?}",
        c.events
    );
    w.stop().await.unwrap();

    // the default sends both
    let mut w = Wire::start(args()).await;
    w.send(&add("loud", &[10, 11, 12], 4)).await;
    let c = w.collect(&["loud"]).await;
    assert!(c.envelopes.iter().any(|e| e.scheduler_stats.is_some()));
    assert_eq!(
        c.events["loud"],
        vec![EventType::Queued, EventType::Scheduled]
    );
    w.stop().await.unwrap();
}
