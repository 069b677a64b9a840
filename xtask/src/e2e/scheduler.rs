//! The scheduler legs: one real frontend with `vllm-vcr play` configured as a small, loaded
//! engine (4 sequences, 64 KV blocks of 16 tokens, one LoRA slot, speculative decoding),
//! checked over HTTP for what a user of a loaded vLLM engine observes: prefix-cache hits,
//! a queue that builds and drains, KV preemption that still completes every request,
//! logprobs, the LoRA scheduling gauge and the spec-decode counters.
//!
//! Tokens are random here (not echo), so the checks assert counts, finish reasons and
//! metrics, never text; `ignore_eos` makes every completion-token count exact. With the tiny
//! model's byte tokenizer an ASCII prompt of N bytes is N tokens.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};

use crate::e2e::checks::{
    Check, Ctx, check, engine_log_clean, frontend_log_clean, metric, metrics, poll, post_json,
    usage,
};
use crate::e2e::load::*;
use crate::http::{Sample, metric_sum, snippet};

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

/// The scheduler checks; `lora` when the frontend loaded the two adapters.
pub fn checks(lora: bool) -> Vec<Check> {
    let mut v = vec![
        check("prefix-cache-hit", prefix_cache_hit),
        check("logprobs", logprobs),
        check("queue-builds-and-drains", queue_builds_and_drains),
        check("kv-preemption", kv_preemption),
    ];
    if lora {
        v.push(check("lora-info", lora_info));
        v.push(check("lora-waiting-deferred", lora_waiting_deferred));
    }
    v.push(check("spec-decode-metrics", spec_decode_metrics));
    v.push(check("frontend-log-clean", frontend_log_clean));
    v.push(check("engine-log-clean", engine_log_clean));
    v
}

// ---------------------------------------------------------------- checks

/// Same long prompt twice: the second finds all its full blocks but the last token's in
/// the prefix cache (vLLM never caches the block holding the last prompt token's KV it
/// must recompute: at most `prompt_len - 1` tokens, in whole blocks).
fn prefix_cache_hit(ctx: &Ctx) -> Result<String> {
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

fn logprob_value(v: &Value, what: &str) -> Result<f64> {
    let x = v
        .as_f64()
        .with_context(|| format!("{what} is not a number: {v}"))?;
    ensure!(x <= 0.0, "{what} = {x} > 0");
    Ok(x)
}

/// `choices[0].logprobs` of a completion with `logprobs: k` and token ids as keys.
fn check_completion_logprobs(v: &Value, n: usize, k: usize) -> Result<()> {
    let lp = &v["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().with_context(|| {
        format!(
            "no choices[0].logprobs.tokens in {}",
            snippet(&v.to_string())
        )
    })?;
    let token_lps = lp["token_logprobs"]
        .as_array()
        .context("no logprobs.token_logprobs")?;
    let tops = lp["top_logprobs"]
        .as_array()
        .context("no logprobs.top_logprobs")?;
    ensure!(
        tokens.len() == n && token_lps.len() == n && tops.len() == n,
        "{} tokens, {} token_logprobs, {} top_logprobs for {n} generated tokens",
        tokens.len(),
        token_lps.len(),
        tops.len()
    );
    for i in 0..n {
        let tok = tokens[i].as_str().context("token is not a string")?;
        let lp = logprob_value(&token_lps[i], &format!("token_logprobs[{i}]"))?;
        let top = tops[i]
            .as_object()
            .with_context(|| format!("top_logprobs[{i}] is not an object: {}", tops[i]))?;
        for (t, x) in top {
            logprob_value(x, &format!("top_logprobs[{i}][{t:?}]"))?;
        }
        let own = top
            .get(tok)
            .with_context(|| format!("top_logprobs[{i}] lacks the sampled token {tok:?}"))?
            .as_f64()
            .unwrap_or(f64::NAN);
        ensure!(
            own == lp,
            "top_logprobs[{i}][{tok:?}] = {own} but token_logprobs[{i}] = {lp}"
        );
        // the sampled token plus the top k: k entries when it is among them, k + 1 when
        // it is not (then it is the least likely of them)
        let outside =
            top.len() == k + 1 && top.values().filter_map(Value::as_f64).all(|x| x >= own);
        ensure!(
            top.len() == k || outside,
            "top_logprobs[{i}] has {} entries, want {k} (or {} with the sampled token outside the top {k}): {}",
            top.len(),
            k + 1,
            tops[i]
        );
    }
    Ok(())
}

