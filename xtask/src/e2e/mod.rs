//! `cargo xtask e2e`: the end-to-end matrix and its legs.

pub(crate) mod checks;
pub(crate) mod load;
pub(crate) mod parity;
pub(crate) mod record;
pub(crate) mod replay;
pub(crate) mod runner;
pub(crate) mod scheduler;

pub use runner::{Options, SchedulerLegs, run};
