//! The scheduler legs: one real frontend with `vllm-vcr play` configured as a small, loaded
//! engine (4 sequences, 64 KV blocks of 16 tokens, one LoRA slot, speculative decoding),
//! checked over HTTP for what a user of a loaded vLLM engine observes: prefix-cache hits,
//! a queue that builds and drains, KV preemption that still completes every request,
//! logprobs, the LoRA scheduling gauge and the spec-decode counters.
//!
//! Tokens are random here (not echo), so the checks assert counts, finish reasons and
//! metrics, never text; `ignore_eos` makes every completion-token count exact. With the tiny
//! model's byte tokenizer an ASCII prompt of N bytes is N tokens.
//!
//! [`config`] holds the engine and frontend flags; the checks live by what they watch:
//! [`kv`] (prefix cache, queue, preemption), [`logprobs`], [`lora`] and [`spec`].

mod config;
mod kv;
mod logprobs;
mod lora;
mod spec;

pub(crate) use config::SPEC_FLAG;

use crate::e2e::basic::{Leg, line_at_least};
use crate::e2e::checks::{Check, check, engine_log_clean, frontend_log_clean};
use crate::e2e::scheduler::config::{
    BLOCK_SIZE, ITL_MS, MAX_LORAS, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, NUM_GPU_BLOCKS,
    NUM_SPECULATIVE_TOKENS, SPECULATIVE_ACCEPTANCE_RATE, TTFT_MS, engine_setup,
    python_frontend_args, rs_frontend_args,
};
use crate::e2e::select::Frontends;
use crate::stack::frontend::Frontend;

/// The scheduler legs: vllm-rs of the default line (when selected) and the Python frontend
/// (when asked for). `spec`: the engine has [`SPEC_FLAG`], so it speculates.
pub(crate) fn legs(fe: &Frontends, spec: bool) -> Vec<Leg> {
    let spec_note = if spec {
        format!("spec decode {NUM_SPECULATIVE_TOKENS} @ {SPECULATIVE_ACCEPTANCE_RATE}")
    } else {
        format!("the engine lacks {SPEC_FLAG}: no spec decode")
    };
    let sched_note = format!(
        "scheduler: random tokens, max-num-seqs {MAX_NUM_SEQS}, {NUM_GPU_BLOCKS} blocks x {BLOCK_SIZE}, max-num-batched-tokens {MAX_NUM_BATCHED_TOKENS}, ttft {TTFT_MS} ms, itl {ITL_MS} ms, max-loras {MAX_LORAS}, {spec_note}",
    );
    let mut legs = Vec::new();
    if let Some(line) = fe.rs_default() {
        // vllm-rs loads --lora-modules (add_lora at startup) from 0.30 on
        let lora = line_at_least(&line.line, (0, 30));
        legs.push(Leg {
            name: format!("vllm-rs {} scheduler", line.tag),
            note: if lora {
                format!("{sched_note}; LoRA l1, l2")
            } else {
                format!(
                    "{sched_note}; no LoRA checks: vllm-rs {} has no --lora-modules",
                    line.tag
                )
            },
            line: line.line.clone(),
            frontend: Frontend::Rs {
                bin: fe.rs_bin(line),
            },
            frontend_args: rs_frontend_args(lora),
            engine: engine_setup(spec),
            checks: checks(lora),
        });
    }
    if let Some(py) = &fe.python {
        legs.push(Leg {
            name: format!("python {} scheduler", py.version),
            note: format!(
                "{sched_note}; one API server, --enable-lora l1, l2{}",
                if spec {
                    ", --speculative-config ngram (the frontend exports spec-decode metrics only then)"
                } else {
                    ""
                }
            ),
            line: py.line.clone(),
            frontend: Frontend::Python {
                venv: py.venv.clone(),
                api_servers: 1,
                dev_mode: false,
            },
            frontend_args: python_frontend_args(spec),
            engine: engine_setup(spec),
            checks: checks(true),
        });
    }
    legs
}

/// The scheduler checks; `lora` when the frontend loaded the two adapters.
pub fn checks(lora: bool) -> Vec<Check> {
    let mut v = vec![
        check("prefix-cache-hit", kv::prefix_cache_hit),
        check("logprobs", logprobs::logprobs),
        check("queue-builds-and-drains", kv::queue_builds_and_drains),
        check("kv-preemption", kv::kv_preemption),
    ];
    if lora {
        v.push(check("lora-info", lora::lora_info));
        v.push(check("lora-waiting-deferred", lora::lora_waiting_deferred));
    }
    v.push(check("spec-decode-metrics", spec::spec_decode_metrics));
    v.push(check("frontend-log-clean", frontend_log_clean));
    v.push(check("engine-log-clean", engine_log_clean));
    v
}

#[cfg(test)]
mod tests {

    use crate::e2e::load::prompt_of;

    #[test]
    fn prompts_have_the_exact_length() {
        for len in [1, 20, 300, 420] {
            let p = prompt_of("head: ", len);
            assert_eq!(p.len(), len);
            assert!(p.is_ascii());
        }
        assert!(prompt_of("preemption 00: ", 300) != prompt_of("preemption 01: ", 300));
    }

    #[test]
    fn line_versions() {
        assert!(crate::e2e::basic::line_at_least("0.33", (0, 30)));
        assert!(crate::e2e::basic::line_at_least("0.30", (0, 30)));
        assert!(!crate::e2e::basic::line_at_least("0.29", (0, 30)));
        assert!(crate::e2e::basic::line_at_least("1.0", (0, 30)));
    }
}
