//! Prefill/decode disaggregation: vLLM's NixlConnector (pull mode) as the engines see it.
//!
//! - A **prefill** engine (`--pd-role prefill` or `both`) runs a request whose
//!   `kv_transfer_params` say `do_remote_decode` like any other; when it stops (`length`
//!   after the proxy's `max_tokens: 1`, or `stop`) its output carries `kv_transfer_params`
//!   as vLLM's connector fills them ([`prefill_params`]) and its blocks stay allocated
//!   until the decode engine has read them, or for `--kv-lease-duration` seconds (vLLM's
//!   `kv_lease_duration`, 30 s by default). An aborted or failed request frees its blocks
//!   at once and carries no params.
//! - A **decode** engine (`decode` or `both`) parks a request whose params say
//!   `do_remote_prefill` (with `remote_engine_id`, `remote_request_id`, `remote_host`,
//!   `remote_port` and `remote_block_ids`) as vLLM's WAITING_FOR_REMOTE_KVS: counted as a
//!   skipped waiting request, not scheduled, while the KV is pulled from the prefill engine
//!   over its side channel. Once pulled, the prompt counts as externally cached and one
//!   token is computed to sample; if the pull fails, `--kv-load-failure-policy` decides:
//!   `fail` (vLLM's default: finish `error`, HTTP 500) or `recompute` (prefill locally).
//!
//! The side channel is a ZMQ ROUTER at `--side-channel-host:--side-channel-port` + the DP
//! rank, as vLLM's. vLLM's peers exchange NIXL agent metadata there and the read itself is
//! a NIXL transfer whose notification frees the blocks; with the no-op data plane the
//! decode engine sends one `vcr_read` message naming P's request id and the block ids
//! instead, and the prefill engine answers once it has released them (see docs/pd.md).
//!
//! This room also holds what the engines say to their peers and routers beside the
//! frontend's sockets: the side channel, the data plane behind it (no-op or NIXL), and the
//! KV-cache events publisher.

pub mod connector_stats;
pub mod data_plane;
pub mod handshake;
pub mod kv_events;
pub mod layout;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod side_channel;

use rmpv::Value;

/// `--pd-role`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum PdRole {
    /// Both sides (a single engine, as without P/D); requests marked for either side get
    /// that side's behaviour.
    #[default]
    Both,
    /// A prefill instance: `do_remote_decode` requests keep their KV for a decode engine.
    Prefill,
    /// A decode instance: `do_remote_prefill` requests pull their KV first.
    Decode,
}

impl PdRole {
    pub fn prefills(self) -> bool {
        matches!(self, PdRole::Both | PdRole::Prefill)
    }

    pub fn decodes(self) -> bool {
        matches!(self, PdRole::Both | PdRole::Decode)
    }
}

/// `--kv-load-failure-policy` (vLLM's `kv_transfer_config.kv_load_failure_policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LoadFailurePolicy {
    /// Finish the request with `error` (vLLM's default).
    #[default]
    Fail,
    /// Forget the remote KV and prefill the whole prompt locally.
    Recompute,
}

/// This engine's P/D settings, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct PdConfig {
    pub role: PdRole,
    pub engine_id: String,
    pub side_channel_host: String,
    /// The side-channel port of DP rank 0 (rank r listens on this + r).
    pub side_channel_port: u16,
    /// How long a prefill engine keeps unread blocks, seconds.
    pub lease_s: f64,
    pub failure_policy: LoadFailurePolicy,
    /// Bytes per KV block in the NIXL data plane's pool (`--kv-block-bytes`).
    pub block_bytes: u64,
    /// The vLLM line (0.33 adds `remote_registration_generation`).
    pub registration_generation: bool,
    /// `--kv-peer-layout`: lay the NIXL pool out as this vLLM engine's KV cache.
    pub peer_layout: Option<layout::KvLayout>,
    /// `--nixl-connector-stats`: report the reads as vLLM's NixlConnector does.
    pub connector_stats: bool,
}

