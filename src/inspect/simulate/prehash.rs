//! The engine's block hashes of the synthesized prompts, each distinct block hashed once.
//!
//! A synthesized block's tokens follow from its trace hash id alone (`Workload::prompt`),
//! so when the trace's blocks are the engine's blocks, the engine's hash of block k is a
//! function of its parent's hash and block k's trace id. Conversation turns resend every
//! earlier block of their conversation (60 % of the Mooncake conversation trace's
//! requests): each would otherwise cost the engine one pickle and one SHA-256 per block
//! again. The memo is keyed by (parent hash, trace id), so it is right whether or not the
//! trace's ids are themselves chained, and it is bounded: two generations of at most
//! [`GENERATION`] entries each, the older dropped when the younger fills (a recently used
//! entry found in the older one moves to the younger), so memory stays flat however long
//! the trace.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use rustc_hash::FxHasher;

use crate::play::engine::block_hash::{BlockHash, hash_block};

/// Entries per generation (~0.6 MiB each): a memo of twice 16,384 measured as fast on the
/// ×10 Mooncake-shaped trace and held 5 MiB more at its peak.
const GENERATION: usize = 1 << 12;

type Memo = HashMap<(BlockHash, u64), BlockHash, BuildHasherDefault<FxHasher>>;

/// The memo of block hashes, for one engine's hash chain root and block size.
pub struct PromptHashes {
    root: BlockHash,
    block_size: usize,
    young: Memo,
    old: Memo,
}

impl PromptHashes {
    /// Chains start at `root` (the engine's `NONE_HASH`), blocks are `block_size` tokens.
    pub fn new(root: BlockHash, block_size: usize) -> Self {
        Self {
            root,
            block_size: block_size.max(1),
            young: Memo::default(),
            old: Memo::default(),
        }
    }

    /// The engine's hashes of the complete blocks of `prompt`, whose blocks `k < ids.len()`
    /// are the ones trace id `ids[k]` names (equal ids, equal tokens); the blocks past
    /// them are the request's own and are hashed without the memo.
    pub fn of(&mut self, prompt: &[u32], ids: &[u64]) -> Vec<BlockHash> {
        let bs = self.block_size;
        let full = prompt.len() / bs;
        let mut out: Vec<BlockHash> = Vec::with_capacity(full);
        for k in 0..full {
            let parent = out.last().copied().unwrap_or(self.root);
            let block = &prompt[k * bs..(k + 1) * bs];
            let h = match ids.get(k) {
                Some(&id) => self.memoized(parent, id, block),
                None => hash_block(&parent, block, &[]),
            };
            out.push(h);
        }
        out
    }

    fn memoized(&mut self, parent: BlockHash, id: u64, block: &[u32]) -> BlockHash {
        let key = (parent, id);
        if let Some(h) = self.young.get(&key) {
            return *h;
        }
        let h = match self.old.remove(&key) {
            Some(h) => h,
            None => hash_block(&parent, block, &[]),
        };
        if self.young.len() >= GENERATION {
            self.old = std::mem::take(&mut self.young);
        }
        self.young.insert(key, h);
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::play::engine::block_hash::default_none_hash;

    /// What the engine computes without the memo.
    fn direct(root: BlockHash, prompt: &[u32], bs: usize) -> Vec<BlockHash> {
        let mut out: Vec<BlockHash> = Vec::new();
        for block in prompt.chunks_exact(bs) {
            let parent = out.last().copied().unwrap_or(root);
            out.push(hash_block(&parent, block, &[]));
        }
        out
    }

    #[test]
    fn memoized_hashes_are_the_engines_own() {
        let root = default_none_hash();
        let mut m = PromptHashes::new(root, 4);
        let a: Vec<u32> = (0..10).collect();
        // the same first block under the same id, then another block under another id
        let mut b: Vec<u32> = (0..4).collect();
        b.extend(20..29);
        assert_eq!(m.of(&a, &[7, 8]), direct(root, &a, 4));
        assert_eq!(
            m.of(&b, &[7, 9]),
            direct(root, &b, 4),
            "a third block without id"
        );
        assert_eq!(m.of(&a, &[7, 8]), direct(root, &a, 4), "found in the memo");
        assert_eq!(
            m.of(&a[..3], &[7]),
            Vec::<BlockHash>::new(),
            "no complete block"
        );
    }

    #[test]
    fn the_memo_stays_bounded() {
        let root = default_none_hash();
        let mut m = PromptHashes::new(root, 1);
        for id in 0..(3 * GENERATION as u64) {
            m.of(&[id as u32], &[id]);
        }
        assert!(m.young.len() + m.old.len() <= 2 * GENERATION);
        assert_eq!(m.of(&[5], &[5]), direct(root, &[5], 1));
    }
}
