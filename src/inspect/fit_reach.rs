//! Whether a trace asks a latency model about prompts longer than any its captures held.
//!
//! Past the longest captured prompt the law's prefill cost is an extrapolation: linear in
//! the prompt's tokens, plus the depth term (attention over the tokens below each one)
//! only when the captures varied prompt lengths enough to identify it. Nothing in a run
//! checks that extrapolation, and it can be far off: fitted on fixed 128-token prompts
//! (no depth term), a model puts 600–1,800-token prompts' TTFT about 25 % short. So
//! `simulate` and `calibrate` count the trace's prompts past the fit set's longest and
//! say so, rather than let an extrapolation read as a prediction the captures back.

use sim_trace::fit::FittedModel;

/// A prompt counts as past the captures when it is longer than this many times the
/// longest captured one (a few tokens more is no extrapolation worth a note).
const PAST: f64 = 1.25;

/// The trace's prompts against the longest prompt a model's captures held.
#[derive(Debug, Clone)]
pub struct PromptReach {
    /// The longest prompt among the fit set's records, tokens.
    longest: u32,
    /// Whether the law kept its depth term.
    depth_term: bool,
    /// Prompts seen, and those past the captures.
    total: u64,
    past: u64,
    /// The longest prompt seen.
    max: u32,
}

impl PromptReach {
    /// For `model`; `None` when its sources do not say how long their prompts were
    /// (a model file written before they kept it).
    pub fn of(model: &FittedModel) -> Option<Self> {
        let longest = model
            .meta
            .sources
            .iter()
            .filter_map(|s| s.prompt_tokens.map(|[_, hi]| hi))
            .max()?;
        Some(Self {
            longest,
            depth_term: model.law.per_prefill_depth_ms > 0.0,
            total: 0,
            past: 0,
            max: 0,
        })
    }

    /// Count one of the trace's prompts.
    pub fn add(&mut self, prompt_tokens: u32) {
        self.total += 1;
        self.max = self.max.max(prompt_tokens);
        if f64::from(prompt_tokens) > f64::from(self.longest) * PAST {
            self.past += 1;
        }
    }

    /// The note to print, when some prompts ran past the captures.
    pub fn note(&self) -> Option<String> {
        if self.past == 0 {
            return None;
        }
        let law = if self.depth_term {
            "extrapolated from the law (its depth term included)"
        } else {
            "extrapolated from the law, which has no depth term (the captures could not show how a prefill slows with the tokens below it), so likely too short"
        };
        Some(format!(
            "{} of the trace's {} prompts ({:.0} %) are longer than any the model's captures held (up to {} tokens here, {} there): their prefill is {law}; fit on captures whose prompts are as long (`inspect suite` runs prompts of 90–1,710 tokens)",
            self.past,
            self.total,
            100.0 * self.past as f64 / self.total as f64,
            self.max,
            self.longest,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reach(longest: u32, depth_term: bool) -> PromptReach {
        PromptReach {
            longest,
            depth_term,
            total: 0,
            past: 0,
            max: 0,
        }
    }

    #[test]
    fn prompts_within_a_quarter_past_the_longest_captured_need_no_note() {
        let mut r = reach(128, false);
        for p in [64, 128, 160] {
            r.add(p);
        }
        assert_eq!(r.note(), None);
    }

    #[test]
    fn prompts_past_the_captures_are_counted_and_the_missing_depth_term_named() {
        let mut r = reach(128, false);
        for p in [100, 600, 1800, 900] {
            r.add(p);
        }
        let note = r.note().expect("a note");
        assert!(
            note.starts_with("3 of the trace's 4 prompts (75 %)"),
            "{note}"
        );
        assert!(note.contains("up to 1800 tokens here, 128 there"), "{note}");
        assert!(note.contains("no depth term"), "{note}");
        let mut r = reach(128, true);
        r.add(600);
        assert!(
            r.note()
                .expect("a note")
                .contains("its depth term included")
        );
    }
}
