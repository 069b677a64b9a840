//! The data plane's connections (legs) and the accept loop that serves each engine
//! connection.
//!
//! Each data connection is a ZMTP session of its own: the tap greets the engine as the
//! frontend's socket type (ROUTER, PULL) and the frontend as the engine's (DEALER with the
//! engine's identity, PUSH), then forwards whole messages as the bytes they arrived as.
//! The tap speaks ZMTP itself here, not through a socket library per hop, so that relaying
//! costs one read and one write for however many messages a read brought in, with no
//! re-framing of each message on the path between engine and frontend.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::Mutex;
use tokio::time::timeout;

use sim_protocol::zmtp;

use super::ctx::Ctx;
use super::sock;

/// How long a peer may take to finish its greeting and READY.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Read buffer growth: large enough that a busy stream needs few reads.
pub(super) const READ_CHUNK: usize = 64 * 1024;

type Reader = Box<dyn AsyncRead + Send + Unpin>;
pub(super) type Writer = Arc<Mutex<Box<dyn AsyncWrite + Send + Unpin>>>;

/// One side of a relayed connection after its handshake.
pub(super) struct Leg {
    pub(super) reader: Reader,
    pub(super) writer: Writer,
    /// Bytes that arrived right behind the peer's READY.
    pub(super) pending: BytesMut,
    pub(super) peer: zmtp::Peer,
}

pub(super) fn writer<W: AsyncWrite + Send + Unpin + 'static>(w: W) -> Writer {
    Arc::new(Mutex::new(Box::new(w)))
}

/// The ZMTP handshake on a fresh connection, bounded by [`HANDSHAKE_TIMEOUT`].
pub(super) async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
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

/// The relay's leg on a socket after its handshake (see [`sock`] for why not the tokio
/// stream's own halves).
fn relay_leg(fd: OwnedFd, peer: zmtp::Peer, pending: BytesMut) -> Result<Leg, zmtp::ZmtpError> {
    let (r, w) = sock::split(fd)?;
    Ok(Leg {
        reader: Box::new(r),
        writer: writer(w),
        pending,
        peer,
    })
}

/// Handshake on an accepted (or connected) TCP stream and split it.
pub(super) async fn tcp_leg(
    mut stream: TcpStream,
    socket_type: &str,
    identity: Option<&[u8]>,
    accept: &[&str],
) -> Result<Leg, zmtp::ZmtpError> {
    // every relayed message goes out at once, not when Nagle thinks it should
    stream.set_nodelay(true)?;
    let (peer, pending) = handshake(&mut stream, socket_type, identity, accept).await?;
    relay_leg(OwnedFd::from(stream.into_std()?), peer, pending)
}

/// Handshake on an accepted (or connected) Unix-domain stream and split it.
async fn unix_leg(
    mut stream: UnixStream,
    socket_type: &str,
    identity: Option<&[u8]>,
    accept: &[&str],
) -> Result<Leg, zmtp::ZmtpError> {
    let (peer, pending) = handshake(&mut stream, socket_type, identity, accept).await?;
    relay_leg(OwnedFd::from(stream.into_std()?), peer, pending)
}

