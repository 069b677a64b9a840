//! The engine's sockets: decode what the frontend sends into [`EngineInput`]s, encode what
//! the engine emits for the configured line, and keep the engine loop on its own thread so
//! socket work never delays pacing.

use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, Result};
use bytes::Bytes;
use sim_protocol::decode::decode_input_with;
use sim_protocol::encode::encode_outputs;
use sim_protocol::transport::{ConnectOptions, connect_to_frontend};
use sim_protocol::{ENGINE_CORE_DEAD, VllmLine};
use tokio::sync::{mpsc, watch};
use zeromq::{SocketRecv, SocketSend, ZmqMessage};

use super::config::PlayConfig;
use crate::play::engine::engine_core::{EngineInput, LoopControl, LoopExit, Outbound, run_loop};
use crate::play::engine::sim::SimEngine;

/// How late one engine emitted its steps (and scripted chunks) against their deadlines,
/// over a whole run: the disturbance a wall-clock run suffered from the machine, which a
/// check of its timing is judged against.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Pacing {
    /// Emissions measured.
    pub steps: u64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

/// The pacing of every engine this process ran, as each stopped.
static PACING: Mutex<Vec<Pacing>> = Mutex::new(Vec::new());

/// The pacing of the engines this process ran and stopped since the last call, in stop
/// order (an in-process caller such as `calibrate-e2e` reads its engine's here).
pub fn take_pacing() -> Vec<Pacing> {
    PACING
        .lock()
        .map(|mut v| std::mem::take(&mut *v))
        .unwrap_or_default()
}

