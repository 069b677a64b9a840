//! `KVEventBatch` / `KVEventsConfig` bytes checked against msgspec with vLLM's own classes.

use rmpv::Value;
use sim_protocol::VllmLine;
use sim_protocol::kv_events::{
    KvEvent, KvEventsConfig, decode_kv_event_batch, encode_kv_event_batch,
};
fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn line(minor: u16) -> VllmLine {
    VllmLine::new(0, minor)
}

/// The batch the expected bytes below were produced from (see `MSGSPEC_*`).
fn sample_events(session_id: Option<&str>) -> Vec<KvEvent> {
    vec![
        KvEvent::BlockStored {
            block_hashes: vec![1088283741995145368, u64::MAX],
            parent_block_hash: Some(42),
            token_ids: vec![0, 1, 127, 128, 65535, 65536, 151643, 7],
            block_size: 4,
            lora_id: Some(3),
            lora_name: Some("sql-lora".into()),
            medium: Some("GPU".into()),
            extra_keys: Some(vec![
                Some(vec![Value::from("sql-lora")]),
                Some(vec![Value::from("sql-lora"), Value::from("salt")]),
            ]),
            group_idx: Some(0),
            session_id: session_id.map(str::to_string),
        },
        KvEvent::BlockStored {
            block_hashes: vec![5],
            parent_block_hash: None,
            token_ids: vec![9, 9, 9, 9],
            block_size: 4,
            lora_id: None,
            lora_name: None,
            medium: None,
            extra_keys: None,
            group_idx: None,
            session_id: None,
        },
        KvEvent::BlockRemoved {
            block_hashes: vec![5, 1088283741995145368],
            medium: Some("GPU".into()),
            group_idx: Some(0),
        },
        KvEvent::AllBlocksCleared,
    ]
}

// Produced once with vLLM 0.33.0's venv (`~/.cache/vllm-vcr/py/vllm-0.33.0/bin/python`):
//
//   import msgspec
//   from vllm.distributed.kv_events import (KVEventBatch, BlockStored, BlockRemoved,
//                                           AllBlocksCleared)
//   def stored(session_id):
//       return BlockStored(block_hashes=[1088283741995145368, 2**64 - 1],
//           parent_block_hash=42, token_ids=[0, 1, 127, 128, 65535, 65536, 151643, 7],
//           block_size=4, lora_id=3, medium="GPU", lora_name="sql-lora",
//           extra_keys=[("sql-lora",), ("sql-lora", "salt")], group_idx=0,
//           session_id=session_id)
//   plain = BlockStored(block_hashes=[5], parent_block_hash=None, token_ids=[9, 9, 9, 9],
//           block_size=4, lora_id=None, medium=None, lora_name=None)
//   removed = BlockRemoved(block_hashes=[5, 1088283741995145368], medium="GPU", group_idx=0)
//   for sid in ("sess-1", None):
//       ev = [stored(sid), plain, removed, AllBlocksCleared()]
//       print(msgspec.msgpack.encode(
//           KVEventBatch(ts=1700000000.25, events=ev, data_parallel_rank=1)).hex())
//   print(msgspec.msgpack.encode(KVEventBatch(ts=0.5, events=[AllBlocksCleared()])).hex())
const MSGSPEC_033_SESSION: &str = "93cb41d954fc4010000094de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf0f1a5c4c20741898cfffffffffffffffffb1706172656e745f626c6f636b5f686173682aa9746f6b656e5f6964739800017fcc80cdffffce00010000ce0002505b07aa626c6f636b5f73697a6504a76c6f72615f696403a66d656469756da3475055a96c6f72615f6e616d65a873716c2d6c6f7261aa65787472615f6b6579739291a873716c2d6c6f726192a873716c2d6c6f7261a473616c74a967726f75705f69647800aa73657373696f6e5f6964a6736573732d31de0008a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739105b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739409090909aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756dc0a96c6f72615f6e616d65c084a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739205cf0f1a5c4c20741898a66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656401";
const MSGSPEC_033_NO_SESSION: &str = "93cb41d954fc4010000094de000aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf0f1a5c4c20741898cfffffffffffffffffb1706172656e745f626c6f636b5f686173682aa9746f6b656e5f6964739800017fcc80cdffffce00010000ce0002505b07aa626c6f636b5f73697a6504a76c6f72615f696403a66d656469756da3475055a96c6f72615f6e616d65a873716c2d6c6f7261aa65787472615f6b6579739291a873716c2d6c6f726192a873716c2d6c6f7261a473616c74a967726f75705f69647800de0008a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739105b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739409090909aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756dc0a96c6f72615f6e616d65c084a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739205cf0f1a5c4c20741898a66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656401";
const MSGSPEC_NO_RANK: &str =
    "93cb3fe00000000000009181a474797065b0416c6c426c6f636b73436c6561726564c0";

