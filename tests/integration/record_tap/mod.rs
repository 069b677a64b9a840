//! `vllm-vcr record` on real sockets: a Rust stand-in frontend (`FrontendListener`), the
//! tap binary, and an engine (`play`, or a hand-driven engine for exact bytes).
//!
//! What a user of the tap relies on: every frame crosses unchanged (INIT's data addresses
//! excepted), the trace's records match what the frontend saw, and the trace is valid and
//! complete however the capture ends (SIGTERM, engine killed, ENGINE_CORE_DEAD, frontend
//! gone), gzip or plain.
//!
//! The relay is checked in [`relay`], the endings in [`endings`], hostile peers in
//! [`hostile`], an engine faster than the observer in [`backlog`]; the tap process,
//! reading traces and a hand-driven engine are here.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::support::{Collected, Disturbance, TestDir, TestProcess, add, vcr, vcr_command};
use bytes::Bytes;
use sim_protocol::decode::{DecodedOutputs, decode_input, decode_outputs_for};
use sim_protocol::encode::{encode_input, encode_outputs};
use sim_protocol::transport::{
    ConnectOptions, EngineSockets, FrontendListener, connect_to_frontend,
};
use sim_protocol::{
    ENGINE_CORE_DEAD, EngineCoreEvent, EngineCoreOutput, EngineCoreOutputs, EventType,
    FinishReason, InputMessage, ReadyResponse, VllmLine,
};
use sim_trace::trace::{TraceMeta, TraceRecord};
use tokio::sync::watch;
use vllm_vcr::child::free_ports;

mod backlog;
mod endings;
mod hostile;
mod relay;

const LINE: VllmLine = VllmLine::new(0, 33);

const WAIT: Duration = Duration::from_secs(20);

/// A `vllm-vcr record` child between a frontend and an engine: its stderr is its log;
/// killed when the test ends.
struct Tap {
    process: TestProcess,
    engine_handshake: String,
    trace: PathBuf,
}

impl Tap {
    fn start(frontend_handshake: &str, trace: &Path, extra: &[&str]) -> Tap {
        let port = free_ports(1).unwrap()[0];
        let engine_handshake = format!("tcp://127.0.0.1:{port}");
        let mut cmd = vcr_command();
        cmd.env("NO_COLOR", "1")
            .args(["record", "--frontend-handshake", frontend_handshake])
            .args(["--engine-handshake", &engine_handshake])
            .arg("--trace-out")
            .arg(trace)
            .args(extra)
            .stdout(Stdio::null());
        Tap {
            process: TestProcess::start("record-tap", cmd).with_grace(Duration::ZERO),
            engine_handshake,
            trace: trace.to_path_buf(),
        }
    }

    fn signal(&self, sig: i32) {
        self.process.signal(sig);
    }

    fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        match self.process.wait_exit(within) {
            Some(s) => s,
            None => panic!(
                "the tap did not exit within {within:?}; log:\n{}",
                self.log_text()
            ),
        }
    }

    fn log_text(&self) -> String {
        self.process.stderr()
    }
}

/// The whole trace: meta and records; fails the test on any error (truncation included).
fn tap_trace(path: &Path) -> (TraceMeta, Vec<TraceRecord>) {
    let (meta, records) = crate::support::read_trace(path);
    (meta.expect("a meta line"), records)
}

fn record<'a>(records: &'a [TraceRecord], id: &str) -> &'a TraceRecord {
    records
        .iter()
        .find(|r| r.request_id.as_deref() == Some(id))
        .unwrap_or_else(|| panic!("no record for {id}: {records:?}"))
}

fn play_args(handshake: &str) -> vllm_vcr::play::PlayArgs {
    let mut a = vllm_vcr::play::PlayArgs::defaults();
    a.handshake_address = handshake.to_string();
    a
}

/// `play`, in this process, joined through the tap: the frontend has accepted it.
struct PlayBehindTap {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
    /// The engine's identity on the frontend's sockets.
    identity: Bytes,
}

impl PlayBehindTap {
    async fn join(fl: &mut FrontendListener, tap: &Tap) -> PlayBehindTap {
        Self::join_with(fl, play_args(&tap.engine_handshake)).await
    }

    /// [`PlayBehindTap::join`] with these flags (their handshake the tap's).
    async fn join_with(fl: &mut FrontendListener, args: vllm_vcr::play::PlayArgs) -> PlayBehindTap {
        let (stop, rx) = watch::channel(false);
        let task = tokio::spawn(vllm_vcr::play::run(args, rx));
        let accepted = fl.accept_engines(1, WAIT).await.unwrap();
        PlayBehindTap {
            stop,
            task,
            identity: accepted[0].identity.clone(),
        }
    }

    /// Send the request `id` (prompt `[1, 2]`, `max_tokens` 4) from client 0.
    async fn send(&self, fl: &mut FrontendListener, id: &str) {
        fl.send(0, &self.identity, encode_input(LINE, &add(id, &[1, 2], 4)))
            .await
            .unwrap();
    }

    async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = tokio::time::timeout(WAIT, self.task).await;
    }
}

/// `vllm-vcr play` as a child process joined through the tap (silent; the test kills it).
fn play_child_behind(tap: &Tap) -> std::process::Child {
    vcr_command()
        .args(["play", "--handshake-address", &tap.engine_handshake])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Collect outputs on client 0 until every id finished.
async fn collect(fl: &mut FrontendListener, ids: &[&str]) -> Collected {
    let mut c = Collected::default();
    let deadline = Instant::now() + WAIT;
    while ids.iter().any(|id| !c.finished.contains_key(*id)) {
        assert!(Instant::now() < deadline, "not finished: {:?}", c.finished);
        let frames = tokio::time::timeout(WAIT, fl.recv_output(0))
            .await
            .expect("no output in time")
            .unwrap();
        match decode_outputs_for(LINE, &frames).unwrap() {
            DecodedOutputs::Outputs(o) => c.absorb(o),
            DecodedOutputs::Dead => panic!("ENGINE_CORE_DEAD"),
        }
    }
    c
}

/// An engine driven by hand (its sockets in the test's hands) joined through the tap at
/// `engine_handshake`: the frontend's view of it, and its sockets.
async fn hand_driven_engine(
    fl: &mut FrontendListener,
    engine_handshake: &str,
) -> (Vec<sim_protocol::transport::AcceptedEngine>, EngineSockets) {
    let hs = engine_handshake.to_string();
    let engine = tokio::spawn(async move {
        connect_to_frontend(
            &hs,
            0,
            &ReadyResponse::default(),
            &ConnectOptions::default(),
        )
        .await
        .unwrap()
    });
    let accepted = fl.accept_engines(1, WAIT).await.unwrap();
    (accepted, engine.await.unwrap())
}
