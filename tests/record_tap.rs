//! `vllm-vcr record` on real sockets: a Rust stand-in frontend (`FrontendListener`), the
//! tap binary, and an engine (`play`, or a hand-driven engine for exact bytes).
//!
//! What a user of the tap relies on: every frame crosses unchanged (INIT's data addresses
//! excepted), the trace's records match what the frontend saw, and the trace is valid and
//! complete however the capture ends (SIGTERM, engine killed, ENGINE_CORE_DEAD, frontend
//! gone), gzip or plain.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use sim_protocol::decode::{DecodedOutputs, decode_input, decode_outputs_for};
use sim_protocol::encode::{encode_input, encode_outputs};
use sim_protocol::transport::{
    ConnectOptions, EngineSockets, FrontendListener, connect_to_frontend,
};
use sim_protocol::{
    ENGINE_CORE_DEAD, EngineCoreEvent, EngineCoreOutput, EngineCoreOutputs, EventType,
    FinishReason, InputMessage, ReadyResponse, VllmLine,
};
use sim_trace::trace::{TraceItem, TraceMeta, TraceReader, TraceRecord};
use support::{Collected, TestDir, add, vcr, vcr_command};
use tokio::sync::watch;
use vllm_vcr::child::free_ports;

const LINE: VllmLine = VllmLine::new(0, 33);
const WAIT: Duration = Duration::from_secs(20);

/// One processor of a Sapphire Rapids host (flags trimmed to the x86 basics and the vector
/// extensions), for `--host-cpu FILE`.
const OTHER_HOST_CPUINFO: &str = "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n\
model\t\t: 143\nmodel name\t: Intel(R) Xeon(R) Platinum 8488C\nstepping\t: 8\n\
flags\t\t: fpu sse sse2 lm avx f16c fma avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni \
avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8\n\n";

struct Tap {
    child: Child,
    engine_handshake: String,
    trace: PathBuf,
    log: PathBuf,
    /// Where the log of a tap writing to a device goes.
    _log_dir: Option<TestDir>,
}

impl Tap {
    fn start(frontend_handshake: &str, trace: &Path, extra: &[&str]) -> Tap {
        let port = free_ports(1).unwrap()[0];
        let engine_handshake = format!("tcp://127.0.0.1:{port}");
        let log_dir = trace
            .starts_with("/dev")
            .then(|| TestDir::new("record-dev-trace"));
        let log = match &log_dir {
            Some(dir) => dir.path("dev-trace.log"),
            None => trace.with_extension("log"),
        };
        let child = vcr_command()
            .env("NO_COLOR", "1")
            .args(["record", "--frontend-handshake", frontend_handshake])
            .args(["--engine-handshake", &engine_handshake])
            .arg("--trace-out")
            .arg(trace)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Tap {
            child,
            engine_handshake,
            trace: trace.to_path_buf(),
            log,
            _log_dir: log_dir,
        }
    }

    fn signal(&self, sig: i32) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }

    fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "the tap did not exit within {within:?}; log:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Tap {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The whole trace: meta and records; fails the test on any error (truncation included).
fn read_trace(path: &Path) -> (TraceMeta, Vec<TraceRecord>) {
    let mut meta = None;
    let mut records = Vec::new();
    for item in TraceReader::open(path).unwrap() {
        match item.unwrap_or_else(|e| panic!("reading {}: {e}", path.display())) {
            TraceItem::Meta(m) => meta = Some(m),
            TraceItem::Record(r) => records.push(r),
        }
    }
    (meta.expect("a meta line"), records)
}

fn record<'a>(records: &'a [TraceRecord], id: &str) -> &'a TraceRecord {
    records
        .iter()
        .find(|r| r.request_id.as_deref() == Some(id))
        .unwrap_or_else(|| panic!("no record for {id}: {records:?}"))
}

fn play_args(handshake: &str) -> vllm_vcr::play::PlayArgs {
    let mut a = vllm_vcr::play::PlayArgs::defaults();
    a.handshake_address = handshake.to_string();
    a
}

