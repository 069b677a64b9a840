//! The rig: capturing the real CPU engine, the conformance corpus and its figures.

pub(crate) mod capture;
pub(crate) mod corpus;
pub(crate) mod figures;
pub(crate) mod heldout;
