//! Time is an input: one workload run live over ZMQ, then fed to the offline driver with
//! the engine-side arrival time of each request, gives the same tokens, the same step
//! sequence and the same step durations.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::support::*;
use sim_protocol::{EngineCoreOutputs, EventType, FinishReason};
use vllm_vcr::play::config::PlayConfig;
use vllm_vcr::play::engine::offline::OfflineDriver;
use vllm_vcr::play::engine::timer::instant_to_monotonic;

/// One step as the stats show it: (step counter, running, waiting, KV usage ‰, prefix
/// queries, hits, requests that produced tokens).
type Step = (u64, u64, u64, u64, u64, u64, Vec<String>);

/// A request of the workload: (id, prompt, max_tokens).
type Req = (String, Vec<u32>, u32);

/// What a run showed, with times relative to the first request's arrival.
#[derive(Debug, Default, PartialEq)]
struct Run {
    tokens: BTreeMap<String, Vec<u32>>,
    finished: BTreeMap<String, FinishReason>,
    steps: Vec<Step>,
    /// Every SCHEDULED / PREEMPTED event: (µs after the first arrival, request, kind).
    /// These carry a step's start, which is the previous step's end: the step clock.
    step_events: Vec<(i64, String, EventType)>,
    /// Emission time of each step, µs after the first arrival.
    emitted_us: Vec<i64>,
}

impl Run {
    fn absorb(&mut self, env: &EngineCoreOutputs, origin: f64) {
        let us = |t: f64| ((t - origin) * 1e6).round() as i64;
        let mut produced = Vec::new();
        for o in &env.outputs {
            if !o.new_token_ids.is_empty() {
                produced.push(o.request_id.to_string());
            }
            self.tokens
                .entry(o.request_id.to_string())
                .or_default()
                .extend(&o.new_token_ids);
            if let Some(f) = o.finish_reason {
                self.finished.insert(o.request_id.to_string(), f);
            }
            for e in &o.events {
                if e.kind != EventType::Queued {
                    self.step_events
                        .push((us(e.timestamp), o.request_id.to_string(), e.kind));
                }
            }
        }
        if let Some(s) = &env.scheduler_stats {
            produced.sort();
            self.steps.push((
                s.step_counter,
                s.num_running_reqs,
                s.num_waiting_reqs,
                (s.kv_cache_usage * 1000.0).round() as u64,
                s.prefix_cache_stats.queries,
                s.prefix_cache_stats.hits,
                produced,
            ));
            self.emitted_us.push(us(env.timestamp));
        }
    }
}

