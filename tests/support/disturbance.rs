//! How much the machine disturbed a wall-clock test while it ran: a probe thread that asks
//! to sleep 1 ms over and over and keeps how much longer each sleep took. A stall that
//! delays the code under test (another process's burst on shared cores) delays the probe
//! too, so a timing check can be judged against what its own run suffered instead of
//! being run a second time. A client in another process (a Python load generator) is
//! also slowed by something a short sleep barely feels: more runnable tasks than cores,
//! which stretches any CPU work by their ratio. The probe samples the kernel's count of
//! runnable tasks at each tick and keeps the mean of that stretch.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub struct Disturbance {
    stop: Arc<AtomicBool>,
    probe: Option<JoinHandle<(Duration, f64)>>,
}

/// What a probed window suffered.
#[derive(Clone, Copy, Debug)]
pub struct Suffered {
    /// The longest a 1 ms sleep overran, ms.
    pub worst_ms: f64,
    /// How much CPU work was stretched on average: runnable tasks (the probe standing in
    /// for the work) per core, at least 1 (1 where the kernel does not say).
    pub cpu_stretch: f64,
}

/// Runnable tasks now, this thread included (`/proc/loadavg`'s fourth field).
fn runnable() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    let field = text.split_whitespace().nth(3)?;
    field.split('/').next()?.parse().ok()
}

impl Disturbance {
    /// Start probing.
    pub fn start() -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let probe = std::thread::spawn(move || {
            let tick = Duration::from_millis(1);
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
            let mut worst = Duration::ZERO;
            let (mut stretch, mut samples) = (0.0, 0u32);
            while !flag.load(Ordering::Relaxed) {
                let t = Instant::now();
                std::thread::sleep(tick);
                worst = worst.max(t.elapsed().saturating_sub(tick));
                if let Some(n) = runnable() {
                    stretch += (n / cores).max(1.0);
                    samples += 1;
                }
            }
            let mean = if samples == 0 {
                1.0
            } else {
                stretch / f64::from(samples)
            };
            (worst, mean)
        });
        Self {
            stop,
            probe: Some(probe),
        }
    }

    /// Stop probing: the longest a 1 ms sleep overran while the test ran, ms.
    pub fn worst_ms(self) -> f64 {
        self.finish().worst_ms
    }

    /// Stop probing: everything the window suffered.
    pub fn finish(mut self) -> Suffered {
        self.stop.store(true, Ordering::Relaxed);
        let (worst, cpu_stretch) = self
            .probe
            .take()
            .and_then(|p| p.join().ok())
            .unwrap_or((Duration::ZERO, 1.0));
        Suffered {
            worst_ms: worst.as_secs_f64() * 1e3,
            cpu_stretch,
        }
    }
}

impl Drop for Disturbance {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The engine's own pacing lateness, (p50, p99) in ms, from the line `play` (and `serve`'s
/// engine) logs when it stops: how late it emitted its steps against the deadlines its
/// latency model set. A wall-clock check of what the engine paced is judged against it.
pub fn engine_lateness_ms(log: &str) -> Option<(f64, f64)> {
    let line = log
        .lines()
        .rev()
        .find(|l| l.contains("pacing: step emission lateness"))?;
    let field = |name: &str| -> Option<f64> {
        let rest = &line[line.find(&format!("{name}="))? + name.len() + 1..];
        let value = rest
            .trim_start_matches('"')
            .split(|c: char| c == '"' || c.is_whitespace())
            .next()?;
        value.parse::<f64>().ok().map(|us| us / 1e3)
    };
    Some((field("lateness_p50_us")?, field("lateness_p99_us")?))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_engine_lateness_is_read_from_its_exit_line() {
        let log = "INFO vllm_vcr::play::io: pacing: step emission lateness against the \
                   scheduled deadlines rank=0 steps=812 lateness_p50_us=\"143.2\" \
                   lateness_p99_us=\"2210.0\" lateness_max_us=\"5100.3\"";
        assert_eq!(super::engine_lateness_ms(log), Some((0.1432, 2.21)));
        assert_eq!(super::engine_lateness_ms("nothing"), None);
    }
}
