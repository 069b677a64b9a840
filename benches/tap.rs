//! Tap overhead (`cargo bench --bench tap`): what `vllm-vcr record` adds between a frontend
//! and an engine, measured against a direct connection in the same run. A report, not a
//! timed test.
//!
//! A Rust frontend (`FrontendListener`) and a hand-driven engine (`connect_to_frontend`)
//! exchange real protocol messages, first directly, then through the tap (the `record`
//! code, in this process on its own thread and current-thread runtime, as the binary runs
//! it, writing a gzip trace):
//!
//! 1. Latency: the frontend sends an ADD; the engine answers at once with a one-token output
//!    that finishes the request. Round trip p50/p90/p99 direct vs tapped; the difference is
//!    the latency the tap adds (two extra hops, one each way).
//! 2. Throughput: the engine sends output messages back to back (64 requests x 1 token per
//!    message, as a busy engine step does) and the frontend counts what arrives: messages/s
//!    and tokens/s, direct vs tapped, while the tap's observer decodes every message and
//!    follows every request.
//!
//! Direct and tapped pairs alternate `BENCH_ROUNDS` times (default 7; the first of each
//! round alternates too) and the summary gives medians over the rounds: on a shared
//! machine single runs swing by 2x. Beside wall-clock figures it reports the CPU time the
//! tap's relay thread spent per million relayed output messages (from the thread's
//! `schedstat`), which does not depend on how busy the machine is, the observer
//! thread's CPU time over the same window, and the cores the whole process kept busy in
//! the throughput part (its CPU time over wall time): a direct run already near the host's
//! core count leaves a tap no CPU of its own, so every µs it spends per message is taken
//! from the tapped rate.
//!
//! `BENCH_QUICK=1` shrinks the runs; `BENCH_ONLY=tapped` runs only tapped pairs (for
//! profilers); `BENCH_IPC=1` gives the frontend `ipc://` data sockets, as a Python frontend
//! binds them for an engine on its own host (the handshake stays on TCP);
//! `BENCH_ENGINE_IPC=1` runs the tap with `--engine-ipc-dir` (Unix-domain sockets towards
//! the engine, whatever the frontend's are).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use sim_protocol::encode::{encode_input, encode_outputs};
use sim_protocol::transport::{
    ConnectOptions, EngineSockets, FrontendListener, connect_to_frontend,
};
use sim_protocol::{
    EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason, InputMessage,
    ReadyResponse, SamplingParams, VllmLine,
};
use tokio::sync::watch;
use zeromq::{SocketRecv, SocketSend, ZmqMessage};

#[path = "common/cpu.rs"]
mod cpu;

const LINE: VllmLine = VllmLine::new(0, 33);

fn quick() -> bool {
    std::env::var_os("BENCH_QUICK").is_some()
}

fn add(id: &str) -> Vec<Bytes> {
    let req = EngineCoreRequest {
        request_id: id.into(),
        prompt_token_ids: Some((0..128).collect()),
        sampling_params: Some(SamplingParams {
            max_tokens: Some(1),
            ..Default::default()
        }),
        arrival_time: 1.0,
        ..Default::default()
    };
    encode_input(LINE, &InputMessage::Add(Box::new(req)))
}

