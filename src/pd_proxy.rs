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
use tokio::net::{TcpListener, TcpStream};

use crate::http_proxy::{
    Limits, encode_request, exchange, read_request, refuse, relay, respond, respond_raw,
    serve_connections,
};
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

pub async fn run(args: PdProxyArgs, shutdown: watch::Receiver<bool>) -> Result<()> {
    let prefill = authority(&args.prefill, "--prefill")?;
    let decode = authority(&args.decode, "--decode")?;
    let listener = TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("pd-proxy: cannot listen on {}:{}", args.host, args.port))?;
    let timeout = Duration::from_secs_f64(args.timeout.max(0.001));
    let limits = Limits {
        who: "pd-proxy",
        max_body: args.max_body_mib as usize * (1 << 20),
        header_timeout: Duration::from_secs(args.header_timeout.into()),
    };
    crate::outln!(
        "pd-proxy on http://{}:{}: prefill {prefill}, decode {decode}",
        args.host,
        args.port
    );
    serve_connections("pd-proxy", listener, shutdown, |conn, peer| {
        let (p, d) = (prefill.clone(), decode.clone());
        async move { handle(conn, peer, &p, &d, timeout, limits).await }
    })
    .await
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
        Err(refusal) => return refuse("pd-proxy", conn, peer, refusal).await,
    };
    let generate = req.method == "POST"
        && matches!(
            req.path.as_str(),
            "/v1/completions" | "/v1/chat/completions"
        );
    if !generate {
        let up = encode_request(&req, decode, &req.body);
        return relay("pd-proxy", &mut conn, decode, &up, timeout).await;
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
    relay("pd-proxy", &mut conn, decode, &up, timeout).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bases_are_checked() {
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
