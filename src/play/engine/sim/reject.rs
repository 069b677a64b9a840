//! Why the engine refuses a request, typed: the [`RejectCode`]s it sends in vLLM's
//! `RequestError` (with their wire strings) and the other ways a request can be turned away
//! ([`Refusal`]).

use std::fmt::Display;

use sim_protocol::{FinishReason, RequestError};

/// The `RequestError.code` values this engine sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectCode {
    /// The request has another vLLM line's layout than the one this engine speaks.
    VersionMismatch,
    /// Generation is paused (`pause_generation`): retryable.
    EnginePaused,
    /// The request cannot be served as asked. The one non-retryable code both frontends
    /// turn into an answer that carries the message (HTTP 400); any other code reaches a
    /// vllm-rs client as a bare "Internal server error".
    ValidationError,
    /// The request frame did not decode.
    InvalidRequest,
}

impl RejectCode {
    /// The code as it goes on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::VersionMismatch => "version_mismatch",
            Self::EnginePaused => "engine_paused",
            Self::ValidationError => "validation_error",
            Self::InvalidRequest => "invalid_request",
        }
    }
}

/// A refusal the frontend is told about: the request finishes `error` with this
/// `RequestError` (on lines whose outputs carry one).
#[derive(Debug, Clone, PartialEq)]
pub struct Reject {
    pub code: RejectCode,
    pub message: String,
    pub retryable: bool,
}

impl Reject {
    fn new(code: RejectCode, message: impl Into<String>, retryable: bool) -> Self {
        Self {
            code,
            message: message.into(),
            retryable,
        }
    }

    /// The frontend speaks another line (`message` says which it looks like).
    pub fn version_mismatch(message: impl Into<String>) -> Self {
        Self::new(RejectCode::VersionMismatch, message, false)
    }

    /// Generation is paused: the client may retry once it resumes.
    pub fn paused() -> Self {
        Self::new(
            RejectCode::EnginePaused,
            "Generation is paused. Please retry after it resumes.",
            true,
        )
    }

    /// The request cannot be served as asked; the client reads why.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(RejectCode::ValidationError, message, false)
    }

    /// Its structured outputs (or tool calls) cannot be generated.
    pub fn structured_output_unsupported(why: impl Display) -> Self {
        Self::invalid(format!("structured_output_unsupported: {why}"))
    }

    /// Replay has no record for it, and `--replay-miss` refuses such requests.
    pub fn replay_miss(why: impl Display) -> Self {
        Self::invalid(format!("replay_miss: {why}"))
    }

    /// Its frame did not decode.
    pub fn undecodable(message: impl Into<String>) -> Self {
        Self::new(RejectCode::InvalidRequest, message, false)
    }

    /// vLLM's `RequestError` for the request's output.
    pub fn request_error(self) -> RequestError {
        RequestError {
            code: self.code.as_str().into(),
            message: self.message,
            retryable: self.retryable,
        }
    }
}

/// What becomes of a request the engine does not take in.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    /// It finishes `error` with the reject's `RequestError`.
    Reject(Reject),
    /// It finishes with this reason and no error: `abort` while the engine shuts down,
    /// `error` where the frontend could not read an error (another line's layout).
    Finish(FinishReason),
    /// Its id is already in the engine: the second add is ignored, as vLLM does.
    Duplicate,
}

impl From<Reject> for Refusal {
    fn from(r: Reject) -> Self {
        Self::Reject(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_codes_go_on_the_wire_as_vllm_spells_them() {
        let e = Reject::paused().request_error();
        assert_eq!((e.code.as_str(), e.retryable), ("engine_paused", true));
        let e = Reject::version_mismatch("v0.25").request_error();
        assert_eq!(e.code, "version_mismatch");
        assert_eq!(
            Reject::undecodable("bad").request_error().code,
            "invalid_request"
        );
    }

    #[test]
    fn replay_misses_and_unsupported_grammars_are_validation_errors_that_say_so() {
        let e = Reject::replay_miss("no record").request_error();
        assert_eq!(e.code, "validation_error");
        assert_eq!(e.message, "replay_miss: no record");
        assert!(!e.retryable);
        let e = Reject::structured_output_unsupported("regex").request_error();
        assert_eq!(e.message, "structured_output_unsupported: regex");
    }
}