/// Collect outputs on client 0 until every id finished.
async fn collect(fl: &mut FrontendListener, ids: &[&str]) -> Collected {
    let mut c = Collected::default();
    let deadline = Instant::now() + WAIT;
    while ids.iter().any(|id| !c.finished.contains_key(*id)) {
        assert!(Instant::now() < deadline, "not finished: {:?}", c.finished);
        let frames = tokio::time::timeout(WAIT, fl.recv_output(0))
            .await
            .expect("no output in time")
            .unwrap();
        match decode_outputs_for(LINE, &frames).unwrap() {
            DecodedOutputs::Outputs(o) => c.absorb(o),
            DecodedOutputs::Dead => panic!("ENGINE_CORE_DEAD"),
        }
    }
    c
}

/// A hand-driven engine: every byte it sends and receives is the test's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_frame_crosses_unchanged_in_both_directions() {
    let tmp = TestDir::new("every_frame_crosses_unchanged_in_both_directions");
    let mut fl = FrontendListener::bind("127.0.0.1", 2).await.unwrap();
    let trace = tmp.path("bytes.jsonl");
    // the engine host's CPU, from a copy of its /proc/cpuinfo
    let cpuinfo = tmp.path("bytes.cpuinfo");
    std::fs::write(&cpuinfo, OTHER_HOST_CPUINFO).unwrap();
    let mut tap = Tap::start(
        fl.handshake_address(),
        &trace,
        &[
            "--gpu",
            "cpu",
            "--vllm-version",
            "v0.33.0",
            "--engine-config",
            "model=tiny",
            "--host-cpu",
            cpuinfo.to_str().unwrap(),
            "--note",
            "rig=tcmalloc; engine on CPU 1",
            "--note",
            "operator=ci",
        ],
    );

    let ready = ReadyResponse {
        vllm_version: "0.33.0".into(),
        block_size: 4,
        max_num_seqs: 7,
        instance_id: "hand-driven".into(),
        ..Default::default()
    };
    let hs = tap.engine_handshake.clone();
    let ready2 = ready.clone();
    let engine = tokio::spawn(async move {
        connect_to_frontend(&hs, 0, &ready2, &ConnectOptions::default())
            .await
            .unwrap()
    });
    let accepted = fl.accept_engines(1, WAIT).await.unwrap();
    let mut eng = engine.await.unwrap();

    // The engine was told the tap's addresses, not the frontend's; nothing else differs.
    assert_eq!(eng.init.inputs.len(), 2);
    for (tap_addr, fe_addr) in eng.init.inputs.iter().zip(fl.input_addresses()) {
        assert_ne!(tap_addr, fe_addr);
    }
    assert_eq!(eng.init.coordinator_input, None);
    // The frontend got the engine's own identity, HELLO and ready response, byte for byte,
    // on both clients.
    assert_eq!(accepted[0].identity.as_ref(), &[0, 0]);
    assert!(!accepted[0].hello.local && accepted[0].hello.headless);
    let mut expected_ready = ready.clone();
    expected_ready.dp_stats_address = eng.init.frontend_stats_publish_address.clone();
    let expected_ready = Bytes::from(expected_ready.encode());
    assert_eq!(accepted[0].ready_payloads, vec![expected_ready.clone(); 2]);

    // Frontend → engine, on each client: a real ADD, and arbitrary multi-frame bytes.
    let id = accepted[0].identity.clone();
    for client in 0..2 {
        let add_frames = encode_input(LINE, &add(&format!("r{client}"), &[1, 2, 3, 4, 5], 3));
        let odd = vec![
            Bytes::from_static(&[0x03]),
            Bytes::from_static(b"\xc1not msgpack"),
            Bytes::from(vec![0u8; 70_000]),
        ];
        for frames in [add_frames, odd] {
            fl.send(client, &id, frames.clone()).await.unwrap();
            let got = tokio::time::timeout(WAIT, eng.inputs[client].recv())
                .await
                .unwrap()
                .unwrap()
                .into_vec();
            assert_eq!(got, frames, "client {client}");
        }
    }
    assert!(matches!(
        decode_input(&encode_input(LINE, &add("x", &[1], 1))).unwrap(),
        InputMessage::Add(_)
    ));

    // Engine → frontend: outputs finishing r0 (with engine-side timestamps and events),
    // then raw bytes with an aux frame.
    use zeromq::{SocketRecv, SocketSend, ZmqMessage};
    let t0 = vllm_vcr::play::engine::timer::now_monotonic();
    let out =
        |ts: f64, ids: Vec<u32>, finish: Option<FinishReason>, first: bool| EngineCoreOutputs {
            timestamp: ts,
            outputs: vec![EngineCoreOutput {
                request_id: "r0".into(),
                new_token_ids: ids.into(),
                finish_reason: finish,
                events: if first {
                    vec![EngineCoreEvent {
                        kind: EventType::Queued,
                        timestamp: t0,
                    }]
                } else {
                    vec![]
                },
                ..Default::default()
            }],
            ..Default::default()
        };
    let sends = vec![
        out(t0 + 0.010, vec![7], None, true),
        out(t0 + 0.015, vec![8, 9], Some(FinishReason::Length), false),
    ];
    for env in sends {
        let frames = encode_outputs(LINE, &env).unwrap();
        eng.outputs[0]
            .send(ZmqMessage::try_from(frames.clone()).unwrap())
            .await
            .unwrap();
        let got = tokio::time::timeout(WAIT, fl.recv_output(0))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, frames);
    }
    let raw = vec![
        Bytes::from_static(b"\x93\x00\x90\xc0"),
        Bytes::from(vec![9u8; 5000]),
    ];
    eng.outputs[1]
        .send(ZmqMessage::try_from(raw.clone()).unwrap())
        .await
        .unwrap();
    let got = tokio::time::timeout(WAIT, fl.recv_output(1))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got, raw);

    tap.signal(libc::SIGTERM);
    assert!(tap.wait_exit(WAIT).success(), "{}", tap.log_text());
    let (meta, records) = read_trace(&trace);
    assert_eq!(meta.gpu.as_deref(), Some("cpu"));
    let cpu = sim_trace::host::parse_cpuinfo(OTHER_HOST_CPUINFO).unwrap();
    assert_eq!(meta.host_cpu.as_deref(), Some(&cpu));
    assert_eq!(cpu.model, "Intel(R) Xeon(R) Platinum 8488C");
    assert_eq!(
        meta.notes.get("rig").map(String::as_str),
        Some("tcmalloc; engine on CPU 1")
    );
    assert_eq!(meta.notes.get("operator").map(String::as_str), Some("ci"));
    let hash = sim_trace::config_hash::ConfigFingerprint::new("cpu", "v0.33.0", "model=tiny")
        .with_host_cpu(Some(&cpu))
        .hash();
    assert_eq!(meta.config_hash.as_deref(), Some(hash.as_str()));
    assert_eq!(meta.vllm_version.as_deref(), Some("0.33.0"));
    assert_eq!(meta.block_size, Some(4));
    assert_eq!(meta.max_num_seqs, Some(7));
    let hex: String = expected_ready.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(meta.ready_response_hex.as_deref(), Some(hex.as_str()));
    let r0 = record(&records, "r0");
    assert_eq!(r0.output_tokens, 3);
    assert_eq!(r0.finish_reason.as_deref(), Some("length"));
    assert!(!r0.incomplete);
    assert_eq!(r0.itl_tokens, vec![2], "one 2-token chunk after the first");
    assert_eq!(r0.itl_ms.len(), 1);
    assert!((r0.itl_ms[0] - 5.0).abs() < 0.01, "{:?}", r0.itl_ms);
    // arrival = when the tap relayed the ADD, just before t0 here; first token at t0+10ms
    let ttft = r0.ttft_ms.unwrap();
    assert!(ttft > 9.0 && ttft < 1000.0, "{ttft}");
    assert_eq!(r0.prompt_tokens, 5);
    assert_eq!(r0.block_hashes.len(), 1, "one full block of 4 tokens");
    // r1 never finished: written as incomplete when the capture stopped
    let r1 = record(&records, "r1");
    assert!(r1.incomplete);
    assert_eq!(r1.abort_reason.as_deref(), Some("capture stopped"));
    drop(eng);
}

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
    tap.signal(libc::SIGTERM);
    assert!(tap.wait_exit(WAIT).success(), "{}", tap.log_text());
    let _ = stop.send(true);
    let _ = tokio::time::timeout(WAIT, engine).await;

    let (meta, records) = read_trace(&trace);
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
        // to have been up to 8 ms late (a loaded machine), the k-th gap ends no earlier than
        // 5k - 8 ms after it (1 ms more of slack for the clocks). A pacing bug (tokens 2 ms
        // apart, say) still fails within a few tokens.
        let mut since_first = 0.0;
        for (k, gap) in r.itl_ms.iter().enumerate() {
            since_first += gap;
            let never_early = since_first > 5.0 * (k + 1) as f64 - 9.0;
            assert!(
                never_early && *gap > 0.0 && *gap < 60.0,
                "{rid}: gaps {:?}",
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
    let (meta, records) = read_trace(&tap.trace);
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

/// An engine driven by hand (its sockets in the test's hands) joined through the tap at
/// `engine_handshake`: the frontend's view of it, and its sockets.
async fn hand_driven_engine(
    fl: &mut FrontendListener,
    engine_handshake: &str,
) -> (Vec<sim_protocol::transport::AcceptedEngine>, EngineSockets) {
    let hs = engine_handshake.to_string();
    let engine = tokio::spawn(async move {
        connect_to_frontend(
            &hs,
            0,
            &ReadyResponse::default(),
            &ConnectOptions::default(),
        )
        .await
        .unwrap()
    });
    let accepted = fl.accept_engines(1, WAIT).await.unwrap();
    (accepted, engine.await.unwrap())
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
    let (_, records) = read_trace(&tap.trace);
    let x = record(&records, "x");
    assert!(x.incomplete);
    assert_eq!(x.abort_reason.as_deref(), Some("engine core dead"));
    drop(eng);
}

/// A stranger on the tap's engine-handshake port declaring a 2^62-byte frame is dropped:
/// the tap lives on, and an engine that joins afterwards is relayed and recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_2_pow_62_frame_on_the_handshake_port_drops_only_that_peer() {
    let tmp = TestDir::new("a_2_pow_62_frame_on_the_handshake_port_drops_only_that_peer");
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let trace = tmp.path("hostile-handshake.jsonl");
    let mut tap = Tap::start(fl.handshake_address(), &trace, &[]);
    assert!(
        support::send_a_2_pow_62_frame_header(&tap.engine_handshake, "DEALER").await,
        "the tap closes the stranger's connection: {}",
        tap.log_text()
    );
    assert!(
        tap.child.try_wait().unwrap().is_none(),
        "the tap is alive: {}",
        tap.log_text()
    );
    let (stop, rx) = watch::channel(false);
    let engine = tokio::spawn(vllm_vcr::play::run(play_args(&tap.engine_handshake), rx));
    let accepted = fl.accept_engines(1, WAIT).await.unwrap();
    fl.send(
        0,
        &accepted[0].identity,
        encode_input(LINE, &add("after", &[1, 2], 4)),
    )
    .await
    .unwrap();
    collect(&mut fl, &["after"]).await;
    drop(fl);
    let status = tap.wait_exit(WAIT);
    assert!(status.success(), "{}", tap.log_text());
    let (_, records) = read_trace(&tap.trace);
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].output_tokens, 4);
    let _ = stop.send(true);
    let _ = tokio::time::timeout(WAIT, engine).await;
}

