//! The logprobs check of the scheduler legs: completion and chat logprobs with the sampled
//! token and the top-k alternatives, well-formed and sorted.

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};

use crate::e2e::checks::{Ctx, post_json, usage};
use crate::http::snippet;

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

pub(crate) fn logprobs(ctx: &Ctx) -> Result<String> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
