//! What crosses the tap and what it records: every frame unchanged in both directions, when
//! each request was sent, two engines and two clients, DP outputs merged whole, an oversized
//! frame relayed without being decoded.

use super::*;

/// One processor of a Sapphire Rapids host (flags trimmed to the x86 basics and the vector
/// extensions), for `--host-cpu FILE`.
const OTHER_HOST_CPUINFO: &str = "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n\
model\t\t: 143\nmodel name\t: Intel(R) Xeon(R) Platinum 8488C\nstepping\t: 8\n\
flags\t\t: fpu sse sse2 lm avx f16c fma avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni \
avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8\n\n";

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
    let (meta, records) = tap_trace(&trace);
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

/// Each record says when the tap relayed its request (`sent_ms`) beside when the engine
/// queued it (`arrival_ms`, never earlier).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_record_says_when_its_request_was_sent() {
    let tmp = TestDir::new("each_record_says_when_its_request_was_sent");
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let trace = tmp.path("sent.jsonl");
    let mut tap = Tap::start(fl.handshake_address(), &trace, &[]);
    let engine = PlayBehindTap::join(&mut fl, &tap).await;
    for id in ["s1", "s2"] {
        engine.send(&mut fl, id).await;
    }
    collect(&mut fl, &["s1", "s2"]).await;
    drop(fl);
    assert!(tap.wait_exit(WAIT).success(), "{}", tap.log_text());
    let (_, records) = tap_trace(&tap.trace);
    assert_eq!(records.len(), 2);
    for r in &records {
        let (sent, arrival) = (r.sent_ms.unwrap(), r.arrival_ms.unwrap());
        assert!(
            sent <= arrival && arrival - sent < 1000.0,
            "sent {sent} ms, queued {arrival} ms"
        );
    }
    engine.stop().await;
}

/// With `--reasoning-format`, each record says how long its answer thought, as the
/// frontend's usage would: `play` writes `qwen3` blocks of half of each 80-token answer,
/// and in the embedded model's tokens (one a byte) 17 of the block's 40 are `<think>`,
/// `</think>` and the blank line after it. The ids are not recorded for the count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_record_says_how_long_its_answer_thought() {
    use vllm_vcr::play::content::reasoning::ReasoningFormat;
    let tmp = TestDir::new("each_record_says_how_long_its_answer_thought");
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let trace = tmp.path("thinking.jsonl");
    let mut tap = Tap::start(
        fl.handshake_address(),
        &trace,
        &["--reasoning-format", "qwen3"],
    );
    let mut args = play_args(&tap.engine_handshake);
    args.engine.tokens = Some(vllm_vcr::play::TokenMode::Text);
    args.engine.reasoning_format = Some(ReasoningFormat::Qwen3);
    args.engine.reasoning_share = 0.5;
    let engine = PlayBehindTap::join_with(&mut fl, args).await;
    for (id, max_tokens) in [("t1", 80), ("t2", 20)] {
        let req = add(id, &[1, 2], max_tokens);
        fl.send(0, &engine.identity, encode_input(LINE, &req))
            .await
            .unwrap();
    }
    collect(&mut fl, &["t1", "t2"]).await;
    drop(fl);
    assert!(tap.wait_exit(WAIT).success(), "{}", tap.log_text());
    let (_, records) = tap_trace(&tap.trace);
    let t1 = record(&records, "t1");
    assert_eq!((t1.output_tokens, t1.reasoning_tokens), (80, Some(23)));
    assert!(t1.output_token_ids.is_none());
    // a block of 10 has no room for its 19 tokens of tags: no thinking
    assert_eq!(record(&records, "t2").reasoning_tokens, Some(0));
    engine.stop().await;
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
            let msg = crate::support::with_client(add(&rid, &[1, 2, 3], 5), client);
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
    let (_, records) = tap_trace(&trace);
    assert_eq!(records.len(), 4, "{records:?}");
    assert!(
        records
            .iter()
            .all(|r| !r.incomplete && r.output_tokens == 5)
    );
    let _ = stop.send(true);
    let _ = tokio::time::timeout(WAIT, engine).await;
}

