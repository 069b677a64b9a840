//! Waiting on processes and servers a test started.

use std::io::{Read, Write};
use std::net::TcpStream;
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

/// Whether `GET path` on `127.0.0.1:port` answers 200 within 2 s (false while nothing
/// listens).
pub fn http_get_ok(port: u16, path: &str) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .is_err()
    {
        return false;
    }
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    buf.starts_with("HTTP/1.1 200") || buf.starts_with("HTTP/1.0 200")
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
