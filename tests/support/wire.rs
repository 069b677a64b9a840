//! A Rust stand-in for a vLLM frontend, driving `play` over real ZMQ sockets.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use sim_protocol::decode::{DecodedOutputs, decode_outputs_for};
use sim_protocol::encode::encode_input;
use sim_protocol::transport::{AcceptedEngine, FrontendListener};
use sim_protocol::{
    CallId, EngineCoreOutputs, EngineCoreRequest, EventType, FinishReason, InputMessage,
    PrefillStats, SamplingParams, StopReason, UtilityCall, VllmLine,
};
use tokio::sync::watch;
use vllm_vcr::play::PlayArgs;

pub const TIMEOUT: Duration = Duration::from_secs(10);

pub struct Wire {
    pub fl: FrontendListener,
    pub engines: Vec<AcceptedEngine>,
    pub line: VllmLine,
    pub shutdown: watch::Sender<bool>,
    pub task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

/// Default play arguments for tests: instant latency, random tokens.
pub fn args() -> PlayArgs {
    PlayArgs::defaults()
}

impl Wire {
    pub async fn start(args: PlayArgs) -> Self {
        Self::start_with_clients(args, 1).await
    }

    pub async fn start_with_clients(mut args: PlayArgs, clients: usize) -> Self {
        let mut fl = FrontendListener::bind("127.0.0.1", clients).await.unwrap();
        args.handshake_address = fl.handshake_address().to_string();
        let line = args.vllm_version;
        let n = usize::from(args.engine_count);
        let (tx, rx) = watch::channel(false);
        let task = tokio::spawn(vllm_vcr::play::run(args, rx));
        let engines = fl.accept_engines(n, TIMEOUT).await.unwrap();
        Wire {
            fl,
            engines,
            line,
            shutdown: tx,
            task,
        }
    }

    pub async fn send_to(&mut self, client: usize, engine: usize, msg: &InputMessage) {
        let frames = encode_input(self.line, msg);
        let id = self.engines[engine].identity.clone();
        self.fl.send(client, &id, frames).await.unwrap();
    }

    pub async fn send(&mut self, msg: &InputMessage) {
        self.send_to(0, 0, msg).await
    }

    pub async fn send_raw(&mut self, frames: Vec<Bytes>) {
        let id = self.engines[0].identity.clone();
        self.fl.send(0, &id, frames).await.unwrap();
    }

    pub async fn recv_on(&mut self, client: usize) -> EngineCoreOutputs {
        let frames = tokio::time::timeout(TIMEOUT, self.fl.recv_output(client))
            .await
            .expect("no output from the engine in time")
            .unwrap();
        match decode_outputs_for(self.line, &frames).unwrap() {
            DecodedOutputs::Outputs(o) => o,
            DecodedOutputs::Dead => panic!("engine sent ENGINE_CORE_DEAD"),
        }
    }

    pub async fn recv(&mut self) -> EngineCoreOutputs {
        self.recv_on(0).await
    }

    /// Next message within `wait`, or `None`.
    pub async fn try_recv(&mut self, wait: Duration) -> Option<EngineCoreOutputs> {
        let frames = tokio::time::timeout(wait, self.fl.recv_output(0))
            .await
            .ok()?
            .ok()?;
        match decode_outputs_for(self.line, &frames).unwrap() {
            DecodedOutputs::Outputs(o) => Some(o),
            DecodedOutputs::Dead => panic!("engine sent ENGINE_CORE_DEAD"),
        }
    }

    /// Call a utility method on client 0 and return its outcome (skipping request outputs).
    pub async fn call(
        &mut self,
        call_id: u64,
        method: &str,
        args: Vec<rmpv::Value>,
    ) -> Result<rmpv::Value, String> {
        self.send(&InputMessage::Utility(UtilityCall {
            client_index: 0,
            call_id: CallId::Unsigned(call_id),
            method: method.into(),
            args,
        }))
        .await;
        loop {
            let env = self.recv().await;
            if let Some(u) = env.utility_output {
                assert!(env.outputs.is_empty(), "utility reply mixed with outputs");
                assert_eq!(u.call_id, CallId::Unsigned(call_id));
                return u.outcome;
            }
        }
    }

    /// `reset_prefix_cache(reset_running_requests, reset_connector)` as utility call
    /// `call_id`: whether the engine reset its prefix cache.
    pub async fn reset_prefix_cache(
        &mut self,
        call_id: u64,
        reset_running_requests: bool,
    ) -> Result<rmpv::Value, String> {
        self.call(
            call_id,
            "reset_prefix_cache",
            vec![
                rmpv::Value::Boolean(reset_running_requests),
                rmpv::Value::Boolean(false),
            ],
        )
        .await
    }

    /// Collect outputs on client 0 until every request in `ids` finished.
    pub async fn collect(&mut self, ids: &[&str]) -> Collected {
        self.collect_on(0, ids).await
    }

