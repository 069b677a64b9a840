//! Child processes (the frontends of `serve` and of the e2e run): spawning with logs,
//! bounded waits, and a guard that always stops what it started (on every exit path,
//! panics and Ctrl-C included). Shared with the xtask through `#[path]`.

use std::fs::File;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
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
        eprintln!("  $ {}", describe(&cmd));
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
            eprintln!("  stopped {name}: {how}");
        }
    }
}

pub use crate::frontends::describe;

/// `n` distinct free TCP ports on 127.0.0.1 (held open together while picking).
pub fn free_ports(n: usize) -> Result<Vec<u16>> {
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