/// What the side channel and the KV pulls tell an engine.
#[derive(Debug)]
pub enum PdEvent {
    /// Prefill side: a decode engine read the blocks of `request_id`. The answer is how
    /// many blocks were released, or why none were.
    Read {
        engine_id: String,
        request_id: String,
        block_ids: Vec<u64>,
        reply: tokio::sync::oneshot::Sender<Result<usize, String>>,
    },
    /// Decode side: the pull for `request_id` ended, having moved `transfer`.
    Pulled {
        request_id: String,
        result: Result<usize, String>,
        transfer: connector_stats::Transfer,
    },
}

/// A KV pull the engine asks the io layer to make.
#[derive(Debug, Clone, PartialEq)]
pub struct Pull {
    /// The decode request (this engine's id).
    pub request_id: String,
    /// This engine's id, sent to the prefill engine.
    pub engine_id: String,
    pub remote: RemoteKv,
    /// How long to wait for the prefill engine's answer.
    pub timeout: std::time::Duration,
}

/// Where a decode request's KV is: what it must pull.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteKv {
    pub engine_id: String,
    pub request_id: String,
    pub host: String,
    pub port: u16,
    pub block_ids: Vec<u64>,
}

fn get<'a>(m: &'a Value, key: &str) -> Option<&'a Value> {
    m.as_map()?
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

/// The request's `kv_transfer_params` (`sampling_params.extra_args["kv_transfer_params"]`).
pub fn transfer_params(extra_args: Option<&Value>) -> Option<&Value> {
    get(extra_args?, "kv_transfer_params").filter(|p| p.is_map())
}

/// `do_remote_decode` is set: a request whose KV a decode engine will read.
pub fn wants_remote_decode(params: Option<&Value>) -> bool {
    flag(params, "do_remote_decode")
}

/// `do_remote_prefill` is set (the decode side of a P/D pair).
pub fn wants_remote_prefill(params: Option<&Value>) -> bool {
    flag(params, "do_remote_prefill")
}

/// A `kv_transfer_params` flag read as vLLM's NixlConnector reads it: `params.get(key)`
/// in an `if`, so Python's truthiness (absent, null, false, 0, "", [] and {} are false;
/// anything else, `"yes"`, `1` and also `"false"`, is true). A value that is not a boolean
/// is most likely a client's mistake: it is taken the way vLLM takes it, with a warning
/// (the first time each flag is seen so; later ones at debug level).
fn flag(params: Option<&Value>, key: &str) -> bool {
    let Some(v) = params.and_then(|p| get(p, key)) else {
        return false;
    };
    if let Some(b) = v.as_bool() {
        return b;
    }
    let taken = truthy(v);
    static WARNED: [std::sync::atomic::AtomicBool; 2] = [
        std::sync::atomic::AtomicBool::new(false),
        std::sync::atomic::AtomicBool::new(false),
    ];
    let first = !WARNED[usize::from(key == "do_remote_prefill")]
        .swap(true, std::sync::atomic::Ordering::Relaxed);
    if first {
        tracing::warn!(
            "kv_transfer_params.{key} is {v}, not a boolean: taken as {taken}, as vLLM's \
             connector takes it (Python truthiness; further such values are logged at debug)"
        );
    } else {
        tracing::debug!("kv_transfer_params.{key} is {v}: taken as {taken}");
    }
    taken
}

/// Python's `bool()` of the value the frontend decoded from the request's JSON.
fn truthy(v: &Value) -> bool {
    match v {
        Value::Nil => false,
        Value::Boolean(b) => *b,
        Value::Integer(i) => i.as_i64() != Some(0) && i.as_u64() != Some(0),
        // NaN is true in Python too (it is not equal to 0)
        Value::F32(x) => *x != 0.0,
        Value::F64(x) => *x != 0.0,
        Value::String(s) => !s.as_bytes().is_empty(),
        Value::Binary(b) => !b.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Map(m) => !m.is_empty(),
        Value::Ext(..) => true,
    }
}

