//! The speculative-decoding check of the scheduler legs: the `vllm:spec_decode_*`
//! counters move as the engine's acceptance rate says.

use std::time::Duration;

use anyhow::{Result, ensure};

use crate::e2e::checks::{Ctx, metric, metrics, poll};
use crate::e2e::load::*;
use crate::e2e::scheduler::config::{
    NUM_SPECULATIVE_TOKENS, SPEC_FLAG, SPECULATIVE_ACCEPTANCE_RATE,
};
use crate::http::{Sample, metric_sum};

pub(crate) fn spec_decode_metrics(ctx: &Ctx) -> Result<String> {
    ensure!(
        ctx.engine_spec_decode,
        "engine lacks {SPEC_FLAG} (`vllm-vcr play --help` does not list it)"
    );
    const N: usize = 4;
    const MAX_TOKENS: u64 = 100;
    const DRAFTS: &str = "vllm:spec_decode_num_drafts_total";
    const DRAFT_TOKENS: &str = "vllm:spec_decode_num_draft_tokens_total";
    const ACCEPTED: &str = "vllm:spec_decode_num_accepted_tokens_total";
    const PER_POS: &str = "vllm:spec_decode_num_accepted_tokens_per_pos_total";
    const GEN: &str = "vllm:generation_tokens_total";
    let per_pos = |m: &[Sample]| -> Vec<f64> {
        (0..NUM_SPECULATIVE_TOKENS)
            .map(|i| metric(m, PER_POS, &[("position", &i.to_string())]))
            .collect()
    };
    let before = metrics(ctx)?;
    for n in [DRAFTS, DRAFT_TOKENS, ACCEPTED] {
        ensure!(metric_sum(&before, n, &[]).is_some(), "/metrics has no {n}");
    }
    let read = |m: &[Sample]| [DRAFTS, DRAFT_TOKENS, ACCEPTED, GEN].map(|n| metric(m, n, &[]));
    let b = read(&before);
    let bp = per_pos(&before);
    all_ok(
        "requests",
        concurrently(N, |i| {
            completion_exact(
                ctx,
                "tiny",
                &prompt_of(&format!("spec {i:02}: "), 20),
                MAX_TOKENS,
            )
        }),
    )?;
    let want_gen = (N as u64 * MAX_TOKENS) as f64;
    let (d, dp) = poll(Duration::from_secs(3), || {
        let m = metrics(ctx).map_err(|e| e.to_string())?;
        let now = read(&m);
        let d = [now[0] - b[0], now[1] - b[1], now[2] - b[2], now[3] - b[3]];
        if d[3] >= want_gen {
            let dp: Vec<f64> = per_pos(&m).iter().zip(&bp).map(|(a, b)| a - b).collect();
            Ok(Some((d, dp)))
        } else {
            Err(format!(
                "generation_tokens_total +{}, want +{want_gen}",
                d[3]
            ))
        }
    })?;
    let [drafts, draft_tokens, accepted, generated] = d;
    ensure!(
        drafts > 0.0 && draft_tokens > 0.0,
        "after {N} x {MAX_TOKENS} tokens with {SPEC_FLAG} {NUM_SPECULATIVE_TOKENS}: {DRAFTS} +{drafts}, {DRAFT_TOKENS} +{draft_tokens}"
    );
    ensure!(
        draft_tokens <= drafts * NUM_SPECULATIVE_TOKENS as f64,
        "{draft_tokens} draft tokens in {drafts} drafts of at most {NUM_SPECULATIVE_TOKENS}"
    );
    ensure!(
        accepted <= draft_tokens,
        "accepted {accepted} > draft tokens {draft_tokens}"
    );
    // Accepted / draft tokens: with each position accepted with p only after the ones
    // before it, E = (p + p^2 + p^3) / 3 = 0.392 for p = 0.6. Tolerance: [0.2, 0.95].
    let rate = accepted / draft_tokens;
    ensure!(
        (0.2..=0.95).contains(&rate),
        "acceptance {accepted}/{draft_tokens} = {rate:.3} outside [0.2, 0.95] (configured {SPECULATIVE_ACCEPTANCE_RATE})"
    );
    let mut pos_detail = String::new();
    if dp.iter().sum::<f64>() > 0.0 {
        ensure!(
            dp.windows(2).all(|w| w[0] >= w[1]),
            "accepted tokens per position {dp:?} grow with the position (a draft token is accepted only after every earlier one)"
        );
        ensure!(
            dp.iter().sum::<f64>() == accepted,
            "accepted tokens per position {dp:?} do not add up to {accepted}"
        );
        // Conditional acceptance: position i is tried when i-1 was accepted. Estimates the
        // configured per-token rate; tolerance ±0.2 (thousands of trials at 0.6).
        let tried: f64 = drafts + dp[..dp.len() - 1].iter().sum::<f64>();
        let p = accepted / tried;
        ensure!(
            (SPECULATIVE_ACCEPTANCE_RATE - 0.2..=SPECULATIVE_ACCEPTANCE_RATE + 0.2).contains(&p),
            "per-position acceptance {accepted}/{tried} = {p:.3}, configured {SPECULATIVE_ACCEPTANCE_RATE} (tolerance ±0.2); per position {dp:?} over {drafts} drafts"
        );
        pos_detail = format!("; per position {dp:?}, conditional acceptance {p:.3}");
    }
    Ok(format!(
        "{N} x {MAX_TOKENS} tokens: drafts +{drafts}, draft tokens +{draft_tokens}, accepted +{accepted} (rate {rate:.3}; accepted [0.2, 0.95], {:.3} expected){pos_detail}; {:.2} tokens per verify step",
        (1..=NUM_SPECULATIVE_TOKENS)
            .map(|i| SPECULATIVE_ACCEPTANCE_RATE.powi(i as i32))
            .sum::<f64>()
            / NUM_SPECULATIVE_TOKENS as f64,
        (generated - N as f64) / drafts
    ))
}
