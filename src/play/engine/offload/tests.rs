//! The offload tier alone: stores, lookups, load cost, LRU and ARC eviction, its events
//! and its connector stats.

use super::*;

fn h(i: u8) -> BlockHash {
    [i; 32]
}

fn tier(blocks: usize, policy: OffloadPolicy) -> OffloadTier {
    let mut t = OffloadTier::new(OffloadConfig {
        blocks,
        policy,
        load_per_block: Duration::from_micros(50),
        block_bytes: 1000,
        connector_stats: false,
    });
    t.set_record_events(true);
    t
}

fn medium(e: &KvEvent) -> Option<&str> {
    match e {
        KvEvent::BlockStored { medium, .. } | KvEvent::BlockRemoved { medium, .. } => {
            medium.as_deref()
        }
        KvEvent::AllBlocksCleared => None,
    }
}

#[test]
fn stores_once_and_finds_the_prefix_run() {
    let mut t = tier(8, OffloadPolicy::Lru);
    t.store(1, &[h(1), h(2), h(3)]);
    t.store(2, &[h(1), h(2)]); // already there: reused, not stored again
    assert_eq!(t.len(), 3);
    assert_eq!(
        t.lookup(&[h(1), h(2), h(9), h(3)]),
        2,
        "stops at the first miss"
    );
    assert_eq!(t.lookup(&[h(9), h(1)]), 0);
    let ev = t.take_events();
    assert_eq!(ev.len(), 3, "one BlockStored per stored block: {ev:?}");
    for e in &ev {
        assert_eq!(medium(e), Some("CPU"));
        assert!(
            matches!(e, KvEvent::BlockStored { block_size: 0, token_ids, parent_block_hash: None, .. } if token_ids.is_empty())
        );
    }
    let s = t.take_stats();
    assert_eq!(s.stored_blocks, 3);
}

#[test]
fn a_load_costs_its_blocks_and_is_counted() {
    let mut t = tier(8, OffloadPolicy::Lru);
    t.store(1, &[h(1), h(2), h(3)]);
    t.finish(1);
    assert_eq!(t.load(2, &[h(1), h(2)]), Duration::from_micros(100));
    assert_eq!(t.load(3, &[]), Duration::ZERO);
    assert_eq!(t.take_stats().loaded_blocks, 2);
}

#[test]
fn lru_evicts_the_least_recent_idle_blocks_never_the_offer() {
    let mut t = tier(4, OffloadPolicy::Lru);
    t.store(1, &[h(1), h(2)]);
    t.finish(1);
    t.store(2, &[h(3), h(4)]);
    t.finish(2);
    // request 3 reuses block 1 (a hit): finishing makes it the most recent
    t.load(3, &[h(1)]);
    t.finish(3);
    t.take_events();
    // recency now (oldest first): 2 4 3 1 — a finished request's tail is older than
    // its head. Two new blocks: the two least recent go, not the reused block 1
    t.store(4, &[h(5), h(6)]);
    assert!(t.contains(&h(1)) && t.contains(&h(3)));
    assert!(!t.contains(&h(2)) && !t.contains(&h(4)));
    let ev = t.take_events();
    assert_eq!(
        ev[0],
        KvEvent::BlockRemoved {
            block_hashes: vec![hash_u64(&h(2)), hash_u64(&h(4))],
            medium: Some("CPU".into()),
            group_idx: Some(0),
        }
    );
    assert_eq!(ev.len(), 3, "the removal, then two stores");
    // an offer bigger than the tier cannot make room: dropped whole
    t.store(5, &[h(7), h(8), h(9), h(10), h(11)]);
    assert!(!t.contains(&h(7)));
    let s = t.take_stats();
    assert_eq!((s.evicted_blocks, s.allocation_failures), (2, 1));
}

#[test]
fn arc_keeps_reused_blocks_over_blocks_seen_once() {
    let mut t = tier(4, OffloadPolicy::Arc);
    t.store(1, &[h(1), h(2)]);
    t.finish(1);
    // blocks 1 and 2 are reused: they move to T2
    t.load(2, &[h(1), h(2)]);
    t.finish(2);
    t.store(3, &[h(3), h(4)]);
    t.finish(3);
    // a scan of new blocks evicts from T1 (seen once), not the reused T2 blocks
    t.store(4, &[h(5), h(6)]);
    assert!(t.contains(&h(1)) && t.contains(&h(2)), "T2 kept");
    assert!(!t.contains(&h(3)) && !t.contains(&h(4)), "T1 evicted");
    // LRU would have evicted the older blocks 1 and 2 instead
    let mut l = tier(4, OffloadPolicy::Lru);
    l.store(1, &[h(1), h(2)]);
    l.finish(1);
    l.store(3, &[h(3), h(4)]);
    l.finish(3);
    l.store(4, &[h(5), h(6)]);
    assert!(!l.contains(&h(1)) && l.contains(&h(3)));
}

#[test]
fn arc_ghost_hit_grows_the_recency_target() {
    let mut t = tier(2, OffloadPolicy::Arc);
    t.store(1, &[h(1)]);
    t.finish(1);
    t.store(2, &[h(2)]);
    t.finish(2);
    t.store(3, &[h(3)]); // evicts 1 into B1
    t.finish(3);
    let Policy::Arc(a) = &t.policy else {
        unreachable!()
    };
    assert!(a.b1.contains(&h(1)));
    assert_eq!(a.target_t1, 0.0);
    t.store(4, &[h(1)]); // a B1 ghost comes back
    let Policy::Arc(a) = &t.policy else {
        unreachable!()
    };
    assert_eq!(a.target_t1, 1.0);
    assert!(!a.b1.contains(&h(1)) && a.t1.contains(&h(1)));
}

#[test]
fn the_connector_stats_carry_bytes_sizes_and_load_time_as_vllm_names_them() {
    let mut t = tier(2, OffloadPolicy::Lru);
    assert_eq!(
        t.take_stats().kv_connector_stats(),
        None,
        "nothing happened"
    );
    t.store(1, &[h(1), h(2)]);
    t.finish(1);
    t.load(2, &[h(1)]);
    t.store(3, &[h(3), h(4), h(5)]); // cannot fit: an allocation failure
    let v = t.take_stats().kv_connector_stats().unwrap();
    let text = v.to_string();
    for (metric, kind, value) in [
        ("vllm:kv_offload_load_bytes", "counter", "1000"),
        ("vllm:kv_offload_load_time", "counter", "0.00005"),
        ("vllm:kv_offload_load_size", "histogram", "[1000]"),
        ("vllm:kv_offload_store_bytes", "counter", "2000"),
        ("vllm:kv_offload_store_size", "histogram", "[2000]"),
        ("vllm:kv_offload_allocation_failure", "counter", "1"),
    ] {
        assert!(
            text.contains(&format!("\"{metric}\": \"{kind}\""))
                && text.contains(&format!("\"{metric}\": {{[]: {value}}}")),
            "{metric}: {text}"
        );
    }
}

#[test]
fn reset_forgets_every_block() {
    let mut t = tier(4, OffloadPolicy::Lru);
    t.store(1, &[h(1)]);
    t.reset();
    assert!(t.is_empty());
    assert_eq!(t.lookup(&[h(1)]), 0);
}
