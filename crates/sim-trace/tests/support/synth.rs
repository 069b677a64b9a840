//! A synthetic capture with known step costs: a small engine simulator (FCFS, decodes
//! first, chunked prefill in the token budget left, prefix-cache hits, optional speculative
//! bursts, closed-loop clients with think time) that writes a trace and a step-stats
//! sidecar as the tap would. Shared by the fit tests and the fit bench
//! (`#[path]`-included).

#![allow(dead_code)]

use std::collections::VecDeque;
use std::path::Path;

use sim_trace::latency::IDLE_WAKE_MS;
use sim_trace::steps::StepStats;
use sim_trace::trace::{ItlCtx, TraceMeta, TraceRecord, TraceWriter};

/// What to simulate. Costs in ms; a step costs
/// `(step + decode·D + context·ΣC + prefill·P + depth·Q + burst·(T − D) + [a new size]·new_size
/// + [from idle]·idle_wake + first_token·F) × noise`, the size of a step being P + D.
#[derive(Debug, Clone)]
pub struct Synth {
    pub requests: usize,
    pub concurrency: usize,
    pub seed: u64,
    pub step_ms: f64,
    pub per_decode_ms: f64,
    pub per_context_token_ms: f64,
    pub per_prefill_token_ms: f64,
    pub per_prefill_depth_ms: f64,
    pub per_burst_token_ms: f64,
    /// Per step of a size (prefilled tokens plus decodes) not run before.
    pub new_size_ms: f64,
    /// Per step started after the engine sat idle `IDLE_WAKE_MS` or more.
    pub idle_wake_ms: f64,
    /// Per request whose prefill completes in the step.
    pub per_first_token_ms: f64,
    /// Multiplicative noise, uniform in `[1 − noise, 1 + noise]`.
    pub noise: f64,
    /// Token budget per step (`max_num_batched_tokens`).
    pub budget: u32,
    /// Prompt length, uniform in this range.
    pub prompt: (u32, u32),
    /// Up to this many 64-token blocks of the prompt are cached.
    pub cached_blocks: u32,
    /// Output length, uniform in this range.
    pub output: (u32, u32),
    /// A client waits up to this long (uniform) before its next request.
    pub think_ms: f64,
    /// Speculative decoding: K drafts, each accepted with this probability.
    pub spec: Option<(u32, f64)>,
}

impl Default for Synth {
    fn default() -> Self {
        Self {
            requests: 400,
            concurrency: 8,
            seed: 1,
            step_ms: 5.0,
            per_decode_ms: 0.4,
            per_context_token_ms: 0.0,
            per_prefill_token_ms: 0.05,
            per_prefill_depth_ms: 0.0,
            per_burst_token_ms: 0.0,
            new_size_ms: 0.0,
            idle_wake_ms: 0.0,
            per_first_token_ms: 0.0,
            noise: 0.05,
            budget: 2048,
            prompt: (128, 128),
            cached_blocks: 0,
            output: (64, 64),
            think_ms: 0.0,
            spec: None,
        }
    }
}

/// What was written.
#[derive(Debug, Clone, Copy, Default)]
pub struct Written {
    pub records: usize,
    pub steps: usize,
    pub tokens: u64,
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn range(&mut self, (lo, hi): (u32, u32)) -> u32 {
        lo + (self.next() % u64::from(hi - lo + 1)) as u32
    }
}

struct Req {
    prompt: u32,
    cached: u32,
    target: u32,
    arrival: f64,
    computed: u32,
    emitted: u32,
    last: f64,
    ttft: f64,
    itl: Vec<f64>,
    tokens: Vec<u32>,
    running: Vec<u32>,
}

fn r3(v: f64) -> f64 {
    (v * 1e3).round() / 1e3
}