/// One `logprobs.content[i]` of a chat response with `top_logprobs: k`. Both frontends
/// list the first k of the engine's row: the sampled token, then the most likely others in
/// descending order (the sampled one not repeated).
fn check_chat_entry(e: &Value, i: usize, k: usize) -> Result<()> {
    let own = logprob_value(&e["logprob"], &format!("content[{i}].logprob"))?;
    let top = e["top_logprobs"]
        .as_array()
        .with_context(|| format!("content[{i}] has no top_logprobs: {e}"))?;
    ensure!(
        top.len() == k,
        "content[{i}].top_logprobs has {} entries, want {k}: {}",
        top.len(),
        snippet(&e.to_string())
    );
    ensure!(
        top[0]["token"] == e["token"] && top[0]["logprob"].as_f64() == Some(own),
        "content[{i}].top_logprobs[0] is not the sampled token: {}",
        snippet(&e.to_string())
    );
    let mut prev = 0.0f64;
    for (j, t) in top.iter().enumerate() {
        ensure!(
            t["token"].is_string(),
            "content[{i}].top_logprobs[{j}] has no token"
        );
        let x = logprob_value(
            &t["logprob"],
            &format!("content[{i}].top_logprobs[{j}].logprob"),
        )?;
        ensure!(
            j < 2 || x <= prev,
            "content[{i}].top_logprobs after the sampled token not in descending order: {}",
            snippet(&e.to_string())
        );
        prev = x;
    }
    Ok(())
}

fn logprobs(ctx: &Ctx) -> Result<String> {
    const N: u64 = 8;
    const K: usize = 3;
    // token ids as keys: byte tokens that are not UTF-8 on their own would otherwise all
    // decode to the same key and merge in the completions dict
    let v = post_json(
        ctx,
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "Hello", "max_tokens": N, "ignore_eos": true,
                "logprobs": K, "return_tokens_as_token_ids": true}),
    )?;
    ensure!(usage(&v)?.1 == N, "usage.completion_tokens != {N}");
    check_completion_logprobs(&v, N as usize, K).context("completions")?;

    let chat_body = |stream: bool| {
        json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
               "max_tokens": N, "ignore_eos": true, "logprobs": true, "top_logprobs": K,
               "stream": stream})
    };
    let v = post_json(ctx, "/v1/chat/completions", &chat_body(false))?;
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .with_context(|| {
            format!(
                "chat: no choices[0].logprobs.content in {}",
                snippet(&v.to_string())
            )
        })?;
    ensure!(
        content.len() as u64 == N,
        "chat: {} logprobs.content entries for {N} tokens",
        content.len()
    );
    for (i, e) in content.iter().enumerate() {
        check_chat_entry(e, i, K).context("chat")?;
    }

    let mut s = ctx
        .http
        .post_sse("/v1/chat/completions", &chat_body(true))?;
    if s.status != 200 {
        let status = s.status;
        bail!("chat stream: HTTP {status} {}", snippet(&s.rest()));
    }
    let mut entries = Vec::new();
    let mut chunks = 0;
    while let Some(data) = s.next_data()? {
        if data.trim() == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(&data)
            .with_context(|| format!("chat stream: event is not JSON: {}", snippet(&data)))?;
        ensure!(
            v.get("error").is_none(),
            "chat stream: error event {}",
            snippet(&data)
        );
        chunks += 1;
        for c in v["choices"].as_array().into_iter().flatten() {
            if let Some(a) = c["logprobs"]["content"].as_array() {
                entries.extend(a.iter().cloned());
            }
        }
    }
    ensure!(
        entries.len() as u64 == N,
        "chat stream: {} logprobs.content entries over {chunks} chunks for {N} tokens",
        entries.len()
    );
    for (i, e) in entries.iter().enumerate() {
        check_chat_entry(e, i, K).context("chat stream")?;
    }
    Ok(format!(
        "completions: {N} tokens, each with the sampled token and {K} alternatives (or {} when it is outside the top {K}); chat and chat stream ({chunks} chunks): {N} entries x {K} top_logprobs (sampled first, then descending), all <= 0",
        K + 1
    ))
}

