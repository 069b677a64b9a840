//! The stack layer, the bottom of the e2e legs and the rig: starting the frontend, the
//! `record` tap, the engine under test and the real CPU engine, waiting for them to be
//! healthy, stopping them, what a check came to, a command run beside other work
//! (`beside.rs`) and the CPU time spent (`usage.rs`). It imports nothing above it (only
//! [`crate::http`], [`crate::fetch`] and `vcr_host`).

pub(crate) mod beside;
pub(crate) mod chain;
pub(crate) mod cpu_engine;
pub(crate) mod cpu_rig;
pub(crate) mod engine;
pub(crate) mod frontend;
pub(crate) mod pacing;
pub(crate) mod pool;
pub(crate) mod result;
pub(crate) mod tap;
pub(crate) mod usage;
