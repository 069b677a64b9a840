//! A request's life on the wire: the handshake, streaming to max_tokens with events and
//! prefill stats, seeds, EOS and stop tokens, length limits, aborts, queueing behind
//! max_num_seqs, paced latency, token chunks, a prompt the KV cache cannot hold, shutdown.

use super::*;

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
    let probe = crate::support::Disturbance::start();
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
    // how much this run's machine stalled a 1 ms sleep widens every bound below
    let stall = probe.worst_ms() / 1e3;
    assert_eq!(times.len(), 4);
    assert!(times[0] >= Duration::from_millis(60), "ttft {:?}", times[0]);
    assert!(
        times[0].as_secs_f64() < 0.160 + stall,
        "ttft {:?} (worst stall {stall} s)",
        times[0]
    );
    // Steps run on an absolute clock: each emission is its deadline plus the loop's
    // wake-up lateness (well under 10 ms even on a loaded 2-core machine).
    for (i, t) in stamps.iter().enumerate() {
        let since_first = t - stamps[0];
        let planned = 0.020 * i as f64;
        assert!(
            (planned - 0.010 - stall..planned + 0.020 + stall).contains(&since_first),
            "engine-stamped step {i} at {since_first} s after the first, planned {planned} s \
             (worst stall {stall} s)"
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

/// An answer the client did not bound (`max_tokens` up to the end of the context, as the
/// frontends fill it in) ends with EOS after its own length, like a model's; a bounded one
/// runs to `max_tokens`, and `--natural-output-len 0` runs to the context's end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unbounded_answer_ends_with_eos_after_its_own_length() {
    let prompt = [10, 11, 12, 13];
    let mut a = args();
    a.max_model_len = 4096;
    a.natural_output_len = 40;
    let mut w = Wire::start(a.clone()).await;
    let ids: Vec<String> = (0..30).map(|i| format!("u{i}")).collect();
    for id in &ids {
        w.send(&add(id, &prompt, 4096 - 4)).await;
    }
    w.send(&add("bounded", &prompt, 300)).await;
    let mut all: Vec<&str> = ids.iter().map(String::as_str).collect();
    all.push("bounded");
    let c = w.collect(&all).await;
    let lens: Vec<usize> = ids.iter().map(|id| c.tokens[id.as_str()].len()).collect();
    for id in &ids {
        assert_eq!(c.finished[id.as_str()], (FinishReason::Stop, None), "{id}");
        assert_eq!(c.tokens[id.as_str()].last(), Some(&2), "{id} ends with EOS");
    }
    let mean = lens.iter().sum::<usize>() as f64 / lens.len() as f64;
    // exponential lengths of mean 40: the mean of 30 is within 20..80 (±3.5 standard
    // errors), and they differ from one another
    assert!((20.0..80.0).contains(&mean), "mean {mean} of {lens:?}");
    assert!(lens.iter().any(|&l| l != lens[0]), "{lens:?}");
    assert_eq!(c.tokens["bounded"].len(), 300);
    assert_eq!(c.finished["bounded"], (FinishReason::Length, None));
    w.stop().await.unwrap();

    a.natural_output_len = 0;
    a.max_model_len = 64;
    let mut w = Wire::start(a).await;
    w.send(&add("off", &prompt, 60)).await;
    let c = w.collect(&["off"]).await;
    assert_eq!(c.tokens["off"].len(), 60);
    assert_eq!(c.finished["off"], (FinishReason::Length, None));
    w.stop().await.unwrap();
}
