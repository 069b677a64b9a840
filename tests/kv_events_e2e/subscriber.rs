//! KV-cache events against a REAL consumer: `tests/kv_events_subscriber.py` subscribes with
//! pyzmq and decodes with vLLM 0.33's own `KVEventBatch` msgspec classes, then asks the
//! replay ROUTER for what it has buffered. Needs the Python frontend venv
//! (`cargo xtask fetch --python-only`); without it the test fails, it does not skip.
//!
//! The 0.25 replay frame layout and the replay ring are checked with a Rust DEALER.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::support::{fixture, vllm_python};
use bytes::Bytes;
use rmpv::Value as Msgpack;
use serde_json::{Value, json};
use sim_protocol::VllmLine;
use sim_protocol::kv_events::{KvEvent, KvEventsConfig, decode_kv_event_batch};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout};
use vllm_vcr::play::pd::kv_events::{END_SEQ, KvEventPublisher};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// Two free TCP ports (outside the kernel's ephemeral range; see `child::free_ports`).
fn free_ports() -> (u16, u16) {
    let p = vllm_vcr::child::free_ports(2).expect("two free ports");
    (p[0], p[1])
}

struct Subscriber {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
    stderr: tokio::task::JoinHandle<String>,
}

impl Subscriber {
    /// Next JSON line from the script, or `None` if none arrives within `wait`.
    async fn next(&mut self, wait: Duration) -> Option<Value> {
        match tokio::time::timeout(wait, self.lines.next_line()).await {
            Err(_) => None,
            Ok(Ok(Some(line))) => {
                let v: Value = serde_json::from_str(&line)
                    .unwrap_or_else(|e| panic!("subscriber printed non-JSON `{line}`: {e}"));
                if v["kind"] == "error" {
                    self.die(&format!("subscriber failed: {}", v["message"]))
                        .await;
                }
                Some(v)
            }
            Ok(Ok(None)) => self.die("subscriber exited early").await,
            Ok(Err(e)) => {
                self.die(&format!("cannot read the subscriber's stdout: {e}"))
                    .await
            }
        }
    }

    async fn expect(&mut self, wait: Duration, what: &str) -> Value {
        match self.next(wait).await {
            Some(v) => v,
            None => {
                self.die(&format!("no {what} from the subscriber within {wait:?}"))
                    .await
            }
        }
    }

    async fn send(&mut self, cmd: &str) {
        let stdin = self.child.stdin.as_mut().expect("stdin");
        stdin
            .write_all(format!("{cmd}\n").as_bytes())
            .await
            .unwrap();
        stdin.flush().await.unwrap();
    }

    async fn die(&mut self, why: &str) -> ! {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
        let stderr = (&mut self.stderr).await.unwrap_or_default();
        let tail: String = stderr
            .lines()
            .filter(|l| !l.starts_with('W'))
            .collect::<Vec<_>>()
            .join("\n");
        panic!("{why}\n--- subscriber stderr ---\n{tail}");
    }
}

fn spawn_subscriber(python: &Path, endpoint: &str, replay: &str, topic: &str) -> Subscriber {
    let script = fixture("tests/kv_events_subscriber.py");
    let mut child = tokio::process::Command::new(python)
        .arg(script)
        .args([endpoint, replay, topic])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    let stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let stderr = tokio::spawn(async move {
        let mut s = String::new();
        let _ = tokio::io::AsyncReadExt::read_to_string(&mut stderr, &mut s).await;
        s
    });
    Subscriber {
        child,
        lines: BufReader::new(stdout).lines(),
        stderr,
    }
}

