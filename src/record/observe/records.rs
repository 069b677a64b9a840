//! Writing what was followed: the meta line once, and one trace record per request when
//! it finishes (or when the capture ends with it in flight).

use sim_protocol::FinishReason;
use sim_trace::trace::{ItlCtx, TraceRecord};

use crate::play::engine::timer::now_monotonic;

use super::Observer;

impl Observer {
    pub(super) fn ensure_meta(&mut self) {
        if self.meta_written {
            return;
        }
        // `created_unix_ms` is the wall-clock time of the capture's zero.
        if let Ok(now) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            let since_zero = self
                .zero
                .map_or(0.0, |zero| (now_monotonic() - zero).max(0.0));
            self.meta.created_unix_ms =
                Some((now.as_secs_f64() * 1000.0 - since_zero * 1000.0) as u64);
        }
        if let Err(e) = self.writer.write_meta(&self.meta) {
            let what = format!("the trace {}", self.cfg.trace_out.display());
            self.write_failed(&what, e.into());
        }
        self.meta_written = true;
    }

    /// Write the record of request `id` and stop following it. `finish` is the engine's
    /// finish reason; anything but stop/length (or none at all) makes the record incomplete.
    pub(super) fn finalize(&mut self, id: &str, finish: Option<FinishReason>, why: Option<String>) {
        let Some(r) = self.reqs.remove(id) else {
            return;
        };
        self.ensure_meta();
        // Engine-side arrival when the engine reported it (its QUEUED event), else the
        // moment the tap relayed the ADD.
        let arrival = r.queued.unwrap_or(r.relayed);
        let complete = matches!(
            finish,
            Some(FinishReason::Stop | FinishReason::Length | FinishReason::Repetition)
        );
        let record = TraceRecord {
            request_id: Some(id.to_string()),
            prompt_tokens: r.prompt_tokens,
            cached_tokens: r.cached_tokens,
            output_tokens: r.output_tokens,
            arrival_ms: Some(self.ms(arrival)),
            sent_ms: Some(self.ms(r.relayed)),
            ttft_ms: r
                .first_token
                .map(|f| (((f - arrival) * 1000.0).max(0.0) * 1000.0).round() / 1000.0),
            itl_ms: r.itl_ms,
            itl_tokens: r.itl_tokens,
            concurrency: Some(r.concurrency),
            itl_ctx: ItlCtx {
                num_running: r.num_running,
                prefill_tokens: r.prefill_tokens,
            },
            block_hashes: r.block_hashes,
            mm_hashes: r.mm_hashes,
            reasoning_tokens: match (&r.thinking, self.cfg.thinking.as_deref()) {
                (Some(c), Some(m)) => c.finish(m),
                _ => None,
            },
            output_token_ids: r.token_ids,
            finish_reason: finish.map(|f| f.as_str().to_string()),
            incomplete: !complete,
            abort_reason: if complete { None } else { why },
            error: r.error,
            engine: None,
        };
        if self.write_error.is_some() {
            // after a failed write the writer's state is unknown: count, do not write
            self.summary.dropped += 1;
            return;
        }
        if let Err(e) = self.writer.write_record(&record) {
            let what = format!("the trace {}", self.cfg.trace_out.display());
            self.write_failed(&what, e.into());
            self.summary.dropped += 1;
            self.dirty = true;
            return;
        }
        self.summary.records += 1;
        if !complete {
            self.summary.incomplete += 1;
        }
        self.dirty = true;
    }

    /// Write every request still in flight as incomplete, oldest first.
    pub(super) fn finish_all(&mut self, reason: &str) {
        let mut ids: Vec<(f64, String)> = self
            .reqs
            .iter()
            .map(|(id, r)| (r.relayed, id.clone()))
            .collect();
        ids.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (_, id) in ids {
            self.finalize(&id, None, Some(reason.to_string()));
        }
    }
}
