//! The release room: what keeps the project shippable — `cargo xtask ci` ([`ci`]), the
//! container image and deploy/ ([`containers`]), adding and dropping vLLM lines
//! ([`lines`]), the CI workflows' lint ([`workflows`]) and the house's shape: file
//! lengths and import cycles ([`layout`]).

pub(crate) mod ci;
pub(crate) mod containers;
pub(crate) mod layout;
pub(crate) mod lines;
pub(crate) mod workflows;
