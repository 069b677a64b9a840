//! The scheduler checks of KV-cache and queue pressure: prefix-cache hits, a queue that
//! builds and drains, and KV preemption that still completes every request.

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use serde_json::Value;

use crate::e2e::checks::{Ctx, metric, metrics, poll};
use crate::e2e::load::*;
use crate::e2e::scheduler::config::{BLOCK_SIZE, MAX_NUM_SEQS, NUM_GPU_BLOCKS};
use crate::http::{Sample, metric_sum};

/// Same long prompt twice: the second finds all its full blocks but the last token's in
/// the prefix cache (vLLM never caches the block holding the last prompt token's KV it
/// must recompute: at most `prompt_len - 1` tokens, in whole blocks).
pub(crate) fn prefix_cache_hit(ctx: &Ctx) -> Result<String> {
    const LEN: usize = 420;
    const MIN_HITS: f64 = 384.0; // 24 full blocks of 16
    let want_hits = (BLOCK_SIZE * ((LEN as u64 - 1) / BLOCK_SIZE)) as f64;
    let prompt = prompt_of("prefix-cache check. ", LEN);
    let names = [
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prompt_tokens_cached_total",
    ];
    let read = |m: &[Sample]| names.map(|n| metric(m, n, &[]));
    let m0 = metrics(ctx)?;
    // vllm-rs exports prompt_tokens_cached_total only once a request has run: checked
    // after the requests instead
    for n in &names[..2] {
        ensure!(metric_sum(&m0, n, &[]).is_some(), "/metrics has no {n}");
    }
    let b0 = read(&m0);

    let cached = |v: &Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    let first = completion_exact(ctx, "tiny", &prompt, 4)?;
    // the counters move when the engine's stats for the request's steps reach the frontend
    let b1 = poll(Duration::from_secs(3), || {
        let now = read(&metrics(ctx).map_err(|e| e.to_string())?);
        if now[1] - b0[1] >= LEN as f64 {
            Ok(Some(now))
        } else {
            Err(format!(
                "prefix_cache_queries_total +{}, want +{LEN}",
                now[1] - b0[1]
            ))
        }
    })?;
    ensure!(
        b1[0] == b0[0],
        "the first (fresh) prompt already hit the prefix cache: prefix_cache_hits_total +{}",
        b1[0] - b0[0]
    );
    if let Some(c) = cached(&first) {
        ensure!(
            c == 0,
            "first request: usage.prompt_tokens_details.cached_tokens {c}, want 0"
        );
    }

    let second = completion_exact(ctx, "tiny", &prompt, 4)?;
    let d = poll(Duration::from_secs(3), || {
        let m = metrics(ctx).map_err(|e| e.to_string())?;
        if metric_sum(&m, names[2], &[]).is_none() {
            return Err(format!("/metrics has no {}", names[2]));
        }
        let now = read(&m);
        let d = [now[0] - b1[0], now[1] - b1[1], now[2] - b1[2]];
        if d[1] >= LEN as f64 && d[0] >= MIN_HITS && d[2] > 0.0 {
            Ok(Some(d))
        } else {
            Err(format!(
                "after the second request: prefix_cache_hits_total +{}, prefix_cache_queries_total +{}, prompt_tokens_cached_total +{} (want hits >= {MIN_HITS}, cached > 0)",
                d[0], d[1], d[2]
            ))
        }
    })?;
    ensure!(
        d[0] <= (LEN - 1) as f64,
        "prefix_cache_hits_total +{} for a {LEN}-token prompt (at most {} can hit)",
        d[0],
        LEN - 1
    );
    ensure!(
        d[2] == d[0],
        "prompt_tokens_cached_total +{} != prefix_cache_hits_total +{}",
        d[2],
        d[0]
    );
    let details = match cached(&second) {
        Some(c) => {
            ensure!(
                c as f64 == d[0],
                "usage.prompt_tokens_details.cached_tokens {c} != prefix_cache_hits_total +{}",
                d[0]
            );
            format!("; usage cached_tokens 0 then {c}")
        }
        None => "; the frontend reports no usage.prompt_tokens_details.cached_tokens".into(),
    };
    let exact = if d[0] == want_hits {
        format!(" (= {}, every full block)", want_hits)
    } else {
        format!(" (every full block would be {want_hits})")
    };
    Ok(format!(
        "{LEN}-token prompt twice: 2nd hits +{}{exact}, prompt_tokens_cached_total +{}{details}",
        d[0], d[2]
    ))
}

