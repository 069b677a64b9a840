//! The `play` binary and signals: SIGTERM drains for --shutdown-timeout, then finishes the
//! rest with ABORT (as vLLM does), refuses new requests meanwhile, and exits 0.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::support::{add, vcr_command};
use sim_protocol::decode::{DecodedOutputs, decode_outputs_for};
use sim_protocol::encode::encode_input;
use sim_protocol::transport::FrontendListener;
use sim_protocol::{FinishReason, VllmLine};

/// Outputs of the engine until `done` says the finishes and token counts seen so far
/// suffice (or 10 s pass): (request id → finish reason, request id → tokens).
async fn outputs_until(
    fl: &mut FrontendListener,
    line: VllmLine,
    finished: &mut BTreeMap<String, FinishReason>,
    tokens: &mut BTreeMap<String, usize>,
    done: impl Fn(&BTreeMap<String, FinishReason>, &BTreeMap<String, usize>) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done(finished, tokens) && Instant::now() < deadline {
        let Ok(Ok(frames)) = tokio::time::timeout(Duration::from_secs(5), fl.recv_output(0)).await
        else {
            break;
        };
        if let Ok(DecodedOutputs::Outputs(env)) = decode_outputs_for(line, &frames) {
            for o in env.outputs {
                *tokens.entry(o.request_id.to_string()).or_default() += o.new_token_ids.len();
                if let Some(r) = o.finish_reason {
                    finished.insert(o.request_id.to_string(), r);
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_then_aborts_and_exits_zero() {
    let line = VllmLine::new(0, 33);
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let mut child = vcr_command()
        .args(["play", "--handshake-address", fl.handshake_address()])
        .args(["--inter-token-latency", "10", "--shutdown-timeout", "2"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // the log says when the signal was taken (the shutdown is set before it is said)
    let (said, shutting_down) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(stderr).lines().map_while(Result::ok) {
            if l.contains("signal received: shutting down") {
                let _ = said.send(());
            }
        }
    });
    let engines = fl.accept_engines(1, Duration::from_secs(20)).await.unwrap();
    let id = engines[0].identity.clone();
    fl.send(0, &id, encode_input(line, &add("short", &[5], 5)))
        .await
        .unwrap();
    fl.send(0, &id, encode_input(line, &add("long", &[5], 10_000)))
        .await
        .unwrap();
    // both running (each has a token out); then SIGTERM
    let (mut finished, mut tokens) = (BTreeMap::new(), BTreeMap::new());
    outputs_until(&mut fl, line, &mut finished, &mut tokens, |_, t| {
        t.contains_key("short") && t.contains_key("long")
    })
    .await;
    assert!(tokens.contains_key("long"), "both running: {tokens:?}");
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    tokio::task::spawn_blocking(move || shutting_down.recv_timeout(Duration::from_secs(10)))
        .await
        .unwrap()
        .expect("play logs the signal");
    fl.send(0, &id, encode_input(line, &add("late", &[5], 5)))
        .await
        .unwrap();
    outputs_until(&mut fl, line, &mut finished, &mut tokens, |f, _| {
        f.len() >= 3
    })
    .await;
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
    assert!(
        tokens["long"] < 1_000,
        "the long one was cut at the drain's end, not run out: {tokens:?}"
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