/// Connect one engine (DP rank `rank`) to the frontend and serve it until shutdown.
/// Returns the engine's replay counts when it replayed a capture.
pub async fn run_engine(
    cfg: &PlayConfig,
    rank: u16,
    mut shutdown: watch::Receiver<bool>,
) -> Result<Option<serde_json::Value>> {
    let mut ready = cfg.ready_response(rank);
    // KV-cache events: the publisher binds before the handshake so the resolved endpoint
    // can be advertised in the ready response, as vLLM does.
    let kv_publisher = match &cfg.kv_events {
        Some(config) => {
            let (publisher, advertised) =
                crate::play::pd::kv_events::KvEventPublisher::start(config, rank, cfg.line)
                    .await
                    .context("starting the KV-events publisher")?;
            if let Some(a) = &advertised {
                tracing::info!(rank, endpoint = %a.endpoint, "publishing KV-cache events");
            }
            ready.kv_events_config = advertised.map(|c| c.to_value());
            Some(publisher)
        }
        None => None,
    };
    // The frontend's data sockets may appear long after its handshake socket (the Python
    // frontend's API-server processes import torch first): wait as long as for the
    // handshake itself, as the frontend waits for the engine.
    let opts = ConnectOptions {
        handshake_timeout: cfg.handshake_timeout,
        connect_timeout: cfg.handshake_timeout,
        ..Default::default()
    };
    // P/D: the side channel and the KV pulls talk to the engine on their own channel; a
    // prefill engine's side channel is bound before the handshake, so a taken port fails
    // the start
    let (side_tx, side_rx) = mpsc::unbounded_channel::<EngineInput>();
    let side_router = if cfg.engine.pd.role == super::pd::PdRole::Prefill {
        let pd = &cfg.engine.pd;
        let address = format!(
            "tcp://{}:{}",
            pd.side_channel_host,
            u32::from(pd.side_channel_port) + u32::from(rank)
        );
        let router = sim_protocol::listener::ZmtpRouter::bind(
            &address,
            "P/D side channel",
            crate::play::pd::side_channel::peer_limits(),
        )
        .await
        .with_context(|| {
            format!("--side-channel-port: the P/D side channel cannot listen on {address}")
        })?;
        let endpoint = router.endpoint().to_string();
        tracing::info!(%endpoint, engine_id = %pd.engine_id, "P/D side channel listening (prefill role)");
        Some(router)
    } else {
        None
    };
    let plane = crate::play::pd::data_plane::for_engine(
        &cfg.engine.pd,
        cfg.engine.num_gpu_blocks,
        cfg.engine.block_size,
    );
    let connect = connect_to_frontend(&cfg.handshake_address, rank, &ready, &opts);
    let sockets = tokio::select! {
        r = connect => r.with_context(|| format!("handshake with the frontend at {}", cfg.handshake_address))?,
        _ = shutdown.wait_for(|v| *v) => {
            tracing::info!(rank, "shutdown before the frontend connected");
            return Ok(None);
        }
    };
    let clients = sockets.outputs.len();
    tracing::info!(
        rank,
        clients,
        line = %cfg.line,
        "connected to the frontend; serving"
    );

    let (in_tx, mut in_rx) = mpsc::unbounded_channel::<EngineInput>();
    let (out_tx, out_rx) = mpsc::unbounded_channel::<Outbound>();
    let mut input_tasks = Vec::new();
    for (i, sock) in sockets.inputs.into_iter().enumerate() {
        input_tasks.push(tokio::spawn(input_task(
            i as u32,
            sock,
            in_tx.clone(),
            cfg.decode_limits,
        )));
    }
    drop(in_tx);
    let side_task = side_router.map(|router| {
        tokio::spawn(crate::play::pd::side_channel::serve(
            router,
            side_tx.clone(),
            plane.clone(),
            shutdown.clone(),
        ))
    });
    let reads_task = (cfg.engine.pd.role == super::pd::PdRole::Prefill && plane.moves_bytes())
        .then(|| {
            tokio::spawn(crate::play::pd::side_channel::watch_reads(
                plane.clone(),
                side_tx.clone(),
                shutdown.clone(),
            ))
        });
    let line = cfg.line;
    let output_task = tokio::spawn(output_task(
        line,
        sockets.outputs,
        out_rx,
        side_tx,
        plane.clone(),
    ));

    let mut engine = cfg.build_engine(rank);
    engine.set_data_plane(plane);
    if let Some(p) = kv_publisher {
        engine.set_kv_publisher(p);
    }
    tracing::info!("{}", engine.describe());
    let ctl = LoopControl {
        shutdown: shutdown.clone(),
        shutdown_timeout: cfg.shutdown_timeout,
        side: Some(side_rx),
    };
    let dead_tx = out_tx.clone();
    let engine_thread = std::thread::Builder::new()
        .name(format!("engine-{rank}"))
        .spawn(move || -> Result<(LoopExit, SimEngine)> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("engine runtime")?;
            let mut engine = engine;
            let exit = rt.block_on(run_loop(&mut engine, &mut in_rx, &out_tx, ctl));
            Ok((exit, engine))
        })
        .context("spawning the engine thread")?;

    let joined = tokio::task::spawn_blocking(move || engine_thread.join())
        .await
        .context("joining the engine thread")?;
    let result = match joined {
        Ok(Ok((exit, mut engine))) => {
            report_pacing(rank, &engine);
            let replay = engine.replay_summary().map(|(line, json)| {
                tracing::info!(rank, "replay: {line}");
                json
            });
            if let Some(p) = engine.take_kv_publisher() {
                p.shutdown().await;
            }
            match exit {
                LoopExit::Drained | LoopExit::DrainTimedOut => {
                    tracing::info!(rank, ?exit, "engine stopped");
                    Ok(replay)
                }
                LoopExit::InputsClosed => {
                    tracing::warn!(rank, "the frontend's input sockets closed; engine stopped");
                    Ok(replay)
                }
                LoopExit::OutputsClosed => Err(anyhow::anyhow!("output socket task ended")),
            }
        }
        Ok(Err(e)) => {
            let _ = dead_tx.send(Outbound::Dead);
            Err(e)
        }
        Err(panic) => {
            // A fatal engine error: tell the frontend the way vLLM does.
            let _ = dead_tx.send(Outbound::Dead);
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(anyhow::anyhow!("engine thread panicked: {what}"))
        }
    };
    drop(dead_tx);
    // The output task ends when every sender is gone, after flushing what was queued.
    match tokio::time::timeout(Duration::from_secs(5), output_task).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => tracing::warn!("output socket: {e:#}"),
        Ok(Err(e)) => tracing::warn!("output task: {e}"),
        Err(_) => tracing::warn!("output task did not finish flushing in 5 s"),
    }
    for t in input_tasks {
        t.abort();
    }
    if let Some(t) = reads_task {
        t.abort();
    }
    if let Some(t) = side_task {
        match tokio::time::timeout(Duration::from_millis(200), t).await {
            Ok(Ok(Err(e))) => tracing::warn!("{e:#}"),
            Ok(_) => {}
            Err(_) => {}
        }
    }
    result
}

