//! The stack layer: starting a frontend, the `record` tap and an engine together, and the
//! real CPU engine.

pub(crate) mod chain;
pub(crate) mod cpu_engine;
