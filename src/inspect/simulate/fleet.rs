//! The run itself, on one engine or on a fleet (`--engines N --route …`): N independent
//! engines built from the same flags (each its own KV cache and prefix cache), one
//! router that sends each request to an engine when it arrives, and every engine driven
//! on the same virtual clock, event by event in time order. One engine is the fleet of
//! one: the same loop, the same records.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::time::Duration;

use anyhow::Result;
use rustc_hash::FxHasher;
use sim_protocol::{EngineCoreRequest, SamplingParams, VllmLine};

use super::follow::{self, Finished, Follower};
use super::options::{Counts, RunOptions};
use super::prehash::PromptHashes;
use super::route::{Load, Router};
use super::stream::Feed;
use super::workload::{Turn, Workload};
use crate::inspect::progress::Progress;
use crate::play::config::PlayConfig;
use crate::play::content::pooling::Runner;
use crate::play::content::replay::prompt_block_hashes;
use crate::play::engine::block_hash::hash_u64;
use crate::play::engine::offline::OfflineDriver;
use crate::play::engine::sim::SimEngine;
use crate::play::engine_args::TokenMode;

/// One engine of the fleet, on its own virtual clock origin, and the requests it serves.
struct Member {
    driver: OfflineDriver<SimEngine>,
    follower: Follower,
    /// What the router sent here and has not seen finish.
    load: Load,
}

