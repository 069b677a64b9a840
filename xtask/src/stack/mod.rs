//! The stack layer, the bottom of the e2e legs and the rig: starting the frontend, the
//! `record` tap, the engine under test and the real CPU engine, waiting for them to be
//! healthy, stopping them, and what a check came to. It imports nothing above it (only
//! [`crate::http`], [`crate::fetch`] and `vcr_host`).

pub(crate) mod chain;
pub(crate) mod cpu_engine;
pub(crate) mod cpu_rig;
pub(crate) mod engine;
pub(crate) mod frontend;
pub(crate) mod pacing;
pub(crate) mod pool;
pub(crate) mod result;
pub(crate) mod tap;
