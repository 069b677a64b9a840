//! The trie over the records' block-hash chains, and the choice among the records whose
//! chain ends at one node.
//!
//! A node is one prompt prefix of whole blocks. Edges are keyed by `(parent node, hash)`
//! rather than by the hash alone: the tap's hashes are chained, so the hash alone would
//! do, but keying by parent keeps the trie right for traces whose hashes are not.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::hash::{BuildHasherDefault, Hasher};

/// The root: the empty prefix.
const ROOT: u32 = 0;
/// No record (only the root has none).
const NONE: u32 = u32::MAX;

/// A multiply-rotate hasher for the edge keys. Block hashes are already uniformly
/// distributed, so SipHash's protection buys nothing and costs most of a lookup.
#[derive(Default)]
pub(super) struct EdgeHasher(u64);

impl EdgeHasher {
    fn add(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(26) ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

impl Hasher for EdgeHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.add(u64::from(b));
        }
    }

    fn write_u32(&mut self, v: u32) {
        self.add(u64::from(v));
    }

    fn write_u64(&mut self, v: u64) {
        self.add(v);
    }

    fn finish(&self) -> u64 {
        // fold the high bits down: the table indexes by the low bits
        self.0 ^ (self.0 >> 29)
    }
}

#[derive(Debug, Clone, Copy)]
struct Node {
    /// The earliest-arriving record through this node (the closest record of a miss).
    first_record: u32,
    /// This node's groups in `Trie::groups`: the records whose chain ends here.
    groups_start: u32,
    groups_end: u32,
}

/// Records ending at one node with one `prompt_tokens`, in arrival order.
#[derive(Debug, Clone, Copy)]
struct Group {
    prompt_tokens: u32,
    /// Range in `Trie::term`.
    start: u32,
    end: u32,
    /// Everything before it is consumed. Records are consumed in arrival order within a
    /// group (the choice always takes a group's first unconsumed one), so one cursor per
    /// group keeps repeated duplicates O(1) instead of a rescan per lookup.
    cursor: u32,
}

/// The prefix trie (see the module docs).
#[derive(Debug, Default)]
pub(super) struct Trie {
    edges: HashMap<(u32, u64), u32, BuildHasherDefault<EdgeHasher>>,
    nodes: Vec<Node>,
    groups: Vec<Group>,
    /// Record indices, grouped by (node, prompt_tokens), arrival order within a group.
    term: Vec<u32>,
    /// Records in the trie.
    pub(super) indexed: usize,
}

impl Trie {
    /// Build from `(record, chain, prompt_tokens)` in arrival order (records are numbered
    /// by arrival). Empty chains are skipped. `None` when the nodes overflow `u32`.
    pub(super) fn build<'a>(chains: impl Iterator<Item = (u32, &'a [u64], u32)>) -> Option<Self> {
        let mut t = Trie {
            nodes: vec![Node {
                first_record: NONE,
                groups_start: 0,
                groups_end: 0,
            }],
            ..Trie::default()
        };
        // (end node, prompt_tokens, record)
        let mut ends: Vec<(u32, u32, u32)> = Vec::new();
        for (rec, chain, prompt_tokens) in chains {
            if chain.is_empty() {
                continue;
            }
            let mut node = ROOT;
            for &h in chain {
                node = match t.edges.entry((node, h)) {
                    Entry::Occupied(e) => *e.get(),
                    Entry::Vacant(e) => {
                        let id = u32::try_from(t.nodes.len()).ok().filter(|&i| i != NONE)?;
                        // records come in arrival order: the creator arrived first
                        t.nodes.push(Node {
                            first_record: rec,
                            groups_start: 0,
                            groups_end: 0,
                        });
                        e.insert(id);
                        id
                    }
                };
            }
            ends.push((node, prompt_tokens, rec));
        }
        t.indexed = ends.len();
        ends.sort_unstable();
        t.term = ends.iter().map(|e| e.2).collect();
        for (i, &(node, prompt_tokens, _)) in ends.iter().enumerate() {
            let same = i > 0 && ends[i - 1].0 == node && ends[i - 1].1 == prompt_tokens;
            let i = i as u32;
            if same {
                t.groups.last_mut().expect("a group precedes").end = i + 1;
                continue;
            }
            let g = t.groups.len() as u32;
            let n = &mut t.nodes[node as usize];
            if n.groups_start == n.groups_end {
                n.groups_start = g;
            }
            n.groups_end = g + 1;
            t.groups.push(Group {
                prompt_tokens,
                start: i,
                end: i + 1,
                cursor: i,
            });
        }
        t.edges.shrink_to_fit();
        t.nodes.shrink_to_fit();
        t.groups.shrink_to_fit();
        Some(t)
    }

    /// Walk `hashes` from the root as far as they match: `(depth, node)`.
    pub(super) fn walk(&self, hashes: &[u64]) -> (usize, u32) {
        let mut node = ROOT;
        for (depth, &h) in hashes.iter().enumerate() {
            match self.edges.get(&(node, h)) {
                Some(&next) => node = next,
                None => return (depth, node),
            }
        }
        (hashes.len(), node)
    }

    /// The earliest-arriving record through `node` (none for the root).
    pub(super) fn closest(&self, node: u32) -> Option<usize> {
        let r = self.nodes[node as usize].first_record;
        (r != NONE).then_some(r as usize)
    }

    /// Choose among the records ending at `node`: unconsumed first, then equal
    /// `prompt_tokens`, then arrival; once all are consumed, the best of them again.
    /// `None` when no chain ends here.
    pub(super) fn select(
        &mut self,
        node: u32,
        prompt_tokens: u32,
        consumed: &[bool],
    ) -> Option<usize> {
        let n = self.nodes[node as usize];
        if n.groups_start == n.groups_end {
            return None;
        }
        let term = &self.term;
        let groups = &mut self.groups[n.groups_start as usize..n.groups_end as usize];
        for g in groups.iter_mut() {
            // index-mode lookups may have consumed records out of order: skip them too
            while g.cursor < g.end && consumed[term[g.cursor as usize] as usize] {
                g.cursor += 1;
            }
        }
        // groups of a node are sorted by prompt_tokens
        let eq = groups
            .binary_search_by_key(&prompt_tokens, |g| g.prompt_tokens)
            .ok()
            .map(|e| groups[e]);
        if let Some(g) = eq
            && g.cursor < g.end
        {
            return Some(term[g.cursor as usize] as usize);
        }
        let fresh = groups
            .iter()
            .filter(|g| g.cursor < g.end)
            .map(|g| term[g.cursor as usize])
            .min();
        if let Some(r) = fresh {
            return Some(r as usize);
        }
        let again = match eq {
            Some(g) => term[g.start as usize],
            None => groups.iter().map(|g| term[g.start as usize]).min()?,
        };
        Some(again as usize)
    }

    /// Approximate heap bytes.
    pub(super) fn memory_bytes(&self) -> usize {
        use std::mem::size_of;
        // hashbrown: one slot plus one control byte per bucket
        self.edges.capacity() * (size_of::<((u32, u64), u32)>() + 1)
            + self.nodes.capacity() * size_of::<Node>()
            + self.groups.capacity() * size_of::<Group>()
            + self.term.capacity() * 4
    }
}
