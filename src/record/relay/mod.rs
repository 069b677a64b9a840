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

mod bufs;
mod ctx;
mod handshake;
mod inputs;
mod legs;
mod merge;
mod pipe;
mod plane;
mod sock;
mod tap;
#[cfg(test)]
mod tests;

pub use super::handoff::Seen;
pub use ctx::{Event, RelayConfig};
pub use tap::{Tap, start};
