//! The replay index (`sim_trace::replay`): arrival order, id and prefix matching,
//! consumption, payloads and load errors.

use std::path::PathBuf;

use sim_trace::replay::{
    MissReason, ReplayError, ReplayIndex, ReplayLoadOptions, parse_replay_index,
};
use sim_trace::trace::{BlockHash, TraceMeta, TraceRecord, TraceWriter};

fn tmp(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("sim-trace-tests");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(format!("{}-replay-{name}", std::process::id()))
}

fn write(name: &str, block_size: Option<u32>, records: &[TraceRecord]) -> PathBuf {
    let path = tmp(name);
    let meta = TraceMeta {
        block_size,
        config_hash: Some(format!("hash-of-{name}")),
        ..TraceMeta::new()
    };
    let mut w = TraceWriter::create(&path, &meta).unwrap();
    for r in records {
        w.write_record(r).unwrap();
    }
    w.finish().unwrap();
    path
}

fn rec(id: &str, arrival: Option<f64>, chain: &[u64], prompt_tokens: u32) -> TraceRecord {
    TraceRecord {
        request_id: Some(id.to_string()),
        prompt_tokens,
        output_tokens: 2,
        arrival_ms: arrival,
        ttft_ms: Some(10.0),
        itl_ms: vec![1.0],
        block_hashes: chain.iter().map(|&h| BlockHash::Int(h)).collect(),
        output_token_ids: Some(vec![7, 8]),
        finish_reason: Some("length".into()),
        ..TraceRecord::default()
    }
}

const ALL: ReplayLoadOptions = ReplayLoadOptions {
    tokens: true,
    steps: true,
};

fn ids(index: &ReplayIndex) -> Vec<&str> {
    (0..index.len())
        .map(|i| index.record(i).request_id().unwrap())
        .collect()
}

#[test]
fn arrival_order_across_finish_ordered_files() {
    // written in finish order; ties break by file, then line
    let a = write(
        "order-a.jsonl",
        Some(16),
        &[
            rec("a30", Some(30.0), &[], 4),
            rec("a10", Some(10.0), &[], 4),
            rec("a20", Some(20.0), &[], 4),
            rec("a20-later-line", Some(20.0), &[], 4),
        ],
    );
    let b = write(
        "order-b.jsonl.gz",
        Some(16),
        &[
            rec("b-untimed", None, &[], 4),
            rec("b20", Some(20.0), &[], 4),
            rec("b5", Some(5.0), &[], 4),
        ],
    );
    let index = ReplayIndex::load(&[a.clone(), b.clone()], ALL).unwrap();
    assert_eq!(
        ids(&index),
        [
            "b5",
            "a10",
            "a20",
            "a20-later-line",
            "b20",
            "a30",
            "b-untimed"
        ]
    );
    assert_eq!(index.record(0).source(), (b.as_path(), 4));
    assert_eq!(index.block_size(), Some(16));
    assert_eq!(
        index.files()[1].config_hash(),
        Some("hash-of-order-b.jsonl.gz")
    );
    assert_eq!(index.files()[0].records, 4);
    assert!(
        index
            .warnings()
            .iter()
            .any(|w| w.contains("1 of 3 records have no arrival_ms")),
        "{:?}",
        index.warnings()
    );
}