/// Send every request when it is due (to the engine the router picks), drive the engines
/// from event to event, and hand every record to `on_record` as its request finishes
/// (refused and abandoned requests too, as incomplete records). In a fleet of more than
/// one, each record names its engine.
pub fn run_workload(
    work: &Workload,
    cfg: &PlayConfig,
    opts: &RunOptions,
    mut on_record: impl FnMut(Finished) -> Result<()>,
) -> Result<Counts> {
    let n = work.requests();
    let line = cfg.line;
    let ids = cfg.engine.token_ids.clone();
    let block_size = cfg.engine.block_size as usize;
    let mut feed = Feed::of(work, opts)?;
    let engines = opts.fleet.engines.max(1);
    let mut router = Router::new(opts.fleet.route, engines);
    let mut fleet: Vec<Member> = (0..engines)
        .map(|_| {
            let mut driver = OfflineDriver::new(cfg.build_engine(0));
            // every prompt is drawn from the trace's block ids (`Workload::prompt`)
            driver.engine_mut().set_synthesized_prompts(true);
            if router.follows_cache() {
                // from the first step on: the router's view starts empty, as the cache
                driver.engine_mut().take_cache_events();
            }
            let origin = crate::play::engine::timer::instant_to_monotonic(driver.origin());
            let follower = Follower::new(opts.hash_blocks, opts.record_tokens, origin);
            Member {
                driver,
                follower,
                load: Load::default(),
            }
        })
        .collect();
    // each distinct prompt block hashed once for every engine (same flags, same chain
    // root) when the trace's blocks are the engine's and the prompts share them; keyed
    // by trace id when no record carries the hashes (offline engines publish no KV events)
    let keyed = opts.hash_blocks.is_none();
    let mut prehash = (work.trace_block_size == block_size && !opts.cold_prompts).then(|| {
        let root = fleet[0].driver.engine_mut().block_hash_root();
        PromptHashes::new(root, block_size, keyed)
    });
    // whether the engines read a prompt's ids only to hash its blocks, so the blocks the
    // memo hashed need no ids: output tokens drawn at random (not echoed), no replay
    // looked up by prompt, no pooling of the prompt
    let placeholders = cfg.tokens == TokenMode::Random
        && cfg.replay.is_none()
        && cfg.engine.runner != Runner::Pooling;
    let name = |e: usize| (engines > 1).then_some(e as u32);
    // the KV blocks each request in flight added to its engine when routed (those it
    // takes at its longest, less its cached prefix), kept only for a fleet's router
    let mut added: HashMap<usize, usize, BuildHasherDefault<FxHasher>> = HashMap::default();

    let mut finished = Vec::new();
    let mut progress = Progress::new("simulate:");
    let mut done = 0usize;
    let mut rejected = 0u64;
    let limits = Limits {
        max_model_len: cfg.engine.max_model_len,
        kv_tokens: cfg.engine.num_gpu_blocks.saturating_sub(1) * cfg.engine.block_size,
    };
    let mut record = |f: Finished, feed: &mut Feed| -> Result<()> {
        feed.finished(f.index, f.at);
        on_record(f)
    };
    loop {
        let engine_next = fleet.iter().filter_map(|m| m.driver.next_event()).min();
        let Some(next) = earliest(feed.next_due(), engine_next) else {
            break;
        };
        while let Some((at, i)) = feed.pop_due(next)? {
            let plan = feed.plan(i);
            let (prompt_tokens, output_tokens) = (plan.plan.prompt_tokens, plan.plan.output_tokens);
            if let Some(why) = limits.refuse(prompt_tokens.max(1), output_tokens.max(1)) {
                rejected += 1;
                done += 1;
                let f = follow::rejected(i, at, prompt_tokens.max(1), why);
                record(f, &mut feed)?;
                continue;
            }
            // the KV blocks it takes at its longest (prompt and every output token)
            let blocks = (prompt_tokens.max(1) + output_tokens.max(1))
                .div_ceil(block_size.max(1) as u32) as usize;
            // the prompt, and the engine's hashes of its blocks from the memo when it
            // applies; a cache-following router (and the records' hashes) read the same
            // chain in its 64-bit form
            let (prompt, engine_hashes) = match prehash.as_mut() {
                Some(p) => {
                    let (prompt, hashes) = p.prompt_and_hashes(plan, &ids, placeholders);
                    (prompt, Some(hashes))
                }
                None => (plan.prompt(ids.clone(), opts.cold_prompts), None),
            };
            let req = request(i, prompt, output_tokens, line, at);
            let hashes = if engines > 1 && router.follows_cache() {
                match &engine_hashes {
                    Some(h) => h.iter().map(hash_u64).collect(),
                    None => prompt_block_hashes(&req, block_size),
                }
            } else {
                Vec::new()
            };
            let e = if engines == 1 {
                0
            } else {
                let load: Vec<Load> = fleet.iter().map(|m| m.load).collect();
                router.pick(&hashes, blocks, &load)
            };
            // the blocks it adds to its engine: its cached prefix is shared, not new
            let own = blocks.saturating_sub(router.cached_prefix(e, &hashes));
            if engines > 1 {
                added.insert(i, own);
            }
            let m = &mut fleet[e];
            m.load.requests += 1;
            m.load.blocks += own;
            let recorded = engine_hashes
                .as_ref()
                .filter(|_| opts.hash_blocks.is_some())
                .map(|h| h.iter().map(hash_u64).collect());
            m.follower.arrive(i, at, &req, recorded);
            if let Some(hashes) = engine_hashes {
                m.driver
                    .engine_mut()
                    .offer_prompt_hashes(&req.request_id, hashes);
            }
            m.driver.add(at, 0, req);
        }
        for (e, m) in fleet.iter_mut().enumerate() {
            for out in m.driver.run_until(next) {
                m.follower.absorb(&out, &mut finished);
            }
            if router.follows_cache() {
                router.observe(e, m.driver.engine_mut().take_cache_events());
            }
            for mut f in finished.drain(..) {
                done += 1;
                m.load.requests = m.load.requests.saturating_sub(1);
                let own = added.remove(&f.index).unwrap_or(0);
                m.load.blocks = m.load.blocks.saturating_sub(own);
                f.record.engine = name(e);
                record(f, &mut feed)?;
            }
        }
        progress.status(|| {
            let in_flight: usize = fleet.iter().map(|m| m.follower.in_flight()).sum();
            let now = fleet
                .iter()
                .map(|m| m.driver.now())
                .max()
                .unwrap_or_default();
            format!(
                "{done}/{n} requests, {in_flight} in flight, {:.1} s simulated",
                now.as_secs_f64()
            )
        });
    }
    // Requests the engines could not finish (nothing left to happen, yet they are still
    // in flight): written incomplete; turns that continue them are never sent.
    let mut not_finished = 0u64;
    for (e, m) in fleet.iter_mut().enumerate() {
        let left = m.follower.in_flight() as u64;
        if left == 0 {
            continue;
        }
        not_finished += left;
        let why = "the engine could not finish it";
        m.follower.abandon_all(m.driver.now(), why, &mut finished);
        for mut f in finished.drain(..) {
            done += 1;
            f.record.engine = name(e);
            on_record(f)?;
        }
    }
    if not_finished > 0 {
        crate::errln!(
            "warning: {not_finished} request(s) never finished; they are written incomplete"
        );
    }
    if rejected > 0 {
        crate::errln!(
            "warning: {rejected} request(s) refused before the engine (longer than --max-model-len, or than the KV cache); they are written incomplete with the reason"
        );
    }
    progress.finish_status(&format!("{done}/{n} requests"));
    let turns = feed.turns();
    let sessions = opts.replay_sessions.then(|| {
        let roots = turns.iter().filter(|t| **t == Turn::Root).count();
        let untimed = turns
            .iter()
            .filter(|t| matches!(t, Turn::NotBefore { .. }))
            .count();
        (roots, n - roots, untimed)
    });
    let preemptions = fleet.iter().map(|m| m.follower.preemptions).sum();
    // every engine is built from the same flags: the first describes them all
    let engine = fleet.swap_remove(0).driver.into_engine();
    let counts = Counts {
        requests: n,
        sessions,
        preemptions,
        not_finished,
        never_sent: (n - done) as u64,
        rejected,
        describe: engine.describe(),
        replay: engine.replay_summary(),
    };
    Ok(counts)
}

