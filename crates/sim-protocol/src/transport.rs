//! ZMQ sockets and the startup handshake, engine side ([`connect_to_frontend`]) and frontend
//! side ([`FrontendListener`]), on the pure-Rust `zeromq` crate (0.7.0).
//!
//! Workarounds for where that crate differs from libzmq:
//! - `tcp://*:port` is rejected: [`bind_address`] rewrites `*` to `0.0.0.0`;
//! - `connect()` awaits the peer (retrying refused endpoints with a backoff that grows to
//!   30 s): every connect here is wrapped in our own short attempts and an overall deadline,
//!   so a frontend that binds late is found within a fraction of a second;
//! - sending without a connected peer is an error, not a queue: callers treat it as "peer
//!   gone";
//! - there is no LINGER: a dropped socket's writer task still drains what was queued, but
//!   only while the runtime runs, so keep the runtime alive briefly after the last send
//!   (e.g. after `ENGINE_CORE_DEAD`);
//! - DEALER and PUSH never reconnect: the engine needs none (a vLLM frontend never accepts a
//!   second handshake).

use std::time::Duration;

use bytes::Bytes;
use tokio::time::{Instant, timeout, timeout_at};
use zeromq::util::PeerIdentity;
use zeromq::{
    DealerSocket, PushSocket, Socket, SocketOptions, SocketRecv, SocketSend, XSubSocket, ZmqError,
    ZmqMessage,
};

use crate::decode::DecodeError;
use crate::ready::{HandshakeInit, ReadyResponse, encode_status};

mod frontend;
mod ipc;

pub use frontend::{
    AcceptedEngine, FrontendListener, FrontendSockets, bind_pull, bind_router, tcp_host,
};

/// Why a socket operation or the handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("invalid ZMQ address `{address}`: {reason}")]
    BadAddress { address: String, reason: String },
    #[error(
        "no frontend answered on the handshake socket {address} within {waited:?}{}; start the frontend in external-engine mode (`--data-parallel-size-local 0`) with this handshake address, or raise the handshake timeout",
        last_error.as_ref().map(|e| format!(" (last error: {e})")).unwrap_or_default()
    )]
    HandshakeTimeout {
        address: String,
        waited: Duration,
        last_error: Option<String>,
    },
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout { what: String, after: Duration },
    #[error("{what}: {source}")]
    Zmq {
        what: String,
        #[source]
        source: ZmqError,
    },
    #[error("{what}: {source}")]
    Decode {
        what: String,
        #[source]
        source: DecodeError,
    },
    #[error("protocol violation: {0}")]
    Protocol(String),
}

fn zmq_err(what: impl Into<String>) -> impl FnOnce(ZmqError) -> TransportError {
    let what = what.into();
    move |source| TransportError::Zmq { what, source }
}

/// Timeouts of the engine side of the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectOptions {
    /// How long to keep trying to reach the frontend's handshake socket (the engine may
    /// start before the frontend). Frontends wait 600 s for engines by default.
    pub handshake_timeout: Duration,
    /// How long to wait for INIT after HELLO (the Python engine allows 5 minutes).
    pub init_timeout: Duration,
    /// Each data-socket connect (the frontend bound them before sending INIT).
    pub connect_timeout: Duration,
    /// How long to wait for the DP coordinator's `READY`.
    pub coordinator_timeout: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            handshake_timeout: Duration::from_secs(600),
            init_timeout: Duration::from_secs(300),
            connect_timeout: Duration::from_secs(30),
            coordinator_timeout: Duration::from_secs(300),
        }
    }
}

/// The DP coordinator's sockets (only with DP > 1 and a coordinator).
pub struct CoordinatorSockets {
    /// XSUB subscribed to everything; carries START_DP_WAVE broadcasts.
    pub input: XSubSocket,
    /// PUSH for stats and wave control towards the coordinator.
    pub output: PushSocket,
}

/// What an engine holds after the handshake: one input DEALER and one output PUSH per
/// frontend client (index = `client_index`); the zeromq crate's, or our own
/// ([`crate::dealer::connect_to_frontend_direct`]).
pub struct EngineSockets<O = PushSocket, I = DealerSocket> {
    pub inputs: Vec<I>,
    pub outputs: Vec<O>,
    pub init: HandshakeInit,
    pub coordinator: Option<CoordinatorSockets>,
}

/// A ZMQ identity for a DP rank: 2 bytes, little-endian (what vLLM uses).
pub fn rank_identity(rank: u16) -> Bytes {
    Bytes::copy_from_slice(&rank.to_le_bytes())
}

/// The DP rank of a 2-byte little-endian identity.
pub fn identity_rank(identity: &[u8]) -> Option<u16> {
    <[u8; 2]>::try_from(identity).ok().map(u16::from_le_bytes)
}

