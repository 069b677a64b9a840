//! What a request's tokens are: random, echoed, readable text, replayed from a recording,
//! shaped by a grammar, with logprobs, speculative-decoding counts, pooled vectors or an
//! injected failure.

pub mod constrained;
pub mod failures;
pub mod logprobs;
pub mod pooling;
pub mod reasoning;
pub mod reasoning_count;
pub mod replay;
pub mod spec_decode;
pub mod text;
pub mod tokens;
pub mod vocab;
