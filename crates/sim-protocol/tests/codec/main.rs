//! Codec behaviour: per-line layouts, leniency, errors, and known byte sequences of the
//! handshake and messages (as msgspec encodes them for vLLM).
//!
//! One test binary (`--test codec`); its files split the tests by message family:
//! `known_bytes` (handshake, utility and abort bytes), `outputs` (per-line output layouts
//! and their errors), `logprobs` (inline and out-of-band logprobs) and `requests` (lenient
//! request decoding and request encoding). `helpers` builds the messages they share.

#[path = "../common/mod.rs"]
mod common;
mod helpers;
mod known_bytes;
mod logprobs;
mod outputs;
mod requests;