fn queue_builds_and_drains(ctx: &Ctx) -> Result<String> {
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

fn kv_preemption(ctx: &Ctx) -> Result<String> {
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

/// Requests for l1 and l2 at once, `per_adapter` each, `max_tokens` 60; the distinct
/// `(running, waiting)` label pairs of `vllm:lora_requests_info` seen meanwhile (samples
/// stamped after the load began: the Python frontend keeps every label set it ever
/// exported, its value the time it was last current), and the by-reason waiting gauges.
fn lora_load(ctx: &Ctx, per_adapter: usize) -> Result<(Vec<(String, String)>, Observed)> {
    const MAX_TOKENS: u64 = 60;
    let r = ctx.http.get("/v1/models")?;
    ensure!(r.status == 200, "GET /v1/models: HTTP {}", r.status);
    let models = r.json()?;
    let ids: Vec<&str> = models["data"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["id"].as_str())
        .collect();
    for (name, _) in LORAS {
        ensure!(
            ids.contains(&name),
            "/v1/models lists {ids:?}, not the adapter {name}"
        );
    }
    let start = now_unix() - 0.05;
    let watch = [
        "vllm:lora_requests_info",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_requests_waiting_by_reason",
    ];
    let (results, obs) = while_polling(ctx, &watch, || {
        concurrently(2 * per_adapter, |i| {
            let adapter = LORAS[i % 2].0;
            completion_exact(
                ctx,
                adapter,
                &prompt_of(&format!("lora {i:02}: "), 20),
                MAX_TOKENS,
            )
        })
    });
    all_ok("LoRA requests", results)?;
    obs.ensure_polled()?;
    let mut seen: Vec<(String, String)> = Vec::new();
    for p in &obs.polls {
        for s in p
            .iter()
            .filter(|s| s.name == "vllm:lora_requests_info" && s.value >= start)
        {
            let pair = (
                label(s, "running_lora_adapters").to_string(),
                label(s, "waiting_lora_adapters").to_string(),
            );
            if !seen.contains(&pair) {
                seen.push(pair);
            }
        }
    }
    Ok((seen, obs))
}

fn adapters(list: &str) -> Vec<&str> {
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect()
}

fn lora_info(ctx: &Ctx) -> Result<String> {
    const PER: usize = 4;
    let (seen, obs) = lora_load(ctx, PER)?;
    let show = |seen: &[(String, String)]| {
        seen.iter()
            .map(|(r, w)| format!("running={r:?} waiting={w:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    ensure!(
        !seen.is_empty(),
        "vllm:lora_requests_info never current during the load ({} polls)",
        obs.polls.len()
    );
    // one adapter running while the other waits; shown: a state where only the other waits
    // if there is one (the running adapter may have queued requests of its own too)
    let other_waits = |(r, w): &&(String, String), only: bool| {
        let running = adapters(r);
        let waiting = adapters(w);
        !running.is_empty()
            && if only {
                !waiting.is_empty() && waiting.iter().all(|a| !running.contains(a))
            } else {
                waiting.iter().any(|a| !running.contains(a))
            }
    };
    let both = seen
        .iter()
        .find(|p| other_waits(p, true))
        .or_else(|| seen.iter().find(|p| other_waits(p, false)));
    let Some((r, w)) = both else {
        bail!(
            "with --max-loras {MAX_LORAS} no state had one adapter running and the other waiting; seen: {}",
            show(&seen)
        );
    };
    ensure!(
        seen.iter()
            .all(|(r, _)| adapters(r).len() <= MAX_LORAS as usize),
        "more than --max-loras {MAX_LORAS} adapters running at once: {}",
        show(&seen)
    );
    wait_idle(ctx)?;
    Ok(format!(
        "/v1/models lists l1, l2; {PER}+{PER} requests all 60 tokens; e.g. running_lora_adapters={r:?} waiting_lora_adapters={w:?}; {} states seen over {} polls",
        seen.len(),
        obs.polls.len()
    ))
}

/// vLLM counts a request the LoRA budget holds back (a free batch slot, but its adapter is
/// not the running one) as waiting with reason "deferred", not "capacity".
fn lora_waiting_deferred(ctx: &Ctx) -> Result<String> {
    // three of each: one adapter's three run, the batch has a free slot, the other's wait
    const PER: usize = 3;
    let (_, obs) = lora_load(ctx, PER)?;
    let mut worst = (0.0, 0.0, 0.0, 0.0);
    for p in &obs.polls {
        let running = metric(p, "vllm:num_requests_running", &[]);
        let waiting = metric(p, "vllm:num_requests_waiting", &[]);
        let deferred = metric(
            p,
            "vllm:num_requests_waiting_by_reason",
            &[("reason", "deferred")],
        );
        let capacity = metric(
            p,
            "vllm:num_requests_waiting_by_reason",
            &[("reason", "capacity")],
        );
        if waiting > 0.0 && running > 0.0 && running < MAX_NUM_SEQS as f64 {
            if deferred > 0.0 {
                wait_idle(ctx)?;
                return Ok(format!(
                    "running {running} < max-num-seqs {MAX_NUM_SEQS}, waiting {waiting}: by reason deferred {deferred}, capacity {capacity}"
                ));
            }
            worst = (running, waiting, deferred, capacity);
        }
    }
    ensure!(
        worst.1 > 0.0,
        "no poll (of {}) saw requests waiting beside a free batch slot",
        obs.polls.len()
    );
    bail!(
        "running {} < max-num-seqs {MAX_NUM_SEQS} with {} waiting on the LoRA budget, but vllm:num_requests_waiting_by_reason has deferred {}, capacity {} (vLLM counts LoRA-skipped requests as deferred: SchedulerStats.num_skipped_waiting_reqs)",
        worst.0,
        worst.1,
        worst.2,
        worst.3
    )
}

fn spec_decode_metrics(ctx: &Ctx) -> Result<String> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn adapter_lists() {
        assert_eq!(adapters(""), Vec::<&str>::new());
        assert_eq!(adapters("l1"), vec!["l1"]);
        assert_eq!(adapters("l2,l1"), vec!["l2", "l1"]);
    }

    fn completion_with(top: Value) -> Value {
        json!({"choices": [{"logprobs": {
            "tokens": ["token_id:5"], "token_logprobs": [-1.5], "top_logprobs": [top]}}]})
    }

    #[test]
    fn completion_logprobs_rows() {
        // sampled token among the top 3: 3 entries
        let ok =
            completion_with(json!({"token_id:5": -1.5, "token_id:7": -0.5, "token_id:9": -2.0}));
        check_completion_logprobs(&ok, 1, 3).unwrap();
        // outside the top 3: the 3 best plus the sampled one, which is the least likely
        let ok = completion_with(json!({"token_id:5": -1.5, "token_id:7": -0.5,
                                        "token_id:8": -0.9, "token_id:9": -1.2}));
        check_completion_logprobs(&ok, 1, 3).unwrap();
        let few = completion_with(json!({"token_id:5": -1.5, "token_id:7": -0.5}));
        assert!(check_completion_logprobs(&few, 1, 3).is_err());
        let no_sampled =
            completion_with(json!({"token_id:6": -1.5, "token_id:7": -0.5, "token_id:9": -2.0}));
        assert!(check_completion_logprobs(&no_sampled, 1, 3).is_err());
        let positive =
            completion_with(json!({"token_id:5": -1.5, "token_id:7": 0.5, "token_id:9": -2.0}));
        assert!(check_completion_logprobs(&positive, 1, 3).is_err());
        assert!(check_completion_logprobs(&ok, 2, 3).is_err());
    }

    #[test]
    fn chat_logprob_entries() {
        let e = |top: Value| json!({"token": "a", "logprob": -1.0, "top_logprobs": top});
        let ok = e(
            json!([{"token": "a", "logprob": -1.0}, {"token": "b", "logprob": -0.5},
                          {"token": "c", "logprob": -2.0}]),
        );
        check_chat_entry(&ok, 0, 3).unwrap();
        let not_first = e(
            json!([{"token": "b", "logprob": -0.5}, {"token": "a", "logprob": -1.0},
                                 {"token": "c", "logprob": -2.0}]),
        );
        assert!(check_chat_entry(&not_first, 0, 3).is_err());
        let unsorted = e(
            json!([{"token": "a", "logprob": -1.0}, {"token": "c", "logprob": -2.0},
                                {"token": "b", "logprob": -0.5}]),
        );
        assert!(check_chat_entry(&unsorted, 0, 3).is_err());
        let short = e(json!([{"token": "a", "logprob": -1.0}]));
        assert!(check_chat_entry(&short, 0, 3).is_err());
    }

    #[test]
    fn line_versions() {
        assert!(crate::e2e::basic::line_at_least("0.33", (0, 30)));
        assert!(crate::e2e::basic::line_at_least("0.30", (0, 30)));
        assert!(!crate::e2e::basic::line_at_least("0.29", (0, 30)));
        assert!(crate::e2e::basic::line_at_least("1.0", (0, 30)));
    }
}
