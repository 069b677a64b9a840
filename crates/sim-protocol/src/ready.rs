//! The engine's ready response (sent once on every input socket) and the handshake maps
//! (HELLO / INIT / READY on the handshake socket).

use rmpv::Value;

use crate::decode::value::{self as v, R};
use crate::decode::{DecodeError, DecodeErrorKind};
use crate::encode::Writer;

/// `EngineCoreReadyResponse` (a dataclass ⇒ map). Encoded with every key of the 0.33
/// superset, nil where unknown: both frontends of every line ignore keys they do not know,
/// and Python requires some keys that `vllm-rs` treats as optional (e.g. `dp_stats_address`).
#[derive(Debug, Clone, PartialEq)]
pub struct ReadyResponse {
    pub max_model_len: u64,
    pub num_gpu_blocks: u64,
    pub block_size: u64,
    pub dp_stats_address: Option<String>,
    /// `float16`, `bfloat16` or `float32` (`vllm-rs` rejects anything else).
    pub dtype: String,
    pub vllm_version: String,
    pub world_size: u64,
    pub data_parallel_size: u64,
    pub tensor_parallel_size: u64,
    pub pipeline_parallel_size: u64,
    pub decode_context_parallel_size: u64,
    pub data_parallel_rank: u64,
    pub max_num_seqs: u64,
    pub max_num_batched_tokens: u64,
    pub instance_id: String,
    pub supports_lora: bool,
    pub max_loras: u64,
    pub mamba_block_size: Option<u64>,
    pub kv_cache_size_tokens: Option<u64>,
    pub kv_cache_max_concurrency: Option<f64>,
    /// `KVEventsConfig` map (all 8 keys, or `vllm-rs` rejects it) or nil.
    pub kv_events_config: Option<Value>,
    pub weight_transfer_backend: Option<String>,
    pub enable_sleep_mode: bool,
    pub supports_draft_weight_updates: bool,
    pub effective_attention_block_size: Option<u64>,
    pub coord_store_port: u64,
    pub coordinator_input_address: Option<String>,
    pub coordinator_output_address: Option<String>,
}

impl Default for ReadyResponse {
    fn default() -> Self {
        Self {
            max_model_len: 2048,
            num_gpu_blocks: 1024,
            block_size: 16,
            dp_stats_address: None,
            dtype: "bfloat16".into(),
            vllm_version: String::new(),
            world_size: 1,
            data_parallel_size: 1,
            tensor_parallel_size: 1,
            pipeline_parallel_size: 1,
            decode_context_parallel_size: 1,
            data_parallel_rank: 0,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            instance_id: String::new(),
            supports_lora: false,
            max_loras: 0,
            mamba_block_size: None,
            kv_cache_size_tokens: None,
            kv_cache_max_concurrency: None,
            kv_events_config: None,
            weight_transfer_backend: None,
            enable_sleep_mode: false,
            supports_draft_weight_updates: false,
            effective_attention_block_size: None,
            coord_store_port: 0,
            coordinator_input_address: None,
            coordinator_output_address: None,
        }
    }
}

fn opt_u64(w: &mut Writer, x: Option<u64>) {
    match x {
        Some(x) => w.uint(x),
        None => w.nil(),
    }
}