/// A stranger connects to the tap's output port as a PUSH and sends the start of a frame
/// declaring 2^40 bytes: the tap drops that connection, nothing of it reaches the
/// frontend, and the engine's outputs keep arriving whole (before the fix the tap spliced
/// the partial message into the shared stream and the frontend failed every request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_2_pow_40_message_on_the_output_port_never_reaches_the_frontend() {
    let tmp =
        TestDir::new("a_partial_2_pow_40_message_on_the_output_port_never_reaches_the_frontend");
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use zeromq::{SocketRecv, SocketSend, ZmqMessage};
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let trace = tmp.path("hostile-output.jsonl");
    let mut tap = Tap::start(fl.handshake_address(), &trace, &[]);
    let (accepted, mut eng) = hand_driven_engine(&mut fl, &tap.engine_handshake).await;
    // the tap's output port, as the engine learned it from the rewritten INIT
    let tap_output = eng.init.outputs[0].trim_start_matches("tcp://").to_string();
    let mut stranger = tokio::net::TcpStream::connect(&tap_output).await.unwrap();
    sim_protocol::zmtp::handshake(&mut stranger, "PUSH", None, &["PULL"])
        .await
        .unwrap();
    let mut partial = vec![sim_protocol::zmtp::FLAG_LONG];
    partial.extend_from_slice(&(1u64 << 40).to_be_bytes());
    partial.extend_from_slice(&[7u8; 4096]);
    let _ = stranger.write_all(&partial).await;
    let mut sink = [0u8; 64];
    let closed = tokio::time::timeout(WAIT, async {
        loop {
            match stranger.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "the tap drops the stranger: {}",
        tap.log_text()
    );

    // a request and its answer cross the tap as before
    fl.send(
        0,
        &accepted[0].identity,
        encode_input(LINE, &add("after", &[1, 2], 1)),
    )
    .await
    .unwrap();
    let _ = tokio::time::timeout(WAIT, eng.inputs[0].recv())
        .await
        .unwrap()
        .unwrap();
    let out = EngineCoreOutputs {
        outputs: vec![EngineCoreOutput {
            request_id: "after".into(),
            new_token_ids: [5].into_iter().collect(),
            finish_reason: Some(FinishReason::Length),
            ..Default::default()
        }],
        ..Default::default()
    };
    let frames = encode_outputs(LINE, &out).unwrap();
    eng.outputs[0]
        .send(ZmqMessage::try_from(frames).unwrap())
        .await
        .unwrap();
    let got = tokio::time::timeout(WAIT, fl.recv_output(0))
        .await
        .expect("the answer reaches the frontend")
        .unwrap();
    let Ok(DecodedOutputs::Outputs(o)) = decode_outputs_for(LINE, &got) else {
        panic!("the frontend got a message it cannot decode: {got:?}");
    };
    assert_eq!(o.outputs[0].request_id.as_str(), "after");
    assert!(
        tap.child.try_wait().unwrap().is_none(),
        "the tap is alive: {}",
        tap.log_text()
    );
    assert!(
        tap.log_text().contains("--max-frame-size"),
        "the drop is logged with the limit: {}",
        tap.log_text()
    );
    drop(eng);
}

/// Each record says when the tap relayed its request (`sent_ms`) beside when the engine
/// queued it (`arrival_ms`, never earlier).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_record_says_when_its_request_was_sent() {
    let tmp = TestDir::new("each_record_says_when_its_request_was_sent");
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let trace = tmp.path("sent.jsonl");
    let mut tap = Tap::start(fl.handshake_address(), &trace, &[]);
    let (stop, rx) = watch::channel(false);
    let engine = tokio::spawn(vllm_vcr::play::run(play_args(&tap.engine_handshake), rx));
    let accepted = fl.accept_engines(1, WAIT).await.unwrap();
    for id in ["s1", "s2"] {
        fl.send(
            0,
            &accepted[0].identity,
            encode_input(LINE, &add(id, &[1, 2], 4)),
        )
        .await
        .unwrap();
    }
    collect(&mut fl, &["s1", "s2"]).await;
    drop(fl);
    assert!(tap.wait_exit(WAIT).success(), "{}", tap.log_text());
    let (_, records) = read_trace(&tap.trace);
    assert_eq!(records.len(), 2);
    for r in &records {
        let (sent, arrival) = (r.sent_ms.unwrap(), r.arrival_ms.unwrap());
        assert!(
            sent <= arrival && arrival - sent < 1000.0,
            "sent {sent} ms, queued {arrival} ms"
        );
    }
    let _ = stop.send(true);
    let _ = tokio::time::timeout(WAIT, engine).await;
}

