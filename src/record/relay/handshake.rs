//! The handshake relay: HELLO and READY from engines to the frontend, INIT back with the
//! data addresses rewritten to the tap's.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{Context, Result, anyhow};
use bytes::Bytes;
use sim_protocol::listener::{PeerLimits, ZmtpRouter};
use sim_protocol::ready::{HandshakeInit, StatusMessage, rewrite_init_addresses};
use sim_protocol::transport::{connect_retrying, socket_options};
use tokio::sync::mpsc;
use zeromq::{DealerSendHalf, DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::ctx::{Ctx, Event, hex_id};
use super::plane::{Plane, build_plane};

fn msg(frames: Vec<Bytes>) -> Result<ZmqMessage> {
    ZmqMessage::try_from(frames).map_err(|_| anyhow!("cannot relay a message with no frames"))
}

fn status_of(payload: &[u8]) -> Option<String> {
    StatusMessage::decode(payload).ok().map(|s| s.status)
}

/// What an engine may send on the handshake socket: HELLO and READY are status messages
/// of a few hundred bytes (READY may carry the engine's KV-cache config); 4 MiB is far
/// above them and bounds what a stranger on the port can make the tap hold.
pub(super) fn handshake_limits() -> PeerLimits {
    PeerLimits::control(4 << 20)
}

/// Relay the handshake: HELLO/READY from engines to the frontend on a DEALER carrying the
/// engine's identity, INIT back with the data addresses rewritten. Runs for the tap's whole
/// life, so engines may join at any time.
pub(super) async fn handshake_loop(ctx: &Arc<Ctx>, mut eh: ZmtpRouter) -> Result<()> {
    let (from_frontend_tx, mut from_frontend) = mpsc::unbounded_channel::<(Bytes, Vec<Bytes>)>();
    let mut to_frontend: HashMap<Bytes, DealerSendHalf> = HashMap::new();
    let mut plane: Option<Plane> = None;
    loop {
        tokio::select! {
            m = eh.recv() => {
                let mut frames = m.context("the engine handshake socket stopped")?;
                if frames.len() < 2 {
                    tracing::warn!("ignoring a handshake message without payload");
                    continue;
                }
                let identity = frames.remove(0);
                let status = frames.last().and_then(|p| status_of(p));
                tracing::info!(
                    engine = %hex_id(&identity),
                    status = status.as_deref().unwrap_or("?"),
                    "engine handshake message"
                );
                if !to_frontend.contains_key(&identity) {
                    let mut dealer = DealerSocket::with_options(socket_options(Some(&identity))?);
                    tracing::info!(
                        "connecting to the frontend's handshake socket at {}",
                        ctx.frontend_handshake
                    );
                    connect_retrying(
                        &mut dealer,
                        &ctx.frontend_handshake,
                        ctx.cfg.connect_timeout,
                        "frontend's handshake socket",
                        true,
                    )
                    .await?;
                    let (send, mut recv) = dealer.split();
                    let tx = from_frontend_tx.clone();
                    let id = identity.clone();
                    ctx.spawn(async move {
                        while let Ok(m) = recv.recv().await {
                            if tx.send((id.clone(), m.into_vec())).is_err() {
                                break;
                            }
                        }
                    });
                    to_frontend.insert(identity.clone(), send);
                }
                if let Some(sender) = to_frontend.get_mut(&identity) {
                    sender
                        .send(msg(frames)?)
                        .await
                        .context("forwarding a handshake message to the frontend")?;
                }
                if status.as_deref() == Some("READY") {
                    ctx.event(Event::EngineReady(identity));
                }
            }
            Some((identity, mut frames)) = from_frontend.recv() => {
                let init = frames.last().and_then(|p| HandshakeInit::decode(p).ok());
                if let Some(init) = init {
                    let p = match &plane {
                        Some(p) => {
                            if p.frontend_inputs != init.inputs || p.frontend_outputs != init.outputs {
                                return Err(anyhow!(
                                    "the frontend sent a second INIT with different data addresses ({:?} / {:?}, before {:?} / {:?})",
                                    init.inputs, init.outputs, p.frontend_inputs, p.frontend_outputs
                                ));
                            }
                            p
                        }
                        None => plane.insert(build_plane(ctx, &init).await?),
                    };
                    let last = frames.len() - 1;
                    let (rewritten, _) =
                        rewrite_init_addresses(&frames[last], &p.tap_inputs, &p.tap_outputs)
                            .context("rewriting INIT")?;
                    frames[last] = Bytes::from(rewritten);
                    tracing::info!(
                        engine = %hex_id(&identity),
                        frontend_inputs = ?p.frontend_inputs,
                        tap_inputs = ?p.tap_inputs,
                        "relayed INIT with the tap's data addresses"
                    );
                }
                let mut all = Vec::with_capacity(frames.len() + 1);
                all.push(identity);
                all.extend(frames);
                if !eh.send(all) {
                    tracing::warn!(
                        "cannot forward a handshake message to the engine: its connection is gone"
                    );
                }
            }
        }
    }
}
