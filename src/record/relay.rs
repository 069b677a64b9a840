//! The relay half of the tap: it owns every socket, stands in the middle of the handshake
//! and forwards every frame unchanged, handing a copy of each (with its arrival time) to
//! the observer over a channel that never blocks.
//!
//! ```text
//!  frontend (binds H, I[c], O[c])          tap                      engine(s)
//!  H  ROUTER  <-- DEALER id=rank --  [handshake task]  <-- ROUTER Ht <-- DEALER id=rank
//!  I[c] ROUTER <- DEALER id=rank --  [input task c]    <-- ROUTER It[c] <-- DEALER id=rank
//!  O[c] PULL  <-- PUSH  -----------  [output task c]   <-- PULL  Ot[c] <-- PUSH
//! ```
//!
//! What the tap changes on the wire: only the `inputs` and `outputs` lists of INIT, so that
//! the engine connects its data sockets to the tap (it learns them nowhere else). Every
//! other frame — HELLO, READY, the ready response, requests, outputs, utility calls, the
//! `ENGINE_CORE_DEAD` sentinel — is forwarded byte for byte, with the engine's own ZMQ
//! identity on each DEALER the tap opens towards the frontend, so the frontend sees the
//! same identities it would see without the tap. The DP coordinator and KV-event
//! addresses are not rewritten: engines reach those directly.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::mpsc::Sender as StdSender;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use bytes::Bytes;
use futures_util::StreamExt;
use sim_protocol::ENGINE_CORE_DEAD;
use sim_protocol::ready::{HandshakeInit, StatusMessage, rewrite_init_addresses};
use sim_protocol::transport::{
    bind_address, bind_pull, bind_router, connect_address, connect_retrying, socket_options,
    tcp_host,
};
use tokio::sync::{Mutex, mpsc};
use tokio::task::JoinHandle;
use zeromq::{
    DealerRecvHalf, DealerSendHalf, DealerSocket, PullSocket, PushSocket, RouterRecvHalf,
    RouterSendHalf, RouterSocket, Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage,
};

use crate::play::timer::now_monotonic;

/// Where the tap sits.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// The frontend's handshake address (the tap connects to it, as an engine would).
    pub frontend_handshake: String,
    /// Where engines connect (the tap binds it, as a frontend would).
    pub engine_handshake: String,
    /// Host advertised to engines for the tap's data sockets (default: the engine
    /// handshake host, or 127.0.0.1 when that is a wildcard).
    pub advertise_host: Option<String>,
    /// How long to wait for the frontend's sockets to accept a connection.
    pub connect_timeout: Duration,
}

/// A copy of what crossed the tap, for the observer. `t` is the tap's receive time on the
/// monotonic clock (seconds), taken before the frame is forwarded.
#[derive(Debug)]
pub enum Seen {
    /// An engine's ready response on client `client`'s input socket.
    Ready {
        engine: Bytes,
        client: usize,
        payload: Bytes,
    },
    /// A frontend → engine message `[type, payload, aux…]`.
    Input {
        t: f64,
        client: usize,
        engine: Bytes,
        frames: Vec<Bytes>,
    },
    /// An engine → frontend message `[payload, aux…]`.
    Output {
        t: f64,
        client: usize,
        frames: Vec<Bytes>,
    },
    /// An engine's connection closed.
    EngineGone { engine: Bytes },
    /// The capture ends; in-flight requests are written as incomplete with this reason.
    Stop { reason: String },
}

/// Lifecycle events for the supervisor.
#[derive(Debug)]
pub enum Event {
    /// An engine's READY was relayed: it is attached.
    EngineReady(Bytes),
    /// An engine's data connection closed.
    EngineGone(Bytes),
    /// A connection to the frontend closed (what closed).
    FrontendGone(String),
    /// `ENGINE_CORE_DEAD` was relayed.
    EngineDead,
    /// The relay cannot go on.
    Failed(anyhow::Error),
}

