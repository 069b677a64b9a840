//! KV-cache event publishing, as vLLM's `ZmqEventPublisher` does it
//! (`vllm/distributed/kv_events.py`; the wire format is in `sim_protocol::kv_events`).
//!
//! - [`parse_kv_events_config`] (`config.rs`): the `--kv-events-config '<json>'` value,
//!   accepted the way vLLM's pydantic dataclass accepts it;
//! - `endpoint.rs`: vLLM's endpoint rules (DP-rank port offset, bind or connect,
//!   `tcp://*:0` resolution);
//! - [`KvEventPublisher`] (`publisher.rs`): a PUB socket fed from the engine through an
//!   unbounded channel (publishing never blocks the engine), a replay buffer and the replay
//!   ROUTER.
//!
//! Differences from vLLM forced by the `zeromq` crate (0.7, pinned in Cargo.toml): no
//! `hwm` option (each subscriber's queue holds 100 000 messages, then that subscriber drops
//! messages), no `inproc://` transport, a connecting PUB does not reconnect after its peer
//! restarts. `max_queue_size` bounds the batches waiting in the channel: vLLM blocks the
//! engine on a full queue, we drop the batch with a warning instead.

mod config;
mod endpoint;
mod publisher;

pub use config::parse_kv_events_config;
pub use endpoint::{is_bind_endpoint, offset_endpoint_port};
pub use publisher::{END_SEQ, KvEventPublisher, wall_clock_ts};
