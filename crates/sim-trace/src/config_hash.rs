//! The capture-config fingerprint stamped into a trace's `meta.config_hash`.
//!
//! `config_hash` is the profile-once/replay-many cache key: it fingerprints the capture
//! config so a trace cannot be replayed against a config it was not captured for. The sim
//! compares the *stamped* hash (`--expect-config-hash`) and never recomputes it, so traces
//! hashed under an older scheme stay valid; if the input set ever changes, bump
//! [`SCHEME`] so old hashes deliberately stop matching.
//!
//! # Inputs
//!
//! * `gpu` — the hardware, e.g. `H200`.
//! * `vllm_tag` — the vLLM *line tag*, e.g. `v0.23.0` (not the engine's raw reported
//!   version such as `0.23.0.dev1+g…`, which is recorded separately as `meta.vllm_version`).
//! * `engine_config` — a canonical, sorted digest of the deployed behavioral engine flags,
//!   built by the capture driver. It is hashed verbatim: this module does not re-sort or
//!   normalize it.
//!
//! # Canonical byte layout (scheme `config-fingerprint-v3`)
//!
//! The hash is the lowercase-hex SHA-256 of the following bytes, all UTF-8, with no
//! trimming, case folding or other normalization of the values:
//!
//! ```text
//! config-fingerprint-v3\n
//! gpu=<len>:<gpu>\n
//! vllm_tag=<len>:<vllm_tag>\n
//! engine_config=<len>:<engine_config>\n
//! ```
//!
//! where `\n` is a single `0x0A` byte and `<len>` is the value's length in **bytes**,
//! written in ASCII decimal without leading zeros (`0` for an empty value). The field order
//! is fixed as shown. The length prefix makes the encoding injective: a value containing
//! `\n` or `=` cannot be confused with a field boundary.
//!
//! Example: `gpu = "H200"`, `vllm_tag = "v0.23.0"`, `engine_config = "block-size=16"` hashes
//! the 83 bytes
//! `"config-fingerprint-v3\ngpu=4:H200\nvllm_tag=7:v0.23.0\nengine_config=13:block-size=16\n"`.

use sha2::{Digest, Sha256};

/// The scheme tag that starts the canonical form.
pub const SCHEME: &str = "config-fingerprint-v3";

/// The three inputs of the config fingerprint. See the module docs for the byte layout.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConfigFingerprint {
    /// Hardware, e.g. `H200`.
    pub gpu: String,
    /// vLLM line tag, e.g. `v0.23.0`.
    pub vllm_tag: String,
    /// Canonical, sorted digest of the deployed behavioral engine flags (built by the
    /// capture driver; hashed verbatim).
    pub engine_config: String,
}

impl ConfigFingerprint {
    pub fn new(
        gpu: impl Into<String>,
        vllm_tag: impl Into<String>,
        engine_config: impl Into<String>,
    ) -> Self {
        Self {
            gpu: gpu.into(),
            vllm_tag: vllm_tag.into(),
            engine_config: engine_config.into(),
        }
    }

    /// The exact bytes that are hashed (see the module docs).
    pub fn canonical_bytes(&self) -> Vec<u8> {
        let fields: [(&str, &str); 3] = [
            ("gpu", &self.gpu),
            ("vllm_tag", &self.vllm_tag),
            ("engine_config", &self.engine_config),
        ];
        let mut out = Vec::with_capacity(
            SCHEME.len()
                + 1
                + fields
                    .iter()
                    .map(|(k, v)| k.len() + v.len() + 24)
                    .sum::<usize>(),
        );
        out.extend_from_slice(SCHEME.as_bytes());
        out.push(b'\n');
        for (name, value) in fields {
            out.extend_from_slice(name.as_bytes());
            out.push(b'=');
            out.extend_from_slice(value.len().to_string().as_bytes());
            out.push(b':');
            out.extend_from_slice(value.as_bytes());
            out.push(b'\n');
        }
        out
    }

    /// Lowercase-hex SHA-256 of [`canonical_bytes`](Self::canonical_bytes) (64 chars).
    pub fn hash(&self) -> String {
        let digest = Sha256::digest(self.canonical_bytes());
        let mut hex = String::with_capacity(64);
        for b in digest.iter() {
            hex.push(char::from_digit(u32::from(b >> 4), 16).unwrap_or('0'));
            hex.push(char::from_digit(u32::from(b & 0xf), 16).unwrap_or('0'));
        }
        hex
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example() -> ConfigFingerprint {
        ConfigFingerprint::new("H200", "v0.23.0", "block-size=16")
    }

    #[test]
    fn canonical_form_is_pinned() {
        assert_eq!(
            example().canonical_bytes(),
            b"config-fingerprint-v3\ngpu=4:H200\nvllm_tag=7:v0.23.0\nengine_config=13:block-size=16\n"
        );
    }

    #[test]
    fn known_hash_is_pinned() {
        // Cross-checked with: printf '<canonical form>' | sha256sum
        assert_eq!(example().hash(), KNOWN_HASH);
    }

    #[test]
    fn every_input_changes_the_hash() {
        let base = example().hash();
        assert_eq!(base.len(), 64);
        assert!(base.chars().all(|c| matches!(c, '0'..='9' | 'a'..='f')));
        for changed in [
            ConfigFingerprint::new("H100", "v0.23.0", "block-size=16"),
            ConfigFingerprint::new("H200", "v0.22.0", "block-size=16"),
            ConfigFingerprint::new("H200", "v0.23.0", "block-size=32"),
        ] {
            assert_ne!(changed.hash(), base);
        }
    }

    #[test]
    fn length_prefix_prevents_boundary_ambiguity() {
        let a = ConfigFingerprint::new("H200\nvllm_tag=0:", "", "x");
        let b = ConfigFingerprint::new("H200", "", "x");
        assert_ne!(a.hash(), b.hash());
    }

    const KNOWN_HASH: &str = "b7b3b414acd31a528b74e8d75950606a2f90714c9e460a40b88ac2d7d7de6e9f";
}
