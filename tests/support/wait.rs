//! Waiting on what a test started, and on what it needs from the cache.

use std::time::{Duration, Instant};

/// Poll `done` every 50 ms until it holds or `timeout` passes; whether it held (asked once
/// more at the deadline).
pub fn wait_until(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    done()
}

/// The Python of the cached vLLM 0.33.0 venv; fails the test, saying `why` it is needed,
/// when the venv is not there.
pub fn vllm_python(why: &str) -> std::path::PathBuf {
    let cache = vllm_vcr::frontends::cache_root().expect("cache root");
    let python = vllm_vcr::frontends::python_venv(&cache, "vllm", "0.33.0")
        .join("bin")
        .join("python");
    assert!(python.exists(), "{} is missing: {why}", python.display());
    python
}
