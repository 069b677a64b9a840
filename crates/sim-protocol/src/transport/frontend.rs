//! The frontend side of the startup handshake ([`FrontendListener`]): bind the handshake
//! ROUTER and the data sockets as a vLLM frontend does, accept engines' HELLO and READY,
//! answer with INIT, and exchange messages with the engines afterwards (what the benches
//! and tests use to play the frontend).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::{Instant, timeout_at};
use zeromq::{PullSocket, RouterSocket, Socket};

use super::{
    TransportError, bind_address, identity_rank, recv_frames, send_frames, socket_options, zmq_err,
};
use crate::ready::{HandshakeInit, ReadyResponse, StatusMessage};

/// One engine that completed the handshake with a [`FrontendListener`].
#[derive(Debug, Clone, PartialEq)]
pub struct AcceptedEngine {
    /// The engine's ZMQ identity (2-byte little-endian DP rank for vLLM engines).
    pub identity: Bytes,
    /// `identity` read as a DP rank, when it is 2 bytes.
    pub rank: Option<u16>,
    pub hello: StatusMessage,
    /// The ready response from the first input socket.
    pub ready: ReadyResponse,
    /// The raw ready response from every input socket (index = client), byte for byte.
    pub ready_payloads: Vec<Bytes>,
}

/// The frontend half of the sockets: a handshake ROUTER, and per client an input ROUTER
/// and an output PULL, bound on ephemeral TCP ports (as `vllm-rs` and the Python frontend
/// do in external-engine mode).
pub struct FrontendListener {
    handshake: Option<RouterSocket>,
    handshake_address: String,
    // the data sockets (rebound on ipc:// by the sibling `ipc` module)
    pub(super) inputs: Vec<RouterSocket>,
    pub(super) input_addresses: Vec<String>,
    pub(super) outputs: Vec<PullSocket>,
    pub(super) output_addresses: Vec<String>,
    /// Advertised in INIT as `frontend_stats_publish_address`.
    pub stats_publish_address: Option<String>,
}

/// The data sockets of a [`FrontendListener`] after the handshake, for concurrent use.
pub struct FrontendSockets {
    pub inputs: Vec<RouterSocket>,
    pub outputs: Vec<PullSocket>,
}

/// Bind a ROUTER at `address`; returns it and the resolved endpoint.
pub async fn bind_router(address: &str) -> Result<(RouterSocket, String), TransportError> {
    let mut s = RouterSocket::with_options(socket_options(None)?);
    let ep = s
        .bind(address)
        .await
        .map_err(zmq_err(format!("binding {address}")))?;
    Ok((s, ep.to_string()))
}

/// Bind a PULL at `address`; returns it and the resolved endpoint.
pub async fn bind_pull(address: &str) -> Result<(PullSocket, String), TransportError> {
    let mut s = PullSocket::with_options(socket_options(None)?);
    let ep = s
        .bind(address)
        .await
        .map_err(zmq_err(format!("binding {address}")))?;
    Ok((s, ep.to_string()))
}

/// The host part of a `tcp://host:port` address.
pub fn tcp_host(address: &str) -> Option<&str> {
    let rest = address.strip_prefix("tcp://")?;
    let (host, _port) = rest.rsplit_once(':')?;
    Some(host)
}

