//! When each request of a workload is sent: at its recorded offset (open loop), when a
//! slot of a closed loop frees (`--replay-concurrency`), or when its parent turn finished
//! plus the think gap (`--replay-sessions`). One owner of that logic for both drivers: the
//! offline simulation on a virtual clock (`simulate`, `calibrate`) and the wall-clock
//! client of `calibrate-e2e`. The caller reports every finish; `Arrivals` answers what is
//! due next.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use super::options::RunOptions;
use super::workload::{Children, Sessions, Turn, Workload, duration_ms, ramp, ramp_sends};

pub struct Arrivals<'a> {
    work: &'a Workload,
    opts: &'a RunOptions,
    turns: Vec<Turn>,
    children: Children,
    /// Each request's session root, and the requests each session still has to finish.
    root_of: Vec<u32>,
    left_in_session: Vec<u32>,
    /// Closed loop: what takes a slot, in order (requests; with --replay-sessions, the
    /// sessions' roots), the next one (`queue[waiting]`), the slots and the ramp (of
    /// requests or sessions alike: see `workload::ramp`).
    queue: Vec<usize>,
    waiting: usize,
    slots_taken: usize,
    cap: usize,
    ramp: usize,
    /// When the load generator sent each ramp request (ms, the trace's clock).
    ramp_sends: Vec<Option<f64>>,
    /// Recorded offsets are shifted by this so that none is negative.
    shift: f64,
    /// (due, arrival-order index): the earliest first, ties in arrival order.
    due: BinaryHeap<Reverse<(Duration, usize)>>,
    /// Each unit's own turnaround, ms, in `queue`'s order (`RunOptions::own_turnarounds`;
    /// else empty).
    own: Vec<Option<f64>>,
}

impl<'a> Arrivals<'a> {
    pub fn new(work: &'a Workload, opts: &'a RunOptions) -> Self {
        let n = work.reqs.len();
        let turns = if opts.replay_sessions {
            work.sessions()
        } else {
            vec![Turn::Root; n]
        };
        let sessions = Sessions::of(&turns);
        let queue: Vec<usize> = if opts.replay_sessions {
            sessions.roots.clone()
        } else {
            (0..n).collect()
        };
        // the ramp's units are sent when the load generator sent them, not when the
        // engine queued them (what a record's arrival is)
        let (cap, ramp, ramp_sends, own) = match opts.concurrency {
            Some(c) => {
                let units = work.loop_units(opts.replay_sessions.then_some(&sessions));
                let ramp = ramp(&units, c);
                let own = match opts.own_turnarounds {
                    Some(_) => work.turnarounds_ms(&units),
                    None => Vec::new(),
                };
                (c, ramp, ramp_sends(&units, ramp), own)
            }
            None => (usize::MAX, n, Vec::new(), Vec::new()),
        };
        let shift = work
            .reqs
            .iter()
            .filter_map(|p| p.arrival_ms)
            .fold(0.0, f64::min);
        let mut a = Arrivals {
            work,
            opts,
            children: Children::of(&turns),
            root_of: sessions.root_of,
            left_in_session: sessions.size,
            turns,
            queue,
            waiting: 0,
            slots_taken: 0,
            cap,
            ramp,
            ramp_sends,
            shift,
            due: BinaryHeap::new(),
            own,
        };
        if opts.concurrency.is_none() {
            for i in 0..n {
                if a.turns[i] == Turn::Root {
                    let at = a.recorded(i);
                    a.due.push(Reverse((at, i)));
                }
            }
        }
        a.release(Duration::ZERO, 0);
        a
    }

    /// The session turns (every request a root unless --replay-sessions).
    pub fn turns(&self) -> &[Turn] {
        &self.turns
    }

    /// Request `i`'s recorded offset (records without one at 0).
    fn recorded(&self, i: usize) -> Duration {
        duration_ms(self.work.reqs[i].arrival_ms.map_or(0.0, |t| t - self.shift))
    }

    /// When the next request is due, if one is.
    pub fn next_due(&self) -> Option<Duration> {
        self.due.peek().map(|r| r.0.0)
    }

    /// The next request due at or before `until`: (when, arrival-order index).
    pub fn pop_due(&mut self, until: Duration) -> Option<(Duration, usize)> {
        let &Reverse((at, i)) = self.due.peek()?;
        (at <= until).then(|| {
            self.due.pop();
            (at, i)
        })
    }

    /// Request `index` finished (or was refused) at `at`: its turns become due, and in a
    /// closed loop its slot (its session's, once the session is done) goes to the next.
    pub fn finished(&mut self, index: usize, at: Duration) {
        let children: Vec<usize> = self.children.of_request(index).collect();
        for c in children {
            let due = match self.turns[c] {
                Turn::After { gap, .. } => at.saturating_add(gap),
                _ => at.max(self.recorded(c)),
            };
            self.due.push(Reverse((due, c)));
        }
        let root = self.root_of[index] as usize;
        self.left_in_session[root] = self.left_in_session[root].saturating_sub(1);
        let freed = if self.opts.replay_sessions {
            usize::from(self.left_in_session[root] == 0)
        } else {
            1
        };
        self.release(at, freed);
    }

    /// Give free slots to the next waiting requests (or sessions), at `now`.
    fn release(&mut self, now: Duration, freed: usize) {
        if self.opts.concurrency.is_none() {
            return;
        }
        self.slots_taken -= freed.min(self.slots_taken);
        while self.waiting < self.queue.len() && self.slots_taken < self.cap {
            let i = self.queue[self.waiting];
            let at = if self.waiting < self.ramp {
                let sent = self
                    .ramp_sends
                    .get(self.waiting)
                    .copied()
                    .flatten()
                    .map_or_else(|| self.recorded(i), |t| duration_ms(t - self.shift));
                now.max(sent)
            } else {
                let own = self
                    .own
                    .get(self.waiting)
                    .copied()
                    .flatten()
                    .map(duration_ms);
                now.saturating_add(own.unwrap_or(self.opts.think))
            };
            self.due.push(Reverse((at, i)));
            self.waiting += 1;
            self.slots_taken += 1;
        }
    }
}
