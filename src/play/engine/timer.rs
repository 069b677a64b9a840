//! A sub-millisecond timer for the engine loop.
//!
//! tokio's timer wheel has millisecond granularity (sleeps wake 0.7–1.6 ms late at p50,
//! measured on a 2-core VM), which is far from the 0.2 ms pacing budget. A Linux
//! `timerfd` registered with tokio's reactor wakes well within that budget (step lateness
//! p50 ~70 µs, p99 140–170 µs at 100–1,000 streams; `cargo bench --bench engine`, pacing
//! part) and keeps the loop an ordinary `select!` participant.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;

pub struct PreciseTimer {
    fd: AsyncFd<OwnedFd>,
}

impl PreciseTimer {
    /// Must be called inside a tokio runtime with IO enabled.
    pub fn new() -> io::Result<Self> {
        // SAFETY: plain syscall; the returned descriptor is owned below.
        let raw = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor we own.
        let owned = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: `owned` is an open timerfd owned by the AsyncFd for its whole lifetime.
        let fd =
            unsafe { AsyncFd::register(owned) }.map_err(|e| io::Error::other(e.to_string()))?;
        Ok(Self { fd })
    }

    fn arm(&self, after: Duration) -> io::Result<()> {
        // A zero it_value disarms the timer, so never pass zero.
        let after = after.max(Duration::from_nanos(1));
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: after.as_secs() as libc::time_t,
                tv_nsec: after.subsec_nanos() as libc::c_long,
            },
        };
        // SAFETY: valid fd and a properly initialised itimerspec.
        let rc =
            unsafe { libc::timerfd_settime(self.fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Sleep until `deadline` (returns at once if it has passed). Cancel-safe: dropping the
    /// future leaves at most a stale readiness, which costs the next call one more arming.
    ///
    /// The expiry is never read: arming resets the timerfd's count, and each expiry after
    /// an arming wakes the reactor afresh (mio registers descriptors edge-triggered), so a
    /// wake-up is cleared and the clock decides. That saves a `read` per paced step.
    pub async fn sleep_until(&mut self, deadline: Instant) {
        loop {
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            if self.arm(deadline - now).is_err() {
                // fall back to the coarse timer rather than spinning
                tokio::time::sleep_until(deadline.into()).await;
                return;
            }
            match self.fd.readable().await {
                Ok(mut guard) => guard.clear_ready(),
                Err(_) => {
                    tokio::time::sleep_until(deadline.into()).await;
                    return;
                }
            }
        }
    }
}

/// The engine's monotonic clock in seconds, the clock of `EngineCoreOutputs.timestamp` and
/// of event timestamps (Python's `time.monotonic()` reads the same `CLOCK_MONOTONIC`).
pub fn monotonic_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a local timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Convert an `Instant` to the monotonic-seconds clock (both are CLOCK_MONOTONIC on Linux).
/// The offset between the two is measured once, so converted times keep their order.
pub fn instant_to_monotonic(t: Instant) -> f64 {
    static ANCHOR: std::sync::OnceLock<(Instant, f64)> = std::sync::OnceLock::new();
    let (i0, m0) = *ANCHOR.get_or_init(|| (Instant::now(), monotonic_seconds()));
    if t >= i0 {
        m0 + (t - i0).as_secs_f64()
    } else {
        m0 - (i0 - t).as_secs_f64()
    }
}

/// Now, on the engine's output clock.
pub fn now_monotonic() -> f64 {
    instant_to_monotonic(Instant::now())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread")]
    async fn wakes_close_to_the_deadline() {
        let mut t = PreciseTimer::new().unwrap();
        let mut late = Vec::new();
        for _ in 0..50 {
            let d = Instant::now() + Duration::from_micros(700);
            t.sleep_until(d).await;
            let now = Instant::now();
            assert!(now >= d);
            late.push((now - d).as_micros());
        }
        late.sort();
        // generous: CI machines are noisy; the benchmark measures the real figure
        assert!(late[25] < 1000, "median lateness {} µs", late[25]);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_abandoned_sleeps_expiry_does_not_end_the_next_one_early() {
        let mut t = PreciseTimer::new().unwrap();
        let later = Instant::now() + Duration::from_millis(100);
        // dropped well before its expiry (tokio's timer wakes within a few ms), which then
        // fires with nobody waiting and leaves the descriptor's readiness set
        let abandoned = tokio::time::timeout(Duration::from_millis(1), t.sleep_until(later)).await;
        assert!(abandoned.is_err(), "the first sleep was to be abandoned");
        tokio::time::sleep_until((later + Duration::from_millis(10)).into()).await;
        let d = Instant::now() + Duration::from_millis(5);
        t.sleep_until(d).await;
        assert!(Instant::now() >= d);
        // and the one after that still wakes (its expiry was not swallowed)
        let d = Instant::now() + Duration::from_millis(2);
        tokio::time::timeout(Duration::from_millis(500), t.sleep_until(d))
            .await
            .expect("the timer woke");
        assert!(Instant::now() >= d);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn past_deadlines_return_immediately() {
        let mut t = PreciseTimer::new().unwrap();
        let past = Instant::now() - Duration::from_millis(5);
        tokio::time::timeout(Duration::from_millis(50), t.sleep_until(past))
            .await
            .unwrap();
    }

    #[test]
    fn monotonic_clock_agrees_with_instant() {
        let a = monotonic_seconds();
        let b = instant_to_monotonic(Instant::now());
        assert!((b - a).abs() < 0.01);
    }
}
