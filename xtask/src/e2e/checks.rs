//! The e2e checks: what a user of the real frontend observes with `vllm-vcr play --tokens
//! echo` behind it.
//!
//! Echo makes every answer deterministic: the engine emits the prompt's token ids back in
//! order, then EOS (`<|im_end|>`, id 2). With the tiny model's byte-level tokenizer a
//! completion prompt of N bytes is N tokens, so "Hello world" (11 tokens) with
//! `max_tokens: 5` returns "Hello" (finish "length"), and with a larger budget returns
//! "Hello world" plus EOS (finish "stop", 12 completion tokens). Under `ignore_eos` the echo
//! wraps around the prompt.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};
use vcr_host::child::{log_len, read_log, read_log_from};
use vcr_host::tiny_model::encode_text;

use crate::http::{Client, metric_sum, parse_metrics, snippet};
use crate::stack::frontend::Kind;

/// Everything a check needs.
pub struct Ctx {
    pub http: Client,
    pub frontend_log: PathBuf,
    pub engine_log: PathBuf,
    pub kind: Kind,
    /// The engine's configured time to first token.
    pub ttft: Duration,
    /// Whether the engine has `--num-speculative-tokens` (the spec-decode check fails
    /// without it).
    pub engine_spec_decode: bool,
}

/// A named check; `Ok(detail)` passes, `Err(reason)` fails.
pub struct Check {
    pub name: &'static str,
    pub run: fn(&Ctx) -> Result<String>,
}

pub(crate) const fn check(name: &'static str, run: fn(&Ctx) -> Result<String>) -> Check {
    Check { name, run }
}

const PROMPT: &str = "Hello world";

/// The full set, in an order where the metric deltas are not disturbed by a request of an
/// earlier check still in flight.
pub fn full_set() -> Vec<Check> {
    vec![
        check("models", models),
        check("completion-length", completion_length),
        check("completion-eos-stop", completion_eos_stop),
        check("completion-stream", completion_stream),
        check("chat", chat),
        check("chat-stream", chat_stream),
        check("stop-token-ids", stop_token_ids),
        check("stop-string-abort", stop_string_abort),
        check("ignore-eos-wraps", ignore_eos_wraps),
        check("n-2", n_two),
        check("metrics-counters", metrics_counters),
        check("ttft-histogram", ttft_histogram),
        check("prompt-too-long", prompt_too_long),
        check("client-disconnect", client_disconnect),
        check("concurrent-64", concurrent_64),
        check("frontend-log-clean", frontend_log_clean),
        check("engine-log-clean", engine_log_clean),
    ]
}

/// The smaller set for the Python frontend with two API-server processes (the engine
/// serves two clients and must answer each on its own output socket).
pub fn multi_client_set() -> Vec<Check> {
    vec![
        check("models", models),
        check("completion-length", completion_length),
        check("completion-stream", completion_stream),
        check("chat", chat),
        check("concurrent-16", concurrent_16),
        check("two-clients-served", two_clients_served),
        check("frontend-log-clean", frontend_log_clean),
        check("engine-log-clean", engine_log_clean),
    ]
}

// ---------------------------------------------------------------- helpers

pub(crate) fn post_json(ctx: &Ctx, path: &str, body: &Value) -> Result<Value> {
    let r = ctx.http.post(path, body)?;
    ensure!(
        r.status == 200,
        "POST {path}: HTTP {} {}",
        r.status,
        snippet(&r.text())
    );
    let ctype = r.header("content-type").unwrap_or("");
    ensure!(
        ctype.contains("application/json"),
        "POST {path}: content-type {ctype:?}"
    );
    r.json()
}

fn completion(ctx: &Ctx, extra: Value) -> Result<Value> {
    let mut body = json!({"model": "tiny", "prompt": PROMPT});
    merge(&mut body, extra);
    post_json(ctx, "/v1/completions", &body)
}