fn outputs(ids: &[String], finish: bool, ts: f64) -> Vec<Bytes> {
    let env = EngineCoreOutputs {
        timestamp: ts,
        outputs: ids
            .iter()
            .map(|id| EngineCoreOutput {
                request_id: id.into(),
                new_token_ids: vec![42].into(),
                finish_reason: finish.then_some(FinishReason::Length),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    encode_outputs(LINE, &env).expect("encodes")
}

/// A frontend and an engine joined either directly or through a tap.
struct Pair {
    fl: FrontendListener,
    identity: Bytes,
    engine: EngineSockets,
    tap: Option<(watch::Sender<bool>, std::thread::JoinHandle<()>)>,
    /// The tap's relay thread (its Linux thread id), when tapped.
    relay_tid: Option<i64>,
    /// The directory of the frontend's `ipc://` data sockets (`BENCH_IPC`).
    ipc_dir: Option<PathBuf>,
}

/// Nanoseconds a thread of this process has run on a CPU (`/proc/self/task/TID/schedstat`).
fn thread_cpu_ns(tid: i64) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok()?;
    s.split_whitespace().next()?.parse().ok()
}

/// CPU time (user + system) of this whole process so far, in seconds.
fn process_cpu_secs() -> f64 {
    cpu::rusage_seconds(libc::RUSAGE_SELF)
}

/// Minor page faults a thread of this process has taken (`/proc/self/task/TID/stat`).
fn thread_faults(tid: i64) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
    // after the parenthesised name: state, ppid, pgrp, session, tty, tpgid, flags, minflt
    s.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(7)?
        .parse()
        .ok()
}

/// The thread of this process called `name`, if there is one.
fn thread_named(name: &str) -> Option<i64> {
    std::fs::read_dir("/proc/self/task").ok()?.find_map(|e| {
        let e = e.ok()?;
        let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
        (comm.trim() == name).then(|| e.file_name().to_str()?.parse().ok())?
    })
}

fn free_port() -> u16 {
    vllm_vcr::child::free_ports(1).expect("a free port")[0]
}

async fn pair(tapped: bool, trace: &PathBuf) -> Pair {
    static PAIRS: AtomicI64 = AtomicI64::new(0);
    let ipc_dir = std::env::var_os("BENCH_IPC").map(|_| {
        let n = PAIRS.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("vcr-tap-bench-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("ipc dir");
        dir
    });
    let mut fl = match &ipc_dir {
        Some(dir) => FrontendListener::bind_ipc_data("tcp://127.0.0.1:0", dir, 1).await,
        None => FrontendListener::bind("127.0.0.1", 1).await,
    }
    .expect("bind");
    let tid = Arc::new(AtomicI64::new(0));
    let (engine_hs, tap) = if tapped {
        let hs = format!("tcp://127.0.0.1:{}", free_port());
        let _ = std::fs::remove_file(trace);
        let args = vllm_vcr::record::RecordArgs {
            max_frame_size: 64,
            max_observer_backlog: 256,
            frontend_handshake: fl.handshake_address().to_string(),
            engine_handshake: hs.clone(),
            trace_out: trace.clone(),
            record_tokens: false,
            reasoning_format: None,
            tokenizer: None,
            step_stats_out: None,
            force: true,
            model: None,
            gpu: None,
            host_cpu: "auto".into(),
            note: Vec::new(),
            tp: None,
            block_size: None,
            max_num_seqs: None,
            vllm_version: None,
            engine_config: None,
            config_hash: None,
            advertise_host: None,
            engine_ipc_dir: std::env::var_os("BENCH_ENGINE_IPC").map(|_| {
                let dir = std::env::temp_dir()
                    .join(format!("vcr-tap-bench-{}-engine", std::process::id()));
                std::fs::create_dir_all(&dir).expect("engine ipc dir");
                dir
            }),
            connect_timeout: 30.0,
        };
        let (tx, rx) = watch::channel(false);
        let tid2 = tid.clone();
        let spawned = std::thread::Builder::new()
            .name("tap-relay".into())
            .spawn(move || {
                // SAFETY: gettid has no preconditions.
                tid2.store(unsafe { libc::syscall(libc::SYS_gettid) }, Ordering::SeqCst);
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                if let Err(e) = rt.block_on(vllm_vcr::record::run(args, rx)) {
                    eprintln!("tap: {e:#}");
                }
            });
        let handle = spawned.expect("the relay thread");
        (hs, Some((tx, handle)))
    } else {
        (fl.handshake_address().to_string(), None)
    };
    let ready = ReadyResponse {
        vllm_version: "0.33.0".into(),
        ..Default::default()
    };
    let connect = tokio::spawn(async move {
        connect_to_frontend(&engine_hs, 0, &ready, &ConnectOptions::default())
            .await
            .expect("engine handshake")
    });
    let accepted = fl
        .accept_engines(1, Duration::from_secs(30))
        .await
        .expect("accept");
    let engine = connect.await.expect("join");
    let relay_tid = tap.as_ref().map(|_| tid.load(Ordering::SeqCst));
    Pair {
        fl,
        identity: accepted[0].identity.clone(),
        engine,
        tap,
        relay_tid,
        ipc_dir,
    }
}

impl Pair {
    fn stop(self) {
        drop(self.engine);
        if let Some((tx, h)) = self.tap {
            let _ = tx.send(true);
            let _ = h.join();
        }
        if let Some(dir) = self.ipc_dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Round trips: ADD → one finishing output. Returns sorted microseconds.
async fn round_trips(p: &mut Pair, n: usize) -> Vec<f64> {
    let mut rtts = Vec::with_capacity(n);
    for i in 0..n + n / 10 {
        let id = format!("rt-{i}");
        let t = Instant::now();
        p.fl.send(0, &p.identity, add(&id)).await.expect("send");
        let _ = p.engine.inputs[0].recv().await.expect("engine recv");
        let out = outputs(std::slice::from_ref(&id), true, 0.0);
        p.engine.outputs[0]
            .send(ZmqMessage::try_from(out).expect("frames"))
            .await
            .expect("engine send");
        let _ = p.fl.recv_output(0).await.expect("frontend recv");
        if i >= n / 10 {
            rtts.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    rtts.sort_by(f64::total_cmp);
    rtts
}

/// Output messages of 64 one-token outputs, as fast as the engine can send them: messages/s
/// and the CPU cores the whole process kept busy meanwhile (its CPU time over wall time).
async fn throughput(p: &mut Pair, messages: usize) -> (f64, f64) {
    let ids: Vec<String> = (0..64).map(|i| format!("tp-{i}")).collect();
    for id in &ids {
        p.fl.send(0, &p.identity, add(id)).await.expect("send");
        let _ = p.engine.inputs[0].recv().await.expect("engine recv");
    }
    let frames = outputs(&ids, false, 0.0);
    let mut push = std::mem::take(&mut p.engine.outputs);
    let sender = tokio::spawn(async move {
        for _ in 0..messages {
            push[0]
                .send(ZmqMessage::try_from(frames.clone()).expect("frames"))
                .await
                .expect("engine send");
        }
        push
    });
    let t = Instant::now();
    let cpu = process_cpu_secs();
    for _ in 0..messages {
        let _ = p.fl.recv_output(0).await.expect("frontend recv");
    }
    let secs = t.elapsed().as_secs_f64();
    let cores = (process_cpu_secs() - cpu) / secs;
    p.engine.outputs = sender.await.expect("sender");
    (messages as f64 / secs, cores)
}

/// The observer alone: how many output messages per second it decodes and follows.
fn observer_capacity(messages: usize, trace: &PathBuf) -> f64 {
    use vllm_vcr::record::handoff::Seen;
    use vllm_vcr::record::observe::{Observer, ObserverConfig};
    let _ = std::fs::remove_file(trace);
    let obs = Observer::create(ObserverConfig {
        max_frame_bytes: usize::MAX,
        trace_out: trace.clone(),
        step_stats_out: None,
        record_tokens: false,
        thinking: None,
        meta: Default::default(),
    })
    .expect("observer");
    let (tx, rx) = vllm_vcr::record::handoff::channel(usize::MAX);
    let ids: Vec<String> = (0..64).map(|i| format!("obs-{i}")).collect();
    for id in &ids {
        tx.send(Seen::Input {
            t: 1.0,
            client: 0,
            engine: Bytes::from_static(&[0, 0]),
            frames: add(id),
        });
    }
    let frames = outputs(&ids, false, 0.0);
    for i in 0..messages {
        tx.send(Seen::Output {
            t: 1.0 + i as f64 * 1e-3,
            client: 0,
            frames: frames.clone(),
        });
    }
    tx.send(Seen::Stop {
        reason: "bench".into(),
    });
    let t = Instant::now();
    obs.run(rx).expect("observer run");
    messages as f64 / t.elapsed().as_secs_f64()
}

/// One pair's figures.
#[derive(Clone, Copy, Default)]
struct Row {
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
    rate: f64,
    /// Relay thread CPU seconds per million output messages (tapped only).
    relay_cpu: f64,
    /// Observer thread CPU seconds per million output messages over the throughput window.
    observer_cpu: f64,
    /// Relay thread CPU µs per round trip.
    relay_rtt_cpu: f64,
    /// Relay thread page faults per thousand output messages.
    relay_faults: f64,
    /// CPU cores the bench process kept busy during the throughput part (all its threads).
    cores: f64,
}

async fn run_pair(tapped: bool, trace: &PathBuf, n_rtt: usize, n_msgs: usize) -> Row {
    let mut p = pair(tapped, trace).await;
    let cpu = |p: &Pair| p.relay_tid.and_then(thread_cpu_ns).unwrap_or(0);
    let c0 = cpu(&p);
    let rtts = round_trips(&mut p, n_rtt).await;
    let c1 = cpu(&p);
    let faults = |p: &Pair| p.relay_tid.and_then(thread_faults).unwrap_or(0);
    let f1 = faults(&p);
    let observer = if tapped {
        thread_named("record-observer")
    } else {
        None
    };
    let o0 = observer.and_then(thread_cpu_ns).unwrap_or(0);
    let (rate, cores) = throughput(&mut p, n_msgs).await;
    let c2 = cpu(&p);
    let f2 = faults(&p);
    let o1 = observer.and_then(thread_cpu_ns).unwrap_or(0);
    let row = Row {
        p50: quantile(&rtts, 0.5),
        p90: quantile(&rtts, 0.9),
        p99: quantile(&rtts, 0.99),
        max: rtts[rtts.len() - 1],
        rate,
        relay_cpu: (c2 - c1) as f64 / 1e9 / (n_msgs as f64 / 1e6),
        observer_cpu: (o1 - o0) as f64 / 1e9 / (n_msgs as f64 / 1e6),
        relay_rtt_cpu: (c1 - c0) as f64 / 1e3 / (n_rtt + n_rtt / 10) as f64,
        relay_faults: (f2 - f1) as f64 / (n_msgs as f64 / 1e3),
        cores,
    };
    let t = Instant::now();
    p.stop();
    let stop_ms = t.elapsed().as_secs_f64() * 1e3;
    print!(
        "{:<8} {:>7.1}µs {:>7.1}µs {:>7.1}µs {:>8.1}µs {:>10.0} {:>11.0} {:>5.2}",
        if tapped { "tapped" } else { "direct" },
        row.p50,
        row.p90,
        row.p99,
        row.max,
        row.rate,
        row.rate * 64.0,
        row.cores
    );
    if tapped {
        println!(
            " {:>8.2} {:>8.1} {:>8.1} {:>8.2} {:>7.0}",
            row.relay_cpu, row.relay_rtt_cpu, row.relay_faults, row.observer_cpu, stop_ms
        );
    } else {
        println!();
    }
    row
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (n_rtt, n_msgs) = if quick() {
        (300, 2_000)
    } else {
        (5_000, 40_000)
    };
    let rounds: usize = std::env::var("BENCH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(if quick() { 2 } else { 7 })
        .max(1);
    let only_tapped = std::env::var("BENCH_ONLY").is_ok_and(|o| o == "tapped");
    let trace = std::env::temp_dir().join(format!(
        "vllm-vcr-tap-bench-{}.jsonl.gz",
        std::process::id()
    ));
    rt.block_on(async {
        println!(
            "tap overhead: {rounds} rounds of direct and tapped, alternating; {n_rtt} round trips, {n_msgs} output messages x 64 outputs; frontend data sockets on {}",
            if std::env::var_os("BENCH_IPC").is_some() { "ipc" } else { "tcp" }
        );
        println!(
            "{:<8} {:>9} {:>9} {:>9} {:>10} {:>10} {:>11} {:>5} {:>8} {:>8} {:>8} {:>8} {:>7}",
            "path",
            "rtt p50",
            "rtt p90",
            "rtt p99",
            "rtt max",
            "msgs/s",
            "tokens/s",
            "cores",
            "relay s/M",
            "relay µs/rt",
            "faults/k",
            "obs s/M",
            "stop ms"
        );
        let mut direct = Vec::new();
        let mut tapped = Vec::new();
        for round in 0..rounds {
            let order = if only_tapped {
                vec![true]
            } else if round % 2 == 0 {
                vec![false, true]
            } else {
                vec![true, false]
            };
            for t in order {
                let row = run_pair(t, &trace, n_rtt, n_msgs).await;
                if t {
                    tapped.push(row);
                } else {
                    direct.push(row);
                }
            }
        }
        let med = |rows: &[Row], f: fn(&Row) -> f64| median(rows.iter().map(f).collect());
        println!(
            "median of {} tapped runs: p50 {:.1} µs, p99 {:.1} µs, {:.0} msgs/s, {:.2} cores busy; relay thread {:.2} CPU-s per 1M output messages ({:.2} µs each), {:.1} µs per round trip, {:.1} page faults per 1,000 output messages; observer {:.2} CPU-s per 1M in the throughput window",
            tapped.len(),
            med(&tapped, |r| r.p50),
            med(&tapped, |r| r.p99),
            med(&tapped, |r| r.rate),
            med(&tapped, |r| r.cores),
            med(&tapped, |r| r.relay_cpu),
            med(&tapped, |r| r.relay_cpu),
            med(&tapped, |r| r.relay_rtt_cpu),
            med(&tapped, |r| r.relay_faults),
            med(&tapped, |r| r.observer_cpu),
        );
        if !direct.is_empty() {
            println!(
                "median of {} direct runs: p50 {:.1} µs, p99 {:.1} µs, {:.0} msgs/s, {:.2} cores busy ({:.2} CPU-µs per message)",
                direct.len(),
                med(&direct, |r| r.p50),
                med(&direct, |r| r.p99),
                med(&direct, |r| r.rate),
                med(&direct, |r| r.cores),
                med(&direct, |r| 1e6 * r.cores / r.rate),
            );
            // each round's tapped run against its own direct run
            let pairs: Vec<(Row, Row)> = direct.iter().copied().zip(tapped.iter().copied()).collect();
            println!(
                "added by the tap (median over rounds of tapped - direct): p50 {:+.1} µs, p99 {:+.1} µs; throughput {:.0}% of direct (median of per-round ratios; range {:.0}-{:.0}%)",
                median(pairs.iter().map(|(d, t)| t.p50 - d.p50).collect()),
                median(pairs.iter().map(|(d, t)| t.p99 - d.p99).collect()),
                median(pairs.iter().map(|(d, t)| 100.0 * t.rate / d.rate).collect()),
                pairs.iter().map(|(d, t)| 100.0 * t.rate / d.rate).fold(f64::INFINITY, f64::min),
                pairs.iter().map(|(d, t)| 100.0 * t.rate / d.rate).fold(0.0, f64::max),
            );
        }
    });
    let rate = observer_capacity(n_msgs, &trace);
    println!(
        "observer alone: {rate:.0} output messages/s of 64 outputs ({:.1} M outputs/s)",
        rate * 64.0 / 1e6
    );
    let _ = std::fs::remove_file(&trace);
    let _ = std::fs::remove_dir_all(
        std::env::temp_dir().join(format!("vcr-tap-bench-{}-engine", std::process::id())),
    );
}
