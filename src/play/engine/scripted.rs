//! Requests that replay their recorded timing verbatim (`--replay-steps`).
//!
//! A scripted request does not share the batch's steps: each of its chunks is due at its
//! own absolute time (the first after the recorded TTFT, or after the modeled prefill when
//! a latency model is given; every later one a recorded gap after the previous chunk's
//! due time), so a recorded gap is reproduced within the pacing budget at any concurrency
//! and lateness never accumulates. Scripted requests hold no KV blocks.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use super::request::SimRequest;
use crate::play::content::replay::Script;

struct Entry {
    r: SimRequest,
    script: Script,
    /// The next chunk: 0 is the first (`script.first` tokens), `i > 0` is `chunks[i - 1]`.
    next: usize,
    due: Instant,
}

/// The scripted requests of one engine, by due time.
#[derive(Default)]
pub struct Scripts {
    by_due: BTreeSet<(Instant, u64)>,
    /// Insertion order, to keep equal due times in arrival order.
    seq: u64,
    ids: HashMap<u64, String>,
    entries: HashMap<String, (u64, Entry)>,
}

impl Scripts {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn contains(&self, id: &str) -> bool {
        self.entries.contains_key(id)
    }

    /// Follow `script` from chunk `next`, due at `due`.
    pub fn insert(&mut self, r: SimRequest, script: Script, next: usize, due: Instant) {
        let seq = self.seq;
        self.seq += 1;
        self.by_due.insert((due, seq));
        self.ids.insert(seq, r.id.to_string());
        let id = r.id.to_string();
        self.entries.insert(
            id,
            (
                seq,
                Entry {
                    r,
                    script,
                    next,
                    due,
                },
            ),
        );
    }

    /// The earliest due chunk.
    pub fn next_due(&self) -> Option<Instant> {
        self.by_due.first().map(|(t, _)| *t)
    }

    /// Take a request out (finished or aborted).
    pub fn remove(&mut self, id: &str) -> Option<SimRequest> {
        let (seq, e) = self.entries.remove(id)?;
        self.by_due.remove(&(e.due, seq));
        self.ids.remove(&seq);
        Some(e.r)
    }

    /// Every request, sorted by id.
    pub fn drain(&mut self) -> Vec<SimRequest> {
        let mut ids: Vec<String> = self.entries.keys().cloned().collect();
        ids.sort();
        ids.iter().filter_map(|id| self.remove(id)).collect()
    }

    /// Push every due time back by `by` (a pause in keep mode).
    pub fn shift(&mut self, by: Duration) {
        if by.is_zero() {
            return;
        }
        let old = std::mem::take(&mut self.by_due);
        for (t, seq) in old {
            self.by_due.insert((t + by, seq));
        }
        for (_, e) in self.entries.values_mut() {
            e.due += by;
        }
    }