fn merge(body: &mut Value, extra: Value) {
    if let (Some(b), Value::Object(e)) = (body.as_object_mut(), extra) {
        b.extend(e);
    }
}

pub(crate) fn usage(v: &Value) -> Result<(u64, u64)> {
    let u = v
        .get("usage")
        .filter(|u| !u.is_null())
        .context("no usage in the response")?;
    let p = u["prompt_tokens"].as_u64().context("usage.prompt_tokens")?;
    let c = u["completion_tokens"]
        .as_u64()
        .context("usage.completion_tokens")?;
    let t = u["total_tokens"].as_u64().context("usage.total_tokens")?;
    ensure!(t == p + c, "usage.total_tokens {t} != {p} + {c}");
    Ok((p, c))
}

fn expect<T: PartialEq + std::fmt::Debug>(what: &str, got: T, want: T) -> Result<()> {
    ensure!(got == want, "{what}: got {got:?}, want {want:?}");
    Ok(())
}

/// One choice of a non-streaming response: (text, finish_reason).
fn choice(v: &Value, chat: bool) -> Result<(String, String)> {
    let c = &v["choices"][0];
    let text = if chat {
        c["message"]["content"].as_str()
    } else {
        c["text"].as_str()
    };
    let text = text.with_context(|| format!("no text in {}", snippet(&v.to_string())))?;
    let finish = c["finish_reason"].as_str().unwrap_or("null");
    Ok((text.to_string(), finish.to_string()))
}

/// What a streamed response added up to.
#[derive(Debug, Default)]
struct Streamed {
    text: String,
    finish: Option<String>,
    usage: Option<Value>,
    chunks: usize,
    done: bool,
    role: Option<String>,
}

fn stream(ctx: &Ctx, path: &str, body: &Value, chat: bool) -> Result<Streamed> {
    let mut s = ctx.http.post_sse(path, body)?;
    if s.status != 200 {
        let status = s.status;
        bail!("POST {path}: HTTP {status} {}", snippet(&s.rest()));
    }
    let ctype = crate::http::header(&s.headers, "content-type")
        .unwrap_or("")
        .to_string();
    ensure!(
        ctype.contains("text/event-stream"),
        "content-type {ctype:?}, want text/event-stream"
    );
    let mut out = Streamed::default();
    while let Some(data) = s.next_data()? {
        if data.trim() == "[DONE]" {
            out.done = true;
            continue;
        }
        ensure!(!out.done, "data after [DONE]: {}", snippet(&data));
        let v: Value = serde_json::from_str(&data)
            .with_context(|| format!("event is not JSON: {}", snippet(&data)))?;
        ensure!(v.get("error").is_none(), "error event: {}", snippet(&data));
        out.chunks += 1;
        for c in v["choices"].as_array().into_iter().flatten() {
            if chat {
                if let Some(r) = c["delta"]["role"].as_str() {
                    out.role = Some(r.to_string());
                }
                out.text
                    .push_str(c["delta"]["content"].as_str().unwrap_or(""));
            } else {
                out.text.push_str(c["text"].as_str().unwrap_or(""));
            }
            if let Some(f) = c["finish_reason"].as_str() {
                ensure!(out.finish.is_none(), "two finish_reason chunks");
                out.finish = Some(f.to_string());
            }
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            out.usage = Some(u.clone());
        }
    }
    Ok(out)
}

pub(crate) fn metrics(ctx: &Ctx) -> Result<Vec<crate::http::Sample>> {
    let r = ctx.http.get("/metrics")?;
    ensure!(r.status == 200, "GET /metrics: HTTP {}", r.status);
    Ok(parse_metrics(&r.text()))
}

pub(crate) fn metric(samples: &[crate::http::Sample], name: &str, filter: &[(&str, &str)]) -> f64 {
    metric_sum(samples, name, filter).unwrap_or(0.0)
}