struct Ctx {
    cfg: RelayConfig,
    frontend_handshake: String,
    bind_host: String,
    advertise_host: String,
    seen: StdSender<Seen>,
    events: mpsc::UnboundedSender<Event>,
    tasks: std::sync::Mutex<Vec<JoinHandle<()>>>,
    /// Turns true when every engine is gone: the output relays tell the frontend with
    /// `ENGINE_CORE_DEAD`, as an engine that dies does, so its clients do not hang.
    engines_gone: tokio::sync::watch::Sender<bool>,
}

impl Ctx {
    fn spawn<F>(&self, f: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let handle = tokio::spawn(f);
        if let Ok(mut tasks) = self.tasks.lock() {
            tasks.retain(|t| !t.is_finished());
            tasks.push(handle);
        }
    }

    fn event(&self, e: Event) {
        let _ = self.events.send(e);
    }

    /// Hand a copy to the observer; never blocks (the channel is unbounded).
    fn observe(&self, s: Seen) {
        let _ = self.seen.send(s);
    }
}

/// The running relay. Dropping it (or [`Tap::stop`]) stops every relay task.
pub struct Tap {
    ctx: Arc<Ctx>,
    engine_handshake: String,
}

impl Tap {
    /// The resolved address engines connect to.
    pub fn engine_handshake(&self) -> &str {
        &self.engine_handshake
    }

    /// Every engine is gone: send the frontend `ENGINE_CORE_DEAD` on every output socket
    /// (vLLM's own signal of a dead engine; the frontend fails its requests instead of
    /// waiting forever). Give it a moment to go out before [`Tap::stop`].
    pub fn tell_frontend_engine_dead(&self) {
        let _ = self.ctx.engines_gone.send(true);
    }

    /// Stop relaying: abort every task (closing the sockets they own).
    pub fn stop(&self) {
        if let Ok(mut tasks) = self.ctx.tasks.lock() {
            for t in tasks.drain(..) {
                t.abort();
            }
        }
    }
}

impl Drop for Tap {
    fn drop(&mut self) {
        self.stop();
    }
}

fn is_wildcard(host: &str) -> bool {
    matches!(host, "0.0.0.0" | "[::]" | "::" | "*")
}

/// Bind the engine handshake socket and start relaying.
pub async fn start(
    cfg: RelayConfig,
    seen: StdSender<Seen>,
    events: mpsc::UnboundedSender<Event>,
) -> Result<Tap> {
    let frontend_handshake =
        connect_address(&cfg.frontend_handshake).context("--frontend-handshake")?;
    let bind = bind_address(&cfg.engine_handshake).context("--engine-handshake")?;
    let bind_host = tcp_host(&bind)
        .ok_or_else(|| anyhow!("--engine-handshake must be a tcp:// address, got {bind}"))?
        .to_string();
    let (eh, resolved) = bind_router(&bind)
        .await
        .with_context(|| format!("binding the engine handshake socket at {bind}"))?;
    let advertise_host = match &cfg.advertise_host {
        Some(h) => h.clone(),
        None if is_wildcard(&bind_host) => "127.0.0.1".to_string(),
        None => bind_host.clone(),
    };
    let ctx = Arc::new(Ctx {
        cfg,
        frontend_handshake,
        bind_host,
        advertise_host,
        seen,
        events,
        tasks: std::sync::Mutex::new(Vec::new()),
        engines_gone: tokio::sync::watch::channel(false).0,
    });
    let c = ctx.clone();
    ctx.spawn(async move {
        if let Err(e) = handshake_loop(&c, eh).await {
            c.event(Event::Failed(e.context("the handshake relay failed")));
        }
    });
    Ok(Tap {
        ctx,
        engine_handshake: resolved,
    })
}

fn msg(frames: Vec<Bytes>) -> Result<ZmqMessage> {
    ZmqMessage::try_from(frames).map_err(|_| anyhow!("cannot relay a message with no frames"))
}

fn status_of(payload: &[u8]) -> Option<String> {
    StatusMessage::decode(payload).ok().map(|s| s.status)
}

