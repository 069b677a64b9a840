//! The engine itself: steps composed by the batch, timed by the latency model, emitting
//! outputs — it takes the time as an argument and never does I/O.

pub mod batch;
pub mod block_hash;
pub mod emit;
pub mod engine_core;
pub mod kv_cache;
pub mod offline;
pub mod offload;
pub mod queue_policy;
pub mod request;
pub mod scripted;
pub mod sim;
pub mod timer;
pub mod utility;
