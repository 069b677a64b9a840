//! `vllm-vcr pd-proxy`: the two-phase request of prefill/decode disaggregation, in front of
//! a prefill frontend and a decode frontend (vLLM's disaggregated-serving flow, as its own
//! proxy examples and llm-d's routing sidecar run it).
//!
//! For each `POST /v1/completions` or `/v1/chat/completions`:
//! 1. the request goes to the prefill frontend with `max_tokens: 1` (and
//!    `max_completion_tokens: 1`), not streamed, and `kv_transfer_params:
//!    {"do_remote_decode": true, "do_remote_prefill": false, …}`;
//! 2. the `kv_transfer_params` of its answer (where the prefill engine's blocks are) go
//!    into the original request, which is sent to the decode frontend; its answer,
//!    streamed or not, is relayed to the client byte for byte.
//!
//! Other paths (`/v1/models`, `/health`, `/metrics`) go to the decode frontend. HTTP/1.1
//! with `Connection: close` on every hop: one request per connection, which is what load
//! generators and the OpenAI SDK handle.
//!
//! A client cannot make the proxy hold what it sends without end: a body declared larger
//! than `--max-body-mib` is refused with 413 before any of it is read, and a request whose
//! headers (or body) stop arriving for `--header-timeout` seconds is dropped with 408.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Debug, Clone, Args)]
pub struct PdProxyArgs {
    /// The prefill frontend's base address (`http://host:port`).
    #[arg(long)]
    pub prefill: String,

    /// The decode frontend's base address (`http://host:port`).
    #[arg(long)]
    pub decode: String,

    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,

    /// Port to listen on.
    #[arg(long, default_value_t = 8100)]
    pub port: u16,

    /// Seconds to wait for either frontend's answer (more than 0, at most a day).
    #[arg(long, default_value_t = 600.0, value_parser = crate::flag_ranges::seconds)]
    pub timeout: f64,

    /// The largest request body accepted, in MiB: a larger `Content-Length` is answered
    /// with 413 without reading the body (the proxy holds a body whole to rewrite it).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_body_mib: u32,

    /// Seconds a client may take to send its request headers, and at most between two
    /// reads of its body; a slower client is answered 408 and dropped (a connection that
    /// sends partial headers is not held open).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u32).range(1..=3600))]
    pub header_timeout: u32,
}

/// The limits a client's request is read under.
#[derive(Debug, Clone, Copy)]
struct Limits {
    max_body: usize,
    header_timeout: Duration,
}

/// `host:port` of an `http://host:port[/…]` base address.
fn authority(base: &str, flag: &str) -> Result<String> {
    let rest = base
        .strip_prefix("http://")
        .ok_or_else(|| anyhow!("{flag} {base}: expected http://host:port"))?;
    let auth = rest.split('/').next().unwrap_or_default();
    if !auth.contains(':') {
        bail!("{flag} {base}: expected http://host:port");
    }
    Ok(auth.to_string())
}

pub async fn run(args: PdProxyArgs, mut shutdown: watch::Receiver<bool>) -> Result<()> {
    let prefill = authority(&args.prefill, "--prefill")?;
    let decode = authority(&args.decode, "--decode")?;
    let listener = TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("pd-proxy: cannot listen on {}:{}", args.host, args.port))?;
    let timeout = Duration::from_secs_f64(args.timeout.max(0.001));
    let limits = Limits {
        max_body: args.max_body_mib as usize * (1 << 20),
        header_timeout: Duration::from_secs(args.header_timeout.into()),
    };
    crate::outln!(
        "pd-proxy on http://{}:{}: prefill {prefill}, decode {decode}",
        args.host,
        args.port
    );
    loop {
        tokio::select! {
            _ = shutdown.changed() => return Ok(()),
            accepted = listener.accept() => {
                let (conn, peer) = accepted.context("pd-proxy: accept")?;
                let (p, d) = (prefill.clone(), decode.clone());
                tokio::spawn(async move {
                    if let Err(e) = handle(conn, peer, &p, &d, timeout, limits).await {
                        tracing::warn!(%peer, "pd-proxy: {e:#}");
                    }
                });
            }
        }
    }
}