fn hex_id(id: &[u8]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

/// The addresses of the data plane: the frontend's, and the tap's that replace them in
/// INIT.
struct Plane {
    frontend_inputs: Vec<String>,
    frontend_outputs: Vec<String>,
    tap_inputs: Vec<String>,
    tap_outputs: Vec<String>,
}

/// Relay the handshake: HELLO/READY from engines to the frontend on a DEALER carrying the
/// engine's identity, INIT back with the data addresses rewritten. Runs for the tap's whole
/// life, so engines may join at any time.
async fn handshake_loop(ctx: &Arc<Ctx>, mut eh: RouterSocket) -> Result<()> {
    let (from_frontend_tx, mut from_frontend) = mpsc::unbounded_channel::<(Bytes, Vec<Bytes>)>();
    let mut to_frontend: HashMap<Bytes, DealerSendHalf> = HashMap::new();
    let mut plane: Option<Plane> = None;
    loop {
        tokio::select! {
            m = eh.recv() => {
                let mut frames = m.context("receiving on the engine handshake socket")?.into_vec();
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
                eh.send(msg(all)?)
                    .await
                    .context("forwarding a handshake message to the engine")?;
            }
        }
    }
}

fn port_of(endpoint: &str) -> Result<&str> {
    endpoint
        .rsplit_once(':')
        .map(|(_, p)| p)
        .ok_or_else(|| anyhow!("no port in the bound endpoint {endpoint}"))
}

/// Report a peer's disconnects as `event(peer)`.
fn watch_disconnects<M, F>(ctx: &Arc<Ctx>, mut monitor: M, on_gone: F)
where
    M: futures_util::Stream<Item = SocketEvent> + Unpin + Send + 'static,
    F: Fn(&Ctx, Bytes) + Send + Sync + 'static,
{
    let c = ctx.clone();
    ctx.spawn(async move {
        while let Some(ev) = monitor.next().await {
            if let SocketEvent::Disconnected(peer) = ev {
                on_gone(&c, Bytes::from(peer));
            }
        }
    });
}

/// Bind the tap's data sockets (one input ROUTER and output PULL per frontend client),
/// connect the output PUSHes to the frontend and start the data relay tasks.
async fn build_plane(ctx: &Arc<Ctx>, init: &HandshakeInit) -> Result<Plane> {
    let base = format!("tcp://{}:0", ctx.bind_host);
    let mut plane = Plane {
        frontend_inputs: init.inputs.clone(),
        frontend_outputs: init.outputs.clone(),
        tap_inputs: Vec::new(),
        tap_outputs: Vec::new(),
    };
    for (client, (f_in, f_out)) in init.inputs.iter().zip(&init.outputs).enumerate() {
        let f_in = connect_address(f_in)?;
        let f_out = connect_address(f_out)?;
        let (mut from_engines, in_ep) = bind_router(&base).await?;
        let (pull, out_ep) = bind_pull(&base).await?;
        plane
            .tap_inputs
            .push(format!("tcp://{}:{}", ctx.advertise_host, port_of(&in_ep)?));
        plane.tap_outputs.push(format!(
            "tcp://{}:{}",
            ctx.advertise_host,
            port_of(&out_ep)?
        ));

        let mut push = PushSocket::with_options(socket_options(None)?);
        connect_retrying(
            &mut push,
            &f_out,
            ctx.cfg.connect_timeout,
            "frontend's output socket",
            false,
        )
        .await?;

        watch_disconnects(ctx, from_engines.monitor(), |c, peer| {
            c.observe(Seen::EngineGone {
                engine: peer.clone(),
            });
            c.event(Event::EngineGone(peer));
        });
        let (send, recv) = from_engines.split();
        let to_engines = Arc::new(Mutex::new(send));
        let c = ctx.clone();
        ctx.spawn(async move {
            if let Err(e) = input_relay(&c, client, recv, to_engines, f_in).await {
                c.event(Event::Failed(e));
            }
        });
        let c = ctx.clone();
        ctx.spawn(async move {
            if let Err(e) = output_relay(&c, client, pull, push).await {
                c.event(Event::Failed(e));
            }
        });
    }
    Ok(plane)
}

/// Engines → frontend on client `client`'s input socket: each engine's ready response
/// (the first and normally only message), forwarded on a DEALER with the engine's identity
/// that is opened on first sight; that DEALER's reader relays the frontend's requests back.
async fn input_relay(
    ctx: &Arc<Ctx>,
    client: usize,
    mut from_engines: RouterRecvHalf,
    to_engines: Arc<Mutex<RouterSendHalf>>,
    frontend_input: String,
) -> Result<()> {
    let mut to_frontend: HashMap<Bytes, DealerSendHalf> = HashMap::new();
    loop {
        let m = from_engines
            .recv()
            .await
            .with_context(|| format!("receiving on the tap's input socket {client}"))?;
        let mut frames = m.into_vec();
        if frames.len() < 2 {
            continue;
        }
        let identity = frames.remove(0);
        let first = !to_frontend.contains_key(&identity);
        if first {
            let mut dealer = DealerSocket::with_options(socket_options(Some(&identity))?);
            watch_disconnects(ctx, dealer.monitor(), move |c, _| {
                c.event(Event::FrontendGone(format!("input socket {client}")));
            });
            connect_retrying(
                &mut dealer,
                &frontend_input,
                ctx.cfg.connect_timeout,
                "frontend's input socket",
                false,
            )
            .await?;
            let (send, recv) = dealer.split();
            let c = ctx.clone();
            let id = identity.clone();
            let to_engines = to_engines.clone();
            ctx.spawn(async move { frontend_reader(&c, client, id, recv, to_engines).await });
            to_frontend.insert(identity.clone(), send);
        }
        let payload = frames.first().cloned().unwrap_or_default();
        if let Some(sender) = to_frontend.get_mut(&identity) {
            sender
                .send(msg(frames)?)
                .await
                .with_context(|| format!("forwarding to the frontend's input socket {client}"))?;
        }
        if first {
            ctx.observe(Seen::Ready {
                engine: identity,
                client,
                payload,
            });
        } else {
            tracing::debug!(client, "relayed an engine message on an input socket");
        }
    }
}

/// Frontend → engine `identity` on client `client`'s input socket.
async fn frontend_reader(
    ctx: &Arc<Ctx>,
    client: usize,
    identity: Bytes,
    mut recv: DealerRecvHalf,
    to_engines: Arc<Mutex<RouterSendHalf>>,
) {
    while let Ok(mut m) = recv.recv().await {
        let t = now_monotonic();
        let frames: Vec<Bytes> = m.iter().cloned().collect();
        m.push_front(identity.clone());
        let sent = to_engines.lock().await.send(m).await;
        if let Err(e) = sent {
            tracing::warn!(
                client,
                engine = %hex_id(&identity),
                "cannot forward a request to the engine ({e}); it is gone"
            );
            ctx.event(Event::EngineGone(identity.clone()));
        }
        ctx.observe(Seen::Input {
            t,
            client,
            engine: identity.clone(),
            frames,
        });
    }
}

/// Engines → frontend on client `client`'s output socket.
async fn output_relay(
    ctx: &Arc<Ctx>,
    client: usize,
    mut from_engines: PullSocket,
    mut to_frontend: PushSocket,
) -> Result<()> {
    let mut gone = ctx.engines_gone.subscribe();
    loop {
        let m = tokio::select! {
            m = from_engines.recv() => {
                m.with_context(|| format!("receiving on the tap's output socket {client}"))?
            }
            _ = async { gone.wait_for(|g| *g).await.is_ok() } => {
                tracing::warn!(client, "telling the frontend the engine is dead (ENGINE_CORE_DEAD)");
                let dead = ZmqMessage::from(Bytes::from_static(ENGINE_CORE_DEAD));
                let _ = to_frontend.send(dead).await;
                // once is enough; keep the socket open until the tap stops
                std::future::pending::<()>().await;
                unreachable!()
            }
        };
        let t = now_monotonic();
        let frames: Vec<Bytes> = m.iter().cloned().collect();
        let dead = frames.len() == 1 && frames[0].as_ref() == ENGINE_CORE_DEAD;
        if let Err(e) = to_frontend.send(m).await {
            ctx.event(Event::FrontendGone(format!("output socket {client} ({e})")));
        }
        ctx.observe(Seen::Output { t, client, frames });
        if dead {
            ctx.event(Event::EngineDead);
        }
    }
}
