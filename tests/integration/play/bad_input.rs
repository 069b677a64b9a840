//! Bad input never takes the engine down: each malformed frame gets the vLLM-style answer
//! where one exists, and the engine keeps serving.

use crate::support::*;
use bytes::Bytes;
use rmpv::Value;
use sim_protocol::{CallId, FinishReason};

fn msgpack(v: &Value) -> Bytes {
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, v).unwrap();
    Bytes::from(buf)
}

/// After the bad input, a normal request still completes.
async fn still_serving(w: &mut Wire, id: &str) {
    w.send(&add(id, &[10, 11], 3)).await;
    let c = w.collect(&[id]).await;
    assert_eq!(c.tokens[id].len(), 3);
    assert_eq!(c.finished[id].0, FinishReason::Length);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_that_is_not_msgpack() {
    let mut w = Wire::start(args()).await;
    w.send_raw(vec![
        Bytes::from_static(&[0x00]),
        Bytes::from_static(b"\xc1 this is not msgpack"),
    ])
    .await;
    w.send_raw(vec![
        Bytes::from_static(&[0x01]),
        Bytes::from_static(b"\x92\x01"),
    ])
    .await;
    still_serving(&mut w, "after-garbage").await;
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_request_type_byte() {
    let mut w = Wire::start(args()).await;
    w.send_raw(vec![
        Bytes::from_static(&[0x09]),
        msgpack(&Value::Array(vec![])),
    ])
    .await;
    w.send_raw(vec![
        Bytes::from_static(&[0x00, 0x00]),
        msgpack(&Value::Nil),
    ])
    .await;
    w.send_raw(vec![Bytes::from_static(&[0x00])]).await;
    still_serving(&mut w, "after-unknown-type").await;
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_add_missing_required_fields_is_finished_with_error() {
    let mut w = Wire::start(args()).await;
    // request id and prompt only: elements 2–8 have no default in vLLM
    let payload = msgpack(&Value::Array(vec![
        Value::from("short-add"),
        Value::Array(vec![Value::from(1), Value::from(2)]),
    ]));
    w.send_raw(vec![Bytes::from_static(&[0x00]), payload]).await;
    let c = w.collect(&["short-add"]).await;
    assert_eq!(c.finished["short-add"].0, FinishReason::Error);
    assert!(c.tokens["short-add"].is_empty());
    let env = c.envelopes.iter().find(|e| !e.outputs.is_empty()).unwrap();
    let err = env.outputs[0]
        .error
        .as_ref()
        .expect("0.33 carries the error");
    assert!(!err.message.is_empty());
    // a prompt of strings is as bad
    let mut bad = vec![
        Value::from("typed-add"),
        Value::Array(vec![Value::from("x")]),
    ];
    bad.extend(std::iter::repeat_n(Value::Nil, 20));
    w.send_raw(vec![
        Bytes::from_static(&[0x00]),
        msgpack(&Value::Array(bad)),
    ])
    .await;
    let c = w.collect(&["typed-add"]).await;
    assert_eq!(c.finished["typed-add"].0, FinishReason::Error);
    still_serving(&mut w, "after-bad-add").await;
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_utility_call_with_wrong_arguments_gets_a_failure_message() {
    let mut w = Wire::start(args()).await;
    let call = |id: u64, method: &str, args: Value| {
        msgpack(&Value::Array(vec![
            Value::from(0),
            Value::from(id),
            Value::from(method),
            args,
        ]))
    };
    for (id, method, args) in [
        (70u64, "sleep", Value::Array(vec![Value::from("deep")])),
        (71, "is_sleeping", Value::from(5)),
        (
            72,
            "reset_prefix_cache",
            Value::Array(vec![Value::from("yes")]),
        ),
        (73, "add_lora", Value::Array(vec![Value::from(3)])),
        (
            74,
            "pause_scheduler",
            Value::Array(vec![Value::from("sometimes")]),
        ),
    ] {
        w.send_raw(vec![Bytes::from_static(&[0x03]), call(id, method, args)])
            .await;
        let env = loop {
            let env = w.recv().await;
            if env.utility_output.is_some() {
                break env;
            }
        };
        let u = env.utility_output.unwrap();
        assert_eq!(u.call_id, CallId::Unsigned(id));
        let msg = u.outcome.expect_err(method);
        assert!(
            msg.starts_with(&format!("Call to {method} method failed")),
            "{msg}"
        );
    }
    still_serving(&mut w, "after-bad-utility").await;
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_64_mib_frame() {
    let mut w = Wire::start(args()).await;
    let huge = Bytes::from(vec![0x91u8; 64 << 20]);
    w.send_raw(vec![Bytes::from_static(&[0x00]), huge]).await;
    still_serving(&mut w, "after-huge").await;
    w.stop().await.unwrap();
}

/// A well-formed ADD whose prompt claims far more ids than the engine's maximum model
/// length is refused before its ids are read (it once made play allocate ~44 bytes an
/// id), and a payload over --max-frame-size is refused undecoded; both with an error the
/// frontend can show, and the engine keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_prompts_and_frames_are_refused_early() {
    use sim_protocol::FinishReason;
    let mut a = args();
    a.max_frame_size = 1;
    let mut w = Wire::start(a).await;
    // 300k ids (a 900 KB frame, under the 1 MiB limit) against the default 32k context
    let long: Vec<u32> = (0..300_000u32).map(|i| 100 + i % 1000).collect();
    w.send(&add("long", &long, 4)).await;
    let env = w.recv().await;
    let o = &env.outputs[0];
    assert_eq!(o.request_id, "long");
    assert_eq!(o.finish_reason, Some(FinishReason::Error));
    let e = o.error.as_ref().unwrap();
    assert!(
        e.message.contains("300000 tokens")
            && e.message.contains("refused before its ids were read"),
        "{}",
        e.message
    );
    // 600k ids: a 1.7 MiB frame, over --max-frame-size 1
    let longer: Vec<u32> = (0..600_000u32).map(|i| 1000 + i % 1000).collect();
    w.send(&add("huge", &longer, 4)).await;
    let env = w.recv().await;
    let o = &env.outputs[0];
    assert_eq!(
        o.request_id, "huge",
        "the id is read from the head of the frame"
    );
    assert_eq!(o.finish_reason, Some(FinishReason::Error));
    let e = o.error.as_ref().unwrap();
    assert!(e.message.contains("--max-frame-size"), "{}", e.message);
    still_serving(&mut w, "after-oversized").await;
    w.stop().await.unwrap();
}

/// A stranger on the P/D side channel declaring a 2^62-byte frame is dropped; the prefill
/// engine keeps serving requests and the side channel keeps answering readers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_2_pow_62_frame_on_the_side_channel_drops_only_that_peer() {
    use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};
    let port = vllm_vcr::child::free_ports(1).unwrap()[0];
    let mut a = args();
    a.engine.pd_role = vllm_vcr::play::pd::PdRole::Prefill;
    a.engine.side_channel_port = port;
    let mut w = Wire::start(a).await;
    let side = format!("tcp://127.0.0.1:{port}");
    assert!(
        send_a_2_pow_62_frame_header(&side, "DEALER").await,
        "the side channel closes the stranger's connection"
    );
    still_serving(&mut w, "after-side-channel").await;
    let mut reader = DealerSocket::new();
    reader.connect(&side).await.unwrap();
    let read = vllm_vcr::play::pd::wire::read("d-engine", "no-such-request", &[1, 2]);
    reader
        .send(ZmqMessage::from(Bytes::from(read)))
        .await
        .unwrap();
    let answer = tokio::time::timeout(TIMEOUT, reader.recv())
        .await
        .expect("the side channel answers")
        .unwrap()
        .into_vec();
    let answer = vllm_vcr::play::pd::wire::parse_answer(answer.last().unwrap());
    assert!(
        answer.is_err(),
        "an unknown request is an error answer: {answer:?}"
    );
}

/// A message past the input socket's bound (twice --max-frame-size plus 1 MiB) is refused
/// from its frame header: the engine closes that socket and, its only input gone, stops on
/// its own, neither allocating what the frame announces nor panicking.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_past_the_input_bound_closes_the_socket() {
    let mut a = args();
    a.max_frame_size = 1;
    let mut w = Wire::start(a).await;
    w.send_raw(vec![
        Bytes::from_static(&[0x00]),
        Bytes::from(vec![0x91u8; 4 << 20]),
    ])
    .await;
    let ended = tokio::time::timeout(TIMEOUT, &mut w.task)
        .await
        .expect("play did not stop after its input socket closed")
        .unwrap();
    assert!(ended.is_ok(), "{ended:?}");
}
