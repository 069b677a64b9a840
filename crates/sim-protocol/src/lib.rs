//! The vLLM engine-core wire protocol (ZMQ + msgpack), for every line from 0.25 to 0.33.
//!
//! - [`mod@line`]: the supported lines and their array layouts;
//! - [`types`]: the messages as Rust values;
//! - [`decode`] / [`encode`]: msgspec-compatible codec (lenient decode, per-line encode);
//! - [`ready`]: the engine's ready response and the handshake maps;
//! - [`transport`]: sockets and the handshake, engine side and frontend side;
//! - [`zmtp`]: ZMTP framing of our own (greeting, READY, frame headers);
//! - [`push`]: the engine's output sockets on that framing, written from the engine thread;
//! - [`dealer`]: the engine's input sockets on that framing, read on the engine thread;
//! - [`listener`]: sockets that accept peers we do not control, each peer bounded.
//!
//! No simulation lives here.

pub mod dealer;
pub mod decode;
pub mod encode;
pub mod kv_events;
pub mod line;
pub mod listener;
pub mod push;
pub mod ready;
pub mod transport;
pub mod types;
pub mod zmtp;

pub use decode::{
    DecodeError, DecodeErrorKind, DecodedOutputs, ErrorContext, decode_input, decode_outputs,
    decode_outputs_for,
};
pub use encode::{EncodeError, EncodeOptions, encode_outputs};
pub use line::{VllmLine, describe_lines, supported_lines};
pub use ready::{
    HandshakeInit, ReadyResponse, StatusMessage, encode_status, rewrite_init_addresses,
};
pub use types::*;
