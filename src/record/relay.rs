//! The relay half of the tap: it stands in the middle of the handshake, forwards every
//! data-plane message unchanged, and hands each (slices of the bytes it relayed, with its
//! arrival time) to the observer through a queue that never blocks ([`super::handoff`]).
//!
//! ```text
//!  frontend (binds H, I[c], O[c])          tap                      engine(s)
//!  H  ROUTER  <-- DEALER id=rank --  [handshake task]  <-- ROUTER Ht <-- DEALER id=rank
//!  I[c] ROUTER <- DEALER id=rank --  [input pipes c]   <-- "ROUTER" It[c] <-- DEALER id=rank
//!  O[c] PULL  <-- PUSH  -----------  [output pipes c]  <-- "PULL"  Ot[c] <-- PUSH
//! ```
//!
//! The handshake (a few messages per engine) goes through `zeromq` sockets. The data plane
//! does not: the tap speaks ZMTP itself on each data connection ([`sim_protocol::zmtp`]) and
//! relays whole messages as the bytes they arrived as, one write for everything a read
//! brought in. Per-engine input connections map one to one onto connections to the
//! frontend carrying the engine's identity; the output connections of several engines
//! (data parallel) merge into the one stream to the frontend, message by message.
//!
//! What the tap changes on the wire: only the `inputs` and `outputs` lists of INIT, so that
//! the engine connects its data sockets to the tap (it learns them nowhere else). Every
//! other message — HELLO, READY, the ready response, requests, outputs, utility calls, the
//! `ENGINE_CORE_DEAD` sentinel — is forwarded byte for byte, with the engine's own ZMQ
//! identity on the tap's connections towards the frontend, so the frontend sees the same
//! identities it would see without the tap. ZMTP commands (heartbeat PINGs) are answered
//! per connection, not forwarded. The DP coordinator and KV-event addresses are not
//! rewritten: engines reach those directly.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use bytes::{Buf, Bytes, BytesMut};
use sim_protocol::ENGINE_CORE_DEAD;
use sim_protocol::listener::{PeerLimits, ZmtpRouter};
use sim_protocol::ready::{HandshakeInit, StatusMessage, rewrite_init_addresses};
use sim_protocol::transport::{
    bind_address, connect_address, connect_retrying, socket_options, tcp_host,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Mutex, OwnedMutexGuard, mpsc};
