//! Paths of the repository's committed inputs, and paths as `&str` arguments.

use std::path::{Path, PathBuf};

/// `rel` under the repository root (`tests/fixtures/...`, `conformance/...`).
pub fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// A path as a command-line argument (test paths are UTF-8).
pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `name` in the committed CPU-engine capture, `tests/fixtures/cpu-engine-capture/`.
pub fn cpu_capture(name: &str) -> PathBuf {
    fixture("tests/fixtures/cpu-engine-capture").join(name)
}

/// `name` in the conformance corpus of vLLM 0.32, `conformance/0.32/`, as an argument.
pub fn corpus(name: &str) -> String {
    fixture("conformance/0.32").join(name).display().to_string()
}