impl FrontendListener {
    /// Bind everything on `host` (e.g. `127.0.0.1`) with ephemeral ports, `clients`
    /// input/output pairs (the Python frontend's `--api-server-count`; `vllm-rs` uses 1).
    pub async fn bind(host: &str, clients: usize) -> Result<Self, TransportError> {
        let host = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]")
        } else {
            host.to_string()
        };
        Self::bind_at(&format!("tcp://{host}:0"), clients).await
    }

    /// Bind the handshake ROUTER at `handshake_address` (e.g. `tcp://127.0.0.1:29550`) and
    /// the data sockets on ephemeral ports of the same host.
    pub async fn bind_at(handshake_address: &str, clients: usize) -> Result<Self, TransportError> {
        let clients = clients.max(1);
        let address = bind_address(handshake_address)?;
        let (handshake, handshake_address) = bind_router(&address).await?;
        let data_base = match tcp_host(&address) {
            Some(host) => format!("tcp://{host}:0"),
            None => {
                return Err(TransportError::BadAddress {
                    address,
                    reason: "the frontend listener needs a tcp:// handshake address".into(),
                });
            }
        };
        let mut inputs = Vec::new();
        let mut input_addresses = Vec::new();
        let mut outputs = Vec::new();
        let mut output_addresses = Vec::new();
        for _ in 0..clients {
            let (r, a) = bind_router(&data_base).await?;
            inputs.push(r);
            input_addresses.push(a);
            let (p, a) = bind_pull(&data_base).await?;
            outputs.push(p);
            output_addresses.push(a);
        }
        Ok(Self {
            handshake: Some(handshake),
            handshake_address,
            inputs,
            input_addresses,
            outputs,
            output_addresses,
            stats_publish_address: None,
        })
    }

    /// The resolved handshake address engines should connect to.
    pub fn handshake_address(&self) -> &str {
        &self.handshake_address
    }

    pub fn input_addresses(&self) -> &[String] {
        &self.input_addresses
    }

    pub fn output_addresses(&self) -> &[String] {
        &self.output_addresses
    }

    pub fn clients(&self) -> usize {
        self.inputs.len()
    }

    /// The INIT this listener sends.
    pub fn init_message(&self) -> HandshakeInit {
        HandshakeInit {
            inputs: self.input_addresses.clone(),
            outputs: self.output_addresses.clone(),
            frontend_stats_publish_address: self.stats_publish_address.clone(),
            ..Default::default()
        }
    }

    /// The frontend half of the handshake for `n` engines: answer each HELLO with INIT,
    /// wait for each READY, then read one ready response per engine on every input socket.
    /// Closes the handshake socket afterwards (like both vLLM frontends).
    pub async fn accept_engines(
        &mut self,
        n: usize,
        wait: Duration,
    ) -> Result<Vec<AcceptedEngine>, TransportError> {
        let deadline = Instant::now() + wait;
        let timed_out = |what: &str| TransportError::Timeout {
            what: what.to_string(),
            after: wait,
        };
        let init = Bytes::from(self.init_message().encode());
        let handshake = self.handshake.as_mut().ok_or_else(|| {
            TransportError::Protocol("the handshake socket is already closed".into())
        })?;
        let mut hellos: Vec<(Bytes, StatusMessage)> = Vec::new();
        let mut ready: HashSet<Bytes> = HashSet::new();
        while ready.len() < n {
            let frames = timeout_at(deadline, recv_frames(handshake))
                .await
                .map_err(|_| timed_out("HELLO/READY from the engines"))??;
            let (Some(identity), Some(payload)) = (frames.first(), frames.last()) else {
                continue;
            };
            let status =
                StatusMessage::decode(payload).map_err(|source| TransportError::Decode {
                    what: "a handshake message from an engine".into(),
                    source,
                })?;
            match status.status.as_str() {
                "HELLO" => {
                    if hellos.iter().any(|(id, _)| id == identity) {
                        return Err(TransportError::Protocol(format!(
                            "a second HELLO from engine identity {identity:02x?}"
                        )));
                    }
                    hellos.push((identity.clone(), status));
                    send_frames(handshake, vec![identity.clone(), init.clone()]).await?;
                }
                "READY" => {
                    if !hellos.iter().any(|(id, _)| id == identity) {
                        return Err(TransportError::Protocol(format!(
                            "READY before HELLO from engine identity {identity:02x?}"
                        )));
                    }
                    ready.insert(identity.clone());
                }
                other => {
                    return Err(TransportError::Protocol(format!(
                        "unexpected {other} message from engine identity {identity:02x?}"
                    )));
                }
            }
        }
        self.handshake = None;

        let mut payloads: HashMap<Bytes, Vec<Bytes>> = HashMap::new();
        for (client, input) in self.inputs.iter_mut().enumerate() {
            let mut seen = HashSet::new();
            while seen.len() < n {
                let frames = timeout_at(deadline, recv_frames(input))
                    .await
                    .map_err(|_| timed_out("the engines' ready responses"))??;
                let Some(identity) = frames.first().cloned() else {
                    continue;
                };
                if !ready.contains(&identity) {
                    return Err(TransportError::Protocol(format!(
                        "a ready response on input socket {client} from unknown identity {identity:02x?}"
                    )));
                }
                if !seen.insert(identity.clone()) {
                    return Err(TransportError::Protocol(format!(
                        "a second ready response on input socket {client} from identity {identity:02x?}"
                    )));
                }
                let payload = frames.get(1).cloned().unwrap_or_default();
                payloads.entry(identity).or_default().push(payload);
            }
        }

        let mut engines = Vec::with_capacity(n);
        for (identity, hello) in hellos {
            let ready_payloads = payloads.remove(&identity).unwrap_or_default();
            let first = ready_payloads.first().cloned().unwrap_or_default();
            let ready = ReadyResponse::decode(&first).map_err(|source| TransportError::Decode {
                what: format!("the ready response of engine {identity:02x?}"),
                source,
            })?;
            engines.push(AcceptedEngine {
                rank: identity_rank(&identity),
                identity,
                hello,
                ready,
                ready_payloads,
            });
        }
        engines.sort_by_key(|e| (e.rank, e.identity.clone()));
        Ok(engines)
    }

    /// Send `frames` (e.g. from `encode_request`) to the engine `identity` on client
    /// `client`'s input socket.
    pub async fn send(
        &mut self,
        client: usize,
        identity: &[u8],
        frames: Vec<Bytes>,
    ) -> Result<(), TransportError> {
        let sock = self
            .inputs
            .get_mut(client)
            .ok_or_else(|| TransportError::Protocol(format!("no client {client}")))?;
        let mut all = Vec::with_capacity(frames.len() + 1);
        all.push(Bytes::copy_from_slice(identity));
        all.extend(frames);
        send_frames(sock, all).await
    }

    /// Receive the next message on client `client`'s output socket: `[payload, aux…]`.
    pub async fn recv_output(&mut self, client: usize) -> Result<Vec<Bytes>, TransportError> {
        let sock = self
            .outputs
            .get_mut(client)
            .ok_or_else(|| TransportError::Protocol(format!("no client {client}")))?;
        recv_frames(sock).await
    }

    /// The data sockets, for concurrent sending and receiving from separate tasks.
    pub fn into_sockets(self) -> FrontendSockets {
        FrontendSockets {
            inputs: self.inputs,
            outputs: self.outputs,
        }
    }
}
