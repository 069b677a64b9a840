//! [`TestCommand`]: a `std::process::Command` that, when the process does not end as the
//! test expects, panics with everything needed to rerun it by hand.

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Command, Output};

/// The `vllm-vcr` binary under test.
pub fn vcr() -> TestCommand {
    TestCommand::new(env!("CARGO_BIN_EXE_vllm-vcr"))
}

pub struct TestCommand {
    cmd: Command,
    expect_failure: bool,
}

impl TestCommand {
    pub fn new(program: impl AsRef<OsStr>) -> Self {
        TestCommand {
            cmd: Command::new(program),
            expect_failure: false,
        }
    }

    pub fn arg(&mut self, arg: impl AsRef<OsStr>) -> &mut Self {
        self.cmd.arg(arg);
        self
    }

    pub fn args<I, S>(&mut self, args: I) -> &mut Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.cmd.args(args);
        self
    }

    pub fn env(&mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> &mut Self {
        self.cmd.env(key, value);
        self
    }

    pub fn current_dir(&mut self, dir: impl AsRef<Path>) -> &mut Self {
        self.cmd.current_dir(dir);
        self
    }

    /// [`run`](Self::run) then expects a non-zero exit.
    pub fn expect_failure(&mut self) -> &mut Self {
        self.expect_failure = true;
        self
    }

    /// The process's output, whatever its exit status (`Command::output`: stdout and
    /// stderr captured, nothing on stdin).
    #[track_caller]
    pub fn output(&mut self) -> Output {
        self.cmd
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", self.describe()))
    }

    /// Run to the end; panic, with the command, its directory and what it printed, when it
    /// fails (or, after [`expect_failure`](Self::expect_failure), when it succeeds).
    #[track_caller]
    pub fn run(&mut self) -> Output {
        let out = self.output();
        if out.status.success() == self.expect_failure {
            let expected = if self.expect_failure {
                "failure"
            } else {
                "success"
            };
            panic!(
                "expected {expected}, got {}\n{}",
                out.status,
                self.report(&out)
            );
        }
        out
    }

    /// Run to the end, expecting a non-zero exit; what it printed on stderr.
    #[track_caller]
    pub fn run_failing(&mut self) -> String {
        self.expect_failure = true;
        stderr(&self.run())
    }

    /// The command as one would type it, with the environment it sets.
    pub fn describe(&self) -> String {
        let mut line: Vec<String> = self
            .cmd
            .get_envs()
            .map(|(k, v)| match v {
                Some(v) => format!("{}={}", k.to_string_lossy(), v.to_string_lossy()),
                None => format!("-u {}", k.to_string_lossy()),
            })
            .collect();
        line.push(self.cmd.get_program().to_string_lossy().into_owned());
        line.extend(
            self.cmd
                .get_args()
                .map(|a| a.to_string_lossy().into_owned()),
        );
        line.join(" ")
    }

    fn report(&self, out: &Output) -> String {
        let dir = match self.cmd.get_current_dir() {
            Some(d) => d.display().to_string(),
            None => std::env::current_dir()
                .map(|d| d.display().to_string())
                .unwrap_or_default(),
        };
        format!(
            "command: {}\ndir: {dir}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.describe(),
            stdout(out),
            stderr(out)
        )
    }
}

/// What a process printed on stdout, lossily decoded.
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// What a process printed on stderr, lossily decoded.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Stdout and stderr of a process, lossily decoded.
pub fn texts(out: &Output) -> (String, String) {
    (stdout(out), stderr(out))
}

/// `vllm-vcr inspect <sub> <args>`.
pub fn inspect(sub: &str, args: &[&str]) -> TestCommand {
    let mut c = vcr();
    c.args(["inspect", sub]).args(args);
    c
}

/// The `vllm-vcr` binary as a plain `Command`, for a process the test spawns and drives
/// (a server, a tap) rather than runs to its end.
pub fn vcr_command() -> Command {
    Command::new(env!("CARGO_BIN_EXE_vllm-vcr"))
}

/// `inspect fit` of the capture `trace` with its step-stats sidecar `steps` into `model`.
pub fn fit_model(
    trace: impl AsRef<std::path::Path>,
    steps: impl AsRef<std::path::Path>,
    model: &std::path::Path,
) {
    vcr()
        .args(["inspect", "fit"])
        .arg(trace.as_ref())
        .arg("--steps")
        .arg(steps.as_ref())
        .arg("-o")
        .arg(model)
        .run();
}