/// The remote fields of a `do_remote_prefill` request; `Err` names what is missing.
pub fn remote_kv(params: &Value) -> Result<RemoteKv, String> {
    let text = |k: &str| -> Result<String, String> {
        get(params, k)
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| format!("kv_transfer_params.{k} is missing or not a string"))
    };
    let port = get(params, "remote_port")
        .and_then(Value::as_u64)
        .and_then(|p| u16::try_from(p).ok())
        .ok_or("kv_transfer_params.remote_port is missing or not a port")?;
    // one list of block ids per KV-cache group (vLLM sends a tuple of lists); a flat list
    // is accepted too
    let blocks = get(params, "remote_block_ids")
        .and_then(Value::as_array)
        .ok_or("kv_transfer_params.remote_block_ids is missing")?;
    let mut block_ids = Vec::new();
    for b in blocks {
        match b {
            Value::Array(group) => block_ids.extend(group.iter().filter_map(Value::as_u64)),
            other => block_ids.extend(other.as_u64()),
        }
    }
    if block_ids.is_empty() {
        return Err("kv_transfer_params.remote_block_ids is empty".into());
    }
    Ok(RemoteKv {
        engine_id: text("remote_engine_id")?,
        request_id: text("remote_request_id")?,
        host: text("remote_host")?,
        port,
        block_ids,
    })
}

/// The `kv_transfer_params` a prefill engine returns for a finished request (vLLM's
/// `NixlConnector.request_finished`, pull mode, keys in its order).
pub fn prefill_params(
    cfg: &PdConfig,
    dp_rank: u32,
    request_id: &str,
    block_ids: &[usize],
    num_tokens: u64,
    cached_tokens: u64,
) -> Value {
    let s = |x: &str| Value::from(x);
    let mut m = vec![
        (s("do_remote_prefill"), Value::from(true)),
        (s("do_remote_decode"), Value::from(false)),
        (
            s("remote_block_ids"),
            Value::Array(vec![Value::Array(
                block_ids.iter().map(|b| Value::from(*b as u64)).collect(),
            )]),
        ),
        (s("remote_engine_id"), s(&cfg.engine_id)),
        (s("remote_request_id"), s(request_id)),
        (s("remote_host"), s(&cfg.side_channel_host)),
        (
            s("remote_port"),
            Value::from(u64::from(cfg.side_channel_port) + u64::from(dp_rank)),
        ),
        (s("tp_size"), Value::from(1u64)),
        (s("dcp_size"), Value::from(1u64)),
        (s("pp_size"), Value::from(1u64)),
        (s("remote_num_tokens"), Value::from(num_tokens)),
        (s("remote_blocks_expiry_time"), Value::Nil),
    ];
    if cfg.registration_generation {
        m.push((s("remote_registration_generation"), Value::from(1u64)));
    }
    m.push((s("transfer_mode"), s("pull")));
    m.push((
        s("remote_prefill_cached_tokens"),
        Value::from(cached_tokens),
    ));
    Value::Map(m)
}

/// Side-channel messages (msgpack arrays; the first element names the message).
pub mod wire {
    use rmpv::Value;

    /// The decode engine read `request_id`'s blocks: `["vcr_read", engine_id, request_id,
    /// [block ids]]`.
    pub const READ: &str = "vcr_read";

