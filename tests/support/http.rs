//! HTTP to the servers a test starts (frontends, `pd-proxy`), with the xtask's client
//! (`vcr_host::http`): no test writes a request by hand unless the bytes are the point
//! (a hostile or malformed client, a server's exact header lines).

use std::time::Duration;

use serde_json::Value;
pub use vcr_host::http::{Client, Response, metric_sum, parse_metrics};

/// A client of `127.0.0.1:port` whose connects, reads and writes give up after `timeout`.
pub fn http_client(port: u16, timeout: Duration) -> Client {
    Client::new(port, timeout)
}

/// `method path` with an optional JSON body, within 60 s: the status and the body as text
/// (de-chunked), or `(0, "")` when nothing answers (a server still starting).
pub fn http_request(port: u16, method: &str, path: &str, body: Option<&Value>) -> (u16, String) {
    match http_client(port, Duration::from_secs(60)).request(method, path, body) {
        Ok(r) => (r.status, r.text()),
        Err(_) => (0, String::new()),
    }
}

/// `POST path` of a JSON body: the status and the answer as JSON (`Value::Null` when it
/// is not JSON). Panics when nothing answers.
pub fn http_post_json(port: u16, path: &str, body: &Value) -> (u16, Value) {
    let r = http_client(port, Duration::from_secs(60))
        .post(path, body)
        .unwrap_or_else(|e| panic!("POST {path} on port {port}: {e:#}"));
    (r.status, r.json().unwrap_or(Value::Null))
}

/// `GET path`, within 60 s; panics when nothing answers.
pub fn http_get(port: u16, path: &str) -> Response {
    http_client(port, Duration::from_secs(60))
        .get(path)
        .unwrap_or_else(|e| panic!("GET {path} on port {port}: {e:#}"))
}

/// Whether `GET path` on `127.0.0.1:port` answers 200 within 2 s (false while nothing
/// listens).
pub fn http_get_ok(port: u16, path: &str) -> bool {
    http_client(port, Duration::from_secs(2))
        .get(path)
        .is_ok_and(|r| r.status == 200)
}
