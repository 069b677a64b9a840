//! The step composer's rules, checked on a batch directly.

use std::time::Instant;

use sim_protocol::{EngineCoreRequest, EventType, LoRARequest, SamplingParams};

use super::*;
use crate::play::content::tokens::{RandomTokens, TokenSource};
use crate::play::engine::queue_policy::SchedulingPolicy;

struct Bench {
    batch: Batch,
    rules: ComposeRules,
}

fn rules() -> ComposeRules {
    ComposeRules {
        max_num_seqs: 16,
        max_num_batched_tokens: 8192,
        long_prefill_token_threshold: 0,
        enable_chunked_prefill: true,
        enable_prefix_caching: true,
        max_loras: 0,
        priority_preemption: false,
    }
}

/// A batch of 1000 blocks of 16 tokens, with the rules as `f` leaves them.
fn engine(f: impl FnOnce(&mut ComposeRules, &mut (u64, u64))) -> Bench {
    let mut rules = rules();
    let mut kv = (1000, 16);
    f(&mut rules, &mut kv);
    Bench {
        batch: Batch::new(kv.0, kv.1, false, SchedulingPolicy::Fcfs.build()),
        rules,
    }
}

fn add(e: &mut Bench, id: &str, prompt: Vec<u32>, lora: Option<i64>) {
    let req = EngineCoreRequest {
        request_id: id.into(),
        prompt_token_ids: Some(prompt),
        sampling_params: Some(SamplingParams {
            max_tokens: Some(100),
            ..Default::default()
        }),
        lora_request: lora.map(|i| LoRARequest {
            name: format!("l{i}"),
            int_id: i,
            path: format!("/l{i}"),
        }),
        wire_len: 22,
        ..Default::default()
    };
    let tokens = RandomTokens {
        seed: 0,
        min_id: 3,
        vocab_size: 259,
    };
    let r = SimRequest::new(&req, tokens.stream_for(&req), 0);
    e.batch.insert(r, Instant::now());
}

/// The next step's plan, by request id.
fn plan(e: &mut Bench) -> Vec<(String, u64)> {
    let scheduled = e
        .batch
        .compose(&e.rules, Instant::now())
        .map(|p| p.scheduled)
        .unwrap_or_default();
    scheduled
        .into_iter()
        .map(|(slot, n)| (e.batch.requests.get(slot).unwrap().id.to_string(), n))
        .collect()
}

/// Run the plan to completion (what the end of the step does).
fn finish(e: &mut Bench, scheduled: &[(String, u64)]) {
    for (id, n) in scheduled {
        let Some(slot) = e.batch.requests.slot(id) else {
            continue;
        };
        if let Some(r) = e.batch.advance(slot, *n) {
            r.started = true;
            r.generate_one(4096).unwrap();
        }
    }
}

fn s(v: &[(&str, u64)]) -> Vec<(String, u64)> {
    v.iter().map(|(a, b)| (a.to_string(), *b)).collect()
}

#[test]
fn budget_goes_to_running_requests_first_then_chunks() {
    let mut e = engine(|c, _| c.max_num_batched_tokens = 100);
    add(&mut e, "a", vec![5; 60], None);
    add(&mut e, "b", vec![6; 60], None);
    add(&mut e, "c", vec![7; 10], None);
    let p1 = plan(&mut e);
    assert_eq!(p1, s(&[("a", 60), ("b", 40)]), "b is chunked, c waits");
    finish(&mut e, &p1);
    // a decodes (1), b finishes its prompt (20), c gets the rest of the budget
    let p2 = plan(&mut e);
    assert_eq!(p2, s(&[("a", 1), ("b", 20), ("c", 10)]));
}

#[test]
fn long_prefill_threshold_caps_chunks_when_requests_compete() {
    let mut e = engine(|c, _| c.long_prefill_token_threshold = 16);
    add(&mut e, "a", vec![5; 40], None);
    add(&mut e, "b", vec![6; 40], None);
    assert_eq!(plan(&mut e), s(&[("a", 16), ("b", 16)]));
    // alone, a request may use the whole budget
    let mut e = engine(|c, _| c.long_prefill_token_threshold = 16);
    add(&mut e, "solo", vec![5; 40], None);
    assert_eq!(plan(&mut e), s(&[("solo", 40)]));
}

#[test]
fn without_chunked_prefill_a_prompt_must_fit_the_budget() {
    let mut e = engine(|c, _| {
        c.max_num_batched_tokens = 50;
        c.enable_chunked_prefill = false;
    });
    add(&mut e, "a", vec![5; 30], None);
    add(&mut e, "b", vec![6; 30], None);
    assert_eq!(plan(&mut e), s(&[("a", 30)]));
}

