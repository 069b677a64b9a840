//! vLLM release lines and the wire layout each one speaks.
//!
//! One binary speaks every line in the supported window: the line is picked at start-up and
//! every array that crosses the wire is laid out from the tables here. The tables follow the
//! declaration order of the msgspec structs in each release's `vllm/v1/engine/__init__.py`
//! (positions = msgpack array indices, because vLLM's structs are `array_like`).

use std::fmt;
use std::str::FromStr;

/// A vLLM release line such as `0.27` (patch releases of a line share the wire protocol).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VllmLine {
    pub major: u16,
    pub minor: u16,
}

/// The oldest line this build speaks.
pub const OLDEST: VllmLine = VllmLine::new(0, 25);
/// The newest line this build speaks.
pub const NEWEST: VllmLine = VllmLine::new(0, 33);

/// Every supported line, oldest first.
pub fn supported_lines() -> impl Iterator<Item = VllmLine> {
    (OLDEST.minor..=NEWEST.minor).map(|m| VllmLine::new(0, m))
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LineError {
    #[error("`{0}` is not a vLLM version (expected e.g. 0.27, v0.27.1 or 0.27.1)")]
    Malformed(String),
    #[error("vLLM {0} is outside the supported window {OLDEST} … {NEWEST}")]
    Unsupported(VllmLine),
}

impl VllmLine {
    pub const fn new(major: u16, minor: u16) -> Self {
        Self { major, minor }
    }

    /// Parse `0.27`, `v0.27`, `0.27.1`, `v0.27.1` (also `0.27.1rc1`/dev suffixes on the
    /// patch part, as `vllm_version` strings of dev builds carry them) and check that the
    /// line is in the supported window.
    pub fn parse(s: &str) -> Result<Self, LineError> {
        let line = Self::parse_any(s)?;
        if line < OLDEST || line > NEWEST {
            return Err(LineError::Unsupported(line));
        }
        Ok(line)
    }

    /// Parse without the window check.
    pub fn parse_any(s: &str) -> Result<Self, LineError> {
        let bad = || LineError::Malformed(s.to_string());
        let t = s.trim();
        let t = t.strip_prefix('v').unwrap_or(t);
        let mut parts = t.split('.');
        let major = parts
            .next()
            .ok_or_else(bad)?
            .parse::<u16>()
            .map_err(|_| bad())?;
        let minor_str = parts.next().ok_or_else(bad)?;
        let minor = minor_str.parse::<u16>().map_err(|_| bad())?;
        if let Some(patch) = parts.next() {
            let digits: String = patch.chars().take_while(|c| c.is_ascii_digit()).collect();
            if digits.is_empty() {
                return Err(bad());
            }
        }
        Ok(Self::new(major, minor))
    }

    const fn at_least(self, minor: u16) -> bool {
        self.major > 0 || self.minor >= minor
    }

    /// Length of the `EngineCoreRequest` array this line's frontends send.
    pub const fn request_len(self) -> usize {
        if self.at_least(31) {
            22
        } else if self.at_least(28) {
            21
        } else {
            20
        }
    }

    /// Field order of `EngineCoreOutput` on this line.
    pub fn output_layout(self) -> &'static [OutputField] {
        use OutputField::*;
        const L25: &[OutputField] = &[
            RequestId,
            NewTokenIds,
            NewLogprobs,
            NewPromptLogprobsTensors,
            PoolingOutput,
            FinishReason,
            StopReason,
            Events,
            KvTransferParams,
            TraceHeaders,
            PrefillStats,
            RoutedExperts,
            NumNansInLogits,
        ];
        const L26: &[OutputField] = &[
            RequestId,
            NewTokenIds,
            NewLogprobs,
            NewPromptLogprobsTensors,
            PoolingOutput,
            FinishReason,
            StopReason,
            Events,
            KvTransferParams,
            EcTransferParams,
            TraceHeaders,
            PrefillStats,
            RoutedExperts,
            NumNansInLogits,
            MmCacheMissHashes,
            NewSamplingMask,
            SpecDecodeMetrics,
            PromptTokenIdLogprobs,
            Error,
        ];
        if !self.at_least(26) {
            L25
        } else if !self.at_least(28) {
            &L26[..14]
        } else if !self.at_least(29) {
            &L26[..16]
        } else if !self.at_least(31) {
            &L26[..17]
        } else if !self.at_least(33) {
            &L26[..18]
        } else {
            L26
        }
    }

    /// Length of the `EngineCoreOutputs` envelope on this line (`weight_version` from 0.32).
    pub const fn outputs_len(self) -> usize {
        if self.at_least(32) { 9 } else { 8 }
    }

    /// Whether `wake_up` returns a bool (0.31+) or nil (up to 0.30).
    pub const fn wake_up_returns_bool(self) -> bool {
        self.at_least(31)
    }

    /// Whether `PrefillStats` has `num_cache_creation_tokens` (0.26+).
    pub const fn prefill_stats_has_cache_creation(self) -> bool {
        self.at_least(26)
    }

    /// Whether `EngineCoreOutput` carries the `error` field (0.33+).
    pub fn has_output_error(self) -> bool {
        self.output_layout().contains(&OutputField::Error)
    }

    /// Whether `PrefixCacheStats` has `hits_by_source` and `SchedulerStats` has
    /// `num_kv_fetch_reqs_by_stage` (0.32+). Extra keys are ignored by older decoders, so
    /// this only documents what the line itself would send.
    pub const fn stats_have_sources(self) -> bool {
        self.at_least(32)
    }

    /// Whether the `pause_generation` utility exists (0.33+).
    pub const fn has_pause_generation(self) -> bool {
        self.at_least(33)
    }

    /// Lines whose frontends send an `EngineCoreRequest` of the given length.
    pub fn lines_with_request_len(len: usize) -> Vec<VllmLine> {
        supported_lines()
            .filter(|l| l.request_len() == len)
            .collect()
    }
}

