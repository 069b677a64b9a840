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

mod accept;
pub(crate) mod frames;
mod peers;
mod sockets;
#[cfg(test)]
mod tests;

pub use frames::{PeerLimits, encode_message};
pub use sockets::{ZmtpPub, ZmtpRouter};