fn check_transport(address: &str) -> Result<(), TransportError> {
    if address.starts_with("tcp://") || address.starts_with("ipc://") {
        Ok(())
    } else {
        Err(TransportError::BadAddress {
            address: address.to_string(),
            reason: "only tcp:// and ipc:// are supported".into(),
        })
    }
}

/// An address to connect to: `host:port` gets `tcp://`; `*` (a bind wildcard) means this
/// host.
pub fn connect_address(address: &str) -> Result<String, TransportError> {
    normalise(address, "127.0.0.1")
}

/// An address to bind: `host:port` gets `tcp://`; `tcp://*:port` becomes
/// `tcp://0.0.0.0:port` (the zeromq crate rejects `*`).
pub fn bind_address(address: &str) -> Result<String, TransportError> {
    normalise(address, "0.0.0.0")
}

/// Add a missing `tcp://`, replace a `*` host by `wildcard_host`, check the transport.
fn normalise(address: &str, wildcard_host: &str) -> Result<String, TransportError> {
    let a = address.trim();
    let a = if a.contains("://") {
        a.to_string()
    } else {
        format!("tcp://{a}")
    };
    let a = match a.strip_prefix("tcp://*:") {
        Some(port) => format!("tcp://{wildcard_host}:{port}"),
        None => a,
    };
    check_transport(&a)?;
    Ok(a)
}

/// Socket options with our own connect bounding (no crate connect timeout) and an
/// optional ZMQ identity.
pub fn socket_options(identity: Option<&Bytes>) -> Result<SocketOptions, TransportError> {
    let mut opts = SocketOptions::default();
    // We bound every connect ourselves (short attempts + overall deadline).
    opts.no_connect_timeout();
    if let Some(id) = identity {
        let peer = PeerIdentity::try_from(id.clone()).map_err(zmq_err("socket identity"))?;
        opts.peer_identity(peer);
    }
    Ok(opts)
}

fn retryable(e: &ZmqError) -> bool {
    use std::io::ErrorKind as K;
    match e {
        ZmqError::Network(io) => matches!(
            io.kind(),
            K::ConnectionRefused
                | K::ConnectionReset
                | K::ConnectionAborted
                | K::NotFound
                | K::TimedOut
                | K::BrokenPipe
                | K::UnexpectedEof
                | K::AddrNotAvailable
                | K::HostUnreachable
                | K::NetworkUnreachable
        ),
        ZmqError::ConnectTimeout(_) | ZmqError::Codec(_) | ZmqError::NoMessage => true,
        _ => false,
    }
}

/// Poll interval while the peer's port is not open yet.
const PROBE_INTERVAL: Duration = Duration::from_millis(100);

/// Whether something listens at a `tcp://` or `ipc://` address (a plain connect, closed at
/// once; ZMQ peers ignore a connection that closes before its greeting).
async fn probe(address: &str) -> std::io::Result<()> {
    if let Some(rest) = address.strip_prefix("tcp://") {
        let (host, port) = rest
            .rsplit_once(':')
            .ok_or_else(|| std::io::Error::other("no port in the address"))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let port: u16 = port
            .parse()
            .map_err(|_| std::io::Error::other("bad port in the address"))?;
        tokio::net::TcpStream::connect((host, port)).await.map(drop)
    } else if let Some(path) = address.strip_prefix("ipc://") {
        tokio::net::UnixStream::connect(path).await.map(drop)
    } else {
        Err(std::io::Error::other("unsupported transport"))
    }
}

