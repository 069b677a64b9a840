//! A command run beside other work, for what only waits part of the time: its output goes
//! to a log, printed whole when it ends, and its exit status is one check. CI runs the
//! `serve_e2e` tests beside the e2e legs that compare content only
//! ([`crate::e2e::runner`]); nothing that runs beside anything judges wall-clock timing
//! unless against the disturbance it measured.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Result;
use vcr_host::child::{ChildGuard, read_log};

use crate::stack::result::CheckResult;

/// What runs beside: its name and its command.
pub struct Beside {
    pub name: String,
    pub cmd: Command,
}

/// A [`Beside`] that was started; stopped (its process group killed) if dropped unfinished.
pub(crate) struct Running {
    name: String,
    child: ChildGuard,
    log: PathBuf,
    started: Instant,
}

impl Beside {
    /// Start it, its output into a log in `dir`; `what` says beside what (for the line
    /// that announces it).
    pub(crate) fn start(self, dir: &Path, what: &str) -> Result<Running> {
        let file: String = self
            .name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let log = dir.join(format!("{file}.log"));
        eprintln!(
            "\n=== {} starts beside {what} (its output: {})",
            self.name,
            log.display()
        );
        let child = ChildGuard::spawn(&self.name, self.cmd, &log, Duration::from_secs(10))?;
        Ok(Running {
            name: self.name,
            child,
            log,
            started: Instant::now(),
        })
    }
}

impl Running {
    /// Wait for it to end, print its output, and give its result as one check: it passed
    /// when it exited 0. The detail says how long it ran and how long it went on after the
    /// work beside it ended (what running beside did not hide).
    pub(crate) fn finish(mut self) -> (String, CheckResult) {
        let waiting = Instant::now();
        let status = loop {
            if let Some(s) = self.child.exit_status() {
                break s;
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        // the leftovers of its process group, if any, go with it
        self.child.stop();
        let output = read_log(&self.log);
        println!(
            "\n=== {} (its output, from {})",
            self.name,
            self.log.display()
        );
        println!("{}", output.trim_end());
        let results: Vec<&str> = output
            .lines()
            .filter(|l| l.starts_with("test result:"))
            .collect();
        // when it ended: its log's last write (it may have ended long before `finish`)
        let ended = std::fs::metadata(&self.log)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .unwrap_or_default();
        let secs = (self.started.elapsed().saturating_sub(ended)).as_secs_f64();
        let mut detail = status.to_string();
        if !results.is_empty() {
            detail += &format!("; {}", results.join(" / "));
        }
        detail += &format!(
            "; ran {secs:.1} s, {:.1} s of it after the work beside it ended ({:.1} s before)",
            waiting.elapsed().saturating_sub(ended).as_secs_f64(),
            ended.saturating_sub(waiting.elapsed()).as_secs_f64()
        );
        eprintln!("=== {}: {detail}", self.name);
        let check = CheckResult {
            name: "exits 0".to_string(),
            pass: status.success(),
            detail,
            secs,
        };
        (self.name, check)
    }
}