/// Poll `f` every 100 ms until it returns `Ok(Some(_))` or `timeout` passes; the last
/// observation goes into the error.
pub(crate) fn poll<T>(
    timeout: Duration,
    mut f: impl FnMut() -> Result<Option<T>, String>,
) -> Result<T> {
    let start = Instant::now();
    loop {
        let last = match f() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => String::new(),
            Err(e) => e,
        };
        if start.elapsed() >= timeout {
            bail!(
                "not within {timeout:?}{}{last}",
                if last.is_empty() { "" } else { ": " }
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Wait for a case-insensitive `needle` in the engine log after byte offset `from`.
fn engine_log_shows(ctx: &Ctx, from: u64, needle: &str, timeout: Duration) -> Result<String> {
    poll(timeout, || {
        let text = read_log_from(&ctx.engine_log, from);
        Ok(text
            .lines()
            .find(|l| l.to_ascii_lowercase().contains(needle))
            .map(|l| l.trim().to_string()))
    })
    .with_context(|| format!("the engine log shows no {needle:?} line"))
}

// ---------------------------------------------------------------- checks

fn models(ctx: &Ctx) -> Result<String> {
    let r = ctx.http.get("/v1/models")?;
    ensure!(r.status == 200, "GET /v1/models: HTTP {}", r.status);
    let v = r.json()?;
    let m = &v["data"][0];
    expect("data[0].id", m["id"].as_str(), Some("tiny"))?;
    expect(
        "data[0].max_model_len",
        m["max_model_len"].as_u64(),
        Some(2048),
    )?;
    Ok("model \"tiny\", max_model_len 2048".into())
}

fn completion_length(ctx: &Ctx) -> Result<String> {
    let v = completion(ctx, json!({"max_tokens": 5}))?;
    let (text, finish) = choice(&v, false)?;
    expect("text", text.as_str(), "Hello")?;
    expect("finish_reason", finish.as_str(), "length")?;
    let p = encode_text(PROMPT).len() as u64;
    expect("usage (prompt, completion)", usage(&v)?, (p, 5))?;
    Ok(format!("\"Hello\", length, usage {p}+5"))
}

fn completion_eos_stop(ctx: &Ctx) -> Result<String> {
    let v = completion(ctx, json!({"max_tokens": 50}))?;
    let (text, finish) = choice(&v, false)?;
    expect("text", text.as_str(), PROMPT)?;
    expect("finish_reason", finish.as_str(), "stop")?;
    // the 11 echoed tokens plus the EOS that ended the request
    expect("usage (prompt, completion)", usage(&v)?, (11, 12))?;
    Ok("echo + EOS: \"Hello world\", stop, usage 11+12".into())
}

fn completion_stream(ctx: &Ctx) -> Result<String> {
    let body = json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "stream": true,
                      "stream_options": {"include_usage": true}});
    let s = stream(ctx, "/v1/completions", &body, false)?;
    expect("text", s.text.as_str(), "Hello")?;
    expect("finish_reason", s.finish.as_deref(), Some("length"))?;
    ensure!(s.done, "no [DONE] at the end of the stream");
    let u = s
        .usage
        .context("no usage chunk although include_usage was set")?;
    expect(
        "usage (prompt, completion)",
        usage(&json!({"usage": u}))?,
        (11, 5),
    )?;
    // One token per 5 ms step arrives as its own delta, but the Python frontend merges
    // deltas its consumer has not picked up yet (RequestOutputCollector), so a busy
    // machine sees fewer chunks: require a real stream, not one chunk per token.
    ensure!(
        s.chunks >= 2,
        "{} chunk(s) for 5 tokens: not streamed",
        s.chunks
    );
    Ok(format!(
        "{} chunks, \"Hello\", length, usage 11+5, [DONE]",
        s.chunks
    ))
}

/// `<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n`: 21 tokens.
const CHAT_PROMPT_TOKENS: u64 = 21;

fn chat_body(max_tokens: u32, stream: bool) -> Value {
    let mut b = json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                       "max_tokens": max_tokens});
    if stream {
        merge(
            &mut b,
            json!({"stream": true, "stream_options": {"include_usage": true}}),
        );
    }
    b
}

