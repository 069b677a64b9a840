//! Waiting-queue order: which waiting request is admitted next.
//!
//! vLLM's scheduler admits from its waiting queue in FCFS order, or by `(priority,
//! arrival)` under `--scheduling-policy priority`; preempted requests go back to the front.
//! Shortest-prompt-first is an extra policy for experiments.

use clap::ValueEnum;

/// What a policy may look at for each waiting request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitingKey {
    /// Admission order; preempted requests get a smaller value than every arrival so they
    /// are re-admitted first (vLLM prepends them to the waiting queue).
    pub seq: i64,
    /// `EngineCoreRequest.priority` (lower is served first, as in vLLM).
    pub priority: i64,
    pub prompt_len: u64,
}

/// Orders the waiting queue: requests are admitted in ascending `sort_key` order.
pub trait QueuePolicy: Send {
    /// The admission order key of a waiting request (smaller goes first).
    fn sort_key(&self, w: &WaitingKey) -> (i64, i64, i64);
    fn name(&self) -> &'static str;

    /// Index into `waiting` of the request to admit next, if any.
    fn pick(&self, waiting: &[WaitingKey]) -> Option<usize> {
        waiting
            .iter()
            .enumerate()
            .min_by_key(|(_, w)| self.sort_key(w))
            .map(|(i, _)| i)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum SchedulingPolicy {
    /// First come, first served (vLLM's default).
    #[default]
    Fcfs,
    /// Lowest `priority` first, then arrival order (vLLM's `priority` policy).
    Priority,
    /// Shortest prompt first, then arrival order (not a vLLM policy).
    ShortestPromptFirst,
}

impl SchedulingPolicy {
    pub fn build(self) -> Box<dyn QueuePolicy> {
        match self {
            Self::Fcfs => Box::new(Fcfs),
            Self::Priority => Box::new(Priority),
            Self::ShortestPromptFirst => Box::new(ShortestPromptFirst),
        }
    }
}

pub struct Fcfs;
impl QueuePolicy for Fcfs {
    fn sort_key(&self, w: &WaitingKey) -> (i64, i64, i64) {
        (w.seq, 0, 0)
    }
    fn name(&self) -> &'static str {
        "fcfs"
    }
}

pub struct Priority;
impl QueuePolicy for Priority {
    fn sort_key(&self, w: &WaitingKey) -> (i64, i64, i64) {
        (w.priority, w.seq, 0)
    }
    fn name(&self) -> &'static str {
        "priority"
    }
}

pub struct ShortestPromptFirst;
impl QueuePolicy for ShortestPromptFirst {
    fn sort_key(&self, w: &WaitingKey) -> (i64, i64, i64) {
        // preempted requests (negative seq) keep their place at the front
        (i64::from(w.seq >= 0), w.prompt_len as i64, w.seq)
    }
    fn name(&self) -> &'static str {
        "shortest-prompt-first"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(seq: i64, priority: i64, prompt_len: u64) -> WaitingKey {
        WaitingKey {
            seq,
            priority,
            prompt_len,
        }
    }

    #[test]
    fn policies_order_the_queue() {
        let q = [k(1, 5, 100), k(2, 0, 10), k(3, 0, 5)];
        assert_eq!(Fcfs.pick(&q), Some(0));
        assert_eq!(Priority.pick(&q), Some(1));
        assert_eq!(ShortestPromptFirst.pick(&q), Some(2));
        assert_eq!(Fcfs.pick(&[]), None);
    }

    #[test]
    fn preempted_requests_go_first() {
        let q = [k(1, 0, 5), k(-1, 9, 500)];
        assert_eq!(Fcfs.pick(&q), Some(1));
        assert_eq!(ShortestPromptFirst.pick(&q), Some(1));
    }
}