/// Connect `sock` to `address`, waiting up to `total` for the peer to appear.
///
/// The wait is a cheap TCP/IPC probe loop; only once the port is open does the ZMQ connect
/// run (bounded by the overall deadline only). Cancelling a ZMQ connect mid-handshake could
/// leave a libzmq ROUTER holding a half-registered identity that makes it ignore our retry,
/// so connects are never cut short by a per-attempt timer.
pub async fn connect_retrying<S: Socket>(
    sock: &mut S,
    address: &str,
    total: Duration,
    what: &str,
    is_handshake: bool,
) -> Result<(), TransportError> {
    let start = Instant::now();
    let deadline = start + total;
    let mut last_error: Option<String> = None;
    let mut last_report = start;
    let timed_out = |last_error: Option<String>| {
        if is_handshake {
            TransportError::HandshakeTimeout {
                address: address.to_string(),
                waited: total,
                last_error,
            }
        } else {
            TransportError::Timeout {
                what: format!(
                    "the {what} at {address}{}",
                    last_error
                        .map(|e| format!(" (last error: {e})"))
                        .unwrap_or_default()
                ),
                after: total,
            }
        }
    };
    loop {
        if last_report.elapsed() >= Duration::from_secs(10) {
            last_report = Instant::now();
            tracing::debug!(
                address,
                waited_s = start.elapsed().as_secs(),
                last_error = last_error.as_deref().unwrap_or("none"),
                "still waiting for the {what}"
            );
        }
        match timeout_at(deadline, probe(address)).await {
            Err(_) => return Err(timed_out(last_error)),
            Ok(Err(e)) => {
                last_error = Some(e.to_string());
                if timeout_at(deadline, tokio::time::sleep(PROBE_INTERVAL))
                    .await
                    .is_err()
                {
                    return Err(timed_out(last_error));
                }
                continue;
            }
            Ok(Ok(())) => {}
        }
        match timeout_at(deadline, sock.connect(address)).await {
            Err(_) => return Err(timed_out(last_error)),
            Ok(Ok(())) => return Ok(()),
            Ok(Err(ZmqError::Endpoint(e))) => {
                return Err(TransportError::BadAddress {
                    address: address.to_string(),
                    reason: e.to_string(),
                });
            }
            Ok(Err(e)) if retryable(&e) => {
                // The peer went away between the probe and the connect, or is not ZMQ yet.
                last_error = Some(e.to_string());
                tokio::time::sleep(PROBE_INTERVAL).await;
            }
            Ok(Err(e)) => {
                return Err(zmq_err(format!("connecting the {what} to {address}"))(e));
            }
        }
    }
}

/// Build a message from frames (at least one).
pub fn message_from_frames(frames: Vec<Bytes>) -> Result<ZmqMessage, TransportError> {
    ZmqMessage::try_from(frames)
        .map_err(|_| TransportError::Protocol("cannot send a message with no frames".into()))
}

/// Send one multipart message.
pub async fn send_frames<S: SocketSend>(
    sock: &mut S,
    frames: Vec<Bytes>,
) -> Result<(), TransportError> {
    let msg = message_from_frames(frames)?;
    sock.send(msg).await.map_err(zmq_err("send"))
}

/// Receive one multipart message as its frames.
pub async fn recv_frames<S: SocketRecv>(sock: &mut S) -> Result<Vec<Bytes>, TransportError> {
    sock.recv()
        .await
        .map(ZmqMessage::into_vec)
        .map_err(zmq_err("receive"))
}

/// The engine half of the startup handshake (vLLM's `startup_handshake` in
/// `vllm/v1/engine/core.py`), as DP rank `rank`:
/// HELLO → INIT → the ready response on every input socket → (coordinator) → READY.
///
/// Keeps trying to reach `handshake_address` for `opts.handshake_timeout`, so the engine may
/// start before the frontend. `ready.dp_stats_address` and `ready.data_parallel_rank` are
/// filled from INIT and `rank`.
pub async fn connect_to_frontend(
    handshake_address: &str,
    rank: u16,
    ready: &ReadyResponse,
    opts: &ConnectOptions,
) -> Result<EngineSockets, TransportError> {
    connect_engine(
        handshake_address,
        rank,
        ready,
        opts,
        async |output, opts| {
            let mut push = PushSocket::with_options(socket_options(None)?);
            let what = "frontend's output socket";
            connect_retrying(&mut push, &output, opts.connect_timeout, what, false).await?;
            Ok(push)
        },
        async |input, identity, ready, opts| {
            let mut dealer = DealerSocket::with_options(socket_options(Some(&identity))?);
            let what = "frontend's input socket";
            connect_retrying(&mut dealer, &input, opts.connect_timeout, what, false).await?;
            send_frames(&mut dealer, vec![ready]).await?;
            Ok(dealer)
        },
    )
    .await
}

