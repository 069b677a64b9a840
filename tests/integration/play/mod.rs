//! `vllm-vcr play`, the simulated engine-core: on the wire against a Rust stand-in frontend,
//! offline, replaying captures, and as a process (signals, start order, bad input).

mod bad_input;
mod offline;
mod replay;
mod scheduler_wire;
mod signals;
mod start_order;
mod wire;