fn report_pacing(rank: u16, engine: &SimEngine) {
    let s = engine.lateness_us();
    if s.is_empty() {
        return;
    }
    let ms = |v: Option<f64>| v.unwrap_or(0.0) / 1e3;
    let pacing = Pacing {
        steps: s.count(),
        p50_ms: ms(s.quantile(0.5)),
        p99_ms: ms(s.quantile(0.99)),
        max_ms: ms(s.max()),
    };
    tracing::info!(
        rank,
        steps = pacing.steps,
        lateness_p50_us = format!("{:.1}", pacing.p50_ms * 1e3),
        lateness_p99_us = format!("{:.1}", pacing.p99_ms * 1e3),
        lateness_max_us = format!("{:.1}", pacing.max_ms * 1e3),
        "pacing: step emission lateness against the scheduled deadlines"
    );
    if let Ok(mut v) = PACING.lock() {
        v.push(pacing);
    }
}

async fn input_task<S: SocketRecv>(
    client: u32,
    mut sock: S,
    tx: mpsc::UnboundedSender<EngineInput>,
    limits: sim_protocol::decode::DecodeLimits,
) {
    loop {
        let msg = match sock.recv().await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(client, "input socket closed: {e}");
                return;
            }
        };
        let frames: Vec<Bytes> = msg.into_vec();
        let input = match decode_input_with(&frames, &limits) {
            Ok(msg) => EngineInput::Message { client, msg },
            Err(error) => EngineInput::Bad { client, error },
        };
        if tx.send(input).is_err() {
            return;
        }
    }
}

async fn output_task<S: SocketSend>(
    line: VllmLine,
    mut outputs: Vec<S>,
    mut rx: mpsc::UnboundedReceiver<Outbound>,
    side: mpsc::UnboundedSender<EngineInput>,
    plane: std::sync::Arc<dyn crate::play::pd::data_plane::DataPlane>,
) -> Result<()> {
    // A client whose output socket failed is gone (its API server died or closed the
    // socket): like vLLM when a client goes away, its requests are aborted rather than
    // generated for nobody, and nothing more is sent to it. The first failure is logged;
    // the outputs dropped after it are counted.
    let mut failed: Vec<u64> = vec![0; outputs.len()];
    while let Some(item) = rx.recv().await {
        match item {
            Outbound::Outputs {
                client,
                outputs: env,
            } => {
                let frames = match encode_outputs(line, &env) {
                    Ok(f) => f,
                    Err(e) => {
                        // An engine that cannot speak its line is broken: fail loudly.
                        tracing::error!("cannot encode an output for vLLM {line}: {e}");
                        send_dead(&mut outputs).await;
                        return Err(anyhow::anyhow!("encoding failed: {e}"));
                    }
                };
                let Some(sock) = outputs.get_mut(client as usize) else {
                    tracing::error!(
                        client,
                        clients = outputs.len(),
                        "dropping an output for an unknown client index"
                    );
                    continue;
                };
                let fails = &mut failed[client as usize];
                if *fails > 0 {
                    *fails += 1;
                    abort_for_gone_client(&side, client, &env);
                    continue;
                }
                let msg =
                    ZmqMessage::try_from(frames).map_err(|_| anyhow::anyhow!("empty message"))?;
                if let Err(e) = sock.send(msg).await {
                    tracing::warn!(
                        client,
                        "output socket send failed (frontend gone?): {e}; aborting this \
                         client's requests and sending it nothing more"
                    );
                    *fails = 1;
                    abort_for_gone_client(&side, client, &env);
                }
            }
            Outbound::Dead => {
                send_dead(&mut outputs).await;
            }
            Outbound::Pull(p) => {
                tokio::spawn(crate::play::pd::side_channel::pull(
                    p,
                    side.clone(),
                    plane.clone(),
                ));
            }
            Outbound::Compile(c) => {
                // on tokio's blocking pool: a big grammar takes a while, and neither the
                // engine's steps nor this task's sends wait for it
                let side = side.clone();
                tokio::spawn(async move {
                    let request_id = c.request_id.clone();
                    let ready = tokio::task::spawn_blocking(move || c.run())
                        .await
                        .unwrap_or_else(|e| {
                            EngineInput::Grammar(crate::play::engine::engine_core::GrammarReady {
                                request_id,
                                result: Err(format!("the grammar compile failed: {e}")),
                            })
                        });
                    let _ = side.send(ready);
                });
            }
        }
    }
    for (client, n) in failed.iter().enumerate().filter(|(_, n)| **n > 1) {
        tracing::warn!(client, "{n} outputs could not be sent to this client");
    }
    Ok(())
}

