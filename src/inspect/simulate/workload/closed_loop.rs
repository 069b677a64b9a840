//! What a capture says about the closed loop that sent it (`--replay-concurrency`): how
//! many were in flight, how its load generator ramped up, and how long it took to send the
//! next request (or, with `--replay-sessions`, the next conversation) after one finished.
//! A closed loop hands its slots to [`LoopUnit`]s: requests, or whole sessions.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use sim_trace::stats::quantile_of;

use super::{MIN_SPACINGS, NONE, Planned, Turn, Workload};

impl Planned {
    /// The recorded end: arrival plus end to end (records with both).
    pub fn recorded_end(&self) -> Option<f64> {
        Some(self.arrival_ms? + self.e2e_ms?.max(0.0))
    }
}

impl Workload {
    /// The concurrency the workload was captured at (`--replay-concurrency auto`): the
    /// largest of the records' `concurrency` when every timed record has one, else the
    /// most requests in flight at once by the recorded arrivals and ends (records with
    /// both). `None` when neither can be told.
    pub fn captured_concurrency(&self) -> Option<usize> {
        let timed = || self.reqs.iter().filter(|p| p.arrival_ms.is_some());
        if timed().next().is_some() && timed().all(|p| p.concurrency.is_some()) {
            return timed()
                .filter_map(|p| p.concurrency)
                .max()
                .map(|c| c.max(1) as usize);
        }
        // a sweep over (time, +1 at an arrival / −1 at an end); an end at the same time
        // as an arrival comes first (that slot was free)
        most_at_once(
            self.reqs
                .iter()
                .filter_map(|p| Some((p.arrival_ms?, p.recorded_end()?))),
        )
    }

    /// How long a request the tap relayed took to reach the queue of an idle engine, ms:
    /// the median of `arrival − sent` over the records sent while no earlier-sent request
    /// was unfinished (an engine mid-step queues a request only when the step ends; the
    /// first send always finds it idle). `None` without sends.
    pub fn intake_ms(&self) -> Option<f64> {
        let mut sends: Vec<f64> = self.reqs.iter().filter_map(|p| p.sent_ms).collect();
        sends.sort_by(f64::total_cmp);
        let ends = ascending(self.reqs.iter().filter_map(Planned::recorded_end));
        let in_flight = |t: f64| {
            sends
                .partition_point(|s| *s < t)
                .saturating_sub(ends.partition_point(|e| *e <= t))
        };
        let mut idle: Vec<f64> = self
            .reqs
            .iter()
            .filter_map(|p| Some((p.arrival_ms?, p.sent_ms?)))
            .filter(|&(_, s)| in_flight(s) == 0)
            .map(|(a, s)| (a - s).max(0.0))
            .collect();
        quantile_of(&mut idle, 0.5)
    }

    /// Each unit's own turnaround, ms: its send minus the latest recorded end of a unit
    /// before it, plus [`Self::intake_ms`] (`None`: no send, or no end before it).
    pub fn turnarounds_ms(&self, units: &[LoopUnit]) -> Vec<Option<f64>> {
        let ends = unit_ends(units);
        let intake = self.intake_ms().unwrap_or(0.0);
        units
            .iter()
            .map(|u| {
                let s = u.sent_ms?;
                Some(s - latest_end_before(&ends, s)?.1 + intake)
            })
            .collect()
    }

    /// The units of a closed loop, in arrival order: every request (`sessions` `None`),
    /// or every session of `sessions` (`--replay-sessions --replay-concurrency`), whose
    /// recorded end is the latest of its requests' (none while any of them has none: it
    /// stays in flight).
    pub fn loop_units(&self, sessions: Option<&Sessions>) -> Vec<LoopUnit> {
        let unit = |p: &Planned| LoopUnit {
            arrival_ms: p.arrival_ms,
            sent_ms: p.sent_ms,
            ttft_ms: p.ttft_ms,
            end_ms: p.recorded_end(),
        };
        let Some(s) = sessions else {
            return self.reqs.iter().map(unit).collect();
        };
        let mut unit_of = vec![NONE; self.reqs.len()];
        let mut units: Vec<LoopUnit> = Vec::with_capacity(s.roots.len());
        for &r in &s.roots {
            unit_of[r] = units.len() as u32;
            units.push(unit(&self.reqs[r]));
        }
        for (i, p) in self.reqs.iter().enumerate() {
            if s.root_of[i] as usize == i {
                continue;
            }
            let u = &mut units[unit_of[s.root_of[i] as usize] as usize];
            u.end_ms = match (u.end_ms, p.recorded_end()) {
                (Some(a), Some(b)) => Some(a.max(b)),
                _ => None,
            };
        }
        units
    }

