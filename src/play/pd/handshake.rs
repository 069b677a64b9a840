//! vLLM's NIXL side-channel handshake, both ways: the request (`get_meta_msg`), the answer
//! (`NixlHandshakePayload` wrapping `NixlAgentMetadata`, msgpack maps with vLLM's keys),
//! and the READ notification (`"<request id>:<readers>"`). A prefill engine describes its
//! pool with [`encode_handshake`]; a decode engine reads any peer's, vLLM's included, with
//! [`decode_handshake`] (every region).

use rmpv::Value;

use super::layout::KvLayout;

/// What a decode engine needs to read a prefill engine's pool (from its handshake).
#[derive(Clone, Debug, PartialEq)]
pub struct PeerPool {
    pub engine_id: String,
    /// The NIXL agent metadata (`get_local_md` of the peer's agent).
    pub agent_metadata: Vec<u8>,
    /// Each region's base address (vLLM's `kv_caches_base_addr`: one per layer).
    pub region_addrs: Vec<u64>,
    pub num_blocks: u64,
    /// Bytes per block, the same in every region.
    pub block_bytes: u64,
    /// The peer's compatibility hash (vLLM's, or ours).
    pub compatibility_hash: String,
    /// The peer is `play`, whose blocks hold a known pattern (`vcr_pattern`, a key vLLM's
    /// decoder ignores): the reader checks every byte; a vLLM peer's bytes are digested.
    pub vcr_pattern: bool,
}

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

pub(super) fn encode(v: &Value) -> Vec<u8> {
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, v).expect("writing to a Vec cannot fail");
    buf
}

/// The compatibility hash of a pair of `play` engines (vLLM's is a hash of its own
/// configuration: with `--kv-peer-layout` this engine sends that one instead).
pub const COMPATIBILITY_HASH: &str = concat!("vllm-vcr-", env!("CARGO_PKG_VERSION"));

/// `NixlHandshakePayload{compatibility_hash, agent_metadata_bytes}` around a
/// `NixlAgentMetadata` map with vLLM 0.33's keys. With a `layout`, the regions, hash,
/// block size, backend and cache layout are what a vLLM engine of that layout registers;
/// without, one DRAM region of `block_size_tokens`-token blocks.
pub fn encode_handshake(
    pool: &PeerPool,
    block_size_tokens: u64,
    layout: Option<&KvLayout>,
) -> Vec<u8> {
    let s = |x: &str| Value::from(x);
    let ints = |v: &[u64]| Value::Array(v.iter().map(|x| Value::from(*x)).collect());
    let n = pool.region_addrs.len();
    let (hash, cache_layout, backend, block_size, names) = match layout {
        Some(l) => (
            l.compatibility_hash(),
            l.kv_cache_layout.clone(),
            l.attn_backend_name.clone(),
            l.block_size,
            l.region_names(),
        ),
        None => (
            COMPATIBILITY_HASH.to_string(),
            "HND".into(),
            "FLASH_ATTN".into(),
            block_size_tokens,
            (0..n)
                .map(|i| {
                    if n == 1 {
                        "kv".into()
                    } else {
                        format!("kv.{i}")
                    }
                })
                .collect(),
        ),
    };
    let meta = Value::Map(vec![
        (s("engine_id"), s(&pool.engine_id)),
        (
            s("agent_metadata"),
            Value::Binary(pool.agent_metadata.clone()),
        ),
        (s("kv_caches_base_addr"), ints(&pool.region_addrs)),
        (s("device_id"), Value::from(0u64)),
        (s("num_blocks"), Value::from(pool.num_blocks)),
        (s("block_lens"), ints(&vec![pool.block_bytes; n])),
        (s("block_strides"), ints(&vec![pool.block_bytes; n])),
        (s("kv_cache_layout"), s(&cache_layout)),
        (s("block_size"), Value::from(block_size)),
        (s("ssm_sizes"), ints(&[0, 0])),
        (s("attn_backend_name"), s(&backend)),
        (s("physical_blocks_per_logical_kv_block"), Value::from(1u64)),
        (s("region_num_blocks"), ints(&vec![pool.num_blocks; n])),
        (s("region_group_ids"), ints(&vec![0; n])),
        (
            s("region_names"),
            Value::Array(names.iter().map(|x| s(x)).collect()),
        ),
        (s("region_mem_types"), Value::Array(vec![s("DRAM"); n])),
        (s("dcp_size"), Value::from(1u64)),
        (s("pcp_size"), Value::from(1u64)),
        (s("ple_block_len"), Value::Nil),
        (s("region_members"), Value::Array(vec![])),
        (s("packed_member_layouts"), Value::Map(vec![])),
        (s("vcr_pattern"), Value::from(true)),
    ]);
    encode(&Value::Map(vec![
        (s("compatibility_hash"), s(&hash)),
        (s("agent_metadata_bytes"), Value::Binary(encode(&meta))),
    ]))
}