fn chat(ctx: &Ctx) -> Result<String> {
    // Echo of the ChatML prompt: <|im_start|> (special, not shown), "user\nHi", then
    // <|im_end|> = EOS: the request stops after 9 tokens.
    let v = post_json(ctx, "/v1/chat/completions", &chat_body(50, false))?;
    let (text, finish) = choice(&v, true)?;
    expect("message.content", text.as_str(), "user\nHi")?;
    expect(
        "message.role",
        v["choices"][0]["message"]["role"].as_str(),
        Some("assistant"),
    )?;
    expect("finish_reason", finish.as_str(), "stop")?;
    expect(
        "usage (prompt, completion)",
        usage(&v)?,
        (CHAT_PROMPT_TOKENS, 9),
    )?;
    Ok(format!(
        "\"user\\nHi\", stop at EOS, usage {CHAT_PROMPT_TOKENS}+9"
    ))
}

fn chat_stream(ctx: &Ctx) -> Result<String> {
    let s = stream(ctx, "/v1/chat/completions", &chat_body(4, true), true)?;
    // 4 tokens: <|im_start|> (skipped as special) + "use"
    expect("content", s.text.as_str(), "use")?;
    expect("role", s.role.as_deref(), Some("assistant"))?;
    expect("finish_reason", s.finish.as_deref(), Some("length"))?;
    ensure!(s.done, "no [DONE] at the end of the stream");
    let u = s
        .usage
        .context("no usage chunk although include_usage was set")?;
    expect(
        "usage (prompt, completion)",
        usage(&json!({"usage": u}))?,
        (CHAT_PROMPT_TOKENS, 4),
    )?;
    Ok(format!(
        "{} chunks, \"use\", length, usage {CHAT_PROMPT_TOKENS}+4",
        s.chunks
    ))
}

fn stop_token_ids(ctx: &Ctx) -> Result<String> {
    let w = encode_text("w")[0];
    let v = completion(ctx, json!({"max_tokens": 50, "stop_token_ids": [w]}))?;
    let (text, finish) = choice(&v, false)?;
    // Observed on vllm-rs 0.25-0.33 and Python 0.33.0 alike: the stop token is counted in
    // usage and reported as stop_reason, but its text is not part of the output.
    expect("text", text.as_str(), "Hello ")?;
    expect("finish_reason", finish.as_str(), "stop")?;
    expect("usage (prompt, completion)", usage(&v)?, (11, 7))?;
    let reason = &v["choices"][0]["stop_reason"];
    expect("stop_reason", reason.as_u64(), Some(u64::from(w)))?;
    Ok(format!(
        "stop_token_ids [{w}]: \"Hello \", stop, stop_reason {w}, usage 11+7"
    ))
}

fn stop_string_abort(ctx: &Ctx) -> Result<String> {
    let from = log_len(&ctx.engine_log);
    let v = completion(ctx, json!({"max_tokens": 50, "stop": ["wor"]}))?;
    let (text, finish) = choice(&v, false)?;
    expect("text", text.as_str(), "Hello ")?;
    expect("finish_reason", finish.as_str(), "stop")?;
    expect(
        "stop_reason",
        v["choices"][0]["stop_reason"].as_str(),
        Some("wor"),
    )?;
    let (p, c) = usage(&v)?;
    expect("usage.prompt_tokens", p, 11)?;
    // "Hello wor" = 9 tokens reached the frontend before it matched the stop string
    expect("usage.completion_tokens", c, 9)?;
    // the engine does not know stop strings: the frontend must abort the request there
    let line = engine_log_shows(ctx, from, "abort", Duration::from_secs(3))?;
    Ok(format!(
        "\"Hello \", stop \"wor\", usage 11+9; engine: {}",
        snippet(&line)
    ))
}

