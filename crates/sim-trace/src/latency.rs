//! Latency models: how long the engine takes to its first token and between output chunks.
//!
//! A model is asked once per request for the time to first token (from admission) and once
//! per later output chunk for the gap since the previous one. The engine schedules against
//! absolute deadlines built from these answers, so gaps never accumulate drift.

use std::time::Duration;

/// What a model may condition on when it draws a delay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequestCtx {
    /// Prompt length in tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u64,
    /// Output tokens produced so far.
    pub output_tokens: u64,
    /// Requests running in the engine when the delay is drawn (this one included).
    pub running: u64,
}

/// The pacing contract the engine drives.
pub trait LatencyModel: Send {
    /// Delay from a request's admission to its first output.
    fn time_to_first_token(&mut self, ctx: &RequestCtx) -> Duration;
    /// Gap between two consecutive output chunks of a request.
    fn inter_token_latency(&mut self, ctx: &RequestCtx) -> Duration;
    /// Short name for logs.
    fn describe(&self) -> String;
    /// Whether every delay is zero (nothing to pace).
    fn is_instant(&self) -> bool {
        false
    }
}

/// Everything happens as soon as possible (the default).
#[derive(Debug, Clone, Copy, Default)]
pub struct InstantLatency;

impl LatencyModel for InstantLatency {
    fn time_to_first_token(&mut self, _: &RequestCtx) -> Duration {
        Duration::ZERO
    }
    fn inter_token_latency(&mut self, _: &RequestCtx) -> Duration {
        Duration::ZERO
    }
    fn describe(&self) -> String {
        "instant".to_string()
    }
    fn is_instant(&self) -> bool {
        true
    }
}

/// Constant delays, no randomness.
#[derive(Debug, Clone, Copy)]
pub struct FixedLatency {
    pub ttft: Duration,
    pub itl: Duration,
}

impl LatencyModel for FixedLatency {
    fn time_to_first_token(&mut self, _: &RequestCtx) -> Duration {
        self.ttft
    }
    fn inter_token_latency(&mut self, _: &RequestCtx) -> Duration {
        self.itl
    }
    fn describe(&self) -> String {
        format!(
            "fixed (ttft {:.3} ms, itl {:.3} ms)",
            self.ttft.as_secs_f64() * 1e3,
            self.itl.as_secs_f64() * 1e3
        )
    }
}

/// Build the model the knobs describe: instant when both are zero, fixed otherwise.
pub fn from_knobs(ttft_ms: f64, itl_ms: f64) -> Box<dyn LatencyModel> {
    let ms = |v: f64| Duration::from_secs_f64(v.max(0.0) / 1e3);
    if ttft_ms <= 0.0 && itl_ms <= 0.0 {
        Box::new(InstantLatency)
    } else {
        Box::new(FixedLatency {
            ttft: ms(ttft_ms),
            itl: ms(itl_ms),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knobs_pick_the_model() {
        let ctx = RequestCtx::default();
        let mut m = from_knobs(0.0, 0.0);
        assert_eq!(m.time_to_first_token(&ctx), Duration::ZERO);
        assert_eq!(m.describe(), "instant");
        let mut m = from_knobs(40.0, 5.5);
        assert_eq!(m.time_to_first_token(&ctx), Duration::from_millis(40));
        assert_eq!(m.inter_token_latency(&ctx), Duration::from_micros(5500));
    }
}
