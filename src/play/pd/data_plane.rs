//! How a P/D pair moves KV bytes: the [`DataPlane`] a prefill engine publishes its blocks
//! on and a decode engine reads them through.
//!
//! - [`NoopDataPlane`] (every build): no bytes move. The decode engine tells the prefill
//!   engine it has read a request's blocks with one side-channel message (`vcr_read`, see
//!   `pd.rs`), and the transfer costs what the KV-transfer latency knobs say.
//! - `NixlDataPlane` (cargo feature `nixl`): each engine registers a paged KV pool with a
//!   NIXL agent. The prefill engine writes a pattern derived from the request and the
//!   block into a finished request's blocks and answers vLLM's side-channel handshake
//!   (`get_meta_msg`) with its agent metadata; the decode engine READs the advertised
//!   blocks into its own pool with NIXL, checks every byte, and the READ's completion
//!   notification (`"<request id>:1"`, vLLM's) tells the prefill engine to free them.
//!
//! The handshake payload is vLLM's (`handshake.rs`), so a vLLM decode engine loads this
//! engine's agent; with `--kv-peer-layout` (`layout.rs`) the pool is laid out as that
//! vLLM engine's KV cache (one region per layer) and the hash is the one it computes, and
//! a decode engine reads every region of a vLLM prefill engine's payload (its bytes are
//! the model's KV: digested and logged, not checked against a pattern).

use std::sync::Arc;

pub use super::handshake::{
    COMPATIBILITY_HASH, PeerPool, decode_handshake, encode_handshake, get_meta_msg,
    is_get_meta_msg, notification_request,
};
#[cfg(feature = "nixl")]
use super::layout::KvLayout;

/// One finished pull.
#[derive(Clone, Debug, PartialEq)]
pub struct PullStats {
    pub blocks: usize,
    /// Bytes moved (0 on the no-op plane).
    pub bytes: usize,
    /// Descriptors the READ moved: a block in every region (0 on the no-op plane).
    pub descriptors: usize,
    pub elapsed: std::time::Duration,
    /// A vLLM peer's bytes, which cannot be checked here: SHA-256 of what was read,
    /// region by region, block by block (`None`: every byte was checked, or none moved).
    pub digest: Option<String>,
}

/// The data plane of an engine; shared by the engine loop (publish), the side channel
/// (handshake) and the pulls (read), so every method takes `&self`.
pub trait DataPlane: Send + Sync + std::fmt::Debug {
    /// `noop` or `nixl`.
    fn name(&self) -> &'static str;

    /// Whether pulls move bytes (and the prefill engine frees blocks on the transfer's
    /// notification instead of a `vcr_read` message).
    fn moves_bytes(&self) -> bool {
        false
    }

    /// Prefill side: `blocks` now hold `request_id`'s KV.
    fn publish(&self, _request_id: &str, _blocks: &[usize]) -> Result<(), String> {
        Ok(())
    }

    /// Prefill side: the encoded handshake payload for a peer's `get_meta_msg`, if this
    /// plane has an agent to describe.
    fn handshake(&self) -> Option<Vec<u8>> {
        None
    }

    /// Prefill side: the `(reader agent, request id)` of every READ completed since the
    /// last call.
    fn take_read_notifications(&self) -> Vec<(String, String)> {
        Vec::new()
    }

    /// Decode side: the peer `address` (see [`DataPlane::read`]) was handshaken already.
    fn knows_peer(&self, _address: &str) -> bool {
        false
    }

    /// Decode side: READ `remote_blocks` of `remote_request_id` from the peer `address`
    /// (a key: its engine id at its side-channel address; described by `handshake` the
    /// first time), in every region, and verify every byte (a `play` peer) or digest them
    /// (a vLLM peer). Blocks.
    fn read(
        &self,
        _address: &str,
        _handshake: Option<&[u8]>,
        _remote_request_id: &str,
        remote_blocks: &[u64],
        _timeout: std::time::Duration,
    ) -> Result<PullStats, String> {
        Ok(PullStats {
            blocks: remote_blocks.len(),
            bytes: 0,
            descriptors: 0,
            elapsed: std::time::Duration::ZERO,
            digest: None,
        })
    }
}

/// No bytes move: the control plane alone.
#[derive(Debug, Default)]
pub struct NoopDataPlane;

