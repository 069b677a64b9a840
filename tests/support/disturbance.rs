//! How much the machine disturbed a wall-clock test while it ran: a probe thread that asks
//! to sleep 1 ms over and over and keeps how much longer each sleep took. A stall that
//! delays the code under test (another process's burst on shared cores) delays the probe
//! too, so a timing check can be judged against what its own run suffered instead of
//! being run a second time.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub struct Disturbance {
    stop: Arc<AtomicBool>,
    probe: Option<JoinHandle<Duration>>,
}

impl Disturbance {
    /// Start probing.
    pub fn start() -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let probe = std::thread::spawn(move || {
            let tick = Duration::from_millis(1);
            let mut worst = Duration::ZERO;
            while !flag.load(Ordering::Relaxed) {
                let t = Instant::now();
                std::thread::sleep(tick);
                worst = worst.max(t.elapsed().saturating_sub(tick));
            }
            worst
        });
        Self {
            stop,
            probe: Some(probe),
        }
    }

    /// Stop probing: the longest a 1 ms sleep overran while the test ran, ms.
    pub fn worst_ms(mut self) -> f64 {
        self.stop.store(true, Ordering::Relaxed);
        let worst = self
            .probe
            .take()
            .and_then(|p| p.join().ok())
            .unwrap_or_default();
        worst.as_secs_f64() * 1e3
    }
}

impl Drop for Disturbance {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
