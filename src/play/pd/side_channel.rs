//! The P/D side channel on real sockets: a prefill engine's ROUTER (where decode engines
//! say they read a request's KV) and a decode engine's pulls (see `pd.rs`).

use std::time::Duration;

use bytes::Bytes;
use sim_protocol::listener::{PeerLimits, ZmtpRouter};
use sim_protocol::transport::{recv_frames, send_frames, socket_options};
use tokio::sync::{mpsc, oneshot, watch};
use zeromq::{DealerSocket, Socket};

use std::sync::Arc;

use super::connector_stats::{KvTransfer, Transfer};
use super::data_plane::{self, DataPlane, PullStats};
use crate::play::engine::engine_core::EngineInput;
use crate::play::pd::{PdEvent, Pull, wire};

/// What one side-channel peer may send: a read names a request and its block ids (about
/// 5 bytes each), so 1 MiB is ~200,000 blocks, far past any context; a NIXL handshake
/// request is a few bytes.
pub fn peer_limits() -> PeerLimits {
    PeerLimits::control(1 << 20)
}

/// Serve the side channel on `router` (bound at the side-channel address) until shutdown:
/// vLLM's handshake (`get_meta_msg`) is answered with the data plane's agent metadata,
/// each `vcr_read` goes to the engine, and its answer back to the reader.
pub async fn serve(
    mut router: ZmtpRouter,
    engine: mpsc::UnboundedSender<EngineInput>,
    plane: Arc<dyn DataPlane>,
    mut shutdown: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let mut warned_nixl = false;
    loop {
        let frames = tokio::select! {
            _ = shutdown.wait_for(|v| *v) => return Ok(()),
            f = router.recv() => match f {
                Some(f) => f,
                None => return Ok(()),
            },
        };
        // [identity, (empty delimiter of a REQ peer), payload]
        let Some(identity) = frames.first().cloned() else {
            continue;
        };
        let req_peer = frames.len() >= 3 && frames[1].is_empty();
        let Some(payload) = frames.last() else {
            continue;
        };
        if data_plane::is_get_meta_msg(payload) {
            let Some(handshake) = plane.handshake() else {
                if !warned_nixl {
                    warned_nixl = true;
                    tracing::warn!(
                        "a NIXL peer asked this prefill engine for its agent metadata, but its data plane is {} (no NIXL agent: a build without the `nixl` feature, or NIXL did not start); the peer's handshake will time out",
                        plane.name()
                    );
                }
                continue;
            };
            // vLLM's answer to a REQ peer: [identity, "", payload, msgpack(perf_counter)]
            let mut out = vec![identity];
            if req_peer {
                out.push(Bytes::new());
            }
            out.push(Bytes::from(handshake));
            out.push(Bytes::from(perf_counter_msgpack()));
            if !router.send(out) {
                tracing::warn!("P/D side channel: the peer that asked for the handshake is gone");
            }
            continue;
        }
        let answer = match wire::parse_read(payload) {
            Ok((engine_id, request_id, block_ids)) => {
                let (reply, rx) = oneshot::channel();
                let ev = PdEvent::Read {
                    engine_id,
                    request_id,
                    block_ids,
                    reply,
                };
                if engine.send(EngineInput::Pd(ev)).is_err() {
                    return Ok(()); // the engine stopped
                }
                rx.await
                    .unwrap_or_else(|_| Err("the prefill engine stopped".into()))
            }
            Err(e) => Err(format!("bad side-channel message: {e}")),
        };
        let mut out = vec![identity];
        if req_peer {
            out.push(Bytes::new());
        }
        out.push(Bytes::from(wire::answer(&answer)));
        if !router.send(out) {
            tracing::warn!("P/D side channel: the reader is gone before its answer");
        }
    }
}

/// `msgpack(float)`: this process's monotonic clock in seconds (vLLM's handshake answer
/// carries the peer's `time.perf_counter()` to estimate the clock offset).
fn perf_counter_msgpack() -> Vec<u8> {
    let now = crate::play::engine::timer::monotonic_seconds();
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, &rmpv::Value::F64(now)).expect("a Vec");
    buf
}

/// Prefill side of a NIXL plane: each READ's completion notification frees the request's
/// blocks (as vLLM's connector frees them on `"<request id>:<readers>"`).
pub async fn watch_reads(
    plane: Arc<dyn DataPlane>,
    engine: mpsc::UnboundedSender<EngineInput>,
    shutdown: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !*shutdown.borrow() {
        tick.tick().await;
        for (agent, msg) in plane.take_read_notifications() {
            let Some(request_id) = data_plane::notification_request(&msg) else {
                tracing::warn!(%agent, "an unexpected NIXL notification {msg:?}");
                continue;
            };
            let (reply, _) = oneshot::channel();
            let ev = PdEvent::Read {
                engine_id: agent,
                request_id: request_id.to_string(),
                block_ids: Vec::new(),
                reply,
            };
            if engine.send(EngineInput::Pd(ev)).is_err() {
                return;
            }
        }
    }
}