fn ignore_eos_wraps(ctx: &Ctx) -> Result<String> {
    let v = completion(ctx, json!({"max_tokens": 30, "ignore_eos": true}))?;
    let (text, finish) = choice(&v, false)?;
    let want: String = PROMPT.chars().cycle().take(30).collect();
    expect("text", text.as_str(), want.as_str())?;
    expect("finish_reason", finish.as_str(), "length")?;
    expect("usage (prompt, completion)", usage(&v)?, (11, 30))?;
    Ok(format!("{want:?}, length, usage 11+30"))
}

fn n_two(ctx: &Ctx) -> Result<String> {
    let body = json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "n": 2});
    match ctx.kind {
        Kind::Rs => {
            // a vllm-rs limitation: `n > 1` is rejected with 400 "Only n=1 is supported."
            let r = ctx.http.post("/v1/completions", &body)?;
            expect("HTTP status", r.status, 400)?;
            let t = r.text();
            ensure!(
                t.contains("n=1"),
                "error does not mention n=1: {}",
                snippet(&t)
            );
            Ok(format!("rejected as documented: {}", snippet(&t)))
        }
        Kind::Python => {
            let v = post_json(ctx, "/v1/completions", &body)?;
            let choices = v["choices"].as_array().context("no choices")?;
            expect("number of choices", choices.len(), 2)?;
            let mut idx: Vec<u64> = Vec::new();
            for c in choices {
                expect("text", c["text"].as_str(), Some("Hello"))?;
                expect("finish_reason", c["finish_reason"].as_str(), Some("length"))?;
                idx.push(c["index"].as_u64().unwrap_or(99));
            }
            idx.sort_unstable();
            expect("choice indexes", idx, vec![0, 1])?;
            expect("usage (prompt, completion)", usage(&v)?, (11, 10))?;
            Ok("2 choices \"Hello\", length, usage 11+10".into())
        }
    }
}

fn metrics_counters(ctx: &Ctx) -> Result<String> {
    let before = metrics(ctx)?;
    for name in [
        "vllm:num_requests_running",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_sum",
        "vllm:time_to_first_token_seconds_count",
    ] {
        ensure!(
            metric_sum(&before, name, &[]).is_some(),
            "/metrics has no {name}"
        );
    }
    let ok = [("finished_reason", "length")];
    let b = (
        metric(&before, "vllm:prompt_tokens_total", &[]),
        metric(&before, "vllm:generation_tokens_total", &[]),
        metric(&before, "vllm:request_success_total", &ok),
    );
    completion(ctx, json!({"max_tokens": 5}))?;
    let d = poll(Duration::from_secs(3), || {
        let after = metrics(ctx).map_err(|e| e.to_string())?;
        let d = (
            metric(&after, "vllm:prompt_tokens_total", &[]) - b.0,
            metric(&after, "vllm:generation_tokens_total", &[]) - b.1,
            metric(&after, "vllm:request_success_total", &ok) - b.2,
        );
        if d == (11.0, 5.0, 1.0) {
            Ok(Some(d))
        } else {
            Err(format!(
                "deltas prompt/generation/success{{length}} = {d:?}, want (11, 5, 1)"
            ))
        }
    })?;
    Ok(format!(
        "one request moved prompt_tokens_total +{}, generation_tokens_total +{}, request_success_total{{finished_reason=\"length\"}} +{}",
        d.0, d.1, d.2
    ))
}

