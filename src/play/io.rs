//! The engine's sockets: run the engine loop on its own thread, where the frontend's input
//! sockets are read and decoded into [`EngineInput`]s (by a task per socket on that
//! thread's runtime) and each step's outputs are encoded and written to the output sockets
//! (`play/outlet.rs`): no message crosses threads on its way in or out.

use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, Result};
use sim_protocol::dealer::{DealerReader, connect_to_frontend_direct};
use sim_protocol::decode::{DecodeLimits, decode_input_with};
use sim_protocol::transport::ConnectOptions;
use tokio::sync::{mpsc, watch};

use super::config::PlayConfig;
use super::outlet::EngineOutlet;
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

/// How long the engine's last outputs may wait for the frontend to read them at the end
/// (vLLM's output sockets linger 4 s).
const LINGER: Duration = Duration::from_secs(4);

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
    let connect = connect_to_frontend_direct(&cfg.handshake_address, rank, &ready, &opts);
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
    let (jobs_tx, jobs_rx) = mpsc::unbounded_channel::<Outbound>();
    let inputs = sockets.inputs;
    let limits = cfg.decode_limits;
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
    let jobs_task = tokio::spawn(jobs_task(jobs_rx, side_tx.clone(), plane.clone()));
    let streams = sockets.outputs;

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
    let engine_thread = std::thread::Builder::new()
        .name(format!("engine-{rank}"))
        .spawn(move || -> Result<(LoopExit, SimEngine, Option<String>)> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("engine runtime")?;
            let mut outlet = {
                let _in_rt = rt.enter();
                // the input sockets are read by tasks on this thread's runtime: a request
                // reaches the loop's channel with no cross-thread wake-up
                for (i, conn) in inputs.into_iter().enumerate() {
                    let reader = DealerReader::new(conn, max_input_message(&limits))
                        .context("registering the input sockets")?;
                    rt.spawn(input_task(i as u32, reader, in_tx.clone(), limits));
                }
                drop(in_tx);
                EngineOutlet::new(line, streams, jobs_tx, side_tx)
                    .context("registering the output sockets")?
            };
            let mut engine = engine;
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                rt.block_on(run_loop(&mut engine, &mut in_rx, &mut outlet, ctl))
            }));
            match run {
                Ok(exit) => {
                    rt.block_on(outlet.linger(LINGER));
                    let failure = outlet.failure().map(str::to_string);
                    Ok((exit, engine, failure))
                }
                Err(panic) => {
                    // A fatal engine error: tell the frontend the way vLLM does.
                    rt.block_on(outlet.send_dead());
                    std::panic::resume_unwind(panic)
                }
            }
        })
        .context("spawning the engine thread")?;

    let joined = tokio::task::spawn_blocking(move || engine_thread.join())
        .await
        .context("joining the engine thread")?;
    let result = match joined {
        Ok(Ok((exit, mut engine, failure))) => {
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
                LoopExit::OutputsClosed => Err(anyhow::anyhow!(
                    "the output side stopped: {}",
                    failure.as_deref().unwrap_or("unknown")
                )),
            }
        }
        Ok(Err(e)) => Err(e),
        Err(panic) => {
            // the engine thread sent ENGINE_CORE_DEAD before it ended
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(anyhow::anyhow!("engine thread panicked: {what}"))
        }
    };
    jobs_task.abort();
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

/// The largest input message read off a socket: the payload frame --max-frame-size allows
/// (one over it is refused by the decoder, with an error the frontend shows) and as much
/// again for its tensor frames. A message past this closes the socket.
fn max_input_message(limits: &DecodeLimits) -> u64 {
    u64::try_from(limits.max_frame_bytes)
        .unwrap_or(u64::MAX)
        .saturating_mul(2)
        .saturating_add(1 << 20)
}

async fn input_task(
    client: u32,
    mut reader: DealerReader,
    tx: mpsc::UnboundedSender<EngineInput>,
    limits: DecodeLimits,
) {
    loop {
        let frames = match reader.recv().await {
            Ok(Some(frames)) => frames,
            Ok(None) => {
                tracing::warn!(client, "the frontend closed its input socket");
                return;
            }
            Err(e) => {
                let hint = match e {
                    sim_protocol::zmtp::ZmtpError::TooLarge { .. } => {
                        " (the bound is twice --max-frame-size plus 1 MiB)"
                    }
                    _ => "",
                };
                tracing::error!(client, "input socket closed: {e}{hint}");
                return;
            }
        };
        let input = match decode_input_with(&frames, &limits) {
            Ok(msg) => EngineInput::Message { client, msg },
            Err(error) => EngineInput::Bad { client, error },
        };
        if tx.send(input).is_err() {
            return;
        }
    }
}

/// Run the pulls and grammar compiles the engine hands out, on this (the io) runtime.
async fn jobs_task(
    mut rx: mpsc::UnboundedReceiver<Outbound>,
    side: mpsc::UnboundedSender<EngineInput>,
    plane: std::sync::Arc<dyn crate::play::pd::data_plane::DataPlane>,
) {
    while let Some(item) = rx.recv().await {
        match item {
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
            // the engine thread's outlet writes these itself
            Outbound::Outputs { .. } | Outbound::Dead => {}
        }
    }
}