/// Make one pull and report it to the engine: with a plane that moves bytes, the
/// handshake (once per prefill engine) and a verified READ; otherwise one `vcr_read`.
pub async fn pull(p: Pull, engine: mpsc::UnboundedSender<EngineInput>, plane: Arc<dyn DataPlane>) {
    let (result, transfer) = if plane.moves_bytes() {
        // the handshake and the READ are bounded one by one: a first READ from a peer
        // pays UCX's connection set-up, seconds on a loaded machine
        match read_bytes(&p, plane).await {
            Ok(stats) => (
                Ok(stats.blocks),
                Transfer::Done(KvTransfer {
                    seconds: stats.elapsed.as_secs_f64(),
                    bytes: stats.bytes as u64,
                    descriptors: stats.descriptors as u64,
                }),
            ),
            Err(e) => (Err(e), Transfer::Failed),
        }
    } else {
        (answered_within(&p, read_once(&p)).await, Transfer::None)
    };
    let _ = engine.send(EngineInput::Pd(PdEvent::Pulled {
        request_id: p.request_id,
        result,
        transfer,
    }));
}

/// `work`, or the error that the prefill engine did not answer within the pull's timeout.
async fn answered_within<T>(
    p: &Pull,
    work: impl std::future::Future<Output = Result<T, String>>,
) -> Result<T, String> {
    match tokio::time::timeout(p.timeout, work).await {
        Ok(r) => r,
        Err(_) => Err(format!(
            "the prefill engine {} at {}:{} did not answer within {:?}",
            p.remote.engine_id, p.remote.host, p.remote.port, p.timeout
        )),
    }
}

/// The NIXL path: fetch the prefill engine's handshake if this plane has not loaded its
/// agent yet, then READ and verify the blocks (on a blocking thread).
async fn read_bytes(p: &Pull, plane: Arc<dyn DataPlane>) -> Result<PullStats, String> {
    let address = format!("tcp://{}:{}", p.remote.host, p.remote.port);
    // a peer is its engine at its address: a prefill engine restarted on the same port
    // has a new engine id (and a new agent), so it is handshaken again, as vLLM keys its
    // remote agents by engine id
    let peer = format!("{}@{address}", p.remote.engine_id);
    let handshake = if plane.knows_peer(&peer) {
        None
    } else {
        Some(answered_within(p, fetch_handshake(&address)).await?)
    };
    let remote = p.remote.clone();
    let timeout = p.timeout;
    let stats = tokio::task::spawn_blocking(move || {
        plane.read(
            &peer,
            handshake.as_deref(),
            &remote.request_id,
            &remote.block_ids,
            timeout,
        )
    })
    .await
    .map_err(|e| format!("the NIXL read task failed: {e}"))?
    .map_err(|e| {
        format!(
            "NIXL read of {} from the prefill engine {} ({address}): {e}",
            p.remote.request_id, p.remote.engine_id
        )
    })?;
    let secs = stats.elapsed.as_secs_f64();
    let rate = format!(
        "{:.2}",
        if secs > 0.0 {
            stats.bytes as f64 / secs / 1e9
        } else {
            0.0
        }
    );
    match &stats.digest {
        None => tracing::info!(
            request_id = %p.request_id,
            prefill_request = %p.remote.request_id,
            blocks = stats.blocks,
            bytes = stats.bytes,
            gb_per_s = %rate,
            "NIXL READ done: every byte verified"
        ),
        // a vLLM prefill engine's KV: what was read, for whoever holds the source
        Some(sha256) => tracing::info!(
            request_id = %p.request_id,
            prefill_request = %p.remote.request_id,
            blocks = stats.blocks,
            bytes = stats.bytes,
            gb_per_s = %rate,
            %sha256,
            "NIXL READ done: a vLLM engine's KV, digested"
        ),
    }
    Ok(stats)
}

/// vLLM's handshake as a REQ peer does it: `get_meta_msg` out, `[payload, perf_counter]`
/// back.
async fn fetch_handshake(address: &str) -> Result<Vec<u8>, String> {
    // as a REQ peer: an empty delimiter first; back come ["", payload, perf_counter]
    let frames = round_trip(
        address,
        vec![Bytes::new(), Bytes::from(data_plane::get_meta_msg())],
    )
    .await?;
    let payload = frames
        .iter()
        .find(|f| !f.is_empty())
        .ok_or("an empty handshake answer")?;
    Ok(payload.to_vec())
}

async fn read_once(p: &Pull) -> Result<usize, String> {
    let address = format!("tcp://{}:{}", p.remote.host, p.remote.port);
    let msg = wire::read(&p.engine_id, &p.remote.request_id, &p.remote.block_ids);
    let frames = round_trip(&address, vec![Bytes::from(msg)]).await?;
    let answer = frames.last().ok_or("an empty answer")?;
    wire::parse_answer(answer).map_err(|e| {
        format!(
            "the prefill engine {} refused the read of {}: {e}",
            p.remote.engine_id, p.remote.request_id
        )
    })
}

/// One request on a fresh DEALER to a prefill engine's side channel, and its answer.
async fn round_trip(address: &str, frames: Vec<Bytes>) -> Result<Vec<Bytes>, String> {
    let opts = socket_options(None).map_err(|e| e.to_string())?;
    let mut sock = DealerSocket::with_options(opts);
    sock.connect(address)
        .await
        .map_err(|e| format!("cannot reach the prefill engine's side channel {address}: {e}"))?;
    send_frames(&mut sock, frames)
        .await
        .map_err(|e| format!("side channel {address}: {e}"))?;
    recv_frames(&mut sock)
        .await
        .map_err(|e| format!("side channel {address}: {e}"))
}

/// How long a decode engine waits for a prefill engine's answer (vLLM's handshake
/// receive timeout).
pub const PULL_TIMEOUT: Duration = Duration::from_secs(5);
