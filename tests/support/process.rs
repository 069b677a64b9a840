//! [`TestProcess`]: a process a test starts and drives rather than runs to its end (a
//! server, a tap, a proxy). Its stderr (and stdout, unless the test reads it) goes to logs
//! in a directory of its own, kept when the test fails; the tail of the logs is printed
//! when the test fails; the process is stopped when the test ends, however it ends.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::dir::TestDir;

/// How many lines of the logs a failed test prints.
const TAIL_LINES: usize = 60;

pub struct TestProcess {
    child: Child,
    name: String,
    stderr: PathBuf,
    /// Where stdout went, when the test does not read it itself.
    stdout: Option<PathBuf>,
    /// After SIGINT, how long dropping waits before SIGKILL (zero: SIGKILL at once).
    grace: Duration,
    /// Holds the logs: kept when the test fails.
    dir: TestDir,
}

impl TestProcess {
    /// Start `cmd` as `name` with stdin closed, stdout as `cmd` has it (e.g. piped, for
    /// [`take_stdout`](Self::take_stdout)) and stderr to `<name>.err` in a new directory.
    pub fn start(name: &str, cmd: Command) -> TestProcess {
        Self::spawn(name, cmd, false)
    }

    /// [`start`](Self::start), with stdout to `<name>.out` next to the stderr log.
    pub fn start_logged(name: &str, cmd: Command) -> TestProcess {
        Self::spawn(name, cmd, true)
    }

    fn spawn(name: &str, mut cmd: Command, log_stdout: bool) -> TestProcess {
        let dir = TestDir::new(name);
        let stderr = dir.path(&format!("{name}.err"));
        let create = |p: &Path| {
            File::create(p).unwrap_or_else(|e| panic!("cannot create {}: {e}", p.display()))
        };
        cmd.stdin(Stdio::null()).stderr(create(&stderr));
        let stdout = log_stdout.then(|| dir.path(&format!("{name}.out")));
        if let Some(out) = &stdout {
            cmd.stdout(create(out));
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({cmd:?}): {e}"));
        TestProcess {
            child,
            name: name.to_string(),
            stderr,
            stdout,
            grace: Duration::from_secs(10),
            dir,
        }
    }

    /// How long dropping the guard waits for the process to end after SIGINT before it
    /// kills it; `Duration::ZERO` kills it at once.
    pub fn with_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The process's piped stdout (once).
    pub fn take_stdout(&mut self) -> std::process::ChildStdout {
        self.child
            .stdout
            .take()
            .unwrap_or_else(|| panic!("{}: stdout is not piped, or taken", self.name))
    }

    /// Send `sig` to the process.
    pub fn signal(&self, sig: libc::c_int) {
        // SAFETY: signalling our own child (not yet reaped while we hold it).
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }

    /// Its exit status, if it has exited.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child
            .try_wait()
            .unwrap_or_else(|e| panic!("waiting for {}: {e}", self.name))
    }

    /// Wait up to `within` for it to exit; `None` if it is still running.
    pub fn wait_exit(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(s) = self.try_wait() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// What it wrote on stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// What it wrote so far: stderr, then the logged stdout (if any).
    pub fn log(&self) -> String {
        let out = self.stdout.as_ref().map_or_else(String::new, |p| {
            std::fs::read_to_string(p).unwrap_or_default()
        });
        self.stderr() + &out
    }

    /// Its own directory (where the logs are).
    pub fn dir(&self) -> &TestDir {
        &self.dir
    }

    fn stop(&mut self) {
        if self.try_wait_quietly() {
            return;
        }
        if !self.grace.is_zero() {
            self.signal(libc::SIGINT);
            let deadline = Instant::now() + self.grace;
            while Instant::now() < deadline {
                if self.try_wait_quietly() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether the process still runs (not exited, or exited and not yet reaped by this
    /// guard); never panics, for use in a `Drop`.
    pub fn is_running(&mut self) -> bool {
        !self.try_wait_quietly()
    }

    fn try_wait_quietly(&mut self) -> bool {
        self.child.try_wait().ok().flatten().is_some()
    }
}

impl Drop for TestProcess {
    fn drop(&mut self) {
        // a failed assertion must not leave the process running
        self.stop();
        if std::thread::panicking() {
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            eprintln!(
                "--- {} ({}): last {} lines of its log ---\n{}",
                self.name,
                self.stderr.display(),
                TAIL_LINES.min(lines.len()),
                lines[lines.len().saturating_sub(TAIL_LINES)..].join("\n")
            );
        }
    }
}