fn ttft_histogram(ctx: &Ctx) -> Result<String> {
    const N: f64 = 5.0;
    let tolerance = 0.100;
    let before = metrics(ctx)?;
    let (s0, c0) = (
        metric(&before, "vllm:time_to_first_token_seconds_sum", &[]),
        metric(&before, "vllm:time_to_first_token_seconds_count", &[]),
    );
    for _ in 0..N as usize {
        completion(ctx, json!({"max_tokens": 2}))?;
    }
    let (ds, dc) = poll(Duration::from_secs(3), || {
        let after = metrics(ctx).map_err(|e| e.to_string())?;
        let dc = metric(&after, "vllm:time_to_first_token_seconds_count", &[]) - c0;
        let ds = metric(&after, "vllm:time_to_first_token_seconds_sum", &[]) - s0;
        if dc == N {
            Ok(Some((ds, dc)))
        } else {
            Err(format!("count delta {dc}, want {N}"))
        }
    })?;
    let mean = ds / dc;
    let lo = ctx.ttft.as_secs_f64();
    ensure!(
        mean >= lo && mean < lo + tolerance,
        "mean TTFT {mean:.4} s over {dc} requests, want [{lo:.3}, {:.3}) s (configured {lo:.3} s, tolerance +{tolerance:.3} s)",
        lo + tolerance
    );
    Ok(format!(
        "mean TTFT {:.1} ms over {dc} requests (configured {:.0} ms, accepted [{:.0}, {:.0}) ms)",
        mean * 1e3,
        lo * 1e3,
        lo * 1e3,
        (lo + tolerance) * 1e3
    ))
}

fn prompt_too_long(ctx: &Ctx) -> Result<String> {
    let prompt = "a".repeat(3000);
    let r = ctx.http.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": prompt, "max_tokens": 5}),
    )?;
    ensure!(
        (400..500).contains(&r.status),
        "HTTP {}, want 4xx: {}",
        r.status,
        snippet(&r.text())
    );
    Ok(format!("HTTP {}: {}", r.status, snippet(&r.text())))
}

fn client_disconnect(ctx: &Ctx) -> Result<String> {
    let running = |ctx: &Ctx| -> Result<f64, String> {
        let m = metrics(ctx).map_err(|e| e.to_string())?;
        metric_sum(&m, "vllm:num_requests_running", &[])
            .ok_or_else(|| "/metrics has no vllm:num_requests_running".to_string())
    };
    // ~1900 tokens at 5 ms each: ~10 s if the request were not aborted
    let body = json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 1900, "ignore_eos": true,
                      "stream": true});
    let mut s = ctx.http.post_sse("/v1/completions", &body)?;
    ensure!(s.status == 200, "HTTP {}", s.status);
    for i in 0..3 {
        s.next_data()?
            .with_context(|| format!("stream ended after {i} events"))?;
    }
    let seen = poll(Duration::from_secs(3), || {
        let r = running(ctx)?;
        if r >= 1.0 {
            Ok(Some(r))
        } else {
            Err(format!("num_requests_running {r} while streaming"))
        }
    })?;
    let from = log_len(&ctx.engine_log);
    drop(s);
    let t = Instant::now();
    poll(Duration::from_secs(5), || {
        let r = running(ctx)?;
        if r == 0.0 {
            Ok(Some(()))
        } else {
            Err(format!("num_requests_running still {r}"))
        }
    })?;
    let after = t.elapsed();
    let line = engine_log_shows(ctx, from, "abort", Duration::from_secs(2))?;
    Ok(format!(
        "num_requests_running {seen} while streaming, 0 {:.0} ms after the client closed; engine: {}",
        after.as_secs_f64() * 1e3,
        snippet(&line)
    ))
}

fn concurrent(ctx: &Ctx, n: usize) -> Result<String> {
    let start = Instant::now();
    let results: Vec<Result<()>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|i| {
                scope.spawn(move || -> Result<()> {
                    let prompt = format!("request {i:02} says hello");
                    let max_tokens = 4 + i % 8;
                    let v = post_json(
                        ctx,
                        "/v1/completions",
                        &json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens}),
                    )?;
                    let (text, finish) = choice(&v, false)?;
                    expect("text", text.as_str(), &prompt[..max_tokens])?;
                    expect("finish_reason", finish.as_str(), "length")?;
                    expect(
                        "usage (prompt, completion)",
                        usage(&v)?,
                        (prompt.len() as u64, max_tokens as u64),
                    )?;
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("thread panicked")))
            })
            .collect()
    });
    let failed: Vec<String> = results
        .iter()
        .enumerate()
        .filter_map(|(i, r)| r.as_ref().err().map(|e| format!("#{i}: {e:#}")))
        .collect();
    ensure!(
        failed.is_empty(),
        "{}/{n} failed; first: {}",
        failed.len(),
        failed[0]
    );
    Ok(format!(
        "{n} concurrent requests, all with the right text and token counts, in {:.2} s",
        start.elapsed().as_secs_f64()
    ))
}

