//! The tests CI's test stage runs with `--features nixl` (`cargo test --features nixl
//! --test nixl` alone): the NIXL data plane in one process ([`loopback`], built only with the
//! feature) and prefill/decode disaggregation end to end ([`pd_control`]: the control plane
//! in every build, the KV bytes over NIXL with the feature) and a real vLLM engine as the
//! pair's other half ([`real_peer`], with the feature); the reads shown as `vllm:nixl_*`
//! metrics by vLLM's Python frontend ([`connector_stats`], with the feature). A binary of
//! its own so `--test nixl` names exactly these.

#[path = "../support/mod.rs"]
mod support;

#[cfg(feature = "nixl")]
mod connector_stats;
mod loopback;
mod pd_control;
#[cfg(feature = "nixl")]
mod real_peer;
