//! The release room: what keeps the project shippable — `cargo xtask ci` ([`ci`]), the
//! container image and deploy/ ([`containers`]), adding and dropping vLLM lines
//! ([`lines`]), and the CI workflows' lint ([`workflows`]).

pub(crate) mod ci;
pub(crate) mod containers;
pub(crate) mod lines;
pub(crate) mod workflows;
