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
//!
//! **Keyed hashes.** Where no one reads the hashes' values — the run writes no records
//! with block hashes (`--dump-trace`), and an offline engine publishes no KV events — the
//! prefix cache only compares them: a block named by a trace id is then keyed by a
//! SHA-256 of its parent's hash and the id ([`keyed`], one compression) instead of vLLM's
//! hash of its pickled tokens (a 512-token block is ~30 compressions and its pickle). Two
//! blocks are equal under the key exactly when their synthesized tokens are (same parent,
//! same id, same ids drawn), so every cache hit, eviction and routing decision is the
//! same, and no block named by an id needs its tokens at all. The blocks the engine
//! hashes itself (a request's own blocks, the partial last one with the output after it)
//! keep vLLM's hash, chained from these.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::ops::Range;

use rustc_hash::FxHasher;

use sha2::{Digest, Sha256};

use super::workload::PlanRef;
use crate::play::engine::block_hash::{BlockHash, hash_block};

/// Entries per generation (~0.6 MiB each): a memo of twice 16,384 measured as fast on the
/// ×10 Mooncake-shaped trace and held 5 MiB more at its peak.
const GENERATION: usize = 1 << 12;

type Memo = HashMap<(BlockHash, u64), BlockHash, BuildHasherDefault<FxHasher>>;

/// The memo of block hashes, for one engine's hash chain root and block size.
pub struct PromptHashes {
    root: BlockHash,
    block_size: usize,
    /// Blocks named by a trace id get [`keyed`] hashes (see the module docs).
    keyed: bool,
    young: Memo,
    old: Memo,
}

impl PromptHashes {
    /// Chains start at `root` (the engine's `NONE_HASH`), blocks are `block_size` tokens.
    /// `keyed`: no one reads the hashes' values, only compares them (see the module docs).
    pub fn new(root: BlockHash, block_size: usize, keyed: bool) -> Self {
        Self {
            root,
            block_size: block_size.max(1),
            keyed,
            young: Memo::default(),
            old: Memo::default(),
        }
    }

    /// The engine's hashes of the complete blocks of `prompt` (a prompt already built),
    /// whose blocks `k < ids.len()`
    /// are the ones trace id `ids[k]` names (equal ids, equal tokens); the blocks past
    /// them are the request's own and are hashed without the memo.
    #[cfg(test)]
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

    /// A request's synthesized prompt ([`PlanRef::prompt`], `vocab` its id range) and
    /// the engine's hashes of its complete blocks ([`Self::of`]), built together: a block
    /// whose hash the memo holds is not synthesized when `placeholders` is set, its ids
    /// left 0. For a driver whose engine reads a prompt's ids only to hash its blocks
    /// (prompts it is told are synthesized, the random token source, no replay matched by
    /// prompt): those blocks come hashed, and what the engine hashes itself (blocks past
    /// the trace's ids, the partial last block with the output after it) is synthesized.
    /// A conversation turn resends every earlier block; each was drawn once.
    pub fn prompt_and_hashes(
        &mut self,
        plan: PlanRef,
        vocab: &Range<u32>,
        placeholders: bool,
    ) -> (Vec<u32>, Vec<BlockHash>) {
        let bs = self.block_size;
        let len = plan.plan.prompt_tokens.max(1) as usize;
        let ids = plan.hashes;
        let full = len / bs;
        let mut prompt: Vec<u32> = Vec::with_capacity(len);
        let mut out: Vec<BlockHash> = Vec::with_capacity(full);
        for k in 0..len.div_ceil(bs) {
            let parent = out.last().copied().unwrap_or(self.root);
            let id = ids.get(k).filter(|_| k < full);
            if let Some(&id) = id
                && let Some(h) = self.remembered(parent, id)
            {
                if placeholders {
                    prompt.resize(prompt.len() + bs, 0);
                } else {
                    plan.push_block(k, vocab, false, &mut prompt);
                }
                out.push(h);
                continue;
            }
            if let Some(&id) = id
                && self.keyed
            {
                let h = keyed(&parent, id);
                if placeholders {
                    prompt.resize(prompt.len() + bs, 0);
                } else {
                    plan.push_block(k, vocab, false, &mut prompt);
                }
                self.remember(parent, id, h);
                out.push(h);
                continue;
            }
            plan.push_block(k, vocab, false, &mut prompt);
            if k < full {
                let h = hash_block(&parent, &prompt[k * bs..(k + 1) * bs], &[]);
                if let Some(&id) = id {
                    self.remember(parent, id, h);
                }
                out.push(h);
            }
        }
        (prompt, out)
    }

    #[cfg(test)]
    fn memoized(&mut self, parent: BlockHash, id: u64, block: &[u32]) -> BlockHash {
        if let Some(h) = self.remembered(parent, id) {
            return h;
        }
        let h = hash_block(&parent, block, &[]);
        self.remember(parent, id, h);
        h
    }

    /// The memo's hash of block `id` after `parent`; one found in the older generation
    /// moves to the younger.
    fn remembered(&mut self, parent: BlockHash, id: u64) -> Option<BlockHash> {
        let key = (parent, id);
        if let Some(h) = self.young.get(&key) {
            return Some(*h);
        }
        let h = self.old.remove(&key)?;
        self.remember(parent, id, h);
        Some(h)
    }

    fn remember(&mut self, parent: BlockHash, id: u64, h: BlockHash) {
        if self.young.len() >= GENERATION {
            self.old = std::mem::take(&mut self.young);
        }
        self.young.insert((parent, id), h);
    }
}

/// The key of the block trace id `id` names after `parent` (see the module docs): the
/// SHA-256 of a tag, the parent hash and the id, 48 bytes (one compression). The tag keeps
/// it apart from any pickle vLLM's hash reads, which opens with PROTO 5 (`80 05`).
fn keyed(parent: &BlockHash, id: u64) -> BlockHash {
    let mut h = Sha256::new();
    h.update(b"vcr-tid\0");
    h.update(parent);
    h.update(id.to_le_bytes());
    h.finalize().into()
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
        let mut m = PromptHashes::new(root, 4, false);
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
        let mut m = PromptHashes::new(root, 1, false);
        for id in 0..(3 * GENERATION as u64) {
            m.of(&[id as u32], &[id]);
        }
        assert!(m.young.len() + m.old.len() <= 2 * GENERATION);
        assert_eq!(m.of(&[5], &[5]), direct(root, &[5], 1));
    }
}
