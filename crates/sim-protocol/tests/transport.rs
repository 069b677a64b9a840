//! Engine side and frontend side of the handshake in one process, over real TCP sockets.

use std::time::{Duration, Instant};

use bytes::Bytes;
use sim_protocol::decode::{DecodedOutputs, decode_input, decode_outputs};
use sim_protocol::encode::{encode_outputs, encode_request};
use sim_protocol::ready::{HandshakeInit, ReadyResponse, StatusMessage, encode_status};
use sim_protocol::transport::{
    ConnectOptions, EngineSockets, FrontendListener, TransportError, connect_to_frontend,
    recv_frames, send_frames,
};
use sim_protocol::*;
use zeromq::{PullSocket, RouterSocket, Socket, SocketRecv, SocketSend, XPubSocket, ZmqMessage};

const LINE: VllmLine = VllmLine::new(0, 33);

fn ready() -> ReadyResponse {
    ReadyResponse {
        vllm_version: "0.33.0".into(),
        instance_id: "test-engine".into(),
        max_model_len: 4096,
        num_gpu_blocks: 777,
        supports_lora: true,
        max_loras: 2,
        ..Default::default()
    }
}

fn opts(handshake: Duration) -> ConnectOptions {
    ConnectOptions {
        handshake_timeout: handshake,
        init_timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(10),
        coordinator_timeout: Duration::from_secs(10),
    }
}

fn spawn_engine(
    address: String,
    rank: u16,
    handshake: Duration,
) -> tokio::task::JoinHandle<Result<EngineSockets, TransportError>> {
    tokio::spawn(
        async move { connect_to_frontend(&address, rank, &ready(), &opts(handshake)).await },
    )
}

fn request(id: &str, client_index: u32) -> EngineCoreRequest {
    EngineCoreRequest {
        request_id: id.into(),
        prompt_token_ids: Some(vec![1, 2, 3]),
        sampling_params: Some(SamplingParams {
            max_tokens: Some(4),
            ..Default::default()
        }),
        client_index,
        arrival_time: 1.0,
        ..Default::default()
    }
}

