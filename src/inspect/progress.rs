//! Progress on stderr for long work: at most one line a second, only after the first
//! second, so short runs stay quiet.

use std::io::Write;
use std::time::{Duration, Instant};

pub struct Progress {
    what: &'static str,
    started: Instant,
    last: Instant,
    count: u64,
    printed: bool,
}

impl Progress {
    pub fn new(what: &'static str) -> Self {
        let now = Instant::now();
        Self {
            what,
            started: now,
            last: now,
            count: 0,
            printed: false,
        }
    }

    /// Count one item; maybe print.
    pub fn tick(&mut self) {
        self.count += 1;
        if self.count.is_multiple_of(4096) {
            let now = Instant::now();
            if now.duration_since(self.last) >= Duration::from_secs(1) {
                self.last = now;
                self.printed = true;
                let _ = write!(
                    std::io::stderr(),
                    "\r{} {} ({:.0} s)",
                    self.what,
                    self.count,
                    now.duration_since(self.started).as_secs_f64()
                );
            }
        }
    }

    /// For work that is not a count of items: maybe print `status()` after `what` (at most
    /// once a second, after the first). Cheap to call often: the clock is read on every
    /// 1024th call, and `status` runs only when a line is printed.
    pub fn status(&mut self, status: impl FnOnce() -> String) {
        self.count += 1;
        if !self.count.is_multiple_of(1024) {
            return;
        }
        let now = Instant::now();
        if now.duration_since(self.last) >= Duration::from_secs(1) {
            self.last = now;
            self.printed = true;
            let _ = write!(
                std::io::stderr(),
                "\r{} {} ({:.0} s)   ",
                self.what,
                status(),
                now.duration_since(self.started).as_secs_f64()
            );
        }
    }

    /// End a [`status`](Self::status) line with a last status (if a line was printed).
    pub fn finish_status(&self, status: &str) {
        if self.printed {
            let _ = writeln!(
                std::io::stderr(),
                "\r{} {status} ({:.1} s)   ",
                self.what,
                self.started.elapsed().as_secs_f64()
            );
        }
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    /// End the progress line (if one was printed).
    pub fn finish(&self) {
        if self.printed {
            let _ = writeln!(
                std::io::stderr(),
                "\r{} {} ({:.1} s)",
                self.what,
                self.count,
                self.started.elapsed().as_secs_f64()
            );
        }
    }
}
