//! `play` may start before the frontend. The test reserves and releases a port; other
//! tests of this process cannot take it meanwhile: `free_ports` picks below the kernel's
//! ephemeral range (where `bind(:0)` never lands) and never hands a port out twice.

use std::time::Duration;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn play_waits_for_a_frontend_that_starts_later() {
    // reserve a port, release it, start play first, then bind the frontend there
    let port = vllm_vcr::child::free_ports(1).unwrap()[0];
    let mut a = args();
    a.handshake_address = format!("tcp://127.0.0.1:{port}");
    let (tx, rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(vllm_vcr::play::run(a, rx));
    tokio::time::sleep(Duration::from_millis(700)).await;
    let mut fl =
        sim_protocol::transport::FrontendListener::bind_at(&format!("tcp://127.0.0.1:{port}"), 1)
            .await
            .unwrap();
    let engines = fl.accept_engines(1, TIMEOUT).await.unwrap();
    assert_eq!(engines[0].rank, Some(0));
    tx.send(true).unwrap();
    tokio::time::timeout(TIMEOUT, task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}