impl ReadyResponse {
    /// The msgpack map (28 keys, dataclass order).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new(640, usize::MAX);
        w.map(28);
        let kv = |w: &mut Writer, k: &str, x: u64| {
            w.str(k);
            w.uint(x);
        };
        kv(&mut w, "max_model_len", self.max_model_len);
        kv(&mut w, "num_gpu_blocks", self.num_gpu_blocks);
        kv(&mut w, "block_size", self.block_size);
        w.str("dp_stats_address");
        w.opt_str(self.dp_stats_address.as_deref());
        w.str("dtype");
        w.str(&self.dtype);
        w.str("vllm_version");
        w.str(&self.vllm_version);
        kv(&mut w, "world_size", self.world_size);
        kv(&mut w, "data_parallel_size", self.data_parallel_size);
        kv(&mut w, "tensor_parallel_size", self.tensor_parallel_size);
        kv(
            &mut w,
            "pipeline_parallel_size",
            self.pipeline_parallel_size,
        );
        kv(
            &mut w,
            "decode_context_parallel_size",
            self.decode_context_parallel_size,
        );
        kv(&mut w, "data_parallel_rank", self.data_parallel_rank);
        kv(&mut w, "max_num_seqs", self.max_num_seqs);
        kv(
            &mut w,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
        );
        w.str("instance_id");
        w.str(&self.instance_id);
        w.str("supports_lora");
        w.bool(self.supports_lora);
        kv(&mut w, "max_loras", self.max_loras);
        w.str("mamba_block_size");
        opt_u64(&mut w, self.mamba_block_size);
        w.str("kv_cache_size_tokens");
        opt_u64(&mut w, self.kv_cache_size_tokens);
        w.str("kv_cache_max_concurrency");
        match self.kv_cache_max_concurrency {
            Some(c) => w.f64(c),
            None => w.nil(),
        }
        w.str("kv_events_config");
        w.opt_value(self.kv_events_config.as_ref());
        w.str("weight_transfer_backend");
        w.opt_str(self.weight_transfer_backend.as_deref());
        w.str("enable_sleep_mode");
        w.bool(self.enable_sleep_mode);
        w.str("supports_draft_weight_updates");
        w.bool(self.supports_draft_weight_updates);
        w.str("effective_attention_block_size");
        opt_u64(&mut w, self.effective_attention_block_size);
        kv(&mut w, "coord_store_port", self.coord_store_port);
        w.str("coordinator_input_address");
        w.opt_str(self.coordinator_input_address.as_deref());
        w.str("coordinator_output_address");
        w.opt_str(self.coordinator_output_address.as_deref());
        w.buf
    }

    /// Lenient decode: unknown keys ignored, missing keys keep [`Default`] values (the
    /// frontends are stricter; this is for the tap and tests).
    pub fn decode(payload: &[u8]) -> Result<Self, DecodeError> {
        Self::decode_inner(payload).map_err(DecodeError::bare)
    }

    fn decode_inner(payload: &[u8]) -> R<Self> {
        let value = v::read_whole(payload)?;
        let m = v::map(&value, "ready response")?;
        let mut r = ReadyResponse::default();
        for (k, x) in v::str_entries(m) {
            let f = format!("ready.{k}");
            let f = f.as_str();
            match k {
                "max_model_len" => r.max_model_len = v::u64_(x, f)?,
                "num_gpu_blocks" => r.num_gpu_blocks = v::u64_(x, f)?,
                "block_size" => r.block_size = v::u64_(x, f)?,
                "dp_stats_address" => r.dp_stats_address = v::opt_string(x, f)?,
                "dtype" => r.dtype = v::string(x, f)?,
                "vllm_version" => r.vllm_version = v::string(x, f)?,
                "world_size" => r.world_size = v::u64_(x, f)?,
                "data_parallel_size" => r.data_parallel_size = v::u64_(x, f)?,
                "tensor_parallel_size" => r.tensor_parallel_size = v::u64_(x, f)?,
                "pipeline_parallel_size" => r.pipeline_parallel_size = v::u64_(x, f)?,
                "decode_context_parallel_size" => r.decode_context_parallel_size = v::u64_(x, f)?,
                "data_parallel_rank" => r.data_parallel_rank = v::u64_(x, f)?,
                "max_num_seqs" => r.max_num_seqs = v::u64_(x, f)?,
                "max_num_batched_tokens" => r.max_num_batched_tokens = v::u64_(x, f)?,
                "instance_id" => r.instance_id = v::string(x, f)?,
                "supports_lora" => r.supports_lora = v::bool_(x, f)?,
                "max_loras" => r.max_loras = v::u64_(x, f)?,
                "mamba_block_size" => r.mamba_block_size = opt(x, f, v::u64_)?,
                "kv_cache_size_tokens" => r.kv_cache_size_tokens = opt(x, f, v::u64_)?,
                "kv_cache_max_concurrency" => r.kv_cache_max_concurrency = v::opt_f64(x, f)?,
                "kv_events_config" => r.kv_events_config = v::opaque(x.clone()),
                "weight_transfer_backend" => r.weight_transfer_backend = v::opt_string(x, f)?,
                "enable_sleep_mode" => r.enable_sleep_mode = v::bool_(x, f)?,
                "supports_draft_weight_updates" => {
                    r.supports_draft_weight_updates = v::bool_(x, f)?
                }
                "effective_attention_block_size" => {
                    r.effective_attention_block_size = opt(x, f, v::u64_)?
                }
                "coord_store_port" => r.coord_store_port = v::u64_(x, f)?,
                "coordinator_input_address" => r.coordinator_input_address = v::opt_string(x, f)?,
                "coordinator_output_address" => r.coordinator_output_address = v::opt_string(x, f)?,
                _ => {}
            }
        }
        Ok(r)
    }
}