#[test]
fn max_num_seqs_caps_the_batch() {
    let mut e = engine(|c, _| c.max_num_seqs = 2);
    for id in ["a", "b", "c"] {
        add(&mut e, id, vec![5; 4], None);
    }
    assert_eq!(plan(&mut e), s(&[("a", 4), ("b", 4)]));
}

#[test]
fn the_newest_running_request_is_preempted_when_kv_runs_out() {
    // 4 usable blocks of 4 tokens; two 7-token prompts take 2 blocks each
    let mut e = engine(|_, kv| *kv = (5, 4));
    add(&mut e, "old", vec![5; 7], None);
    add(&mut e, "new", vec![6; 7], None);
    let p1 = plan(&mut e);
    assert_eq!(p1, s(&[("old", 7), ("new", 7)]));
    finish(&mut e, &p1); // 8 tokens each, 7 computed
    let p2 = plan(&mut e);
    assert_eq!(
        p2,
        s(&[("old", 1), ("new", 1)]),
        "8 tokens still fit 2 blocks"
    );
    finish(&mut e, &p2); // 9 tokens each: the 9th needs a third block
    let p3 = plan(&mut e);
    assert_eq!(p3, s(&[("old", 1)]), "new was preempted to make room");
    let new = e.batch.requests.by_id("new").unwrap();
    assert_eq!(new.phase, Phase::Waiting);
    assert_eq!(new.num_computed, 0);
    assert_eq!(new.num_preemptions, 1);
    assert!(
        new.pending_events
            .iter()
            .any(|ev| ev.kind == EventType::Preempted)
    );
    assert!(new.seq < 0, "back at the front of the queue");
    assert_eq!(e.batch.running, vec![e.batch.requests.slot("old").unwrap()]);
}

#[test]
fn a_request_is_admitted_only_when_its_whole_sequence_fits() {
    // 6 usable blocks of 4 tokens, budget 8: a 20-token prompt needs 5 blocks, though its
    // first chunk needs only 2 (vLLM's `scheduler_reserve_full_isl`)
    let mut e = engine(|c, kv| {
        *kv = (7, 4);
        c.max_num_batched_tokens = 8;
    });
    add(&mut e, "a", vec![5; 8], None);
    let p1 = plan(&mut e);
    assert_eq!(p1, s(&[("a", 8)]));
    finish(&mut e, &p1); // a holds 3 blocks (9 tokens): 3 are free
    add(&mut e, "long", vec![6; 20], None);
    let p2 = plan(&mut e);
    assert_eq!(
        p2,
        s(&[("a", 1)]),
        "long's first chunk would fit, its whole prompt does not"
    );
    assert_eq!(
        e.batch.requests.by_id("long").unwrap().phase,
        Phase::Waiting
    );
    // a short request behind it waits too: the head of the queue blocks the rest (FCFS)
    add(&mut e, "short", vec![7; 4], None);
    finish(&mut e, &p2);
    assert_eq!(plan(&mut e), s(&[("a", 1)]));
}

#[test]
fn a_repeated_prompt_hits_the_prefix_cache() {
    let mut e = engine(|_, _| {});
    let prompt: Vec<u32> = (0..40).collect();
    add(&mut e, "first", prompt.clone(), None);
    let p = plan(&mut e);
    assert_eq!(p, s(&[("first", 40)]));
    assert_eq!(
        (e.batch.prefix_delta.queries, e.batch.prefix_delta.hits),
        (40, 0)
    );
    finish(&mut e, &p);
    e.batch.remove("first");
    e.batch.prefix_delta = Default::default();
    add(&mut e, "second", prompt, None);
    // 2 full blocks (32 tokens) are cached; the rest is computed
    assert_eq!(plan(&mut e), s(&[("second", 8)]));
    assert_eq!(
        (e.batch.prefix_delta.queries, e.batch.prefix_delta.hits),
        (40, 32)
    );
    assert_eq!(e.batch.requests.by_id("second").unwrap().cached_tokens, 32);
}

#[test]
fn at_least_one_token_is_always_computed() {
    let mut e = engine(|_, _| {});
    let prompt: Vec<u32> = (0..32).collect();
    add(&mut e, "a", prompt.clone(), None);
    let p = plan(&mut e);
    finish(&mut e, &p);
    e.batch.remove("a");
    add(&mut e, "b", prompt, None);
    // a 32-token prompt can hit at most 31 tokens: one block (16)
    assert_eq!(plan(&mut e), s(&[("b", 16)]));
}