/// A frame over `--max-frame-size` crosses the tap unchanged but is not decoded for the
/// trace (it once took the tap's observer to gigabytes); the capture goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_frame_is_relayed_but_not_decoded() {
    let tmp = TestDir::new("an_oversized_frame_is_relayed_but_not_decoded");
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let trace = tmp.path("oversized.jsonl");
    let mut tap = Tap::start(fl.handshake_address(), &trace, &["--max-frame-size", "1"]);
    let mut engine = play_child_behind(&tap);
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
    let (_, records) = tap_trace(&tap.trace);
    assert_eq!(
        records.len(),
        1,
        "only the decodable request is in the trace"
    );
    assert!(!record(&records, "small").incomplete);
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

/// A frontend whose data sockets are `ipc://` (a Python frontend's default for an engine on
/// its own host): the engine is told Unix-domain sockets of the tap beside the frontend's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ipc_frontend_gets_ipc_sockets_from_the_tap() {
    // short: a Unix-domain socket's path has at most 107 bytes
    let tmp = TestDir::new("ipc-fe");
    let dir = tmp.path("s");
    std::fs::create_dir_all(&dir).unwrap();
    let fl = FrontendListener::bind_ipc_data("tcp://127.0.0.1:0", &dir, 1)
        .await
        .unwrap();
    relays_over_ipc_sockets_in(fl, &tmp, &dir, &[]).await;
}

/// `--engine-ipc-dir`: a TCP frontend, and the engine is told Unix-domain sockets in that
/// directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_ipc_dir_gives_the_engine_ipc_sockets() {
    let tmp = TestDir::new("ipc-dir");
    let dir = tmp.path("s");
    std::fs::create_dir_all(&dir).unwrap();
    let fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let flag = ["--engine-ipc-dir", dir.to_str().unwrap()];
    relays_over_ipc_sockets_in(fl, &tmp, &dir, &flag).await;
}

/// Through a tap started with `extra`, the engine is told `ipc://` sockets in `dir`, a
/// request and its answer cross them, and the tap removes its socket files when it ends.
async fn relays_over_ipc_sockets_in(
    mut fl: FrontendListener,
    tmp: &TestDir,
    dir: &Path,
    extra: &[&str],
) {
    use zeromq::{SocketRecv, SocketSend, ZmqMessage};
    let mut tap = Tap::start(fl.handshake_address(), &tmp.path("ipc.jsonl"), extra);
    let (accepted, mut eng) = hand_driven_engine(&mut fl, &tap.engine_handshake).await;
    let tap_files = || -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with("vcr-tap-"))
            .collect();
        names.sort();
        names
    };
    for (what, told) in [("in", &eng.init.inputs[0]), ("out", &eng.init.outputs[0])] {
        let path = told
            .strip_prefix("ipc://")
            .unwrap_or_else(|| panic!("the engine was told {told}, not an ipc:// address"));
        assert_eq!(Path::new(path).parent(), Some(dir));
        assert!(path.ends_with(&format!("-{what}-0")), "{path}");
    }
    assert_eq!(tap_files().len(), 2, "{:?}", tap_files());

    fl.send(
        0,
        &accepted[0].identity,
        encode_input(LINE, &add("u", &[1, 2], 1)),
    )
    .await
    .unwrap();
    let got = tokio::time::timeout(WAIT, eng.inputs[0].recv())
        .await
        .expect("the request reaches the engine")
        .unwrap();
    let InputMessage::Add(req) = decode_input(&got.into_vec()).unwrap() else {
        panic!("not an ADD");
    };
    assert_eq!(req.request_id.as_str(), "u");
    let out = EngineCoreOutputs {
        outputs: vec![EngineCoreOutput {
            request_id: "u".into(),
            new_token_ids: [9].into_iter().collect(),
            finish_reason: Some(FinishReason::Length),
            ..Default::default()
        }],
        ..Default::default()
    };
    eng.outputs[0]
        .send(ZmqMessage::try_from(encode_outputs(LINE, &out).unwrap()).unwrap())
        .await
        .unwrap();
    let c = collect(&mut fl, &["u"]).await;
    assert_eq!(c.tokens["u"], vec![9]);

    drop(eng);
    tap.signal(libc::SIGTERM);
    tap.wait_exit(WAIT);
    assert_eq!(tap_files(), Vec::<String>::new(), "{}", tap.log_text());
}
