//! The integration tests of `vllm-vcr`, one binary (one link on a 2-core machine instead
//! of one per file), a module per area. A test's name is its module path, e.g.
//! `inspect::perfetto::json::stdout_is_the_default_output`; run an area with `cargo test
//! --test integration -- inspect::`.
//!
//! The tests run as threads of this one process: a test never changes the process's
//! environment or working directory (it sets them on the child it spawns).
//!
//! The other binaries hold what must not share the machine with these tests (Cargo runs
//! test binaries one after the other): `tests/serve_e2e/` and `tests/kv_events_e2e/` start real
//! vLLM frontends and Python consumers whose start-up is bounded, `tests/replay_fitted/`
//! compares wall-clock latencies with a capture's; `tests/nixl/` is what CI's test stage
//! runs with the feature.

#[path = "../support/mod.rs"]
mod support;

mod cli;
mod conformance;
mod inspect;
mod play;
mod record_tap;
