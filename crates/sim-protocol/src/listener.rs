//! Sockets that accept connections from peers we do not control — the P/D side channel,
//! the KV-events PUB and replay ROUTER, the tap's engine-handshake socket — speaking ZMTP
//! through [`crate::zmtp`] so that every peer is bounded.
//!
//! A ZMQ socket library reads a frame header and allocates the length it declares before
//! the body arrives, so one connection that declares a 2^62-byte frame aborts the process.
//! Here each peer has its own reader task that checks a frame's declared length against
//! the socket's [`PeerLimits`] *before* reading it, grows its buffer only as bytes arrive,
//! and on any violation (oversize message, too many frames, a broken handshake, a stalled
//! greeting) closes that one connection with a warning; the socket and every other peer
//! carry on. Outgoing messages go through a bounded queue per peer and are dropped when a
//! peer does not read (ZMQ's high-water mark), so a slow peer cannot hold the engine.
//!
//! Two socket kinds are needed: [`ZmtpRouter`] (ROUTER: messages carry the peer's
//! identity; DEALER, REQ and ROUTER peers) and [`ZmtpPub`] (PUB: SUB/XSUB peers subscribe
//! by topic prefix, either with the ZMTP 3.0 `\x01topic` message or the 3.1 `SUBSCRIBE`
//! command). Both listen on `tcp://` or `ipc://` and interoperate with libzmq peers (the
//! greeting and READY are the ones the tap already exchanges with vLLM's Python side).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, watch};

use crate::transport::TransportError;
use crate::zmtp::{self, ZmtpError};

/// What one peer of an accepting socket may make it hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerLimits {
    /// Largest message a peer may send: every frame's header and body, in bytes. A frame
    /// that would take its message past this closes the peer's connection before any of
    /// the frame is read.
    pub max_message: u64,
    /// Most frames in one message (each frame costs a handle even when empty).
    pub max_frames: usize,
    /// Most peers connected at once; a connection beyond them is closed at once.
    pub max_peers: usize,
    /// How long a new connection may take to send its greeting and READY.
    pub handshake_timeout: Duration,
    /// Messages queued towards one peer; further ones to it are dropped until it reads.
    pub send_queue: usize,
}

impl PeerLimits {
    /// Limits for a control socket whose messages are small (`max_message` bytes at most).
    pub fn control(max_message: u64) -> Self {
        Self {
            max_message,
            max_frames: 64,
            max_peers: 256,
            handshake_timeout: Duration::from_secs(10),
            send_queue: 1024,
        }
    }
}

/// Growth of a peer's read buffer per read: a peer gets memory as its bytes arrive, never
/// on the strength of a header alone.
const READ_CHUNK: usize = 64 * 1024;

/// One thing a peer sent.
#[derive(Debug)]
enum Incoming {
    /// A whole message's frame bodies.
    Message(Vec<Bytes>),
    /// A command: its name and data.
    Command(Bytes, Bytes),
}

/// Reads one peer's frames with the limits applied before any allocation.
struct FrameReader {
    buf: BytesMut,
    limits: PeerLimits,
}

impl FrameReader {
    fn new(pending: BytesMut, limits: PeerLimits) -> Self {
        Self {
            buf: pending,
            limits,
        }
    }