// Same script: `msgspec.msgpack.encode(KVEventsConfig(...)).hex()` for the config below
// and for `KVEventsConfig()`.
const MSGSPEC_CONFIG: &str = "88b6656e61626c655f6b765f63616368655f6576656e7473c3a97075626c6973686572a37a6d71a8656e64706f696e74b37463703a2f2f31302e302e302e313a35353537af7265706c61795f656e64706f696e74ac7463703a2f2f2a3a35353538ac6275666665725f7374657073cd2710a368776dce000186a0ae6d61785f71756575655f73697a65ce000186a0a5746f706963a26b76";
const MSGSPEC_CONFIG_DEFAULT: &str = "88b6656e61626c655f6b765f63616368655f6576656e7473c2a97075626c6973686572a46e756c6ca8656e64706f696e74ac7463703a2f2f2a3a35353537af7265706c61795f656e64706f696e74c0ac6275666665725f7374657073cd2710a368776dce000186a0ae6d61785f71756575655f73697a65ce000186a0a5746f706963a0";

#[test]
fn batch_matches_msgspec_bytes_on_0_33() {
    let events = sample_events(Some("sess-1"));
    let got = encode_kv_event_batch(line(33), 1700000000.25, &events, Some(1));
    assert_eq!(got, hex(MSGSPEC_033_SESSION));
    let events = sample_events(None);
    let got = encode_kv_event_batch(line(33), 1700000000.25, &events, Some(1));
    assert_eq!(got, hex(MSGSPEC_033_NO_SESSION));
}

#[test]
fn unset_rank_is_nil_not_trimmed() {
    let got = encode_kv_event_batch(line(33), 0.5, &[KvEvent::AllBlocksCleared], None);
    assert_eq!(got, hex(MSGSPEC_NO_RANK));
}

/// Before 0.33 `BlockStored` has < 15 fields, so msgspec writes a fixmap header; before
/// 0.30 there is no `session_id` to write. Everything else is byte-identical.
#[test]
fn older_lines_differ_only_in_header_and_session_id() {
    let with_session = sample_events(Some("sess-1"));
    let map16_to_fixmap = |mut b: Vec<u8>, keys: u8| {
        // Each `de 00 nn` + "type" + "BlockStored" becomes `8n` + the same.
        let needle = [0xde, 0x00, keys, 0xa4, b't', b'y', b'p', b'e', 0xab, b'B'];
        let pos = b.windows(needle.len()).position(|w| w == needle).unwrap();
        b.splice(pos..pos + 3, [0x80 | keys]);
        b
    };
    // 0.30 – 0.32: session_id written, fixmap headers.
    let expected = map16_to_fixmap(map16_to_fixmap(hex(MSGSPEC_033_SESSION), 11), 8);
    for minor in 30..=32 {
        let got = encode_kv_event_batch(line(minor), 1700000000.25, &with_session, Some(1));
        assert_eq!(got, expected, "0.{minor}");
    }
    // 0.25 – 0.29: session_id dropped even when set.
    let expected = map16_to_fixmap(map16_to_fixmap(hex(MSGSPEC_033_NO_SESSION), 10), 8);
    for minor in 25..=29 {
        let got = encode_kv_event_batch(line(minor), 1700000000.25, &with_session, Some(1));
        assert_eq!(got, expected, "0.{minor}");
    }
}

#[test]
fn decode_round_trips_every_line() {
    for minor in 25..=33 {
        let events = sample_events(Some("sess-1"));
        let bytes = encode_kv_event_batch(line(minor), 1700000000.25, &events, Some(1));
        let (ts, got, rank) = decode_kv_event_batch(&bytes).unwrap();
        assert_eq!(ts, 1700000000.25);
        assert_eq!(rank, Some(1));
        let mut expected = events;
        if minor < 30
            && let KvEvent::BlockStored { session_id, .. } = &mut expected[0]
        {
            *session_id = None;
        }
        assert_eq!(got, expected, "0.{minor}");
    }
    let (ts, got, rank) = decode_kv_event_batch(&hex(MSGSPEC_NO_RANK)).unwrap();
    assert_eq!((ts, rank), (0.5, None));
    assert_eq!(got, vec![KvEvent::AllBlocksCleared]);
}

#[test]
fn decode_is_lenient_where_msgspec_is() {
    // Integer ts, 2-element batch, unknown keys, a bytes hash (low 64 bits kept).
    let mut h = vec![0xAAu8; 24];
    h.extend_from_slice(&7u64.to_be_bytes());
    let ev = Value::Map(vec![
        ("type".into(), "BlockRemoved".into()),
        ("block_hashes".into(), Value::Array(vec![Value::Binary(h)])),
        ("medium".into(), Value::Nil),
        ("locality".into(), "LOCAL".into()),
    ]);
    let batch = Value::Array(vec![Value::from(3), Value::Array(vec![ev])]);
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, &batch).unwrap();
    let (ts, events, rank) = decode_kv_event_batch(&buf).unwrap();
    assert_eq!((ts, rank), (3.0, None));
    assert_eq!(
        events,
        vec![KvEvent::BlockRemoved {
            block_hashes: vec![7],
            medium: None,
            group_idx: None
        }]
    );
}