/// [`connect_to_frontend`] with each output socket connected by `connect_output`, and each
/// input socket by `connect_input` (address, identity, the ready payload it must send
/// once: that message is what registers the DEALER with the frontend's ROUTER).
pub(crate) async fn connect_engine<O, I>(
    handshake_address: &str,
    rank: u16,
    ready: &ReadyResponse,
    opts: &ConnectOptions,
    connect_output: impl AsyncFn(String, ConnectOptions) -> Result<O, TransportError>,
    connect_input: impl AsyncFn(String, Bytes, Bytes, ConnectOptions) -> Result<I, TransportError>,
) -> Result<EngineSockets<O, I>, TransportError> {
    let address = connect_address(handshake_address)?;
    let identity = rank_identity(rank);

    let mut handshake = DealerSocket::with_options(socket_options(Some(&identity))?);
    tracing::info!(
        rank,
        "waiting for the frontend's handshake socket at {address} (up to {:?})",
        opts.handshake_timeout
    );
    connect_retrying(
        &mut handshake,
        &address,
        opts.handshake_timeout,
        "frontend's handshake socket",
        true,
    )
    .await?;
    tracing::debug!(rank, %address, "connected to the handshake socket; sending HELLO");
    send_frames(&mut handshake, vec![Bytes::from(encode_status("HELLO"))]).await?;

    let init_frames = timeout(opts.init_timeout, recv_frames(&mut handshake))
        .await
        .map_err(|_| TransportError::Timeout {
            what: format!("INIT from the frontend at {address}"),
            after: opts.init_timeout,
        })??;
    let payload = init_frames
        .last()
        .ok_or_else(|| TransportError::Protocol("empty INIT message".into()))?;
    let init = HandshakeInit::decode(payload).map_err(|source| TransportError::Decode {
        what: "INIT from the frontend".into(),
        source,
    })?;
    tracing::debug!(rank, inputs = ?init.inputs, outputs = ?init.outputs, "received INIT");

    let mut ready = ready.clone();
    ready.dp_stats_address = init.frontend_stats_publish_address.clone();
    ready.data_parallel_rank = u64::from(rank);
    let ready_bytes = Bytes::from(ready.encode());

    let mut inputs = Vec::with_capacity(init.inputs.len());
    let mut outputs = Vec::with_capacity(init.outputs.len());
    for (i, (input, output)) in init.inputs.iter().zip(&init.outputs).enumerate() {
        let input = connect_address(input)?;
        let (id, payload) = (identity.clone(), ready_bytes.clone());
        inputs.push(connect_input(input.clone(), id, payload, *opts).await?);

        let output = connect_address(output)?;
        outputs.push(connect_output(output.clone(), *opts).await?);
        tracing::debug!(rank, client = i, %input, %output, "data sockets connected");
    }

    let coordinator = match (&init.coordinator_input, &init.coordinator_output) {
        (Some(cin), Some(cout)) => Some(connect_coordinator(cin, cout, opts).await?),
        _ => None,
    };

    send_frames(&mut handshake, vec![Bytes::from(encode_status("READY"))]).await?;
    // Dropping the socket still lets its writer task flush READY (the runtime keeps running).
    drop(handshake);
    tracing::info!(
        rank,
        clients = inputs.len(),
        "handshake with the frontend complete"
    );
    Ok(EngineSockets {
        inputs,
        outputs,
        init,
        coordinator,
    })
}

async fn connect_coordinator(
    input: &str,
    output: &str,
    opts: &ConnectOptions,
) -> Result<CoordinatorSockets, TransportError> {
    let input = connect_address(input)?;
    let output = connect_address(output)?;
    let mut xsub = XSubSocket::with_options(socket_options(None)?);
    connect_retrying(
        &mut xsub,
        &input,
        opts.connect_timeout,
        "DP coordinator's input socket",
        false,
    )
    .await?;
    send_frames(&mut xsub, vec![Bytes::from_static(b"\x01")]).await?;
    let deadline = Instant::now() + opts.coordinator_timeout;
    loop {
        let frames = timeout_at(deadline, recv_frames(&mut xsub))
            .await
            .map_err(|_| TransportError::Timeout {
                what: format!("READY from the DP coordinator at {input}"),
                after: opts.coordinator_timeout,
            })??;
        if frames.len() == 1 && frames[0].as_ref() == b"READY" {
            break;
        }
        tracing::debug!("ignoring a coordinator message before its READY");
    }
    let mut push = PushSocket::with_options(socket_options(None)?);
    connect_retrying(
        &mut push,
        &output,
        opts.connect_timeout,
        "DP coordinator's output socket",
        false,
    )
    .await?;
    Ok(CoordinatorSockets {
        input: xsub,
        output: push,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_normalised() {
        assert_eq!(bind_address("tcp://*:5557").unwrap(), "tcp://0.0.0.0:5557");
        assert_eq!(
            bind_address("127.0.0.1:29550").unwrap(),
            "tcp://127.0.0.1:29550"
        );
        assert_eq!(
            connect_address("tcp://*:5557").unwrap(),
            "tcp://127.0.0.1:5557"
        );
        assert_eq!(connect_address("ipc:///tmp/x").unwrap(), "ipc:///tmp/x");
        assert!(matches!(
            connect_address("inproc://x"),
            Err(TransportError::BadAddress { .. })
        ));
    }

    #[test]
    fn identities_are_little_endian_ranks() {
        assert_eq!(rank_identity(0).as_ref(), &[0, 0]);
        assert_eq!(rank_identity(1).as_ref(), &[1, 0]);
        assert_eq!(rank_identity(258).as_ref(), &[2, 1]);
        assert_eq!(identity_rank(&[1, 0]), Some(1));
        assert_eq!(identity_rank(&[1]), None);
    }
}