fn known_batches() -> Vec<(f64, Vec<KvEvent>)> {
    let lora = KvEvent::BlockStored {
        block_hashes: vec![0x0f1a_5c4c_2074_1898, u64::MAX],
        parent_block_hash: Some(0x1234_5678_9abc_def0),
        token_ids: vec![1, 2, 3, 4, 151_643, 65_536, 0, 7],
        block_size: 4,
        lora_id: Some(7),
        lora_name: Some("sql-lora".into()),
        medium: Some("GPU".into()),
        extra_keys: Some(vec![
            Some(vec![Msgpack::from("sql-lora")]),
            Some(vec![Msgpack::from("sql-lora"), Msgpack::from("salt")]),
        ]),
        group_idx: Some(0),
        session_id: Some("session-9".into()),
    };
    vec![
        (1_700_000_000.25, vec![lora]),
        (
            1_700_000_001.5,
            vec![
                KvEvent::block_stored(vec![42], None, vec![9, 9, 9, 9], 4),
                KvEvent::block_removed(vec![42, u64::MAX]),
            ],
        ),
        (1_700_000_002.75, vec![KvEvent::AllBlocksCleared]),
    ]
}

/// A marker batch published until the subscriber is known to be connected (a PUB drops
/// what it sends before a subscription arrives: ZMQ's slow-joiner).
fn warmup() -> Vec<KvEvent> {
    vec![KvEvent::BlockRemoved {
        block_hashes: vec![0],
        medium: None,
        group_idx: None,
    }]
}

fn assert_known(batch: &Value, i: usize, seq: u64, topic: &str) {
    let ctx = format!("batch {i}: {batch}");
    assert_eq!(batch["seq"], json!(seq), "{ctx}");
    assert_eq!(batch["topic"], json!(topic), "{ctx}");
    assert_eq!(batch["dp_rank"], json!(1), "{ctx}");
    let ts = known_batches()[i].0;
    assert_eq!(batch["ts"].as_f64(), Some(ts), "{ctx}");
    let events = batch["events"].as_array().expect("events");
    match i {
        0 => {
            assert_eq!(
                events,
                &vec![json!({
                    "type": "BlockStored",
                    "block_hashes": [0x0f1a_5c4c_2074_1898u64, u64::MAX],
                    "parent_block_hash": 0x1234_5678_9abc_def0u64,
                    "token_ids": [1, 2, 3, 4, 151_643, 65_536, 0, 7],
                    "block_size": 4,
                    "lora_id": 7,
                    "medium": "GPU",
                    "lora_name": "sql-lora",
                    "extra_keys": [["sql-lora"], ["sql-lora", "salt"]],
                    "group_idx": 0,
                    "session_id": "session-9",
                })],
                "{ctx}"
            );
        }
        1 => {
            assert_eq!(events.len(), 2, "{ctx}");
            let stored = &events[0];
            assert_eq!(stored["type"], "BlockStored", "{ctx}");
            assert_eq!(stored["block_hashes"], json!([42]), "{ctx}");
            assert_eq!(stored["parent_block_hash"], Value::Null, "{ctx}");
            assert_eq!(stored["token_ids"], json!([9, 9, 9, 9]), "{ctx}");
            assert_eq!(stored["block_size"], json!(4), "{ctx}");
            assert_eq!(stored["lora_id"], Value::Null, "{ctx}");
            assert_eq!(stored["lora_name"], Value::Null, "{ctx}");
            assert_eq!(stored["medium"], "GPU", "{ctx}");
            assert_eq!(stored["extra_keys"], json!([null]), "{ctx}");
            assert_eq!(stored["group_idx"], json!(0), "{ctx}");
            // Default-valued optional fields are not on the wire (to_builtins omits them too).
            assert_eq!(stored.as_object().unwrap().len(), 10, "{ctx}");
            assert_eq!(
                events[1],
                json!({"type": "BlockRemoved", "block_hashes": [42, u64::MAX],
                       "medium": "GPU", "group_idx": 0}),
                "{ctx}"
            );
        }
        _ => assert_eq!(events, &vec![json!({"type": "AllBlocksCleared"})], "{ctx}"),
    }
}

