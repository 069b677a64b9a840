//! Content replay through a real frontend: the round trip (record, then replay by index and by
//! prefix) and the committed real-engine capture's ids.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};
use vcr_host::tiny_model::encode_text;

use super::client::{Req, Seen, miss_is_visible, same_views, send};
use super::*;
use crate::stack::chain::Stack;
use crate::stack::pool::boot_together;

// ------------------------------------------------------------------ 1. round trip

/// The round-trip workload. Every finish kind comes from `play --tokens echo` (the prompt's
/// ids back, then EOS): `length` (max_tokens below the echo, and ignore_eos wrapping),
/// `stop` at EOS (max_tokens past the echo), `stop` by a `stop_token_ids` id found in the
/// echo, and `stop` by a stop string the frontend matches in the echo (it then aborts the
/// request on the wire; the record says abort). Random tokens would give only `length`
/// (they never draw EOS or a stop id). Each prompt is at least one 16-token block (play's
/// default block size, hence the capture's) and differs from the others within its full
/// blocks, so prefix matching pairs each request with its own record.
pub(super) fn round_trip_workload() -> Vec<Req> {
    let w = encode_text("w")[0];
    let cmpl = |label: &str, stream: bool, prompt: &str, extra: Value| {
        let mut body = json!({"model": "tiny", "prompt": prompt, "temperature": 0});
        if stream {
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        if let (Some(b), Value::Object(e)) = (body.as_object_mut(), extra) {
            b.extend(e);
        }
        Req {
            label: label.to_string(),
            chat: false,
            stream,
            body,
        }
    };
    let chat = |label: &str, stream: bool, content: &str, extra: Value| {
        let mut r = cmpl(label, stream, "", extra);
        if let Some(b) = r.body.as_object_mut() {
            b.remove("prompt");
            b.insert(
                "messages".into(),
                json!([{"role": "user", "content": content}]),
            );
        }
        r.chat = true;
        r
    };
    vec![
        cmpl(
            "completion, length",
            false,
            "Round trip 01: the engine echoes this prompt back.",
            json!({"max_tokens": 8}),
        ),
        cmpl(
            "completion, EOS",
            false,
            "Round trip 02: echo, then EOS.",
            json!({"max_tokens": 64}),
        ),
        cmpl(
            "completion stream, length",
            true,
            "Round trip 03: a streamed completion cut by max_tokens.",
            json!({"max_tokens": 12}),
        ),
        cmpl(
            "completion stream, EOS",
            true,
            "Round trip 04: streamed to the end.",
            json!({"max_tokens": 64}),
        ),
        cmpl(
            "completion, stop_token_ids",
            false,
            "Round trip 05: stops at the letter w here.",
            json!({"max_tokens": 64, "stop_token_ids": [w]}),
        ),
        cmpl(
            "completion, stop string",
            false,
            "Round trip 06: a stop string ends this world.",
            json!({"max_tokens": 64, "stop": ["wor"]}),
        ),
        cmpl(
            "completion stream, stop string",
            true,
            "Round trip 07: streamed until the stop word arrives.",
            json!({"max_tokens": 64, "stop": ["wor"]}),
        ),
        cmpl(
            "completion, ignore_eos",
            false,
            "Round trip 08: ignore_eos wraps.",
            json!({"max_tokens": 48, "ignore_eos": true}),
        ),
        chat(
            "chat, EOS",
            false,
            "Round trip 09: chat until EOS.",
            json!({"max_tokens": 64}),
        ),
        chat(
            "chat stream, length",
            true,
            "Round trip 10: streamed chat.",
            json!({"max_tokens": 6}),
        ),
        chat(
            "chat stream, stop_token_ids",
            true,
            "Round trip 11: chat stops at w.",
            json!({"max_tokens": 64, "stop_token_ids": [w]}),
        ),
        chat(
            "chat, stop string",
            false,
            "Round trip 12: chat stop string here.",
            json!({"max_tokens": 64, "stop": ["string"]}),
        ),
        // tool calls: the recorded ids come back as the same parsed calls
        chat(
            "chat, tool call (required)",
            false,
            "Round trip 13: what is the weather in Oslo?",
            json!({"max_tokens": 200, "tools": tools(), "tool_choice": "required"}),
        ),
        chat(
            "chat stream, tool call (named)",
            true,
            "Round trip 14: and the time there?",
            json!({"max_tokens": 200, "tools": tools(),
                   "tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
        ),
    ]
}

/// Every "tool call" request of the recorded run got a call the frontend parsed (so the
/// replay comparison compares calls, not two empty answers).
fn tool_calls_seen(recorded: &[Seen]) -> Result<String> {
    let mut n = 0;
    for s in recorded.iter().filter(|s| s.label.contains("tool call")) {
        let v: Value = serde_json::from_str(&s.view)?;
        let names: Vec<String> = match v["choices"][0]["message"]["tool_calls"].as_array() {
            Some(calls) => calls
                .iter()
                .map(|c| c["function"]["name"].as_str().unwrap_or("").to_string())
                .collect(),
            None => v["tool_calls"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| c[0].as_str().unwrap_or("").to_string())
                .collect(),
        };
        ensure!(
            !names.is_empty() && names.iter().all(|n| n.starts_with("get_")),
            "{}: no parsed tool call in {}",
            s.label,
            s.view
        );
        n += 1;
    }
    ensure!(n > 0, "no tool-call request in the workload");
    Ok(format!("{n} requests answered with tool calls"))
}

/// Two tools, for the tool-call requests of the round trip.
fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"]}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
    ])
}