#[test]
fn index_ids_with_frontend_prefixes_and_suffixes() {
    for (id, want) in [
        ("replay-0", Some(0)),
        ("replay-007", Some(7)),
        ("cmpl-replay-17-0-3f2a9c1b", Some(17)),
        ("chatcmpl-replay-17-5d1e9a", Some(17)),
        ("cmpl-replay-17-0-12345678", Some(17)),
        ("req_replay-3", Some(3)),
        ("replay-1-replay-2-0", Some(2)),
        ("replay-5-replay-x", Some(5)),
        ("replay-3f2a", None),
        ("xreplay-3", None),
        ("cmpl-abc-0-17", None),
        ("replay-", None),
        ("replay-99999999999999999999999", Some(u64::MAX)),
    ] {
        assert_eq!(parse_replay_index(id), want, "{id}");
    }

    let path = write(
        "index.jsonl",
        Some(16),
        &[
            rec("r2", Some(2.0), &[], 4),
            rec("r0", Some(0.0), &[], 4),
            rec("r1", Some(1.0), &[], 4),
        ],
    );
    let mut index = ReplayIndex::load(&[path], ALL).unwrap();
    let hit = index.lookup_index("cmpl-replay-2-0-3f2a9c1b").unwrap();
    assert_eq!((hit.record, hit.reserve), (2, false));
    assert_eq!(index.record(hit.record).request_id(), Some("r2"));
    let again = index.lookup_index("chatcmpl-replay-2-ab12").unwrap();
    assert_eq!((again.record, again.reserve), (2, true));

    let miss = index.lookup_index("cmpl-9f1c-0").unwrap_err();
    assert_eq!(miss.kind(), "bad_id");
    assert!(miss.to_string().contains("`cmpl-9f1c-0`"), "{miss}");
    let miss = index.lookup_index("cmpl-replay-3-0-aa").unwrap_err();
    assert_eq!(miss.kind(), "out_of_range");
    assert!(
        miss.to_string().contains("3 records (replay-0 … replay-2)"),
        "{miss}"
    );
    // a number past u64 is reported as the id gives it, not as a saturated 2^64 − 1
    let miss = index
        .lookup_index("cmpl-replay-99999999999999999999999-0")
        .unwrap_err();
    let text = miss.to_string();
    assert!(
        text.contains("names record 99999999999999999999999,")
            && !text.contains("18446744073709551615"),
        "{text}"
    );

    let s = index.stats();
    assert_eq!((s.served, s.reserved, s.missed_total()), (2, 1, 3));
    assert_eq!(s.missed["bad_id"], 1);
}

#[test]
fn duplicate_prompts_consume_one_to_one_then_reserve() {
    let chain = [11, 12];
    let path = write(
        "dups.jsonl",
        Some(16),
        &[
            rec("late", Some(2.0), &chain, 40),
            rec("tail37", Some(0.0), &chain, 37),
            rec("early", Some(1.0), &chain, 40),
            rec("longer", Some(3.0), &[11, 12, 13], 50),
        ],
    );
    // arrival order: tail37 (0), early (1), late (2), longer (3)
    let mut index = ReplayIndex::load(&[path], ALL).unwrap();
    let mut got = Vec::new();
    for _ in 0..5 {
        let hit = index.lookup_prefix(&chain, 40).unwrap();
        assert_eq!(hit.depth, 2);
        got.push((
            index.record(hit.record).request_id().unwrap().to_string(),
            hit.reserve,
        ));
    }
    let got: Vec<(&str, bool)> = got.iter().map(|(id, r)| (id.as_str(), *r)).collect();
    assert_eq!(
        got,
        [
            ("early", false),  // same prompt_tokens, earliest
            ("late", false),   // next duplicate
            ("tail37", false), // unconsumed beats equal prompt_tokens
            ("early", true),   // all consumed: best again (equal tokens, earliest)
            ("early", true),
        ]
    );
    // another tail length: no equal group, so the earliest record again
    let hit = index.lookup_prefix(&chain, 33).unwrap();
    assert_eq!((hit.record, hit.reserve), (0, true));
    // the longer record is its own node, untouched by the above
    let hit = index.lookup_prefix(&[11, 12, 13], 50).unwrap();
    assert_eq!((hit.record, hit.depth, hit.reserve), (3, 3, false));
    let s = index.stats();
    assert_eq!((s.served, s.reserved), (7, 3));
    assert_eq!(s.prefix_depth[&2], 6);
    assert_eq!(s.prefix_depth[&3], 1);
}

