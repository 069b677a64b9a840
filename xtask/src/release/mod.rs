//! The release room: CI, the container image, vLLM lines and the workflows' lint.

pub(crate) mod ci;
pub(crate) mod containers;
pub(crate) mod lines;
pub(crate) mod workflows;