/// Abort the unfinished requests of an envelope meant for a client that is gone, through
/// the engine's own input path (as the frontend's abort would come). Every request of the
/// client is in such an envelope at its next step with output: running ones at once,
/// waiting ones when they are scheduled (they produce their first token, then stop).
fn abort_for_gone_client(
    side: &mpsc::UnboundedSender<EngineInput>,
    client: u32,
    env: &sim_protocol::EngineCoreOutputs,
) {
    let ids: Vec<String> = env
        .outputs
        .iter()
        .filter(|o| o.finish_reason.is_none())
        .map(|o| o.request_id.to_string())
        .collect();
    if ids.is_empty() {
        return;
    }
    tracing::info!(
        client,
        aborted = ids.len(),
        "aborting the requests of a client that is gone"
    );
    let _ = side.send(EngineInput::Message {
        client,
        msg: sim_protocol::InputMessage::Abort(ids),
    });
}

async fn send_dead<S: SocketSend>(outputs: &mut [S]) {
    tracing::error!("sending ENGINE_CORE_DEAD to the frontend");
    for sock in outputs.iter_mut() {
        let _ = sock
            .send(ZmqMessage::from(Bytes::from_static(ENGINE_CORE_DEAD)))
            .await;
    }
    // zeromq has no linger: give the frames a moment to leave before the sockets drop.
    tokio::time::sleep(Duration::from_millis(200)).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use sim_protocol::EngineCoreOutputs;
    use zeromq::{PullSocket, PushSocket, Socket};

    /// A client whose output socket fails is gone: the unfinished requests of that
    /// envelope, and of every later one for it, come back to the engine as the frontend's
    /// abort would, and nothing more is sent to it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_whose_send_fails_has_its_requests_aborted() {
        use sim_protocol::{EngineCoreOutput, FinishReason, InputMessage};
        // a PUSH socket with no peer: every send fails
        let push = PushSocket::new();
        let (tx, rx) = mpsc::unbounded_channel();
        let (side, mut side_rx) = mpsc::unbounded_channel();
        let plane = std::sync::Arc::new(crate::play::pd::data_plane::NoopDataPlane);
        let task = tokio::spawn(output_task(
            VllmLine::new(0, 33),
            vec![push],
            rx,
            side,
            plane,
        ));
        let out = |id: &str, finish: Option<FinishReason>| EngineCoreOutput {
            request_id: id.into(),
            new_token_ids: vec![7].into(),
            finish_reason: finish,
            ..Default::default()
        };
        let envelope = |outputs: Vec<EngineCoreOutput>| Outbound::Outputs {
            client: 0,
            outputs: EngineCoreOutputs {
                timestamp: 1.0,
                outputs,
                ..Default::default()
            },
        };
        tx.send(envelope(vec![
            out("a", None),
            out("b", Some(FinishReason::Length)),
        ]))
        .unwrap();
        tx.send(envelope(vec![out("c", None)])).unwrap();
        drop(tx);
        task.await.unwrap().unwrap();
        let mut aborted = Vec::new();
        while let Ok(input) = side_rx.try_recv() {
            match input {
                EngineInput::Message {
                    client: 0,
                    msg: InputMessage::Abort(ids),
                } => aborted.push(ids),
                other => panic!("unexpected {other:?}"),
            }
        }
        // the finished request is not aborted; the later one is
        assert_eq!(aborted, vec![vec!["a".to_string()], vec!["c".to_string()]]);
    }

    /// A fatal error reaches the frontend as the raw ENGINE_CORE_DEAD frame, after the
    /// outputs queued before it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dead_sentinel_follows_queued_outputs() {
        let mut pull = PullSocket::new();
        let ep = pull.bind("tcp://127.0.0.1:0").await.unwrap();
        let mut push = PushSocket::new();
        push.connect(&ep.to_string()).await.unwrap();
        let (tx, rx) = mpsc::unbounded_channel();
        let (side, _side_rx) = mpsc::unbounded_channel();
        let plane = std::sync::Arc::new(crate::play::pd::data_plane::NoopDataPlane);
        let task = tokio::spawn(output_task(
            VllmLine::new(0, 33),
            vec![push],
            rx,
            side,
            plane,
        ));
        tx.send(Outbound::Outputs {
            client: 0,
            outputs: EngineCoreOutputs {
                timestamp: 1.0,
                finished_requests: Some(vec!["x".into()]),
                ..Default::default()
            },
        })
        .unwrap();
        tx.send(Outbound::Dead).unwrap();
        drop(tx);
        let first = pull.recv().await.unwrap().into_vec();
        assert_ne!(first[0].as_ref(), ENGINE_CORE_DEAD);
        let second = pull.recv().await.unwrap().into_vec();
        assert_eq!(second, vec![Bytes::from_static(ENGINE_CORE_DEAD)]);
        task.await.unwrap().unwrap();
    }
}