#[test]
fn tail_divergence_is_a_partial_prefix_miss() {
    let path = write(
        "diverge.jsonl",
        Some(16),
        &[
            rec("cmpl-long", Some(0.0), &[1, 2, 3, 4, 5], 80),
            rec("cmpl-other", Some(1.0), &[1, 2, 3, 6], 64),
        ],
    );
    let mut index = ReplayIndex::load(&[path], ALL).unwrap();

    let miss = index.lookup_prefix(&[1, 2, 3, 9, 10], 80).unwrap_err();
    assert_eq!(miss.kind(), "partial_prefix");
    let MissReason::PartialPrefix {
        depth,
        prompt_blocks,
        closest,
    } = &miss
    else {
        panic!("{miss:?}")
    };
    assert_eq!(
        (*depth, *prompt_blocks, closest.index, closest.blocks),
        (3, 5, 0, 5)
    );
    assert_eq!(
        miss.to_string(),
        "prompt diverges from record 0 (replay-0, id cmpl-long) after 3 of 5 blocks (the record has 5)"
    );

    // a prompt that is a strict prefix of every record: all blocks match, still a miss
    let miss = index.lookup_prefix(&[1, 2, 3], 48).unwrap_err();
    assert!(matches!(
        miss,
        MissReason::PartialPrefix {
            depth: 3,
            prompt_blocks: 3,
            ..
        }
    ));
    assert!(
        miss.to_string().contains("every record there is longer"),
        "{miss}"
    );

    // a prompt longer than a record it starts with
    let miss = index.lookup_prefix(&[1, 2, 3, 6, 7], 80).unwrap_err();
    assert!(
        matches!(&miss, MissReason::PartialPrefix { depth: 4, closest, .. } if closest.index == 1),
        "{miss:?}"
    );

    let miss = index.lookup_prefix(&[99, 1], 32).unwrap_err();
    assert_eq!(miss.kind(), "no_record");
    assert_eq!(
        miss.to_string(),
        "no record shares the first block (the prompt has 2 blocks)"
    );
    assert!(index.lookup_prefix(&[1, 2, 3, 6], 64).is_ok());
    assert!(!index.is_consumed(0));
    let s = index.stats();
    assert_eq!(s.missed["partial_prefix"], 3);
    assert_eq!(s.prefix_depth[&0], 1);
    assert_eq!(s.prefix_depth[&4], 2);
}

#[test]
fn short_prompt_misses() {
    let path = write("short.jsonl", Some(16), &[rec("a", Some(0.0), &[1], 16)]);
    let mut index = ReplayIndex::load(&[path], ALL).unwrap();
    let miss = index.lookup_prefix(&[], 5).unwrap_err();
    assert_eq!(miss.kind(), "short_prompt");
    assert_eq!(
        miss.to_string(),
        "prompt shorter than one block (5 tokens < block size 16)"
    );
}