    /// A closed loop's turnaround, ms: from a unit's finish to the next unit reaching the
    /// engine — the median of `sent −` the latest recorded end of a unit before it, over
    /// the units after the first `ramp`, plus [`Self::intake_ms`]. `None` without sends.
    pub fn turnaround_ms(&self, units: &[LoopUnit], ramp: usize) -> Option<f64> {
        let ends = unit_ends(units);
        let mut gaps: Vec<f64> = units
            .iter()
            .skip(ramp)
            .filter_map(|u| {
                let s = u.sent_ms?;
                Some(s - latest_end_before(&ends, s)?.1)
            })
            .collect();
        Some(quantile_of(&mut gaps, 0.5)? + self.intake_ms().unwrap_or(0.0))
    }
}

/// What a closed loop gives a slot to, as the capture recorded it: a request, or with
/// `--replay-sessions` a whole session (its root's arrival, send and first token, and the
/// latest end among its requests). See [`Workload::loop_units`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LoopUnit {
    pub arrival_ms: Option<f64>,
    pub sent_ms: Option<f64>,
    pub ttft_ms: Option<f64>,
    pub end_ms: Option<f64>,
}

/// How the capture's client sent the units that one finish released, ms: the median
/// time between two consecutive sends after the same recorded end (0 for a load
/// generator that fills every freed slot at once; a client that answers finished
/// requests one at a time spaces them by its own work). `None` with fewer than
/// [`MIN_SPACINGS`] such pairs.
pub fn client_spacing_ms(units: &[LoopUnit]) -> Option<f64> {
    let ends = unit_ends(units);
    let mut after: Vec<(usize, f64)> = units
        .iter()
        .filter_map(|u| {
            let s = u.sent_ms?;
            Some((latest_end_before(&ends, s)?.0, s))
        })
        .collect();
    after.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
    let mut gaps: Vec<f64> = after
        .windows(2)
        .filter(|w| w[0].0 == w[1].0)
        .map(|w| w[1].1 - w[0].1)
        .collect();
    if gaps.len() < MIN_SPACINGS {
        return None;
    }
    quantile_of(&mut gaps, 0.5)
}

/// The units' recorded ends, ascending.
fn unit_ends(units: &[LoopUnit]) -> Vec<f64> {
    ascending(units.iter().filter_map(|u| u.end_ms))
}

fn ascending(ends: impl Iterator<Item = f64>) -> Vec<f64> {
    let mut ends: Vec<f64> = ends.collect();
    ends.sort_by(f64::total_cmp);
    ends
}

/// The latest of the ascending `ends` at or before `sent`, with its index (plus one);
/// `None` when none is.
fn latest_end_before(ends: &[f64], sent: f64) -> Option<(usize, f64)> {
    let i = ends.partition_point(|e| *e <= sent);
    (i > 0).then(|| (i, ends[i - 1]))
}

/// How many leading units of a closed-loop replay at `n` in flight are the ramp
/// (`--replay-concurrency`): every unit up to the one whose recorded arrival first found
/// `n` units in flight (itself included; by the recorded arrivals and ends), and at least
/// the first `n`. A load generator with a concurrency cap starts its first requests (or
/// conversations) as fast as it can, and units before the cap was reached (a warm-up that
/// finished before the run began) were not waiting for a slot.
pub fn ramp(units: &[LoopUnit], n: usize) -> usize {
    // the ends of the units in flight, in µs (the earliest on top)
    let mut ends: BinaryHeap<Reverse<i64>> = BinaryHeap::new();
    let us = |ms: f64| (ms * 1000.0).round() as i64;
    for (i, u) in units.iter().enumerate() {
        let Some(a) = u.arrival_ms else {
            break;
        };
        while ends.peek().is_some_and(|e| e.0 <= us(a)) {
            ends.pop();
        }
        // a unit without a recorded end stays in flight
        ends.push(Reverse(u.end_ms.map_or(i64::MAX, |e| us(e.max(a)))));
        if ends.len() >= n {
            return (i + 1).max(n).min(units.len());
        }
    }
    n.min(units.len())
}

