//! The integration tests' kit, shared by the root crate's test binaries (`tests/*/main.rs`,
//! each declaring it with `#[path = "../support/mod.rs"] mod support;`).
//!
//! - [`cmd`]: [`vcr()`], the binary under test as a [`TestCommand`] (a `Command` that
//!   panics with the command line, its directory and its output when it fails), and
//!   [`inspect()`] for `vllm-vcr inspect <sub>`; [`stdout`], [`stderr`] and [`texts`]
//!   (both) of an `Output`; [`vcr_command()`], a plain `Command` for a process the test
//!   spawns (a server, a tap).
//! - [`dir`]: [`TestDir`], a test's own scratch directory, removed when the test passes and
//!   kept when it fails; [`process_dir`] for a file that several tests of a process share.
//! - [`disturbance`]: [`Disturbance`], how much the machine stalled a wall-clock test
//!   while it ran (a timing check is judged against it, never run twice).
//! - [`http`]: HTTP to a server the test started, with the xtask's client
//!   ([`http_get`], [`http_post_json`], [`http_request`], [`http_get_ok`]: is it up).
//! - [`paths`]: [`fixture`] (a path under the repository root), [`cpu_capture`] and
//!   [`corpus`] (the committed captures), [`s`] (a path as `&str`).
//! - [`process`]: [`TestProcess`], a process the test drives (a server, a tap, a proxy):
//!   logs kept and printed when the test fails, stopped when the test ends.
//! - [`reports`]: traces and `inspect` reports ([`read_trace`], [`pooled_cohort`],
//!   [`cohort`], [`number`], [`copy_with_config_hash`]).
//! - [`svg`]: [`svg::check_xml`], for the `--plot` figures.
//! - [`wait`]: [`wait_until`] a condition, [`vllm_python`] (the cached vLLM venv's Python,
//!   or a failed test saying why it is needed).
//! - [`wire`]: a Rust stand-in for a vLLM frontend, driving `play` over real ZMQ sockets
//!   ([`Wire`], [`Collected`], [`add`], [`request`], ...).

// Each test binary uses a subset of the kit: what one binary leaves unused is not dead.
#![allow(dead_code, unused_imports)]

pub mod cmd;
pub mod dir;
pub mod disturbance;
pub mod http;
pub mod paths;
pub mod process;
pub mod reports;
pub mod svg;
pub mod wait;
pub mod wire;

pub use cmd::*;
pub use dir::*;
pub use disturbance::*;
pub use http::{http_client, http_get, http_get_ok, http_post_json, http_request};
pub use paths::*;
pub use process::*;
pub use reports::*;
pub use wait::*;
pub use wire::*;