fn opt<T>(x: &Value, f: &str, read: fn(&Value, &str) -> R<T>) -> R<Option<T>> {
    if v::is_nil(x) {
        Ok(None)
    } else {
        read(x, f).map(Some)
    }
}

/// `{"status": …, "local": false, "headless": true}` — HELLO and READY of a remote headless
/// engine (what `--data-parallel-size-local 0` frontends expect).
pub fn encode_status(status: &str) -> Vec<u8> {
    StatusMessage {
        status: status.to_string(),
        local: false,
        headless: true,
    }
    .encode()
}

/// A HELLO / READY map on the handshake socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusMessage {
    pub status: String,
    pub local: bool,
    pub headless: bool,
}

impl StatusMessage {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new(40, usize::MAX);
        w.map(3);
        w.str("status");
        w.str(&self.status);
        w.str("local");
        w.bool(self.local);
        w.str("headless");
        w.bool(self.headless);
        w.buf
    }

    /// Lenient decode; extra keys (`parallel_config_hash`, elastic-EP keys) are ignored.
    pub fn decode(payload: &[u8]) -> Result<Self, DecodeError> {
        let inner = || -> R<Self> {
            let value = v::read_whole(payload)?;
            let m = v::map(&value, "handshake status message")?;
            let mut status = None;
            let mut s = StatusMessage {
                status: String::new(),
                local: false,
                headless: false,
            };
            for (k, x) in v::str_entries(m) {
                match k {
                    "status" => status = Some(v::string(x, "status")?),
                    "local" => s.local = v::bool_(x, "local")?,
                    "headless" => s.headless = v::bool_(x, "headless")?,
                    _ => {}
                }
            }
            s.status = status.ok_or_else(|| DecodeErrorKind::MissingKey {
                field: "status".into(),
            })?;
            Ok(s)
        };
        inner().map_err(DecodeError::bare)
    }
}

/// INIT (`EngineHandshakeMetadata`): the addresses the engine must connect to.
#[derive(Debug, Clone, PartialEq)]
pub struct HandshakeInit {
    /// One input (ROUTER) address per frontend client.
    pub inputs: Vec<String>,
    /// One output (PULL) address per frontend client, parallel to `inputs`.
    pub outputs: Vec<String>,
    pub coordinator_input: Option<String>,
    pub coordinator_output: Option<String>,
    pub frontend_stats_publish_address: Option<String>,
    /// `{}` unless coordinated DP; kept opaque.
    pub parallel_config: Value,
}

impl Default for HandshakeInit {
    fn default() -> Self {
        Self {
            inputs: Vec::new(),
            outputs: Vec::new(),
            coordinator_input: None,
            coordinator_output: None,
            frontend_stats_publish_address: None,
            parallel_config: Value::Map(Vec::new()),
        }
    }
}

impl HandshakeInit {
    /// Byte-identical to what both frontends send.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new(256, usize::MAX);
        w.map(2);
        w.str("addresses");
        w.map(5);
        for (k, list) in [("inputs", &self.inputs), ("outputs", &self.outputs)] {
            w.str(k);
            w.array(list.len());
            for a in list {
                w.str(a);
            }
        }
        w.str("coordinator_input");
        w.opt_str(self.coordinator_input.as_deref());
        w.str("coordinator_output");
        w.opt_str(self.coordinator_output.as_deref());
        w.str("frontend_stats_publish_address");
        w.opt_str(self.frontend_stats_publish_address.as_deref());
        w.str("parallel_config");
        w.value(&self.parallel_config);
        w.buf
    }

    pub fn decode(payload: &[u8]) -> Result<Self, DecodeError> {
        Self::decode_inner(payload).map_err(DecodeError::bare)
    }

    fn decode_inner(payload: &[u8]) -> R<Self> {
        let value = v::read_whole(payload)?;
        let m = v::map(&value, "INIT")?;
        let mut init = HandshakeInit::default();
        let mut addresses = None;
        for (k, x) in v::str_entries(m) {
            match k {
                "addresses" => addresses = Some(x),
                "parallel_config" => init.parallel_config = x.clone(),
                _ => {}
            }
        }
        let addresses = addresses.ok_or_else(|| DecodeErrorKind::MissingKey {
            field: "INIT.addresses".into(),
        })?;
        let am = v::map(addresses, "INIT.addresses")?;
        let (mut inputs, mut outputs) = (None, None);
        for (k, x) in v::str_entries(am) {
            let f = format!("INIT.addresses.{k}");
            match k {
                "inputs" => inputs = Some(v::string_list(x, &f)?),
                "outputs" => outputs = Some(v::string_list(x, &f)?),
                "coordinator_input" => init.coordinator_input = v::opt_string(x, &f)?,
                "coordinator_output" => init.coordinator_output = v::opt_string(x, &f)?,
                "frontend_stats_publish_address" => {
                    init.frontend_stats_publish_address = v::opt_string(x, &f)?
                }
                _ => {}
            }
        }
        let missing = |k: &str| DecodeErrorKind::MissingKey {
            field: format!("INIT.addresses.{k}"),
        };
        init.inputs = inputs.ok_or_else(|| missing("inputs"))?;
        init.outputs = outputs.ok_or_else(|| missing("outputs"))?;
        if init.inputs.len() != init.outputs.len() {
            return Err(DecodeErrorKind::InvalidValue {
                field: "INIT.addresses".into(),
                reason: format!(
                    "{} input addresses but {} output addresses",
                    init.inputs.len(),
                    init.outputs.len()
                ),
            });
        }
        Ok(init)
    }
}