    /// The next message or command, or `None` when the peer closed (a message it left
    /// unfinished is dropped whole).
    async fn next<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut R,
    ) -> Result<Option<Incoming>, ZmtpError> {
        let mut frames: Vec<Bytes> = Vec::new();
        let mut message_bytes: u64 = 0;
        loop {
            let want = match zmtp::frame_header(&self.buf)? {
                Some(h) => {
                    if h.command() {
                        if !frames.is_empty() {
                            return Err(ZmtpError::Protocol("a command inside a message".into()));
                        }
                        if h.body_len > zmtp::MAX_COMMAND {
                            return Err(ZmtpError::TooLarge {
                                claimed: h.body_len,
                                limit: zmtp::MAX_COMMAND,
                            });
                        }
                    } else {
                        let claimed = message_bytes.saturating_add(h.total());
                        if claimed > self.limits.max_message {
                            return Err(ZmtpError::TooLarge {
                                claimed,
                                limit: self.limits.max_message,
                            });
                        }
                        if frames.len() >= self.limits.max_frames {
                            return Err(ZmtpError::Protocol(format!(
                                "a message of more than {} frames",
                                self.limits.max_frames
                            )));
                        }
                    }
                    // bounded by the checks above
                    let total = h.total() as usize;
                    if self.buf.len() >= total {
                        let frame = self.buf.split_to(total).freeze();
                        let body = frame.slice(h.header_len..);
                        if h.command() {
                            let (name, data) = zmtp::split_command(&body)?;
                            let name = body.slice_ref(name);
                            let data = body.slice_ref(data);
                            return Ok(Some(Incoming::Command(name, data)));
                        }
                        frames.push(body);
                        message_bytes += total as u64;
                        if !h.more() {
                            return Ok(Some(Incoming::Message(frames)));
                        }
                        continue;
                    }
                    (total - self.buf.len()).min(READ_CHUNK)
                }
                None => 16,
            };
            if self.buf.capacity() - self.buf.len() < want {
                self.buf.reserve(want);
            }
            if r.read_buf(&mut self.buf).await? == 0 {
                return Ok(None);
            }
        }
    }
}

/// Encode a message's frames for the wire (MORE on every frame but the last).
pub fn encode_message(frames: &[Bytes]) -> Bytes {
    let mut out = Vec::with_capacity(frames.iter().map(|f| f.len() + 9).sum());
    for (i, f) in frames.iter().enumerate() {
        let flags = if i + 1 < frames.len() {
            zmtp::FLAG_MORE
        } else {
            0
        };
        zmtp::put_frame(&mut out, flags, f);
    }
    Bytes::from(out)
}

/// A bound `tcp://` or `ipc://` listener.
enum Acceptor {
    Tcp(TcpListener),
    Ipc(UnixListener, PathBuf),
}

type BoxStream = Box<dyn AsyncReadWrite>;
trait AsyncReadWrite: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> AsyncReadWrite for T {}

impl Acceptor {
    async fn bind(address: &str) -> Result<(Self, String), TransportError> {
        let bad = |reason: String| TransportError::BadAddress {
            address: address.to_string(),
            reason,
        };
        if let Some(rest) = address.strip_prefix("tcp://") {
            let (host, port) = rest.rsplit_once(':').ok_or_else(|| bad("no port".into()))?;
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let host = if host == "*" { "0.0.0.0" } else { host };
            let port: u16 = if port == "*" {
                0
            } else {
                port.parse()
                    .map_err(|_| bad(format!("bad port `{port}`")))?
            };
            let l = TcpListener::bind((host, port))
                .await
                .map_err(|e| bad(format!("cannot listen: {e}")))?;
            let local = l
                .local_addr()
                .map_err(|e| bad(format!("cannot read the bound address: {e}")))?;
            Ok((Acceptor::Tcp(l), format!("tcp://{local}")))
        } else if let Some(path) = address.strip_prefix("ipc://") {
            let path = PathBuf::from(path);
            // a socket file left by an earlier process is replaced, as libzmq does
            if let Ok(meta) = std::fs::symlink_metadata(&path) {
                use std::os::unix::fs::FileTypeExt;
                if meta.file_type().is_socket() {
                    let _ = std::fs::remove_file(&path);
                }
            }
            let l = UnixListener::bind(&path).map_err(|e| bad(format!("cannot listen: {e}")))?;
            Ok((Acceptor::Ipc(l, path), address.to_string()))
        } else {
            Err(bad("only tcp:// and ipc:// are supported".into()))
        }
    }

    async fn accept(&self) -> std::io::Result<(BoxStream, String)> {
        match self {
            Acceptor::Tcp(l) => {
                let (s, addr) = l.accept().await?;
                s.set_nodelay(true)?;
                Ok((Box::new(s), addr.to_string()))
            }
            Acceptor::Ipc(l, path) => {
                let (s, _) = l.accept().await?;
                Ok((Box::new(s), path.display().to_string()))
            }
        }
    }
}

/// Which socket a listener is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Router,
    Pub,
}

impl Kind {
    fn socket_type(self) -> &'static str {
        match self {
            Kind::Router => "ROUTER",
            Kind::Pub => "PUB",
        }
    }
    fn accepts(self) -> &'static [&'static str] {
        match self {
            Kind::Router => &["DEALER", "REQ", "ROUTER"],
            Kind::Pub => &["SUB", "XSUB"],
        }
    }
}