#[test]
fn tokens_and_steps_retrieval() {
    let full = TraceRecord {
        output_tokens: 4,
        ttft_ms: Some(12.5),
        itl_ms: vec![1.0, 2.25],
        itl_tokens: vec![1, 2],
        output_token_ids: Some(vec![5, 6, 7, 8]),
        finish_reason: Some("stop".into()),
        ..rec("full", Some(0.0), &[1], 16)
    };
    let cut = TraceRecord {
        output_tokens: 0,
        ttft_ms: None,
        itl_ms: vec![],
        output_token_ids: None,
        finish_reason: None,
        incomplete: true,
        ..rec("cut", Some(1.0), &[2], 16)
    };
    let path = write("payload.jsonl.gz", Some(16), &[full, cut]);

    let mut index = ReplayIndex::load(std::slice::from_ref(&path), ALL).unwrap();
    let hit = index.lookup_prefix(&[1], 20).unwrap();
    let r = index.record(hit.record);
    assert_eq!(r.tokens(), Some(&[5, 6, 7, 8][..]));
    assert_eq!(r.finish_reason(), Some("stop"));
    assert!(!r.incomplete());
    let steps = r.steps().unwrap();
    assert_eq!(steps.ttft_ms, 12.5);
    assert_eq!(steps.first_chunk_tokens, 1);
    assert_eq!(steps.chunks().collect::<Vec<_>>(), [(1.0, 1), (2.25, 2)]);
    assert_eq!(steps.total_tokens(), 4);
    assert_eq!(index.max_chunk_tokens(), 2);

    // the record without ids is consumed but unservable
    let miss = index.lookup_index("replay-1").unwrap_err();
    assert_eq!(miss.kind(), "no_tokens");
    assert!(
        miss.to_string().starts_with("record 1 (replay-1, id cut)"),
        "{miss}"
    );
    assert!(index.is_consumed(1));
    // the same through a prefix lookup: the full match counts at its depth
    let miss = index.lookup_prefix(&[2], 16).unwrap_err();
    assert_eq!(miss.kind(), "no_tokens");
    assert_eq!(index.stats().prefix_depth[&1], 2);
    assert!(index.record(1).incomplete());
    assert_eq!(index.record(1).finish_reason(), None);
    assert!(
        index
            .warnings()
            .iter()
            .any(|w| w.contains("1 of 2 records have no output_token_ids"))
    );

    // steps only: no token arena, and a timing-less record misses as no_steps
    let only = ReplayLoadOptions {
        tokens: false,
        steps: true,
    };
    let mut index = ReplayIndex::load(&[path], only).unwrap();
    assert_eq!(index.record(0).tokens(), None);
    assert!(index.record(0).steps().is_some());
    assert_eq!(
        index.lookup_index("replay-1").unwrap_err().kind(),
        "no_steps"
    );
    // neither: shape only
    let path = write("shape.jsonl", Some(16), &[rec("a", Some(0.0), &[1], 16)]);
    let index = ReplayIndex::load(&[path], ReplayLoadOptions::default()).unwrap();
    assert_eq!(
        (index.record(0).tokens(), index.record(0).steps()),
        (None, None)
    );
    assert_eq!(index.record(0).output_tokens(), 2);
}

#[test]
fn different_block_sizes_are_an_error() {
    let a = write("bs16.jsonl", Some(16), &[rec("a", Some(0.0), &[1], 16)]);
    let b = write("bs32.jsonl", Some(32), &[rec("b", Some(0.0), &[1], 32)]);
    let err = ReplayIndex::load(&[a, b], ALL).unwrap_err();
    assert!(matches!(
        err,
        ReplayError::BlockSizeMismatch {
            found: 32,
            expected: 16,
            ..
        }
    ));
    let msg = err.to_string();
    assert!(
        msg.contains("bs32.jsonl") && msg.contains("bs16.jsonl"),
        "{msg}"
    );
}

#[test]
fn trace_without_token_ids_is_an_error_under_tokens() {
    let mut r = rec("a", Some(0.0), &[1], 16);
    r.output_token_ids = None;
    let path = write("no-ids.jsonl", Some(16), &[r]);
    let err = ReplayIndex::load(std::slice::from_ref(&path), ALL).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, ReplayError::NoTokenIds { .. }));
    assert!(
        msg.contains("no-ids.jsonl") && msg.contains("--record-tokens"),
        "{msg}"
    );
    // without `tokens` the same trace serves timing
    let steps = ReplayLoadOptions {
        tokens: false,
        steps: true,
    };
    assert!(ReplayIndex::load(&[path], steps).is_ok());
}

#[test]
fn string_hashes_are_counted_and_never_matched() {
    let mut s = rec("s", Some(0.0), &[], 32);
    s.block_hashes = vec![BlockHash::Int(1), BlockHash::Str("ab12".into())];
    let path = write(
        "strings.jsonl",
        Some(16),
        &[s, rec("i", Some(1.0), &[5], 16)],
    );
    let mut index = ReplayIndex::load(&[path], ALL).unwrap();
    assert_eq!(index.prefix_indexed(), 1);
    assert_eq!(index.record(0).blocks(), 0);
    assert!(
        index
            .warnings()
            .iter()
            .any(|w| w.contains("1 of 2 records carry string")),
        "{:?}",
        index.warnings()
    );
    assert_eq!(
        index.lookup_prefix(&[1], 16).unwrap_err().kind(),
        "no_record"
    );
}

