//! The state a listener shares with its accept loop and its peers, and each peer's task:
//! the handshake, the bounded reader and the bounded outgoing queue.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, watch};

use crate::zmtp::{self, ZmtpError};

use super::accept::{Acceptor, BoxStream};
use super::frames::{FrameReader, Incoming, PeerLimits};

/// Which socket a listener is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Router,
    Pub,
}

impl Kind {
    pub(super) fn socket_type(self) -> &'static str {
        match self {
            Kind::Router => "ROUTER",
            Kind::Pub => "PUB",
        }
    }
    pub(super) fn accepts(self) -> &'static [&'static str] {
        match self {
            Kind::Router => &["DEALER", "REQ", "ROUTER"],
            Kind::Pub => &["SUB", "XSUB"],
        }
    }
}

/// One connected peer, as the socket's owner sees it.
pub(super) struct PeerHandle {
    /// Connection number (an identity may be reused by a later connection).
    conn: u64,
    pub(super) tx: mpsc::Sender<Bytes>,
    /// PUB: the topic prefixes it subscribed to.
    pub(super) topics: Vec<Bytes>,
}

/// State shared by a listener's owner, its accept loop and its peers.
pub(super) struct Shared {
    pub(super) what: String,
    kind: Kind,
    pub(super) limits: PeerLimits,
    pub(super) peers: Mutex<HashMap<Bytes, PeerHandle>>,
    pub(super) connected: AtomicUsize,
    next_identity: AtomicU32,
    /// ROUTER: messages from peers, `[identity, frames…]`.
    pub(super) inbox: Option<mpsc::Sender<Vec<Bytes>>>,
    /// Set when the owner is dropped: every task ends.
    pub(super) closed: watch::Sender<bool>,
    dropped_sends: AtomicUsize,
}

impl Shared {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Bytes, PeerHandle>> {
        // a panic while holding the map cannot leave it inconsistent (single inserts and
        // removals), so a poisoned lock is still usable
        self.peers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Queue `bytes` to one peer; `false` when the peer is unknown or its queue is full.
    pub(super) fn send_to(&self, identity: &[u8], bytes: Bytes) -> bool {
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

    pub(super) fn count_dropped(&self) {
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

pub(super) fn subscribe(shared: &Shared, identity: &Bytes, topic: Bytes, on: bool) {
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

pub(super) fn start(
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