#[test]
fn decode_rejects_what_msgspec_rejects() {
    let enc = |v: Value| {
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, &v).unwrap();
        buf
    };
    // A required key missing (BlockStored without lora_name).
    let ev = Value::Map(vec![
        ("type".into(), "BlockStored".into()),
        ("block_hashes".into(), Value::Array(vec![1.into()])),
        ("parent_block_hash".into(), Value::Nil),
        ("token_ids".into(), Value::Array(vec![])),
        ("block_size".into(), 4.into()),
        ("lora_id".into(), Value::Nil),
        ("medium".into(), Value::Nil),
    ]);
    let err = decode_kv_event_batch(&enc(Value::Array(vec![1.0.into(), Value::Array(vec![ev])])))
        .unwrap_err();
    assert!(err.to_string().contains("events[0].lora_name"), "{err}");
    // An unknown type.
    let ev = Value::Map(vec![("type".into(), "BlockMoved".into())]);
    let err = decode_kv_event_batch(&enc(Value::Array(vec![1.0.into(), Value::Array(vec![ev])])))
        .unwrap_err();
    assert!(err.to_string().contains("BlockMoved"), "{err}");
    // Not a batch.
    assert!(decode_kv_event_batch(&enc(Value::Array(vec![1.0.into()]))).is_err());
    assert!(decode_kv_event_batch(b"\xc1").is_err());
}

#[test]
fn constructors_match_vllm_0_33_block_pool() {
    // BlockPool(16, True, 4, enable_kv_cache_events=True).cache_full_blocks(...) on a
    // 10-token prompt emitted exactly this (vLLM 0.33.0, no LoRA / mm / salt):
    // {'type': 'BlockStored', 'block_hashes': [h1, h2], 'parent_block_hash': None,
    //  'token_ids': [0..8], 'block_size': 4, 'lora_id': None, 'medium': 'GPU',
    //  'lora_name': None, 'extra_keys': [None, None], 'group_idx': 0}
    let e = KvEvent::block_stored(vec![1, 2], None, (0..8).collect(), 4);
    let KvEvent::BlockStored {
        extra_keys,
        group_idx,
        medium,
        ..
    } = &e
    else {
        unreachable!()
    };
    assert_eq!(extra_keys, &Some(vec![None, None]));
    assert_eq!((*group_idx, medium.as_deref()), (Some(0), Some("GPU")));
    let bytes = encode_kv_event_batch(line(33), 1.0, &[e], Some(0));
    // The 10 keys above behind a map16 header (`de 000a`), as msgspec writes them.
    assert_eq!(&bytes[10..13], &[0x91, 0xde, 0x00][..]);
    assert_eq!(bytes[13], 0x0a);
}

#[test]
fn config_matches_msgspec_bytes() {
    let c = KvEventsConfig {
        enable_kv_cache_events: true,
        publisher: "zmq".into(),
        endpoint: "tcp://10.0.0.1:5557".into(),
        replay_endpoint: Some("tcp://*:5558".into()),
        buffer_steps: 10_000,
        hwm: 100_000,
        max_queue_size: 100_000,
        topic: "kv".into(),
    };
    assert_eq!(c.encode(), hex(MSGSPEC_CONFIG));
    assert_eq!(
        KvEventsConfig::default().encode(),
        hex(MSGSPEC_CONFIG_DEFAULT)
    );
    // The Value form writes the same bytes (it goes into ReadyResponse).
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, &c.to_value()).unwrap();
    assert_eq!(buf, hex(MSGSPEC_CONFIG));
    assert_eq!(KvEventsConfig::decode(&buf).unwrap(), c);
    assert_eq!(KvEventsConfig::from_value(&c.to_value()).unwrap(), c);
}

#[test]
fn config_decode_is_lenient() {
    let m = Value::Map(vec![
        ("enable_kv_cache_events".into(), true.into()),
        ("publisher".into(), Value::Nil),
        ("topic".into(), "t".into()),
        ("something_new".into(), 1.into()),
    ]);
    let c = KvEventsConfig::from_value(&m).unwrap();
    assert_eq!(c.publisher, "zmq");
    assert_eq!(c.topic, "t");
    assert_eq!(c.endpoint, "tcp://*:5557");
    assert!(c.is_active());
    let c = KvEventsConfig::from_value(&Value::Map(vec![])).unwrap();
    assert_eq!(c, KvEventsConfig::default());
    assert!(!c.is_active());
    assert!(KvEventsConfig::from_value(&Value::from(1)).is_err());
}
