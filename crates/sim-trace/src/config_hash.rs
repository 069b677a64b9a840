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
//! * `gpu` — the accelerator, e.g. `H200`; `cpu` for an engine that computes on the host
//!   CPU (vLLM's CPU backend), whose hardware is then `host_cpu`.
//! * `host_cpu` — the host CPU the capture ran on, [`HostCpu::canonical`]: architecture,
//!   logical CPU count, vector-relevant flags, vendor family/model numbers and model name
//!   (empty when unknown or not recorded, `record --host-cpu none`).
//! * `vllm_tag` — the vLLM *line tag*, e.g. `v0.23.0` (not the engine's raw reported
//!   version such as `0.23.0.dev1+g…`, which is recorded separately as `meta.vllm_version`).
//! * `engine_config` — a canonical, sorted digest of the deployed behavioral engine flags,
//!   built by the capture driver. It is hashed verbatim: this module does not re-sort or
//!   normalize it.
//!
//! ## Why the host CPU is an input
//!
//! A config hash names the configuration whose timings a trace holds, so that a latency
//! model fitted to it is not replayed against another. The host CPU changes those timings
//! as much as the flags do. For a CPU engine it is the hardware: the same `cargo xtask
//! capture` gave ~110 output tok/s on one 2-core VM and ~800 on another of the same class,
//! because one CPU has `avx512_bf16` (oneDNN runs bf16 natively) and the other falls back
//! to an emulated path, and the core count sets the engine's thread count. Behind a GPU the
//! CPU still runs the scheduler, the input preparation and the frontend between steps
//! (vLLM's CPU overhead is a known share of a decode step at small batches). So a capture
//! from another CPU is another configuration, and its hash differs. Frequency, microcode
//! and stepping are left out (they vary within one fleet without changing what the CPU
//! computes with); noisy neighbours cannot be hashed at all — see docs/fidelity.md.
//!
//! # Canonical byte layout (scheme `config-fingerprint-v4`)
//!
//! The hash is the lowercase-hex SHA-256 of the following bytes, all UTF-8, with no
//! trimming, case folding or other normalization of the values:
//!
//! ```text
//! config-fingerprint-v4\n
//! gpu=<len>:<gpu>\n
//! host_cpu=<len>:<host_cpu>\n
//! vllm_tag=<len>:<vllm_tag>\n
//! engine_config=<len>:<engine_config>\n
//! ```
//!
//! where `\n` is a single `0x0A` byte and `<len>` is the value's length in **bytes**,
//! written in ASCII decimal without leading zeros (`0` for an empty value). The field order
//! is fixed as shown. The length prefix makes the encoding injective: a value containing
//! `\n` or `=` cannot be confused with a field boundary.
//!
//! Example: `gpu = "H200"`, `host_cpu = ""`, `vllm_tag = "v0.23.0"`, `engine_config =
//! "block-size=16"` hashes the 95 bytes
//! `"config-fingerprint-v4\ngpu=4:H200\nhost_cpu=0:\nvllm_tag=7:v0.23.0\nengine_config=13:block-size=16\n"`.
//!
//! ## Earlier schemes
//!
//! `config-fingerprint-v3` had no `host_cpu` line (otherwise the same layout); traces
//! stamped under it keep their hash, and [`ConfigFingerprint::hash_v3`] recomputes one
//! to check such a trace.

use sha2::{Digest, Sha256};

use crate::host::HostCpu;

/// The scheme tag that starts the canonical form.
pub const SCHEME: &str = "config-fingerprint-v4";

/// The previous scheme (no `host_cpu` line), for checking traces stamped under it.
pub const SCHEME_V3: &str = "config-fingerprint-v3";

/// The inputs of the config fingerprint. See the module docs for the byte layout.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConfigFingerprint {
    /// Accelerator, e.g. `H200`; `cpu` for a CPU engine.
    pub gpu: String,
    /// The host CPU, [`HostCpu::canonical`] (empty when not recorded).
    pub host_cpu: String,
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
            host_cpu: String::new(),
            vllm_tag: vllm_tag.into(),
            engine_config: engine_config.into(),
        }
    }

    /// The same inputs with the host CPU set (`None` leaves it empty).
    pub fn with_host_cpu(mut self, cpu: Option<&HostCpu>) -> Self {
        self.host_cpu = cpu.map(HostCpu::canonical).unwrap_or_default();
        self
    }

    /// The exact bytes that are hashed (see the module docs).
    pub fn canonical_bytes(&self) -> Vec<u8> {
        encode(
            SCHEME,
            &[
                ("gpu", &self.gpu),
                ("host_cpu", &self.host_cpu),
                ("vllm_tag", &self.vllm_tag),
                ("engine_config", &self.engine_config),
            ],
        )
    }

    /// The bytes the previous scheme, `config-fingerprint-v3`, hashed: the same without
    /// `host_cpu`.
    pub fn canonical_bytes_v3(&self) -> Vec<u8> {
        encode(
            SCHEME_V3,
            &[
                ("gpu", &self.gpu),
                ("vllm_tag", &self.vllm_tag),
                ("engine_config", &self.engine_config),
            ],
        )
    }

    /// Lowercase-hex SHA-256 of [`canonical_bytes`](Self::canonical_bytes) (64 chars).
    pub fn hash(&self) -> String {
        sha256_hex(&self.canonical_bytes())
    }

    /// The hash a trace stamped under `config-fingerprint-v3` carries for these inputs
    /// (`host_cpu` is ignored): to check a trace captured before v4.
    pub fn hash_v3(&self) -> String {
        sha256_hex(&self.canonical_bytes_v3())
    }
}