fn key<'a>(m: &'a Value, k: &str) -> Option<&'a Value> {
    m.as_map()?
        .iter()
        .find(|(x, _)| x.as_str() == Some(k))
        .map(|(_, v)| v)
}

/// The pool a handshake payload describes (vLLM's or ours; every region; extra keys are
/// ignored). Regions of different block lengths are refused: a pool here has one.
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
    let list = |k: &str| -> Result<Vec<u64>, String> {
        key(&inner, k)
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
            .filter(|v| !v.is_empty())
            .ok_or_else(|| format!("the agent metadata has no {k}"))
    };
    let agent_metadata = match key(&inner, "agent_metadata") {
        Some(Value::Binary(b)) => b.clone(),
        _ => return Err("the agent metadata has no agent_metadata bytes".into()),
    };
    let region_addrs = list("kv_caches_base_addr")?;
    let lens = list("block_lens")?;
    if lens.len() != region_addrs.len() {
        return Err(format!(
            "{} block lengths for {} regions",
            lens.len(),
            region_addrs.len()
        ));
    }
    if lens.iter().any(|&l| l != lens[0]) {
        return Err(format!(
            "regions of different block lengths ({lens:?}) are not supported"
        ));
    }
    Ok(PeerPool {
        engine_id: key(&inner, "engine_id")
            .and_then(Value::as_str)
            .ok_or("the agent metadata has no engine_id")?
            .to_string(),
        agent_metadata,
        region_addrs,
        num_blocks: num("num_blocks")?,
        block_bytes: lens[0],
        compatibility_hash: key(&outer, "compatibility_hash")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        vcr_pattern: key(&inner, "vcr_pattern").and_then(Value::as_bool) == Some(true),
    })
}

/// A READ notification (`"<request id>:<readers>"`): the request id.
pub fn notification_request(msg: &str) -> Option<&str> {
    let (id, n) = msg.rsplit_once(':')?;
    n.parse::<u32>().ok().map(|_| id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_handshake_round_trips_and_is_vllms_shape() {
        let mut pool = PeerPool {
            engine_id: "prefill-0".into(),
            agent_metadata: vec![1, 2, 3, 0, 255],
            region_addrs: vec![0x7f00_0000_1000],
            num_blocks: 512,
            block_bytes: 4096,
            compatibility_hash: COMPATIBILITY_HASH.into(),
            vcr_pattern: true,
        };
        let bytes = encode_handshake(&pool, 16, None);
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

        // laid out as a vLLM CPU engine: one region per layer, its hash, its names
        let layout = crate::play::pd::layout::parse(
            r#"{"vllm_version":"0.32.0","model":"/m","dtype":"bfloat16","num_hidden_layers":4,"num_kv_heads":4,"head_size":64}"#,
        )
        .unwrap();
        pool.region_addrs = vec![0x1000, 0x9000, 0x11000, 0x19000];
        pool.block_bytes = layout.block_bytes();
        pool.compatibility_hash = layout.compatibility_hash();
        let bytes = encode_handshake(&pool, 16, Some(&layout));
        assert_eq!(decode_handshake(&bytes).unwrap(), pool);
        let outer = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let inner = match key(&outer, "agent_metadata_bytes") {
            Some(Value::Binary(b)) => rmpv::decode::read_value(&mut &b[..]).unwrap(),
            _ => panic!("no metadata"),
        };
        assert_eq!(key(&inner, "block_size").and_then(Value::as_u64), Some(128));
        assert_eq!(
            key(&inner, "kv_cache_layout").and_then(Value::as_str),
            Some("LBHNC")
        );
        assert_eq!(
            key(&inner, "attn_backend_name").and_then(Value::as_str),
            Some("CPU_ATTN")
        );
        let names = key(&inner, "region_names")
            .and_then(Value::as_array)
            .unwrap();
        assert_eq!(names[2].as_str(), Some("model.layers.2.self_attn.attn"));
        // regions of different block lengths are refused, not misread
        let mixed = encode(&Value::Map(vec![(
            Value::from("agent_metadata_bytes"),
            Value::Binary(encode(&Value::Map(vec![
                (Value::from("engine_id"), Value::from("e")),
                (Value::from("agent_metadata"), Value::Binary(vec![1])),
                (
                    Value::from("kv_caches_base_addr"),
                    Value::Array(vec![Value::from(1u64), Value::from(2u64)]),
                ),
                (Value::from("num_blocks"), Value::from(4u64)),
                (
                    Value::from("block_lens"),
                    Value::Array(vec![Value::from(8u64), Value::from(16u64)]),
                ),
            ]))),
        )]));
        assert!(
            decode_handshake(&mixed)
                .unwrap_err()
                .contains("different block lengths")
        );
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
