//! The LoRA checks of the scheduler legs: `vllm:lora_requests_info` reports the running
//! and waiting adapters, and a request for an adapter that does not fit waits.

use anyhow::{Result, bail, ensure};

use crate::e2e::checks::{Ctx, metric};
use crate::e2e::load::*;
use crate::e2e::scheduler::config::{LORAS, MAX_LORAS, MAX_NUM_SEQS};

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

pub(crate) fn lora_info(ctx: &Ctx) -> Result<String> {
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
pub(crate) fn lora_waiting_deferred(ctx: &Ctx) -> Result<String> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapter_lists() {
        assert_eq!(adapters(""), Vec::<&str>::new());
        assert_eq!(adapters("l1"), vec!["l1"]);
        assert_eq!(adapters("l2,l1"), vec!["l2", "l1"]);
    }
}
