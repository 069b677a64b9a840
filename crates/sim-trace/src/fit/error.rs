//! Why a fit, or reading or writing a model file, fails.

use std::path::PathBuf;

use super::format::{FORMAT, VERSION};
use crate::trace::TraceError;

/// Why a fit, or reading or writing a model file, failed.
#[derive(Debug, thiserror::Error)]
pub enum FitError {
    /// A trace or sidecar could not be read.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// A model file could not be read or written.
    #[error("{}: {cause}", path.display())]
    Io {
        /// The model file.
        path: PathBuf,
        /// What the OS said.
        cause: std::io::Error,
    },
    /// The file is not JSON of a model's shape.
    #[error("{}: not a vllm-vcr latency model file: {cause}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// What serde said.
        cause: serde_json::Error,
    },
    /// The file is of another format or version.
    #[error(
        "{}: {found} is not a latency model this build reads (it reads format {FORMAT:?} version {VERSION}; refit with `vllm-vcr inspect fit TRACE --steps SIDECAR -o MODEL`)",
        path.display()
    )]
    Version {
        /// The file.
        path: PathBuf,
        /// What the file claims to be.
        found: String,
    },
    /// The file has the right format but impossible contents.
    #[error("{}: invalid latency model: {why}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// A sidecar that does not belong to its trace: their steps do not line up.
    #[error(
        "{}: only {matched} of the {total} token times of {} fall on one of its steps: it is not that trace's step-stats sidecar (--steps pairs with the traces in order)",
        steps.display(),
        trace.display()
    )]
    Mismatch {
        /// The trace.
        trace: PathBuf,
        /// The sidecar given with it.
        steps: PathBuf,
        /// Token times of the trace that fell on a sidecar step.
        matched: u64,
        /// Token times of the trace.
        total: u64,
    },
    /// The captures hold no step with a usable duration.
    #[error(
        "nothing to fit: the captures hold no engine step with a duration (a trace from `vllm-vcr record`, ideally with its --step-stats-out sidecar)"
    )]
    NoSteps,
    /// The model could not be encoded (never happens with finite numbers).
    #[error("encoding the model: {0}")]
    Encode(serde_json::Error),
}
