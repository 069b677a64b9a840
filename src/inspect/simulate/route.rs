//! The router of a simulated fleet (`inspect simulate --engines N --route …`): which
//! engine each arriving request goes to, decided at its arrival on the virtual clock.
//!
//! `prefix-aware` routes on what each engine's prefix cache holds, the way llm-d's
//! scheduler does: it keeps its own view of every engine's cached blocks, fed by the
//! engine's cache events (a block stored, a block evicted, the cache cleared) in the
//! 64-bit form vLLM's KV events carry, and scores a prompt by its chained block hashes
//! (the engine's own hashing). A block computed by a request still in prefill is not in
//! the view until its step ends, as an event-fed router only learns of it then.

use std::cmp::Reverse;
use std::collections::HashSet;

use clap::ValueEnum;

use crate::play::engine::block_hash::hash_u64;
use crate::play::engine::kv_cache::PoolEvent;

/// How the fleet's router picks an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum Route {
    /// Each engine in turn, in arrival order.
    #[default]
    RoundRobin,
    /// The engine with the fewest requests in flight (waiting + running); ties to the
    /// lowest index.
    LeastLoaded,
    /// The engine whose prefix cache holds the most leading blocks of the prompt; ties
    /// to the fewest requests in flight, then the lowest index.
    PrefixAware,
    /// The lowest cost: the prompt blocks the engine would prefill (those its cache does
    /// not hold) plus the KV blocks its requests in flight hold of their own, as Dynamo's
    /// KV router weighs them; ties to the lowest index.
    KvAware,
}

impl Route {
    /// The flag's spelling (`round-robin`, …).
    pub fn name(self) -> &'static str {
        match self {
            Route::RoundRobin => "round-robin",
            Route::LeastLoaded => "least-loaded",
            Route::PrefixAware => "prefix-aware",
            Route::KvAware => "kv-aware",
        }
    }
}

/// How many engines serve the workload, and how the router picks one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fleet {
    pub engines: usize,
    pub route: Route,
}

impl Default for Fleet {
    /// One engine: what `play` runs.
    fn default() -> Self {
        Fleet {
            engines: 1,
            route: Route::RoundRobin,
        }
    }
}

/// The router's state: the next engine in turn, and (prefix-aware) each engine's cached
/// blocks as its events told them.
pub struct Router {
    route: Route,
    next: usize,
    cached: Vec<HashSet<u64>>,
}

impl Router {
    pub fn new(route: Route, engines: usize) -> Self {
        Self {
            route,
            next: 0,
            cached: vec![HashSet::new(); engines.max(1)],
        }
    }

    /// Whether the router follows the engines' cache events (the cache-aware routes).
    pub fn follows_cache(&self) -> bool {
        matches!(self.route, Route::PrefixAware | Route::KvAware)
    }

    /// Take in engine `e`'s cache events.
    pub fn observe(&mut self, e: usize, events: Vec<PoolEvent>) {
        let view = &mut self.cached[e];
        for ev in events {
            match ev {
                PoolEvent::Stored { hashes, .. } => view.extend(hashes.iter().map(hash_u64)),
                PoolEvent::Removed { hashes } => {
                    for h in &hashes {
                        view.remove(&hash_u64(h));
                    }
                }
                PoolEvent::AllCleared => view.clear(),
            }
        }
    }

    /// Leading blocks of a prompt (its chained hashes) engine `e` holds, as far as the
    /// router knows.
    pub fn cached_prefix(&self, e: usize, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.cached[e].contains(h))
            .count()
    }

    /// The engine for a request whose prompt has the chained block `hashes` (its full
    /// blocks) and takes `blocks` KV blocks in all, given each engine's load.
    pub fn pick(&mut self, hashes: &[u64], blocks: usize, load: &[Load]) -> usize {
        let n = load.len().max(1);
        match self.route {
            Route::RoundRobin => {
                let e = self.next % n;
                self.next = (e + 1) % n;
                e
            }
            Route::LeastLoaded => least(load, |e| load[e].requests),
            Route::PrefixAware => least(load, |e| {
                (Reverse(self.cached_prefix(e, hashes)), load[e].requests)
            }),
            Route::KvAware => least(load, |e| {
                blocks.saturating_sub(self.cached_prefix(e, hashes)) + load[e].blocks
            }),
        }
    }
}

