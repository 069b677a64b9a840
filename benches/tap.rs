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
//! `BENCH_QUICK=1` shrinks the runs.

use std::path::PathBuf;
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
}

fn free_port() -> u16 {
    vllm_vcr::child::free_ports(1).expect("a free port")[0]
}

async fn pair(tapped: bool, trace: &PathBuf) -> Pair {
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.expect("bind");
    let (engine_hs, tap) = if tapped {
        let hs = format!("tcp://127.0.0.1:{}", free_port());
        let _ = std::fs::remove_file(trace);
        let args = vllm_vcr::record::RecordArgs {
            max_frame_size: 64,
            frontend_handshake: fl.handshake_address().to_string(),
            engine_handshake: hs.clone(),
            trace_out: trace.clone(),
            record_tokens: false,
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
            connect_timeout: 30.0,
        };
        let (tx, rx) = watch::channel(false);
        let handle = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            if let Err(e) = rt.block_on(vllm_vcr::record::run(args, rx)) {
                eprintln!("tap: {e:#}");
            }
        });
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
    Pair {
        fl,
        identity: accepted[0].identity.clone(),
        engine,
        tap,
    }
}

impl Pair {
    fn stop(self) {
        drop(self.engine);
        if let Some((tx, h)) = self.tap {
            let _ = tx.send(true);
            let _ = h.join();
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

/// Output messages of 64 one-token outputs, as fast as the engine can send them.
async fn throughput(p: &mut Pair, messages: usize) -> f64 {
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
    for _ in 0..messages {
        let _ = p.fl.recv_output(0).await.expect("frontend recv");
    }
    let secs = t.elapsed().as_secs_f64();
    p.engine.outputs = sender.await.expect("sender");
    messages as f64 / secs
}

/// The observer alone: how many output messages per second it decodes and follows.
fn observer_capacity(messages: usize, trace: &PathBuf) -> f64 {
    use vllm_vcr::record::observe::{Observer, ObserverConfig};
    use vllm_vcr::record::relay::Seen;
    let _ = std::fs::remove_file(trace);
    let obs = Observer::create(ObserverConfig {
        max_frame_bytes: usize::MAX,
        trace_out: trace.clone(),
        step_stats_out: None,
        record_tokens: false,
        meta: Default::default(),
    })
    .expect("observer");
    let (tx, rx) = std::sync::mpsc::channel();
    let ids: Vec<String> = (0..64).map(|i| format!("obs-{i}")).collect();
    for id in &ids {
        tx.send(Seen::Input {
            t: 1.0,
            client: 0,
            engine: Bytes::from_static(&[0, 0]),
            frames: add(id),
        })
        .expect("send");
    }
    let frames = outputs(&ids, false, 0.0);
    for i in 0..messages {
        tx.send(Seen::Output {
            t: 1.0 + i as f64 * 1e-3,
            client: 0,
            frames: frames.clone(),
        })
        .expect("send");
    }
    tx.send(Seen::Stop {
        reason: "bench".into(),
    })
    .expect("send");
    let t = Instant::now();
    obs.run(rx).expect("observer run");
    messages as f64 / t.elapsed().as_secs_f64()
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
    let trace = std::env::temp_dir().join(format!(
        "vllm-vcr-tap-bench-{}.jsonl.gz",
        std::process::id()
    ));
    rt.block_on(async {
        println!("tap overhead: {n_rtt} round trips, {n_msgs} output messages x 64 outputs");
        println!(
            "{:<8} {:>9} {:>9} {:>9} {:>10} {:>12} {:>13}",
            "path", "rtt p50", "rtt p90", "rtt p99", "rtt max", "msgs/s", "tokens/s"
        );
        let mut rows = Vec::new();
        for tapped in [false, true] {
            let mut p = pair(tapped, &trace).await;
            let rtts = round_trips(&mut p, n_rtt).await;
            let rate = throughput(&mut p, n_msgs).await;
            let row = (
                quantile(&rtts, 0.5),
                quantile(&rtts, 0.9),
                quantile(&rtts, 0.99),
                rtts[rtts.len() - 1],
                rate,
            );
            println!(
                "{:<8} {:>7.1}µs {:>7.1}µs {:>7.1}µs {:>8.1}µs {:>12.0} {:>13.0}",
                if tapped { "tapped" } else { "direct" },
                row.0,
                row.1,
                row.2,
                row.3,
                row.4,
                row.4 * 64.0
            );
            rows.push(row);
            let t = Instant::now();
            p.stop();
            if tapped {
                println!(
                    "tap stop (observer drains its backlog, closes the gzip trace): {:.0} ms",
                    t.elapsed().as_secs_f64() * 1e3
                );
            }
        }
        let (d, t) = (rows[0], rows[1]);
        println!(
            "added by the tap: p50 {:+.1} µs, p99 {:+.1} µs; throughput {:.0}% of direct",
            t.0 - d.0,
            t.2 - d.2,
            100.0 * t.4 / d.4
        );
        if let Ok(m) = std::fs::metadata(&trace) {
            println!("trace written: {} bytes ({})", m.len(), trace.display());
        }
    });
    let rate = observer_capacity(n_msgs, &trace);
    println!(
        "observer alone: {rate:.0} output messages/s of 64 outputs ({:.1} M outputs/s)",
        rate * 64.0 / 1e6
    );
    let _ = std::fs::remove_file(&trace);
}
