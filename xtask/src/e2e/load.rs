//! Load helpers of the e2e checks: concurrent requests, a `/metrics` poller running
//! beside a load, and small request builders.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Result, anyhow, ensure};
use serde_json::{Value, json};

use crate::e2e::checks::{Ctx, metric, metrics, poll, post_json, usage};
use crate::http::{Client, Sample, metric_sum, parse_metrics, snippet};

/// What a `/metrics` poller saw while a load ran.
#[derive(Default)]
pub(crate) struct Observed {
    /// One entry per successful poll: the samples of the watched metrics.
    pub(crate) polls: Vec<Vec<Sample>>,
    pub(crate) errors: usize,
    pub(crate) last_error: String,
}

impl Observed {
    /// Per poll, the sum of `name` (with `filter`), for polls that had it.
    pub(crate) fn series(&self, name: &str, filter: &[(&str, &str)]) -> Vec<f64> {
        self.polls
            .iter()
            .filter_map(|p| metric_sum(p, name, filter))
            .collect()
    }

    pub(crate) fn max(&self, name: &str, filter: &[(&str, &str)]) -> f64 {
        self.series(name, filter)
            .into_iter()
            .fold(f64::NEG_INFINITY, f64::max)
    }

    pub(crate) fn ensure_polled(&self) -> Result<()> {
        ensure!(
            !self.polls.is_empty(),
            "no /metrics poll succeeded during the load ({} errors, last: {})",
            self.errors,
            self.last_error
        );
        Ok(())
    }
}

/// Upper bounds of a poller, whatever the load does.
const POLL_EVERY: Duration = Duration::from_millis(20);
const POLL_FOR_AT_MOST: Duration = Duration::from_secs(90);
const MAX_POLLS: usize = 4000;

/// Run `load` on this thread while another thread polls `/metrics` (keeping the samples
/// named in `keep`) until the load returns.
pub(crate) fn while_polling<T>(
    ctx: &Ctx,
    keep: &[&str],
    load: impl FnOnce() -> T,
) -> (T, Observed) {
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let poller = s.spawn(|| {
            let client = Client::new(ctx.http.addr.port(), Duration::from_secs(5));
            let start = Instant::now();
            let mut obs = Observed::default();
            while !stop.load(Ordering::SeqCst)
                && start.elapsed() < POLL_FOR_AT_MOST
                && obs.polls.len() + obs.errors < MAX_POLLS
            {
                match client.get("/metrics") {
                    Ok(r) if r.status == 200 => obs.polls.push(
                        parse_metrics(&r.text())
                            .into_iter()
                            .filter(|s| keep.contains(&s.name.as_str()))
                            .collect(),
                    ),
                    Ok(r) => {
                        obs.errors += 1;
                        obs.last_error = format!("HTTP {}", r.status);
                    }
                    Err(e) => {
                        obs.errors += 1;
                        obs.last_error = format!("{e:#}");
                    }
                }
                std::thread::sleep(POLL_EVERY);
            }
            obs
        });
        let out = load();
        stop.store(true, Ordering::SeqCst);
        let obs = poller.join().unwrap_or_else(|_| Observed {
            last_error: "the poller panicked".into(),
            ..Observed::default()
        });
        (out, obs)
    })
}

/// Run `f(0..n)` on `n` threads at once; the results in index order.
pub(crate) fn concurrently<T: Send>(
    n: usize,
    f: impl Fn(usize) -> Result<T> + Sync,
) -> Vec<Result<T>> {
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n).map(|i| s.spawn(move || f(i))).collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("thread panicked"))))
            .collect()
    })
}

/// Fail with the first error of `results` (and how many failed).
pub(crate) fn all_ok<T>(what: &str, results: Vec<Result<T>>) -> Result<Vec<T>> {
    let n = results.len();
    let mut ok = Vec::new();
    let mut failed = Vec::new();
    for (i, r) in results.into_iter().enumerate() {
        match r {
            Ok(v) => ok.push(v),
            Err(e) => failed.push(format!("#{i}: {e:#}")),
        }
    }
    ensure!(
        failed.is_empty(),
        "{}/{n} {what} failed; first: {}",
        failed.len(),
        failed[0]
    );
    Ok(ok)
}

/// An ASCII prompt of exactly `len` bytes (= tokens) starting with `head`.
pub(crate) fn prompt_of(head: &str, len: usize) -> String {
    const FILLER: &str = "the quick brown fox jumps over the lazy dog, ";
    let mut s = head.to_string();
    s.extend(FILLER.chars().cycle().take(len.saturating_sub(head.len())));
    s.truncate(len);
    s
}

/// A completion that must run to `max_tokens` (ignore_eos): checks finish "length" and the
/// usage, returns the response.
pub(crate) fn completion_exact(
    ctx: &Ctx,
    model: &str,
    prompt: &str,
    max_tokens: u64,
) -> Result<Value> {
    let v = post_json(
        ctx,
        "/v1/completions",
        &json!({"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true}),
    )?;
    let c = &v["choices"][0];
    ensure!(
        c["text"].is_string(),
        "no text in {}",
        snippet(&v.to_string())
    );
    let finish = c["finish_reason"].as_str().unwrap_or("null");
    ensure!(
        finish == "length",
        "finish_reason {finish:?}, want \"length\""
    );
    let got = usage(&v)?;
    ensure!(
        got == (prompt.len() as u64, max_tokens),
        "usage (prompt, completion) {got:?}, want ({}, {max_tokens})",
        prompt.len()
    );
    Ok(v)
}

/// Poll until `vllm:num_requests_running` and `vllm:num_requests_waiting` are both 0.
pub(crate) fn wait_idle(ctx: &Ctx) -> Result<Duration> {
    let t = Instant::now();
    poll(Duration::from_secs(5), || {
        let m = metrics(ctx).map_err(|e| e.to_string())?;
        let r = metric(&m, "vllm:num_requests_running", &[]);
        let w = metric(&m, "vllm:num_requests_waiting", &[]);
        if r == 0.0 && w == 0.0 {
            Ok(Some(()))
        } else {
            Err(format!("running {r}, waiting {w} after the load"))
        }
    })?;
    Ok(t.elapsed())
}

pub(crate) fn label<'a>(s: &'a Sample, key: &str) -> &'a str {
    s.labels
        .iter()
        .find(|(k, _)| k == key)
        .map_or("", |(_, v)| v.as_str())
}

pub(crate) fn now_unix() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
