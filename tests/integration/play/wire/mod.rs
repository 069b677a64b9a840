//! Wire-level tests: a Rust frontend stand-in drives `play` over real ZMQ sockets and checks
//! what a frontend would observe: a request's life in [`requests`], the engine as the
//! frontend's peer in [`engine`], structured outputs in [`structured`].

use std::time::{Duration, Instant};

use crate::support::*;
use rmpv::Value;
use sim_protocol::{EventType, FinishReason, InputMessage, StopReason, VllmLine};
use vllm_vcr::play::TokenMode;

mod engine;
mod requests;
mod structured;

fn line(s: &str) -> VllmLine {
    VllmLine::parse(s).unwrap()
}
