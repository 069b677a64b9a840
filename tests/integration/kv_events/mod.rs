//! KV-cache events: what `play` publishes, read by vLLM's own engine-side code and by a
//! real subscriber.

mod engine;
mod subscriber;