use tokio::task::JoinHandle;
use tokio::time::timeout;
use zeromq::{DealerSendHalf, DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::handoff::SeenSender;
use sim_protocol::zmtp;

use crate::play::engine::timer::now_monotonic;

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
    /// Largest message (bytes) the data relay buffers whole, for the observer and for
    /// merging DP engines' outputs; a larger one is streamed through and not observed.
    pub max_message_bytes: u64,
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
    /// A message larger than `--max-frame-size` was relayed without being buffered, so it
    /// cannot be decoded.
    Streamed { what: String },
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
    /// `cfg.max_message_bytes`, at least enough for any frame header.
    max_frame: u64,
    frontend_handshake: String,
    bind_host: String,
    advertise_host: String,
    seen: SeenSender,
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

    /// Hand a copy to the observer; never blocks (the queue is unbounded).
    fn observe(&self, s: Seen) {
        self.seen.send(s);
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
    seen: SeenSender,
    events: mpsc::UnboundedSender<Event>,
) -> Result<Tap> {
    let frontend_handshake =
        connect_address(&cfg.frontend_handshake).context("--frontend-handshake")?;
    let bind = bind_address(&cfg.engine_handshake).context("--engine-handshake")?;
    let bind_host = tcp_host(&bind)
        .ok_or_else(|| anyhow!("--engine-handshake must be a tcp:// address, got {bind}"))?
        .to_string();
    let eh = ZmtpRouter::bind(&bind, "engine handshake", handshake_limits())
        .await
        .with_context(|| format!("binding the engine handshake socket at {bind}"))?;
    let resolved = eh.endpoint().to_string();
    let advertise_host = match &cfg.advertise_host {
        Some(h) => h.clone(),
        None if is_wildcard(&bind_host) => "127.0.0.1".to_string(),
        None => bind_host.clone(),
    };
    let ctx = Arc::new(Ctx {
        max_frame: cfg.max_message_bytes.max(1024),
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

/// What an engine may send on the handshake socket: HELLO and READY are status messages
/// of a few hundred bytes (READY may carry the engine's KV-cache config); 4 MiB is far
/// above them and bounds what a stranger on the port can make the tap hold.
fn handshake_limits() -> PeerLimits {
    PeerLimits::control(4 << 20)
}

/// Relay the handshake: HELLO/READY from engines to the frontend on a DEALER carrying the
/// engine's identity, INIT back with the data addresses rewritten. Runs for the tap's whole
/// life, so engines may join at any time.
async fn handshake_loop(ctx: &Arc<Ctx>, mut eh: ZmtpRouter) -> Result<()> {
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

fn port_of(endpoint: &str) -> Result<&str> {
    endpoint
        .rsplit_once(':')
        .map(|(_, p)| p)
        .ok_or_else(|| anyhow!("no port in the bound endpoint {endpoint}"))
}

// ---- the data plane, relayed as bytes ----------------------------------------------------
//
// Each data connection is a ZMTP session of its own: the tap greets the engine as the
// frontend's socket type (ROUTER, PULL) and the frontend as the engine's (DEALER with the
// engine's identity, PUSH), then forwards whole messages as the bytes they arrived as. A
// zeromq-crate socket per hop cost ~30 µs and one message per send; a read of many messages
// now leaves in one write.

/// How long a peer may take to finish its greeting and READY.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Read buffer growth: large enough that a busy stream needs few reads.
const READ_CHUNK: usize = 64 * 1024;

type Reader = Box<dyn AsyncRead + Send + Unpin>;
type Writer = Arc<Mutex<Box<dyn AsyncWrite + Send + Unpin>>>;

/// One side of a relayed connection after its handshake.
struct Leg {
    reader: Reader,
    writer: Writer,
    /// Bytes that arrived right behind the peer's READY.
    pending: BytesMut,
    peer: zmtp::Peer,
}

fn writer<W: AsyncWrite + Send + Unpin + 'static>(w: W) -> Writer {
    Arc::new(Mutex::new(Box::new(w)))
}

/// The ZMTP handshake on a fresh connection, bounded by [`HANDSHAKE_TIMEOUT`].
async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    socket_type: &str,
    identity: Option<&[u8]>,
    accept: &[&str],
) -> Result<(zmtp::Peer, BytesMut), zmtp::ZmtpError> {
    timeout(
        HANDSHAKE_TIMEOUT,
        zmtp::handshake(stream, socket_type, identity, accept),
    )
    .await
    .map_err(|_| zmtp::ZmtpError::Protocol("the ZMTP handshake timed out".into()))?
}

/// Handshake on an accepted (or connected) TCP stream and split it.
async fn tcp_leg(
    mut stream: TcpStream,
    socket_type: &str,
    identity: Option<&[u8]>,
    accept: &[&str],
) -> Result<Leg, zmtp::ZmtpError> {
    // every relayed message goes out at once, not when Nagle thinks it should
    stream.set_nodelay(true)?;
    let (peer, pending) = handshake(&mut stream, socket_type, identity, accept).await?;
    let (r, w) = stream.into_split();
    Ok(Leg {
        reader: Box::new(r),
        writer: writer(w),
        pending,
        peer,
    })
}

async fn ipc_leg(
    path: &str,
    socket_type: &str,
    identity: Option<&[u8]>,
    accept: &[&str],
) -> Result<Leg, zmtp::ZmtpError> {
    let mut stream = tokio::net::UnixStream::connect(path).await?;
    let (peer, pending) = handshake(&mut stream, socket_type, identity, accept).await?;
    let (r, w) = stream.into_split();
    Ok(Leg {
        reader: Box::new(r),
        writer: writer(w),
        pending,
        peer,
    })
}

/// Connect to one of the frontend's data sockets as `socket_type`, retrying while it is
/// not there yet (it bound them before INIT, so normally at once).
async fn open_leg(
    ctx: &Ctx,
    address: &str,
    socket_type: &str,
    identity: Option<&[u8]>,
    accept: &[&str],
    what: &str,
) -> Result<Leg> {
    let deadline = tokio::time::Instant::now() + ctx.cfg.connect_timeout;
    loop {
        let attempt = if let Some(rest) = address.strip_prefix("tcp://") {
            let (host, port) = rest
                .rsplit_once(':')
                .ok_or_else(|| anyhow!("no port in {address}"))?;
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let port: u16 = port
                .parse()
                .with_context(|| format!("bad port in {address}"))?;
            match TcpStream::connect((host, port)).await {
                Ok(s) => tcp_leg(s, socket_type, identity, accept).await,
                Err(e) => Err(e.into()),
            }
        } else if let Some(path) = address.strip_prefix("ipc://") {
            ipc_leg(path, socket_type, identity, accept).await
        } else {
            return Err(anyhow!("unsupported transport in {address}"));
        };
        match attempt {
            Ok(leg) => return Ok(leg),
            // a peer that answers but refuses us will not change its mind
            Err(
                e @ (zmtp::ZmtpError::Greeting(_)
                | zmtp::ZmtpError::Protocol(_)
                | zmtp::ZmtpError::PeerError(_)),
            ) => return Err(anyhow!("the {what} at {address}: {e}")),
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(anyhow!(
                    "the {what} at {address} did not accept a connection within {:?} (last error: {e})",
                    ctx.cfg.connect_timeout
                ));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// What a pipe hands its owner.
enum Got {
    /// A whole message, with the time its last bytes were read (before forwarding).
    Message { t: f64, frames: Vec<Bytes> },
    /// A message over the size limit, forwarded without being buffered (or observed).
    Streamed,
}

/// Why a pipe stopped.
enum PipeEnd {
    /// The source closed its connection (or broke the protocol: `Some(why)`).
    SourceClosed(Option<String>),
    /// Forwarding failed: the destination is gone.
    WriteFailed(String),
}

/// Write `data` to the destination, through the held guard if a streamed message holds it.
async fn write_to(
    held: &mut Option<OwnedMutexGuard<Box<dyn AsyncWrite + Send + Unpin>>>,
    to: &Writer,
    data: &[u8],
) -> std::io::Result<()> {
    match held {
        Some(g) => g.write_all(data).await,
        None => to.lock().await.write_all(data).await,
    }
}

/// What a pipe does with a message larger than its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Oversize {
    /// Stream it through with the destination held until it ends: for a destination only
    /// this source writes to, from a peer we connected to (the frontend).
    Stream,
    /// Close the source's connection before any byte of that message is relayed: for a
    /// destination shared by several sources (DP engines' outputs merge into one stream)
    /// or a source that connected to us. A streamed message whose source dies halfway
    /// would leave a partial message in the shared stream, and every later message on it
    /// would be misread.
    DropSource,
}

/// Relay whole messages from `src` to `to` (or drop them when `to` is `None`): read, find
/// the message boundaries, write every complete message of the read at once, then hand
/// copies to `on`. PINGs from the source are answered on its own connection; commands are
/// never forwarded. Messages are only ever written whole, so several pipes can share one
/// destination (DP engines into one output stream) without interleaving mid-message, and a
/// message the source leaves unfinished is never written. A message larger than `limit` is
/// handled as `oversize` says.
async fn pipe<F: FnMut(Got)>(
    mut src: Leg,
    to: Option<Writer>,
    limit: u64,
    oversize: Oversize,
    mut on: F,
) -> PipeEnd {
    let mut buf = std::mem::take(&mut src.pending);
    let mut scanner = zmtp::Scanner::new(limit);
    let mut held: Option<OwnedMutexGuard<Box<dyn AsyncWrite + Send + Unpin>>> = None;
    let mut t = now_monotonic();
    let end = 'relay: loop {
        let scan = match scanner.scan(&buf) {
            Ok(s) => s,
            Err(e) => break PipeEnd::SourceClosed(Some(e.to_string())),
        };
        if scan.complete > 0 {
            // Forward the complete bytes less any commands: one write in the usual case.
            if let Some(to) = &to {
                let mut from = 0;
                for item in &scan.items {
                    if let zmtp::Item::Command { span, .. } = item {
                        if span.start > from
                            && let Err(e) = write_to(&mut held, to, &buf[from..span.start]).await
                        {
                            break 'relay PipeEnd::WriteFailed(e.to_string());
                        }
                        from = span.end;
                    }
                }
                if scan.complete > from
                    && let Err(e) = write_to(&mut held, to, &buf[from..scan.complete]).await
                {
                    break 'relay PipeEnd::WriteFailed(e.to_string());
                }
            }
            // The observer gets slices of the bytes just relayed, not copies: they share
            // the read buffer's allocation (the next reads fill the rest of it; a new one
            // is made once it is used up), which is freed when the observer is done.
            let chunk = buf.split_to(scan.complete).freeze();
            for item in scan.items {
                match item {
                    zmtp::Item::Message { frames, .. } => {
                        let frames = frames.into_iter().map(|f| chunk.slice(f)).collect();
                        on(Got::Message { t, frames });
                    }
                    zmtp::Item::Tail { .. } => {}
                    zmtp::Item::Command { body, .. } => {
                        if let Ok((b"PING", data)) = zmtp::split_command(&chunk[body]) {
                            let pong = zmtp::pong_for(data);
                            if let Err(e) = src.writer.lock().await.write_all(&pong).await {
                                break 'relay PipeEnd::SourceClosed(Some(e.to_string()));
                            }
                        }
                    }
                }
            }
            if !scanner.mid_message() {
                held = None;
            }
        }
        if let Some((at, h)) = scan.oversize {
            if oversize == Oversize::DropSource {
                break 'relay PipeEnd::SourceClosed(Some(format!(
                    "a message of more than {limit} bytes (--max-frame-size); nothing of it was relayed and the connection is dropped"
                )));
            }
            on(Got::Streamed);
            if held.is_none()
                && let Some(to) = &to
            {
                held = Some(to.clone().lock_owned().await);
            }
            // the message so far and the whole oversize frame, as it arrives
            let mut remaining = at as u64 + h.total();
            loop {
                let n = usize::try_from(remaining)
                    .unwrap_or(usize::MAX)
                    .min(buf.len());
                if n > 0 {
                    if let Some(g) = held.as_mut()
                        && let Err(e) = g.write_all(&buf[..n]).await
                    {
                        break 'relay PipeEnd::WriteFailed(e.to_string());
                    }
                    buf.advance(n);
                    remaining -= n as u64;
                }
                if remaining == 0 {
                    break;
                }
                buf.reserve(READ_CHUNK);
                match src.reader.read_buf(&mut buf).await {
                    Ok(0) => break 'relay PipeEnd::SourceClosed(None),
                    Ok(_) => {}
                    Err(e) => break 'relay PipeEnd::SourceClosed(Some(e.to_string())),
                }
            }
            scanner.streamed(h.more());
            if !h.more() {
                held = None;
            }
            t = now_monotonic();
            continue;
        }
        if buf.capacity() - buf.len() < READ_CHUNK / 4 {
            buf.reserve(READ_CHUNK);
        }
        match src.reader.read_buf(&mut buf).await {
            Ok(0) => break PipeEnd::SourceClosed(None),
            Ok(_) => t = now_monotonic(),
            Err(e) => break PipeEnd::SourceClosed(Some(e.to_string())),
        }
    };
    if let Some(mut g) = held {
        // The source died inside a streamed message: what follows on this connection
        // would be read as the rest of it. Close it rather than corrupt the stream.
        tracing::warn!("a streamed message was cut off; closing the connection it went to");
        let _ = g.shutdown().await;
    }
    end
}

/// Bind the tap's data listeners (one input and one output per frontend client), connect
/// to the frontend's output sockets and start relaying.
async fn build_plane(ctx: &Arc<Ctx>, init: &HandshakeInit) -> Result<Plane> {
    let mut plane = Plane {
        frontend_inputs: init.inputs.clone(),
        frontend_outputs: init.outputs.clone(),
        tap_inputs: Vec::new(),
        tap_outputs: Vec::new(),
    };
    let bind_host = ctx.bind_host.trim_start_matches('[').trim_end_matches(']');
    for (client, (f_in, f_out)) in init.inputs.iter().zip(&init.outputs).enumerate() {
        let f_in = connect_address(f_in)?;
        let f_out = connect_address(f_out)?;
        let inputs = TcpListener::bind((bind_host, 0))
            .await
            .with_context(|| format!("binding an input listener on {bind_host}"))?;
        let outputs = TcpListener::bind((bind_host, 0))
            .await
            .with_context(|| format!("binding an output listener on {bind_host}"))?;
        plane.tap_inputs.push(format!(
            "tcp://{}:{}",
            ctx.advertise_host,
            port_of(&inputs.local_addr()?.to_string())?
        ));
        plane.tap_outputs.push(format!(
            "tcp://{}:{}",
            ctx.advertise_host,
            port_of(&outputs.local_addr()?.to_string())?
        ));

        let frontend = open_leg(
            ctx,
            &f_out,
            "PUSH",
            None,
            &["PULL"],
            "frontend's output socket",
        )
        .await?;
        let to_frontend = frontend.writer.clone();

        // The frontend never sends on its PULL; reading it answers PINGs and sees it go.
        let c = ctx.clone();
        let limit = ctx.max_frame;
        ctx.spawn(async move {
            let why = match pipe(frontend, None, limit, Oversize::Stream, |_| {}).await {
                PipeEnd::SourceClosed(why) => why,
                PipeEnd::WriteFailed(why) => Some(why),
            };
            c.event(Event::FrontendGone(match why {
                Some(why) => format!("output socket {client} ({why})"),
                None => format!("output socket {client}"),
            }));
        });

        // Every engine gone: say ENGINE_CORE_DEAD for them, between two messages (every
        // write to this stream is of whole messages).
        let c = ctx.clone();
        let to = to_frontend.clone();
        ctx.spawn(async move {
            let mut gone = c.engines_gone.subscribe();
            if gone.wait_for(|g| *g).await.is_ok() {
                tracing::warn!(
                    client,
                    "telling the frontend the engine is dead (ENGINE_CORE_DEAD)"
                );
                let mut frame = Vec::new();
                zmtp::put_frame(&mut frame, 0, ENGINE_CORE_DEAD);
                let mut w = to.lock().await;
                let _ = w.write_all(&frame).await;
                let _ = w.flush().await;
            }
        });

        let c = ctx.clone();
        ctx.spawn(async move {
            accept_outputs(&c, client, outputs, to_frontend).await;
        });
        let c = ctx.clone();
        ctx.spawn(async move {
            accept_inputs(&c, client, inputs, f_in).await;
        });
    }
    Ok(plane)
}

/// An engine-side connection that did not complete its handshake: a connection closed
/// or resets before its greeting is a port probe (engines check that the port is open before they
/// connect), anything else deserves a word.
fn handshake_refused(client: usize, socket: &str, e: &zmtp::ZmtpError) {
    if matches!(e, zmtp::ZmtpError::Closed | zmtp::ZmtpError::Io(_)) {
        tracing::debug!(client, "a probe of the tap's {socket} socket {client}");
    } else {
        tracing::warn!(
            client,
            "refused a connection to the tap's {socket} socket {client}: {e}"
        );
    }
}

/// Engines' output connections on client `client`: each relays into the one stream to
/// the frontend.
async fn accept_outputs(ctx: &Arc<Ctx>, client: usize, listener: TcpListener, to: Writer) {
    accept_each(ctx, client, "output", listener, |stream| {
        let c = ctx.clone();
        let to = to.clone();
        async move {
            let leg = match tcp_leg(stream, "PULL", None, &["PUSH"]).await {
                Ok(leg) => leg,
                Err(e) => {
                    handshake_refused(client, "output", &e);
                    return;
                }
            };
            let limit = c.max_frame;
            let end =
                pipe(leg, Some(to), limit, Oversize::DropSource, |got| {
                    match got {
                Got::Message { t, frames } => {
                    let dead = frames.len() == 1 && frames[0].as_ref() == ENGINE_CORE_DEAD;
                    c.observe(Seen::Output { t, client, frames });
                    if dead {
                        c.event(Event::EngineDead);
                    }
                }
                Got::Streamed => c.observe(Seen::Streamed {
                    what: format!(
                        "an engine output message on client {client} larger than --max-frame-size"
                    ),
                }),
            }
                })
                .await;
            match end {
                PipeEnd::WriteFailed(e) => {
                    c.event(Event::FrontendGone(format!("output socket {client} ({e})")));
                }
                PipeEnd::SourceClosed(Some(why)) => {
                    tracing::warn!(client, "an engine's output connection was dropped: {why}");
                }
                PipeEnd::SourceClosed(None) => {
                    tracing::debug!(client, "an engine's output connection closed");
                }
            }
        }
    })
    .await;
}

/// Engines' input connections on client `client`: each gets its own connection to the
/// frontend's input socket, carrying the engine's identity.
async fn accept_inputs(ctx: &Arc<Ctx>, client: usize, listener: TcpListener, frontend: String) {
    accept_each(ctx, client, "input", listener, |stream| {
        let c = ctx.clone();
        let frontend = frontend.clone();
        async move {
            if let Err(e) = engine_input(&c, client, stream, &frontend).await {
                c.event(Event::Failed(e));
            }
        }
    })
    .await;
}

/// Accept engines' connections on the tap's `socket` listener of client `client` for the
/// tap's whole life, each served by its own task.
async fn accept_each<F, Fut>(
    ctx: &Arc<Ctx>,
    client: usize,
    socket: &str,
    listener: TcpListener,
    mut serve: F,
) where
    F: FnMut(TcpStream) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    loop {
        match listener.accept().await {
            Ok((stream, _)) => ctx.spawn(serve(stream)),
            Err(e) => {
                tracing::warn!(client, "accepting on the tap's {socket} socket: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// One engine's input connection: its messages (the ready response) go to the frontend,
/// the frontend's requests come back.
async fn engine_input(
    ctx: &Arc<Ctx>,
    client: usize,
    stream: TcpStream,
    frontend: &str,
) -> Result<()> {
    let engine = match tcp_leg(stream, "ROUTER", None, &["DEALER"]).await {
        Ok(leg) => leg,
        Err(e) => {
            handshake_refused(client, "input", &e);
            return Ok(());
        }
    };
    let identity = engine.peer.identity.clone();
    let to_engine = engine.writer.clone();
    let fe = open_leg(
        ctx,
        frontend,
        "DEALER",
        (!identity.is_empty()).then_some(identity.as_ref()),
        &["ROUTER"],
        "frontend's input socket",
    )
    .await?;
    let to_frontend = fe.writer.clone();
    let limit = ctx.max_frame;

    let c = ctx.clone();
    let id = identity.clone();
    ctx.spawn(async move {
        let end = pipe(
            fe,
            Some(to_engine),
            limit,
            Oversize::Stream,
            |got| match got {
                Got::Message { t, frames } => c.observe(Seen::Input {
                    t,
                    client,
                    engine: id.clone(),
                    frames,
                }),
                Got::Streamed => c.observe(Seen::Streamed {
                    what: format!(
                        "a frontend message on client {client} larger than --max-frame-size"
                    ),
                }),
            },
        )
        .await;
        match end {
            PipeEnd::SourceClosed(why) => c.event(Event::FrontendGone(match why {
                Some(why) => format!("input socket {client} ({why})"),
                None => format!("input socket {client}"),
            })),
            PipeEnd::WriteFailed(e) => {
                tracing::warn!(
                    client,
                    engine = %hex_id(&id),
                    "cannot forward a request to the engine ({e}); it is gone"
                );
                c.event(Event::EngineGone(id));
            }
        }
    });

    let mut first = true;
    let end = pipe(
        engine,
        Some(to_frontend),
        limit,
        Oversize::DropSource,
        |got| {
            if let Got::Message { frames, .. } = got {
                if std::mem::take(&mut first) {
                    ctx.observe(Seen::Ready {
                        engine: identity.clone(),
                        client,
                        payload: frames.first().cloned().unwrap_or_default(),
                    });
                } else {
                    tracing::debug!(client, "relayed an engine message on an input socket");
                }
            }
        },
    )
    .await;
    match end {
        PipeEnd::SourceClosed(why) => {
            if let Some(why) = why {
                tracing::warn!(client, engine = %hex_id(&identity), "engine input connection: {why}");
            }
            ctx.observe(Seen::EngineGone {
                engine: identity.clone(),
            });
            ctx.event(Event::EngineGone(identity));
        }
        PipeEnd::WriteFailed(e) => {
            ctx.event(Event::FrontendGone(format!("input socket {client} ({e})")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{DuplexStream, duplex};

    fn leg(stream: DuplexStream) -> Leg {
        let (r, w) = tokio::io::split(stream);
        Leg {
            reader: Box::new(r),
            writer: writer(w),
            pending: BytesMut::new(),
            peer: zmtp::Peer {
                version: (3, 1),
                socket_type: "PUSH".into(),
                identity: Bytes::new(),
            },
        }
    }

    fn message(engine: u8, i: u32) -> Vec<u8> {
        let mut out = Vec::new();
        let big = vec![engine; 100 + (i as usize % 7) * 100];
        zmtp::put_frame(
            &mut out,
            zmtp::FLAG_MORE,
            format!("{engine}:{i}").as_bytes(),
        );
        zmtp::put_frame(&mut out, 0, &big);
        out
    }

    /// Two engines write their messages in awkward pieces (3 bytes at a time, so every
    /// message spans many reads) into pipes that share one destination: the destination
    /// gets every message whole, each engine's in order, never two interleaved; the
    /// observer sees the same frames; a PING is answered on its own connection and not
    /// forwarded.
    #[tokio::test]
    async fn dp_merge_keeps_messages_whole() {
        const N: u32 = 200;
        let (dest_tap, mut dest) = duplex(1 << 20);
        let to = writer(dest_tap);
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut pipes = Vec::new();
        let mut engines = Vec::new();
        for e in 0..2u8 {
            let (tap_side, engine_side) = duplex(1 << 20);
            let seen = seen.clone();
            let to = Some(to.clone());
            pipes.push(tokio::spawn(async move {
                pipe(leg(tap_side), to, 1 << 20, Oversize::DropSource, |got| {
                    if let Got::Message { frames, .. } = got {
                        seen.lock().unwrap().push(frames);
                    }
                })
                .await
            }));
            engines.push(tokio::spawn(async move {
                let mut s = engine_side;
                let mut bytes = zmtp::command_frame("PING", &[0, 0, b'h', b'i']);
                for i in 0..N {
                    bytes.extend(message(e, i));
                }
                for piece in bytes.chunks(3) {
                    s.write_all(piece).await.unwrap();
                    tokio::task::yield_now().await;
                }
                let want = zmtp::command_frame("PONG", b"hi");
                let mut pong = vec![0u8; want.len()];
                s.read_exact(&mut pong).await.unwrap();
                assert_eq!(pong, want);
                s
            }));
        }
        let mut engine_ends = Vec::new();
        for e in engines {
            engine_ends.push(e.await.unwrap());
        }
        let expect_len: usize = (0..2u8)
            .flat_map(|e| (0..N).map(move |i| message(e, i).len()))
            .sum();
        let mut got = vec![0u8; expect_len];
        dest.read_exact(&mut got).await.unwrap();
        let mut scanner = zmtp::Scanner::new(1 << 30);
        let scan = scanner.scan(&got).unwrap();
        assert_eq!(scan.complete, got.len());
        let mut next = [0u32; 2];
        for item in scan.items {
            let zmtp::Item::Message { span, .. } = item else {
                panic!("a command was forwarded");
            };
            let e = usize::from(got[span.start + 2] - b'0');
            assert_eq!(&got[span], message(e as u8, next[e]).as_slice());
            next[e] += 1;
        }
        assert_eq!(next, [N, N]);
        drop(engine_ends);
        for p in pipes {
            assert!(matches!(p.await.unwrap(), PipeEnd::SourceClosed(None)));
        }
        assert_eq!(seen.lock().unwrap().len(), 2 * N as usize);
    }

    /// A message over the limit is streamed through whole, the messages around it are
    /// buffered as usual, and only those are observed.
    #[tokio::test]
    async fn oversize_messages_stream_through() {
        let (dest_tap, mut dest) = duplex(1 << 20);
        let (tap_side, mut engine) = duplex(1 << 20);
        let observed = Arc::new(std::sync::Mutex::new((0, 0)));
        let o = observed.clone();
        let p = tokio::spawn(async move {
            pipe(
                leg(tap_side),
                Some(writer(dest_tap)),
                2048,
                Oversize::Stream,
                |got| {
                    let mut o = o.lock().unwrap();
                    match got {
                        Got::Message { .. } => o.0 += 1,
                        Got::Streamed => o.1 += 1,
                    }
                },
            )
            .await
        });
        let mut bytes = message(1, 1);
        zmtp::put_frame(&mut bytes, zmtp::FLAG_MORE, b"head");
        zmtp::put_frame(&mut bytes, zmtp::FLAG_MORE, &[7u8; 50_000]);
        zmtp::put_frame(&mut bytes, 0, b"tail");
        bytes.extend(message(1, 2));
        for piece in bytes.chunks(1000) {
            engine.write_all(piece).await.unwrap();
        }
        let mut got = vec![0u8; bytes.len()];
        dest.read_exact(&mut got).await.unwrap();
        assert_eq!(got, bytes);
        drop(engine);
        assert!(matches!(p.await.unwrap(), PipeEnd::SourceClosed(None)));
        assert_eq!(*observed.lock().unwrap(), (2, 1));
    }

    /// A peer on a shared output stream that declares a 2^40-byte frame, or dies in the
    /// middle of a message, is dropped without a byte of that message reaching the
    /// destination; the other engine's messages before and after go through whole.
    #[tokio::test]
    async fn a_bad_peer_never_splices_a_partial_message_into_a_shared_stream() {
        let (dest_tap, mut dest) = duplex(1 << 20);
        let to = writer(dest_tap);
        // the good engine
        let (good_tap, mut good) = duplex(1 << 20);
        let good_pipe = tokio::spawn(pipe(
            leg(good_tap),
            Some(to.clone()),
            1 << 20,
            Oversize::DropSource,
            |_| {},
        ));
        // a peer that declares a huge frame after one good message
        let (huge_tap, mut huge) = duplex(1 << 20);
        let huge_pipe = tokio::spawn(pipe(
            leg(huge_tap),
            Some(to.clone()),
            1 << 20,
            Oversize::DropSource,
            |_| {},
        ));
        // a peer that sends half a message and goes
        let (cut_tap, mut cut) = duplex(1 << 20);
        let cut_pipe = tokio::spawn(pipe(
            leg(cut_tap),
            Some(to.clone()),
            1 << 20,
            Oversize::DropSource,
            |_| {},
        ));
        let first = message(1, 1);
        good.write_all(&first).await.unwrap();
        let mut bytes = message(2, 1);
        bytes.push(zmtp::FLAG_LONG);
        bytes.extend_from_slice(&(1u64 << 40).to_be_bytes());
        bytes.extend_from_slice(&[9u8; 1000]);
        huge.write_all(&bytes).await.unwrap();
        let whole = message(3, 1);
        cut.write_all(&whole[..whole.len() - 10]).await.unwrap();
        drop(cut);
        let end = huge_pipe.await.unwrap();
        assert!(
            matches!(&end, PipeEnd::SourceClosed(Some(why)) if why.contains("--max-frame-size")),
            "the huge peer is dropped with a reason"
        );
        assert!(matches!(
            cut_pipe.await.unwrap(),
            PipeEnd::SourceClosed(None)
        ));
        let second = message(1, 2);
        good.write_all(&second).await.unwrap();
        drop(good);
        assert!(matches!(
            good_pipe.await.unwrap(),
            PipeEnd::SourceClosed(None)
        ));
        drop(to);
        // exactly: good 1, the huge peer's one whole message, good 2 (in arrival order
        // between the two peers' whole messages); nothing of the cut or huge message
        let mut got = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(2), dest.read_to_end(&mut got)).await;
        let mut scanner = zmtp::Scanner::new(1 << 30);
        let scan = scanner.scan(&got).unwrap();
        assert_eq!(scan.complete, got.len(), "only whole messages were written");
        let mut names: Vec<String> = scan
            .items
            .iter()
            .map(|item| match item {
                zmtp::Item::Message { frames, .. } => {
                    String::from_utf8_lossy(&got[frames[0].clone()]).into_owned()
                }
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        names.sort();
        assert_eq!(names, vec!["1:1", "1:2", "2:1"]);
    }

    mod fuzz {
        //! Whatever bytes a peer of the tap's data listeners sends, the pipe ends without a
        //! panic and the shared destination holds only whole messages.
        use super::*;
        use proptest::prelude::*;

        fn relay(bytes: Vec<u8>, chunk: usize) {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let (dest_tap, mut dest) = duplex(1 << 22);
                let (tap_side, mut peer) = duplex(1 << 22);
                let to = writer(dest_tap);
                let p = tokio::spawn(pipe(
                    leg(tap_side),
                    Some(to.clone()),
                    4096,
                    Oversize::DropSource,
                    |_| {},
                ));
                for piece in bytes.chunks(chunk.max(1)) {
                    if peer.write_all(piece).await.is_err() {
                        break;
                    }
                }
                drop(peer);
                let _ = p.await.unwrap();
                drop(to);
                let mut got = Vec::new();
                dest.read_to_end(&mut got).await.unwrap();
                let mut scanner = zmtp::Scanner::new(1 << 30);
                let scan = scanner.scan(&got).unwrap();
                assert_eq!(
                    scan.complete,
                    got.len(),
                    "only whole messages reach the destination"
                );
            });
        }

        /// Whole messages with garbage spliced in at random places.
        fn stream() -> impl Strategy<Value = Vec<u8>> {
            let part = prop_oneof![
                (0u8..4, 0usize..600).prop_map(|(e, n)| message(e, n as u32)),
                proptest::collection::vec(any::<u8>(), 0..40),
            ];
            proptest::collection::vec(part, 0..12).prop_map(|parts| parts.concat())
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]
            #[test]
            fn any_bytes_leave_only_whole_messages(bytes in stream(), chunk in 1usize..700) {
                relay(bytes, chunk);
            }
        }
    }
}
