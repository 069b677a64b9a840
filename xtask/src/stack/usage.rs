//! CPU time spent by this process and the children it has reaped, and by the whole host,
//! for the wall and CPU figures CI prints per stage and the e2e runner per leg. On a
//! shared host a wall time carries everyone's load; the CPU time of our own processes does
//! not, the host's busy time minus ours is the others' load, and wall time well above our
//! CPU time / cores is time spent waiting (boots, paced streams, sleeps).

use std::time::Instant;

/// User + system seconds of this process (every thread) and of every child it waited for
/// (with their own waited-for descendants). A child still running, or one reaped by init
/// after its parent died, is not in it.
pub(crate) fn cpu_secs() -> f64 {
    let secs = |who: libc::c_int| {
        let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
        // SAFETY: getrusage fills the struct it is given; RUSAGE_SELF and RUSAGE_CHILDREN
        // are always valid.
        if unsafe { libc::getrusage(who, ru.as_mut_ptr()) } != 0 {
            return 0.0;
        }
        // SAFETY: getrusage returned 0, so it wrote the struct.
        let ru = unsafe { ru.assume_init() };
        let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        tv(ru.ru_utime) + tv(ru.ru_stime)
    };
    secs(libc::RUSAGE_SELF) + secs(libc::RUSAGE_CHILDREN)
}

/// Seconds the host's cores have been busy since boot, every process's (`/proc/stat`: all
/// but idle and iowait), or `None` where there is no such file.
pub(crate) fn host_busy_secs() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    // user nice system idle iowait irq softirq steal (guest time is inside user)
    let ticks: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .filter_map(|t| t.parse().ok())
        .collect();
    if ticks.len() < 5 {
        return None;
    }
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz <= 0 {
        return None;
    }
    Some((ticks.iter().sum::<f64>() - ticks[3] - ticks[4]) / hz as f64)
}

/// Wall time, our CPU time and the others' since a starting point.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Span {
    started: Instant,
    cpu0: f64,
    host0: Option<f64>,
}

/// What a [`Span`] measured, seconds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Spent {
    pub(crate) wall: f64,
    /// Ours: this process and the children it reaped.
    pub(crate) cpu: f64,
    /// Everyone else's on the host (the host's busy time minus ours), when known.
    pub(crate) others: Option<f64>,
}

impl Span {
    pub(crate) fn start() -> Span {
        Span {
            started: Instant::now(),
            cpu0: cpu_secs(),
            host0: host_busy_secs(),
        }
    }

    pub(crate) fn spent(&self) -> Spent {
        let cpu = (cpu_secs() - self.cpu0).max(0.0);
        let others = match (self.host0, host_busy_secs()) {
            (Some(a), Some(b)) => Some((b - a - cpu).max(0.0)),
            _ => None,
        };
        Spent {
            wall: self.started.elapsed().as_secs_f64(),
            cpu,
            others,
        }
    }

    /// `12.3 s wall, 20.1 s CPU (1.6 cores), others 3.2 s CPU`.
    pub(crate) fn describe(&self) -> String {
        self.spent().to_string()
    }
}

impl std::fmt::Display for Spent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.1} s wall, {:.1} s CPU ({:.2} cores busy)",
            self.wall,
            self.cpu,
            self.cpu / self.wall.max(1e-9)
        )?;
        if let Some(o) = self.others {
            write!(f, ", others on the host {o:.1} s CPU")?;
        }
        Ok(())
    }
}
