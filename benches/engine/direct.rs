//! Driving `play` directly over ZMQ as its frontend: the closed-loop throughput run and
//! the grammar run.

use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use sim_protocol::decode::{DecodedOutputs, decode_outputs_for};
use sim_protocol::encode::encode_request;
use sim_protocol::transport::{FrontendListener, recv_frames, send_frames};
use sim_protocol::{EngineCoreRequest, SamplingParams, VllmLine};

use crate::process::{Engine, cpu_seconds, rss_kib};

pub(crate) fn request(id: String, prompt_len: usize, max_tokens: u32) -> EngineCoreRequest {
    EngineCoreRequest {
        request_id: id,
        prompt_token_ids: Some((0..prompt_len as u32).map(|i| 3 + i % 200).collect()),
        sampling_params: Some(SamplingParams {
            max_tokens: Some(max_tokens),
            eos_token_id: None, // ignore_eos: every request runs to max_tokens
            output_kind: 1,
            ..Default::default()
        }),
        arrival_time: 0.0,
        ..Default::default()
    }
}

pub(crate) struct DirectResult {
    pub(crate) concurrency: usize,
    pub(crate) tokens: u64,
    pub(crate) wall: f64,
    pub(crate) engine_cpu: f64,
    /// Engine resident memory (KiB) after a quarter, half and all of the requests.
    pub(crate) rss_kib: [u64; 3],
}
/// Closed loop: keep `concurrency` requests in flight until `total` were served.
pub(crate) async fn direct_run(
    concurrency: usize,
    total: usize,
    max_tokens: u32,
    extra: &[&str],
    log: &Path,
) -> (DirectResult, String) {
    let line = VllmLine::new(0, 33);
    // `replay-<i>` names the i-th record of a --replay-tokens trace
    let replaying = extra.contains(&"--replay-tokens");
    let prefix = if replaying { "replay-" } else { "b" };
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let seqs = concurrency.to_string();
    let mut args = vec!["--max-num-seqs", &seqs, "--max-model-len", "1000000"];
    args.extend_from_slice(extra);
    let engine = Engine::start(fl.handshake_address(), &args, log);
    let engines = fl.accept_engines(1, Duration::from_secs(30)).await.unwrap();
    let identity = engines[0].identity.clone();
    let mut socks = fl.into_sockets();
    let mut input = socks.inputs.remove(0);
    let mut output = socks.outputs.remove(0);
    let pid = engine.child.id();

    let cpu0 = cpu_seconds(pid);
    let start = Instant::now();
    let mut sent = 0usize;
    let mut in_flight: HashSet<String> = HashSet::new();
    let mut tokens = 0u64;
    let mut done = 0usize;
    let mut rss = [0u64; 3];
    let send = |i: usize| {
        let mut frames = vec![identity.clone()];
        frames.extend(encode_request(
            line,
            &request(format!("{prefix}{i}"), 32, max_tokens),
        ));
        frames
    };
    while sent < concurrency.min(total) {
        send_frames(&mut input, send(sent)).await.unwrap();
        in_flight.insert(format!("{prefix}{sent}"));
        sent += 1;
    }
    while done < total {
        let frames: Vec<Bytes> = recv_frames(&mut output).await.unwrap();
        let Ok(DecodedOutputs::Outputs(env)) = decode_outputs_for(line, &frames) else {
            panic!("bad output");
        };
        let mut refill = 0;
        for o in &env.outputs {
            tokens += o.new_token_ids.len() as u64;
            if o.finish_reason.is_some() && in_flight.remove(o.request_id.as_str()) {
                done += 1;
                refill += 1;
                if done == total / 4 {
                    rss[0] = rss_kib(pid);
                } else if done == total / 2 {
                    rss[1] = rss_kib(pid);
                }
            }
        }
        for _ in 0..refill {
            if sent < total {
                send_frames(&mut input, send(sent)).await.unwrap();
                in_flight.insert(format!("{prefix}{sent}"));
                sent += 1;
            }
        }
    }
    let wall = start.elapsed().as_secs_f64();
    let engine_cpu = cpu_seconds(pid) - cpu0;
    rss[2] = rss_kib(pid);
    drop(input);
    drop(output);
    let log = engine.stop();
    (
        DirectResult {
            concurrency,
            tokens,
            wall,
            engine_cpu,
            rss_kib: rss,
        },
        log,
    )
}

/// The inter-token gaps (engine timestamps, ms) of one stream at a fixed 10 ms ITL while
/// `grammars` requests with a 60,000-entry enum schema arrive (each compiles a grammar of
/// some hundreds of milliseconds); `grammars = 0` is the baseline. Returns the stream's
/// gaps and the wall time until every grammar request finished.
pub(crate) async fn grammar_run(grammars: usize, log: &Path) -> (Vec<f64>, f64) {
    use rmpv::Value;
    let line = VllmLine::new(0, 33);
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let engine = Engine::start(
        fl.handshake_address(),
        &["--inter-token-latency", "10", "--time-to-first-token", "10"],
        log,
    );
    let engines = fl.accept_engines(1, Duration::from_secs(30)).await.unwrap();
    let identity = engines[0].identity.clone();
    let mut socks = fl.into_sockets();
    let mut input = socks.inputs.remove(0);
    let mut output = socks.outputs.remove(0);
    let words: Vec<String> = (0..60_000)
        .map(|i| format!("option-{i:06}-{}", (i * 7919) % 100_003))
        .collect();
    let schema = serde_json::json!({"type": "object", "properties": {"pick": {"enum": words}},
        "required": ["pick"]})
    .to_string();
    let send = |r: &EngineCoreRequest| {
        let mut frames = vec![identity.clone()];
        frames.extend(encode_request(line, r));
        frames
    };
    let stream = request("stream".into(), 16, 200);
    send_frames(&mut input, send(&stream)).await.unwrap();
    let mut stamps: Vec<f64> = Vec::new();
    let mut pending: HashSet<String> = (0..grammars).map(|i| format!("g{i}")).collect();
    let mut stream_done = false;
    let mut sent = false;
    let start = Instant::now();
    let mut grammars_done_at = 0.0;
    while !stream_done || !pending.is_empty() {
        let frames: Vec<Bytes> = recv_frames(&mut output).await.unwrap();
        let Ok(DecodedOutputs::Outputs(env)) = decode_outputs_for(line, &frames) else {
            continue;
        };
        for o in &env.outputs {
            if o.request_id.as_str() == "stream" {
                stamps.push(env.timestamp);
                stream_done |= o.finish_reason.is_some();
            } else if o.finish_reason.is_some() && pending.remove(o.request_id.as_str()) {
                grammars_done_at = start.elapsed().as_secs_f64();
            }
        }
        // the grammars arrive once the stream is in its stride
        if !sent && stamps.len() == 20 {
            for i in 0..grammars {
                let mut r = request(format!("g{i}"), 16, 8);
                if let Some(sp) = r.sampling_params.as_mut() {
                    sp.structured_outputs = Some(Value::Map(vec![
                        (Value::from("json"), Value::from(schema.clone())),
                        (Value::from("_backend"), Value::from("xgrammar")),
                    ]));
                }
                send_frames(&mut input, send(&r)).await.unwrap();
            }
            sent = true;
        }
    }
    drop(input);
    drop(output);
    engine.stop();
    let gaps = stamps.windows(2).map(|p| (p[1] - p[0]) * 1e3).collect();
    (gaps, grammars_done_at)
}