/// The frontend flags that parse hermes-style tool calls (the tiny model's chat template
/// renders tools and calls that way).
fn tool_call_args() -> Vec<String> {
    ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
        .map(String::from)
        .to_vec()
}

pub(super) fn round_trip(
    env: &Env,
    frontend: &Frontend,
    line: &str,
    dir: &Path,
    out: &mut Checks,
) -> Result<()> {
    let reqs = round_trip_workload();
    // The recorded run: sequential, so the i-th request is the i-th record by arrival.
    let t = Instant::now();
    let trace = dir.join("record").join("trace.jsonl.gz");
    let stack = start_stack(
        env.engine_bin,
        frontend,
        &tool_call_args(),
        env.model,
        Some(&trace),
        Backend::Play {
            line,
            args: play_args(&[
                "--tokens",
                "echo",
                "--time-to-first-token",
                &RECORD_TTFT_MS.to_string(),
                "--inter-token-latency",
                &RECORD_ITL_MS.to_string(),
            ]),
        },
        &dir.join("record"),
    )?;
    let recorded: Vec<Seen> = reqs
        .iter()
        .map(|r| send(&stack.http, r, None))
        .collect::<Result<_>>()?;
    let tap = stack.stop();
    out.push(
        "record run: one complete record per request, in sending order",
        t,
        recorded_in_order(&recorded, &trace, &tap),
    );
    out.push(
        "record run: the tool-call requests were answered with parsed tool calls",
        t,
        tool_calls_seen(&recorded),
    );

    // both replay stacks boot at once (a Python frontend imports for ~10 s on one core),
    // then serve their requests one after the other
    let t = Instant::now();
    let modes = ["index", "prefix"];
    let booted: Vec<Result<Stack>> = boot_together(modes, |mode| {
        let run = dir.join(format!("replay-{mode}"));
        start_stack(
            env.engine_bin,
            frontend,
            &tool_call_args(),
            env.model,
            None,
            Backend::Play {
                line,
                args: replay_flags(&trace, mode, "fail", &run.join("summary.json"), &[]),
            },
            &run,
        )
    });
    for (mode, stack) in modes.into_iter().zip(booted) {
        let summary = dir.join(format!("replay-{mode}")).join("summary.json");
        let stack = stack?;
        let replayed: Result<Vec<Seen>> = reqs
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let id = format!("replay-{i}");
                send(&stack.http, r, (mode == "index").then_some(id.as_str()))
            })
            .collect();
        // One request with no record, to see what a miss looks like to a client.
        let probe = Req {
            label: "probe".into(),
            chat: false,
            stream: false,
            body: json!({"model": "tiny", "max_tokens": 8,
                         "prompt": "Probe: a prompt that was never recorded, so it has no record."}),
        };
        let probe_seen = send(
            &stack.http,
            &probe,
            (mode == "index").then_some("probe-without-a-record"),
        );
        let engine_log = stack.engine_log.clone();
        stack.stop();
        out.push(
            &format!("replay by {mode}: every response equals the recorded one"),
            t,
            replayed.and_then(|r| same_views(&recorded, &r)),
        );
        let want_miss = if mode == "index" {
            "bad_id"
        } else {
            "no_record"
        };
        let t = Instant::now();
        out.push(
            &format!("replay by {mode}: summary: all served, only the probe missed"),
            t,
            read_summary(&summary).and_then(|s| {
                let Counts {
                    served,
                    reserved,
                    missed,
                } = summary_counts(&s, "tokens")?;
                ensure!(
                    served == reqs.len() as u64 && reserved == 0,
                    "served {served} (re-served {reserved}), want {} and 0: {s}",
                    reqs.len()
                );
                ensure!(
                    missed == vec![(want_miss.to_string(), 1)],
                    "missed {missed:?}, want only the probe ({want_miss} 1)"
                );
                Ok(format!(
                    "served {served}, re-served 0, missed {want_miss} 1 (the probe)"
                ))
            }),
        );
        out.push(
            &format!("replay by {mode}: a miss under --replay-miss fail reaches the client"),
            t,
            probe_seen.and_then(|p| miss_is_visible(&p, &engine_log, want_miss)),
        );
    }
    Ok(())
}

