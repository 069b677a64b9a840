//! The HTTP/1.1 plumbing of the proxies in front of frontends (`pd-proxy`, and the router
//! `serve --route` puts in front of a data-parallel frontend): a client's request read
//! under limits, sent on with `Connection: close`, the answer relayed byte for byte (SSE
//! streams as they come) or read whole.
//!
//! A client cannot make a proxy hold what it sends without end: a body declared larger
//! than the limit is refused with 413 before any of it is read, and a request whose headers
//! (or body) stop arriving for the header timeout is dropped with 408.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Accept connections on `listener` until `shutdown` changes, each handled by `handle` on
/// a task of its own; a connection that fails is logged under the proxy's name `who`.
pub(crate) async fn serve_connections<F, Fut>(
    who: &'static str,
    listener: TcpListener,
    mut shutdown: watch::Receiver<bool>,
    handle: F,
) -> Result<()>
where
    F: Fn(TcpStream, SocketAddr) -> Fut,
    Fut: std::future::Future<Output = Result<()>> + Send + 'static,
{
    loop {
        tokio::select! {
            _ = shutdown.changed() => return Ok(()),
            accepted = listener.accept() => {
                let (conn, peer) = accepted.with_context(|| format!("{who}: accept"))?;
                let work = handle(conn, peer);
                tokio::spawn(async move {
                    if let Err(e) = work.await {
                        tracing::warn!(%peer, "{who}: {e:#}");
                    }
                });
            }
        }
    }
}

/// The limits a client's request is read under.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// The proxy's name in its messages.
    pub who: &'static str,
    pub max_body: usize,
    pub header_timeout: Duration,
}

/// One HTTP request: method, path, headers (lower-case names) and body.
pub(crate) struct Request {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// Why a client's request was not read whole: answered with this status, then dropped.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// 408: the headers (or the body) stopped arriving.
    Slow(String),
    /// 413: the declared body is over the cap.
    TooLarge(String),
    /// 431: the headers alone are over 1 MiB.
    HeadersTooLarge,
    /// 400: the headers make no sense (a Content-Length that is not a number).
    Bad(String),
}