    /// Every chunk due at `now`: calls `emit(request, tokens)` for each in due order;
    /// `emit` says whether the request finished. Requests with more chunks are due again
    /// one recorded gap after this chunk's due time. Requests that finished, or whose
    /// script ran out without finishing (`false`), are returned.
    pub fn fire(
        &mut self,
        now: Instant,
        mut emit: impl FnMut(&mut SimRequest, u32) -> bool,
    ) -> Vec<(SimRequest, bool)> {
        let mut finished = Vec::new();
        while let Some(&(due, seq)) = self.by_due.first() {
            if due > now {
                break;
            }
            self.by_due.pop_first();
            let Some(id) = self.ids.get(&seq).cloned() else {
                continue;
            };
            let Some((_, e)) = self.entries.get_mut(&id) else {
                continue;
            };
            let tokens = if e.next == 0 {
                e.script.first
            } else {
                e.script.chunks.get(e.next - 1).map_or(1, |c| c.1)
            };
            let done = emit(&mut e.r, tokens.max(1));
            e.next += 1;
            match e.script.chunks.get(e.next - 1) {
                Some(&(gap, _)) if !done => {
                    e.due = due + gap;
                    self.by_due.insert((e.due, seq));
                }
                _ => {
                    // finished, or the script ran out (the engine's own stop rules end
                    // it at the recorded length; a request the client cut short ends
                    // earlier)
                    if let Some((_, e)) = self.entries.remove(&id) {
                        self.ids.remove(&seq);
                        finished.push((e.r, done));
                    }
                }
            }
        }
        finished
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use sim_protocol::{EngineCoreRequest, FinishReason, SamplingParams};

    use super::*;
    use crate::play::config::PlayConfig;
    use crate::play::content::replay::{Miss, MissPolicy, RecordSource, Recorded, Replay};
    use crate::play::engine::offline::OfflineDriver;

    /// Request `r<i>` gets a script of its own: TTFT 10 + i ms, then chunks of 1–4 tokens
    /// at gaps of 3–9 ms.
    struct Scripted;

    fn script(i: usize) -> Script {
        Script {
            ttft: Duration::from_millis(10 + i as u64),
            first: 1,
            chunks: (0..12)
                .map(|j| {
                    let gap = Duration::from_micros(3000 + ((i * 7 + j * 13) % 7) as u64 * 1000);
                    (gap, 1 + ((i + j) % 4) as u32)
                })
                .collect(),
        }
    }

    impl RecordSource for Scripted {
        fn lookup(&mut self, req: &EngineCoreRequest) -> Result<Recorded, Miss> {
            let i: usize = req.request_id[1..].parse().map_err(|_| Miss {
                kind: "bad_id",
                message: req.request_id.clone(),
            })?;
            Ok(Recorded {
                record: i,
                tokens: None,
                finish: FinishReason::Stop,
                script: Some(script(i)),
                reasoning_tokens: None,
            })
        }
        fn summary(&self) -> String {
            String::new()
        }
        fn summary_json(&self) -> serde_json::Value {
            serde_json::Value::Null
        }
    }

    fn request(i: usize) -> EngineCoreRequest {
        EngineCoreRequest {
            request_id: format!("r{i}"),
            prompt_token_ids: Some(vec![7; 20]),
            sampling_params: Some(SamplingParams {
                max_tokens: Some(1000),
                ..Default::default()
            }),
            wire_len: PlayConfig::defaults().line.request_len(),
            ..Default::default()
        }
    }

    #[test]
    fn recorded_chunks_come_at_their_recorded_times_at_any_concurrency() {
        let cfg = PlayConfig::defaults();
        let mut engine = cfg.build_engine(0);
        engine.set_replay(Replay {
            tokens: Some(Box::new(Scripted)),
            miss: MissPolicy::Fail,
            ..Default::default()
        });
        let mut run = OfflineDriver::new(engine);
        // 64 requests within 2 ms: all of them are in flight together
        for i in 0..64 {
            run.add(Duration::from_micros(30 * i as u64), 0, request(i));
        }
        let outputs = run.run_until_idle();
        let mut seen: BTreeMap<String, Vec<(Duration, u32)>> = BTreeMap::new();
        let mut finish: BTreeMap<String, FinishReason> = BTreeMap::new();
        for o in &outputs {
            for x in &o.outputs.outputs {
                if !x.new_token_ids.is_empty() {
                    seen.entry(x.request_id.to_string())
                        .or_default()
                        .push((o.at, x.new_token_ids.len() as u32));
                }
                if let Some(f) = x.finish_reason {
                    finish.insert(x.request_id.to_string(), f);
                }
            }
        }
        assert_eq!(seen.len(), 64);
        for (i, arrival) in (0..64).map(|i| (i, Duration::from_micros(30 * i as u64))) {
            let s = script(i);
            let mut want = vec![(arrival + s.ttft, s.first)];
            for (gap, n) in &s.chunks {
                let prev = want.last().unwrap().0;
                want.push((prev + *gap, *n));
            }
            assert_eq!(seen[&format!("r{i}")], want, "request r{i}");
            assert_eq!(finish[&format!("r{i}")], FinishReason::Stop);
        }
    }
}

#[cfg(test)]
mod modeled_prefill {
    use std::time::Duration;

    use sim_protocol::{EngineCoreRequest, FinishReason, SamplingParams};

    use crate::play::config::PlayConfig;
    use crate::play::content::replay::{Miss, MissPolicy, RecordSource, Recorded, Replay, Script};
    use crate::play::engine::offline::OfflineDriver;

    /// Every request's record: a recorded TTFT of 1 s (ignored: the model paces the
    /// prefill), then chunks of 2 tokens 7 ms apart.
    struct Source;

    impl RecordSource for Source {
        fn lookup(&mut self, _req: &EngineCoreRequest) -> Result<Recorded, Miss> {
            Ok(Recorded {
                record: 0,
                tokens: None,
                finish: FinishReason::Length,
                script: Some(Script {
                    ttft: Duration::from_secs(1),
                    first: 1,
                    chunks: vec![(Duration::from_millis(7), 2); 3],
                }),
                reasoning_tokens: None,
            })
        }
        fn summary(&self) -> String {
            String::new()
        }
        fn summary_json(&self) -> serde_json::Value {
            serde_json::Value::Null
        }
    }

    #[test]
    fn with_a_model_the_first_token_is_modeled_and_the_rest_follows_the_record() {
        let mut args = crate::play::PlayArgs::defaults();
        args.time_to_first_token = 40.0; // the "model": a 40 ms prefill step
        let mut cfg = PlayConfig::try_from(&args).unwrap();
        cfg.engine.modeled_prefill = true;
        let mut engine = cfg.build_engine(0);
        engine.set_replay(Replay {
            tokens: Some(Box::new(Source)),
            miss: MissPolicy::Fail,
            ..Default::default()
        });
        let mut run = OfflineDriver::new(engine);
        run.add(
            Duration::from_millis(5),
            0,
            EngineCoreRequest {
                request_id: "r".into(),
                prompt_token_ids: Some(vec![7; 16]),
                sampling_params: Some(SamplingParams {
                    max_tokens: Some(100),
                    ..Default::default()
                }),
                wire_len: cfg.line.request_len(),
                ..Default::default()
            },
        );
        let got: Vec<(Duration, usize)> = run
            .run_until_idle()
            .iter()
            .flat_map(|o| {
                o.outputs
                    .outputs
                    .iter()
                    .filter(|x| !x.new_token_ids.is_empty())
                    .map(move |x| (o.at, x.new_token_ids.len()))
            })
            .collect();
        let ms = Duration::from_millis;
        assert_eq!(
            got,
            vec![(ms(45), 1), (ms(52), 2), (ms(59), 2), (ms(66), 2)],
            "prefill modeled (40 ms), then the recorded 7 ms gaps and 2-token chunks"
        );
    }
}
