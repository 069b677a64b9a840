//! The offline driver: the very same engine on a virtual clock — no sockets, no sleeping.
//!
//! Inputs are fed with the time they arrive; the driver processes them and the engine's
//! deadlines in time order (a step that ends at `t` ends before an input that arrives at
//! `t`, as in the live loop), jumping from one event to the next. Outputs come back with
//! the virtual time they were emitted. This is what simulation and calibration build on:
//! a live run and an offline run that see the same arrivals compose the same steps, draw
//! the same durations and emit the same tokens.
//!
//! ```no_run
//! # use std::time::Duration;
//! # use vllm_vcr::play::{config::PlayConfig, engine::offline::OfflineDriver};
//! # use sim_protocol::EngineCoreRequest;
//! let cfg = PlayConfig::defaults();
//! let mut run = OfflineDriver::new(cfg.build_engine(0));
//! run.add(Duration::from_millis(5), 0, EngineCoreRequest::default());
//! let outputs = run.run_until_idle();
//! ```

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use sim_protocol::{EngineCoreOutputs, EngineCoreRequest, InputMessage};

use super::engine_core::{EngineCore, EngineInput, Outbound, Outbox};

/// An output and when it was emitted (virtual time since the driver's origin).
#[derive(Debug)]
pub struct TimedOutput {
    pub at: Duration,
    /// The API-server index (output socket) it is addressed to.
    pub client: u32,
    pub outputs: EngineCoreOutputs,
}

/// Drives an [`EngineCore`] on a virtual clock.
pub struct OfflineDriver<E: EngineCore> {
    engine: E,
    /// The virtual clock's origin. The engine sees `origin + t`; the origin itself is
    /// read once so engine timestamps look like the monotonic clock's.
    origin: Instant,
    now: Duration,
    /// Inputs not yet delivered, in arrival order (stable for equal times).
    pending: VecDeque<(Duration, EngineInput)>,
    /// Set when the engine reported a fatal error (`ENGINE_CORE_DEAD`).
    dead: bool,
}

impl<E: EngineCore> OfflineDriver<E> {
    pub fn new(engine: E) -> Self {
        Self {
            engine,
            origin: Instant::now(),
            now: Duration::ZERO,
            pending: VecDeque::new(),
            dead: false,
        }
    }

    /// The driver's origin on the engine's clock (virtual time zero).
    pub fn origin(&self) -> Instant {
        self.origin
    }

    /// Virtual time reached so far.
    pub fn now(&self) -> Duration {
        self.now
    }

    pub fn engine(&self) -> &E {
        &self.engine
    }

    /// The engine, to ask it between events (a fleet's router takes its cache events).
    pub fn engine_mut(&mut self) -> &mut E {
        &mut self.engine
    }

    pub fn into_engine(self) -> E {
        self.engine
    }

    /// Whether the engine reported a fatal error.
    pub fn is_dead(&self) -> bool {
        self.dead
    }

    /// Deliver `input` at virtual time `at` (never before the current time).
    pub fn push(&mut self, at: Duration, input: EngineInput) {
        let at = at.max(self.now);
        let pos = self.pending.partition_point(|(t, _)| *t <= at);
        self.pending.insert(pos, (at, input));
    }

    /// A request arrives at `at` on API-server `client`'s socket.
    pub fn add(&mut self, at: Duration, client: u32, req: EngineCoreRequest) {
        let msg = InputMessage::Add(Box::new(req));
        self.push(at, EngineInput::Message { client, msg });
    }

    /// The frontend aborts `ids` at `at`.
    pub fn abort(&mut self, at: Duration, client: u32, ids: Vec<String>) {
        let msg = InputMessage::Abort(ids);
        self.push(at, EngineInput::Message { client, msg });
    }

    /// The engine's next deadline, on the virtual clock (never before the current time).
    fn deadline(&self) -> Option<Duration> {
        self.engine
            .next_deadline()
            .map(|d| d.saturating_duration_since(self.origin).max(self.now))
    }

    /// When the next event happens: the engine's next deadline or the next input,
    /// whichever comes first; `None` when nothing is left to do. A caller that reacts to
    /// outputs with new inputs (a closed loop) runs to each event in turn.
    pub fn next_event(&self) -> Option<Duration> {
        let input = self.pending.front().map(|(t, _)| *t);
        match (self.deadline(), input) {
            (Some(d), Some(i)) => Some(d.min(i)),
            (d, i) => d.or(i),
        }
    }

    /// Process every event up to and including virtual time `until`.
    pub fn run_until(&mut self, until: Duration) -> Vec<TimedOutput> {
        let mut got = Vec::new();
        let mut out = Outbox::default();
        loop {
            let deadline = self.deadline();
            let Some(next) = self.next_event() else {
                break;
            };
            if next > until {
                break;
            }
            self.now = next;
            let now = self.origin + next;
            // An input due at a step's deadline is taken first: it reached the engine
            // while that step ran, so it is queued at the step's end and can join the next
            // step, as in a live run where it arrived a moment before the deadline.
            let input_due = self.pending.front().is_some_and(|(t, _)| *t <= next);
            if input_due {
                if let Some((_, input)) = self.pending.pop_front() {
                    self.engine.on_input(input, now, &mut out);
                }
            } else if deadline.is_some_and(|d| d <= next) {
                self.engine.on_deadline(now, &mut out);
            }
            self.collect(&mut out, &mut got);
        }
        self.now = self.now.max(until.min(self.now.max(until)));
        got
    }

    /// Process every event until no input is left and the engine has nothing scheduled.
    pub fn run_until_idle(&mut self) -> Vec<TimedOutput> {
        self.run_until(Duration::MAX)
    }

    /// Shut down at the current time: stop taking requests, serve the admitted ones for
    /// `drain`, then abort the rest.
    pub fn shutdown(&mut self, drain: Duration) -> Vec<TimedOutput> {
        let mut got = Vec::new();
        let mut out = Outbox::default();
        self.engine.begin_shutdown(self.origin + self.now, &mut out);
        self.collect(&mut out, &mut got);
        let until = self.now.saturating_add(drain);
        got.extend(self.run_until(until));
        if !self.engine.is_idle() {
            self.now = self.now.max(until);
            self.engine.abort_all(self.origin + self.now, &mut out);
            self.collect(&mut out, &mut got);
        }
        got
    }

    fn collect(&mut self, out: &mut Outbox, got: &mut Vec<TimedOutput>) {
        let mut pulled = Vec::new();
        for item in out.items.drain(..) {
            match item {
                Outbound::Outputs { client, outputs } => got.push(TimedOutput {
                    at: self.now,
                    client,
                    outputs,
                }),
                Outbound::Dead => self.dead = true,
                // offline there is no prefill engine to read from: the pull succeeds at
                // once (its time is the latency model's KV-transfer cost)
                Outbound::Pull(p) => pulled.push(p),
                // offline the grammar compiles at once, at the current virtual time: runs
                // stay deterministic (the live wait for a compile is wall-clock time)
                Outbound::Compile(c) => {
                    let ready = c.run();
                    self.push(self.now, ready);
                }
            }
        }
        for p in pulled {
            let n = p.remote.block_ids.len();
            let ev = crate::play::pd::PdEvent::Pulled {
                request_id: p.request_id,
                result: Ok(n),
                transfer: crate::play::pd::connector_stats::Transfer::None,
            };
            self.push(self.now, EngineInput::Pd(ev));
        }
    }
}