/// `scheme\n` then `name=<len>:<value>\n` per field.
fn encode(scheme: &str, fields: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        scheme.len()
            + 1
            + fields
                .iter()
                .map(|(k, v)| k.len() + v.len() + 24)
                .sum::<usize>(),
    );
    out.extend_from_slice(scheme.as_bytes());
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

fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let mut hex = String::with_capacity(64);
    for b in digest.iter() {
        hex.push(char::from_digit(u32::from(b >> 4), 16).unwrap_or('0'));
        hex.push(char::from_digit(u32::from(b & 0xf), 16).unwrap_or('0'));
    }
    hex
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::parse_cpuinfo;

    fn example() -> ConfigFingerprint {
        ConfigFingerprint::new("H200", "v0.23.0", "block-size=16")
    }

    fn cpu(model: &str, flags: &str, processors: usize) -> HostCpu {
        let one = format!(
            "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n\
             model name\t: {model}\ncpu MHz\t\t: 2596.140\nflags\t\t: fpu lm {flags}\n\n"
        );
        parse_cpuinfo(&one.repeat(processors)).unwrap()
    }

    #[test]
    fn canonical_form_is_pinned() {
        assert_eq!(
            example().canonical_bytes(),
            b"config-fingerprint-v4\ngpu=4:H200\nhost_cpu=0:\nvllm_tag=7:v0.23.0\nengine_config=13:block-size=16\n"
        );
        let with_cpu = example().with_host_cpu(Some(&cpu("AMD EPYC", "avx2 fma", 2)));
        assert_eq!(
            String::from_utf8(with_cpu.canonical_bytes()).unwrap(),
            "config-fingerprint-v4\ngpu=4:H200\nhost_cpu=98:arch=x86_64;logical_cpus=2;\
             flags=avx2,fma;signature=AuthenticAMD family 25 model 17;model=AMD EPYC\n\
             vllm_tag=7:v0.23.0\nengine_config=13:block-size=16\n"
        );
    }

    #[test]
    fn known_hash_is_pinned() {
        // Cross-checked with: printf '<canonical form>' | sha256sum
        assert_eq!(example().hash(), KNOWN_HASH);
    }

    #[test]
    fn the_v3_hash_of_earlier_traces_is_unchanged() {
        assert_eq!(
            example().canonical_bytes_v3(),
            b"config-fingerprint-v3\ngpu=4:H200\nvllm_tag=7:v0.23.0\nengine_config=13:block-size=16\n"
        );
        assert_eq!(example().hash_v3(), KNOWN_HASH_V3);
        let with_cpu = example().with_host_cpu(Some(&cpu("AMD EPYC", "avx2", 2)));
        assert_eq!(with_cpu.hash_v3(), KNOWN_HASH_V3, "v3 has no host_cpu");
        assert_ne!(with_cpu.hash(), KNOWN_HASH_V3);
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
            example().with_host_cpu(Some(&cpu("AMD EPYC", "avx2", 2))),
        ] {
            assert_ne!(changed.hash(), base);
        }
    }

    #[test]
    fn another_cpu_is_another_configuration() {
        let here = cpu("AMD EPYC", "avx avx2 avx512f avx512_bf16 fma", 2);
        let base = example().with_host_cpu(Some(&here)).hash();
        for other in [
            cpu("AMD EPYC 7B13", "avx avx2 avx512f avx512_bf16 fma", 2),
            cpu("AMD EPYC", "avx avx2 fma", 2),
            cpu("AMD EPYC", "avx avx2 avx512f avx512_bf16 fma", 4),
        ] {
            assert_ne!(
                example().with_host_cpu(Some(&other)).hash(),
                base,
                "{other:?}"
            );
        }
    }

    #[test]
    fn the_same_cpu_hashes_the_same() {
        let a = cpu("AMD EPYC", "avx2 fma avx512f", 2);
        // another moment: other frequency, other flag order, flags that are not vector
        // extensions
        let text = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n\
             model name\t: AMD  EPYC\nstepping\t: 2\ncpu MHz\t\t: 3700.000\n\
             flags\t\t: avx512f fpu fma hypervisor lm avx2 sse\n\n";
        let b = parse_cpuinfo(&text.repeat(2)).unwrap();
        assert_eq!(a, b);
        assert_eq!(
            example().with_host_cpu(Some(&a)).hash(),
            example().with_host_cpu(Some(&b)).hash()
        );
        assert_eq!(example().with_host_cpu(None).hash(), example().hash());
    }

    #[test]
    fn length_prefix_prevents_boundary_ambiguity() {
        let a = ConfigFingerprint::new("H200\nvllm_tag=0:", "", "x");
        let b = ConfigFingerprint::new("H200", "", "x");
        assert_ne!(a.hash(), b.hash());
    }

    const KNOWN_HASH: &str = "19742bbf4b7083d6c26223775f29737e6fc122257c8b5ee6a1d6dee34b26b104";
    const KNOWN_HASH_V3: &str = "b7b3b414acd31a528b74e8d75950606a2f90714c9e460a40b88ac2d7d7de6e9f";
}
