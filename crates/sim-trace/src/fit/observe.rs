//! Captured steps as observations of the law: a duration and the step's features.
//!
//! * A step's duration is the time since the engine's previous step — unless the engine
//!   sat idle in between: a step cannot start before the requests it prefills arrived, so
//!   its duration is at most the time since the earliest of them arrived. (On the fixture
//!   this turns a 116 ms "prefill" after an idle second into the 79.6 ms it took.)
//! * A step that computed prefill chunks without finishing them shows no first token: the
//!   engine reports the request as running, yet it emitted nothing. Such steps and the step
//!   that finishes their prefills form one observation, summed over its steps: the law is
//!   linear, and the depth term telescopes over chunks (`Σ (d1² − d0²)/2` over a prompt's
//!   chunks is `((cached + U)² − cached²)/2` however it was chunked), so the sum is exact
//!   without knowing where the chunks were cut.
//! * A step that emitted nothing at all (after the last request finished), or that
//!   recomputed a preempted request (prefill work and no first token), is skipped: its
//!   work is not attributable.
//! * A prefill slows the steps after it, fading over about ten steps, more after a longer
//!   prompt (on the CPU engine the first decode step after a 1,200-token prefill takes
//!   10.9 ms, the twelfth 7.7 ms). Each step therefore carries the prefills before it,
//!   discounted by `decay` per step since: `after_prefill = Σ decay^k` and
//!   `after_prefill_tokens = Σ P·decay^k` over earlier steps with prefill work (`k` steps
//!   ago, `P` tokens). The pacer keeps the same sums ([`AfterPrefill`]).
//! * A step of a size (tokens scheduled in it) the engine has not run since it started
//!   costs a few milliseconds more: the CPU engine prepares its kernels per shape and
//!   caches them. A closed loop of fixed 128-token prompts repeats a handful of sizes and
//!   never pays it after the first; prompts of varied lengths pay it on most prefills
//!   (the corpus: 2–8 ms a new size, at 60–77 µs a token, where a law without the term
//!   charges every prefill step a fixed 1–4 ms). The pacer keeps the same set
//!   ([`SeenSizes`]).
//! * A step the engine starts after sitting idle for [`IDLE_WAKE_MS`] or more costs more
//!   than one it starts straight after another (its duration runs from the request's
//!   arrival): the CPU engine's worker threads have gone to sleep and must be woken. A
//!   lone 128-token prefill took 12.3 ms within 2 ms of the previous step and 13.2–14.4 ms
//!   after 5 ms or more; a closed loop sends its next request within a millisecond or two
//!   and never pays it, an open loop pays it on most arrivals (the `after_idle` term).
//!   The engine tells the pacer ([`crate::latency::StepShape::after_idle`]).

use super::capture::{Capture, Step, UNKNOWN};
use super::features::{Kind, NF, Obs};
use crate::latency::IDLE_WAKE_MS;

/// The prefills before a step, discounted per step since: `[Σ decay^k, Σ P·decay^k]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct AfterPrefill {
    decay: f64,
    sums: [f64; 2],
}

impl AfterPrefill {
    pub fn new(decay: f64) -> Self {
        Self {
            decay: if decay.is_finite() {
                decay.clamp(0.0, 0.99)
            } else {
                0.0
            },
            sums: [0.0; 2],
        }
    }
    /// What the next step carries.
    pub fn sums(&self) -> [f64; 2] {
        self.sums
    }
    /// A step ran that prefilled `tokens` (0: none).
    pub fn after_step(&mut self, tokens: u64) {
        let d = self.decay;
        let work = if tokens > 0 { 1.0 } else { 0.0 };
        self.sums = [
            d * (self.sums[0] + work),
            d * (self.sums[1] + tokens as f64),
        ];
        // a long run of decode steps: nothing left worth carrying
        if self.sums[0] < 1e-6 {
            self.sums = [0.0; 2];
        }
    }
}

/// The step sizes (tokens scheduled in one step: prefilled tokens plus one per decode) an
/// engine has run since it started. Bounded: sizes past [`SeenSizes::MAX`] count as seen.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct SeenSizes {
    bits: Vec<u64>,
}

impl SeenSizes {
    /// Larger than any step's token budget; a bitset of this many bits is 128 KiB.
    const MAX: u64 = 1 << 20;

    /// Whether a step of `tokens` scheduled tokens is the first of its size (and remember it).
    pub fn first(&mut self, tokens: u64) -> bool {
        if tokens >= Self::MAX {
            return false;
        }
        let (word, bit) = ((tokens / 64) as usize, tokens % 64);
        if self.bits.len() <= word {
            self.bits.resize(word + 1, 0);
        }
        let new = self.bits[word] & (1 << bit) == 0;
        self.bits[word] |= 1 << bit;
        new
    }
}