pub(crate) fn queue_builds_and_drains(ctx: &Ctx) -> Result<String> {
    const N: usize = 16;
    const MAX_TOKENS: u64 = 40;
    let watch = ["vllm:num_requests_running", "vllm:num_requests_waiting"];
    let t = Instant::now();
    let (results, obs) = while_polling(ctx, &watch, || {
        concurrently(N, |i| {
            completion_exact(
                ctx,
                "tiny",
                &prompt_of(&format!("queue {i:02}: "), 24),
                MAX_TOKENS,
            )
        })
    });
    let load = t.elapsed();
    all_ok("requests", results)?;
    obs.ensure_polled()?;
    let max_running = obs.max("vllm:num_requests_running", &[]);
    let max_waiting = obs.max("vllm:num_requests_waiting", &[]);
    ensure!(
        max_waiting > 0.0,
        "vllm:num_requests_waiting never above 0 over {} polls while {N} requests met max-num-seqs {MAX_NUM_SEQS}",
        obs.polls.len()
    );
    ensure!(
        max_running <= MAX_NUM_SEQS as f64,
        "vllm:num_requests_running reached {max_running} > max-num-seqs {MAX_NUM_SEQS}"
    );
    ensure!(
        max_running == MAX_NUM_SEQS as f64,
        "vllm:num_requests_running peaked at {max_running}: the batch never filled to max-num-seqs {MAX_NUM_SEQS} with {N} requests queued"
    );
    let idle = wait_idle(ctx)?;
    Ok(format!(
        "{N} x {MAX_TOKENS} tokens in {:.2} s, all finish length; over {} polls running peaked at {max_running} (max-num-seqs {MAX_NUM_SEQS}), waiting at {max_waiting}; running and waiting 0 {:.0} ms later",
        load.as_secs_f64(),
        obs.polls.len(),
        idle.as_secs_f64() * 1e3
    ))
}

pub(crate) fn kv_preemption(ctx: &Ctx) -> Result<String> {
    const N: usize = 4;
    const PROMPT: usize = 300;
    const MAX_TOKENS: u64 = 200;
    let before = metrics(ctx)?;
    ensure!(
        metric_sum(&before, "vllm:num_preemptions_total", &[]).is_some(),
        "/metrics has no vllm:num_preemptions_total"
    );
    let p0 = metric(&before, "vllm:num_preemptions_total", &[]);
    let watch = [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
    ];
    let t = Instant::now();
    let (results, obs) = while_polling(ctx, &watch, || {
        concurrently(N, |i| {
            completion_exact(
                ctx,
                "tiny",
                &prompt_of(&format!("preemption {i:02}: "), PROMPT),
                MAX_TOKENS,
            )
        })
    });
    let load = t.elapsed();
    all_ok("requests", results)?;
    let preemptions = poll(Duration::from_secs(3), || {
        let m = metrics(ctx).map_err(|e| e.to_string())?;
        let d = metric(&m, "vllm:num_preemptions_total", &[]) - p0;
        if d > 0.0 {
            Ok(Some(d))
        } else {
            Err(format!(
                "vllm:num_preemptions_total +{d}: {N} requests of {PROMPT}+{MAX_TOKENS} tokens need {} blocks of {BLOCK_SIZE}, the engine has {NUM_GPU_BLOCKS}, yet nothing was preempted",
                N as u64 * (PROMPT as u64 + MAX_TOKENS).div_ceil(BLOCK_SIZE)
            ))
        }
    })?;
    let idle = wait_idle(ctx)?;
    let usage = obs.max("vllm:kv_cache_usage_perc", &[]);
    Ok(format!(
        "{N} x ({PROMPT} prompt + {MAX_TOKENS}) tokens in {:.2} s over {NUM_GPU_BLOCKS} blocks: num_preemptions_total +{preemptions}, every request {MAX_TOKENS} tokens, finish length; peak kv_cache_usage_perc {}, waiting peak {}; idle {:.0} ms later",
        load.as_secs_f64(),
        if usage.is_finite() {
            format!("{usage:.2}")
        } else {
            "n/a".into()
        },
        obs.max("vllm:num_requests_waiting", &[]),
        idle.as_secs_f64() * 1e3
    ))
}
