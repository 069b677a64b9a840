//! KV-events endpoints as vLLM treats them: DP-rank port offsets, bind or connect,
//! `tcp://*:0` bound to the node IP.

use std::net::{IpAddr, UdpSocket};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use sim_protocol::listener::{PeerLimits, ZmtpPub, ZmtpRouter};
use sim_protocol::transport::TransportError;
use tokio::sync::oneshot;
use zeromq::{PubSocket, Socket};

/// vLLM's `offset_endpoint_port`: for DP rank > 0, a tcp port is offset by the rank (port 0
/// is left for the OS), an `inproc://` name gets `_dp<rank>`; any other transport is an
/// error there (vLLM raises `Invalid endpoint: must contain 'inproc' or 'tcp'`).
pub fn offset_endpoint_port(endpoint: &str, dp_rank: u16) -> Result<String> {
    if endpoint.is_empty() || dp_rank == 0 {
        return Ok(endpoint.to_string());
    }
    if endpoint.contains("inproc") {
        return Ok(format!("{endpoint}_dp{dp_rank}"));
    }
    if endpoint.contains("tcp") {
        let Some(colon) = endpoint.rfind(':') else {
            return Ok(endpoint.to_string());
        };
        let port: u32 = endpoint[colon + 1..].parse().with_context(|| {
            format!("KV-events endpoint `{endpoint}` has no numeric port to offset by the DP rank")
        })?;
        if port == 0 {
            return Ok(endpoint.to_string());
        }
        let new_port = port + u32::from(dp_rank);
        if new_port > u32::from(u16::MAX) {
            bail!("KV-events endpoint `{endpoint}`: port {port} + DP rank {dp_rank} exceeds 65535");
        }
        return Ok(format!("{}:{new_port}", &endpoint[..colon]));
    }
    bail!(
        "KV-events endpoint `{endpoint}` cannot be offset for DP rank {dp_rank}: like vLLM, only tcp:// (port + rank) and inproc:// endpoints work with data parallelism"
    )
}

/// vLLM's `_is_bind_endpoint`: wildcard and ipc/inproc endpoints bind, the rest connect.
pub fn is_bind_endpoint(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

pub(super) fn check_transport(endpoint: &str) -> Result<()> {
    if endpoint.starts_with("inproc://") {
        bail!(
            "KV-events endpoint `{endpoint}`: inproc:// only works inside one process (vLLM's engine and its consumer); use tcp:// or ipc:// with vllm-vcr"
        );
    }
    if !(endpoint.starts_with("tcp://") || endpoint.starts_with("ipc://")) {
        bail!("KV-events endpoint `{endpoint}`: only tcp:// and ipc:// are supported");
    }
    Ok(())
}

/// vLLM's `get_ip`: `$VLLM_HOST_IP`, else the address of the interface that routes to the
/// internet (IPv4, then IPv6; no packet is sent).
fn node_ip() -> Result<IpAddr> {
    if let Some(ip) = std::env::var("VLLM_HOST_IP").ok().filter(|s| !s.is_empty()) {
        return ip
            .parse()
            .with_context(|| format!("VLLM_HOST_IP=`{ip}` is not an IP address"));
    }
    let probe = |bind: &str, target: &str| -> Option<IpAddr> {
        let s = UdpSocket::bind(bind).ok()?;
        s.connect(target).ok()?;
        Some(s.local_addr().ok()?.ip())
    };
    probe("0.0.0.0:0", "8.8.8.8:80")
        .or_else(|| probe("[::]:0", "[2001:4860:4860::8888]:80"))
        .filter(|ip| !ip.is_unspecified())
        .ok_or_else(|| anyhow!("tcp://*:0 needs a node IP; set VLLM_HOST_IP"))
}

fn tcp_uri(ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V6(v6) => format!("tcp://[{v6}]:{port}"),
        IpAddr::V4(v4) => format!("tcp://{v4}:{port}"),
    }
}

/// What a subscriber or a replay client may send the publisher's listening sockets: a
/// subscription is a topic, a replay request a sequence number; 64 KiB is far above both.
fn peer_limits() -> PeerLimits {
    PeerLimits::control(64 * 1024)
}

/// Bind a PUB like vLLM's `_bind`, each subscriber bounded (see [`bind_with`]).
pub(super) async fn bind_pub(endpoint: &str, what: &str) -> Result<(ZmtpPub, String)> {
    bind_with(endpoint, what, node_ip, |target| async move {
        let sock = ZmtpPub::bind(&target, what, peer_limits()).await?;
        let bound = sock.endpoint().to_string();
        Ok((sock, bound))
    })
    .await
}

