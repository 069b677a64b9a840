//! `cargo xtask e2e`: the end-to-end matrix, legs built on [`crate::stack`]. The runner
//! ([`runner`]) builds the legs the flags select ([`select`]) and runs them; each group of
//! legs builds and runs its own: the basic legs ([`basic`]: the check catalogue [`checks`] against `play`
//! behind every frontend), the scheduler legs ([`scheduler`], loaded by [`load`]), the
//! record legs ([`record`]), the replay legs ([`replay`]) and the parity leg ([`parity`]);
//! the runner can run a command (CI: the `serve_e2e` tests) beside the legs that compare
//! content only ([`crate::stack::beside`]).

pub(crate) mod basic;
pub(crate) mod checks;
pub(crate) mod load;
pub(crate) mod parity;
pub(crate) mod record;
pub(crate) mod replay;
pub(crate) mod runner;
pub(crate) mod scheduler;
pub(crate) mod select;

// what `main` and `ci` call
pub use runner::{run, run_beside};
pub use select::{GroupPick, Options};