/// The features of one step, which carries `after` ([`AfterPrefill::sums`]) and is the
/// engine's first step of its size or not.
fn features(
    s: &Step,
    prefill_work: bool,
    after: [f64; 2],
    new_size: bool,
    from_idle: bool,
) -> [f32; NF] {
    let decodes = s.decodes as f32;
    [
        1.0,
        decodes,
        s.prefill as f32,
        if prefill_work { 1.0 } else { 0.0 },
        s.ctx,
        (s.tokens.saturating_sub(s.decodes)) as f32,
        s.depth,
        after[0] as f32,
        after[1] as f32,
        if new_size { 1.0 } else { 0.0 },
        if from_idle { 1.0 } else { 0.0 },
        s.firsts as f32,
    ]
}

/// The step's duration, ms, or `None` when the capture cannot tell it.
fn duration(s: &Step) -> Option<f32> {
    if s.idle_before {
        return None;
    }
    let d = if s.step_ms.is_nan() {
        s.since_arrival
    } else {
        s.step_ms.min(s.since_arrival)
    };
    (d.is_finite() && d > 0.0).then_some(d)
}

/// The steps of a chunked prefill, being summed.
struct Episode {
    x: [f32; NF],
    y: f32,
    steps: u32,
    firsts: u32,
    prefill: u32,
    valid: bool,
}

/// Append the observations of a capture to `out`, prefills fading by `decay` per step.
pub(crate) fn observations(cap: &Capture, decay: f64, out: &mut Vec<Obs>) {
    let mut open: Option<Episode> = None;
    let mut engine = None;
    let mut after = AfterPrefill::new(decay);
    let mut sizes = SeenSizes::default();
    // when the engine last emitted something: a step that starts long after it starts
    // from idle
    let mut last_active = f64::NEG_INFINITY;
    for s in &cap.steps {
        if engine != Some(s.engine) {
            // another engine's steps: an episode does not span engines
            open = None;
            engine = Some(s.engine);
            after = AfterPrefill::new(decay);
            sizes = SeenSizes::default();
            last_active = f64::NEG_INFINITY;
        }
        let carried = after.sums();
        after.after_step(u64::from(s.prefill));
        let new_size = sizes.first(u64::from(s.prefill) + u64::from(s.decodes));
        let outputs = s.decodes + s.firsts;
        let partial = if s.running == UNKNOWN {
            0
        } else {
            (s.running + s.finished).saturating_sub(outputs)
        };
        let work = s.firsts > 0 || partial > 0;
        let dur = duration(s);
        let from_idle = s.after_idle
            && dur.is_some_and(|d| s.ts - f64::from(d) - last_active >= IDLE_WAKE_MS as f64);
        if s.decodes + s.firsts > 0 {
            last_active = s.ts;
        }
        if !work {
            // an open episode that ends without a first token recomputed a preempted
            // request, or lost track: drop it
            open = None;
            if let (Some(y), true) = (dur, s.decodes > 0) {
                out.push(Obs {
                    x: features(s, false, carried, new_size, from_idle),
                    y,
                    weight: 1.0,
                    kind: Kind::Decode {
                        decodes: s.decodes,
                        burst: mean_burst(s.tokens, s.decodes),
                    },
                });
            }
            continue;
        }
        let ep = open.get_or_insert(Episode {
            x: [0.0; NF],
            y: 0.0,
            steps: 0,
            firsts: 0,
            prefill: 0,
            valid: true,
        });
        for (a, b) in
            ep.x.iter_mut()
                .zip(features(s, true, carried, new_size, from_idle))
        {
            *a += b;
        }
        ep.y += dur.unwrap_or(f32::NAN);
        ep.valid &= dur.is_some();
        ep.steps += 1;
        ep.firsts += s.firsts;
        ep.prefill = ep.prefill.saturating_add(s.prefill);
        if partial == 0 {
            let ep = open.take().expect("inserted above");
            if ep.valid && ep.firsts > 0 && ep.prefill > 0 {
                out.push(Obs {
                    x: ep.x,
                    y: ep.y,
                    weight: 1.0,
                    kind: Kind::Prefill {
                        per_step: ep.prefill / ep.steps,
                    },
                });
            }
        }
    }
    for g in &cap.gaps {
        let d = g.decodes as f32;
        let burst = g.tokens.max(1);
        out.push(Obs {
            // the step's other decodes are taken to be like this one
            x: [
                1.0,
                d,
                0.0,
                0.0,
                d * g.ctx as f32,
                d * (burst - 1) as f32,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
            ],
            y: g.ms,
            weight: 1.0 / d,
            kind: Kind::Decode {
                decodes: g.decodes,
                burst,
            },
        });
    }
}

/// Tokens per decode, rounded: the burst state of a step.
pub(crate) fn mean_burst(tokens: u32, decodes: u32) -> u32 {
    if decodes == 0 {
        return 1;
    }
    ((f64::from(tokens) / f64::from(decodes)).round() as u32).max(1)
}