fn workload() -> Vec<Req> {
    (0..64u32)
        .map(|i| {
            // prompts of 6..=40 tokens sharing a 12-token prefix every other request
            let len = 6 + (i * 7) % 35;
            let prompt: Vec<u32> = (0..len)
                .map(|j| {
                    if i % 2 == 0 && j < 12 {
                        5 + j
                    } else {
                        3 + (i * 31 + j * 17) % 250
                    }
                })
                .collect();
            (format!("r{i:02}"), prompt, 8 + (i * 5) % 17)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_run_and_the_offline_driver_agree_step_for_step() {
    let mut a = args();
    a.time_to_first_token = 6.0;
    a.time_to_first_token_std_dev = 3.0;
    a.inter_token_latency = 1.5;
    a.inter_token_latency_std_dev = 0.7;
    a.prefill_time_per_token = 0.02;
    a.max_num_seqs = Some(24);
    a.block_size = Some(4);
    a.num_gpu_blocks = 60; // 236 tokens of KV: the batch outgrows it and preempts
    a.seed = 11;
    let cfg = PlayConfig::try_from(&a).unwrap();
    let line = cfg.line;

    // live, over ZMQ, requests sent ~0.7 ms apart
    let mut w = Wire::start(a).await;
    let work = workload();
    for (i, (id, prompt, max)) in work.iter().enumerate() {
        w.send(&add(id, prompt, *max)).await;
        if i % 3 != 2 {
            tokio::time::sleep(Duration::from_micros(700)).await;
        }
    }
    let ids: Vec<&str> = work.iter().map(|(id, _, _)| id.as_str()).collect();
    let mut c = w.collect(&ids).await;

    // engine-side arrivals: each request's QUEUED event
    let mut arrivals: BTreeMap<String, f64> = BTreeMap::new();
    for env in &c.envelopes {
        for o in &env.outputs {
            for e in &o.events {
                if e.kind == EventType::Queued {
                    arrivals.insert(o.request_id.to_string(), e.timestamp);
                }
            }
        }
    }
    assert_eq!(arrivals.len(), 64, "every request reported its arrival");
    let first = arrivals.values().copied().fold(f64::INFINITY, f64::min);

    // offline, on a virtual clock
    let mut run = OfflineDriver::new(cfg.build_engine(0));
    let mut order: Vec<(f64, &Req)> = work.iter().map(|r| (arrivals[&r.0], r)).collect();
    order.sort_by(|x, y| x.0.total_cmp(&y.0));
    for (t, (id, prompt, max)) in order {
        let mut req = request(id, prompt, *max);
        req.wire_len = line.request_len();
        run.add(Duration::from_secs_f64(t - first), 0, req);
    }
    let outputs = run.run_until_idle();
    let origin = instant_to_monotonic(run.origin());
    let mut offline = Run::default();
    for o in &outputs {
        offline.absorb(&o.outputs, origin);
    }

    // The live engine's last message, the stats of the empty step after the last finish,
    // can come after the last request's: wait for as many steps' stats as the offline run
    // made (a loaded host can hold a message back past any short silence), then for any
    // the live engine sent beyond them.
    let stats = |c: &Collected| {
        c.envelopes
            .iter()
            .filter(|e| e.scheduler_stats.is_some())
            .count()
    };
    while stats(&c) < offline.steps.len() {
        match w.try_recv(Duration::from_secs(10)).await {
            Some(env) => c.envelopes.push(env),
            None => panic!(
                "the live engine sent {} steps' stats in 10 s more; the offline run made {}",
                stats(&c),
                offline.steps.len()
            ),
        }
    }
    while let Some(env) = w.try_recv(Duration::from_millis(200)).await {
        c.envelopes.push(env);
    }
    w.stop().await.unwrap();
    let mut live = Run::default();
    for env in &c.envelopes {
        live.absorb(env, first);
    }
    let preemptions = live
        .step_events
        .iter()
        .filter(|e| e.2 == EventType::Preempted)
        .count();
    assert!(preemptions > 0, "the workload preempts");

    assert_eq!(offline.tokens, live.tokens, "same tokens");
    assert_eq!(offline.finished, live.finished, "same finishes");
    assert_eq!(offline.steps, live.steps, "same step sequence");
    // Step starts (SCHEDULED/PREEMPTED stamps) are the previous steps' deadlines: equal
    // up to the clock conversion's rounding.
    assert_eq!(offline.step_events.len(), live.step_events.len());
    for (o, l) in offline.step_events.iter().zip(&live.step_events) {
        assert_eq!((&o.1, o.2), (&l.1, l.2));
        assert!(
            (o.0 - l.0).abs() <= 2,
            "step clock: offline {o:?} live {l:?}"
        );
    }
    // Live emissions are late by the loop's wake-up lateness, never early.
    let mut late: Vec<i64> = live
        .emitted_us
        .iter()
        .zip(&offline.emitted_us)
        .map(|(l, o)| l - o)
        .collect();
    late.sort();
    assert!(
        late[0] >= -2,
        "a live step was emitted before its deadline: {late:?}"
    );
    let p50 = late[late.len() / 2];
    assert!(p50 < 2_000, "median lateness {p50} µs");
    eprintln!(
        "{} steps, {} preemptions; live lateness p50 {} µs, max {} µs",
        live.steps.len(),
        preemptions,
        p50,
        late[late.len() - 1]
    );
}

/// vLLM's engine-core takes in new requests between steps: a request that arrives while a
/// step runs is QUEUED when that step ends (and joins the next one), one that finds the
/// engine idle is queued at once and starts a step of its own.
#[test]
fn a_request_arriving_during_a_step_is_queued_when_the_step_ends() {
    let mut a = args();
    a.time_to_first_token = 20.0;
    a.inter_token_latency = 5.0;
    let cfg = PlayConfig::try_from(&a).unwrap();
    let line = cfg.line;
    let mut run = OfflineDriver::new(cfg.build_engine(0));
    let ms = |x: f64| Duration::from_secs_f64(x / 1000.0);
    for (id, at) in [("early", 0.0), ("during", 3.0), ("alone", 500.0)] {
        let mut req = request(id, &[5, 6, 7, 8], 3);
        req.wire_len = line.request_len();
        run.add(ms(at), 0, req);
    }
    let outputs = run.run_until_idle();
    let origin = instant_to_monotonic(run.origin());
    let mut queued: BTreeMap<String, f64> = BTreeMap::new();
    let mut first_token: BTreeMap<String, f64> = BTreeMap::new();
    for o in &outputs {
        for x in &o.outputs.outputs {
            for e in &x.events {
                if e.kind == EventType::Queued {
                    queued.insert(x.request_id.to_string(), (e.timestamp - origin) * 1000.0);
                }
            }
            if !x.new_token_ids.is_empty() {
                first_token
                    .entry(x.request_id.to_string())
                    .or_insert(o.at.as_secs_f64() * 1000.0);
            }
        }
    }
    let near = |x: f64, y: f64| (x - y).abs() < 0.01;
    assert!(near(queued["early"], 0.0), "{queued:?}");
    // "early" prefills alone from 0 to 20 ms; "during" came at 3 ms and waits for it
    assert!(near(first_token["early"], 20.0), "{first_token:?}");
    assert!(near(queued["during"], 20.0), "{queued:?}");
    assert!(first_token["during"] > 20.0, "{first_token:?}");
    // the engine was idle at 500 ms
    assert!(near(queued["alone"], 500.0), "{queued:?}");
}

/// Requests that reach an idle engine at the same instant share its first step (vLLM
/// drains its input queue before it schedules); an abort in that instant starts the step
/// itself, and the engine then runs to the end instead of waking again and again.
#[test]
fn requests_of_one_instant_share_the_first_step_and_an_abort_among_them_starts_it() {
    let mut a = args();
    a.time_to_first_token = 20.0;
    a.inter_token_latency = 5.0;
    let cfg = PlayConfig::try_from(&a).unwrap();
    let line = cfg.line;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut run = OfflineDriver::new(cfg.build_engine(0));
        for id in ["a", "b", "gone"] {
            let mut req = request(id, &[5, 6, 7, 8], 3);
            req.wire_len = line.request_len();
            run.add(Duration::ZERO, 0, req);
        }
        run.abort(Duration::ZERO, 0, vec!["gone".into()]);
        let _ = tx.send(first_token_ms(&run.run_until_idle()));
    });
    let first = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the offline run ends");
    assert_eq!(first.len(), 2, "{first:?}");
    assert!((first["a"] - 20.0).abs() < 0.01, "{first:?}");
    assert!(
        (first["b"] - 20.0).abs() < 0.01,
        "one step for both: {first:?}"
    );
}

/// `--ttft-mode fixed`: each request's first token comes the knob's TTFT after its
/// arrival, plus at most the decode step in flight, however many arrive at once; under the
/// default `step` mode a burst (a request every 0.1 ms) queues behind its own prefills:
/// the first starts a step alone, the rest wait for it.
#[test]
fn a_fixed_ttft_does_not_grow_with_concurrency() {
    let first_tokens = |mode: vllm_vcr::play::engine_args::TtftMode, spread_us: u64| -> Vec<f64> {
        let mut a = args();
        a.time_to_first_token = 40.0;
        a.inter_token_latency = 8.0;
        a.ttft_mode = mode;
        let cfg = PlayConfig::try_from(&a).unwrap();
        let line = cfg.line;
        let mut run = OfflineDriver::new(cfg.build_engine(0));
        let sent = |i: u64| Duration::from_micros(100_000 + spread_us * i);
        for i in 0..16 {
            // a burst of 16 from 100 ms
            let mut req = request(&format!("r{i:02}"), &[5, 6, 7, 8], 20);
            req.wire_len = line.request_len();
            run.add(sent(i), 0, req);
        }
        let outputs = run.run_until_idle();
        let mut first: BTreeMap<String, f64> = BTreeMap::new();
        for o in &outputs {
            for x in &o.outputs.outputs {
                if !x.new_token_ids.is_empty() {
                    let id = x.request_id.to_string();
                    let i: u64 = id[1..].parse().unwrap();
                    let ttft = (o.at - sent(i)).as_secs_f64() * 1000.0;
                    first.entry(id).or_insert(ttft);
                }
            }
        }
        first.into_values().collect()
    };
    use vllm_vcr::play::engine_args::TtftMode;
    let fixed = first_tokens(TtftMode::Fixed, 0);
    assert_eq!(fixed.len(), 16);
    for t in &fixed {
        assert!((40.0..=48.01).contains(t), "fixed TTFTs {fixed:?}");
    }
    let step = first_tokens(TtftMode::Step, 100);
    let worst = step.iter().cloned().fold(0.0, f64::max);
    assert!(
        worst > 60.0,
        "step mode queues the burst behind its prefills: {step:?}"
    );
}

/// The first token's time of each request, ms after `origin_ms`.
fn first_token_ms(
    outputs: &[vllm_vcr::play::engine::offline::TimedOutput],
) -> BTreeMap<String, f64> {
    let mut first = BTreeMap::new();
    for o in outputs {
        for x in &o.outputs.outputs {
            if !x.new_token_ids.is_empty() {
                first
                    .entry(x.request_id.to_string())
                    .or_insert(o.at.as_secs_f64() * 1000.0);
            }
        }
    }
    first
}

/// A fully cached prompt still costs a forward pass: on an idle engine the second of two
/// identical 460-token prompts gets its first token no sooner than a decode step (10 ms)
/// after it arrives, in every latency mode (it used to come after 0.2 ms: only the 12
/// uncached tokens' share of the TTFT knob, or nothing at all with a 0 TTFT). A cold
/// prompt's TTFT knob is still what it costs.
#[test]
fn a_fully_cached_prompt_costs_at_least_a_decode_step() {
    use vllm_vcr::play::engine_args::TtftMode;
    let prompt: Vec<u32> = (0..460).map(|i| 3 + (i * 7) % 250).collect();
    for (mode, ttft) in [
        (TtftMode::Step, 0.0),
        (TtftMode::Step, 100.0),
        (TtftMode::Fixed, 5.0),
        (TtftMode::Fixed, 40.0),
    ] {
        let mut a = args();
        a.time_to_first_token = ttft;
        a.inter_token_latency = 10.0;
        a.ttft_mode = mode;
        let cfg = PlayConfig::try_from(&a).unwrap();
        let line = cfg.line;
        let mut run = OfflineDriver::new(cfg.build_engine(0));
        for (id, at) in [("cold", 0), ("cached", 1000)] {
            let mut req = request(id, &prompt, 2);
            req.wire_len = line.request_len();
            run.add(Duration::from_millis(at), 0, req);
        }
        let first = first_token_ms(&run.run_until_idle());
        let what = format!("{mode:?} ttft {ttft}: {first:?}");
        let cold = first["cold"];
        let cached = first["cached"] - 1000.0;
        // a cold prompt: the knob, and no less than a step
        assert!(cold >= ttft.max(10.0) - 0.01, "{what}");
        assert!(cold <= ttft + 10.01, "{what}");
        assert!(cached >= 10.0 - 0.01, "{what}");
        if mode == TtftMode::Step {
            assert!(cached < cold.max(10.0) + 0.01, "{what}");
        }
    }
}

/// The engine's description (logged at start) names the latency in force: under
/// `--ttft-mode fixed` the TTFT knob, not the 0 ms the steps are given.
#[test]
fn the_logged_latency_names_a_fixed_ttft() {
    let mut a = args();
    a.ttft_mode = vllm_vcr::play::engine_args::TtftMode::Fixed;
    a.time_to_first_token = 50.0;
    a.inter_token_latency = 10.0;
    let cfg = PlayConfig::try_from(&a).unwrap();
    let text = cfg.build_engine(0).describe();
    assert!(text.contains("ttft fixed 50 ms"), "{text}");
    assert!(!text.contains("ttft 0 ms"), "{text}");
    assert!(text.contains("itl 10 ms"), "{text}");
}

/// A request's tokens, the virtual times of its outputs and its finish.
type Answer = (Vec<u32>, Vec<Duration>, Option<FinishReason>);

/// Issue 22 M4: live, a grammar compiles off the step loop while its request waits; the
/// offline driver compiles it at once at the current virtual time, so a simulated run with
/// structured outputs answers them and is the same run every time.
#[test]
fn the_offline_driver_compiles_grammars_at_once_and_deterministically() {
    let schema =
        r#"{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}"#;
    let once = || {
        let mut a = args();
        a.inter_token_latency = 10.0;
        let line = a.vllm_version;
        let cfg = PlayConfig::try_from(&a).unwrap();
        let mut d = OfflineDriver::new(cfg.build_engine(0));
        let mut j = request("json", &[10, 11], 100);
        j.wire_len = line.request_len();
        j.sampling_params.as_mut().unwrap().structured_outputs = Some(rmpv::Value::Map(vec![(
            rmpv::Value::from("json"),
            rmpv::Value::from(schema),
        )]));
        d.add(Duration::ZERO, 0, j);
        let mut p = request("plain", &[10, 12], 4);
        p.wire_len = line.request_len();
        d.add(Duration::from_millis(5), 0, p);
        let mut got: BTreeMap<String, Answer> = BTreeMap::new();
        for o in d.run_until_idle() {
            for out in &o.outputs.outputs {
                let e = got.entry(out.request_id.to_string()).or_default();
                e.0.extend(&out.new_token_ids);
                e.1.push(o.at);
                e.2 = e.2.or(out.finish_reason);
            }
        }
        got
    };
    let first = once();
    assert_eq!(first, once(), "the same run every time");
    let (ids, _, finish) = &first["json"];
    assert_eq!(*finish, Some(FinishReason::Stop));
    let text: String = ids[..ids.len() - 1]
        .iter()
        .map(|t| char::from((t - 3) as u8))
        .collect();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(v["n"].is_i64(), "{text}");
    // no wait for the compile on the virtual clock: it answered no later than a request
    // without a grammar that arrived after it
    assert!(first["json"].1[0] <= first["plain"].1[0], "{first:?}");
    assert_eq!(first["plain"].2, Some(FinishReason::Length));
}
