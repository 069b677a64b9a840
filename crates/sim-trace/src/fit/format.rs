//! The identity of a model file: the format name and version it carries, which loading
//! checks first and the errors name.

/// The `format` of a model file.
pub const FORMAT: &str = "vllm-vcr-latency-model";
/// The model file version this build writes and reads (1 was the batch-quantile model of
/// earlier builds).
pub const VERSION: u32 = 2;