/// Publish, subscribe with vLLM's own decoder, replay — against pyzmq + msgspec.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_subscriber_decodes_published_and_replayed_batches() {
    let python = vllm_python(
        "the KV-events subscriber test needs vLLM 0.33.0's venv to decode with \
         vLLM's own classes. Install it with `cargo xtask fetch --python-only` (or point \
         $VLLM_VCR_CACHE at a cache that has py/vllm-0.33.0).",
    );
    let started = Instant::now();
    let (pub_port, replay_port) = free_ports();
    // Rank 1 offsets both ports by +1, as vLLM does.
    let config = KvEventsConfig {
        enable_kv_cache_events: true,
        publisher: "zmq".into(),
        endpoint: format!("tcp://*:{}", pub_port - 1),
        replay_endpoint: Some(format!("tcp://*:{}", replay_port - 1)),
        topic: "kv".into(),
        ..KvEventsConfig::default()
    };
    let (publisher, advertised) = KvEventPublisher::start(&config, 1, VllmLine::new(0, 33))
        .await
        .expect("publisher starts");
    let advertised = advertised.expect("an active publisher advertises its config");
    assert_eq!(advertised.endpoint, format!("tcp://*:{pub_port}"));
    assert_eq!(
        advertised.replay_endpoint,
        Some(format!("tcp://*:{replay_port}"))
    );

    let mut sub = spawn_subscriber(
        &python,
        &format!("tcp://127.0.0.1:{pub_port}"),
        &format!("tcp://127.0.0.1:{replay_port}"),
        "kv",
    );
    // a hang guard: the subscriber imports vLLM first (~20 s quiet, ~47 s measured on a
    // loaded 2-core host)
    let ready = sub.expect(Duration::from_secs(180), "ready line").await;
    assert_eq!(ready["kind"], "ready");

    // Warm up until a batch gets through.
    let mut warmups = 0u64;
    let deadline = Instant::now() + Duration::from_secs(10);
    let first = loop {
        publisher.publish(warmup());
        warmups += 1;
        if let Some(v) = sub.next(Duration::from_millis(100)).await {
            break v;
        }
        if Instant::now() > deadline {
            sub.die("no warm-up batch reached the subscriber within 10 s")
                .await;
        }
    };
    assert_eq!(first["kind"], "batch", "{first}");
    assert_eq!(
        first["events"],
        json!([{"type": "BlockRemoved", "block_hashes": [0], "medium": null}])
    );

    for (ts, events) in known_batches() {
        publisher.publish_at(ts, events);
    }
    // Warm-ups still in flight come first; sequence numbers count every batch from 0.
    let mut known = Vec::new();
    let mut last_seq = first["seq"].as_u64().unwrap();
    while known.len() < 3 {
        let b = sub.expect(Duration::from_secs(10), "published batch").await;
        assert_eq!(b["kind"], "batch", "{b}");
        let seq = b["seq"].as_u64().unwrap();
        assert_eq!(seq, last_seq + 1, "sequence numbers go up by one: {b}");
        last_seq = seq;
        if seq >= warmups {
            known.push(b);
        }
    }
    for (i, b) in known.iter().enumerate() {
        assert_known(b, i, warmups + i as u64, "kv");
    }

    // Replay from the second known batch: the last two batches, then the end marker.
    sub.send(&format!("replay {}", warmups + 1)).await;
    let replay = sub.expect(Duration::from_secs(10), "replay result").await;
    assert_eq!(replay["kind"], "replay", "{replay}");
    assert_eq!(replay["end_marker_ok"], json!(true), "{replay}");
    let items = replay["items"].as_array().unwrap();
    assert_eq!(items.len(), 2, "{replay}");
    for (k, item) in items.iter().enumerate() {
        assert_eq!(item["matches_live"], json!(true), "{item}");
        assert_known(item, k + 1, warmups + 1 + k as u64, "kv");
    }

    sub.send("quit").await;
    let bye = sub.expect(Duration::from_secs(10), "bye").await;
    assert_eq!(bye["kind"], "bye");
    assert_eq!(
        bye["other_topic_messages"],
        json!(0),
        "a subscriber to another topic got messages"
    );
    let status = sub.child.wait().await.unwrap();
    assert!(status.success(), "subscriber exit status {status}");
    publisher.shutdown().await;
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
}