/// Connect to one of the frontend's data sockets as `socket_type`, retrying while it is
/// not there yet (it bound them before INIT, so normally at once).
pub(super) async fn open_leg(
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
            match UnixStream::connect(path).await {
                Ok(s) => unix_leg(s, socket_type, identity, accept).await,
                Err(e) => Err(e.into()),
            }
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

/// An engine-side connection that did not complete its handshake: a connection closed
/// or resets before its greeting is a port probe (engines check that the port is open before they
/// connect), anything else deserves a word.
pub(super) fn handshake_refused(client: usize, socket: &str, e: &zmtp::ZmtpError) {
    if matches!(e, zmtp::ZmtpError::Closed | zmtp::ZmtpError::Io(_)) {
        tracing::debug!(client, "a probe of the tap's {socket} socket {client}");
    } else {
        tracing::warn!(
            client,
            "refused a connection to the tap's {socket} socket {client}: {e}"
        );
    }
}

/// Accept engines' connections on the tap's `socket` listener of client `client` for the
/// tap's whole life, each served by its own task.
pub(super) async fn accept_each<F, Fut>(
    ctx: &Arc<Ctx>,
    client: usize,
    socket: &str,
    listener: Listener,
    mut serve: F,
) where
    F: FnMut(Accepted) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    loop {
        let accepted = match &listener {
            Listener::Tcp(l) => l.accept().await.map(|(s, _)| Accepted::Tcp(s)),
            Listener::Ipc { listener, .. } => {
                listener.accept().await.map(|(s, _)| Accepted::Ipc(s))
            }
        };
        match accepted {
            Ok(stream) => ctx.spawn(serve(stream)),
            Err(e) => {
                tracing::warn!(client, "accepting on the tap's {socket} socket: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// A listener for engines' data connections.
pub(super) enum Listener {
    Tcp(TcpListener),
    /// A Unix-domain socket; its file is removed when the listener goes.
    Ipc {
        listener: UnixListener,
        _file: SocketFile,
    },
}

/// An engine's data connection, as accepted.
pub(super) enum Accepted {
    Tcp(TcpStream),
    Ipc(UnixStream),
}

/// The file of a Unix-domain socket the tap bound: removed when dropped.
pub(super) struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Handshake on an engine's data connection and split it.
pub(super) async fn accepted_leg(
    stream: Accepted,
    socket_type: &str,
    accept: &[&str],
) -> Result<Leg, zmtp::ZmtpError> {
    match stream {
        Accepted::Tcp(s) => tcp_leg(s, socket_type, None, accept).await,
        Accepted::Ipc(s) => unix_leg(s, socket_type, None, accept).await,
    }
}

/// Bind the tap's `what` ("in" or "out") data listener of client `client`, whose frontend
/// socket is at `frontend`, and return it with the address engines are told in INIT.
///
/// A Unix-domain socket in `--engine-ipc-dir` when given. Else, when the frontend's socket
/// is an absolute `ipc://` path and no `--advertise-host` was given, a Unix-domain socket in
/// the same directory: an engine the frontend would have reached there is on this host and
/// sees that directory, and a Unix-domain hop costs the relay less than loopback TCP (no
/// TCP stack run on each send and receive). Otherwise, or if that bind fails, TCP on the
/// engine-handshake host.
pub(super) async fn data_listener(
    ctx: &Ctx,
    frontend: &str,
    client: usize,
    what: &str,
) -> Result<(Listener, String)> {
    static BOUND: AtomicUsize = AtomicUsize::new(0);
    let beside = frontend
        .strip_prefix("ipc://")
        .map(Path::new)
        .filter(|p| p.is_absolute() && ctx.cfg.advertise_host.is_none())
        .and_then(Path::parent);
    let dir = ctx.cfg.engine_ipc_dir.as_deref().or(beside);
    if let Some(dir) = dir {
        let n = BOUND.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!(
            "vcr-tap-{}-{n}-{what}-{client}",
            std::process::id()
        ));
        match UnixListener::bind(&path) {
            Ok(l) => {
                let address = format!("ipc://{}", path.display());
                let listener = Listener::Ipc {
                    listener: l,
                    _file: SocketFile(path),
                };
                return Ok((listener, address));
            }
            Err(e) if ctx.cfg.engine_ipc_dir.is_some() => {
                return Err(anyhow!(
                    "binding the tap's {what} socket at {} (--engine-ipc-dir): {e}",
                    path.display()
                ));
            }
            Err(e) => tracing::warn!(
                client,
                "cannot bind the tap's {what} socket at {} ({e}); engines get a TCP one",
                path.display()
            ),
        }
    }
    let host = ctx.bind_host.trim_start_matches('[').trim_end_matches(']');
    let l = TcpListener::bind((host, 0))
        .await
        .with_context(|| format!("binding an {what} listener on {host}"))?;
    let address = format!("tcp://{}:{}", ctx.advertise_host, l.local_addr()?.port());
    Ok((Listener::Tcp(l), address))
}