/// Replace the input and output addresses of an INIT payload, keeping every other byte of
/// the message as the frontend encoded it (key order, the other addresses, the parallel
/// config). This is the one change the record tap makes on the wire: the engine must
/// connect its data sockets to the tap, and it learns where only from INIT.
///
/// Returns the new payload and the decoded original (whose addresses the tap connects to).
pub fn rewrite_init_addresses(
    payload: &[u8],
    inputs: &[String],
    outputs: &[String],
) -> Result<(Vec<u8>, HandshakeInit), DecodeError> {
    let original = HandshakeInit::decode(payload)?;
    if inputs.len() != original.inputs.len() || outputs.len() != original.outputs.len() {
        return Err(DecodeError::bare(DecodeErrorKind::InvalidValue {
            field: "INIT.addresses".into(),
            reason: format!(
                "the frontend advertised {} client(s), the replacement has {} input(s) and {} output(s)",
                original.inputs.len(),
                inputs.len(),
                outputs.len()
            ),
        }));
    }
    let mut value = v::read_whole(payload).map_err(DecodeError::bare)?;
    let list = |xs: &[String]| Value::Array(xs.iter().map(|s| Value::from(s.as_str())).collect());
    if let Value::Map(top) = &mut value {
        for (k, x) in top.iter_mut() {
            if k.as_str() != Some("addresses") {
                continue;
            }
            if let Value::Map(addresses) = x {
                for (k, x) in addresses.iter_mut() {
                    match k.as_str() {
                        Some("inputs") => *x = list(inputs),
                        Some("outputs") => *x = list(outputs),
                        _ => {}
                    }
                }
            }
        }
    }
    let mut out = Vec::with_capacity(payload.len() + 16);
    rmpv::encode::write_value(&mut out, &value).map_err(|e| {
        DecodeError::bare(DecodeErrorKind::NotMsgpack(format!(
            "re-encoding INIT failed: {e}"
        )))
    })?;
    Ok((out, original))
}

#[cfg(test)]
mod rewrite_tests {
    use super::*;

    #[test]
    fn rewriting_changes_only_the_data_addresses() {
        let init = HandshakeInit {
            inputs: vec!["tcp://127.0.0.1:42817".into()],
            outputs: vec!["tcp://127.0.0.1:32865".into()],
            frontend_stats_publish_address: Some("tcp://127.0.0.1:9999".into()),
            ..Default::default()
        };
        let payload = init.encode();
        // Same addresses: byte for byte the same message.
        let (same, original) =
            rewrite_init_addresses(&payload, &init.inputs, &init.outputs).unwrap();
        assert_eq!(same, payload);
        assert_eq!(original, init);
        // New addresses: exactly what a frontend would have sent with them.
        let ins = vec!["tcp://10.0.0.7:5000".to_string()];
        let outs = vec!["tcp://10.0.0.7:5001".to_string()];
        let (new, _) = rewrite_init_addresses(&payload, &ins, &outs).unwrap();
        let expected = HandshakeInit {
            inputs: ins.clone(),
            outputs: outs.clone(),
            ..init.clone()
        };
        assert_eq!(new, expected.encode());
        // A client-count mismatch is refused.
        assert!(rewrite_init_addresses(&payload, &[], &[]).is_err());
        assert!(rewrite_init_addresses(b"\xc1", &ins, &outs).is_err());
    }
}
