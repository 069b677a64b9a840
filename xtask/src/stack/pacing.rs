//! How late a `play` engine paced its steps, read from its log: the disturbance a run
//! suffered from the machine, which timing checks add to their bounds.

use std::path::Path;

/// How late a `play` engine emitted its steps and scripted chunks against their deadlines,
/// ms, as it logged at exit (`pacing: step emission lateness …`): the disturbance the run
/// suffered from the machine.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Pacing {
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) max_ms: f64,
}

impl Pacing {
    /// The pacing line of `log` (the last one), or `None` when the engine logged none.
    pub(crate) fn from_log(log: &Path) -> Option<Pacing> {
        let text = std::fs::read_to_string(log).ok()?;
        let line = text
            .lines()
            .rev()
            .find(|l| l.contains("pacing: step emission lateness"))?;
        let field = |name: &str| -> Option<f64> {
            let at = line.find(&format!("{name}="))? + name.len() + 1;
            let v: String = line[at..]
                .trim_start_matches('"')
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.')
                .collect();
            v.parse::<f64>().ok().map(|us| us / 1e3)
        };
        Some(Pacing {
            p50_ms: field("lateness_p50_us")?,
            p99_ms: field("lateness_p99_us")?,
            max_ms: field("lateness_max_us")?,
        })
    }

    /// Two runs' disturbances together (a replay judged against a capture: both moved).
    pub(crate) fn plus(self, o: Pacing) -> Pacing {
        Pacing {
            p50_ms: self.p50_ms + o.p50_ms,
            p99_ms: self.p99_ms + o.p99_ms,
            max_ms: self.max_ms + o.max_ms,
        }
    }
}
