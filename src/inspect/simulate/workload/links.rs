//! Which earlier request each request of a workload continues (`--replay-sessions`): the
//! conversations of a capture, told from its records' block hashes, lengths and times.
//!
//! A turn of a conversation sends its parent's whole prompt, the parent's answer and a new
//! message, so its hashes start with the parent's chain and its prompt holds at least the
//! parent's prompt and output tokens; and a client sends it only once the answer is in, so
//! it arrives after the parent's recorded end. Prompts that open with the same system
//! prompt (or even the same first message) share their first blocks without one
//! continuing the other: a request that repeats an earlier prompt, or is too short to
//! hold it and its answer, or arrived before it finished, is not its turn.

use std::collections::HashMap;

use super::{Turn, Workload, duration_ms};

/// Of the requests with one chain, how many of the latest that no turn continues yet (and
/// of the latest that one does) a request looks at; older ones are passed over. Bounds the
/// work on a capture of many identical prompts that nothing continues.
const RECENT: usize = 64;

/// A recorded end may come out this much after the next turn's arrival, ms: times are
/// kept to the µs and an end is summed from every rounded inter-token gap.
const ROUNDING_MS: f64 = 0.1;

/// The earlier requests whose chain is one sequence of hashes.
struct Group {
    /// The chain's length.
    len: usize,
    /// A member, whose hashes tell the chain.
    first: u32,
    /// Members no turn continues yet, in arrival order.
    open: Vec<u32>,
    /// Members a turn continues, in the order they were taken.
    taken: Vec<u32>,
}

impl Workload {
    /// Every request's turn (`--replay-sessions`), in arrival order. A request's parent is,
    /// among the earlier requests it can continue (`Workload::continues`), one of those with
    /// the longest chain; of those, the earliest that no turn continues yet (conversations
    /// that opened alike are answered in the order they were asked), else the latest that
    /// one does (a second answer to the same question). None: a root.
    pub fn sessions(&self) -> Vec<Turn> {
        let mut groups: HashMap<u64, Group> = HashMap::new();
        let mut turns = Vec::with_capacity(self.reqs.len());
        for i in 0..self.reqs.len() {
            turns.push(match self.parent_of(i, &mut groups) {
                None => Turn::Root,
                Some(j) => {
                    let (parent, child) = (&self.reqs[j as usize], &self.reqs[i]);
                    match (parent.arrival_ms, parent.e2e_ms, child.arrival_ms) {
                        (Some(pa), Some(e2e), Some(ca)) => Turn::After {
                            parent: j,
                            gap: duration_ms(ca - pa - e2e),
                        },
                        _ => Turn::NotBefore { parent: j },
                    }
                }
            });
            let chain = self.chain_len(i);
            if chain > 0 {
                let g = groups
                    .entry(self.hashes(i)[chain - 1])
                    .or_insert_with(|| Group {
                        len: chain,
                        first: i as u32,
                        open: Vec::new(),
                        taken: Vec::new(),
                    });
                // (a 64-bit collision with a chain of another length joins nothing)
                if g.len == chain {
                    g.open.push(i as u32);
                }
            }
        }
        turns
    }

    /// Request `i`'s parent among the requests before it in `groups`, which it updates.
    fn parent_of(&self, i: usize, groups: &mut HashMap<u64, Group>) -> Option<u32> {
        let mine = self.hashes(i);
        for k in (1..=mine.len()).rev() {
            let Some(g) = groups.get_mut(&mine[k - 1]) else {
                continue;
            };
            if g.len != k || self.hashes(g.first as usize)[..k] != mine[..k] {
                continue;
            }
            let from = g.open.len().saturating_sub(RECENT);
            if let Some(at) = (from..g.open.len()).find(|&at| self.continues(i, g.open[at])) {
                let j = g.open.remove(at);
                g.taken.push(j);
                return Some(j);
            }
            let mut again = g.taken.iter().rev().take(RECENT);
            if let Some(&j) = again.find(|&&j| self.continues(i, j)) {
                return Some(j);
            }
        }
        None
    }

    /// Whether request `i` can be a next turn after request `j`, whose chain starts its
    /// hashes: its prompt holds `j`'s prompt and answer, and it arrived after `j` ended
    /// (when both times are recorded).
    fn continues(&self, i: usize, j: u32) -> bool {
        let (p, c) = (&self.reqs[j as usize], &self.reqs[i]);
        let holds =
            u64::from(c.prompt_tokens) >= u64::from(p.prompt_tokens) + u64::from(p.output_tokens);
        let after = match (p.recorded_end(), c.arrival_ms) {
            (Some(end), Some(ca)) => ca >= end - ROUNDING_MS,
            _ => true,
        };
        holds && after
    }
}