fn concurrent_64(ctx: &Ctx) -> Result<String> {
    concurrent(ctx, 64)
}

fn concurrent_16(ctx: &Ctx) -> Result<String> {
    concurrent(ctx, 16)
}

/// With two API servers the engine has two clients; requests from both must have been
/// served (otherwise the multi-client leg proved nothing about output routing).
fn two_clients_served(ctx: &Ctx) -> Result<String> {
    let text = read_log(&ctx.engine_log);
    let handshake = text.lines().find(|l| l.contains("clients=")).unwrap_or("");
    ensure!(
        handshake.contains("clients=2"),
        "the engine log does not show a 2-client handshake (got {:?})",
        snippet(handshake)
    );
    // The kernel hands each new connection to whichever API server accepts first, and
    // one of them can win every race of a short run: send more requests (each on its own
    // connection) until both have been seen, or give up after 60.
    let mut per_client = requests_per_client(&read_log(&ctx.engine_log));
    for i in 0..60 {
        if per_client[0] > 0 && per_client[1] > 0 {
            break;
        }
        let body = json!({"model": "tiny", "prompt": format!("which server {i}"), "max_tokens": 1});
        ctx.http.post("/v1/completions", &body)?;
        std::thread::sleep(Duration::from_millis(20));
        per_client = requests_per_client(&read_log(&ctx.engine_log));
    }
    ensure!(
        per_client[0] > 0 && per_client[1] > 0,
        "requests per client {per_client:?}: both API servers should have sent some"
    );
    Ok(format!(
        "2-client handshake; requests served for client 0: {}, client 1: {}",
        per_client[0], per_client[1]
    ))
}

/// Requests the engine log shows added by client 0 and client 1.
fn requests_per_client(log: &str) -> [usize; 2] {
    let mut per_client = [0usize; 2];
    for l in log.lines().filter(|l| l.contains("request added")) {
        let client = l
            .split_whitespace()
            .find_map(|w| w.strip_prefix("client="))
            .and_then(|c| c.parse::<usize>().ok());
        if let Some(c @ 0..=1) = client {
            per_client[c] += 1;
        }
    }
    per_client
}

/// Lines that mean the frontend rejected something the engine sent (or crashed).
const FRONTEND_BAD: &[&str] = &[
    "failed to decode",
    "output dispatcher exiting",
    "invalid wire shape",
    "Traceback",
    "EngineDeadError",
    "ValidationError",
];

pub(crate) fn frontend_log_clean(ctx: &Ctx) -> Result<String> {
    let text = read_log(&ctx.frontend_log);
    let bad: Vec<&str> = text
        .lines()
        .filter(|l| FRONTEND_BAD.iter().any(|p| l.contains(p)))
        .collect();
    ensure!(
        bad.is_empty(),
        "{} bad line(s), first: {}",
        bad.len(),
        snippet(bad[0])
    );
    Ok(format!(
        "{} lines, none matching {}",
        text.lines().count(),
        FRONTEND_BAD.join(" | ")
    ))
}

pub(crate) fn engine_log_clean(ctx: &Ctx) -> Result<String> {
    let text = read_log(&ctx.engine_log);
    let bad: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("panicked") || l.contains(" ERROR "))
        .collect();
    ensure!(
        bad.is_empty(),
        "{} bad line(s), first: {}",
        bad.len(),
        snippet(bad[0])
    );
    Ok(format!(
        "{} lines, no panic and no ERROR",
        text.lines().count()
    ))
}