    pub async fn collect_on(&mut self, client: usize, ids: &[&str]) -> Collected {
        let mut c = Collected::default();
        let deadline = Instant::now() + TIMEOUT;
        while ids.iter().any(|id| !c.finished.contains_key(*id)) {
            assert!(
                Instant::now() < deadline,
                "requests did not finish: {:?}",
                c.finished
            );
            let env = self.recv_on(client).await;
            c.absorb(env);
        }
        c
    }

    pub async fn stop(self) -> anyhow::Result<()> {
        self.shutdown.send(true).unwrap();
        tokio::time::timeout(TIMEOUT, self.task)
            .await
            .expect("play did not stop")
            .unwrap()
    }
}

#[derive(Debug, Default)]
pub struct Collected {
    pub tokens: BTreeMap<String, Vec<u32>>,
    pub finished: BTreeMap<String, (FinishReason, Option<StopReason>)>,
    pub events: BTreeMap<String, Vec<EventType>>,
    pub prefill: BTreeMap<String, PrefillStats>,
    /// Outputs seen per request (messages carrying it).
    pub messages: BTreeMap<String, usize>,
    pub max_waiting: u64,
    pub max_running: u64,
    pub last_running: Option<u64>,
    pub envelopes: Vec<EngineCoreOutputs>,
}

impl Collected {
    pub fn absorb(&mut self, env: EngineCoreOutputs) {
        if let Some(s) = &env.scheduler_stats {
            self.max_waiting = self.max_waiting.max(s.num_waiting_reqs);
            self.max_running = self.max_running.max(s.num_running_reqs);
            self.last_running = Some(s.num_running_reqs);
        }
        for o in &env.outputs {
            self.tokens
                .entry(o.request_id.to_string())
                .or_default()
                .extend(&o.new_token_ids);
            *self.messages.entry(o.request_id.to_string()).or_default() += 1;
            self.events
                .entry(o.request_id.to_string())
                .or_default()
                .extend(o.events.iter().map(|e| e.kind));
            if let Some(p) = o.prefill_stats.as_deref().copied() {
                assert!(
                    self.prefill.insert(o.request_id.to_string(), p).is_none(),
                    "prefill stats twice for {}",
                    o.request_id
                );
            }
            if let Some(f) = o.finish_reason {
                self.finished
                    .insert(o.request_id.to_string(), (f, o.stop_reason.clone()));
            }
        }
        self.envelopes.push(env);
    }
}

/// An ADD as a frontend would send it.
pub fn add(id: &str, prompt: &[u32], max_tokens: u32) -> InputMessage {
    InputMessage::Add(Box::new(request(id, prompt, max_tokens)))
}

pub fn request(id: &str, prompt: &[u32], max_tokens: u32) -> EngineCoreRequest {
    EngineCoreRequest {
        request_id: id.into(),
        prompt_token_ids: Some(prompt.to_vec()),
        sampling_params: Some(SamplingParams {
            max_tokens: Some(max_tokens),
            eos_token_id: Some(2),
            stop_token_ids: vec![0],
            all_stop_token_ids: vec![0, 2],
            output_kind: 1,
            ..Default::default()
        }),
        arrival_time: 1.0,
        external_req_id: Some(id.into()),
        ..Default::default()
    }
}

pub fn with_client(msg: InputMessage, client: u32) -> InputMessage {
    match msg {
        InputMessage::Add(mut r) => {
            r.client_index = client;
            InputMessage::Add(r)
        }
        m => m,
    }
}

/// What a hostile stranger sends a socket that accepts connections: a ZMTP greeting, a
/// READY as `socket_type`, then a frame header declaring 2^62 bytes (a ZMQ library that
/// allocates what a header declares aborts on it). Keeps trying to connect for 10 s while
/// nothing listens yet. Returns whether the socket then closed the connection, i.e.
/// dropped that one peer.
pub async fn send_a_2_pow_62_frame_header(endpoint: &str, socket_type: &str) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = endpoint
        .trim_start_matches("tcp://")
        .replace('*', "127.0.0.1");
    let deadline = Instant::now() + TIMEOUT;
    let mut stream = loop {
        match tokio::net::TcpStream::connect(&addr).await {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => panic!("nothing listens at {addr}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let accept = ["ROUTER", "PUB", "PULL", "DEALER"];
    sim_protocol::zmtp::handshake(&mut stream, socket_type, None, &accept)
        .await
        .expect("the socket completes a ZMTP handshake");
    let mut header = vec![sim_protocol::zmtp::FLAG_LONG];
    header.extend_from_slice(&(1u64 << 62).to_be_bytes());
    header.extend_from_slice(&[0u8; 64]);
    let _ = stream.write_all(&header).await;
    let mut sink = [0u8; 256];
    tokio::time::timeout(TIMEOUT, async {
        loop {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => return true,
                Ok(_) => {}
            }
        }
    })
    .await
    .unwrap_or(false)
}
