//! vllm-vcr: a CPU stand-in for vLLM's engine-core process.
//!
//! The binary's subcommands live here as modules so integration tests, the xtask and the
//! benchmarks can drive them in-process.

pub mod cli;
pub mod compat;
pub mod flag_ranges;
pub mod http_proxy;
pub mod inspect;
pub mod io_guard;
pub mod pd_proxy;
pub mod play;
pub mod record;
pub mod serve;

// Host plumbing shared with the xtask (crates/vcr-host), at the paths the integration
// tests and benchmarks import (`vllm_vcr::child::free_ports`, `vllm_vcr::frontends::…`,
// `vllm_vcr::tiny_model::write_to`); product modules use `vcr_host::…` directly.
pub use vcr_host::{child, frontends, tiny_model};
// `crate::errln!` and the others, in every module of this crate.
pub use vcr_host::{errln, errp, outln};
