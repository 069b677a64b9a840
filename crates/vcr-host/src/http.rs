//! A tiny blocking HTTP/1.1 client over `std::net::TcpStream`: enough for the OpenAI
//! routes, /health and /metrics, and Server-Sent Events that can be dropped mid-stream.
//! The xtask's checks and loads and the integration tests talk to servers with it, so
//! neither writes HTTP by hand. std, anyhow and serde_json only.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// Response headers in arrival order.
pub type Headers = Vec<(String, String)>;

/// A complete response.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Result<Value> {
        serde_json::from_slice(&self.body).with_context(|| {
            format!(
                "response (HTTP {}) is not JSON: {}",
                self.status,
                snippet(&self.text())
            )
        })
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }
}

/// A header's value (case-insensitive name).
pub fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// At most 300 chars of `s`, for error messages.
pub fn snippet(s: &str) -> String {
    let s = s.trim();
    match s.char_indices().nth(300) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// Where a server listens, plus the timeout of every read and write.
#[derive(Debug, Clone)]
pub struct Client {
    pub addr: SocketAddr,
    pub timeout: Duration,
}

/// How the body of a response is framed.
enum Framing {
    Length(u64),
    Chunked { left_in_chunk: u64, done: bool },
    UntilClose,
}

/// The body of a response as a `Read`, de-chunked.
struct Body {
    inner: BufReader<TcpStream>,
    framing: Framing,
}

impl Read for Body {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match &mut self.framing {
            Framing::Length(left) => {
                if *left == 0 || buf.is_empty() {
                    return Ok(0);
                }
                let want = buf.len().min(*left as usize);
                let n = self.inner.read(&mut buf[..want])?;
                if n == 0 {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "connection closed before Content-Length bytes",
                    ));
                }
                *left -= n as u64;
                Ok(n)
            }
            Framing::UntilClose => self.inner.read(buf),
            Framing::Chunked {
                left_in_chunk,
                done,
            } => {
                if *done || buf.is_empty() {
                    return Ok(0);
                }
                if *left_in_chunk == 0 {
                    let mut line = String::new();
                    self.inner.read_line(&mut line)?;
                    let size_text = line
                        .trim()
                        .split(';')
                        .next()
                        .unwrap_or("")
                        .trim()
                        .to_string();
                    let size = u64::from_str_radix(&size_text, 16).map_err(|_| {
                        std::io::Error::new(
                            std::io::ErrorKind::InvalidData,
                            format!("bad chunk size line {line:?}"),
                        )
                    })?;
                    if size == 0 {
                        // trailers until the empty line
                        loop {
                            let mut t = String::new();
                            if self.inner.read_line(&mut t)? == 0 || t.trim().is_empty() {
                                break;
                            }
                        }
                        *done = true;
                        return Ok(0);
                    }
                    *left_in_chunk = size;
                }
                let want = buf.len().min(*left_in_chunk as usize);
                let n = self.inner.read(&mut buf[..want])?;
                if n == 0 {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "connection closed inside a chunk",
                    ));
                }
                *left_in_chunk -= n as u64;
                if *left_in_chunk == 0 {
                    let mut crlf = String::new();
                    self.inner.read_line(&mut crlf)?;
                }
                Ok(n)
            }
        }
    }
}

/// A streaming response being read as Server-Sent Events. Dropping it closes the socket.
pub struct SseStream {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    reader: BufReader<Body>,
}

impl SseStream {
    /// The next `data:` payload (joined if an event has several data lines), or `None` at the
    /// end of the stream.
    pub fn next_data(&mut self) -> Result<Option<String>> {
        let mut data: Option<String> = None;
        loop {
            let mut line = String::new();
            let n = self
                .reader
                .read_line(&mut line)
                .context("reading the event stream")?;
            if n == 0 {
                return Ok(data);
            }
            let line = line.trim_end_matches(['\r', '\n']);
            if line.is_empty() {
                if data.is_some() {
                    return Ok(data);
                }
                continue;
            }
            if let Some(rest) = line.strip_prefix("data:") {
                let rest = rest.strip_prefix(' ').unwrap_or(rest);
                match &mut data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(rest);
                    }
                    None => data = Some(rest.to_string()),
                }
            }
            // comments (":"), event:, id:, retry: are ignored
        }
    }

    /// Read the rest of the body (for error responses).
    pub fn rest(mut self) -> String {
        let mut s = String::new();
        let _ = self.reader.read_to_string(&mut s);
        s
    }
}