/// The frontend goes away: the capture ends normally (exit 0) with a valid trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frontend_exit_ends_the_capture_cleanly() {
    let tmp = TestDir::new("frontend_exit_ends_the_capture_cleanly");
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let trace = tmp.path("frontend-gone.jsonl.gz");
    let mut tap = Tap::start(fl.handshake_address(), &trace, &[]);
    let (stop, rx) = watch::channel(false);
    let engine = tokio::spawn(vllm_vcr::play::run(play_args(&tap.engine_handshake), rx));
    let accepted = fl.accept_engines(1, WAIT).await.unwrap();
    fl.send(
        0,
        &accepted[0].identity,
        encode_input(LINE, &add("ok", &[1, 2], 4)),
    )
    .await
    .unwrap();
    collect(&mut fl, &["ok"]).await;
    drop(fl);
    let status = tap.wait_exit(WAIT);
    assert!(status.success(), "{}", tap.log_text());
    let (_, records) = read_trace(&tap.trace);
    assert_eq!(records.len(), 1);
    assert!(!records[0].incomplete);
    let _ = stop.send(true);
    let _ = tokio::time::timeout(WAIT, engine).await;
}

/// The engine starts first, then the tap, then the frontend; two DP engines and two
/// frontend clients are relayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_first_with_two_engines_and_two_clients() {
    let tmp = TestDir::new("engines_first_with_two_engines_and_two_clients");
    let ports = free_ports(2).unwrap();
    let fe_hs = format!("tcp://127.0.0.1:{}", ports[0]);
    let trace = tmp.path("dp.jsonl");
    let mut tap = Tap::start(&fe_hs, &trace, &[]);
    let mut args = play_args(&tap.engine_handshake);
    args.engine_count = 2;
    args.inter_token_latency = 2.0;
    let (stop, rx) = watch::channel(false);
    let engine = tokio::spawn(vllm_vcr::play::run(args, rx));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut fl = FrontendListener::bind_at(&fe_hs, 2).await.unwrap();
    let accepted = fl.accept_engines(2, WAIT).await.unwrap();
    assert_eq!(accepted.len(), 2);
    let mut ids = Vec::new();
    for (e, eng) in accepted.iter().enumerate() {
        for client in 0..2u32 {
            let rid = format!("e{e}c{client}");
            let msg = support::with_client(add(&rid, &[1, 2, 3], 5), client);
            fl.send(client as usize, &eng.identity, encode_input(LINE, &msg))
                .await
                .unwrap();
            ids.push((client, rid));
        }
    }
    for client in 0..2usize {
        let want: Vec<&str> = ids
            .iter()
            .filter(|(c, _)| *c as usize == client)
            .map(|(_, r)| r.as_str())
            .collect();
        let mut done = std::collections::BTreeSet::new();
        let deadline = Instant::now() + WAIT;
        while done.len() < want.len() {
            assert!(Instant::now() < deadline);
            let frames = tokio::time::timeout(WAIT, fl.recv_output(client))
                .await
                .unwrap()
                .unwrap();
            if let Ok(DecodedOutputs::Outputs(o)) = decode_outputs_for(LINE, &frames) {
                for out in o.outputs {
                    if out.finish_reason.is_some() {
                        done.insert(out.request_id);
                    }
                }
            }
        }
    }
    tap.signal(libc::SIGINT);
    assert!(tap.wait_exit(WAIT).success(), "{}", tap.log_text());
    let (_, records) = read_trace(&trace);
    assert_eq!(records.len(), 4, "{records:?}");
    assert!(
        records
            .iter()
            .all(|r| !r.incomplete && r.output_tokens == 5)
    );
    let _ = stop.send(true);
    let _ = tokio::time::timeout(WAIT, engine).await;
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

