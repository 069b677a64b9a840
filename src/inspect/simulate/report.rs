//! Where a simulation's output goes: the `--dump-trace` file, and the summary it prints.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{Value, json};
use sim_trace::trace::{TraceMeta, TraceWriter};

use super::args::SimulateArgs;
use super::options::{Counts, OwnTurnarounds};
use super::workload::Workload;
use crate::inspect::summarize::Summary;
use crate::play::config::PlayConfig;

/// Where simulated records go: the `--dump-trace` file, if any.
pub(super) struct Sink {
    pub(super) meta: TraceMeta,
    writer: Option<TraceWriter>,
    pub(super) path: Option<PathBuf>,
}

impl Sink {
    pub(super) fn open(a: &SimulateArgs, source: &TraceMeta, cfg: &PlayConfig) -> Result<Self> {
        let e = &cfg.engine;
        let mut meta = TraceMeta::new();
        meta.model = source.model.clone();
        meta.gpu = Some("simulated".to_string());
        meta.block_size = u32::try_from(e.block_size).ok();
        meta.max_num_seqs = u32::try_from(cfg.max_num_seqs).ok();
        meta.vllm_version = Some(
            crate::compat::tag_for(cfg.line)
                .trim_start_matches('v')
                .to_string(),
        );
        meta.ready_response_hex = Some(hex(&cfg.ready_response(0).encode()));
        let writer = match &a.dump_trace {
            Some(p) => Some(
                TraceWriter::create(p, &meta)
                    .with_context(|| format!("creating --dump-trace {}", p.display()))?,
            ),
            None => None,
        };
        Ok(Self {
            meta,
            writer,
            path: a.dump_trace.clone().filter(|p| p.as_os_str() != "-"),
        })
    }

    pub(super) fn write(&mut self, r: &sim_trace::trace::TraceRecord) -> Result<()> {
        if let Some(w) = self.writer.as_mut() {
            w.write_record(r)?;
        }
        Ok(())
    }

    pub(super) fn finish(&mut self) -> Result<()> {
        if let Some(w) = self.writer.take() {
            w.finish()?;
        }
        self.path = None;
        Ok(())
    }
}

impl Drop for Sink {
    /// A run that failed leaves no half-written trace behind.
    fn drop(&mut self) {
        if let Some(p) = self.path.take() {
            drop(self.writer.take());
            let _ = std::fs::remove_file(p);
        }
    }
}

pub(super) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Everything the summary shows.
pub(super) struct Report<'a> {
    pub(super) args: &'a SimulateArgs,
    /// The latency model was fitted under another configuration than the trace's.
    pub(super) other_config: Option<crate::inspect::fit_config::OtherConfig>,
    /// `--replay-concurrency`, resolved.
    pub(super) concurrency: Option<usize>,
    /// The closed loop's turnaround, resolved.
    pub(super) think: Duration,
    /// Each request after its own recorded turnaround, resolved.
    pub(super) own_turnarounds: Option<OwnTurnarounds>,
    pub(super) work: &'a Workload,
    pub(super) summary: &'a Summary,
    /// Each engine's summary, with `--engines` N > 1 (empty for one engine).
    pub(super) per_engine: &'a [Summary],
    pub(super) counts: &'a Counts,
    pub(super) block_size: u64,
    pub(super) wall: f64,
}

