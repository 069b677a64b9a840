//! `--open`: the file served to the hosted Perfetto UI (CORS, bounded requests, any bytes a
//! client sends, SIGINT when started in the background). Raw HTTP on purpose: the server's
//! exact status and header lines are what is checked.

use super::*;

/// Read the `serving URL` line; return (host:port, path).
fn served_url(child: &mut std::process::Child) -> (String, String) {
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let served = lines.next().unwrap().unwrap();
    let url = served.strip_prefix("serving ").expect(&served).to_string();
    let open = lines.next().unwrap().unwrap();
    assert_eq!(open, format!("open https://ui.perfetto.dev/#!/?url={url}"));
    let rest = url.strip_prefix("http://127.0.0.1:").unwrap();
    let (port, path) = rest.split_once('/').unwrap();
    (format!("127.0.0.1:{port}"), format!("/{path}"))
}

fn http_bytes(host: &str, request: &str) -> Vec<u8> {
    let mut s = std::net::TcpStream::connect(host).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut resp = Vec::new();
    if let Err(e) = s.read_to_end(&mut resp) {
        panic!("{e}: {request:?} got {resp:?}");
    }
    resp
}

fn http(host: &str, request: &str) -> String {
    String::from_utf8(http_bytes(host, request)).unwrap()
}

/// The served protobuf file: a GET returns the whole packet stream, as a binary type.
fn check_served_proto(host: &str, path: &str) {
    let resp = http_bytes(
        host,
        &format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nOrigin: https://ui.perfetto.dev\r\n\r\n"),
    );
    let split = resp.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&resp[..split]).to_string();
    let body = &resp[split + 4..];
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.contains("Access-Control-Allow-Origin: https://ui.perfetto.dev"),
        "{head}"
    );
    assert!(
        head.contains("Content-Type: application/octet-stream"),
        "{head}"
    );
    assert!(
        head.contains(&format!("Content-Length: {}", body.len())),
        "{head}"
    );
    assert!(packets(body) > 6);
}

fn check_served(host: &str, path: &str) {
    let resp = http(
        host,
        &format!(
            "OPTIONS {path} HTTP/1.1\r\nHost: {host}\r\nOrigin: https://ui.perfetto.dev\r\n\
             Access-Control-Request-Method: GET\r\n\r\n"
        ),
    );
    assert!(resp.starts_with("HTTP/1.1 204"), "{resp}");
    assert!(
        resp.contains("Access-Control-Allow-Origin: https://ui.perfetto.dev\r\n"),
        "{resp}"
    );
    assert!(resp.contains("Access-Control-Allow-Methods: GET"), "{resp}");

    let resp = http(
        host,
        &format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nOrigin: https://ui.perfetto.dev\r\n\r\n"),
    );
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(
        resp.contains("Access-Control-Allow-Origin: https://ui.perfetto.dev\r\n"),
        "{resp}"
    );
    let (head, body) = resp.split_once("\r\n\r\n").unwrap();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(len, body.len());
    let doc: Value = serde_json::from_str(body).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    assert!(events.len() >= 3);
    validate(events);

    let resp = http(
        host,
        &format!("GET /other.json HTTP/1.1\r\nHost: {host}\r\n\r\n"),
    );
    assert!(resp.starts_with("HTTP/1.1 404"), "{resp}");
}

/// `inspect perfetto --open -o OUT` of the small trace, written as `trace_name`: the
/// server process and the host and path it serves the file at.
fn open_small(tmp: &TestDir, trace_name: &str, out: &str) -> (std::process::Child, String, String) {
    let trace = tmp.path(trace_name);
    std::fs::write(&trace, SMALL).unwrap();
    let mut child = vcr_command()
        .args(["inspect", "perfetto", "--open", "--port", "0", "-o"])
        .arg(tmp.path(out))
        .arg(&trace)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (host, path) = served_url(&mut child);
    (child, host, path)
}

#[test]
fn open_serves_the_file_with_cors_for_the_hosted_ui() {
    let tmp = TestDir::new("open_serves_the_file_with_cors_for_the_hosted_ui");
    let (mut child, host, path) = open_small(&tmp, "open.jsonl", "open out.json");
    // a URL-safe name
    assert_eq!(path, "/open_out.json");
    check_served(&host, &path);
    let _ = child.kill();
    let _ = child.wait();
}

