//! The contract between the engine loop and an engine, and the loop itself.
//!
//! `run_loop` owns the `select!` over frontend inputs, the shutdown signal and the engine's
//! next deadline; an [`EngineCore`] only reacts. `SimEngine` is the production engine; the
//! small `ConstantEngine` in the tests proves the loop. The engine never reads a clock:
//! every call carries `now` (the live loop's wall clock here, a virtual clock in the
//! offline driver).

use std::time::{Duration, Instant};

use sim_protocol::decode::DecodeError;
use sim_protocol::{EngineCoreOutputs, InputMessage};
use tokio::sync::{mpsc, watch};

use super::timer::PreciseTimer;

/// Something the io layer hands to the engine.
#[derive(Debug)]
pub enum EngineInput {
    /// A decoded message that arrived on input socket `client` (the API-server index).
    Message { client: u32, msg: InputMessage },
    /// A frame that could not be decoded.
    Bad { client: u32, error: DecodeError },
    /// Prefill/decode: the side channel or a KV pull reports.
    Pd(crate::play::pd::PdEvent),
    /// A request's grammar, compiled off the engine thread (see [`Outbound::Compile`]).
    Grammar(GrammarReady),
}

/// A grammar to compile away from the step loop: vLLM compiles structured-output grammars
/// in a thread pool while the request waits (`WAITING_FOR_FSM`) and the others keep
/// stepping. The engine hands the job out; the loop's side runs it and hands the result
/// back as [`EngineInput::Grammar`] (the offline driver runs it at once, on its clock).
#[derive(Debug)]
pub struct GrammarCompile {
    pub request_id: String,
    pub job: crate::play::content::constrained::GrammarJob,
}

impl GrammarCompile {
    /// Build and compile the grammar (slow for a big one: run it on a blocking thread).
    pub fn run(self) -> EngineInput {
        EngineInput::Grammar(GrammarReady {
            request_id: self.request_id,
            result: self
                .job
                .compile()
                .map(|s| Box::new(s) as Box<dyn crate::play::content::tokens::TokenStream>),
        })
    }
}

/// A compiled grammar: the request's stream, or why it cannot be generated.
pub struct GrammarReady {
    pub request_id: String,
    pub result: Result<Box<dyn crate::play::content::tokens::TokenStream>, String>,
}

impl std::fmt::Debug for GrammarReady {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarReady")
            .field("request_id", &self.request_id)
            .field("result", &self.result.as_ref().map(|_| "stream"))
            .finish()
    }
}

/// Something the engine wants sent.
#[derive(Debug)]
pub enum Outbound {
    /// An envelope for output socket `client`.
    Outputs {
        client: u32,
        outputs: EngineCoreOutputs,
    },
    /// A fatal error: send `ENGINE_CORE_DEAD` on every output socket.
    Dead,
    /// Prefill/decode: pull a decode request's KV from its prefill engine; the answer
    /// comes back as [`EngineInput::Pd`].
    Pull(crate::play::pd::Pull),
    /// Compile a request's grammar off the engine thread; the result comes back as
    /// [`EngineInput::Grammar`].
    Compile(GrammarCompile),
}

/// Collects what one engine callback wants sent.
#[derive(Debug, Default)]
pub struct Outbox {
    pub items: Vec<Outbound>,
}

impl Outbox {
    pub fn send(&mut self, client: u32, outputs: EngineCoreOutputs) {
        self.items.push(Outbound::Outputs { client, outputs });
    }

    pub fn pull(&mut self, pull: crate::play::pd::Pull) {
        self.items.push(Outbound::Pull(pull));
    }

    pub fn compile(&mut self, job: GrammarCompile) {
        self.items.push(Outbound::Compile(job));
    }
}

/// Where the loop hands what the engine wants sent. The live engine's outlet encodes and
/// writes the outputs on the loop's own thread (`play/outlet.rs`); a channel serves
/// the tests.
pub trait Outlet {
    /// Take one item; `false` when the output side is broken and the loop must stop.
    fn deliver(&mut self, item: Outbound) -> bool;
    /// Some output waits for a peer to read: the loop also waits on [`Self::drain`].
    fn backlogged(&self) -> bool {
        false
    }
    /// A peer's backlog is past its bound: the loop waits on [`Self::drain`] before it
    /// steps again (a ZMQ PUSH at its high-water mark blocks its sender alike).
    fn over_bound(&self) -> bool {
        false
    }
    /// `true`: the next step is due at once, so hold what is delivered to send it with
    /// that step's (one write for a burst of back-to-back steps); `false`: send it now.
    fn hold(&mut self, _on: bool) {}
    /// Write some of the backlog once a peer can take it. Cancel-safe.
    fn drain(&mut self) -> impl std::future::Future<Output = ()> + Send {
        async {}
    }
}

