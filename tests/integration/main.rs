//! The integration tests of `vllm-vcr`, one binary (one link on a 2-core machine instead
//! of one per file), a module per area. A test's name is its module path, e.g.
//! `inspect::perfetto::serves_the_trace`; run an area with `cargo test --test integration
//! -- inspect::`. The NIXL-stage tests are the other binary, `tests/nixl/`.
//!
//! The tests of an area run as threads of this one process: a test never changes the
//! process's environment or working directory (it sets them on the child it spawns).

#[path = "../support/mod.rs"]
mod support;

mod cli;
mod conformance;
mod inspect;
mod kv_events;
mod play;
mod record_tap;
mod serve_e2e;