impl fmt::Display for VllmLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

impl FromStr for VllmLine {
    type Err = LineError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// Format a set of lines compactly, e.g. `0.25–0.27` or `0.25, 0.29`.
pub fn describe_lines(lines: &[VllmLine]) -> String {
    match lines {
        [] => "none of the supported lines".to_string(),
        [one] => one.to_string(),
        _ => {
            let contiguous = lines
                .windows(2)
                .all(|w| w[1].major == w[0].major && w[1].minor == w[0].minor + 1);
            if contiguous {
                format!("{}–{}", lines[0], lines[lines.len() - 1])
            } else {
                lines
                    .iter()
                    .map(|l| l.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        }
    }
}

/// Logical fields of `EngineCoreOutput`; a line's layout orders a subset of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputField {
    RequestId,
    NewTokenIds,
    NewLogprobs,
    NewPromptLogprobsTensors,
    PoolingOutput,
    FinishReason,
    StopReason,
    Events,
    KvTransferParams,
    EcTransferParams,
    TraceHeaders,
    PrefillStats,
    RoutedExperts,
    NumNansInLogits,
    MmCacheMissHashes,
    NewSamplingMask,
    SpecDecodeMetrics,
    PromptTokenIdLogprobs,
    Error,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_spellings_users_type() {
        for s in ["0.27", "v0.27", "0.27.1", "v0.27.1", " 0.27.0 "] {
            assert_eq!(VllmLine::parse(s).unwrap(), VllmLine::new(0, 27), "{s}");
        }
        assert_eq!(
            VllmLine::parse("0.24").unwrap_err(),
            LineError::Unsupported(VllmLine::new(0, 24))
        );
        assert!(matches!(
            VllmLine::parse("banana"),
            Err(LineError::Malformed(_))
        ));
        assert!(matches!(VllmLine::parse("0"), Err(LineError::Malformed(_))));
    }

    #[test]
    fn layouts_match_the_field_lists() {
        let len = |m| VllmLine::new(0, m).output_layout().len();
        assert_eq!(len(25), 13);
        assert_eq!(len(26), 14);
        assert_eq!(len(27), 14);
        assert_eq!(len(28), 16);
        assert_eq!(len(29), 17);
        assert_eq!(len(30), 17);
        assert_eq!(len(31), 18);
        assert_eq!(len(32), 18);
        assert_eq!(len(33), 19);
        // the 0.26 insertion moves prefill_stats from 10 to 11
        let pos = |m, f| {
            VllmLine::new(0, m)
                .output_layout()
                .iter()
                .position(|x| *x == f)
                .unwrap()
        };
        assert_eq!(pos(25, OutputField::PrefillStats), 10);
        assert_eq!(pos(26, OutputField::PrefillStats), 11);
        assert_eq!(pos(25, OutputField::NumNansInLogits), 12);
        assert_eq!(VllmLine::new(0, 31).outputs_len(), 8);
        assert_eq!(VllmLine::new(0, 32).outputs_len(), 9);
    }

    #[test]
    fn request_lengths_group_lines() {
        assert_eq!(
            describe_lines(&VllmLine::lines_with_request_len(21)),
            "0.28–0.30"
        );
        assert_eq!(
            describe_lines(&VllmLine::lines_with_request_len(20)),
            "0.25–0.27"
        );
        assert!(VllmLine::lines_with_request_len(19).is_empty());
    }
}