impl Outlet for mpsc::UnboundedSender<Outbound> {
    fn deliver(&mut self, item: Outbound) -> bool {
        self.send(item).is_ok()
    }
}

/// The engine side of the loop.
pub trait EngineCore {
    /// A message (or an undecodable frame) from the frontend.
    fn on_input(&mut self, input: EngineInput, now: Instant, out: &mut Outbox);
    /// The deadline returned by `next_deadline` has been reached.
    fn on_deadline(&mut self, now: Instant, out: &mut Outbox);
    /// When the engine next wants `on_deadline`; `None` when it has nothing scheduled.
    fn next_deadline(&self) -> Option<Instant>;
    /// Shutdown was requested: stop taking new requests, keep serving the admitted ones.
    fn begin_shutdown(&mut self, now: Instant, out: &mut Outbox);
    /// Finish every remaining request with ABORT (the drain time ran out).
    fn abort_all(&mut self, now: Instant, out: &mut Outbox);
    /// No request left in the engine.
    fn is_idle(&self) -> bool;
}

/// Why `run_loop` returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoopExit {
    /// Shutdown requested and every request finished in time.
    Drained,
    /// Shutdown requested; the drain time ran out and the rest was aborted.
    DrainTimedOut,
    /// The io layer went away (frontend gone or sockets failed).
    InputsClosed,
    /// The output side went away.
    OutputsClosed,
}

pub struct LoopControl {
    /// Becomes `true` when the process should shut down.
    pub shutdown: watch::Receiver<bool>,
    /// How long to keep serving admitted requests after shutdown was requested.
    pub shutdown_timeout: Duration,
    /// Inputs that are not the frontend's (the P/D side channel and KV pulls): they keep
    /// coming while the engine runs, so they do not count for "the frontend is gone".
    pub side: Option<mpsc::UnboundedReceiver<EngineInput>>,
}

/// Drive `engine` until shutdown or until the frontend goes away.
pub async fn run_loop<E: EngineCore, O: Outlet>(
    engine: &mut E,
    inputs: &mut mpsc::UnboundedReceiver<EngineInput>,
    outputs: &mut O,
    mut ctl: LoopControl,
) -> LoopExit {
    let mut timer = match PreciseTimer::new() {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::warn!("no timerfd ({e}); pacing falls back to tokio's millisecond timer");
            None
        }
    };
    let mut drain_until: Option<Instant> = None;
    let mut out = Outbox::default();
    let mut shutdown_seen = *ctl.shutdown.borrow();
    // back-to-back steps taken without waiting on the timer, since the loop last yielded
    let mut direct = 0u32;
    if shutdown_seen {
        engine.begin_shutdown(Instant::now(), &mut out);
        drain_until = Some(Instant::now() + ctl.shutdown_timeout);
    }
    loop {
        if drain_until.is_some() && engine.is_idle() {
            if !flush(&mut out, outputs).await {
                return LoopExit::OutputsClosed;
            }
            return LoopExit::Drained;
        }
        let deadline = engine.next_deadline();
        // A step already due (no latency, or catching up) with nothing else to wait for is
        // taken at once, in the select's order (inputs first), rather than through an
        // expired timer and a trip through the runtime's poller (a few µs a step); the loop
        // still yields to the runtime every so often.
        let due_now = (deadline.is_some()
            && drain_until.is_none()
            && !outputs.backlogged()
            && direct < DIRECT_STEPS
            && !ctl.shutdown.has_changed().unwrap_or(true))
        .then(Instant::now)
        .filter(|&now| deadline.is_some_and(|d| d <= now));
        let taken = match due_now {
            Some(now) => match inputs.try_recv() {
                Ok(m) => {
                    fire_due(engine, now, &mut out);
                    engine.on_input(m, now, &mut out);
                    true
                }
                Err(mpsc::error::TryRecvError::Empty) => {
                    match ctl.side.as_mut().map(|rx| rx.try_recv()) {
                        Some(Ok(m)) => {
                            fire_due(engine, now, &mut out);
                            engine.on_input(m, now, &mut out);
                        }
                        _ => engine.on_deadline(now, &mut out),
                    }
                    true
                }
                // the input side is gone: the select below says so
                Err(mpsc::error::TryRecvError::Disconnected) => false,
            },
            None => false,
        };
        if taken {
            direct += 1;
        } else {
            if direct >= DIRECT_STEPS {
                direct = 0;
                tokio::task::yield_now().await;
            }
            tokio::select! {
                biased;
                msg = inputs.recv() => match msg {
                    Some(m) => {
                        let now = Instant::now();
                        // Steps that ended before this input was seen end first, so the engine
                        // sees events in time order (as the offline driver does).
                        fire_due(engine, now, &mut out);
                        // a shutdown signalled before this input was read comes first: the
                        // biased select would otherwise admit a request that arrived after it
                        if !shutdown_seen && *ctl.shutdown.borrow() {
                            shutdown_seen = true;
                            engine.begin_shutdown(now, &mut out);
                            drain_until = Some(now + ctl.shutdown_timeout);
                        }
                        engine.on_input(m, now, &mut out);
                    }
                    None => {
                        flush(&mut out, outputs).await;
                        return LoopExit::InputsClosed;
                    }
                },
                Some(m) = recv_side(&mut ctl.side) => {
                    let now = Instant::now();
                    fire_due(engine, now, &mut out);
                    engine.on_input(m, now, &mut out);
                }
                changed = ctl.shutdown.changed(), if !shutdown_seen => {
                    if changed.is_err() || *ctl.shutdown.borrow() {
                        shutdown_seen = true;
                        let now = Instant::now();
                        engine.begin_shutdown(now, &mut out);
                        drain_until = Some(now + ctl.shutdown_timeout);
                    }
                }
                _ = sleep_until(&mut timer, earliest(deadline, drain_until)), if deadline.is_some() || drain_until.is_some() => {
                    let now = Instant::now();
                    if drain_until.is_some_and(|d| now >= d) {
                        engine.abort_all(now, &mut out);
                        if !flush(&mut out, outputs).await {
                            return LoopExit::OutputsClosed;
                        }
                        return LoopExit::DrainTimedOut;
                    }
                    engine.on_deadline(now, &mut out);
                }
                () = outputs.drain(), if outputs.backlogged() => {}
            }
        }
        if !flush(&mut out, outputs).await {
            return LoopExit::OutputsClosed;
        }
        // Outputs of steps that run back to back (an engine with no latency, or one catching
        // up) leave together once the loop is about to wait; a paced step's leave at once.
        let due = engine.next_deadline().is_some_and(|d| d <= Instant::now());
        outputs.hold(due);
    }
}

