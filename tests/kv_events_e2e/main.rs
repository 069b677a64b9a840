//! KV-cache events: what `play` publishes, read by vLLM's own engine-side code and by a
//! real subscriber. A binary of its own: the Python consumers' start-up is bounded, and
//! must not compete with the other integration tests for the machine.

#[path = "../support/mod.rs"]
mod support;

mod engine;
mod subscriber;