impl Synth {
    /// Simulate and write the trace (and the sidecar).
    pub fn write(&self, trace: &Path, sidecar: Option<&Path>) -> Written {
        let mut rng = Rng(self.seed);
        let meta = TraceMeta {
            block_size: Some(64),
            config_hash: Some("synthetic".into()),
            ..TraceMeta::new()
        };
        let mut w = TraceWriter::create(trace, &meta).unwrap();
        let mut side = sidecar.map(|p| TraceWriter::create_without_meta(p).unwrap());
        let mut out = Written::default();
        // when each client sends its next request
        let mut arrivals: Vec<f64> = (0..self.concurrency).map(|c| c as f64 * 0.5).collect();
        let mut issued = 0usize;
        // the step sizes run so far
        let mut sizes = std::collections::HashSet::new();
        let (mut waiting, mut running): (VecDeque<Req>, Vec<Req>) = Default::default();
        let (mut t, mut prev_ts, mut done) = (0.0f64, None::<f64>, 0usize);
        while done < self.requests {
            arrivals.sort_by(|a, b| b.total_cmp(a));
            while arrivals.last().is_some_and(|&a| a <= t) && issued < self.requests {
                let a = arrivals.pop().unwrap();
                issued += 1;
                let prompt = rng.range(self.prompt);
                let blocks = rng.range((0, self.cached_blocks)).min((prompt - 1) / 64);
                waiting.push_back(Req {
                    prompt,
                    cached: blocks * 64,
                    target: rng.range(self.output),
                    arrival: r3(a),
                    computed: blocks * 64,
                    emitted: 0,
                    last: 0.0,
                    ttft: 0.0,
                    itl: Vec::new(),
                    tokens: Vec::new(),
                    running: Vec::new(),
                });
            }
            if running.is_empty() && waiting.is_empty() {
                match arrivals.last() {
                    Some(&a) if issued < self.requests => t = a,
                    _ => break,
                }
                continue;
            }
            // compose: decodes, then partial prefills, then new requests
            let mut budget = self.budget;
            let mut bursts = vec![0u32; running.len()];
            let (mut d, mut ctx, mut extra) = (0u32, 0f64, 0u32);
            for (i, r) in running.iter().enumerate() {
                if r.computed == r.prompt && budget > 0 {
                    let mut n = 1;
                    if let Some((k, a)) = self.spec {
                        while n <= k && rng.unit() < a {
                            n += 1;
                        }
                    }
                    let n = n.min(r.target - r.emitted);
                    bursts[i] = n;
                    d += 1;
                    extra += n - 1;
                    ctx += f64::from(r.prompt + r.emitted);
                    budget -= 1;
                }
            }
            let mut chunks: Vec<(usize, u32)> = Vec::new();
            for (i, r) in running.iter().enumerate() {
                if r.computed < r.prompt && budget > 0 {
                    let c = (r.prompt - r.computed).min(budget);
                    chunks.push((i, c));
                    budget -= c;
                }
            }
            while budget > 0 && !waiting.is_empty() {
                let r = waiting.pop_front().unwrap();
                let c = (r.prompt - r.computed).min(budget);
                budget -= c;
                chunks.push((running.len(), c));
                running.push(r);
                bursts.push(0);
            }
            let (mut p, mut q) = (0f64, 0f64);
            for &(i, c) in &chunks {
                let d0 = f64::from(running[i].computed);
                let d1 = d0 + f64::from(c);
                p += f64::from(c);
                q += (d1 * d1 - d0 * d0) / 2.0;
            }
            let new_size = sizes.insert(p as u64 + u64::from(d));
            let from_idle = prev_ts.is_some_and(|p| t - p >= IDLE_WAKE_MS as f64);
            let completing = chunks
                .iter()
                .filter(|&&(i, c)| running[i].computed + c == running[i].prompt)
                .count();
            let cost = self.step_ms
                + if new_size { self.new_size_ms } else { 0.0 }
                + if from_idle { self.idle_wake_ms } else { 0.0 }
                + self.per_first_token_ms * completing as f64
                + self.per_decode_ms * f64::from(d)
                + self.per_context_token_ms * ctx
                + self.per_prefill_token_ms * p
                + self.per_prefill_depth_ms * q
                + self.per_burst_token_ms * f64::from(extra);
            let cost = cost * (1.0 + self.noise * (2.0 * rng.unit() - 1.0));
            t = r3(t + cost);
            // outputs
            let (mut firsts, mut first_tokens, mut new_tokens) = (0u64, 0u64, 0u64);
            for (i, r) in running.iter_mut().enumerate() {
                if bursts[i] > 0 {
                    r.itl.push(r3(t - r.last));
                    r.tokens.push(bursts[i]);
                    r.emitted += bursts[i];
                    r.last = t;
                    new_tokens += u64::from(bursts[i]);
                }
            }
            for &(i, c) in &chunks {
                let r = &mut running[i];
                r.computed += c;
                if r.computed == r.prompt {
                    r.ttft = r3(t - r.arrival);
                    r.emitted = 1;
                    r.last = t;
                    firsts += 1;
                    first_tokens += u64::from(r.prompt - r.cached);
                    new_tokens += 1;
                }
            }
            let (mut gone, keep): (Vec<Req>, Vec<Req>) = std::mem::take(&mut running)
                .into_iter()
                .partition(|r| r.emitted >= r.target);
            running = keep;
            let after = running.len() as u32;
            for r in running.iter_mut().chain(gone.iter_mut()) {
                if r.itl.len() > r.running.len() {
                    r.running.push(after);
                }
            }
            for r in gone {
                out.records += 1;
                out.tokens += u64::from(r.emitted);
                let all_one = r.tokens.iter().all(|&n| n == 1);
                w.write_record(&TraceRecord {
                    prompt_tokens: r.prompt,
                    cached_tokens: Some(r.cached),
                    output_tokens: r.emitted,
                    arrival_ms: Some(r.arrival),
                    ttft_ms: Some(r.ttft),
                    itl_ms: r.itl,
                    itl_tokens: if all_one { Vec::new() } else { r.tokens },
                    itl_ctx: ItlCtx {
                        num_running: r.running,
                        prefill_tokens: Vec::new(),
                    },
                    finish_reason: Some("length".into()),
                    ..Default::default()
                })
                .unwrap();
                done += 1;
                arrivals.push(t + self.think_ms * rng.unit());
            }
            if let Some(s) = side.as_mut() {
                s.write_json(&StepStats {
                    ts_ms: t,
                    step_ms: prev_ts.map(|p| r3(t - p)),
                    num_running_reqs: u64::from(after),
                    num_waiting_reqs: waiting.len() as u64,
                    outputs: u64::from(d) + firsts,
                    new_tokens,
                    prefill_requests: firsts as u32,
                    prefill_tokens: first_tokens,
                    ..StepStats::default()
                })
                .unwrap();
            }
            prev_ts = Some(t);
            out.steps += 1;
        }
        w.finish().unwrap();
        if let Some(s) = side {
            s.finish().unwrap();
        }
        out
    }
}