/// What an engine has in flight, as the router counts it: what it sent there and has not
/// seen finish.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    pub requests: usize,
    /// KV blocks those requests take at their longest (prompt and every output token),
    /// less the prefix each found cached when it was sent: blocks of their own.
    pub blocks: usize,
}

/// The engine with the lowest key; ties to the lowest index.
fn least<K: Ord>(load: &[Load], key: impl Fn(usize) -> K) -> usize {
    (0..load.len()).min_by_key(|&e| key(e)).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hs: &[u8]) -> PoolEvent {
        PoolEvent::Stored {
            hashes: hs.iter().map(|&i| h(i)).collect(),
            parent: None,
            token_ids: Vec::new(),
            lora: None,
        }
    }

    fn h(i: u8) -> [u8; 32] {
        [i; 32]
    }

    fn u(i: u8) -> u64 {
        hash_u64(&h(i))
    }

    /// Engines with these requests in flight, each of 10 blocks.
    fn load(requests: &[usize]) -> Vec<Load> {
        requests
            .iter()
            .map(|&r| Load {
                requests: r,
                blocks: 10 * r,
            })
            .collect()
    }

    #[test]
    fn round_robin_takes_each_engine_in_turn() {
        let mut r = Router::new(Route::RoundRobin, 3);
        let got: Vec<usize> = (0..5).map(|_| r.pick(&[], 1, &load(&[9, 0, 0]))).collect();
        assert_eq!(got, vec![0, 1, 2, 0, 1]);
    }

    #[test]
    fn least_loaded_ties_to_the_lowest_index() {
        let mut r = Router::new(Route::LeastLoaded, 3);
        assert_eq!(r.pick(&[], 1, &load(&[2, 1, 1])), 1);
        assert_eq!(r.pick(&[], 1, &load(&[0, 0, 0])), 0);
    }

    #[test]
    fn prefix_aware_follows_stores_evictions_and_clears() {
        let mut r = Router::new(Route::PrefixAware, 2);
        r.observe(1, vec![stored(&[1, 2, 3])]);
        let prompt = [u(1), u(2), u(4)];
        // engine 1 holds two leading blocks: it wins though it is busier
        assert_eq!(r.pick(&prompt, 4, &load(&[0, 5])), 1);
        // a block that is not leading does not count
        r.observe(0, vec![stored(&[2, 4])]);
        assert_eq!(r.cached_prefix(0, &prompt), 0);
        // an eviction in the middle of the chain cuts the match there
        r.observe(1, vec![PoolEvent::Removed { hashes: vec![h(2)] }]);
        assert_eq!(r.cached_prefix(1, &prompt), 1);
        r.observe(0, vec![stored(&[1, 2])]);
        assert_eq!(r.pick(&prompt, 4, &load(&[3, 0])), 0);
        // nothing cached anywhere: the least loaded
        r.observe(0, vec![PoolEvent::AllCleared]);
        r.observe(1, vec![PoolEvent::AllCleared]);
        assert_eq!(r.pick(&prompt, 4, &load(&[3, 2])), 1);
    }

    #[test]
    fn kv_aware_weighs_the_blocks_to_prefill_against_the_blocks_in_flight() {
        let mut r = Router::new(Route::KvAware, 2);
        r.observe(0, vec![stored(&[1, 2, 3])]);
        let prompt = [u(1), u(2), u(3)];
        // engine 0 saves 3 of the 5 blocks: 2 + 10 against 5 + 0
        assert_eq!(r.pick(&prompt, 5, &load(&[1, 0])), 1);
        // with less in flight it keeps the request: 2 + 2 against 5 + 0
        let light = [
            Load {
                requests: 1,
                blocks: 2,
            },
            Load::default(),
        ];
        assert_eq!(r.pick(&prompt, 5, &light), 0);
    }
}