#[test]
fn max_loras_limits_distinct_adapters_in_the_batch() {
    let mut e = engine(|c, _| c.max_loras = 1);
    add(&mut e, "l1", vec![5; 4], Some(1));
    add(&mut e, "l2", vec![5; 4], Some(2));
    add(&mut e, "base", vec![5; 4], None);
    add(&mut e, "l1b", vec![5; 4], Some(1));
    assert_eq!(plan(&mut e), s(&[("l1", 4), ("base", 4), ("l1b", 4)]));
    let waiting: Vec<&str> = e
        .batch
        .waiting
        .values()
        .map(|s| e.batch.requests.get(*s).unwrap().id.as_str())
        .collect();
    assert_eq!(waiting, ["l2"]);
    assert_eq!(
        e.batch.skipped_waiting, 1,
        "reported as deferred, not waiting for capacity"
    );
}

#[test]
fn a_prompt_evicted_from_the_device_is_loaded_from_the_offload_tier() {
    use crate::play::engine::offload::{OffloadConfig, OffloadPolicy, OffloadTier};
    use std::time::Duration;
    // 4 usable device blocks of 16 tokens; a 16-block tier, 1 ms per loaded block
    let mut e = engine(|_, kv| kv.0 = 5);
    e.batch.set_offload(OffloadTier::new(OffloadConfig {
        blocks: 16,
        policy: OffloadPolicy::Lru,
        load_per_block: Duration::from_millis(1),
        block_bytes: 1000,
        connector_stats: false,
    }));
    let a: Vec<u32> = (3..35).collect(); // two full blocks
    add(&mut e, "a", a.clone(), None);
    let p = plan(&mut e);
    assert_eq!(p, s(&[("a", 32)]));
    finish(&mut e, &p);
    e.batch.remove("a");
    // b takes every device block: a's cached blocks leave the device
    add(&mut e, "b", (100..164).collect(), None);
    let p = plan(&mut e);
    assert_eq!(p, s(&[("b", 64)]));
    finish(&mut e, &p);
    e.batch.remove("b");
    add(&mut e, "a2", a, None);
    let step = e.batch.compose(&e.rules, Instant::now()).unwrap();
    // the whole prompt is loaded (2 blocks, 2 ms); its last token is computed again
    assert_eq!(step.load_time, Duration::from_millis(2));
    assert_eq!(step.scheduled.len(), 1);
    assert_eq!(step.scheduled[0].1, 1);
    let r = e.batch.get("a2").unwrap();
    assert_eq!((r.cached_tokens, r.external_cached_tokens), (32, 32));
    // the device found nothing for a2; the connector's stats have the tier's hit
    let (_, device) = e.batch.take_stats();
    assert_eq!((device.queries, device.hits), (32 + 64 + 32, 0));
    let tier = e.batch.take_offload_stats().unwrap();
    assert_eq!(
        (
            tier.lookups.requests,
            tier.lookups.queries,
            tier.lookups.hits
        ),
        (3, 128, 32)
    );
    assert_eq!(tier.loaded_blocks, 2);
}

#[test]
fn device_hits_are_offered_to_the_offload_tier_when_nothing_is_loaded() {
    use crate::play::engine::offload::{OffloadConfig, OffloadPolicy, OffloadTier};
    use std::time::Duration;
    // a 2-block tier behind a large device cache
    let mut e = engine(|_, _| {});
    e.batch.set_offload(OffloadTier::new(OffloadConfig {
        blocks: 2,
        policy: OffloadPolicy::Lru,
        load_per_block: Duration::ZERO,
        block_bytes: 1000,
        connector_stats: false,
    }));
    let a: Vec<u32> = (3..35).collect();
    for (id, prompt) in [("a", a.clone()), ("b", (100..132).collect()), ("a2", a)] {
        add(&mut e, id, prompt, None);
        let p = plan(&mut e);
        finish(&mut e, &p);
        e.batch.remove(id);
    }
    // b's blocks pushed a's out of the tier; a2 hit its first block on the device, found
    // nothing to load, and stored both blocks again (the hit one included)
    let s = e.batch.take_offload_stats().unwrap();
    assert_eq!(
        (s.stored_blocks, s.evicted_blocks, s.loaded_blocks),
        (6, 4, 0)
    );
    assert_eq!((s.lookups.queries, s.lookups.hits), (32 + 32 + 16, 0));
}
