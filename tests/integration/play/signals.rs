//! The `play` binary and signals: SIGTERM drains for --shutdown-timeout, then finishes the
//! rest with ABORT (as vLLM does), refuses new requests meanwhile, and exits 0.

use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::support::{add, vcr_command};
use sim_protocol::decode::{DecodedOutputs, decode_outputs_for};
use sim_protocol::encode::encode_input;
use sim_protocol::transport::FrontendListener;
use sim_protocol::{FinishReason, VllmLine};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_then_aborts_and_exits_zero() {
    let line = VllmLine::new(0, 33);
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let mut child = vcr_command()
        .args(["play", "--handshake-address", fl.handshake_address()])
        .args(["--inter-token-latency", "10", "--shutdown-timeout", "0.3"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let engines = fl.accept_engines(1, Duration::from_secs(20)).await.unwrap();
    let id = engines[0].identity.clone();
    fl.send(0, &id, encode_input(line, &add("short", &[5], 5)))
        .await
        .unwrap();
    fl.send(0, &id, encode_input(line, &add("long", &[5], 10_000)))
        .await
        .unwrap();
    // both running; then SIGTERM
    tokio::time::sleep(Duration::from_millis(30)).await;
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    tokio::time::sleep(Duration::from_millis(50)).await;
    fl.send(0, &id, encode_input(line, &add("late", &[5], 5)))
        .await
        .unwrap();

    let mut finished = std::collections::BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while finished.len() < 3 && Instant::now() < deadline {
        let Ok(Ok(frames)) = tokio::time::timeout(Duration::from_secs(5), fl.recv_output(0)).await
        else {
            break;
        };
        if let Ok(DecodedOutputs::Outputs(env)) = decode_outputs_for(line, &frames) {
            for o in env.outputs {
                if let Some(r) = o.finish_reason {
                    finished.insert(o.request_id, r);
                }
            }
        }
    }
    assert_eq!(
        finished.get("short"),
        Some(&FinishReason::Length),
        "drained: {finished:?}"
    );
    assert_eq!(
        finished.get("late"),
        Some(&FinishReason::Abort),
        "refused while shutting down"
    );
    assert_eq!(
        finished.get("long"),
        Some(&FinishReason::Abort),
        "aborted after the drain time"
    );
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "play did not exit"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "exit status {status}");
}
