//! What a check of a leg came to, and the list a leg collects them in.

use std::time::Instant;

use anyhow::Result;

/// One check of a leg: its name, whether it passed, what it saw and how long it took.
pub struct CheckResult {
    pub name: String,
    pub pass: bool,
    pub detail: String,
    pub secs: f64,
}

/// A check that failed without running (a leg that could not start).
pub(crate) fn fail(name: &str, detail: String) -> CheckResult {
    CheckResult {
        name: name.into(),
        pass: false,
        detail,
        secs: 0.0,
    }
}

/// The checks of a leg, in the order they ran.
#[derive(Default)]
pub(crate) struct Checks(Vec<CheckResult>);

impl Checks {
    /// The checks pushed so far.
    pub(crate) fn into_results(self) -> Vec<CheckResult> {
        self.0
    }

    pub(crate) fn push(&mut self, name: &str, t: Instant, r: Result<String>) {
        let (pass, detail) = match r {
            Ok(d) => (true, d),
            Err(e) => (false, format!("{e:#}")),
        };
        let secs = t.elapsed().as_secs_f64();
        eprintln!(
            "  [{}] {name} ({secs:.2} s)",
            if pass { "PASS" } else { "FAIL" }
        );
        self.0.push(CheckResult {
            name: name.to_string(),
            pass,
            detail,
            secs,
        });
    }
}
