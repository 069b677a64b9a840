//! The rig: what drives the real vLLM CPU engine for measurements rather than for pass/fail
//! legs — `cargo xtask cpu-engine` ([`smoke`]), `capture` ([`capture`]), `corpus`
//! ([`corpus`]) and `figures` ([`figures`], with the held-out table [`heldout`]), on the
//! starters of [`crate::stack`].

pub(crate) mod capture;
pub(crate) mod corpus;
pub(crate) mod figures;
pub(crate) mod heldout;
pub(crate) mod smoke;
pub(crate) mod tool;
