//! How the scheduler legs configure `play` and the frontends: a small engine (4
//! sequences, 64 KV blocks of 16 tokens, one LoRA slot, speculative decoding) and the
//! flags that load the two LoRA adapters.

use serde_json::json;

use crate::e2e::basic::EngineSetup;

// The engine of a scheduler leg.
pub const MAX_NUM_SEQS: u64 = 4;
pub const NUM_GPU_BLOCKS: u64 = 64;
pub const BLOCK_SIZE: u64 = 16;
pub const MAX_NUM_BATCHED_TOKENS: u64 = 512;
pub const TTFT_MS: u64 = 20;
pub const ITL_MS: u64 = 4;
pub const MAX_LORAS: u64 = 1;
pub const NUM_SPECULATIVE_TOKENS: u64 = 3;
pub const SPECULATIVE_ACCEPTANCE_RATE: f64 = 0.6;

/// The flag whose presence in `vllm-vcr play --help` says the engine can speculate.
pub const SPEC_FLAG: &str = "--num-speculative-tokens";

/// The two adapters the frontend loads at startup (the engine never reads the paths).
pub const LORAS: [(&str, &str); 2] = [("l1", "/tmp/vllm-vcr-l1"), ("l2", "/tmp/vllm-vcr-l2")];

/// Engine flags of a scheduler leg (`spec`: the engine has `--num-speculative-tokens`).
pub fn engine_args(spec: bool) -> Vec<String> {
    let mut a: Vec<String> = [
        ("--max-num-seqs", MAX_NUM_SEQS.to_string()),
        ("--num-gpu-blocks", NUM_GPU_BLOCKS.to_string()),
        ("--block-size", BLOCK_SIZE.to_string()),
        (
            "--max-num-batched-tokens",
            MAX_NUM_BATCHED_TOKENS.to_string(),
        ),
        ("--max-loras", MAX_LORAS.to_string()),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_string(), v])
    .collect();
    if spec {
        a.extend([
            SPEC_FLAG.to_string(),
            NUM_SPECULATIVE_TOKENS.to_string(),
            "--speculative-acceptance-rate".into(),
            SPECULATIVE_ACCEPTANCE_RATE.to_string(),
        ]);
    }
    a
}

fn lora_modules() -> Vec<String> {
    let mut a = vec!["--lora-modules".to_string()];
    a.extend(LORAS.iter().map(|(n, p)| format!("{n}={p}")));
    a
}

/// Frontend flags of the vllm-rs scheduler leg. vllm-rs has no `--enable-lora`: it sends
/// `add_lora` for each `--lora-modules` entry at startup (0.30 and later).
pub fn rs_frontend_args(lora: bool) -> Vec<String> {
    let mut a = vec!["--enable-prompt-tokens-details".to_string()];
    if lora {
        a.extend(lora_modules());
    }
    a
}

/// Frontend flags of the Python scheduler leg. The Python frontend registers the
/// `vllm:spec_decode_*` counters only when its own config speculates, so it gets a
/// `--speculative-config` matching the engine (the ngram method needs no draft model).
pub fn python_frontend_args(spec: bool) -> Vec<String> {
    let mut a = vec![
        "--enable-prompt-tokens-details".to_string(),
        "--enable-lora".into(),
    ];
    a.extend(lora_modules());
    a.extend(["--max-loras".into(), MAX_LORAS.to_string()]);
    if spec {
        a.push("--speculative-config".into());
        a.push(
            json!({"method": "ngram", "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
                   "prompt_lookup_max": 3, "prompt_lookup_min": 1})
            .to_string(),
        );
    }
    a
}

/// How a scheduler leg runs `play`: random tokens, the small engine's pacing and flags.
pub(crate) fn engine_setup(spec: bool) -> EngineSetup {
    EngineSetup {
        tokens: "random",
        ttft_ms: TTFT_MS,
        itl_ms: ITL_MS,
        extra: engine_args(spec),
    }
}
