//! Prefix-cache block hashes, computed exactly as vLLM computes them by default.
//!
//! vLLM (`vllm/v1/core/kv_cache_utils.py::hash_block_tokens`, default
//! `--prefix-caching-hash-algo sha256`) hashes each full block as
//! `sha256(pickle.dumps((parent_hash, tuple(block_token_ids), extra_keys), protocol=5))`,
//! chained through the parent block's hash; the first block's parent is `NONE_HASH =
//! sha256(pickle.dumps("vllm-none-hash"))` (or of `$PYTHONHASHSEED` when that is set).
//! Reproducing the bytes lets a real consumer of KV events match our hashes to its own.
//! Extra keys cover LoRA (`("lora", name, path)`) and the cache salt on the first block
//! (`("cache_salt", salt)`); multimodal and prompt-embedding keys are not reproduced.

use sha2::{Digest, Sha256};

pub type BlockHash = [u8; 32];

/// One extra key of a block, as vLLM tags them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtraKey {
    Lora { name: String, path: String },
    CacheSalt(String),
}

/// A minimal pickle (protocol 5) writer for the few shapes vLLM hashes.
struct Pickle {
    body: Vec<u8>,
}

impl Pickle {
    fn new() -> Self {
        Self::with_capacity(128)
    }

    /// A writer with room for `bytes` of body, so that a block's ints never regrow it.
    fn with_capacity(bytes: usize) -> Self {
        Self {
            body: Vec::with_capacity(bytes),
        }
    }

    fn str(&mut self, s: &str) {
        let b = s.as_bytes();
        if b.len() < 256 {
            self.body.push(0x8c); // SHORT_BINUNICODE
            self.body.push(b.len() as u8);
        } else {
            self.body.push(0x58); // BINUNICODE
            self.body.extend_from_slice(&(b.len() as u32).to_le_bytes());
        }
        self.body.extend_from_slice(b);
        self.body.push(0x94); // MEMOIZE
    }

    fn bytes(&mut self, b: &[u8]) {
        if b.len() < 256 {
            self.body.push(0x43); // SHORT_BINBYTES
            self.body.push(b.len() as u8);
        } else {
            self.body.push(0x42); // BINBYTES
            self.body.extend_from_slice(&(b.len() as u32).to_le_bytes());
        }
        self.body.extend_from_slice(b);
        self.body.push(0x94);
    }

    fn int(&mut self, v: u64) {
        if v < 256 {
            self.body.extend_from_slice(&[0x4b, v as u8]); // BININT1
        } else if v < 65536 {
            self.body.push(0x4d); // BININT2
            self.body.extend_from_slice(&(v as u16).to_le_bytes());
        } else if v < (1 << 31) {
            self.body.push(0x4a); // BININT
            self.body.extend_from_slice(&(v as u32).to_le_bytes());
        } else {
            // LONG1: minimal little-endian two's complement
            let mut bytes = v.to_le_bytes().to_vec();
            while bytes.len() > 1
                && bytes[bytes.len() - 1] == 0
                && bytes[bytes.len() - 2] & 0x80 == 0
            {
                bytes.pop();
            }
            if bytes[bytes.len() - 1] & 0x80 != 0 {
                bytes.push(0);
            }
            self.body.push(0x8a);
            self.body.push(bytes.len() as u8);
            self.body.extend_from_slice(&bytes);
        }
    }

    fn none(&mut self) {
        self.body.push(0x4e);
    }

    /// Close a tuple of `n` items written since `mark` (for n > 3).
    fn tuple_end(&mut self, n: usize) {
        match n {
            1 => self.body.push(0x85),
            2 => self.body.push(0x86),
            3 => self.body.push(0x87),
            _ => self.body.push(0x74), // TUPLE (after a MARK)
        }
        self.body.push(0x94);
    }

    fn tuple_start(&mut self, n: usize) {
        if n > 3 {
            self.body.push(0x28); // MARK
        }
    }

    /// The protocol header (PROTO 5, and a FRAME of the body's length once it has 4 bytes)
    /// and the body with its STOP: the pickle is the two back to back.
    fn header_and_body(mut self) -> (([u8; 11], usize), Vec<u8>) {
        self.body.push(0x2e); // STOP
        let mut head = [0u8; 11];
        head[..2].copy_from_slice(&[0x80, 0x05]);
        let mut n = 2;
        if self.body.len() >= 4 {
            head[2] = 0x95; // FRAME
            head[3..11].copy_from_slice(&(self.body.len() as u64).to_le_bytes());
            n = 11;
        }
        ((head, n), self.body)
    }

    #[cfg(test)]
    fn finish(self) -> Vec<u8> {
        let ((head, n), body) = self.header_and_body();
        [&head[..n], &body].concat()
    }

    /// SHA-256 of the pickle, fed in two parts rather than copied into one.
    fn sha256(self) -> BlockHash {
        let ((head, n), body) = self.header_and_body();
        let mut h = Sha256::new();
        h.update(&head[..n]);
        h.update(&body);
        h.finalize().into()
    }
}

/// vLLM's `NONE_HASH` for a seed (`"vllm-none-hash"` unless `$PYTHONHASHSEED` is set).
pub fn none_hash(seed: &str) -> BlockHash {
    let mut p = Pickle::new();
    p.str(seed);
    p.sha256()
}

/// The seed vLLM uses for `NONE_HASH` with the default sha256 algorithm.
pub fn default_none_hash() -> BlockHash {
    let seed = std::env::var("PYTHONHASHSEED").unwrap_or_else(|_| "vllm-none-hash".to_string());
    none_hash(&seed)
}

