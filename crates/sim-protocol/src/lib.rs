//! The vLLM engine-core wire protocol (ZMQ + msgpack), for every line from 0.25 to 0.33.
//!
//! - [`line`]: the supported lines and their array layouts;
//! - [`types`]: the messages as Rust values;
//! - [`decode`] / [`encode`]: msgspec-compatible codec (lenient decode, per-line encode);
//! - [`ready`]: the engine's ready response and the handshake maps;
//! - [`transport`]: sockets and the handshake, engine side and frontend side.
//!
//! No simulation lives here.

pub mod line;
pub mod types;

pub use line::{VllmLine, describe_lines, supported_lines};
pub use types::*;