/// A frame over `--max-frame-size` crosses the tap unchanged but is not decoded for the
/// trace (it once took the tap's observer to gigabytes); the capture goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_frame_is_relayed_but_not_decoded() {
    let tmp = TestDir::new("an_oversized_frame_is_relayed_but_not_decoded");
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let trace = tmp.path("oversized.jsonl");
    let mut tap = Tap::start(fl.handshake_address(), &trace, &["--max-frame-size", "1"]);
    let mut engine = vcr_command()
        .args(["play", "--handshake-address", &tap.engine_handshake])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let accepted = fl.accept_engines(1, WAIT).await.unwrap();
    let id = accepted[0].identity.clone();
    // 600k ids: a 1.7 MiB frame; the engine refuses it (longer than its context)
    let long: Vec<u32> = (0..600_000u32).map(|i| 1000 + i % 1000).collect();
    fl.send(0, &id, encode_input(LINE, &add("big", &long, 3)))
        .await
        .unwrap();
    fl.send(0, &id, encode_input(LINE, &add("small", &[5, 6, 7], 3)))
        .await
        .unwrap();
    let c = collect(&mut fl, &["big", "small"]).await;
    assert_eq!(
        c.finished["big"].0,
        FinishReason::Error,
        "relayed to the engine"
    );
    assert_eq!(c.tokens["small"].len(), 3);
    tap.signal(libc::SIGINT);
    let status = tap.wait_exit(WAIT);
    assert!(status.success(), "{}", tap.log_text());
    assert!(
        tap.log_text().contains("--max-frame-size"),
        "{}",
        tap.log_text()
    );
    let (_, records) = read_trace(&tap.trace);
    assert_eq!(
        records.len(),
        1,
        "only the decodable request is in the trace"
    );
    assert!(!record(&records, "small").incomplete);
    let _ = engine.kill();
    let _ = engine.wait();
}

