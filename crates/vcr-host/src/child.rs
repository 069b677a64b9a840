//! Child processes (the frontends of `serve` and of the e2e run): spawning with logs,
//! bounded waits, and a guard that always stops what it started (on every exit path,
//! panics and Ctrl-C included).

use std::fs::File;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Process groups of the children alive right now, so a signal handler can kill them.
static LIVE_GROUPS: [AtomicI32; 32] = [const { AtomicI32::new(0) }; 32];

fn register_group(pgid: i32) {
    for slot in &LIVE_GROUPS {
        if slot
            .compare_exchange(0, pgid, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            return;
        }
    }
}

fn unregister_group(pgid: i32) {
    for slot in &LIVE_GROUPS {
        let _ = slot.compare_exchange(pgid, 0, Ordering::SeqCst, Ordering::SeqCst);
    }
}

extern "C" fn on_fatal_signal(sig: libc::c_int) {
    // Only async-signal-safe calls here: kill(2) and _exit(2).
    for slot in &LIVE_GROUPS {
        let pgid = slot.load(Ordering::SeqCst);
        if pgid > 0 {
            // SAFETY: kill is async-signal-safe; the group is one this process created.
            unsafe { libc::kill(-pgid, libc::SIGKILL) };
        }
    }
    // SAFETY: _exit is async-signal-safe.
    unsafe { libc::_exit(128 + sig) };
}

/// Children run in their own process groups (so the whole tree of a multi-process frontend
/// can be stopped); this makes Ctrl-C / SIGTERM on the xtask take them down too.
pub fn install_signal_handlers() {
    let handler = on_fatal_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: installing a handler that only calls async-signal-safe functions.
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
        libc::signal(libc::SIGHUP, handler);
    }
}

/// A running child; dropping it stops it (SIGTERM, bounded wait, then SIGKILL of its group).
pub struct ChildGuard {
    pub name: String,
    pub log: PathBuf,
    child: Option<Child>,
    grace: Duration,
}

impl ChildGuard {
    /// Spawn `cmd` in a new process group with stdout and stderr appended to `log`.
    pub fn spawn(name: &str, mut cmd: Command, log: &Path, grace: Duration) -> Result<ChildGuard> {
        use std::os::unix::process::CommandExt;
        let out = File::options()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening log {}", log.display()))?;
        let err = out.try_clone()?;
        cmd.stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0);
        crate::errln!("  $ {}", describe(&cmd));
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {name}: {}", describe(&cmd)))?;
        register_group(child.id() as i32);
        Ok(ChildGuard {
            name: name.to_string(),
            log: log.to_path_buf(),
            child: Some(child),
            grace,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// `Some(status)` if the child has exited.
    pub fn exited(&mut self) -> Option<String> {
        let child = self.child.as_mut()?;
        match child.try_wait() {
            Ok(Some(status)) => Some(status.to_string()),
            Ok(None) => None,
            Err(e) => Some(format!("unknown ({e})")),
        }
    }

    /// The child's exit status, if it has exited.
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut()?.try_wait().ok().flatten()
    }

    /// Fail if the child is gone.
    pub fn ensure_running(&mut self) -> Result<()> {
        match self.exited() {
            Some(status) => bail!(
                "{} exited early ({status}); log: {}",
                self.name,
                self.log.display()
            ),
            None => Ok(()),
        }
    }

    /// SIGTERM, wait up to the grace period, then SIGKILL the whole process group.
    /// Returns how the child ended.
    pub fn stop(&mut self) -> String {
        let Some(mut child) = self.child.take() else {
            return "already stopped".into();
        };
        let pid = child.id() as i32;
        let outcome = match child.try_wait() {
            Ok(Some(status)) => format!("had exited ({status})"),
            _ => {
                // SAFETY: signalling a child this guard spawned.
                unsafe { libc::kill(pid, libc::SIGTERM) };
                let deadline = Instant::now() + self.grace;
                loop {
                    match child.try_wait() {
                        Ok(Some(status)) => break format!("stopped on SIGTERM ({status})"),
                        Ok(None) if Instant::now() < deadline => {
                            std::thread::sleep(Duration::from_millis(50))
                        }
                        _ => {
                            // SAFETY: the group was created for this child.
                            unsafe { libc::kill(-pid, libc::SIGKILL) };
                            let _ = child.wait();
                            break format!("killed after {:?} grace", self.grace);
                        }
                    }
                }
            }
        };
        // Leftovers of the group (e.g. API-server workers of the Python frontend).
        // SAFETY: the group was created for this child; ESRCH when nothing is left is fine.
        unsafe { libc::kill(-pid, libc::SIGKILL) };
        unregister_group(pid);
        outcome
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if self.child.is_some() {
            let name = self.name.clone();
            let how = self.stop();
            crate::errln!("  stopped {name}: {how}");
        }
    }
}

pub use crate::frontends::describe;

/// `n` distinct free TCP ports on 127.0.0.1 (held open together while picking).
///
/// Ports come from below the kernel's ephemeral range (`ip_local_port_range`): a port the
/// kernel handed out with `bind(:0)` is released when we return, and the next socket that
/// binds `:0` (a frontend's ZMQ sockets, a client's outgoing connection) may get the very
/// same number before our child binds it — "Address already in use". Below the range the
/// kernel never assigns ports on its own, so only another picker can race us, and pickers
/// start at a per-process offset and never hand out the same port twice in one process.
pub fn free_ports(n: usize) -> Result<Vec<u16>> {
    let (lo, hi) = outside_ephemeral_range();
    if hi <= lo || hi - lo < 1000 {
        return kernel_ports(n);
    }
    let span = u32::from(hi - lo);
    let mut listeners = Vec::with_capacity(n);
    let mut ports = Vec::with_capacity(n);
    for _ in 0..span {
        if ports.len() == n {
            break;
        }
        let offset = NEXT_PORT.fetch_add(1, Ordering::Relaxed);
        let port = lo + ((port_seed() + offset) % span) as u16;
        // Fails when anything listens there, on 127.0.0.1 or the wildcard address.
        if let Ok(l) = TcpListener::bind(("127.0.0.1", port)) {
            listeners.push(l);
            ports.push(port);
        }
    }
    if ports.len() < n {
        return kernel_ports(n);
    }
    Ok(ports)
}

static NEXT_PORT: AtomicU32 = AtomicU32::new(0);

/// Where this process starts picking: spread by pid and time so that parallel test
/// processes rarely walk the same ports.
fn port_seed() -> u32 {
    static SEED: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *SEED.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        std::process::id().wrapping_mul(7919) ^ nanos
    })
}

