//! The processes under test: which binary, which parts run, spawning `play`, and reading
//! a process's CPU time, memory and pacing log.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_vllm-vcr");

/// The binary under test: `BENCH_BIN=path` runs another build (e.g. a copy of the previous
/// one, for a before/after in one run).
pub(crate) fn bin() -> String {
    std::env::var("BENCH_BIN").unwrap_or_else(|_| BIN.to_string())
}

pub(crate) fn quick() -> bool {
    std::env::var_os("BENCH_QUICK").is_some()
}

/// Whether to run a part: `BENCH_ONLY=replay,pacing` runs only those (default: all).
pub(crate) fn part(name: &str) -> bool {
    match std::env::var("BENCH_ONLY") {
        Ok(v) if !v.trim().is_empty() => v.split(',').any(|p| p.trim() == name),
        _ => true,
    }
}

/// The CPU time of a process, every thread's (those that ended too), seconds, to the
/// nanosecond: the process's CPU-time clock (`clock_getcpuclockid`); [`cpu_seconds`] when
/// it cannot be read. The frontend part reads this: a paced run's engine spends about
/// 0.1 s, and the 10 ms ticks of `cpu_seconds` were a tenth of it.
pub(crate) fn process_cpu_seconds(pid: u32) -> f64 {
    let mut clock: libc::clockid_t = 0;
    // SAFETY: a plain call with a valid pointer to a local.
    let found = unsafe { libc::clock_getcpuclockid(pid as libc::pid_t, &mut clock) } == 0;
    found
        .then(|| clock_seconds(clock))
        .flatten()
        .unwrap_or_else(|| cpu_seconds(pid))
}

/// The time of `clock` (a CPU-time clock: a process's, `CLOCK_THREAD_CPUTIME_ID`), seconds.
pub(crate) fn clock_seconds(clock: libc::clockid_t) -> Option<f64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid pointer to a local timespec.
    let ok = unsafe { libc::clock_gettime(clock, &mut ts) } == 0;
    ok.then_some(ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9)
}

/// utime + stime of a process, seconds.
pub(crate) fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return f64::NAN;
    };
    // fields after the parenthesised command name
    let rest = &stat[stat.rfind(')').map_or(0, |i| i + 2)..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|s| s.parse::<f64>().ok()).unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (ticks(11) + ticks(12)) / hz
}

pub(crate) struct Engine {
    pub(crate) child: Child,
    pub(crate) log: PathBuf,
}

impl Engine {
    pub(crate) fn start(handshake: &str, extra: &[&str], log: &Path) -> Engine {
        Self::start_bin(&bin(), handshake, extra, log)
    }

    /// [`Engine::start`] of the build at `bin`.
    pub(crate) fn start_bin(bin: &str, handshake: &str, extra: &[&str], log: &Path) -> Engine {
        let f = std::fs::File::create(log).unwrap();
        let child = Command::new(bin)
            .arg("play")
            .args(["--handshake-address", handshake])
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(f)
            .spawn()
            .expect("start vllm-vcr play");
        Engine {
            child,
            log: log.to_path_buf(),
        }
    }

    pub(crate) fn stop(mut self) -> String {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// VmRSS of a process, KiB.
pub(crate) fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

pub(crate) fn log_field(log: &str, key: &str) -> Option<f64> {
    let line = log.lines().rev().find(|l| l.contains("pacing:"))?;
    let plain: String = strip_ansi(line);
    let at = plain.find(&format!("{key}="))? + key.len() + 1;
    let rest = plain[at..].trim_start_matches('"');
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

pub(crate) fn strip_ansi(s: &str) -> String {
    let mut out = String::new();
    let mut esc = false;
    for c in s.chars() {
        if esc {
            if c.is_ascii_alphabetic() {
                esc = false;
            }
        } else if c == '\u{1b}' {
            esc = true;
        } else {
            out.push(c);
        }
    }
    out
}

pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub(crate) fn wait_health(port: u16, timeout: Duration) -> bool {
    use std::io::{Read, Write};
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            let _ = s.write_all(b"GET /health HTTP/1.0\r\nHost: x\r\n\r\n");
            let mut buf = [0u8; 32];
            if let Ok(n) = s.read(&mut buf)
                && String::from_utf8_lossy(&buf[..n]).contains(" 200")
            {
                return true;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}
