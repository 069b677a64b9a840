//! Trace schema, latency models and statistics for vllm-vcr.
//!
//! This crate knows nothing about ZMQ or the wire protocol, so analysis tools can build
//! without the protocol stack.

pub mod config_hash;
pub mod fastjson;
pub mod fit;
pub mod host;
pub mod latency;
pub mod loads;
pub mod replay;
mod rng;
pub mod stats;
pub mod steps;
pub mod trace;
