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
//! The handshake payload is vLLM's (`NixlHandshakePayload` wrapping `NixlAgentMetadata`,
//! msgpack maps with the 0.33 keys), so a vLLM decode engine can load this engine's agent;
//! see docs/pd.md for what differs (the compatibility hash, one region).

use std::sync::Arc;

use rmpv::Value;

/// What a decode engine needs to read a prefill engine's pool (from its handshake).
#[derive(Clone, Debug, PartialEq)]
pub struct PeerPool {
    pub engine_id: String,
    /// The NIXL agent metadata (`get_local_md` of the peer's agent).
    pub agent_metadata: Vec<u8>,
    pub base_addr: u64,
    pub num_blocks: u64,
    pub block_bytes: u64,
}

/// One finished pull.
#[derive(Clone, Debug, PartialEq)]
pub struct PullStats {
    pub blocks: usize,
    /// Bytes moved and verified (0 on the no-op plane).
    pub bytes: usize,
    pub elapsed: std::time::Duration,
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

    /// Decode side: the peer at `address` was handshaken already.
    fn knows_peer(&self, _address: &str) -> bool {
        false
    }

    /// Decode side: READ `remote_blocks` of `remote_request_id` from the peer at
    /// `address` (described by `handshake` the first time) and verify every byte. Blocks.
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
            elapsed: std::time::Duration::ZERO,
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
/// the runtime starts; otherwise said once, and no-op), no-op otherwise.
pub fn for_engine(
    role: crate::play::pd::PdRole,
    engine_id: &str,
    num_blocks: u64,
    block_bytes: u64,
) -> Arc<dyn DataPlane> {
    if role == crate::play::pd::PdRole::Both {
        return Arc::new(NoopDataPlane);
    }
    #[cfg(feature = "nixl")]
    {
        match nixl_plane::NixlDataPlane::start(engine_id, num_blocks, block_bytes) {
            Ok(p) => {
                tracing::info!(
                    engine_id,
                    blocks = num_blocks,
                    block_bytes,
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
    let _ = (engine_id, num_blocks, block_bytes);
    Arc::new(NoopDataPlane)
}

// ---------------------------------------------------------------- the handshake

/// vLLM's handshake request: `msgpack((b"get_meta_msg", pp_rank, tp_rank))`.
pub fn get_meta_msg() -> Vec<u8> {
    let v = Value::Array(vec![
        Value::Binary(b"get_meta_msg".to_vec()),
        Value::from(0u64),
        Value::from(0u64),
    ]);
    encode(&v)
}

/// Whether a side-channel message is vLLM's handshake request.
pub fn is_get_meta_msg(bytes: &[u8]) -> bool {
    let Ok(v) = rmpv::decode::read_value(&mut &bytes[..]) else {
        return false;
    };
    match v.as_array().and_then(|a| a.first()) {
        Some(Value::Binary(b)) => b == b"get_meta_msg",
        Some(Value::String(s)) => s.as_str() == Some("get_meta_msg"),
        _ => false,
    }
}

fn encode(v: &Value) -> Vec<u8> {
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, v).expect("writing to a Vec cannot fail");
    buf
}

/// What this engine's handshake says besides the pool: the compatibility hash (vLLM's is
/// a hash of its own configuration; ours names the tool, so a vLLM peer needs
/// `enforce_handshake_compat: false`).
pub const COMPATIBILITY_HASH: &str = concat!("vllm-vcr-", env!("CARGO_PKG_VERSION"));

/// `NixlHandshakePayload{compatibility_hash, agent_metadata_bytes}` around a
/// `NixlAgentMetadata` map with vLLM 0.33's keys, describing one DRAM region.
pub fn encode_handshake(pool: &PeerPool, block_size_tokens: u64) -> Vec<u8> {
    let s = |x: &str| Value::from(x);
    let ints = |v: &[u64]| Value::Array(v.iter().map(|x| Value::from(*x)).collect());
    let meta = Value::Map(vec![
        (s("engine_id"), s(&pool.engine_id)),
        (
            s("agent_metadata"),
            Value::Binary(pool.agent_metadata.clone()),
        ),
        (s("kv_caches_base_addr"), ints(&[pool.base_addr])),
        (s("device_id"), Value::from(0u64)),
        (s("num_blocks"), Value::from(pool.num_blocks)),
        (s("block_lens"), ints(&[pool.block_bytes])),
        (s("block_strides"), ints(&[pool.block_bytes])),
        (s("kv_cache_layout"), s("HND")),
        (s("block_size"), Value::from(block_size_tokens)),
        (s("ssm_sizes"), ints(&[0, 0])),
        (s("attn_backend_name"), s("FLASH_ATTN")),
        (s("physical_blocks_per_logical_kv_block"), Value::from(1u64)),
        (s("region_num_blocks"), ints(&[pool.num_blocks])),
        (s("region_group_ids"), ints(&[0])),
        (s("region_names"), Value::Array(vec![s("kv")])),
        (s("region_mem_types"), Value::Array(vec![s("DRAM")])),
        (s("dcp_size"), Value::from(1u64)),
        (s("pcp_size"), Value::from(1u64)),
        (s("ple_block_len"), Value::Nil),
        (
            s("region_members"),
            Value::Array(vec![Value::Array(vec![])]),
        ),
        (s("packed_member_layouts"), Value::Map(vec![])),
    ]);
    encode(&Value::Map(vec![
        (s("compatibility_hash"), s(COMPATIBILITY_HASH)),
        (s("agent_metadata_bytes"), Value::Binary(encode(&meta))),
    ]))
}

fn key<'a>(m: &'a Value, k: &str) -> Option<&'a Value> {
    m.as_map()?
        .iter()
        .find(|(x, _)| x.as_str() == Some(k))
        .map(|(_, v)| v)
}

/// The pool a handshake payload describes (vLLM's or ours; extra keys are ignored).
pub fn decode_handshake(bytes: &[u8]) -> Result<PeerPool, String> {
    let outer = rmpv::decode::read_value(&mut &bytes[..])
        .map_err(|e| format!("the handshake is not msgpack: {e}"))?;
    let inner = match key(&outer, "agent_metadata_bytes") {
        Some(Value::Binary(b)) => rmpv::decode::read_value(&mut &b[..])
            .map_err(|e| format!("agent_metadata_bytes is not msgpack: {e}"))?,
        _ => return Err("the handshake has no agent_metadata_bytes".into()),
    };
    let num = |k: &str| -> Result<u64, String> {
        key(&inner, k)
            .and_then(Value::as_u64)
            .ok_or_else(|| format!("the agent metadata has no {k}"))
    };
    let first = |k: &str| -> Result<u64, String> {
        key(&inner, k)
            .and_then(Value::as_array)
            .and_then(|a| a.first())
            .and_then(Value::as_u64)
            .ok_or_else(|| format!("the agent metadata has no {k}"))
    };
    let agent_metadata = match key(&inner, "agent_metadata") {
        Some(Value::Binary(b)) => b.clone(),
        _ => return Err("the agent metadata has no agent_metadata bytes".into()),
    };
    Ok(PeerPool {
        engine_id: key(&inner, "engine_id")
            .and_then(Value::as_str)
            .ok_or("the agent metadata has no engine_id")?
            .to_string(),
        agent_metadata,
        base_addr: first("kv_caches_base_addr")?,
        num_blocks: num("num_blocks")?,
        block_bytes: first("block_lens")?,
    })
}

/// A READ notification (`"<request id>:<readers>"`): the request id.
pub fn notification_request(msg: &str) -> Option<&str> {
    let (id, n) = msg.rsplit_once(':')?;
    n.parse::<u32>().ok().map(|_| id)
}

#[cfg(feature = "nixl")]
mod nixl_plane {
    use std::collections::HashMap;
    use std::sync::Mutex;
    use std::time::Duration;

    use anyhow::Result;

    use super::{DataPlane, PeerPool, PullStats};
    use crate::play::pd::nixl::{NixlPool, PoolInfo};

    /// A KV pool registered with a NIXL agent (see the module doc).
    pub struct NixlDataPlane {
        engine_id: String,
        pool: Mutex<NixlPool>,
        handshake: Vec<u8>,
        /// Free blocks of this pool a pull may read into.
        landing: Mutex<Vec<usize>>,
        /// Peers handshaken, by side-channel address.
        peers: Mutex<HashMap<String, PoolInfo>>,
    }

    impl std::fmt::Debug for NixlDataPlane {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("NixlDataPlane")
                .field("engine_id", &self.engine_id)
                .finish()
        }
    }

    impl NixlDataPlane {
        pub fn start(engine_id: &str, num_blocks: u64, block_bytes: u64) -> Result<Self> {
            anyhow::ensure!(
                num_blocks.saturating_mul(block_bytes) <= 16 << 30,
                "a KV pool of {num_blocks} blocks of {block_bytes} bytes is over 16 GiB: lower --num-gpu-blocks or --kv-block-bytes"
            );
            let pool = NixlPool::new(
                &format!("{engine_id}-{}", std::process::id()),
                num_blocks as usize,
                block_bytes as usize,
            )?;
            let info = pool.info()?;
            let handshake = super::encode_handshake(
                &PeerPool {
                    engine_id: engine_id.to_string(),
                    agent_metadata: info.metadata.clone(),
                    base_addr: info.base_addr as u64,
                    num_blocks,
                    block_bytes,
                },
                16,
            );
            Ok(Self {
                engine_id: engine_id.to_string(),
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
            let peer = {
                let mut peers = lock(&self.peers);
                match (peers.get(address), handshake) {
                    (Some(p), _) => p.clone(),
                    (None, Some(h)) => {
                        let pool = super::decode_handshake(h)?;
                        let mut info = PoolInfo {
                            agent_name: String::new(),
                            metadata: pool.agent_metadata,
                            base_addr: pool.base_addr as usize,
                            num_blocks: pool.num_blocks as usize,
                            block_bytes: pool.block_bytes as usize,
                        };
                        info.agent_name = lock(&self.pool)
                            .load_any_remote(&info)
                            .map_err(|e| format!("{e:#}"))?;
                        peers.insert(address.to_string(), info.clone());
                        info
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
                        pool.verify(remote_request_id, &local)?;
                        Ok(stats)
                    })
            };
            lock(&self.landing).extend(local.iter().copied());
            if result.is_err() {
                // a restarted prefill engine has a new agent: handshake again next time
                lock(&self.peers).remove(address);
            }
            let stats = result.map_err(|e| format!("{e:#}"))?;
            Ok(PullStats {
                blocks: remote.len(),
                bytes: stats.bytes,
                elapsed: stats.elapsed,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_handshake_round_trips_and_is_vllms_shape() {
        let pool = PeerPool {
            engine_id: "prefill-0".into(),
            agent_metadata: vec![1, 2, 3, 0, 255],
            base_addr: 0x7f00_0000_1000,
            num_blocks: 512,
            block_bytes: 4096,
        };
        let bytes = encode_handshake(&pool, 16);
        assert_eq!(decode_handshake(&bytes).unwrap(), pool);
        // the outer map has vLLM's two keys, the metadata is a map of 0.33's keys
        let outer = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let keys: Vec<_> = outer
            .as_map()
            .unwrap()
            .iter()
            .map(|(k, _)| k.as_str().unwrap().to_string())
            .collect();
        assert_eq!(keys, ["compatibility_hash", "agent_metadata_bytes"]);
        assert!(decode_handshake(b"\x90").is_err());
    }

    #[test]
    fn get_meta_msg_is_recognised_in_vllms_encoding() {
        assert!(is_get_meta_msg(&get_meta_msg()));
        // msgspec encodes Python bytes as bin; a str spelling is accepted too
        let as_str = encode(&Value::Array(vec![
            Value::from("get_meta_msg"),
            Value::from(0u64),
            Value::from(1u64),
        ]));
        assert!(is_get_meta_msg(&as_str));
        assert!(!is_get_meta_msg(&crate::play::pd::wire::read(
            "d",
            "r",
            &[1]
        )));
        assert!(!is_get_meta_msg(b"get_meta_msg"));
    }

    #[test]
    fn notifications_name_the_request() {
        assert_eq!(notification_request("cmpl-1-0-ab:1"), Some("cmpl-1-0-ab"));
        assert_eq!(notification_request("a:b:2"), Some("a:b"));
        assert_eq!(notification_request("no-count"), None);
    }
}