/// Read one request under `limits`: `Ok(Err(refusal))` when the client is to be refused.
pub(crate) async fn read_request(
    conn: &mut TcpStream,
    limits: Limits,
) -> Result<std::result::Result<Request, Refusal>> {
    let mut buf = Vec::new();
    let deadline = tokio::time::Instant::now() + limits.header_timeout;
    let head_end = loop {
        let mut chunk = [0u8; 8192];
        let n = match tokio::time::timeout_at(deadline, conn.read(&mut chunk)).await {
            Ok(r) => r?,
            Err(_) => {
                return Ok(Err(Refusal::Slow(format!(
                    "{}: the request headers did not arrive within {:?} (--header-timeout)",
                    limits.who, limits.header_timeout
                ))));
            }
        };
        if n == 0 {
            bail!("the client closed the connection before a whole request");
        }
        let from = buf.len().saturating_sub(3);
        buf.extend_from_slice(&chunk[..n]);
        // the end may straddle two reads: look from a little before the new bytes (not
        // from the start each time: 1 MiB of headers in small reads would be quadratic)
        if let Some(i) = find(&buf[from..], b"\r\n\r\n") {
            break from + i;
        }
        if buf.len() > 1 << 20 {
            return Ok(Err(Refusal::HeadersTooLarge));
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let first = lines.next().unwrap_or_default();
    let mut parts = first.split_whitespace();
    let method = parts.next().unwrap_or_default().to_string();
    let path = parts.next().unwrap_or("/").to_string();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let declared = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .map(|(_, v)| v.as_str());
    let len: usize = match declared {
        None => 0,
        Some(v) => match v.parse::<u64>() {
            Ok(n) if n <= limits.max_body as u64 => n as usize,
            Ok(n) => {
                return Ok(Err(Refusal::TooLarge(format!(
                    "{}: the request body ({n} bytes) is over the {} MiB limit (--max-body-mib)",
                    limits.who,
                    limits.max_body >> 20
                ))));
            }
            Err(_) => {
                return Ok(Err(Refusal::Bad(format!(
                    "{}: Content-Length {v:?} is not a number",
                    limits.who
                ))));
            }
        },
    };
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < len {
        let mut chunk = vec![0u8; (len - body.len()).min(1 << 20)];
        let n = match tokio::time::timeout(limits.header_timeout, conn.read(&mut chunk)).await {
            Ok(r) => r?,
            Err(_) => {
                return Ok(Err(Refusal::Slow(format!(
                    "{}: the request body stopped arriving for {:?} (--header-timeout)",
                    limits.who, limits.header_timeout
                ))));
            }
        };
        if n == 0 {
            bail!("the client closed the connection mid-body");
        }
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(len);
    Ok(Ok(Request {
        method,
        path,
        headers,
        body,
    }))
}

pub(crate) fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The request line, the client's headers that matter downstream, and `body`.
pub(crate) fn encode_request(req: &Request, host: &str, body: &[u8]) -> Vec<u8> {
    let mut out = format!("{} {} HTTP/1.1\r\nHost: {host}\r\n", req.method, req.path);
    for (k, v) in &req.headers {
        if matches!(
            k.as_str(),
            "host" | "content-length" | "connection" | "transfer-encoding" | "keep-alive"
        ) {
            continue;
        }
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str(&format!(
        "Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    ));
    let mut bytes = out.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

/// Send `request` to `host` and read the whole answer: status and (de-chunked) body.
pub(crate) async fn exchange(host: &str, request: &[u8]) -> Result<(u16, Vec<u8>)> {
    let mut up = TcpStream::connect(host)
        .await
        .with_context(|| format!("connecting to {host}"))?;
    up.write_all(request).await?;
    let mut raw = Vec::new();
    up.read_to_end(&mut raw).await?;
    let end = find(&raw, b"\r\n\r\n").ok_or_else(|| anyhow!("no HTTP answer"))?;
    let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("no HTTP status"))?;
    let mut body = raw[end + 4..].to_vec();
    if head.contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    Ok((status, body))
}

pub(crate) fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(i) = find(b, b"\r\n") {
        let size = std::str::from_utf8(&b[..i])
            .ok()
            .and_then(|s| usize::from_str_radix(s.split(';').next().unwrap_or("").trim(), 16).ok())
            .unwrap_or(0);
        if size == 0 || b.len() < i + 2 + size {
            break;
        }
        out.extend_from_slice(&b[i + 2..i + 2 + size]);
        b = &b[(i + 4 + size).min(b.len())..];
    }
    out
}

/// Send `request` to `host` and copy its answer to the client as it comes (SSE streams
/// included).
pub(crate) async fn relay(
    who: &str,
    conn: &mut TcpStream,
    host: &str,
    request: &[u8],
    timeout: Duration,
) -> Result<()> {
    let mut up = match TcpStream::connect(host).await {
        Ok(s) => s,
        Err(e) => {
            let msg = format!("{who}: cannot reach {host}: {e}");
            return respond(
                conn,
                502,
                &json!({"error": {"message": msg, "type": "BadGateway", "code": 502}}),
            )
            .await;
        }
    };
    up.write_all(request).await?;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match tokio::time::timeout(timeout, up.read(&mut buf)).await {
            Ok(r) => r?,
            Err(_) => bail!("{host} sent nothing for {timeout:?}"),
        };
        if n == 0 {
            return Ok(());
        }
        if conn.write_all(&buf[..n]).await.is_err() {
            // the client is gone: closing the upstream connection aborts the request
            return Ok(());
        }
    }
}

/// Answer a refused request and close: what the client still sends is read and dropped for
/// a moment first (closing with unread bytes resets the connection, and the client would
/// never see the answer), never kept.
pub(crate) async fn refuse(
    who: &str,
    mut conn: TcpStream,
    peer: SocketAddr,
    refusal: Refusal,
) -> Result<()> {
    let (status, kind, msg) = match refusal {
        Refusal::Slow(m) => (408, "RequestTimeout", m),
        Refusal::TooLarge(m) => (413, "PayloadTooLarge", m),
        Refusal::Bad(m) => (400, "BadRequestError", m),
        Refusal::HeadersTooLarge => (
            431,
            "RequestHeaderFieldsTooLarge",
            format!("{who}: the request headers are over 1 MiB"),
        ),
    };
    tracing::warn!(%peer, "{msg}");
    let body = json!({"error": {"message": msg, "type": kind, "code": status}});
    // a client that is not reading cannot hold the answer up either
    let sent =
        tokio::time::timeout(Duration::from_secs(5), respond(&mut conn, status, &body)).await;
    if !matches!(sent, Ok(Ok(()))) {
        return Ok(());
    }
    let _ = conn.shutdown().await;
    let drain = async {
        let mut sink = vec![0u8; 64 * 1024];
        while matches!(conn.read(&mut sink).await, Ok(n) if n > 0) {}
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), drain).await;
    Ok(())
}

pub(crate) async fn respond(conn: &mut TcpStream, status: u16, body: &Value) -> Result<()> {
    respond_raw(conn, status, &serde_json::to_vec(body)?).await
}

pub(crate) async fn respond_raw(conn: &mut TcpStream, status: u16, body: &[u8]) -> Result<()> {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        408 => "Request Timeout",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        502 => "Bad Gateway",
        504 => "Gateway Timeout",
        _ => "Error",
    };
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await?;
    conn.write_all(body).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_bodies_are_joined() {
        assert_eq!(
            dechunk(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"),
            b"hello world"
        );
    }
}