/// The record run's trace holds one complete record per request, and arrival order is
/// sending order (record i's id extends response i's id).
pub(super) fn recorded_in_order(seen: &[Seen], trace: &Path, tap: &str) -> Result<String> {
    ensure!(tap.contains("exit status: 0"), "the tap ended: {tap}");
    if let Some(s) = seen.iter().find(|s| s.status != 200) {
        bail!("{}: HTTP {} {}", s.label, s.status, snippet(&s.view));
    }
    let (meta, records) = read_by_arrival(trace)?;
    ensure!(
        records.len() == seen.len(),
        "{} records for {} requests",
        records.len(),
        seen.len()
    );
    let mut finishes = std::collections::BTreeMap::<String, usize>::new();
    let mut client = std::collections::BTreeMap::<String, usize>::new();
    for s in seen {
        let v: Value = serde_json::from_str(&s.view).unwrap_or_default();
        let c = if v.get("choices").is_some() {
            &v["choices"][0]
        } else {
            &v
        };
        let key = match (&c["finish_reason"], &c["stop_reason"]) {
            (f, Value::Null) => f.as_str().unwrap_or("none").to_string(),
            (f, r) => format!("{} ({r})", f.as_str().unwrap_or("none")),
        };
        *client.entry(key).or_default() += 1;
    }
    for (i, (s, r)) in seen.iter().zip(&records).enumerate() {
        let rid = r.request_id.as_deref().unwrap_or_default();
        ensure!(
            !s.id.is_empty() && rid.starts_with(&s.id),
            "record {i} by arrival is {rid:?}, but request {i} ({}) was answered as {:?}",
            s.label,
            s.id
        );
        ensure!(
            r.output_token_ids.is_some(),
            "record {i} has no output_token_ids"
        );
        ensure!(
            r.finish_reason.is_some(),
            "record {i} ({rid}) has no finish reason: the capture closed it unfinished"
        );
        *finishes
            .entry(r.finish_reason.clone().unwrap_or_default())
            .or_default() += 1;
    }
    Ok(format!(
        "{} records, block size {}; the client saw {client:?}; the records say {finishes:?} (abort = the frontend's stop-string match)",
        records.len(),
        meta.block_size.unwrap_or(0)
    ))
}

// ------------------------------------------------------------------ 2. fixture ids