impl Report<'_> {
    fn simulated_ms(&self) -> Option<f64> {
        self.summary.duration_ms()
    }

    fn output_tokens_per_s(&self) -> Option<f64> {
        let d = self.simulated_ms()?;
        (d > 0.0).then(|| self.summary.output_tokens.sum() / (d / 1000.0))
    }

    fn speedup(&self) -> Option<f64> {
        let d = self.simulated_ms()?;
        (self.wall > 0.0).then(|| d / 1000.0 / self.wall)
    }

    pub(super) fn json(&self) -> Value {
        let c = self.counts;
        let mut v = json!({
            "trace": self.args.trace,
            "records_in_trace": self.work.records_in_trace,
            "requests": c.requests,
            "arrivals": self.args.arrivals.mode(self.concurrency),
            "replay_concurrency": self.concurrency,
            "sessions": c.sessions.map(|(roots, turns, untimed)| json!({
                "roots": roots, "turns": turns, "turns_without_recorded_gap": untimed,
            })),
            "cold_prompts": self.args.arrivals.cold_prompts,
            "engine": c.describe,
            "block_size": self.block_size,
            "trace_block_size": self.work.trace_block_size,
            "simulated_ms": self.simulated_ms(),
            "wall_s": self.wall,
            "speedup": self.speedup(),
            "output_tokens_per_s": self.output_tokens_per_s(),
            "preemptions": c.preemptions,
            "prefix_cache_hit_ratio": self.summary.prefix_cache_hit_ratio(),
            "rejected": c.rejected,
            "not_finished": c.not_finished,
            "never_sent": c.never_sent,
            "replay": c.replay.as_ref().map(|r| &r.1),
            "dump_trace": self.args.dump_trace,
            "other_configuration": self.other_config.is_some(),
            "config_hashes": self.other_config.as_ref().map(|o| o.json()),
            "summary": self.summary.to_json(),
        });
        if !self.per_engine.is_empty() {
            v["fleet"] = self.fleet_json();
        }
        v
    }

    /// `--engines` N > 1: the fleet, each engine's latencies, hit rate and requests, and
    /// the pooled ones (the whole summary's) beside them.
    fn fleet_json(&self) -> Value {
        let one = |s: &Summary| {
            let all = s.to_json();
            json!({
                "requests": s.records,
                "prefix_cache_hit_ratio": s.prefix_cache_hit_ratio(),
                "ttft_ms": all["ttft_ms"],
                "itl_ms": all["itl_ms"],
                "request_total_ms": all["request_total_ms"],
            })
        };
        let per: Vec<Value> = self
            .per_engine
            .iter()
            .enumerate()
            .map(|(e, s)| {
                let mut v = one(s);
                v["engine"] = json!(e);
                v
            })
            .collect();
        json!({
            "engines": self.per_engine.len(),
            "route": self.args.fleet.route.name(),
            "per_engine": per,
            "pooled": one(self.summary),
        })
    }

    /// The fleet's table: one row per engine, then the pooled row.
    fn write_fleet(&self, out: &mut impl Write) -> std::io::Result<()> {
        writeln!(
            out,
            "fleet: {} engines, route {}",
            self.per_engine.len(),
            self.args.fleet.route.name()
        )?;
        writeln!(
            out,
            "  {:<7} {:>8}  {:>8}  {:<24} {:<24} total p50/p90/p99 ms",
            "engine", "requests", "hit rate", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms"
        )?;
        let q = |h: &sim_trace::stats::Histogram| {
            if h.is_empty() {
                return "-".to_string();
            }
            [0.5, 0.9, 0.99]
                .iter()
                .map(|&p| h.quantile(p).map_or("-".to_string(), |x| format!("{x:.1}")))
                .collect::<Vec<_>>()
                .join(" / ")
        };
        let rows = self
            .per_engine
            .iter()
            .enumerate()
            .map(|(e, s)| (e.to_string(), s))
            .chain(std::iter::once(("pooled".to_string(), self.summary)));
        for (name, s) in rows {
            let hit = s
                .prefix_cache_hit_ratio()
                .map_or("-".to_string(), |h| format!("{:.1} %", h * 100.0));
            writeln!(
                out,
                "  {name:<7} {:>8}  {hit:>8}  {:<24} {:<24} {}",
                s.records,
                q(&s.ttft_ms),
                q(&s.itl_ms),
                q(&s.total_ms)
            )?;
        }
        Ok(())
    }

    pub(super) fn write_text(&self, out: &mut impl Write) -> std::io::Result<()> {
        let c = self.counts;
        let mut how = match c.sessions {
            Some((roots, turns, untimed)) => format!(
                "sessions: {roots} root(s), {turns} turn(s) after their parent{}",
                if untimed > 0 {
                    format!(" ({untimed} without a recorded think gap)")
                } else {
                    String::new()
                }
            ),
            None => match self.concurrency {
                Some(c) => self
                    .args
                    .arrivals
                    .describe(c, self.think, self.own_turnarounds),
                None => "arrivals at their recorded offsets".to_string(),
            },
        };
        if self.args.arrivals.cold_prompts {
            how += "; cold prompts";
        }
        writeln!(
            out,
            "simulated: {} ({} of {} records; {how})",
            self.args.trace.display(),
            c.requests,
            self.work.records_in_trace
        )?;
        writeln!(out, "{}", c.describe)?;
        if let Some(o) = &self.other_config {
            writeln!(out, "WARNING: {}", o.describe())?;
        }
        self.summary.write_text(out)?;
        if !self.per_engine.is_empty() {
            self.write_fleet(out)?;
        }
        let f = |v: Option<f64>, d: usize| v.map_or("-".to_string(), |x| format!("{x:.d$}"));
        writeln!(
            out,
            "throughput: {} output tok/s; preemptions: {}",
            f(self.output_tokens_per_s(), 1),
            c.preemptions
        )?;
        if c.rejected > 0 || c.not_finished > 0 || c.never_sent > 0 {
            writeln!(
                out,
                "refused before the engine: {}; not finished: {}; never sent: {} (their parent never finished)",
                c.rejected, c.not_finished, c.never_sent
            )?;
        }
        if let Some((line, _)) = &c.replay {
            writeln!(out, "replay: {line}")?;
        }
        writeln!(
            out,
            "wall: {:.2} s for {} s simulated ({}× real time)",
            self.wall,
            f(self.simulated_ms().map(|d| d / 1000.0), 1),
            f(self.speedup(), 0)
        )?;
        Ok(())
    }
}