#[test]
fn empty_or_missing_traces_are_errors() {
    assert!(matches!(
        ReplayIndex::load(&[], ALL),
        Err(ReplayError::NoPaths)
    ));
    let path = write("empty.jsonl", Some(16), &[]);
    assert!(matches!(
        ReplayIndex::load(&[path], ALL),
        Err(ReplayError::Empty { .. })
    ));
    let err = ReplayIndex::load(&[tmp("does-not-exist.jsonl")], ALL).unwrap_err();
    assert!(err.to_string().contains("does-not-exist.jsonl"), "{err}");
}

#[test]
fn stats_summary_and_json() {
    let path = write(
        "stats.jsonl",
        Some(16),
        &[
            rec("a", Some(0.0), &[1, 2], 32),
            rec("b", Some(1.0), &[3], 16),
        ],
    );
    let mut index = ReplayIndex::load(&[path], ALL).unwrap();
    assert_eq!(index.stats().summary(), "no lookups (2 records indexed)");
    index.lookup_prefix(&[1, 2], 32).unwrap();
    index.lookup_prefix(&[1, 2], 32).unwrap();
    index.lookup_prefix(&[1, 9], 32).unwrap_err();
    index.lookup_prefix(&[], 3).unwrap_err();
    assert_eq!(
        index.stats().summary(),
        "2 served (1 re-served, 1 of 2 records used), 2 missed (partial_prefix 1, short_prompt 1); prefix depth min 0 / median 1 / max 2 blocks"
    );
    let json = serde_json::to_value(index.stats()).unwrap();
    assert_eq!(
        json,
        serde_json::json!({
            "records": 2, "served": 2, "reserved": 1,
            "missed": {"partial_prefix": 1, "short_prompt": 1},
            "prefix_depth": {"0": 1, "1": 1, "2": 2}
        })
    );
}

#[test]
fn truncated_gzip_keeps_its_complete_lines_with_a_warning() {
    let records: Vec<TraceRecord> = (0..200u32)
        .map(|i| {
            rec(
                &format!("r{i}"),
                Some(f64::from(i)),
                &[u64::from(i) + 1],
                16,
            )
        })
        .collect();
    let path = write("cut.jsonl.gz", Some(16), &records);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let index = ReplayIndex::load(&[path], ALL).unwrap();
    assert!(index.len() < 200, "{}", index.len());
    assert!(
        index
            .warnings()
            .iter()
            .any(|w| w.contains("gzip stream cut short")),
        "{:?}",
        index.warnings()
    );
}

/// A gap or TTFT past a day is refused at load, naming the file, line, record and field
/// (an engine told to wait 1e300 ms used to panic); a meta line of a newer schema warns.
#[test]
fn absurd_timing_is_refused_and_newer_schemas_warn() {
    let mut bad = rec("huge", Some(0.0), &[], 4);
    bad.itl_ms = vec![1.0, 1e300];
    bad.output_tokens = 3;
    let path = write(
        "huge-itl.jsonl",
        Some(16),
        &[rec("ok", Some(1.0), &[], 4), bad],
    );
    let e = ReplayIndex::load(std::slice::from_ref(&path), ALL).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("{}:3:", path.display()))
            && msg.contains("`huge`")
            && msg.contains("itl_ms[1] = 1e300"),
        "{msg}"
    );
    // content alone does not use the timing
    let tokens_only = ReplayLoadOptions {
        tokens: true,
        steps: false,
    };
    assert!(ReplayIndex::load(std::slice::from_ref(&path), tokens_only).is_ok());

    let newer = tmp("v999.jsonl");
    std::fs::write(
        &newer,
        "{\"meta\": {\"version\": 999}}\n{\"request_id\": \"a\", \"ttft_ms\": 1, \"output_token_ids\": [1]}\n",
    )
    .unwrap();
    let index = ReplayIndex::load(&[newer], ALL).unwrap();
    assert!(
        index
            .warnings()
            .iter()
            .any(|w| w.contains("meta version 999")),
        "{:?}",
        index.warnings()
    );
}