/// When the first `ramp` units of a closed loop reach the simulated engine, ms. A
/// record's arrival is when the engine *queued* it, and vLLM's engine-core takes in new
/// requests only between steps: of a burst sent at once, the engine's first step takes
/// what its intake has handed over (one request, or six of sixteen) and the rest are
/// queued when that step ends — as its first tokens come out. So a ramp unit queued with
/// an earlier one of a burst (within 0.1 ms) arrives with it, one queued within 1 ms of
/// the first token of an earlier one of a burst arrives just after that one (while its
/// step runs, whatever the step's modelled length), and joins the burst; any other at its
/// recorded arrival. A burst opens with a unit that arrived with nothing in flight (a
/// load generator's first send, or its first after a warm-up): a multi-turn client's
/// conversations start over the run, and a root queued at a step's end that meets the
/// first token of some root of that step by coincidence was not sent with it (chained
/// anyway, the 64 roots of the corpus's `sessions` capture crowd into its first seconds:
/// TTFT p90 +33 % against +7.5 % at their recorded arrivals).
pub fn ramp_sends(units: &[LoopUnit], ramp: usize) -> Vec<Option<f64>> {
    /// How much after the unit whose step it waited for.
    const JUST_AFTER_MS: f64 = 0.01;
    /// Requests one drain of the engine's input queue took share their QUEUED time to
    /// within tens of µs (corpus v2: six of a burst within 26 µs).
    const SAME_DRAIN_MS: f64 = 0.1;
    let n = ramp.min(units.len());
    let mut sent: Vec<Option<f64>> = Vec::with_capacity(n);
    let mut in_burst: Vec<bool> = Vec::with_capacity(n);
    // the latest recorded end of the units so far (infinite once one has none)
    let mut latest_end = f64::NEG_INFINITY;
    for i in 0..n {
        let arrival = units[i].arrival_ms;
        let opens = arrival.is_some_and(|a| latest_end <= a);
        let with = arrival.and_then(|a| {
            let earlier = || {
                (0..i)
                    .filter(|&j| in_burst[j])
                    .filter_map(|j| Some((j, units[j].arrival_ms?)))
            };
            if let Some(s) = earlier()
                .find_map(|(j, qa)| ((a - qa).abs() <= SAME_DRAIN_MS).then_some(sent[j])?)
            {
                return Some(s);
            }
            earlier().find_map(|(j, qa)| {
                let t = units[j].ttft_ms?;
                ((a - (qa + t)).abs() <= 1.0).then_some(sent[j]? + JUST_AFTER_MS)
            })
        });
        in_burst.push(opens || with.is_some());
        sent.push(with.or(arrival));
        latest_end = latest_end.max(units[i].end_ms.unwrap_or(f64::INFINITY));
    }
    sent
}

/// The sessions of a `--replay-sessions` run, for a closed loop over sessions
/// (`--replay-sessions --replay-concurrency`): which session each request belongs to (the
/// root of its chain of turns), and how many requests each session holds.
pub struct Sessions {
    /// Per request: the arrival-order index of its session's root.
    pub root_of: Vec<u32>,
    /// Per request: the number of requests in the session it roots (0 for a turn).
    pub size: Vec<u32>,
    /// The roots, in arrival order.
    pub roots: Vec<usize>,
}

impl Sessions {
    /// Group `turns` (from [`Workload::sessions`]: a parent comes before its turns).
    pub fn of(turns: &[Turn]) -> Self {
        let mut root_of = Vec::with_capacity(turns.len());
        let mut size = vec![0u32; turns.len()];
        let mut roots = Vec::new();
        for (i, t) in turns.iter().enumerate() {
            let root = match *t {
                Turn::Root => {
                    roots.push(i);
                    i as u32
                }
                Turn::After { parent, .. } | Turn::NotBefore { parent } => root_of[parent as usize],
            };
            root_of.push(root);
            size[root as usize] += 1;
        }
        Self {
            root_of,
            size,
            roots,
        }
    }

    /// The most sessions in flight at once in the capture, a session lasting from its
    /// root's recorded arrival to the latest recorded end among its requests (sessions
    /// with both); `None` when no session has them.
    pub fn captured_concurrency(&self, work: &Workload) -> Option<usize> {
        let mut span: Vec<Option<(f64, f64)>> = vec![None; work.reqs.len()];
        for (i, p) in work.reqs.iter().enumerate() {
            let (Some(a), Some(end)) = (p.arrival_ms, p.recorded_end()) else {
                continue;
            };
            let r = self.root_of[i] as usize;
            span[r] = Some(match span[r] {
                Some((s, e)) => (s.min(a), e.max(end)),
                None => (a, end),
            });
        }
        most_at_once(span.into_iter().flatten())
    }
}

/// The most spans (start, end) open at once; an end at the same time as a start comes
/// first (that slot was free). `None` when there are none.
fn most_at_once(spans: impl Iterator<Item = (f64, f64)>) -> Option<usize> {
    let mut events: Vec<(f64, i32)> = spans.flat_map(|(s, e)| [(s, 1), (e, -1)]).collect();
    events.sort_by(|x, y| x.0.total_cmp(&y.0).then(x.1.cmp(&y.1)));
    let (mut now, mut most) = (0i32, 0i32);
    for (_, d) in events {
        now += d;
        most = most.max(now);
    }
    (most > 0).then_some(most as usize)
}
