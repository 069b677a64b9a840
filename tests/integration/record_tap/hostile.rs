//! What a hostile peer or a full disk cannot do to the tap: a 2^62-byte frame header drops
//! only that peer, a partial 2^40-byte message never reaches the frontend, and a full disk
//! keeps the relay going while the trace counts what was lost.

use super::*;

/// A stranger on the tap's engine-handshake port declaring a 2^62-byte frame is dropped:
/// the tap lives on, and an engine that joins afterwards is relayed and recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_2_pow_62_frame_on_the_handshake_port_drops_only_that_peer() {
    let tmp = TestDir::new("a_2_pow_62_frame_on_the_handshake_port_drops_only_that_peer");
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let trace = tmp.path("hostile-handshake.jsonl");
    let mut tap = Tap::start(fl.handshake_address(), &trace, &[]);
    assert!(
        crate::support::send_a_2_pow_62_frame_header(&tap.engine_handshake, "DEALER").await,
        "the tap closes the stranger's connection: {}",
        tap.log_text()
    );
    assert!(
        tap.process.try_wait().is_none(),
        "the tap is alive: {}",
        tap.log_text()
    );
    let engine = PlayBehindTap::join(&mut fl, &tap).await;
    engine.send(&mut fl, "after").await;
    collect(&mut fl, &["after"]).await;
    drop(fl);
    let status = tap.wait_exit(WAIT);
    assert!(status.success(), "{}", tap.log_text());
    let (_, records) = tap_trace(&tap.trace);
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].output_tokens, 4);
    engine.stop().await;
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
        tap.process.try_wait().is_none(),
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

/// A full disk (`/dev/full`: every write fails with ENOSPC): the tap keeps relaying, says
/// so once, and at exit reports how many records could not be written, naming the trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_keeps_the_relay_going_and_counts_what_was_lost() {
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let full = Path::new("/dev/full");
    let mut tap = Tap::start(fl.handshake_address(), full, &["--force"]);
    let mut engine = play_child_behind(&tap);
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
