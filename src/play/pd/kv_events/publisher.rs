//! The publisher task: sequence numbers, the replay ring and the replay ROUTER.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Result, bail};
use bytes::Bytes;
use sim_protocol::VllmLine;
use sim_protocol::kv_events::{KvEvent, KvEventsConfig, encode_kv_event_batch};
use sim_protocol::listener::{ZmtpPub, ZmtpRouter};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use zeromq::{PubSocket, SocketSend, ZmqMessage};

use super::endpoint::{
    bind_pub, bind_router, check_transport, is_bind_endpoint, offset_endpoint_port, spawn_connect,
};

/// vLLM's `ZmqEventPublisher.END_SEQ`: the sequence number of the replay end marker.
pub const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// vLLM's `SHUTDOWN_TIMEOUT`: how long [`KvEventPublisher::shutdown`] waits for the queue
/// to drain.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(1);

struct Batch {
    ts: f64,
    events: Vec<KvEvent>,
}

struct Active {
    tx: mpsc::UnboundedSender<Batch>,
    queued: Arc<AtomicUsize>,
    max_queue_size: usize,
    dropped: AtomicU64,
    task: JoinHandle<()>,
}

/// Publishes KV-cache event batches the way vLLM's `ZmqEventPublisher` does. Inactive
/// (every call a no-op) when events are disabled or the publisher is `"null"`.
pub struct KvEventPublisher {
    active: Option<Active>,
}

