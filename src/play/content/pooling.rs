//! `--runner pooling`: the engine of an embedding model.
//!
//! A pooling request (no sampling parameters, `pooling_params` instead) is prefilled like
//! any other, then finishes with its pooled vector as `pooling_output` and no tokens, as
//! vLLM's pooling runner does. The vector is a bag of per-token vectors: each token id has
//! a fixed pseudo-random direction (from `--seed`), and a prompt's embedding is their sum,
//! L2-normalised as vLLM's embed pooler does (unless the request turns the activation off).
//! So the same text always gets the same vector, texts that share words are closer than
//! texts that do not, and `dimensions` (Matryoshka) truncates before normalising.

use rmpv::Value;

use super::tokens::SplitMix64;

/// `--runner`: what kind of model the engine is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Runner {
    /// Text generation (what every request gets today).
    #[default]
    Generate,
    /// An embedding model: `get_supported_tasks` answers `embed`, and requests get vectors.
    Pooling,
}

impl Runner {
    /// `get_supported_tasks`' answer.
    pub fn tasks(self) -> &'static [&'static str] {
        match self {
            Runner::Generate => &["generate"],
            Runner::Pooling => &["embed"],
        }
    }
}

/// What a request's `pooling_params` ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolingRequest {
    /// Matryoshka truncation (`dimensions`).
    pub dimensions: Option<u32>,
    /// `use_activation` (normalisation for `embed`; vLLM's default is on).
    pub normalize: bool,
}

impl PoolingRequest {
    /// Reads `PoolingParams`: a msgspec `array_like` struct (the same order on every line
    /// 0.25–0.33: `use_activation`, `dimensions`, `step_tag_id`, …; trailing defaults
    /// omitted), or a map. Missing values are vLLM's defaults for `embed`.
    pub fn from_params(params: Option<&Value>) -> PoolingRequest {
        let get = |index: usize, key: &str| -> Option<&Value> {
            match params? {
                Value::Array(a) => a.get(index),
                Value::Map(m) => m
                    .iter()
                    .find(|(k, _)| k.as_str() == Some(key))
                    .map(|(_, v)| v),
                _ => None,
            }
        };
        PoolingRequest {
            dimensions: get(1, "dimensions")
                .and_then(Value::as_u64)
                .and_then(|d| u32::try_from(d).ok()),
            normalize: get(0, "use_activation")
                .and_then(Value::as_bool)
                .unwrap_or(true),
        }
    }
}

/// The embedding of `prompt` in `dim` dimensions (see the module docs).
pub fn embed(prompt: &[u32], dim: u32, req: PoolingRequest, seed: u64) -> Vec<f32> {
    let dim = dim.max(1) as usize;
    let mut v = vec![0f64; dim];
    for &t in prompt {
        let mut rng = SplitMix64(seed ^ (u64::from(t).wrapping_mul(0x9e37_79b9_7f4a_7c15)));
        for x in v.iter_mut() {
            // uniform in [-1, 1)
            *x += (rng.next_u64() >> 11) as f64 / (1u64 << 52) as f64 - 1.0;
        }
    }
    if let Some(d) = req.dimensions {
        v.truncate((d as usize).clamp(1, dim));
    }
    if req.normalize {
        let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        if norm > 0.0 {
            v.iter_mut().for_each(|x| *x /= norm);
        }
    }
    v.into_iter().map(|x| x as f32).collect()
}

/// A float32 vector as vLLM's msgpack encoder sends a small CPU tensor:
/// `["float32", [len], ext(3, raw little-endian bytes)]`.
pub fn tensor_value(v: &[f32]) -> Value {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    Value::Array(vec![
        Value::from("float32"),
        Value::Array(vec![Value::from(v.len() as u64)]),
        Value::Ext(3, bytes),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cos(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    #[test]
    fn embeddings_are_unit_vectors_that_know_shared_words() {
        let on = PoolingRequest {
            dimensions: None,
            normalize: true,
        };
        let a = embed(&[10, 11, 12, 13], 64, on, 0);
        assert_eq!(a.len(), 64);
        assert!((cos(&a, &a) - 1.0).abs() < 1e-5);
        assert_eq!(a, embed(&[10, 11, 12, 13], 64, on, 0), "deterministic");
        let near = embed(&[10, 11, 12, 99], 64, on, 0);
        let far = embed(&[40, 41, 42, 43], 64, on, 0);
        assert!(
            cos(&a, &near) > cos(&a, &far) + 0.3,
            "{} vs {}",
            cos(&a, &near),
            cos(&a, &far)
        );
        let short = embed(
            &[10, 11],
            64,
            PoolingRequest {
                dimensions: Some(8),
                normalize: true,
            },
            0,
        );
        assert_eq!(short.len(), 8);
        assert!((cos(&short, &short) - 1.0).abs() < 1e-5);
        let raw = embed(
            &[10, 11],
            64,
            PoolingRequest {
                dimensions: None,
                normalize: false,
            },
            0,
        );
        assert!(cos(&raw, &raw) > 1.5, "unnormalised sums are longer than 1");
    }

    #[test]
    fn pooling_params_are_read() {
        let p = Value::Map(vec![
            (Value::from("dimensions"), Value::from(16u64)),
            (Value::from("use_activation"), Value::from(false)),
        ]);
        let r = PoolingRequest::from_params(Some(&p));
        assert_eq!(r.dimensions, Some(16));
        assert!(!r.normalize);
        assert!(PoolingRequest::from_params(None).normalize);
        // what the Python frontend sends: [use_activation, dimensions, …]
        let a = Value::Array(vec![Value::from(true), Value::from(8u64)]);
        assert_eq!(PoolingRequest::from_params(Some(&a)).dimensions, Some(8));
        let t = tensor_value(&[1.0, 2.0]);
        assert_eq!(t[0], Value::from("float32"));
        assert_eq!(
            t[2],
            Value::Ext(3, [1.0f32.to_le_bytes(), 2.0f32.to_le_bytes()].concat())
        );
    }
}