/// The port range the kernel never assigns by itself: [10000, start of the ephemeral
/// range), or above its end if the range starts low.
fn outside_ephemeral_range() -> (u16, u16) {
    let text =
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    let mut it = text
        .split_whitespace()
        .filter_map(|t| t.parse::<u32>().ok());
    let (start, end) = (it.next().unwrap_or(32768), it.next().unwrap_or(60999));
    if start >= 11000 {
        (10000, start.min(65535) as u16)
    } else {
        ((end + 1).min(65535) as u16, 65535)
    }
}

/// Fallback: ports the kernel picks (`bind(:0)`).
fn kernel_ports(n: usize) -> Result<Vec<u16>> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<_>>()
        .context("binding a free port")?;
    listeners
        .iter()
        .map(|l| Ok(l.local_addr()?.port()))
        .collect()
}

/// Whether something LISTENs on `port` (from /proc/net/tcp{,6}; no connection is made, so
/// the frontend's ZMQ socket never sees a stray peer).
pub fn is_listening(port: u16) -> bool {
    let needle = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        std::fs::read_to_string(f).is_ok_and(|text| {
            text.lines().skip(1).any(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                cols.len() > 3 && cols[1].ends_with(&needle) && cols[3] == "0A"
            })
        })
    })
}

/// Wait until `port` listens, failing early if one of `watch` exits.
pub fn wait_listening(
    port: u16,
    timeout: Duration,
    watch: &mut [&mut ChildGuard],
) -> Result<Duration> {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if is_listening(port) {
            return Ok(start.elapsed());
        }
        for c in watch.iter_mut() {
            c.ensure_running()?;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("port {port} did not start listening within {timeout:?}")
}

/// Remove ANSI colour sequences (vllm-rs logs are coloured).
pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                // CSI: parameters and intermediates, then one final byte in @..~
                for c in chars.by_ref() {
                    if ('@'..='~').contains(&c) {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

/// The log as text with colours removed (lossy UTF-8; empty if unreadable).
pub fn read_log(path: &Path) -> String {
    std::fs::read(path)
        .map(|b| strip_ansi(&String::from_utf8_lossy(&b)))
        .unwrap_or_default()
}

/// The log from byte offset `from` on.
pub fn read_log_from(path: &Path, from: u64) -> String {
    std::fs::read(path)
        .map(|b| {
            let from = (from as usize).min(b.len());
            strip_ansi(&String::from_utf8_lossy(&b[from..]))
        })
        .unwrap_or_default()
}

pub fn log_len(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

/// The last `n` lines of a log, colours removed.
pub fn tail(path: &Path, n: usize) -> String {
    let text = read_log(path);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_colours() {
        let s = "\u{1b}[2m09-01\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m ready";
        assert_eq!(strip_ansi(s), "09-01  INFO ready");
    }

    #[test]
    fn sees_a_listener() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        assert!(is_listening(port));
        drop(l);
        // A test spawning a child at this moment holds a copy of the socket between its
        // fork and exec (the fd is CLOEXEC, not gone): allow for that window.
        let deadline = Instant::now() + Duration::from_secs(2);
        while is_listening(port) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!is_listening(port));
    }

    #[test]
    fn distinct_ports() {
        let p = free_ports(2).unwrap();
        assert_ne!(p[0], p[1]);
    }
}
