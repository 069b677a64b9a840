//! The two socket kinds built on the listener: [`ZmtpRouter`] and [`ZmtpPub`].

use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::mpsc;

use crate::transport::TransportError;

use super::accept::Acceptor;
use super::frames::{PeerLimits, encode_message};
use super::peers::{Kind, Shared, start};

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