fn frames(m: ZmqMessage) -> Vec<Bytes> {
    m.into_vec()
}

/// 0.25: replay replies have no topic frame and the end marker is `[b"", END_SEQ, b""]`
/// after the delimiter; the replay ring keeps only the last `buffer_steps` batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_replay_frames_and_ring_on_0_25() {
    let (pub_port, replay_port) = free_ports();
    let config = KvEventsConfig {
        enable_kv_cache_events: true,
        publisher: "zmq".into(),
        endpoint: format!("tcp://*:{pub_port}"),
        replay_endpoint: Some(format!("tcp://*:{replay_port}")),
        buffer_steps: 2,
        ..KvEventsConfig::default()
    };
    let (publisher, _) = KvEventPublisher::start(&config, 0, VllmLine::new(0, 25))
        .await
        .unwrap();

    let mut sub = SubSocket::new();
    sub.subscribe("").await.unwrap();
    sub.connect(&format!("tcp://127.0.0.1:{pub_port}"))
        .await
        .unwrap();
    // Slow joiner: publish markers until one arrives.
    loop {
        publisher.publish(warmup());
        if let Ok(m) = tokio::time::timeout(Duration::from_millis(100), sub.recv()).await {
            let f = frames(m.unwrap());
            assert_eq!(
                f.len(),
                3,
                "topic, seq, payload (topic frame sent even when empty)"
            );
            assert!(f[0].is_empty());
            break;
        }
    }
    for (ts, events) in known_batches() {
        publisher.publish_at(ts, events);
    }
    // Read until the AllBlocksCleared batch (the last known one) is through.
    let mut live = Vec::new();
    let last_seq = loop {
        let f = frames(
            tokio::time::timeout(Duration::from_secs(10), sub.recv())
                .await
                .expect("published batch")
                .unwrap(),
        );
        let (_, events, rank) = decode_kv_event_batch(&f[2]).unwrap();
        assert_eq!(rank, Some(0));
        let seq = u64::from_be_bytes(f[1][..].try_into().unwrap());
        if events != warmup() {
            live.push(events.clone());
        }
        if events == vec![KvEvent::AllBlocksCleared] {
            break seq;
        }
    };
    // 0.25's BlockStored has no session_id field: it is left off the wire.
    let mut expected = known_batches()[0].1.clone();
    if let KvEvent::BlockStored { session_id, .. } = &mut expected[0] {
        *session_id = None;
    }
    assert_eq!(live[0], expected);
    let mut dealer = DealerSocket::new();
    dealer
        .connect(&format!("tcp://127.0.0.1:{replay_port}"))
        .await
        .unwrap();
    let req = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&0u64.to_be_bytes()),
    ])
    .unwrap();
    dealer.send(req).await.unwrap();
    let mut got = Vec::new();
    loop {
        let f = frames(
            tokio::time::timeout(Duration::from_secs(10), dealer.recv())
                .await
                .expect("replay reply")
                .unwrap(),
        );
        assert!(f[0].is_empty(), "empty delimiter first");
        if f[1][..] == END_SEQ {
            assert_eq!(
                f.len(),
                3,
                "0.25 end marker is [b\"\", END_SEQ, b\"\"]: {f:?}"
            );
            assert!(f[2].is_empty());
            break;
        }
        assert_eq!(
            f.len(),
            3,
            "0.25 replay reply is [b\"\", seq, payload]: {f:?}"
        );
        let seq = u64::from_be_bytes(f[1][..].try_into().unwrap());
        got.push((seq, decode_kv_event_batch(&f[2]).unwrap().1));
    }
    // buffer_steps = 2: only the last two batches survive.
    let known = known_batches();
    assert_eq!(
        got.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        vec![last_seq - 1, last_seq]
    );
    assert_eq!(got[0].1, known[1].1);
    assert_eq!(got[1].1, known[2].1);
    publisher.shutdown().await;
}