/// Bind the replay ROUTER like vLLM's `_bind`, each client bounded; up to `replies`
/// messages (a whole replay) are queued towards one client.
pub(super) async fn bind_router(
    endpoint: &str,
    what: &str,
    replies: usize,
) -> Result<(ZmtpRouter, String)> {
    let limits = PeerLimits {
        send_queue: replies.max(1),
        ..peer_limits()
    };
    bind_with(endpoint, what, node_ip, |target| async move {
        let sock = ZmtpRouter::bind(&target, what, limits).await?;
        let bound = sock.endpoint().to_string();
        Ok((sock, bound))
    })
    .await
}

/// vLLM's `_bind`: `tcp://*:0` binds the node IP and returns the real endpoint; anything
/// else is bound as given (`*` meaning every interface) and returned unchanged. `bind`
/// listens at a concrete address and returns the socket and the endpoint it got.
async fn bind_with<S, F, Fut>(
    endpoint: &str,
    what: &str,
    node_ip: impl FnOnce() -> Result<IpAddr>,
    bind: F,
) -> Result<(S, String)>
where
    F: FnOnce(String) -> Fut,
    Fut: std::future::Future<Output = Result<(S, String), TransportError>>,
{
    check_transport(endpoint)?;
    if endpoint == "tcp://*:0" {
        let ip = node_ip()?;
        let target = tcp_uri(ip, 0);
        let (sock, bound) = bind(target.clone())
            .await
            .with_context(|| format!("cannot bind the {what} socket to {target}"))?;
        let port: u16 = bound
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .ok_or_else(|| anyhow!("the {what} socket bound to an unexpected endpoint {bound}"))?;
        return Ok((sock, tcp_uri(ip, port)));
    }
    let target = match endpoint.strip_prefix("tcp://*:") {
        Some(port) => format!("tcp://0.0.0.0:{port}"),
        None => endpoint.to_string(),
    };
    let (sock, _) = bind(target)
        .await
        .with_context(|| format!("cannot bind the {what} socket to {endpoint}"))?;
    Ok((sock, endpoint.to_string()))
}

/// Keep connecting (the crate's connect gives up after its timeout) until the publisher
/// goes away; a PUB with no peer drops what it is given, as libzmq's does.
pub(super) fn spawn_connect(endpoint: String) -> oneshot::Receiver<PubSocket> {
    let (tx, rx) = oneshot::channel();
    tokio::spawn(async move {
        loop {
            let mut sock = PubSocket::new();
            match sock.connect(&endpoint).await {
                Ok(()) => {
                    tracing::info!(%endpoint, "KV-events publisher connected");
                    let _ = tx.send(sock);
                    return;
                }
                Err(e) => {
                    tracing::warn!(%endpoint, error = %e, "KV-events publisher cannot connect; retrying")
                }
            }
            if tx.is_closed() {
                return;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_offset_like_vllm() {
        let o = |e: &str, r| offset_endpoint_port(e, r).unwrap();
        assert_eq!(o("tcp://*:5557", 0), "tcp://*:5557");
        assert_eq!(o("tcp://*:5557", 2), "tcp://*:5559");
        assert_eq!(o("tcp://*:0", 3), "tcp://*:0");
        assert_eq!(o("tcp://[::1]:7000", 1), "tcp://[::1]:7001");
        assert_eq!(o("inproc://cache", 1), "inproc://cache_dp1");
        assert_eq!(o("ipc:///tmp/kv", 0), "ipc:///tmp/kv");
        assert!(offset_endpoint_port("ipc:///tmp/kv", 1).is_err());
    }

    #[test]
    fn bind_or_connect_like_vllm() {
        assert!(is_bind_endpoint("tcp://*:5557"));
        assert!(is_bind_endpoint("tcp://[::]:5557"));
        assert!(is_bind_endpoint("ipc:///tmp/kv"));
        assert!(is_bind_endpoint("inproc://kv"));
        assert!(!is_bind_endpoint("tcp://10.0.0.1:5557"));
        assert!(!is_bind_endpoint("tcp://localhost:5557"));
    }

    #[tokio::test]
    async fn wildcard_port_zero_resolves_to_the_bound_port() {
        let (_sock, ep) = bind_with(
            "tcp://*:0",
            "test",
            || Ok("127.0.0.1".parse().unwrap()),
            |target| async move {
                let sock = ZmtpPub::bind(&target, "test", peer_limits()).await?;
                let bound = sock.endpoint().to_string();
                Ok((sock, bound))
            },
        )
        .await
        .unwrap();
        let port: u16 = ep
            .strip_prefix("tcp://127.0.0.1:")
            .unwrap()
            .parse()
            .unwrap();
        assert_ne!(port, 0);
    }
}
