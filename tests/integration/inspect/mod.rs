//! `vllm-vcr inspect`: summarize, convert, fit, calibrate, compare, simulate and the
//! Perfetto export, each driven through the binary.

mod calibrate;
mod compare;
mod convert;
mod convert_tools;
mod fit;
mod fleet;
mod offload;
mod perfetto;
mod simulate;
mod stream;
mod summarize;
