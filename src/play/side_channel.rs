//! The P/D side channel on real sockets: a prefill engine's ROUTER (where decode engines
//! say they read a request's KV) and a decode engine's pulls (see `pd.rs`).

use std::time::Duration;

use bytes::Bytes;
use sim_protocol::transport::{recv_frames, send_frames, socket_options};
use tokio::sync::{mpsc, oneshot, watch};
use zeromq::{DealerSocket, RouterSocket, Socket};

use super::engine_core::EngineInput;
use super::pd::{PdEvent, Pull, wire};

/// vLLM's handshake request (`GET_META_MSG`): a NIXL peer asking for agent metadata.
const GET_META_MSG: &[u8] = b"get_meta_msg";

/// Serve the side channel on `router` (bound at the side-channel address) until shutdown:
/// each `vcr_read` goes to the engine, and its answer back to the reader.
pub async fn serve(
    mut router: RouterSocket,
    engine: mpsc::UnboundedSender<EngineInput>,
    mut shutdown: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let mut warned_nixl = false;
    loop {
        let frames = tokio::select! {
            _ = shutdown.wait_for(|v| *v) => return Ok(()),
            f = recv_frames(&mut router) => match f {
                Ok(f) => f,
                Err(e) => {
                    tracing::warn!("P/D side channel: {e}");
                    continue;
                }
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
        if payload
            .windows(GET_META_MSG.len())
            .any(|w| w == GET_META_MSG)
        {
            if !warned_nixl {
                warned_nixl = true;
                tracing::warn!(
                    "a vLLM NIXL peer asked this prefill engine for its agent metadata: the no-op data plane has no NIXL agent to describe (see docs/pd.md); its handshake will time out"
                );
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
        if let Err(e) = send_frames(&mut router, out).await {
            tracing::warn!("P/D side channel: answering a reader: {e}");
        }
    }
}

/// Make one pull and report it to the engine.
pub async fn pull(p: Pull, engine: mpsc::UnboundedSender<EngineInput>) {
    let result = match tokio::time::timeout(p.timeout, read_once(&p)).await {
        Ok(r) => r,
        Err(_) => Err(format!(
            "the prefill engine {} at {}:{} did not answer within {:?}",
            p.remote.engine_id, p.remote.host, p.remote.port, p.timeout
        )),
    };
    let _ = engine.send(EngineInput::Pd(PdEvent::Pulled {
        request_id: p.request_id,
        result,
    }));
}

async fn read_once(p: &Pull) -> Result<usize, String> {
    let opts = socket_options(None).map_err(|e| e.to_string())?;
    let mut sock = DealerSocket::with_options(opts);
    let address = format!("tcp://{}:{}", p.remote.host, p.remote.port);
    sock.connect(&address)
        .await
        .map_err(|e| format!("cannot reach the prefill engine's side channel {address}: {e}"))?;
    let msg = wire::read(&p.engine_id, &p.remote.request_id, &p.remote.block_ids);
    send_frames(&mut sock, vec![Bytes::from(msg)])
        .await
        .map_err(|e| format!("side channel {address}: {e}"))?;
    let frames = recv_frames(&mut sock)
        .await
        .map_err(|e| format!("side channel {address}: {e}"))?;
    let answer = frames.last().ok_or("an empty answer")?;
    wire::parse_answer(answer).map_err(|e| {
        format!(
            "the prefill engine {} refused the read of {}: {e}",
            p.remote.engine_id, p.remote.request_id
        )
    })
}

/// How long a decode engine waits for a prefill engine's answer (vLLM's handshake
/// receive timeout).
pub const PULL_TIMEOUT: Duration = Duration::from_secs(5);
