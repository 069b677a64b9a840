//! `inspect perfetto --open`: serve the written file on 127.0.0.1 to the hosted Perfetto UI
//! (CORS preflight, GET, HEAD) until the process is interrupted.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};

/// The only port the hosted UI (ui.perfetto.dev) may fetch from: its Content-Security-Policy
/// allows `http://127.0.0.1:9001` (trace_processor's port, which Perfetto's own
/// `open_trace_in_ui` script reuses for this reason).
pub const PERFETTO_UI_PORT: u16 = 9001;

/// The file's name as a URL path segment (characters outside `[A-Za-z0-9._-]` → `_`).
pub fn url_name(path: &Path) -> String {
    let name: String = path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if name.is_empty() {
        "trace.json".to_string()
    } else {
        name
    }
}

/// Serve `file` as `/name` to the hosted Perfetto UI until the process is interrupted.
pub fn serve(file: File, name: &str, port: u16, content_type: &'static str) -> Result<()> {
    use std::net::TcpListener;
    let listener = TcpListener::bind(("127.0.0.1", port)).with_context(|| {
        format!(
            "binding 127.0.0.1:{port}{}",
            if port == PERFETTO_UI_PORT {
                " (the port the hosted Perfetto UI may fetch from; is trace_processor \
                 --httpd running? Stop it, or write the file with -o and drag it into \
                 the UI)"
            } else {
                ""
            }
        )
    })?;
    let port = listener.local_addr()?.port();
    // A shell starts a background job (`… --open &`) with SIGINT ignored, and an ignored
    // signal stays ignored across exec: without this, `kill -INT` (or Ctrl-C after `fg`)
    // would not stop a server that only ever ends on a signal.
    // SAFETY: restoring the default disposition; no handler runs.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_DFL);
    }
    let url = format!("http://127.0.0.1:{port}/{name}");
    if port != PERFETTO_UI_PORT {
        crate::errln!(
            "perfetto: note: ui.perfetto.dev may only fetch from 127.0.0.1:{PERFETTO_UI_PORT} \
             (its Content-Security-Policy); from port {port} the link suits a self-hosted UI"
        );
    }
    // One write, and its failure ignored: whoever reads our stdout may stop after the URL
    // (`| head -2`, a test), and that must not stop the server.
    let _ = std::io::stdout().lock().write_all(
        format!("serving {url}\nopen https://ui.perfetto.dev/#!/?url={url}\n(Ctrl-C to stop)\n")
            .as_bytes(),
    );
    let file = Arc::new(file);
    let name: Arc<str> = Arc::from(name);
    let busy = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        // a thread per connection, up to a bound: the UI opens a few at a time
        if busy.load(std::sync::atomic::Ordering::Relaxed) >= MAX_CONNECTIONS {
            drop(stream);
            continue;
        }
        busy.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (file, name, busy) = (Arc::clone(&file), Arc::clone(&name), Arc::clone(&busy));
        std::thread::spawn(move || {
            if let Err(e) = answer(stream, &file, &name, content_type) {
                crate::errln!("perfetto: a request failed: {e}");
            }
            busy.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        });
    }
    Ok(())
}

/// Connections served at once; more are closed at once.
const MAX_CONNECTIONS: usize = 64;

/// The request line and headers together: a browser's are a few KiB.
const MAX_REQUEST_HEAD: u64 = 16 * 1024;

/// How long a client may take to send its request line and headers.
const REQUEST_HEAD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Read the request line and skip the headers, within [`MAX_REQUEST_HEAD`] bytes and
/// [`REQUEST_HEAD_TIMEOUT`]; `None` when the client sent more, too slowly, or nothing.
fn read_request_line(stream: &std::net::TcpStream) -> std::io::Result<Option<String>> {
    use std::io::{BufRead, BufReader, Read};
    let deadline = std::time::Instant::now() + REQUEST_HEAD_TIMEOUT;
    let mut reader = BufReader::new(stream.try_clone()?.take(MAX_REQUEST_HEAD));
    let mut line = |out: &mut String| -> std::io::Result<bool> {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        stream.set_read_timeout(Some(left))?;
        let mut raw = Vec::new();
        match reader.read_until(b'\n', &mut raw) {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Ok(false);
            }
            Err(e) => return Err(e),
        }
        // a line the cap cut (no newline) is not a request
        if !raw.ends_with(b"\n") {
            return Ok(false);
        }
        *out = String::from_utf8_lossy(&raw).into_owned();
        Ok(true)
    };
    let mut request = String::new();
    if !line(&mut request)? {
        return Ok(None);
    }
    loop {
        let mut h = String::new();
        if !line(&mut h)? {
            return Ok(None);
        }
        if h == "\r\n" || h == "\n" {
            return Ok(Some(request));
        }
    }
}

const CORS: &str = "Access-Control-Allow-Origin: https://ui.perfetto.dev\r\n\
Access-Control-Allow-Methods: GET, HEAD, OPTIONS\r\n\
Access-Control-Allow-Headers: *\r\n\
Access-Control-Allow-Private-Network: true\r\n\
Cache-Control: no-cache\r\n";

/// Answer one HTTP/1.x request: OPTIONS (CORS preflight), GET or HEAD of `/name`.
fn answer(
    mut stream: std::net::TcpStream,
    file: &File,
    name: &str,
    content_type: &str,
) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let Some(request) = read_request_line(&stream)? else {
        let bad = "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        return stream.write_all(bad.as_bytes());
    };
    let mut parts = request.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let simple = |status: &str| {
        format!("HTTP/1.1 {status}\r\n{CORS}Content-Length: 0\r\nConnection: close\r\n\r\n")
    };
    if method == "OPTIONS" {
        return stream.write_all(simple("204 No Content").as_bytes());
    }
    if method != "GET" && method != "HEAD" {
        return stream.write_all(simple("405 Method Not Allowed").as_bytes());
    }
    let wanted = target
        .split(['?', '#'])
        .next()
        .unwrap_or("")
        .trim_start_matches('/');
    if wanted != name && !wanted.is_empty() {
        return stream.write_all(simple("404 Not Found").as_bytes());
    }
    let len = file.metadata()?.len();
    let encoding = if name.ends_with(".gz") {
        "Content-Encoding: gzip\r\n"
    } else {
        ""
    };
    stream.write_all(
        format!(
            "HTTP/1.1 200 OK\r\n{CORS}Content-Type: {content_type}\r\n{encoding}\
             Content-Length: {len}\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )?;
    if method == "HEAD" {
        return Ok(());
    }
    // positioned reads: connections share the one handle
    let mut buf = vec![0u8; 1 << 16];
    let mut off = 0u64;
    while off < len {
        let n = file.read_at(&mut buf, off)?;
        if n == 0 {
            break;
        }
        stream.write_all(&buf[..n])?;
        off += n as u64;
    }
    stream.flush()
}