/// A client that sends an endless request line, or headers that never end, gets a 400
/// (or its connection closed) without the server holding what it sent; the file is still
/// served to the next client.
#[test]
fn open_bounds_what_a_client_can_send() {
    let tmp = TestDir::new("open_bounds_what_a_client_can_send");
    let (mut child, host, path) = open_small(&tmp, "open-hostile.jsonl", "open-hostile.json");
    for hostile in [
        format!("GET /{} HTTP/1.1", "a".repeat(1 << 20)),
        format!("GET {path} HTTP/1.1\r\n{}", "X-Pad: y\r\n".repeat(100_000)),
    ] {
        let mut s = std::net::TcpStream::connect(&host).unwrap();
        // the server stops reading at its cap: a write may fail once it has answered
        let _ = s.write_all(hostile.as_bytes());
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        assert!(
            answer.is_empty() || answer.starts_with("HTTP/1.1 400"),
            "{answer}"
        );
    }
    check_served(&host, &path);
    let _ = child.kill();
    let _ = child.wait();
}

/// Fuzz: whatever bytes clients send the viewer server (random bytes, request lines with
/// junk, cut-off headers), each gets an answer or a closed connection and the server
/// keeps serving the file. 128 cases, about a second.
#[test]
fn open_survives_any_bytes_a_client_sends() {
    let tmp = TestDir::new("open_survives_any_bytes_a_client_sends");
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};
    let (mut child, host, path) = open_small(&tmp, "open-fuzz.jsonl", "open-fuzz.json");
    let nasty = prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..4096),
        "[A-Z]{0,8} [ -~]{0,200}( HTTP/1\\.[01])?(\r\n[ -~]{0,60}){0,8}(\r\n\r\n)?"
            .prop_map(String::into_bytes),
    ];
    let mut runner = TestRunner::new(Config {
        cases: 128,
        ..Config::default()
    });
    runner
        .run(&nasty, |bytes| {
            let mut s = std::net::TcpStream::connect(&host).unwrap();
            s.set_read_timeout(Some(std::time::Duration::from_secs(15)))
                .unwrap();
            let _ = s.write_all(&bytes);
            let _ = s.shutdown(std::net::Shutdown::Write);
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink);
            Ok(())
        })
        .unwrap();
    assert!(child.try_wait().unwrap().is_none(), "the server died");
    check_served(&host, &path);
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn open_without_output_leaves_no_file_behind() {
    let tmp = TestDir::new("open_without_output_leaves_no_file_behind");
    let trace = tmp.path("open-temp.jsonl");
    std::fs::write(&trace, SMALL).unwrap();
    let mut child = vcr_command()
        .args(["inspect", "perfetto", "--open", "--port", "0"])
        .arg(&trace)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (host, path) = served_url(&mut child);
    // without -o, the default format: protobuf
    assert!(path.ends_with(".pftrace"), "{path}");
    check_served_proto(&host, &path);
    let file = std::env::temp_dir().join(path.trim_start_matches('/'));
    assert!(!file.exists(), "{} left behind", file.display());
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn open_started_in_the_background_stops_on_sigint() {
    let tmp = TestDir::new("open_started_in_the_background_stops_on_sigint");
    // what `vllm-vcr inspect perfetto t --open &` gets from a shell: SIGINT ignored
    use std::os::unix::process::CommandExt;
    let trace = tmp.path("open-bg.jsonl");
    std::fs::write(&trace, SMALL).unwrap();
    let mut cmd = vcr_command();
    cmd.args(["inspect", "perfetto", "--open", "--port", "0"])
        .arg(&trace)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    // SAFETY: only an async-signal-safe call between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_IGN);
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    let (host, path) = served_url(&mut child);
    check_served_proto(&host, &path);
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if std::time::Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let _ = child.kill();
    let _ = child.wait();
    let status = status.expect("the server ignored SIGINT");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGINT), "{status:?}");
}