impl DataPlane for NoopDataPlane {
    fn name(&self) -> &'static str {
        "noop"
    }
}

/// The plane for an engine: NIXL for a prefill or decode engine of a `nixl` build (when
/// the runtime starts; otherwise said once, and no-op), no-op otherwise. `block_size` is
/// the engine's tokens per block.
pub fn for_engine(
    pd: &crate::play::pd::PdConfig,
    num_blocks: u64,
    block_size: u64,
) -> Arc<dyn DataPlane> {
    if pd.role == crate::play::pd::PdRole::Both {
        return Arc::new(NoopDataPlane);
    }
    #[cfg(feature = "nixl")]
    {
        let layout = pd.peer_layout.as_ref();
        let regions = layout.map_or(1, KvLayout::regions);
        let block_bytes = layout.map_or(pd.block_bytes, KvLayout::block_bytes);
        let engine_id = pd.engine_id.as_str();
        match nixl_plane::NixlDataPlane::start(
            engine_id,
            regions,
            num_blocks,
            block_bytes,
            block_size,
            layout,
        ) {
            Ok(p) => {
                tracing::info!(
                    engine_id,
                    regions,
                    blocks = num_blocks,
                    block_bytes,
                    compatibility_hash = %layout.map_or(COMPATIBILITY_HASH.to_string(), KvLayout::compatibility_hash),
                    "NIXL data plane: KV pool registered"
                );
                return Arc::new(p);
            }
            Err(e) => {
                tracing::warn!(
                    "NIXL could not start ({e:#}): KV moves on the control plane only (no bytes)"
                );
            }
        }
    }
    #[cfg(not(feature = "nixl"))]
    let _ = (num_blocks, block_size);
    Arc::new(NoopDataPlane)
}

#[cfg(feature = "nixl")]
mod nixl_plane {
    use std::collections::HashMap;
    use std::sync::Mutex;
    use std::time::Duration;

    use anyhow::Result;

    use super::{DataPlane, KvLayout, PeerPool, PullStats};
    use crate::play::pd::nixl::{NixlPool, PoolInfo};

    /// A KV pool registered with a NIXL agent (see the module doc).
    pub struct NixlDataPlane {
        engine_id: String,
        /// With `--kv-peer-layout`: the hash a vLLM peer must send (vLLM checks ours
        /// the same way before loading this engine's agent).
        expected_hash: Option<String>,
        pool: Mutex<NixlPool>,
        handshake: Vec<u8>,
        /// Free blocks of this pool a pull may read into.
        landing: Mutex<Vec<usize>>,
        /// Peers handshaken, by side-channel address, and whether each writes
        /// `play`'s pattern (else it is vLLM, whose bytes are digested).
        peers: Mutex<HashMap<String, (PoolInfo, bool)>>,
    }