/// One connected peer, as the socket's owner sees it.
struct PeerHandle {
    /// Connection number (an identity may be reused by a later connection).
    conn: u64,
    tx: mpsc::Sender<Bytes>,
    /// PUB: the topic prefixes it subscribed to.
    topics: Vec<Bytes>,
}

/// State shared by a listener's owner, its accept loop and its peers.
struct Shared {
    what: String,
    kind: Kind,
    limits: PeerLimits,
    peers: Mutex<HashMap<Bytes, PeerHandle>>,
    connected: AtomicUsize,
    next_identity: AtomicU32,
    /// ROUTER: messages from peers, `[identity, frames…]`.
    inbox: Option<mpsc::Sender<Vec<Bytes>>>,
    /// Set when the owner is dropped: every task ends.
    closed: watch::Sender<bool>,
    dropped_sends: AtomicUsize,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Bytes, PeerHandle>> {
        // a panic while holding the map cannot leave it inconsistent (single inserts and
        // removals), so a poisoned lock is still usable
        self.peers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Queue `bytes` to one peer; `false` when the peer is unknown or its queue is full.
    fn send_to(&self, identity: &[u8], bytes: Bytes) -> bool {
        let peers = self.lock();
        match peers.get(identity) {
            Some(p) => {
                let ok = p.tx.try_send(bytes).is_ok();
                if !ok {
                    self.count_dropped();
                }
                ok
            }
            None => false,
        }
    }

    fn count_dropped(&self) {
        let n = self.dropped_sends.fetch_add(1, Ordering::Relaxed);
        if n.is_power_of_two() || n == 0 {
            tracing::warn!(
                socket = %self.what,
                dropped = n + 1,
                "a peer does not read what it is sent; dropping messages to it"
            );
        }
    }
}

/// Accept connections until the owner goes.
async fn accept_loop(acceptor: Acceptor, shared: Arc<Shared>) {
    let mut closed = shared.closed.subscribe();
    let mut conn: u64 = 0;
    let mut refused: u64 = 0;
    loop {
        let accepted = tokio::select! {
            _ = closed.wait_for(|c| *c) => return,
            a = acceptor.accept() => a,
        };
        let (stream, from) = match accepted {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(socket = %shared.what, "accepting a connection: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        if shared.connected.load(Ordering::Relaxed) >= shared.limits.max_peers {
            refused += 1;
            if refused.is_power_of_two() {
                tracing::warn!(
                    socket = %shared.what,
                    %from,
                    refused,
                    "refused a connection: {} peers are connected already",
                    shared.limits.max_peers
                );
            }
            drop(stream);
            continue;
        }
        conn += 1;
        shared.connected.fetch_add(1, Ordering::Relaxed);
        let s = shared.clone();
        let id = conn;
        tokio::spawn(async move {
            let mut closed = s.closed.subscribe();
            tokio::select! {
                _ = closed.wait_for(|c| *c) => {}
                _ = serve_peer(stream, &from, id, &s) => {}
            }
            s.connected.fetch_sub(1, Ordering::Relaxed);
        });
    }
}

/// One peer's life: handshake, then read until it closes or breaks a limit.
async fn serve_peer(mut stream: BoxStream, from: &str, conn: u64, shared: &Arc<Shared>) {
    let kind = shared.kind;
    let handshake = tokio::time::timeout(
        shared.limits.handshake_timeout,
        zmtp::handshake(&mut stream, kind.socket_type(), None, kind.accepts()),
    )
    .await;
    let (peer, pending) = match handshake {
        Ok(Ok(p)) => p,
        Ok(Err(ZmtpError::Closed | ZmtpError::Io(_))) => {
            tracing::debug!(socket = %shared.what, %from, "a connection closed before its handshake (a probe)");
            return;
        }
        Ok(Err(e)) => {
            tracing::warn!(socket = %shared.what, %from, "refused a peer: {e}");
            return;
        }
        Err(_) => {
            tracing::warn!(
                socket = %shared.what,
                %from,
                "refused a peer: no ZMTP handshake within {:?}",
                shared.limits.handshake_timeout
            );
            return;
        }
    };
    let identity = if kind == Kind::Router && !peer.identity.is_empty() {
        peer.identity.clone()
    } else {
        // libzmq's form for a peer without an identity: a zero byte and a counter
        let n = shared.next_identity.fetch_add(1, Ordering::Relaxed);
        let mut id = vec![0u8];
        id.extend_from_slice(&n.to_be_bytes());
        Bytes::from(id)
    };
    let (tx, mut rx) = mpsc::channel::<Bytes>(shared.limits.send_queue.max(1));
    {
        let mut peers = shared.lock();
        if peers.contains_key(&identity) {
            tracing::warn!(
                socket = %shared.what,
                %from,
                identity = %hex(&identity),
                "refused a peer: its identity is in use by another connection"
            );
            return;
        }
        peers.insert(
            identity.clone(),
            PeerHandle {
                conn,
                tx: tx.clone(),
                topics: Vec::new(),
            },
        );
    }
    let (mut r, mut w) = tokio::io::split(stream);
    let writer = tokio::spawn(async move {
        while let Some(bytes) = rx.recv().await {
            if w.write_all(&bytes).await.is_err() {
                break;
            }
        }
        let _ = w.shutdown().await;
    });
    let mut reader = FrameReader::new(pending, shared.limits);
    let end = loop {
        let item = match reader.next(&mut r).await {
            Ok(Some(item)) => item,
            Ok(None) => break None,
            Err(e) => break Some(e),
        };
        match item {
            Incoming::Command(name, data) => match name.as_ref() {
                b"PING" => {
                    let _ = tx.try_send(Bytes::from(zmtp::pong_for(&data)));
                }
                b"SUBSCRIBE" if kind == Kind::Pub => subscribe(shared, &identity, data, true),
                b"CANCEL" if kind == Kind::Pub => subscribe(shared, &identity, data, false),
                b"ERROR" => {
                    break Some(ZmtpError::PeerError(
                        String::from_utf8_lossy(data.get(1..).unwrap_or_default()).into_owned(),
                    ));
                }
                _ => {}
            },
            Incoming::Message(frames) => match kind {
                Kind::Router => {
                    let Some(inbox) = &shared.inbox else {
                        break None;
                    };
                    let mut msg = Vec::with_capacity(frames.len() + 1);
                    msg.push(identity.clone());
                    msg.extend(frames);
                    // a full inbox holds this peer's reads (TCP pushes back on it)
                    if inbox.send(msg).await.is_err() {
                        break None;
                    }
                }
                Kind::Pub => {
                    // ZMTP 3.0 subscriptions: `\x01topic` subscribes, `\x00topic` cancels;
                    // anything else a subscriber sends is ignored, as PUB does
                    if let [f] = frames.as_slice()
                        && let Some((&op, _)) = f.split_first()
                        && op <= 1
                    {
                        subscribe(shared, &identity, f.slice(1..), op == 1);
                    }
                }
            },
        }
    };
    if let Some(e) = end {
        tracing::warn!(
            socket = %shared.what,
            %from,
            identity = %hex(&identity),
            "dropped a peer: {e}"
        );
    }
    {
        let mut peers = shared.lock();
        if peers.get(&identity).is_some_and(|p| p.conn == conn) {
            peers.remove(&identity);
        }
    }
    drop(tx);
    writer.abort();
}

fn subscribe(shared: &Shared, identity: &Bytes, topic: Bytes, on: bool) {
    let mut peers = shared.lock();
    let Some(p) = peers.get_mut(identity) else {
        return;
    };
    if on {
        // a bound on what one subscriber can make us keep
        if p.topics.len() < 1024 {
            p.topics.push(topic);
        }
    } else if let Some(i) = p.topics.iter().position(|t| *t == topic) {
        p.topics.swap_remove(i);
    }
}

fn hex(id: &[u8]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

fn start(
    acceptor: Acceptor,
    what: &str,
    kind: Kind,
    limits: PeerLimits,
    inbox: Option<mpsc::Sender<Vec<Bytes>>>,
) -> Arc<Shared> {
    let shared = Arc::new(Shared {
        what: what.to_string(),
        kind,
        limits,
        peers: Mutex::new(HashMap::new()),
        connected: AtomicUsize::new(0),
        next_identity: AtomicU32::new(rand_start()),
        inbox,
        closed: watch::channel(false).0,
        dropped_sends: AtomicUsize::new(0),
    });
    tokio::spawn(accept_loop(acceptor, shared.clone()));
    shared
}

/// Where generated identities start (libzmq starts at a random value, so identities of
/// two sockets rarely collide).
fn rand_start() -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    t ^ std::process::id().rotate_left(16)
}

/// A ROUTER that accepts DEALER, REQ and ROUTER peers, each bounded by [`PeerLimits`].
pub struct ZmtpRouter {
    shared: Arc<Shared>,
    inbox: mpsc::Receiver<Vec<Bytes>>,
    endpoint: String,
}

impl ZmtpRouter {
    /// Listen at `address` (`tcp://host:port`, port 0 for any, or `ipc://path`). `what`
    /// names the socket in logs ("P/D side channel").
    pub async fn bind(
        address: &str,
        what: &str,
        limits: PeerLimits,
    ) -> Result<Self, TransportError> {
        let (acceptor, endpoint) = Acceptor::bind(address).await?;
        let (tx, inbox) = mpsc::channel(64);
        let shared = start(acceptor, what, Kind::Router, limits, Some(tx));
        Ok(Self {
            shared,
            inbox,
            endpoint,
        })
    }

    /// The address it listens at, with the port it got.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The next message from any peer: `[identity, frames…]` (a REQ peer's empty
    /// delimiter frame included, as a ROUTER sees it).
    pub async fn recv(&mut self) -> Option<Vec<Bytes>> {
        self.inbox.recv().await
    }

    /// Send `[identity, frames…]` to the peer with that identity. A message to a peer that
    /// is gone (or whose queue is full) is dropped, as a ROUTER does; `false` says so.
    pub fn send(&self, message: Vec<Bytes>) -> bool {
        let Some((identity, frames)) = message.split_first() else {
            return false;
        };
        if frames.is_empty() {
            return false;
        }
        self.shared.send_to(identity, encode_message(frames))
    }

    /// How many peers are connected now.
    pub fn peers(&self) -> usize {
        self.shared.lock().len()
    }
}

impl Drop for ZmtpRouter {
    fn drop(&mut self) {
        self.shared.closed.send_replace(true);
    }
}

/// A PUB that accepts SUB and XSUB peers, each bounded by [`PeerLimits`]; a peer whose
/// queue is full misses messages (ZMQ's high-water mark), never the others.
pub struct ZmtpPub {
    shared: Arc<Shared>,
    endpoint: String,
}

impl ZmtpPub {
    /// Listen at `address` (`tcp://host:port`, port 0 for any, or `ipc://path`).
    pub async fn bind(
        address: &str,
        what: &str,
        limits: PeerLimits,
    ) -> Result<Self, TransportError> {
        let (acceptor, endpoint) = Acceptor::bind(address).await?;
        let shared = start(acceptor, what, Kind::Pub, limits, None);
        Ok(Self { shared, endpoint })
    }

    /// The address it listens at, with the port it got.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Send a message to every peer subscribed to a prefix of its first frame; returns
    /// how many it was queued for.
    pub fn publish(&self, frames: &[Bytes]) -> usize {
        let Some(topic) = frames.first() else {
            return 0;
        };
        let mut bytes: Option<Bytes> = None;
        let mut sent = 0;
        let peers = self.shared.lock();
        for p in peers.values() {
            if !p.topics.iter().any(|t| topic.starts_with(t)) {
                continue;
            }
            let b = bytes.get_or_insert_with(|| encode_message(frames)).clone();
            if p.tx.try_send(b).is_ok() {
                sent += 1;
            } else {
                self.shared.count_dropped();
            }
        }
        sent
    }

    /// How many peers are connected now (subscribed or not).
    pub fn peers(&self) -> usize {
        self.shared.lock().len()
    }
}

impl Drop for ZmtpPub {
    fn drop(&mut self) {
        self.shared.closed.send_replace(true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpStream;

    fn limits() -> PeerLimits {
        PeerLimits {
            handshake_timeout: Duration::from_millis(500),
            ..PeerLimits::control(4096)
        }
    }

    /// A raw peer: greeting and READY as `socket_type`, then whatever the test sends.
    async fn raw_peer(endpoint: &str, socket_type: &str, identity: Option<&[u8]>) -> TcpStream {
        let mut s = TcpStream::connect(endpoint.trim_start_matches("tcp://"))
            .await
            .unwrap();
        let (peer, _) = zmtp::handshake(&mut s, socket_type, identity, &["ROUTER", "PUB"])
            .await
            .unwrap();
        assert!(!peer.socket_type.is_empty());
        s
    }

    async fn read_message(s: &mut TcpStream) -> Vec<Bytes> {
        let mut r = FrameReader::new(BytesMut::new(), PeerLimits::control(1 << 20));
        loop {
            match tokio::time::timeout(Duration::from_secs(5), r.next(s))
                .await
                .expect("an answer in time")
                .unwrap()
            {
                Some(Incoming::Message(m)) => return m,
                Some(Incoming::Command(..)) => continue,
                None => panic!("the socket closed the connection"),
            }
        }
    }

    #[tokio::test]
    async fn a_frame_declaring_2_pow_62_bytes_drops_only_that_peer() {
        let mut router = ZmtpRouter::bind("tcp://127.0.0.1:0", "test", limits())
            .await
            .unwrap();
        let ep = router.endpoint().to_string();
        let mut good = raw_peer(&ep, "DEALER", Some(b"good")).await;
        let mut bad = raw_peer(&ep, "DEALER", Some(b"bad")).await;
        let mut header = vec![zmtp::FLAG_LONG];
        header.extend_from_slice(&(1u64 << 62).to_be_bytes());
        bad.write_all(&header).await.unwrap();
        // the bad peer's connection is closed
        let mut sink = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(5), bad.read(&mut sink))
            .await
            .expect("the bad peer is dropped")
            .unwrap_or(0);
        assert_eq!(n, 0, "the connection of the bad peer closes");
        // the good one still talks both ways
        good.write_all(&encode_message(&[Bytes::from_static(b"hi")]))
            .await
            .unwrap();
        let got = tokio::time::timeout(Duration::from_secs(5), router.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            got,
            vec![Bytes::from_static(b"good"), Bytes::from_static(b"hi")]
        );
        assert!(router.send(vec![
            Bytes::from_static(b"good"),
            Bytes::from_static(b"there")
        ]));
        assert_eq!(
            read_message(&mut good).await,
            vec![Bytes::from_static(b"there")]
        );
    }

    #[tokio::test]
    async fn a_message_over_the_limit_or_with_too_many_frames_is_refused() {
        let router = ZmtpRouter::bind("tcp://127.0.0.1:0", "test", limits())
            .await
            .unwrap();
        let ep = router.endpoint().to_string();
        let mut big = raw_peer(&ep, "DEALER", None).await;
        // two frames of 3,000 bytes: the second takes the message past 4,096
        let f = Bytes::from(vec![7u8; 3000]);
        let _ = big.write_all(&encode_message(&[f.clone(), f])).await;
        let mut many = raw_peer(&ep, "DEALER", None).await;
        let frames: Vec<Bytes> = (0..65).map(|_| Bytes::new()).collect();
        let _ = many.write_all(&encode_message(&frames)).await;
        for s in [&mut big, &mut many] {
            let mut sink = [0u8; 64];
            let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut sink))
                .await
                .expect("dropped in time")
                .unwrap_or(0);
            assert_eq!(n, 0);
        }
        assert_eq!(router.peers(), 0);
    }

    #[tokio::test]
    async fn a_silent_connection_is_closed_after_the_handshake_timeout() {
        let _router = ZmtpRouter::bind("tcp://127.0.0.1:0", "test", limits())
            .await
            .unwrap();
        let mut s = TcpStream::connect(_router.endpoint().trim_start_matches("tcp://"))
            .await
            .unwrap();
        let mut buf = vec![0u8; 256];
        // our greeting and READY arrive, then the close
        let closed = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(closed.is_ok(), "the connection is closed after 500 ms");
    }

    #[tokio::test]
    async fn pub_sends_to_subscribers_of_a_matching_prefix_only() {
        let publisher = ZmtpPub::bind("tcp://127.0.0.1:0", "test", limits())
            .await
            .unwrap();
        let ep = publisher.endpoint().to_string();
        let mut kv = raw_peer(&ep, "SUB", None).await;
        kv.write_all(&encode_message(&[Bytes::from_static(b"\x01kv")]))
            .await
            .unwrap();
        let mut other = raw_peer(&ep, "SUB", None).await;
        other
            .write_all(&zmtp::command_frame("SUBSCRIBE", b"zz"))
            .await
            .unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while publisher.publish(&[Bytes::from_static(b"kv-events"), Bytes::from_static(b"x")]) == 0
        {
            assert!(tokio::time::Instant::now() < deadline, "no subscriber");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            read_message(&mut kv).await,
            vec![Bytes::from_static(b"kv-events"), Bytes::from_static(b"x")]
        );
        // `kv` is not subscribed to `zz`: only `other` (once its SUBSCRIBE is in) gets it
        while publisher.publish(&[Bytes::from_static(b"zz"), Bytes::from_static(b"y")]) == 0 {
            assert!(tokio::time::Instant::now() < deadline, "no zz subscriber");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            publisher.publish(&[Bytes::from_static(b"zz"), Bytes::from_static(b"y")]),
            1
        );
        assert_eq!(
            read_message(&mut other).await,
            vec![Bytes::from_static(b"zz"), Bytes::from_static(b"y")]
        );
    }

    mod fuzz {
        //! Arbitrary bytes after (or instead of) a valid handshake never take the socket
        //! down: after each hostile peer, a good peer still gets an answer.
        use super::*;
        use proptest::prelude::*;

        fn hostile_then_good(bytes: Vec<u8>, greet: bool) {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let mut router = ZmtpRouter::bind("tcp://127.0.0.1:0", "fuzz", limits())
                    .await
                    .unwrap();
                let ep = router.endpoint().to_string();
                let mut bad = if greet {
                    raw_peer(&ep, "DEALER", Some(b"bad")).await
                } else {
                    TcpStream::connect(ep.trim_start_matches("tcp://"))
                        .await
                        .unwrap()
                };
                let _ = bad.write_all(&bytes).await;
                let mut good = raw_peer(&ep, "REQ", Some(b"good")).await;
                good.write_all(&encode_message(&[Bytes::new(), Bytes::from_static(b"q")]))
                    .await
                    .unwrap();
                loop {
                    let m = tokio::time::timeout(Duration::from_secs(5), router.recv())
                        .await
                        .expect("the good peer is heard")
                        .expect("the socket is up");
                    if m[0].as_ref() == b"good" {
                        assert_eq!(m[2].as_ref(), b"q");
                        break;
                    }
                }
                assert!(router.send(vec![
                    Bytes::from_static(b"good"),
                    Bytes::new(),
                    Bytes::from_static(b"a")
                ]));
                assert_eq!(read_message(&mut good).await[1].as_ref(), b"a");
            });
        }