    pub fn read(engine_id: &str, request_id: &str, block_ids: &[u64]) -> Vec<u8> {
        let v = Value::Array(vec![
            Value::from(READ),
            Value::from(engine_id),
            Value::from(request_id),
            Value::Array(block_ids.iter().map(|b| Value::from(*b)).collect()),
        ]);
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, &v).expect("writing to a Vec cannot fail");
        buf
    }

    /// `(engine_id, request_id, block_ids)` of a `vcr_read` message.
    pub fn parse_read(bytes: &[u8]) -> Result<(String, String, Vec<u64>), String> {
        let v = rmpv::decode::read_value(&mut &bytes[..]).map_err(|e| e.to_string())?;
        let a = v.as_array().ok_or("not an array")?;
        if a.first().and_then(Value::as_str) != Some(READ) {
            return Err(format!(
                "unknown side-channel message {}",
                a.first().unwrap_or(&Value::Nil)
            ));
        }
        let s = |i: usize| a.get(i).and_then(Value::as_str).map(str::to_string);
        let blocks = a
            .get(3)
            .and_then(Value::as_array)
            .map(|b| b.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default();
        Ok((
            s(1).ok_or("no engine id")?,
            s(2).ok_or("no request id")?,
            blocks,
        ))
    }

    /// The answer: `["ok", n_blocks]` or `["error", message]`.
    pub fn answer(result: &Result<usize, String>) -> Vec<u8> {
        let v = match result {
            Ok(n) => Value::Array(vec![Value::from("ok"), Value::from(*n as u64)]),
            Err(e) => Value::Array(vec![Value::from("error"), Value::from(e.as_str())]),
        };
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, &v).expect("writing to a Vec cannot fail");
        buf
    }

    pub fn parse_answer(bytes: &[u8]) -> Result<usize, String> {
        let v = rmpv::decode::read_value(&mut &bytes[..]).map_err(|e| e.to_string())?;
        let a = v.as_array().ok_or("the answer is not an array")?;
        match (a.first().and_then(Value::as_str), a.get(1)) {
            (Some("ok"), Some(n)) => Ok(n.as_u64().unwrap_or(0) as usize),
            (Some("error"), Some(m)) => Err(m.as_str().unwrap_or("").to_string()),
            _ => Err(format!("unexpected answer {v}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> PdConfig {
        PdConfig {
            role: PdRole::Prefill,
            engine_id: "p-engine".into(),
            side_channel_host: "127.0.0.1".into(),
            side_channel_port: 5600,
            lease_s: 30.0,
            failure_policy: LoadFailurePolicy::Fail,
            block_bytes: 4096,
            registration_generation: true,
            peer_layout: None,
            connector_stats: false,
        }
    }

    /// L10: what vLLM's connector does with `if params.get("do_remote_decode"):`.
    #[test]
    fn transfer_flags_are_read_with_pythons_truthiness() {
        let with = |v: Value| Value::Map(vec![("do_remote_decode".into(), v)]);
        for (v, want) in [
            (Value::from(true), true),
            (Value::from(false), false),
            (Value::from("yes"), true),
            (Value::from("false"), true),
            (Value::from(""), false),
            (Value::from(1), true),
            (Value::from(0), false),
            (Value::from(-1), true),
            (Value::from(0.0), false),
            (Value::from(0.5), true),
            (Value::Nil, false),
            (Value::Array(vec![]), false),
            (Value::Array(vec![Value::from(0)]), true),
            (Value::Map(vec![]), false),
        ] {
            assert_eq!(wants_remote_decode(Some(&with(v.clone()))), want, "{v}");
        }
        assert!(!wants_remote_decode(None));
        assert!(!wants_remote_decode(Some(&Value::Map(vec![]))));
    }

    #[test]
    fn prefill_params_are_what_a_decode_request_reads_back() {
        let p = prefill_params(&cfg(), 1, "cmpl-x-0-abcd", &[7, 8, 9], 40, 16);
        assert!(wants_remote_prefill(Some(&p)));
        assert!(!wants_remote_decode(Some(&p)));
        let r = remote_kv(&p).unwrap();
        assert_eq!(r.port, 5601, "side-channel port + DP rank");
        assert_eq!(r.block_ids, vec![7, 8, 9]);
        assert_eq!(r.request_id, "cmpl-x-0-abcd");
        assert_eq!(r.engine_id, "p-engine");
        let keys: Vec<&str> = p
            .as_map()
            .unwrap()
            .iter()
            .filter_map(|(k, _)| k.as_str())
            .collect();
        assert_eq!(keys[0], "do_remote_prefill");
        assert!(
            keys.contains(&"remote_registration_generation") && keys.contains(&"transfer_mode")
        );
        let mut missing = p.clone();
        if let Value::Map(m) = &mut missing {
            m.retain(|(k, _)| k.as_str() != Some("remote_host"));
        }
        assert!(remote_kv(&missing).unwrap_err().contains("remote_host"));
    }

    #[test]
    fn side_channel_messages_round_trip() {
        let m = wire::read("d", "req-1", &[3, 4]);
        assert_eq!(
            wire::parse_read(&m).unwrap(),
            ("d".into(), "req-1".into(), vec![3, 4])
        );
        assert_eq!(wire::parse_answer(&wire::answer(&Ok(2))).unwrap(), 2);
        assert_eq!(
            wire::parse_answer(&wire::answer(&Err("gone".into()))).unwrap_err(),
            "gone"
        );
    }
}