    impl std::fmt::Debug for NixlDataPlane {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("NixlDataPlane")
                .field("engine_id", &self.engine_id)
                .finish()
        }
    }

    impl NixlDataPlane {
        /// Register a pool of `regions × num_blocks × block_bytes` bytes and prepare the
        /// handshake that describes it (as `layout`'s vLLM engine would, when given).
        pub fn start(
            engine_id: &str,
            regions: usize,
            num_blocks: u64,
            block_bytes: u64,
            block_size: u64,
            layout: Option<&KvLayout>,
        ) -> Result<Self> {
            let total = num_blocks
                .saturating_mul(block_bytes)
                .saturating_mul(regions as u64);
            anyhow::ensure!(
                total <= 16 << 30,
                "a KV pool of {regions} region(s) of {num_blocks} blocks of {block_bytes} bytes is over 16 GiB: lower --num-gpu-blocks (or --kv-block-bytes)"
            );
            let pool = NixlPool::with_regions(
                &format!("{engine_id}-{}", std::process::id()),
                regions,
                num_blocks as usize,
                block_bytes as usize,
            )?;
            let info = pool.info()?;
            let handshake = super::encode_handshake(
                &PeerPool {
                    engine_id: engine_id.to_string(),
                    agent_metadata: info.metadata.clone(),
                    region_addrs: info.region_addrs.iter().map(|&a| a as u64).collect(),
                    num_blocks,
                    block_bytes,
                    compatibility_hash: String::new(),
                    vcr_pattern: true,
                },
                block_size,
                layout,
            );
            Ok(Self {
                engine_id: engine_id.to_string(),
                expected_hash: layout.map(KvLayout::compatibility_hash),
                // block 0 is vLLM's null block: never a landing block
                landing: Mutex::new((1..num_blocks as usize).rev().collect()),
                pool: Mutex::new(pool),
                handshake,
                peers: Mutex::new(HashMap::new()),
            })
        }
    }

    fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|e| e.into_inner())
    }

    impl DataPlane for NixlDataPlane {
        fn name(&self) -> &'static str {
            "nixl"
        }

        fn moves_bytes(&self) -> bool {
            true
        }

        fn publish(&self, request_id: &str, blocks: &[usize]) -> Result<(), String> {
            lock(&self.pool)
                .fill(request_id, blocks)
                .map_err(|e| format!("{e:#}"))
        }

        fn handshake(&self) -> Option<Vec<u8>> {
            Some(self.handshake.clone())
        }

        fn take_read_notifications(&self) -> Vec<(String, String)> {
            match lock(&self.pool).take_notifications() {
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!("NIXL: reading notifications: {e:#}");
                    Vec::new()
                }
            }
        }

        fn knows_peer(&self, address: &str) -> bool {
            lock(&self.peers).contains_key(address)
        }

        fn read(
            &self,
            address: &str,
            handshake: Option<&[u8]>,
            remote_request_id: &str,
            remote_blocks: &[u64],
            timeout: Duration,
        ) -> Result<PullStats, String> {
            let (peer, vcr_pattern) = {
                let mut peers = lock(&self.peers);
                match (peers.get(address), handshake) {
                    (Some(p), _) => p.clone(),
                    (None, Some(h)) => {
                        let pool = super::decode_handshake(h)?;
                        if let Some(want) = &self.expected_hash
                            && !pool.vcr_pattern
                            && &pool.compatibility_hash != want
                        {
                            return Err(format!(
                                "NIXL compatibility hash mismatch: the prefill engine {} sent {}, --kv-peer-layout gives {want}",
                                pool.engine_id, pool.compatibility_hash
                            ));
                        }
                        let mut info = PoolInfo {
                            agent_name: String::new(),
                            metadata: pool.agent_metadata,
                            region_addrs: pool.region_addrs.iter().map(|&a| a as usize).collect(),
                            num_blocks: pool.num_blocks as usize,
                            block_bytes: pool.block_bytes as usize,
                        };
                        info.agent_name = lock(&self.pool)
                            .load_any_remote(&info)
                            .map_err(|e| format!("{e:#}"))?;
                        peers.insert(address.to_string(), (info.clone(), pool.vcr_pattern));
                        (info, pool.vcr_pattern)
                    }
                    (None, None) => return Err(format!("no handshake with {address} yet")),
                }
            };
            if let Some(&b) = remote_blocks.iter().find(|&&b| b >= peer.num_blocks as u64) {
                return Err(format!(
                    "block {b} is outside the prefill engine's pool ({} blocks)",
                    peer.num_blocks
                ));
            }
            let local: Vec<usize> = {
                let mut free = lock(&self.landing);
                if free.len() < remote_blocks.len() {
                    return Err(format!(
                        "{} blocks to read but only {} free in this engine's KV pool",
                        remote_blocks.len(),
                        free.len()
                    ));
                }
                let at = free.len() - remote_blocks.len();
                free.split_off(at)
            };
            let remote: Vec<usize> = remote_blocks.iter().map(|&b| b as usize).collect();
            let result = {
                let mut pool = lock(&self.pool);
                pool.read_blocks(&peer, &remote, &local, remote_request_id, timeout)
                    .and_then(|stats| {
                        let digest = if vcr_pattern {
                            pool.verify(remote_request_id, &local)?;
                            None
                        } else {
                            Some(pool.digest(&local)?)
                        };
                        Ok((stats, digest))
                    })
            };
            lock(&self.landing).extend(local.iter().copied());
            if result.is_err() {
                // a restarted prefill engine has a new agent: handshake again next time
                lock(&self.peers).remove(address);
            }
            let (stats, digest) = result.map_err(|e| format!("{e:#}"))?;
            let regions = lock(&self.pool).regions();
            Ok(PullStats {
                blocks: remote.len(),
                bytes: stats.bytes,
                descriptors: remote.len() * regions,
                elapsed: stats.elapsed,
                digest,
            })
        }
    }
}