/// A full disk (`/dev/full`: every write fails with ENOSPC): the tap keeps relaying, says
/// so once, and at exit reports how many records could not be written, naming the trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_keeps_the_relay_going_and_counts_what_was_lost() {
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let full = Path::new("/dev/full");
    let mut tap = Tap::start(fl.handshake_address(), full, &["--force"]);
    let mut engine = vcr_command()
        .args(["play", "--handshake-address", &tap.engine_handshake])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let accepted = fl.accept_engines(1, WAIT).await.unwrap();
    let id = accepted[0].identity.clone();
    let ids: Vec<String> = (0..20).map(|i| format!("r{i}")).collect();
    for rid in &ids {
        fl.send(0, &id, encode_input(LINE, &add(rid, &[5, 6, 7], 4)))
            .await
            .unwrap();
    }
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let c = collect(&mut fl, &refs).await;
    assert_eq!(
        c.finished.len(),
        20,
        "every request was relayed and answered"
    );
    tap.signal(libc::SIGINT);
    let status = tap.wait_exit(WAIT);
    let log = tap.log_text();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("writing the trace /dev/full failed"), "{log}");
    assert_eq!(
        log.matches("writing the trace /dev/full failed").count(),
        1,
        "said once: {log}"
    );
    assert!(log.contains("could NOT be written"), "{log}");
    assert!(
        log.contains("20 request records could not be written"),
        "{log}"
    );
    let _ = engine.kill();
    let _ = engine.wait();
}