/// Seconds since the Unix epoch, as Python's `time.time()`.
pub fn wall_clock_ts() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl KvEventPublisher {
    /// A publisher that publishes nothing.
    pub fn disabled() -> Self {
        Self { active: None }
    }

    /// Start publishing for engine `dp_rank` on `line`. Returns the publisher and the
    /// config to advertise in the ready response's `kv_events_config`: the resolved one
    /// (ports offset by the rank, `tcp://*:0` replaced by the bound node IP and port), or
    /// `None` when no publisher runs — vLLM's `NullEventPublisher` advertises nil too.
    pub async fn start(
        config: &KvEventsConfig,
        dp_rank: u16,
        line: VllmLine,
    ) -> Result<(KvEventPublisher, Option<KvEventsConfig>)> {
        if !config.is_active() {
            return Ok((Self::disabled(), None));
        }
        if config.publisher != "zmq" {
            bail!(
                "unknown KV event publisher `{}` (expected \"zmq\" or \"null\")",
                config.publisher
            );
        }
        let endpoint = offset_endpoint_port(&config.endpoint, dp_rank)?;
        let replay_endpoint = config
            .replay_endpoint
            .as_deref()
            .map(|e| offset_endpoint_port(e, dp_rank))
            .transpose()?;
        check_transport(&endpoint)?;

        let (pub_state, endpoint) = if is_bind_endpoint(&endpoint) {
            let (sock, resolved) = bind_pub(&endpoint, "KV-events PUB").await?;
            (PubState::Bound(sock), resolved)
        } else {
            (
                PubState::Connecting(spawn_connect(endpoint.clone())),
                endpoint,
            )
        };
        let (router, replay_endpoint) = match replay_endpoint.filter(|e| !e.is_empty()) {
            Some(e) => {
                let (sock, resolved) = bind_router(
                    &e,
                    "KV-events replay ROUTER",
                    // a whole replay is queued at once: every buffered batch and the end
                    usize::try_from(config.buffer_steps)
                        .unwrap_or(usize::MAX)
                        .saturating_add(1),
                )
                .await?;
                (Some(sock), Some(resolved))
            }
            None => (None, None),
        };
        if config.hwm != 100_000 {
            tracing::info!(
                hwm = config.hwm,
                "KV events: the zeromq crate has no HWM option; each subscriber queues up to 100000 messages"
            );
        }
        let advertised = KvEventsConfig {
            enable_kv_cache_events: true,
            publisher: "zmq".to_string(),
            endpoint,
            replay_endpoint,
            ..config.clone()
        };
        tracing::info!(
            endpoint = %advertised.endpoint,
            replay = ?advertised.replay_endpoint,
            topic = %advertised.topic,
            "publishing KV-cache events"
        );

        let (tx, rx) = mpsc::unbounded_channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn(
            PublisherTask {
                rx,
                queued: queued.clone(),
                pub_state,
                router,
                topic: Bytes::from(config.topic.clone().into_bytes()),
                line,
                dp_rank: i64::from(dp_rank),
                buffer: VecDeque::new(),
                buffer_steps: usize::try_from(config.buffer_steps).unwrap_or(usize::MAX),
                next_seq: 0,
            }
            .run(),
        );
        let active = Active {
            tx,
            queued,
            max_queue_size: usize::try_from(config.max_queue_size).unwrap_or(usize::MAX),
            dropped: AtomicU64::new(0),
            task,
        };
        Ok((
            Self {
                active: Some(active),
            },
            Some(advertised),
        ))
    }

    /// Whether batches go anywhere.
    pub fn is_enabled(&self) -> bool {
        self.active.is_some()
    }

    /// Publish one step's events, stamped with the wall clock now (vLLM stamps
    /// `time.time()` when the scheduler builds the batch). Never blocks; an empty list
    /// publishes nothing (vLLM only publishes non-empty batches).
    pub fn publish(&self, events: Vec<KvEvent>) {
        self.publish_at(wall_clock_ts(), events);
    }

    /// [`publish`](Self::publish) with a given timestamp (seconds since the epoch).
    pub fn publish_at(&self, ts: f64, events: Vec<KvEvent>) {
        let Some(a) = &self.active else { return };
        if events.is_empty() {
            return;
        }
        if a.queued.load(Ordering::Relaxed) >= a.max_queue_size {
            let n = a.dropped.fetch_add(1, Ordering::Relaxed);
            if n.is_power_of_two() || n == 0 {
                tracing::warn!(
                    dropped = n + 1,
                    max_queue_size = a.max_queue_size,
                    "KV-events queue is full; dropping a batch"
                );
            }
            return;
        }
        a.queued.fetch_add(1, Ordering::Relaxed);
        if a.tx.send(Batch { ts, events }).is_err() {
            a.queued.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Stop: publish what is queued (waiting up to 1 s, like vLLM), then close the sockets.
    pub async fn shutdown(self) {
        let Some(a) = self.active else { return };
        drop(a.tx);
        let mut task = a.task;
        if tokio::time::timeout(SHUTDOWN_TIMEOUT, &mut task)
            .await
            .is_err()
        {
            tracing::warn!(
                queued = a.queued.load(Ordering::Relaxed),
                "KV-events publisher did not drain within {SHUTDOWN_TIMEOUT:?}"
            );
            task.abort();
        }
    }
}

enum PubState {
    /// Listening (bounded per subscriber): `endpoint` was a bind address.
    Bound(ZmtpPub),
    /// Connected out to a subscriber that listens (an XSUB proxy, say).
    Ready(PubSocket),
    Connecting(oneshot::Receiver<PubSocket>),
    Gone,
}

struct PublisherTask {
    rx: mpsc::UnboundedReceiver<Batch>,
    queued: Arc<AtomicUsize>,
    pub_state: PubState,
    router: Option<ZmtpRouter>,
    topic: Bytes,
    line: VllmLine,
    dp_rank: i64,
    buffer: VecDeque<(u64, Bytes)>,
    buffer_steps: usize,
    next_seq: u64,
}

async fn recv_replay(router: &mut Option<ZmtpRouter>) -> Option<Vec<Bytes>> {
    match router {
        Some(r) => r.recv().await,
        None => std::future::pending().await,
    }
}

async fn connected(state: &mut PubState) -> Option<PubSocket> {
    match state {
        PubState::Connecting(rx) => rx.await.ok(),
        _ => std::future::pending().await,
    }
}

fn message(frames: Vec<Bytes>) -> ZmqMessage {
    // Never empty: every caller passes at least two frames.
    ZmqMessage::try_from(frames).unwrap_or_else(|_| ZmqMessage::from(Bytes::new()))
}

impl PublisherTask {
    async fn run(mut self) {
        let mut published = false;
        loop {
            tokio::select! {
                biased;
                batch = self.rx.recv() => match batch {
                    Some(batch) => {
                        self.queued.fetch_sub(1, Ordering::Relaxed);
                        self.publish(batch).await;
                        published = true;
                    }
                    None => break,
                },
                request = recv_replay(&mut self.router) => match request {
                    Some(request) => self.replay(request).await,
                    None => {
                        tracing::warn!("KV-events replay socket stopped; replay is off");
                        self.router = None;
                    }
                },
                sock = connected(&mut self.pub_state) => {
                    self.pub_state = match sock {
                        Some(sock) => PubState::Ready(sock),
                        None => PubState::Gone,
                    };
                }
            }
        }
        if published {
            // The crate has no linger: give its writer tasks a moment to flush.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn publish(&mut self, batch: Batch) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let payload = Bytes::from(encode_kv_event_batch(
            self.line,
            batch.ts,
            &batch.events,
            Some(self.dp_rank),
        ));
        let frames = || {
            vec![
                self.topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload.clone(),
            ]
        };
        match &mut self.pub_state {
            PubState::Bound(sock) => {
                sock.publish(&frames());
            }
            PubState::Ready(sock) => {
                if let Err(e) = sock.send(message(frames())).await {
                    tracing::warn!(seq, error = %e, "cannot publish a KV-events batch");
                }
            }
            PubState::Connecting(_) | PubState::Gone => {}
        }
        if self.buffer_steps > 0 {
            if self.buffer.len() >= self.buffer_steps {
                self.buffer.pop_front();
            }
            self.buffer.push_back((seq, payload));
        }
    }

    /// vLLM's `_service_replay`: `[client, b"", start_seq]` → every buffered batch with
    /// `seq ≥ start`, then the end marker. 0.25 has no topic frame in either.
    async fn replay(&mut self, frames: Vec<Bytes>) {
        let Some(router) = self.router.as_ref() else {
            return;
        };
        if frames.len() != 3 {
            tracing::warn!(
                frames = frames.len(),
                "invalid KV-events replay request (expected 3 frames)"
            );
            return;
        }
        let client = frames[0].clone();
        // `int.from_bytes(start_seq_bytes, "big")`, any length.
        let start = frames[2].iter().fold(0u128, |acc, &b| {
            acc.saturating_mul(256).saturating_add(u128::from(b))
        });
        let with_topic = self.line >= VllmLine::new(0, 26);
        let empty = Bytes::new();
        let mut replies = Vec::new();
        for (seq, payload) in &self.buffer {
            if u128::from(*seq) >= start {
                let mut f = vec![client.clone(), empty.clone()];
                if with_topic {
                    f.push(self.topic.clone());
                }
                f.push(Bytes::copy_from_slice(&seq.to_be_bytes()));
                f.push(payload.clone());
                replies.push(f);
            }
        }
        let end = if with_topic {
            vec![
                client,
                empty.clone(),
                empty.clone(),
                Bytes::from_static(&END_SEQ),
                empty,
            ]
        } else {
            vec![client, empty.clone(), Bytes::from_static(&END_SEQ), empty]
        };
        replies.push(end);
        // Each reply is queued towards the client (up to its queue's bound); a client that
        // is gone or does not read loses the rest of its replay, never the publisher.
        for f in replies {
            if !router.send(f) {
                tracing::warn!(
                    "KV-events replay client went away or stopped reading; replay abandoned"
                );
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn disabled_and_inproc() {
        let (p, adv) = KvEventPublisher::start(&KvEventsConfig::default(), 0, VllmLine::new(0, 33))
            .await
            .unwrap();
        assert!(!p.is_enabled() && adv.is_none());
        p.publish(vec![KvEvent::AllBlocksCleared]); // a no-op
        p.shutdown().await;
        let c = KvEventsConfig {
            enable_kv_cache_events: true,
            publisher: "zmq".into(),
            endpoint: "inproc://kv".into(),
            ..KvEventsConfig::default()
        };
        let err = KvEventPublisher::start(&c, 0, VllmLine::new(0, 33))
            .await
            .err()
            .unwrap();
        assert!(err.to_string().contains("inproc"), "{err}");
    }

    #[tokio::test]
    async fn rank_offsets_the_advertised_ports() {
        // rank 1 binds base + 1 and base + 3: a base whose two neighbours are free now
        let free = |p: u16| std::net::TcpListener::bind(("0.0.0.0", p)).is_ok();
        let port = (0..100)
            .map(|_| {
                let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                l.local_addr().unwrap().port()
            })
            .find(|&p| p < u16::MAX - 3 && free(p + 1) && free(p + 3))
            .expect("a port with free neighbours");
        let c = KvEventsConfig {
            enable_kv_cache_events: true,
            publisher: "zmq".into(),
            endpoint: format!("tcp://*:{port}"),
            replay_endpoint: Some(format!("tcp://*:{}", port + 2)),
            ..KvEventsConfig::default()
        };
        let (p, adv) = KvEventPublisher::start(&c, 1, VllmLine::new(0, 33))
            .await
            .unwrap();
        let adv = adv.unwrap();
        assert_eq!(adv.endpoint, format!("tcp://*:{}", port + 1));
        assert_eq!(adv.replay_endpoint, Some(format!("tcp://*:{}", port + 3)));
        assert!(p.is_enabled());
        p.shutdown().await;
    }
}