/// The earlier of two times, if either.
fn earliest(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, y) => x.or(y),
    }
}

/// What a request may ask for. A frontend refuses a request longer than the model's
/// context (`--max-model-len`, prompt plus `max_tokens`), and vLLM does not start with a
/// context longer than its KV cache, so no request it serves is longer than that either:
/// the engine would queue it forever (first come, first served: with everything behind
/// it).
struct Limits {
    max_model_len: u64,
    kv_tokens: u64,
}

impl Limits {
    fn refuse(&self, prompt: u32, output: u32) -> Option<String> {
        let total = u64::from(prompt) + u64::from(output);
        if total > self.max_model_len {
            return Some(format!(
                "refused as a frontend would: {prompt} prompt + {output} output tokens exceed the maximum model length {} (--max-model-len, capped at what the KV cache holds)",
                self.max_model_len
            ));
        }
        (total > self.kv_tokens).then(|| {
            format!(
                "refused: {prompt} prompt + {output} output tokens do not fit the KV cache of {} tokens ((--num-gpu-blocks − 1) × --block-size; vLLM does not start with a --max-model-len above it)",
                self.kv_tokens
            )
        })
    }
}

/// The engine-side request a record becomes: named `replay-<i>` (its arrival-order
/// index, what `--replay-match index` looks up), generating exactly the recorded number
/// of tokens (`ignore_eos`; at least one, as vLLM requires).
fn request(
    i: usize,
    prompt: Vec<u32>,
    output_tokens: u32,
    line: VllmLine,
    at: Duration,
) -> EngineCoreRequest {
    let id = format!("replay-{i}");
    EngineCoreRequest {
        request_id: id.clone(),
        prompt_token_ids: Some(prompt),
        sampling_params: Some(SamplingParams {
            max_tokens: Some(output_tokens.max(1)),
            ignore_eos: true,
            output_kind: 1,
            ..Default::default()
        }),
        arrival_time: at.as_secs_f64(),
        external_req_id: Some(id),
        wire_len: line.request_len(),
        ..Default::default()
    }
}