async fn recv_side(side: &mut Option<mpsc::UnboundedReceiver<EngineInput>>) -> Option<EngineInput> {
    match side {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// Due steps the loop takes directly in a row before it yields to the runtime once. The
/// live engine's inputs are read by tasks on the loop's own runtime, which run only while
/// the loop yields or waits: a streak of due steps holds a new request back by at most
/// this many steps.
const DIRECT_STEPS: u32 = 16;

/// Run every deadline that is due at `now`.
fn fire_due<E: EngineCore>(engine: &mut E, now: Instant, out: &mut Outbox) {
    while let Some(d) = engine.next_deadline() {
        if d > now {
            return;
        }
        engine.on_deadline(now, out);
        if engine.next_deadline() == Some(d) {
            return; // no progress: leave it to the timer rather than spin
        }
    }
}

fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

async fn sleep_until(timer: &mut Option<PreciseTimer>, deadline: Option<Instant>) {
    let Some(deadline) = deadline else {
        return std::future::pending().await;
    };
    match timer {
        Some(t) => t.sleep_until(deadline).await,
        None => tokio::time::sleep_until(deadline.into()).await,
    }
}

/// Hand over what the engine wants sent; while a peer's backlog is past its bound, wait
/// for it before the next step.
async fn flush<O: Outlet>(out: &mut Outbox, outputs: &mut O) -> bool {
    for item in out.items.drain(..) {
        if !outputs.deliver(item) {
            return false;
        }
    }
    while outputs.over_bound() {
        outputs.drain().await;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use sim_protocol::{EngineCoreOutput, EngineCoreRequest, FinishReason};

    /// Emits `n` tokens per request, one every `gap`, each token id = its position.
    struct ConstantEngine {
        n: u32,
        gap: Duration,
        live: Vec<(String, u32, u32, Instant)>,
        draining: bool,
    }

    impl EngineCore for ConstantEngine {
        fn on_input(&mut self, input: EngineInput, now: Instant, out: &mut Outbox) {
            if let EngineInput::Message {
                client,
                msg: InputMessage::Add(req),
            } = input
            {
                if self.draining {
                    out.send(
                        client,
                        EngineCoreOutputs {
                            outputs: vec![EngineCoreOutput {
                                request_id: req.request_id.as_str().into(),
                                finish_reason: Some(FinishReason::Abort),
                                ..Default::default()
                            }],
                            ..Default::default()
                        },
                    );
                    return;
                }
                self.live
                    .push((req.request_id.clone(), client, 0, now + self.gap));
            }
        }
        fn on_deadline(&mut self, now: Instant, out: &mut Outbox) {
            let gap = self.gap;
            let n = self.n;
            for (id, client, emitted, due) in &mut self.live {
                if *due <= now {
                    *emitted += 1;
                    *due += gap;
                    out.send(
                        *client,
                        EngineCoreOutputs {
                            outputs: vec![EngineCoreOutput {
                                request_id: id.as_str().into(),
                                new_token_ids: vec![*emitted].into(),
                                finish_reason: (*emitted == n).then_some(FinishReason::Length),
                                ..Default::default()
                            }],
                            ..Default::default()
                        },
                    );
                }
            }
            self.live.retain(|r| r.2 < n);
        }
        fn next_deadline(&self) -> Option<Instant> {
            self.live.iter().map(|r| r.3).min()
        }
        fn begin_shutdown(&mut self, _: Instant, _: &mut Outbox) {
            self.draining = true;
        }
        fn abort_all(&mut self, _: Instant, out: &mut Outbox) {
            for (id, client, _, _) in self.live.drain(..) {
                out.send(
                    client,
                    EngineCoreOutputs {
                        outputs: vec![EngineCoreOutput {
                            request_id: id.into(),
                            finish_reason: Some(FinishReason::Abort),
                            ..Default::default()
                        }],
                        ..Default::default()
                    },
                );
            }
        }
        fn is_idle(&self) -> bool {
            self.live.is_empty()
        }
    }

    fn add(id: &str) -> EngineInput {
        EngineInput::Message {
            client: 0,
            msg: InputMessage::Add(Box::new(EngineCoreRequest {
                request_id: id.into(),
                ..Default::default()
            })),
        }
    }

    fn tokens(o: &Outbound) -> (String, Vec<u32>, Option<FinishReason>) {
        match o {
            Outbound::Outputs { outputs, .. } => {
                let x = &outputs.outputs[0];
                (
                    x.request_id.to_string(),
                    x.new_token_ids.to_vec(),
                    x.finish_reason,
                )
            }
            Outbound::Dead => panic!("dead"),
            Outbound::Pull(p) => panic!("unexpected pull {p:?}"),
            Outbound::Compile(c) => panic!("unexpected compile {c:?}"),
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn paces_tokens_and_drains_on_shutdown() {
        let (in_tx, mut in_rx) = mpsc::unbounded_channel();
        let (mut out_tx, mut out_rx) = mpsc::unbounded_channel();
        let (sd_tx, sd_rx) = watch::channel(false);
        let mut engine = ConstantEngine {
            n: 3,
            gap: Duration::from_millis(5),
            live: vec![],
            draining: false,
        };
        in_tx.send(add("a")).unwrap();
        let start = Instant::now();
        let task = tokio::spawn(async move {
            run_loop(
                &mut engine,
                &mut in_rx,
                &mut out_tx,
                LoopControl {
                    shutdown: sd_rx,
                    side: None,
                    shutdown_timeout: Duration::from_secs(5),
                },
            )
            .await
        });
        let mut got = vec![];
        for _ in 0..3 {
            got.push(tokens(&out_rx.recv().await.unwrap()));
        }
        assert!(start.elapsed() >= Duration::from_millis(15));
        assert_eq!(got[2], ("a".into(), vec![3], Some(FinishReason::Length)));
        sd_tx.send(true).unwrap();
        assert_eq!(task.await.unwrap(), LoopExit::Drained);
        drop(in_tx);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn drain_timeout_aborts_the_rest() {
        let (in_tx, mut in_rx) = mpsc::unbounded_channel();
        let (mut out_tx, mut out_rx) = mpsc::unbounded_channel();
        let (sd_tx, sd_rx) = watch::channel(false);
        let mut engine = ConstantEngine {
            n: 1000,
            gap: Duration::from_millis(50),
            live: vec![],
            draining: false,
        };
        in_tx.send(add("slow")).unwrap();
        let task = tokio::spawn(async move {
            run_loop(
                &mut engine,
                &mut in_rx,
                &mut out_tx,
                LoopControl {
                    shutdown: sd_rx,
                    side: None,
                    shutdown_timeout: Duration::from_millis(20),
                },
            )
            .await
        });
        tokio::time::sleep(Duration::from_millis(5)).await;
        sd_tx.send(true).unwrap();
        assert_eq!(task.await.unwrap(), LoopExit::DrainTimedOut);
        let last = tokens(&out_rx.recv().await.unwrap());
        assert_eq!(last, ("slow".into(), vec![], Some(FinishReason::Abort)));
        drop(in_tx);
    }

    /// A request read after the shutdown was signalled is refused, even when both were
    /// pending when the loop woke (its select takes inputs first).
    #[tokio::test(flavor = "current_thread")]
    async fn a_request_after_the_signal_is_refused_though_both_were_pending() {
        let (in_tx, mut in_rx) = mpsc::unbounded_channel();
        let (mut out_tx, mut out_rx) = mpsc::unbounded_channel();
        let (sd_tx, sd_rx) = watch::channel(false);
        let mut engine = ConstantEngine {
            n: 3,
            gap: Duration::from_millis(5),
            live: vec![],
            draining: false,
        };
        let task = tokio::spawn(async move {
            run_loop(
                &mut engine,
                &mut in_rx,
                &mut out_tx,
                LoopControl {
                    shutdown: sd_rx,
                    side: None,
                    shutdown_timeout: Duration::from_secs(5),
                },
            )
            .await
        });
        // the loop waits on both; then the signal, then the request, before it wakes
        tokio::task::yield_now().await;
        sd_tx.send(true).unwrap();
        in_tx.send(add("late")).unwrap();
        assert_eq!(task.await.unwrap(), LoopExit::Drained);
        let got = tokens(&out_rx.recv().await.unwrap());
        assert_eq!(got, ("late".into(), vec![], Some(FinishReason::Abort)));
        drop(in_tx);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn closed_inputs_end_the_loop() {
        let (in_tx, mut in_rx) = mpsc::unbounded_channel::<EngineInput>();
        let (mut out_tx, _out_rx) = mpsc::unbounded_channel();
        let (_sd_tx, sd_rx) = watch::channel(false);
        let mut engine = ConstantEngine {
            n: 1,
            gap: Duration::ZERO,
            live: vec![],
            draining: false,
        };
        drop(in_tx);
        let exit = run_loop(
            &mut engine,
            &mut in_rx,
            &mut out_tx,
            LoopControl {
                shutdown: sd_rx,
                side: None,
                shutdown_timeout: Duration::ZERO,
            },
        )
        .await;
        assert_eq!(exit, LoopExit::InputsClosed);
    }

    /// What the loop asks of its outlet, in order: `o` an output, `h` hold, `s` send now.
    #[derive(Default)]
    struct Recorder(String);

    impl Outlet for Recorder {
        fn deliver(&mut self, _: Outbound) -> bool {
            self.0.push('o');
            true
        }
        fn hold(&mut self, on: bool) {
            self.0.push(if on { 'h' } else { 's' });
        }
    }

    async fn record(gap: Duration) -> String {
        let (_in_tx, mut in_rx) = mpsc::unbounded_channel();
        let (_sd_tx, sd_rx) = watch::channel(true);
        let mut engine = ConstantEngine {
            n: 4,
            gap,
            live: vec![("a".into(), 0, 0, Instant::now())],
            draining: false,
        };
        let mut rec = Recorder::default();
        let ctl = LoopControl {
            shutdown: sd_rx,
            side: None,
            shutdown_timeout: Duration::from_secs(5),
        };
        let exit = run_loop(&mut engine, &mut in_rx, &mut rec, ctl).await;
        assert_eq!(exit, LoopExit::Drained);
        rec.0
    }

    /// Steps that are due back to back hold their outputs for one write, released once
    /// the loop is about to wait; a paced step's output is released at once.
    #[tokio::test(flavor = "current_thread")]
    async fn back_to_back_steps_are_held_and_paced_ones_sent_at_once() {
        let burst = record(Duration::ZERO).await;
        let outputs: String = burst.chars().filter(|c| *c == 'o').collect();
        assert_eq!(outputs, "oooo", "{burst}");
        let first_send = burst.find('s').expect("released at the end");
        assert!(
            burst[..first_send].matches('o').count() == 4,
            "every output of the burst held until it ends: {burst}"
        );
        // the next step 100 ms away: the output leaves before the loop waits for it
        let paced = record(Duration::from_millis(100)).await;
        assert!(paced.starts_with("os"), "{paced}");
        assert!(paced.ends_with('s'), "{paced}");
    }
}