/// One HTTP request: method, path, headers (lower-case names) and body.
struct Request {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

/// Why a client's request was not read whole: answered with this status, then dropped.
#[derive(Debug)]
enum Refusal {
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
async fn read_request(
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
                    "pd-proxy: the request headers did not arrive within {:?} (--header-timeout)",
                    limits.header_timeout
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
                    "pd-proxy: the request body ({n} bytes) is over the {} MiB limit (--max-body-mib)",
                    limits.max_body >> 20
                ))));
            }
            Err(_) => {
                return Ok(Err(Refusal::Bad(format!(
                    "pd-proxy: Content-Length {v:?} is not a number"
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
                    "pd-proxy: the request body stopped arriving for {:?} (--header-timeout)",
                    limits.header_timeout
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

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The request line, the client's headers that matter downstream, and `body`.
fn encode_request(req: &Request, host: &str, body: &[u8]) -> Vec<u8> {
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

async fn handle(
    mut conn: TcpStream,
    peer: SocketAddr,
    prefill: &str,
    decode: &str,
    timeout: Duration,
    limits: Limits,
) -> Result<()> {
    let req = match read_request(&mut conn, limits).await? {
        Ok(req) => req,
        Err(refusal) => return refuse(conn, peer, refusal).await,
    };
    let generate = req.method == "POST"
        && matches!(
            req.path.as_str(),
            "/v1/completions" | "/v1/chat/completions"
        );
    if !generate {
        let up = encode_request(&req, decode, &req.body);
        return relay(&mut conn, decode, &up, timeout).await;
    }
    let mut body: Value = match serde_json::from_slice(&req.body) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            return respond(&mut conn, 400, &json!({"error": {"message": "pd-proxy: the request body is not a JSON object", "type": "BadRequestError", "code": 400}})).await;
        }
    };
    // phase 1: prefill only, its KV kept for the decode
    let mut first = body.clone();
    first["max_tokens"] = json!(1);
    if first.get("max_completion_tokens").is_some() {
        first["max_completion_tokens"] = json!(1);
    }
    first["stream"] = json!(false);
    if let Some(m) = first.as_object_mut() {
        m.remove("stream_options");
    }
    first["kv_transfer_params"] = json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "remote_engine_id": null,
        "remote_block_ids": null,
        "remote_host": null,
        "remote_port": null,
    });
    let up = encode_request(&req, prefill, &serde_json::to_vec(&first)?);
    let (status, answer) = match tokio::time::timeout(timeout, exchange(prefill, &up)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            let msg = format!("pd-proxy: the prefill frontend {prefill} failed: {e:#}");
            tracing::warn!(%peer, "{msg}");
            return respond(
                &mut conn,
                502,
                &json!({"error": {"message": msg, "type": "BadGateway", "code": 502}}),
            )
            .await;
        }
        Err(_) => {
            let msg = format!(
                "pd-proxy: the prefill frontend {prefill} did not answer within {timeout:?}"
            );
            return respond(
                &mut conn,
                504,
                &json!({"error": {"message": msg, "type": "GatewayTimeout", "code": 504}}),
            )
            .await;
        }
    };
    if status != 200 {
        // the prefill's own error (a prompt too long, a bad parameter) is the client's
        return respond_raw(&mut conn, status, &answer).await;
    }
    let params = serde_json::from_slice::<Value>(&answer)
        .ok()
        .and_then(|v| v.get("kv_transfer_params").cloned())
        .filter(|p| p.is_object());
    let Some(params) = params else {
        let msg = "pd-proxy: the prefill answer carries no kv_transfer_params: is its engine a prefill instance (play --pd-role prefill)?";
        return respond(
            &mut conn,
            502,
            &json!({"error": {"message": msg, "type": "BadGateway", "code": 502}}),
        )
        .await;
    };
    tracing::debug!(%peer, %params, "pd-proxy: prefill done");
    // phase 2: the whole request at the decode, with where the KV is
    body["kv_transfer_params"] = params;
    let up = encode_request(&req, decode, &serde_json::to_vec(&body)?);
    relay(&mut conn, decode, &up, timeout).await
}

/// Send `request` to `host` and read the whole answer: status and (de-chunked) body.
async fn exchange(host: &str, request: &[u8]) -> Result<(u16, Vec<u8>)> {
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

fn dechunk(mut b: &[u8]) -> Vec<u8> {
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
async fn relay(conn: &mut TcpStream, host: &str, request: &[u8], timeout: Duration) -> Result<()> {
    let mut up = match TcpStream::connect(host).await {
        Ok(s) => s,
        Err(e) => {
            let msg = format!("pd-proxy: cannot reach {host}: {e}");
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
async fn refuse(mut conn: TcpStream, peer: SocketAddr, refusal: Refusal) -> Result<()> {
    let (status, kind, msg) = match refusal {
        Refusal::Slow(m) => (408, "RequestTimeout", m),
        Refusal::TooLarge(m) => (413, "PayloadTooLarge", m),
        Refusal::Bad(m) => (400, "BadRequestError", m),
        Refusal::HeadersTooLarge => (
            431,
            "RequestHeaderFieldsTooLarge",
            "pd-proxy: the request headers are over 1 MiB".to_string(),
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

async fn respond(conn: &mut TcpStream, status: u16, body: &Value) -> Result<()> {
    respond_raw(conn, status, &serde_json::to_vec(body)?).await
}

async fn respond_raw(conn: &mut TcpStream, status: u16, body: &[u8]) -> Result<()> {
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
    fn chunked_bodies_are_joined_and_bases_are_checked() {
        assert_eq!(
            dechunk(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"),
            b"hello world"
        );
        assert_eq!(
            authority("http://127.0.0.1:8001", "--x").unwrap(),
            "127.0.0.1:8001"
        );
        assert_eq!(authority("http://h:1/v1", "--x").unwrap(), "h:1");
        assert!(
            authority("127.0.0.1:8001", "--prefill")
                .unwrap_err()
                .to_string()
                .contains("--prefill")
        );
    }
}