impl Client {
    pub fn new(port: u16, timeout: Duration) -> Client {
        Client {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            timeout,
        }
    }

    fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        accept: &str,
        extra_headers: &[(&str, &str)],
    ) -> Result<(u16, Headers, Body)> {
        let stream = TcpStream::connect_timeout(&self.addr, self.timeout)
            .with_context(|| format!("connecting to {}", self.addr))?;
        stream.set_read_timeout(Some(self.timeout))?;
        stream.set_write_timeout(Some(self.timeout))?;
        stream.set_nodelay(true)?;
        let payload = body.map(|b| b.to_string()).unwrap_or_default();
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nAccept: {accept}\r\nConnection: close\r\nUser-Agent: vllm-vcr-xtask\r\n",
            self.addr
        );
        for (k, v) in extra_headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        if body.is_some() {
            req.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                payload.len()
            ));
        }
        req.push_str("\r\n");
        req.push_str(&payload);
        (&stream)
            .write_all(req.as_bytes())
            .with_context(|| format!("sending {method} {path}"))?;
        let mut inner = BufReader::new(stream);
        let mut status_line = String::new();
        inner
            .read_line(&mut status_line)
            .with_context(|| format!("reading the status line of {method} {path}"))?;
        let status: u16 = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("bad status line {status_line:?} for {method} {path}"))?;
        let mut headers = Vec::new();
        loop {
            let mut line = String::new();
            if inner.read_line(&mut line)? == 0 {
                bail!("connection closed inside the headers of {method} {path}");
            }
            let line = line.trim_end_matches(['\r', '\n']);
            if line.is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':') {
                headers.push((k.trim().to_string(), v.trim().to_string()));
            }
        }
        let chunked = header(&headers, "transfer-encoding")
            .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
        let framing = if chunked {
            Framing::Chunked {
                left_in_chunk: 0,
                done: false,
            }
        } else if let Some(n) = header(&headers, "content-length").and_then(|v| v.parse().ok()) {
            Framing::Length(n)
        } else if method == "HEAD" || status == 204 || status == 304 {
            Framing::Length(0)
        } else {
            Framing::UntilClose
        };
        Ok((status, headers, Body { inner, framing }))
    }

    /// A request with an optional JSON body; the whole response.
    pub fn request(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Response> {
        self.request_with(method, path, body, &[])
    }

    /// [`Client::request`] with extra request headers (e.g. `X-Request-Id`).
    pub fn request_with(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        extra_headers: &[(&str, &str)],
    ) -> Result<Response> {
        let (status, headers, mut body_reader) =
            self.send(method, path, body, "*/*", extra_headers)?;
        let mut body = Vec::new();
        body_reader
            .read_to_end(&mut body)
            .with_context(|| format!("reading the body of {method} {path}"))?;
        Ok(Response {
            status,
            headers,
            body,
        })
    }

    pub fn get(&self, path: &str) -> Result<Response> {
        self.request("GET", path, None)
    }

    pub fn post(&self, path: &str, body: &Value) -> Result<Response> {
        self.request("POST", path, Some(body))
    }

    /// POST a JSON body and read the response as an event stream.
    pub fn post_sse(&self, path: &str, body: &Value) -> Result<SseStream> {
        self.post_sse_with(path, body, &[])
    }

    /// [`Client::post_sse`] with extra request headers (e.g. `X-Request-Id`).
    pub fn post_sse_with(
        &self,
        path: &str,
        body: &Value,
        extra_headers: &[(&str, &str)],
    ) -> Result<SseStream> {
        let (status, headers, body) =
            self.send("POST", path, Some(body), "text/event-stream", extra_headers)?;
        Ok(SseStream {
            status,
            headers,
            reader: BufReader::new(body),
        })
    }
}

/// One sample of a Prometheus text exposition.
#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

