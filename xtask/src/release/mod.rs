//! The release room: what keeps the project shippable — `cargo xtask ci` ([`ci`]) and the
//! build directory checkouts share ([`build_cache`]), the container image and deploy/
//! ([`containers`]), adding and dropping vLLM lines ([`lines`]), the CI workflows' lint
//! ([`workflows`]) and the house's shape: file lengths and import cycles ([`layout`]).

pub(crate) mod build_cache;
pub(crate) mod ci;
pub(crate) mod containers;
pub(crate) mod layout;
pub(crate) mod lines;
pub(crate) mod workflows;
