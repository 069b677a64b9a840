//! vllm-vcr: a CPU stand-in for vLLM's engine-core process.
//!
//! The binary's subcommands live here as modules so integration tests, the xtask and the
//! benchmarks can drive them in-process.

mod print;

pub mod child;
pub mod cli;
pub mod compat;
pub mod flag_ranges;
pub mod frontends;
pub mod inspect;
pub mod io_guard;
pub mod pd_proxy;
pub mod play;
pub mod record;
pub mod serve;
pub mod tiny_model;