/// `hash_block_tokens(sha256, parent, tokens, extra_keys)`.
pub fn hash_block(parent: &BlockHash, tokens: &[u32], extra: &[ExtraKey]) -> BlockHash {
    // the parent (35 bytes with its opcodes), at most 5 bytes a token, tuples and extras
    let mut p = Pickle::with_capacity(64 + 5 * tokens.len());
    p.tuple_start(3);
    p.bytes(parent);
    p.tuple_start(tokens.len());
    for t in tokens {
        p.int(u64::from(*t));
    }
    p.tuple_end(tokens.len());
    if extra.is_empty() {
        p.none();
    } else {
        p.tuple_start(extra.len());
        for k in extra {
            match k {
                ExtraKey::Lora { name, path } => {
                    p.str("lora");
                    p.str(name);
                    p.str(path);
                    p.tuple_end(3);
                }
                ExtraKey::CacheSalt(salt) => {
                    p.str("cache_salt");
                    p.str(salt);
                    p.tuple_end(2);
                }
            }
        }
        p.tuple_end(extra.len());
    }
    p.tuple_end(3);
    p.sha256()
}

/// The 64-bit form KV events carry (`int.from_bytes(hash, "big") & (2**64 - 1)`).
pub fn hash_u64(h: &BlockHash) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&h[24..]);
    u64::from_be_bytes(b)
}

/// Chained hashes of every full block of `tokens`.
pub fn chain(
    none: &BlockHash,
    tokens: &[u32],
    block_size: usize,
    lora: Option<&ExtraKey>,
    cache_salt: Option<&str>,
) -> Vec<BlockHash> {
    let mut out: Vec<BlockHash> = Vec::with_capacity(tokens.len() / block_size.max(1));
    for (i, block) in tokens.chunks_exact(block_size.max(1)).enumerate() {
        let mut extra = Vec::new();
        if let Some(l) = lora {
            extra.push(l.clone());
        }
        if i == 0
            && let Some(s) = cache_salt.filter(|s| !s.is_empty())
        {
            extra.push(ExtraKey::CacheSalt(s.to_string()));
        }
        let parent = out.last().unwrap_or(none);
        out.push(hash_block(parent, block, &extra));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    // Expected values produced with CPython 3.11:
    //   none = sha256(pickle.dumps("vllm-none-hash", protocol=5))
    //   h1 = sha256(pickle.dumps((none, tuple(range(16)), None), protocol=5))
    #[test]
    fn matches_python_pickle_sha256() {
        let none = none_hash("vllm-none-hash");
        let mut p = Pickle::new();
        p.str("vllm-none-hash");
        assert_eq!(
            hex(&p.finish()),
            "80059512000000000000008c0e766c6c6d2d6e6f6e652d68617368942e"
        );
        let tokens: Vec<u32> = (0..16).collect();
        let h1 = hash_block(&none, &tokens, &[]);
        assert_eq!(
            hex(&h1),
            "fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798"
        );
        // every int width pickle uses
        let wide = [
            300,
            70000,
            3,
            1 << 31,
            1 << 31,
            255,
            256,
            65535,
            65536,
            0,
            1,
            2,
            3,
            4,
            5,
            6,
        ];
        let h2 = hash_block(&h1, &wide, &[]);
        assert_eq!(
            hex(&h2),
            "5a6d6bc6e7079c8ec3629815584e6f3b9c2bafaad7c6380aef5437a62fb72fc7"
        );
        // sha256(pickle.dumps((none, tuple(range(16)),
        //     (("lora", "l1", "/p"), ("cache_salt", "s"))), protocol=5))
        let extra = [
            ExtraKey::Lora {
                name: "l1".into(),
                path: "/p".into(),
            },
            ExtraKey::CacheSalt("s".into()),
        ];
        assert_eq!(
            hex(&hash_block(&none, &tokens, &extra)),
            "96ef76bc04ee2d995f28c218f91ec8d2e765a0e2aa683d306b90af7eaf2e6bfd"
        );
        let mut p = Pickle::new();
        p.int(1 << 40);
        assert_eq!(hex(&p.body), "8a06000000000001");
        let mut p = Pickle::new();
        p.int(1 << 31);
        assert_eq!(hex(&p.body), "8a050000008000");
    }

    #[test]
    fn pickles_small_tuples_and_extra_keys_like_python() {
        let none = none_hash("vllm-none-hash");
        // pickle.dumps((none, (1, 2), None), protocol=5)
        let mut p = Pickle::new();
        p.tuple_start(3);
        p.bytes(&none);
        p.tuple_start(2);
        p.int(1);
        p.int(2);
        p.tuple_end(2);
        p.none();
        p.tuple_end(3);
        assert_eq!(
            hex(&p.finish()),
            "8005952d000000000000004320066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198944b014b0286944e87942e"
        );
    }

    #[test]
    fn chains_full_blocks_only() {
        let none = default_none_hash();
        let toks: Vec<u32> = (0..40).collect();
        let c = chain(&none, &toks, 16, None, None);
        assert_eq!(c.len(), 2);
        assert_eq!(c[1], hash_block(&c[0], &toks[16..32], &[]));
        // a salt changes the first block and so every later one
        let salted = chain(&none, &toks, 16, None, Some("s"));
        assert_ne!(salted[0], c[0]);
        assert_ne!(salted[1], c[1]);
        let lora = ExtraKey::Lora {
            name: "l1".into(),
            path: "/p".into(),
        };
        assert_ne!(chain(&none, &toks, 16, Some(&lora), None)[0], c[0]);
        assert_eq!(
            hash_u64(&c[0]),
            u64::from_be_bytes(c[0][24..].try_into().unwrap())
        );
    }
}