/// A message from engine `rank`, number `i`: three frames whose sizes cross the 255-byte
/// short/long boundary and reach hundreds of KiB (many TCP reads), with bytes that depend
/// on both, so an altered, dropped, reordered or spliced frame shows.
fn wire_message(rank: u8, i: u32) -> Vec<Bytes> {
    let sizes = [10usize, 255, 256, 4_000, 70_000, 300_000];
    let n = sizes[i as usize % sizes.len()];
    let body: Vec<u8> = (0..n)
        .map(|k| {
            (k as u32)
                .wrapping_mul(31)
                .wrapping_add(i * 7 + u32::from(rank)) as u8
        })
        .collect();
    vec![
        Bytes::from(format!("engine {rank} message {i}")),
        Bytes::from(body),
        Bytes::from(vec![rank; (i % 3) as usize]),
    ]
}

/// Two DP engines send multi-frame messages into the same output stream at once, through
/// the tap: the frontend must receive every message whole and unaltered, each engine's in
/// order, never two engines' frames interleaved. And the frontend's messages reach each
/// engine byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp_outputs_merge_whole_and_unaltered() {
    let tmp = TestDir::new("dp_outputs_merge_whole_and_unaltered");
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let trace = tmp.path("wire.jsonl");
    let mut tap = Tap::start(fl.handshake_address(), &trace, &[]);
    let ready = ReadyResponse {
        vllm_version: "0.33.0".into(),
        ..Default::default()
    };
    let mut engines = Vec::new();
    for rank in 0..2u16 {
        let hs = tap.engine_handshake.clone();
        let ready = ready.clone();
        engines.push(tokio::spawn(async move {
            connect_to_frontend(&hs, rank, &ready, &ConnectOptions::default())
                .await
                .unwrap()
        }));
    }
    let accepted = fl.accept_engines(2, WAIT).await.unwrap();
    let mut socks = Vec::new();
    for e in engines {
        socks.push(e.await.unwrap());
    }
    // frontend → each engine, byte for byte
    for (rank, a) in accepted.iter().enumerate() {
        let sent = wire_message(9, rank as u32 + 4);
        fl.send(0, &a.identity, sent.clone()).await.unwrap();
        let rank = sim_protocol::transport::identity_rank(&a.identity).unwrap() as usize;
        let got = tokio::time::timeout(WAIT, zeromq::SocketRecv::recv(&mut socks[rank].inputs[0]))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got.into_vec(), sent);
    }
    // both engines → the one output stream, concurrently
    const N: u32 = 120;
    let mut senders = Vec::new();
    for (rank, mut s) in socks.into_iter().enumerate() {
        senders.push(tokio::spawn(async move {
            for i in 0..N {
                let m = zeromq::ZmqMessage::try_from(wire_message(rank as u8, i)).unwrap();
                zeromq::SocketSend::send(&mut s.outputs[0], m)
                    .await
                    .unwrap();
            }
            s
        }));
    }
    let mut next = [0u32; 2];
    for _ in 0..2 * N {
        let frames = tokio::time::timeout(WAIT, fl.recv_output(0))
            .await
            .expect("every message arrives")
            .unwrap();
        let head = String::from_utf8_lossy(&frames[0]).into_owned();
        let rank: usize = match head.strip_prefix("engine ") {
            Some(rest) => rest[..1].parse().unwrap(),
            None => panic!("a message that no engine sent: {head:?}"),
        };
        assert_eq!(
            frames,
            wire_message(rank as u8, next[rank]),
            "message {} of engine {rank} altered or out of order",
            next[rank]
        );
        next[rank] += 1;
    }
    assert_eq!(next, [N, N]);
    // Keep the engines connected until the tap has exited: an engine that goes first ends
    // the capture with "the engine disconnected", racing the SIGINT.
    let mut engines = Vec::new();
    for s in senders {
        engines.push(s.await.unwrap());
    }
    tap.signal(libc::SIGINT);
    assert!(tap.wait_exit(WAIT).success(), "{}", tap.log_text());
    drop(engines);
}