/// Strangers declaring 2^62-byte frames on the PUB port (as a SUB) and on the replay port
/// (as a DEALER) are dropped; subscribers and replay clients are served as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_2_pow_62_frame_on_either_port_drops_only_that_peer() {
    let (pub_port, replay_port) = free_ports();
    let config = KvEventsConfig {
        enable_kv_cache_events: true,
        publisher: "zmq".into(),
        endpoint: format!("tcp://*:{pub_port}"),
        replay_endpoint: Some(format!("tcp://*:{replay_port}")),
        ..KvEventsConfig::default()
    };
    let (publisher, _) = KvEventPublisher::start(&config, 0, VllmLine::new(0, 33))
        .await
        .unwrap();
    let pub_ep = format!("tcp://127.0.0.1:{pub_port}");
    let replay_ep = format!("tcp://127.0.0.1:{replay_port}");
    assert!(crate::support::send_a_2_pow_62_frame_header(&pub_ep, "SUB").await);
    assert!(crate::support::send_a_2_pow_62_frame_header(&replay_ep, "DEALER").await);

    let mut sub = SubSocket::new();
    sub.subscribe("").await.unwrap();
    sub.connect(&pub_ep).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        publisher.publish(warmup());
        if let Ok(m) = tokio::time::timeout(Duration::from_millis(100), sub.recv()).await {
            assert_eq!(frames(m.unwrap()).len(), 3, "topic, seq, payload");
            break;
        }
        assert!(Instant::now() < deadline, "the subscriber got nothing");
    }
    let mut dealer = DealerSocket::new();
    dealer.connect(&replay_ep).await.unwrap();
    let req = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&0u64.to_be_bytes()),
    ])
    .unwrap();
    dealer.send(req).await.unwrap();
    loop {
        let f = frames(
            tokio::time::timeout(Duration::from_secs(10), dealer.recv())
                .await
                .expect("replay reply")
                .unwrap(),
        );
        if f.len() >= 4 && f[2][..] == END_SEQ {
            break;
        }
    }
    publisher.shutdown().await;
}

/// An endpoint without `*`, `::` or `ipc://` makes the PUB connect (to a consumer that
/// binds), as vLLM does; the advertised endpoint is the configured one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publisher_connects_to_a_binding_consumer() {
    let mut sub = SubSocket::new();
    sub.subscribe("").await.unwrap();
    let bound = sub.bind("tcp://127.0.0.1:0").await.unwrap();
    let endpoint = bound.to_string();
    let config = KvEventsConfig {
        enable_kv_cache_events: true,
        publisher: "zmq".into(),
        endpoint: endpoint.clone(),
        ..KvEventsConfig::default()
    };
    let (publisher, advertised) = KvEventPublisher::start(&config, 0, VllmLine::new(0, 33))
        .await
        .unwrap();
    assert_eq!(advertised.unwrap().endpoint, endpoint);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        publisher.publish(vec![KvEvent::AllBlocksCleared]);
        if let Ok(m) = tokio::time::timeout(Duration::from_millis(100), sub.recv()).await {
            let f = frames(m.unwrap());
            let (_, events, rank) = decode_kv_event_batch(&f[2]).unwrap();
            assert_eq!((events, rank), (vec![KvEvent::AllBlocksCleared], Some(0)));
            break;
        }
        assert!(
            Instant::now() < deadline,
            "nothing arrived over the connected PUB"
        );
    }
    publisher.shutdown().await;
}
