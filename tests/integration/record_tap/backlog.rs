//! An engine that outruns the trace's observer: the tap slows it rather than holding
//! everything it sends in memory, and loses nothing.

use super::*;
use zeromq::{SocketRecv, SocketSend, ZmqMessage};

/// Output messages the engine sends back to back, 64 one-token outputs each (~450 bytes):
/// five times `--max-observer-backlog 1`, to an observer that also writes every token,
/// gzipped, at nice 19: far slower than the relay forwards them (the relay waited 2–3
/// times, 0.5–0.7 s in all, in runs alone and beside the other tap tests).
const MESSAGES: usize = 12_000;

/// One step's outputs: one token for each of `ids`, finishing them all when `last`.
fn step(ids: &[String], last: bool, ts: f64) -> ZmqMessage {
    let env = EngineCoreOutputs {
        timestamp: ts,
        outputs: ids
            .iter()
            .map(|id| EngineCoreOutput {
                request_id: id.as_str().into(),
                new_token_ids: vec![42].into(),
                finish_reason: last.then_some(FinishReason::Length),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    ZmqMessage::try_from(encode_outputs(LINE, &env).unwrap()).unwrap()
}

/// With `--max-observer-backlog 1`, a burst of outputs sent as fast as the engine can: the
/// relay waits for the observer (its last line says so) instead of queueing the burst,
/// and nothing is lost: the frontend gets every message and the trace every token of every
/// request. (How long the relay waits, until the observer is back within the bound, is the
/// handoff's unit test; the tap's memory is not asserted here: in a debug build it is
/// mostly the observer's per-request state, not the queue.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_outruns_the_observer_is_slowed_and_nothing_is_lost() {
    let tmp = TestDir::new("an_engine_that_outruns_the_observer_is_slowed");
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let trace = tmp.path("flood.jsonl.gz");
    let mut tap = Tap::start(
        fl.handshake_address(),
        &trace,
        &["--max-observer-backlog", "1", "--record-tokens"],
    );
    let (accepted, mut eng) = hand_driven_engine(&mut fl, &tap.engine_handshake).await;
    let ids: Vec<String> = (0..64).map(|i| format!("r{i}")).collect();
    for id in &ids {
        let add = add(id, &[1, 2], MESSAGES as u32);
        fl.send(0, &accepted[0].identity, encode_input(LINE, &add))
            .await
            .unwrap();
    }
    for _ in &ids {
        tokio::time::timeout(WAIT, eng.inputs[0].recv())
            .await
            .expect("every request reaches the engine")
            .unwrap();
    }

    let flood = tokio::spawn(async move {
        let mut bytes = 0usize;
        for k in 0..MESSAGES {
            let msg = step(&ids, k + 1 == MESSAGES, k as f64 * 1e-4);
            bytes += msg.iter().map(|f| f.len()).sum::<usize>();
            eng.outputs[0].send(msg).await.unwrap();
        }
        (eng, bytes)
    });
    let mut received = 0;
    while received < MESSAGES {
        tokio::time::timeout(WAIT, fl.recv_output(0))
            .await
            .expect("the outputs keep coming")
            .unwrap();
        received += 1;
    }
    let (eng, sent_bytes) = flood.await.unwrap();
    assert!(
        sent_bytes > 5 << 20,
        "the burst outgrows the bound: {sent_bytes} bytes"
    );

    tap.signal(libc::SIGTERM);
    let status = tap.wait_exit(WAIT);
    let log = tap.log_text();
    assert!(status.success(), "{log}");
    let (_, records) = tap_trace(&tap.trace);
    assert_eq!(records.len(), 64, "{log}");
    for r in &records {
        assert!(!r.incomplete, "{r:?}");
        assert_eq!(r.output_tokens, MESSAGES as u32, "{:?}", r.request_id);
    }
    assert!(
        log.contains("the relay waited"),
        "the end-of-capture line says the relay waited: {log}"
    );
    drop(eng);
}