/// Parse Prometheus text format (the subset both frontends write).
pub fn parse_metrics(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, labels, rest) = match line.find('{') {
            Some(open) => {
                let Some(close) = line.rfind('}') else {
                    continue;
                };
                (
                    &line[..open],
                    parse_labels(&line[open + 1..close]),
                    &line[close + 1..],
                )
            }
            None => match line.split_once(char::is_whitespace) {
                Some((n, r)) => (n, Vec::new(), r),
                None => continue,
            },
        };
        let Some(value) = rest.split_whitespace().next() else {
            continue;
        };
        let value = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => match v.parse::<f64>() {
                Ok(v) => v,
                Err(_) => continue,
            },
        };
        out.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    out
}

fn parse_labels(s: &str) -> Vec<(String, String)> {
    let mut labels = Vec::new();
    let mut rest = s;
    while let Some(eq) = rest.find('=') {
        let key = rest[..eq].trim().trim_start_matches(',').trim().to_string();
        let after = &rest[eq + 1..];
        let Some(after) = after.strip_prefix('"') else {
            break;
        };
        let mut value = String::new();
        let mut end = after.len();
        let mut chars = after.char_indices();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, n)) = chars.next() {
                        value.push(if n == 'n' { '\n' } else { n });
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        labels.push((key, value));
        rest = &after[end..];
    }
    labels
}

/// Sum of the samples named `name` whose labels include every `(key, value)` of `filter`.
/// `None` when there is no such sample at all.
pub fn metric_sum(samples: &[Sample], name: &str, filter: &[(&str, &str)]) -> Option<f64> {
    let mut found = false;
    let mut sum = 0.0;
    for s in samples.iter().filter(|s| s.name == name) {
        if filter
            .iter()
            .all(|(k, v)| s.labels.iter().any(|(lk, lv)| lk == k && lv == v))
        {
            found = true;
            sum += s.value;
        }
    }
    found.then_some(sum)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn parses_prometheus_text() {
        let text = "# HELP x\n# TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{model_name=\"tiny\",engine=\"0\"} 2\n\
            vllm:request_success_total{engine=\"0\",finished_reason=\"stop\",model_name=\"tiny\"} 3.0\n\
            vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"tiny\"} 4\n\
            plain_metric 1.5e0\n\
            h_bucket{le=\"+Inf\",x=\"a\\\"b\"} 7\n";
        let s = parse_metrics(text);
        assert_eq!(metric_sum(&s, "vllm:num_requests_running", &[]), Some(2.0));
        assert_eq!(metric_sum(&s, "vllm:request_success_total", &[]), Some(7.0));
        assert_eq!(
            metric_sum(
                &s,
                "vllm:request_success_total",
                &[("finished_reason", "stop")]
            ),
            Some(3.0)
        );
        assert_eq!(metric_sum(&s, "plain_metric", &[]), Some(1.5));
        assert_eq!(metric_sum(&s, "h_bucket", &[("x", "a\"b")]), Some(7.0));
        assert_eq!(metric_sum(&s, "missing", &[]), None);
    }

    /// Serve one canned response on a local socket.
    fn serve_once(response: &'static [u8]) -> u16 {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let _ = s.write_all(response);
        });
        port
    }

    #[test]
    fn reads_chunked_and_sized_bodies() {
        let port = serve_once(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n");
        let r = Client::new(port, Duration::from_secs(5)).get("/").unwrap();
        assert_eq!((r.status, r.text().as_str()), (200, "hello world"));
        let port = serve_once(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 2\r\n\r\n{}");
        let r = Client::new(port, Duration::from_secs(5))
            .post("/", &serde_json::json!({}))
            .unwrap();
        assert_eq!((r.status, r.text().as_str()), (400, "{}"));
    }

    #[test]
    fn reads_events() {
        let port = serve_once(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n\
              e\r\ndata: {\"a\":1}\n\r\n3\r\n\n: \r\n1\r\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n",
        );
        let mut s = Client::new(port, Duration::from_secs(5))
            .post_sse("/", &serde_json::json!({}))
            .unwrap();
        assert_eq!(s.next_data().unwrap().as_deref(), Some("{\"a\":1}"));
        assert_eq!(s.next_data().unwrap().as_deref(), Some("[DONE]"));
        assert_eq!(s.next_data().unwrap(), None);
    }
}