        fn hostile_subscriber_then_good(bytes: Vec<u8>) {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let publisher = ZmtpPub::bind("tcp://127.0.0.1:0", "fuzz", limits())
                    .await
                    .unwrap();
                let ep = publisher.endpoint().to_string();
                let mut bad = raw_peer(&ep, "SUB", None).await;
                let _ = bad.write_all(&bytes).await;
                let mut good = raw_peer(&ep, "SUB", None).await;
                good.write_all(&encode_message(&[Bytes::from_static(b"\x01t")]))
                    .await
                    .unwrap();
                let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
                // the bad peer may have subscribed too: publishing reaches the good one
                // once its subscription is in
                loop {
                    publisher.publish(&[Bytes::from_static(b"t"), Bytes::from_static(b"m")]);
                    let got =
                        tokio::time::timeout(Duration::from_millis(50), read_message(&mut good))
                            .await;
                    if let Ok(m) = got {
                        assert_eq!(m[1].as_ref(), b"m");
                        break;
                    }
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "the good subscriber got nothing"
                    );
                }
            });
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
            #[test]
            fn arbitrary_bytes_from_a_subscriber(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
                hostile_subscriber_then_good(bytes);
            }
            #[test]
            fn arbitrary_bytes_after_the_handshake(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
                hostile_then_good(bytes, true);
            }
            #[test]
            fn arbitrary_bytes_instead_of_a_greeting(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
                hostile_then_good(bytes, false);
            }
        }
    }
}