fn token_step(id: &str, tok: u32) -> EngineCoreOutputs {
    EngineCoreOutputs {
        outputs: vec![EngineCoreOutput {
            request_id: id.into(),
            new_token_ids: vec![tok].into(),
            ..Default::default()
        }],
        timestamp: 3.5,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_completes_and_frames_flow_both_ways() {
    let mut fe = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let engine = spawn_engine(
        fe.handshake_address().to_string(),
        0,
        Duration::from_secs(10),
    );
    let engines = fe.accept_engines(1, Duration::from_secs(10)).await.unwrap();
    let mut sockets = engine.await.unwrap().unwrap();

    let e = &engines[0];
    assert_eq!(e.identity.as_ref(), &[0, 0]);
    assert_eq!(e.rank, Some(0));
    assert_eq!(
        e.hello,
        StatusMessage {
            status: "HELLO".into(),
            local: false,
            headless: true
        }
    );
    assert_eq!(e.ready_payloads.len(), 1);
    assert_eq!(
        e.ready,
        ReadyResponse {
            data_parallel_rank: 0,
            dp_stats_address: None,
            ..ready()
        }
    );
    assert_eq!(sockets.init.inputs, fe.input_addresses());
    assert_eq!(sockets.inputs.len(), 1);
    assert_eq!(sockets.outputs.len(), 1);
    assert!(sockets.coordinator.is_none());

    // frontend → engine
    fe.send(0, &e.identity, encode_request(LINE, &request("req-1", 0)))
        .await
        .unwrap();
    let frames = tokio::time::timeout(Duration::from_secs(5), recv_frames(&mut sockets.inputs[0]))
        .await
        .unwrap()
        .unwrap();
    let InputMessage::Add(req) = decode_input(&frames).unwrap() else {
        panic!("not an ADD")
    };
    assert_eq!(req.request_id, "req-1");
    assert_eq!(req.wire_len, 22);

    // engine → frontend
    send_frames(
        &mut sockets.outputs[0],
        encode_outputs(LINE, &token_step("req-1", 42)).unwrap(),
    )
    .await
    .unwrap();
    let frames = tokio::time::timeout(Duration::from_secs(5), fe.recv_output(0))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        decode_outputs(&frames).unwrap(),
        DecodedOutputs::Outputs(token_step("req-1", 42))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_started_before_the_frontend_binds_still_connects() {
    // pick a free port, release it, start the engine, and only then bind the frontend
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let address = format!("tcp://127.0.0.1:{port}");
    let engine = spawn_engine(address.clone(), 0, Duration::from_secs(30));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!engine.is_finished(), "the engine must keep waiting");

    let mut fe = FrontendListener::bind_at(&address, 1).await.unwrap();
    assert_eq!(fe.handshake_address(), address);
    let bound = Instant::now();
    let engines = fe.accept_engines(1, Duration::from_secs(10)).await.unwrap();
    let took = bound.elapsed();
    let sockets = engine.await.unwrap().unwrap();
    assert_eq!(engines[0].rank, Some(0));
    assert_eq!(sockets.inputs.len(), 1);
    eprintln!("handshake completed {took:?} after the frontend bound");
    assert!(took < Duration::from_secs(3), "took {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_clients_each_get_a_ready_response_and_their_own_sockets() {
    let mut fe = FrontendListener::bind("127.0.0.1", 3).await.unwrap();
    let engine = spawn_engine(
        fe.handshake_address().to_string(),
        0,
        Duration::from_secs(10),
    );
    let engines = fe.accept_engines(1, Duration::from_secs(10)).await.unwrap();
    let mut sockets = engine.await.unwrap().unwrap();
    assert_eq!(engines[0].ready_payloads.len(), 3);
    assert!(
        engines[0]
            .ready_payloads
            .iter()
            .all(|p| p == &engines[0].ready_payloads[0])
    );
    assert_eq!((sockets.inputs.len(), sockets.outputs.len()), (3, 3));

    for client in 0..3usize {
        let id = format!("req-{client}");
        fe.send(
            client,
            &engines[0].identity,
            encode_request(LINE, &request(&id, client as u32)),
        )
        .await
        .unwrap();
        let frames = tokio::time::timeout(
            Duration::from_secs(5),
            recv_frames(&mut sockets.inputs[client]),
        )
        .await
        .unwrap()
        .unwrap();
        let InputMessage::Add(req) = decode_input(&frames).unwrap() else {
            panic!()
        };
        assert_eq!(req.client_index as usize, client);
        send_frames(
            &mut sockets.outputs[client],
            encode_outputs(LINE, &token_step(&id, 7)).unwrap(),
        )
        .await
        .unwrap();
        let frames = tokio::time::timeout(Duration::from_secs(5), fe.recv_output(client))
            .await
            .unwrap()
            .unwrap();
        let DecodedOutputs::Outputs(out) = decode_outputs(&frames).unwrap() else {
            panic!()
        };
        assert_eq!(out.outputs[0].request_id, id);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_engines_handshake_with_their_rank_identities() {
    let mut fe = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let a = spawn_engine(
        fe.handshake_address().to_string(),
        0,
        Duration::from_secs(10),
    );
    let b = spawn_engine(
        fe.handshake_address().to_string(),
        1,
        Duration::from_secs(10),
    );
    let engines = fe.accept_engines(2, Duration::from_secs(10)).await.unwrap();
    let (_a, _b) = (a.await.unwrap().unwrap(), b.await.unwrap().unwrap());
    assert_eq!(engines.len(), 2);
    assert_eq!(engines[0].identity.as_ref(), &[0, 0]);
    assert_eq!(engines[1].identity.as_ref(), &[1, 0]);
    assert_eq!(engines[1].ready.data_parallel_rank, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_frontend_is_a_clear_timeout() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let start = Instant::now();
    let err = connect_to_frontend(
        &format!("127.0.0.1:{port}"),
        0,
        &ready(),
        &opts(Duration::from_millis(1200)),
    )
    .await
    .err()
    .expect("no frontend");
    assert!(start.elapsed() < Duration::from_secs(4));
    assert!(
        matches!(err, TransportError::HandshakeTimeout { .. }),
        "{err}"
    );
    let msg = err.to_string();
    assert!(msg.contains(&format!("tcp://127.0.0.1:{port}")), "{msg}");
    assert!(msg.contains("--data-parallel-size-local 0"), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_64_mib_frame_is_carried_both_ways() {
    let mut fe = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let engine = spawn_engine(
        fe.handshake_address().to_string(),
        0,
        Duration::from_secs(10),
    );
    let engines = fe.accept_engines(1, Duration::from_secs(10)).await.unwrap();
    let mut sockets = engine.await.unwrap().unwrap();
    let big: Bytes = (0..64usize * 1024 * 1024)
        .map(|i| (i % 251) as u8)
        .collect::<Vec<u8>>()
        .into();

    // engine → frontend: [payload, 64 MiB aux]
    let mut frames = encode_outputs(LINE, &token_step("r", 1)).unwrap();
    frames.push(big.clone());
    let t = Instant::now();
    send_frames(&mut sockets.outputs[0], frames).await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(60), fe.recv_output(0))
        .await
        .unwrap()
        .unwrap();
    let push_pull = t.elapsed();
    assert_eq!(got.len(), 2);
    assert!(got[1] == big, "64 MiB frame corrupted");

    // frontend → engine: [type, payload, 64 MiB aux] through ROUTER → DEALER
    let mut frames = encode_request(LINE, &request("r2", 0));
    frames.push(big.clone());
    let t = Instant::now();
    fe.send(0, &engines[0].identity, frames).await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(60), recv_frames(&mut sockets.inputs[0]))
        .await
        .unwrap()
        .unwrap();
    let router_dealer = t.elapsed();
    assert_eq!(got.len(), 3);
    assert!(got[2] == big, "64 MiB frame corrupted");
    eprintln!("64 MiB frame: PUSH→PULL {push_pull:?}, ROUTER→DEALER {router_dealer:?}");
}

/// The coordinator branch (DP > 1): XSUB subscribes, waits for READY, then a PUSH connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_handshake_subscribes_and_waits_for_ready() {
    let mut handshake = RouterSocket::new();
    let hs_addr = handshake
        .bind("tcp://127.0.0.1:0")
        .await
        .unwrap()
        .to_string();
    let mut input = RouterSocket::new();
    let in_addr = input.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let mut output = PullSocket::new();
    let out_addr = output.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let mut xpub = XPubSocket::new();
    let cin = xpub.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let mut coord_pull = PullSocket::new();
    let cout = coord_pull
        .bind("tcp://127.0.0.1:0")
        .await
        .unwrap()
        .to_string();

    let engine = spawn_engine(hs_addr, 0, Duration::from_secs(10));
    let hello = handshake.recv().await.unwrap().into_vec();
    assert_eq!(hello[1].as_ref(), &encode_status("HELLO")[..]);
    let init = HandshakeInit {
        inputs: vec![in_addr],
        outputs: vec![out_addr],
        coordinator_input: Some(cin),
        coordinator_output: Some(cout),
        frontend_stats_publish_address: Some("tcp://127.0.0.1:5999".into()),
        ..Default::default()
    };
    let mut msg = ZmqMessage::from(hello[0].clone());
    msg.push_back(Bytes::from(init.encode()));
    handshake.send(msg).await.unwrap();

    let ready_msg = input.recv().await.unwrap().into_vec();
    let r = ReadyResponse::decode(&ready_msg[1]).unwrap();
    assert_eq!(r.dp_stats_address.as_deref(), Some("tcp://127.0.0.1:5999"));

    // the engine subscribes to everything, then waits for READY
    let sub = tokio::time::timeout(Duration::from_secs(5), xpub.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(sub.into_vec()[0].as_ref(), b"\x01");
    assert!(!engine.is_finished());
    xpub.send(ZmqMessage::from(Bytes::from_static(b"READY")))
        .await
        .unwrap();

    let done = tokio::time::timeout(Duration::from_secs(5), handshake.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(done.into_vec()[1].as_ref(), &encode_status("READY")[..]);
    let mut sockets = engine.await.unwrap().unwrap();
    let coord = sockets.coordinator.as_mut().expect("coordinator sockets");
    send_frames(&mut coord.output, vec![Bytes::from_static(b"stats")])
        .await
        .unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), coord_pull.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got.into_vec()[0].as_ref(), b"stats");
}
