//! However a capture starts or ends, the trace is valid and complete: SIGTERM mid-run, the
//! engine killed, ENGINE_CORE_DEAD, the frontend gone (gzip or plain); and a tap that would
//! overwrite a trace or mix hash flags refuses to start.

use super::*;

/// `play` behind the tap: records match what the frontend saw, TTFT within 1 ms of the
/// engine's own timestamps, and SIGTERM mid-run leaves a valid, complete trace.
async fn sigterm_mid_run(trace_name: &str) {
    let tmp = TestDir::new(trace_name);
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let trace = tmp.path(trace_name);
    let steps = tmp.path(&format!("{trace_name}.steps.jsonl"));
    let steps_arg = steps.to_str().unwrap().to_string();
    let mut tap = Tap::start(
        fl.handshake_address(),
        &trace,
        &["--record-tokens", "--step-stats-out", &steps_arg],
    );
    let mut args = play_args(&tap.engine_handshake);
    args.time_to_first_token = 20.0;
    args.inter_token_latency = 5.0;
    let (stop, rx) = watch::channel(false);
    let engine = tokio::spawn(vllm_vcr::play::run(args, rx));
    let accepted = fl.accept_engines(1, WAIT).await.unwrap();
    let id = accepted[0].identity.clone();

    let prompt: Vec<u32> = (3..40).collect();
    let probe = Disturbance::start();
    for (rid, n) in [
        ("a", 4),
        ("b", 6),
        ("c", 8),
        ("long1", 100_000),
        ("long2", 100_000),
    ] {
        fl.send(0, &id, encode_input(LINE, &add(rid, &prompt, n)))
            .await
            .unwrap();
    }
    let seen = collect(&mut fl, &["a", "b", "c"]).await;
    let stall = probe.worst_ms();
    tap.signal(libc::SIGTERM);
    assert!(tap.wait_exit(WAIT).success(), "{}", tap.log_text());
    let _ = stop.send(true);
    let _ = tokio::time::timeout(WAIT, engine).await;

    let (meta, records) = tap_trace(&trace);
    assert_eq!(meta.block_size, Some(16));
    // --host-cpu auto (the default): this host's CPU
    assert_eq!(
        meta.host_cpu.as_deref(),
        sim_trace::host::HostCpu::detect().as_ref()
    );
    assert_eq!(records.len(), 5, "{records:?}");
    // Engine-side first-token and arrival (QUEUED) times, from the frames the frontend got.
    for rid in ["a", "b", "c"] {
        let r = record(&records, rid);
        assert_eq!(r.output_tokens as usize, seen.tokens[rid].len(), "{rid}");
        assert_eq!(
            r.output_token_ids.as_ref(),
            Some(&seen.tokens[rid]),
            "{rid}"
        );
        assert_eq!(r.finish_reason.as_deref(), Some("length"));
        assert!(!r.incomplete);
        assert_eq!(r.prompt_tokens, 37);
        assert_eq!(r.block_hashes.len(), 2);
        assert_eq!(r.itl_ms.len() + 1, seen.messages[rid]);
        let first = seen
            .envelopes
            .iter()
            .find(|e| e.outputs.iter().any(|o| o.request_id == rid))
            .unwrap();
        let queued = first
            .outputs
            .iter()
            .find(|o| o.request_id == rid)
            .and_then(|o| o.events.iter().find(|e| e.kind == EventType::Queued))
            .expect("a QUEUED event")
            .timestamp;
        let engine_ttft = (first.timestamp - queued) * 1000.0;
        let ttft = r.ttft_ms.unwrap();
        assert!(
            (ttft - engine_ttft).abs() < 1.0,
            "{rid}: trace ttft {ttft} ms vs engine {engine_ttft} ms"
        );
        // gaps: 5 ms, or longer where another request's 20 ms prefill step intervened. Steps
        // run on an absolute clock, so a step the loop emitted late is followed by shorter
        // gaps until the schedule is caught up: no token is early. The schedule starts at
        // the first token's own due time, which this test cannot see; allowing that token
        // to have been up to 8 ms late plus the longest stall this run's probe saw (a
        // loaded machine), the k-th gap ends no earlier than 5k - 8 ms - stall after it
        // (1 ms more of slack for the clocks), and no gap is longer than 60 ms + stall. A
        // pacing bug (tokens 2 ms apart, say) still fails within a few tokens.
        let mut since_first = 0.0;
        for (k, gap) in r.itl_ms.iter().enumerate() {
            since_first += gap;
            let never_early = since_first > 5.0 * (k + 1) as f64 - 9.0 - stall;
            assert!(
                never_early && *gap > 0.0 && *gap < 60.0 + stall,
                "{rid}: gaps {:?} (the probe's longest stall {stall:.1} ms)",
                r.itl_ms
            );
        }
        assert_eq!(r.itl_ctx.num_running.len(), r.itl_ms.len());
    }
    // The same prompt: later requests hit the prefix cache and share block hashes.
    assert_eq!(
        record(&records, "a").block_hashes,
        record(&records, "c").block_hashes
    );
    for rid in ["long1", "long2"] {
        let r = record(&records, rid);
        assert!(r.incomplete, "{rid}");
        assert_eq!(r.finish_reason, None);
        assert_eq!(r.abort_reason.as_deref(), Some("capture stopped"));
        assert!(r.output_tokens > 0);
    }
    // One step line per engine step, on the trace's clock.
    let text = std::fs::read_to_string(&steps).unwrap();
    let n = text.lines().count();
    assert!(n > 5, "{n} step lines");
    let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert!(first["ts_ms"].as_f64().unwrap() >= 0.0);
    assert!(first["num_running_reqs"].as_u64().unwrap() >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_run_leaves_a_valid_plain_trace() {
    sigterm_mid_run("sigterm.jsonl").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_run_leaves_a_valid_gzip_trace() {
    sigterm_mid_run("sigterm.jsonl.gz").await;
}

/// The engine process is killed mid-run: the tap notices, closes the trace (finished
/// requests kept, in-flight ones incomplete) and exits non-zero.
async fn engine_killed(trace_name: &str) {
    let tmp = TestDir::new(trace_name);
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let trace = tmp.path(trace_name);
    let mut tap = Tap::start(fl.handshake_address(), &trace, &["--host-cpu", "none"]);
    let mut engine = vcr_command()
        .args(["play", "--handshake-address", &tap.engine_handshake])
        .args(["--inter-token-latency", "5"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let accepted = fl.accept_engines(1, WAIT).await.unwrap();
    let id = accepted[0].identity.clone();
    for (rid, n) in [("done1", 3), ("done2", 5), ("cut", 100_000)] {
        fl.send(0, &id, encode_input(LINE, &add(rid, &[5, 6, 7], n)))
            .await
            .unwrap();
    }
    collect(&mut fl, &["done1", "done2"]).await;
    engine.kill().unwrap();
    engine.wait().unwrap();
    let status = tap.wait_exit(WAIT);
    assert_eq!(status.code(), Some(1), "{}", tap.log_text());
    assert!(tap.log_text().contains("engine disconnected"));
    // the frontend is told, as a dying vLLM engine tells it: its clients do not hang
    let mut told = false;
    while let Ok(Ok(frames)) = tokio::time::timeout(WAIT, fl.recv_output(0)).await {
        if frames == vec![Bytes::from_static(ENGINE_CORE_DEAD)] {
            told = true;
            break;
        }
    }
    assert!(
        told,
        "the frontend never got ENGINE_CORE_DEAD:\n{}",
        tap.log_text()
    );
    let (meta, records) = tap_trace(&tap.trace);
    assert_eq!(meta.host_cpu, None, "--host-cpu none");
    assert_eq!(records.len(), 3);
    for rid in ["done1", "done2"] {
        assert!(!record(&records, rid).incomplete);
    }
    let cut = record(&records, "cut");
    assert!(cut.incomplete);
    assert_eq!(cut.abort_reason.as_deref(), Some("engine disconnected"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_killed_mid_run_leaves_a_valid_gzip_trace() {
    engine_killed("killed.jsonl.gz").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_killed_mid_run_leaves_a_valid_plain_trace() {
    engine_killed("killed.jsonl").await;
}

/// ENGINE_CORE_DEAD reaches the frontend unchanged, and the trace is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_core_dead_is_relayed_and_closes_the_trace() {
    let tmp = TestDir::new("engine_core_dead_is_relayed_and_closes_the_trace");
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let trace = tmp.path("dead.jsonl.gz");
    let mut tap = Tap::start(fl.handshake_address(), &trace, &[]);
    let (accepted, mut eng) = hand_driven_engine(&mut fl, &tap.engine_handshake).await;
    fl.send(
        0,
        &accepted[0].identity,
        encode_input(LINE, &add("x", &[1, 2], 9)),
    )
    .await
    .unwrap();
    use zeromq::{SocketRecv, SocketSend, ZmqMessage};
    let _ = tokio::time::timeout(WAIT, eng.inputs[0].recv())
        .await
        .unwrap();
    eng.outputs[0]
        .send(ZmqMessage::from(Bytes::from_static(ENGINE_CORE_DEAD)))
        .await
        .unwrap();
    let got = tokio::time::timeout(WAIT, fl.recv_output(0))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got, vec![Bytes::from_static(ENGINE_CORE_DEAD)]);
    let status = tap.wait_exit(WAIT);
    assert_eq!(status.code(), Some(1), "{}", tap.log_text());
    let (_, records) = tap_trace(&tap.trace);
    let x = record(&records, "x");
    assert!(x.incomplete);
    assert_eq!(x.abort_reason.as_deref(), Some("engine core dead"));
    drop(eng);
}

/// The frontend goes away: the capture ends normally (exit 0) with a valid trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frontend_exit_ends_the_capture_cleanly() {
    let tmp = TestDir::new("frontend_exit_ends_the_capture_cleanly");
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let trace = tmp.path("frontend-gone.jsonl.gz");
    let mut tap = Tap::start(fl.handshake_address(), &trace, &[]);
    let engine = PlayBehindTap::join(&mut fl, &tap).await;
    engine.send(&mut fl, "ok").await;
    collect(&mut fl, &["ok"]).await;
    drop(fl);
    let status = tap.wait_exit(WAIT);
    assert!(status.success(), "{}", tap.log_text());
    let (_, records) = tap_trace(&tap.trace);
    assert_eq!(records.len(), 1);
    assert!(!records[0].incomplete);
    engine.stop().await;
}

/// Refuses to overwrite a capture, and explains a partial config-hash request.
#[test]
fn refuses_to_overwrite_and_checks_hash_flags() {
    let tmp = TestDir::new("refuses_to_overwrite_and_checks_hash_flags");
    let trace = tmp.path("exists.jsonl");
    std::fs::write(&trace, b"{\"meta\":{}}\n").unwrap();
    let out = vcr()
        .args(["record", "--frontend-handshake", "tcp://127.0.0.1:1"])
        .args(["--engine-handshake", "tcp://127.0.0.1:0", "--trace-out"])
        .arg(&trace)
        .output();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("already exists") && err.contains("--force"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(&trace).unwrap(),
        b"{\"meta\":{}}\n",
        "untouched"
    );

    let out = vcr()
        .args(["record", "--frontend-handshake", "tcp://127.0.0.1:1"])
        .args(["--engine-handshake", "tcp://127.0.0.1:0", "--trace-out"])
        .arg(tmp.path("hash.jsonl"))
        .args(["--engine-config", "model=x"])
        .output();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--gpu") && err.contains("--vllm-version"),
        "{err}"
    );

    for (bad, says) in [
        (&["--note", "no-equals-sign"][..], "KEY=VALUE"),
        (&["--host-cpu", "/nonexistent/cpuinfo"][..], "--host-cpu"),
    ] {
        let out = vcr()
            .args(["record", "--frontend-handshake", "tcp://127.0.0.1:1"])
            .args(["--engine-handshake", "tcp://127.0.0.1:0", "--trace-out"])
            .arg(tmp.path("bad-flag.jsonl"))
            .args(bad)
            .output();
        assert_eq!(out.status.code(), Some(1), "{bad:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{bad:?}: {err}");
    }
}
