//! Lenient, msgspec-compatible decoding of what crosses the engine-core wire.
//!
//! - [`decode_input`]: frontend → engine frames as the engine's DEALER receives them;
//! - [`decode_outputs`] / [`decode_outputs_for`]: engine → frontend frames as the frontend's
//!   PULL receives them (the record tap and tests use these).
//!
//! Arrays are read positionally like msgspec reads `array_like` structs: a shorter array takes
//! defaults for the missing tail, a longer one's extra tail is ignored, a missing required
//! element is an error. Maps ignore unknown keys and default missing ones. Every decoder is
//! total: any byte sequence gives `Ok` or `Err`, never a panic, and hostile length headers
//! fail at the end of the frame instead of allocating what they claim.

mod input;
mod output;
mod structured;
pub(crate) mod value;

use std::fmt;

use crate::types::{CallId, RequestType};

pub use input::{DecodeLimits, decode_input, decode_input_with};
pub use output::{DecodedOutputs, decode_outputs, decode_outputs_for};

/// Nesting limit for msgpack values (vLLM payloads nest < 20 deep; the limit keeps hostile
/// input from recursing deeply).
pub(crate) const MAX_DEPTH: usize = 128;

/// What could be read of a message before (or despite) a decoding failure. The engine uses
/// it to answer the way vLLM would: an ERROR-finished output for a bad ADD whose request id
/// is readable, a failure reply for a utility call whose call id is readable.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ErrorContext {
    pub request_type: Option<RequestType>,
    pub request_id: Option<String>,
    pub client_index: Option<u32>,
    pub call_id: Option<CallId>,
    pub method: Option<String>,
}

/// Why a message could not be decoded.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DecodeErrorKind {
    #[error("empty multipart message")]
    EmptyMessage,
    #[error("the request-type frame has {0} bytes (expected exactly 1)")]
    BadTypeFrame(usize),
    #[error(
        "unknown request type byte 0x{0:02x} (expected 00 ADD, 01 ABORT, 02 START_DP_WAVE or 03 UTILITY)"
    )]
    UnknownRequestType(u8),
    #[error("the message has no payload frame after the request-type frame")]
    MissingPayload,
    #[error("the payload is not valid msgpack: {0}")]
    NotMsgpack(String),
    #[error("{0} unexpected bytes after the msgpack value")]
    TrailingBytes(usize),
    #[error("{what}: expected {expected}, found {found}")]
    Shape {
        what: String,
        expected: &'static str,
        found: String,
    },
    #[error("{what}: required element {index} ({field}) is missing (the array has {len} elements)")]
    MissingElement {
        what: &'static str,
        index: usize,
        field: &'static str,
        len: usize,
    },
    #[error("{field}: required key is missing")]
    MissingKey { field: String },
    #[error("{field}: expected {expected}, found {found}")]
    WrongType {
        field: String,
        expected: &'static str,
        found: &'static str,
    },
    #[error("{field}: {reason}")]
    InvalidValue { field: String, reason: String },
    #[error("{field}: tensor data refers to frame {index}, but the message has {aux} aux frame(s)")]
    BadFrameIndex {
        field: String,
        index: i64,
        aux: usize,
    },
    #[error(
        "{field}: tensor data is an out-of-band shared-memory handle, which only works for an engine on the frontend's host"
    )]
    OutOfBandTensor { field: String },
}

impl DecodeErrorKind {
    /// The same error for a value found under `path` (`outputs[3]`): its field becomes
    /// `outputs[3].field`, or `outputs[3]` for the value itself (an empty field).
    pub(crate) fn under(self, path: &str) -> Self {
        let join = |f: String| {
            if f.is_empty() {
                path.to_string()
            } else {
                format!("{path}.{f}")
            }
        };
        match self {
            Self::Shape {
                what,
                expected,
                found,
            } => Self::Shape {
                what: join(what),
                expected,
                found,
            },
            Self::MissingKey { field } => Self::MissingKey { field: join(field) },
            Self::WrongType {
                field,
                expected,
                found,
            } => Self::WrongType {
                field: join(field),
                expected,
                found,
            },
            Self::InvalidValue { field, reason } => Self::InvalidValue {
                field: join(field),
                reason,
            },
            Self::BadFrameIndex { field, index, aux } => Self::BadFrameIndex {
                field: join(field),
                index,
                aux,
            },
            Self::OutOfBandTensor { field } => Self::OutOfBandTensor { field: join(field) },
            other => other,
        }
    }
}

/// A message that could not be decoded, with what could be read of it. (The context is
/// boxed to keep `Result<_, DecodeError>` small; field access auto-derefs.)
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeError {
    pub kind: DecodeErrorKind,
    pub context: Box<ErrorContext>,
}

impl DecodeError {
    pub fn new(kind: DecodeErrorKind, context: ErrorContext) -> Self {
        Self {
            kind,
            context: Box::new(context),
        }
    }

    /// An error with no context.
    pub fn bare(kind: DecodeErrorKind) -> Self {
        Self::new(kind, ErrorContext::default())
    }
}

fn type_label(t: RequestType) -> &'static str {
    match t {
        RequestType::Add => "ADD",
        RequestType::Abort => "ABORT",
        RequestType::StartDpWave => "START_DP_WAVE",
        RequestType::Utility => "UTILITY",
    }
}

impl fmt::Display for CallId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CallId::Unsigned(v) => write!(f, "{v}"),
            CallId::Negative(v) => write!(f, "{v}"),
        }
    }
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.context;
        match c.request_type {
            Some(t) => write!(f, "cannot decode {} message", type_label(t))?,
            None => write!(f, "cannot decode message")?,
        }
        if let Some(id) = &c.request_id {
            write!(f, " for request `{id}`")?;
        }
        if let Some(m) = &c.method {
            write!(f, " (utility `{m}`")?;
            if let Some(id) = c.call_id {
                write!(f, ", call id {id}")?;
            }
            write!(f, ")")?;
        } else if let Some(id) = c.call_id {
            write!(f, " (call id {id})")?;
        }
        write!(f, ": {}", self.kind)
    }
}

impl std::error::Error for DecodeError {}