/// `trace` with the `config_hash` its provenance promises (the corpus manifest's), which
/// `play --expect-config-hash` holds the trace to.
pub(super) fn fixture_ids(
    env: &Env,
    rs: &Path,
    line: &str,
    (trace, expect_hash): (&Path, Option<&str>),
    name: &str,
    dir: &Path,
    out: &mut Checks,
) -> Result<()> {
    let t = Instant::now();
    let (_, records) = read_by_arrival(trace)?;
    let summary = dir.join("summary.json");
    let mut args: Vec<String> = vec![
        "--replay-tokens".into(),
        trace.display().to_string(),
        "--replay-match".into(),
        "index".into(),
        "--replay-miss".into(),
        "fail".into(),
        "--replay-summary".into(),
        summary.display().to_string(),
    ];
    if let Some(h) = expect_hash {
        args.extend(["--expect-config-hash".into(), h.to_string()]);
    }
    let stack = start_stack(
        env.engine_bin,
        &Frontend::Rs {
            bin: rs.to_path_buf(),
        },
        &[],
        env.real_model,
        None,
        Backend::Play { line, args },
        dir,
    )?;
    eprintln!("  stack up after {:.1} s", t.elapsed().as_secs_f64());
    let t = Instant::now();
    // The capture ran with --ignore-eos and its ids contain EOS (id 2): so do the requests.
    let results = run_pool(records.len(), 8, |i| {
        let r = &records[i];
        let body = json!({"model": "tiny", "prompt": prompt_of("", r.prompt_tokens as usize),
                          "max_tokens": r.output_tokens, "ignore_eos": true,
                          "return_token_ids": true});
        let resp = stack.http.request_with(
            "POST",
            "/v1/completions",
            Some(&body),
            &[("X-Request-Id", &format!("replay-{i}"))],
        )?;
        ensure!(
            resp.status == 200,
            "replay-{i}: HTTP {} {}",
            resp.status,
            snippet(&resp.text())
        );
        let v = resp.json()?;
        let c = &v["choices"][0];
        let ids: Vec<u32> = serde_json::from_value(c["token_ids"].clone())
            .with_context(|| format!("replay-{i}: no token_ids in {}", snippet(&v.to_string())))?;
        let want = r.output_token_ids.clone().unwrap_or_default();
        ensure!(
            ids == want,
            "replay-{i}: token ids {ids:?}, recorded {want:?}"
        );
        ensure!(
            v["usage"]["prompt_tokens"].as_u64() == Some(u64::from(r.prompt_tokens)),
            "replay-{i}: prompt_tokens {} but the record has {}",
            v["usage"]["prompt_tokens"],
            r.prompt_tokens
        );
        ensure!(
            c["finish_reason"].as_str() == r.finish_reason.as_deref(),
            "replay-{i}: finish {}, recorded {:?}",
            c["finish_reason"],
            r.finish_reason
        );
        Ok(ids.len())
    });
    let results = all_ok("replayed requests", results);
    let secs = t.elapsed().as_secs_f64();
    stack.stop();
    out.push(
        &format!("{name}: the client gets the recorded token ids back (return_token_ids)"),
        t,
        results.map(|n| {
            format!(
                "{} requests replay-0..replay-{} at concurrency 8 in {secs:.1} s: {} token ids, all equal to the records' output_token_ids, finish reasons equal",
                n.len(),
                n.len().saturating_sub(1),
                n.iter().sum::<usize>()
            )
        }),
    );
    let t = Instant::now();
    out.push(
        &format!("{name}: summary: every record served once, nothing missed"),
        t,
        read_summary(&summary).and_then(|s| {
            let Counts {
                served,
                reserved,
                missed,
            } = summary_counts(&s, "tokens")?;
            ensure!(
                served == records.len() as u64 && reserved == 0 && missed.is_empty(),
                "served {served}, re-served {reserved}, missed {missed:?}; want {} / 0 / none",
                records.len()
            );
            Ok(format!("served {served}, re-served 0, missed 0"))
        }),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_prompts_fill_a_block_each() {
        for r in round_trip_workload() {
            let text = r.body["prompt"]
                .as_str()
                .or(r.body["messages"][0]["content"].as_str())
                .unwrap();
            assert!(text.len() >= 16 || r.chat, "{}", r.label);
        }
    }
}
