//! Trace reader/writer: round trips, compatibility and error reporting.

use std::io::Write;
use std::path::PathBuf;

use sim_trace::trace::{
    BlockHash, ItlCtx, SCHEMA_VERSION, TraceError, TraceItem, TraceMeta, TraceReader, TraceRecord,
    TraceWriter,
};

fn tmp(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("sim-trace-tests");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(format!("{}-{name}", std::process::id()))
}

fn sample_meta() -> TraceMeta {
    TraceMeta {
        model: Some("Qwen/Qwen3-8B".into()),
        gpu: Some("H200".into()),
        tp: Some(1),
        block_size: Some(16),
        vllm_version: Some("0.23.0".into()),
        config_hash: Some("ab".repeat(32)),
        ready_response_hex: Some("82a1".into()),
        host_cpu: Some(Box::new(sim_trace::host::HostCpu {
            arch: "x86_64".into(),
            model: "AMD EPYC".into(),
            signature: "AuthenticAMD family 25 model 17".into(),
            flags: vec!["avx2".into(), "fma".into()],
            logical_cpus: Some(2),
        })),
        notes: Box::new([("rig".to_string(), "tcmalloc; engine on cpu 1".to_string())].into()),
        ..TraceMeta::new()
    }
}

fn sample_records() -> Vec<TraceRecord> {
    vec![
        TraceRecord {
            request_id: Some("replay-0".into()),
            prompt_tokens: 512,
            cached_tokens: Some(0),
            output_tokens: 4,
            arrival_ms: Some(0.0),
            ttft_ms: Some(58.25),
            itl_ms: vec![11.5, 10.75, 11.0],
            concurrency: Some(1),
            itl_ctx: ItlCtx {
                num_running: vec![1, 2, 2],
                prefill_tokens: vec![0, 512, 0],
            },
            block_hashes: vec![BlockHash::Int(u64::MAX), BlockHash::Int(7)],
            finish_reason: Some("length".into()),
            ..Default::default()
        },
        TraceRecord {
            request_id: Some("replay-1".into()),
            prompt_tokens: 64,
            output_tokens: 7,
            arrival_ms: Some(3.5),
            ttft_ms: Some(20.0),
            itl_ms: vec![12.0, 12.5],
            itl_tokens: vec![4, 2],
            mm_hashes: vec!["c0ffee".into()],
            block_hashes: vec![BlockHash::Str("deadbeef".into())],
            output_token_ids: Some(vec![1, 2, 3, 4, 5, 6, 7]),
            finish_reason: Some("stop".into()),
            ..Default::default()
        },
        TraceRecord {
            request_id: Some("replay-2".into()),
            prompt_tokens: 10,
            output_tokens: 1,
            arrival_ms: Some(4.0),
            incomplete: true,
            abort_reason: Some("client disconnected".into()),
            error: Some("engine dead".into()),
            ..Default::default()
        },
    ]
}

fn round_trip(name: &str) {
    let path = tmp(name);
    let meta = sample_meta();
    let records = sample_records();
    let mut w = TraceWriter::create(&path, &meta).unwrap();
    for r in &records {
        w.write_record(r).unwrap();
    }
    w.finish().unwrap();

    let items: Vec<TraceItem> = TraceReader::open(&path)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(items.len(), 1 + records.len());
    assert_eq!(items[0], TraceItem::Meta(meta.clone()));
    for (item, want) in items[1..].iter().zip(&records) {
        assert_eq!(item, &TraceItem::Record(want.clone()));
    }
    let TraceItem::Meta(m) = &items[0] else {
        unreachable!()
    };
    assert_eq!(m.schema_version(), SCHEMA_VERSION);
    assert_eq!(m.tool.as_deref(), Some("vllm-vcr"));
}

#[test]
fn round_trip_plain() {
    round_trip("rt.jsonl");
    let path = tmp("rt.jsonl");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.starts_with("{\"meta\":{"), "{text}");
    // grep -v '"meta"' strips exactly the meta line
    assert_eq!(text.lines().filter(|l| l.contains("\"meta\"")).count(), 1);
}

#[test]
fn round_trip_gz() {
    round_trip("rt.jsonl.gz");
    let bytes = std::fs::read(tmp("rt.jsonl.gz")).unwrap();
    assert_eq!(&bytes[..2], &[0x1f, 0x8b], "not gzip");
}

#[test]
fn writer_dropped_without_finish_still_completes_gzip() {
    let path = tmp("drop.jsonl.gz");
    {
        let mut w = TraceWriter::create(&path, &sample_meta()).unwrap();
        w.write_record(&sample_records()[0]).unwrap();
    }
    let n = TraceReader::open(&path)
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap()
        .len();
    assert_eq!(n, 2);
}

#[test]
fn product_docs_fixture_loads() {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/product-docs-schema.jsonl");
    let mut reader = TraceReader::open(&path).unwrap();
    let (meta, first) = reader.read_header().unwrap();
    assert!(first.is_none());
    let meta = meta.expect("meta line");
    assert_eq!(meta.schema_version(), 1, "absent version means 1");
    assert_eq!(meta.model.as_deref(), Some("Qwen/Qwen3-8B"));
    assert_eq!(meta.gpu.as_deref(), Some("H200"));
    assert_eq!(meta.tp, Some(1));
    assert_eq!(meta.block_size, Some(16));
    assert_eq!(meta.max_num_seqs, Some(128));
    assert_eq!(meta.vllm_version.as_deref(), Some("0.23.0.dev1+g0123abc"));
    assert_eq!(meta.config_hash.as_deref().map(str::len), Some(64));
    assert!(meta.ready_response_hex.is_some());
    assert_eq!(meta.host_cpu, None, "a trace without host_cpu loads");
    assert!(meta.notes.is_empty());

    let records: Vec<TraceRecord> = reader.records().collect::<Result<_, _>>().unwrap();
    assert_eq!(records.len(), 3);
    let r0 = &records[0];
    assert_eq!(r0.cached_tokens, Some(0));
    assert_eq!(r0.itl_ms.len(), 3);
    assert_eq!(r0.chunk_tokens(), vec![1, 1, 1]);
    assert_eq!(r0.itl_ctx.num_running, vec![1, 1, 2]);
    assert_eq!(r0.itl_ctx.prefill_tokens, vec![0, 0, 512]);
    assert_eq!(r0.block_hashes[0], BlockHash::Int(9876543210123456789));
    assert_eq!(r0.output_token_ids, None);
    let r1 = &records[1];
    assert_eq!(r1.itl_tokens, vec![1, 5, 2]);
    assert_eq!(r1.first_chunk_tokens(), 1);
    assert_eq!(r1.mm_hashes, vec!["c0ffee".to_string()]);
    assert_eq!(r1.output_token_ids.as_ref().map(Vec::len), Some(9));
    assert_eq!(r1.finish_reason.as_deref(), Some("stop"));
    let r2 = &records[2];
    assert_eq!(r2.arrival_ms, None, "converted traces have no timeline");
    assert_eq!(r2.request_id, None);
    assert!(!r2.incomplete);
}

#[test]
fn corrupt_line_reports_its_line_number() {
    let path = tmp("corrupt.jsonl");
    std::fs::write(
        &path,
        "{\"meta\": {\"model\": \"m\"}}\n{\"prompt_tokens\": 1}\n\n{\"prompt_tokens\": oops}\n{\"prompt_tokens\": 2}\n",
    )
    .unwrap();
    let items: Vec<_> = TraceReader::open(&path).unwrap().collect();
    assert_eq!(items.len(), 4, "parse errors do not end iteration");
    let err = items[2].as_ref().unwrap_err();
    assert!(matches!(err, TraceError::Parse { line: 4, .. }), "{err:?}");
    assert_eq!(err.line(), Some(4));
    let msg = err.to_string();
    assert!(msg.starts_with(&format!("{}:4: ", path.display())), "{msg}");
    assert!(matches!(&items[3], Ok(TraceItem::Record(r)) if r.prompt_tokens == 2));
}

#[test]
fn wrong_type_reports_its_line_number() {
    let path = tmp("badtype.jsonl.gz");
    let mut enc = flate2::write::GzEncoder::new(
        std::fs::File::create(&path).unwrap(),
        flate2::Compression::fast(),
    );
    enc.write_all(b"{\"prompt_tokens\": 1}\n{\"itl_ms\": \"x\"}\n")
        .unwrap();
    enc.finish().unwrap();
    let err = TraceReader::open(&path)
        .unwrap()
        .find_map(Result::err)
        .unwrap();
    assert!(
        err.to_string()
            .starts_with(&format!("{}:2: ", path.display())),
        "{err}"
    );
}

#[test]
fn truncated_gz_reports_the_file() {
    let path = tmp("full.jsonl.gz");
    let mut w = TraceWriter::create(&path, &sample_meta()).unwrap();
    let rec = &sample_records()[0];
    for _ in 0..2000 {
        w.write_record(rec).unwrap();
    }
    w.finish().unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let cut = tmp("cut.jsonl.gz");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();

    let mut good = 0u64;
    let mut err = None;
    for item in TraceReader::open(&cut).unwrap() {
        match item {
            Ok(_) => good += 1,
            Err(e) => {
                err = Some(e);
                break;
            }
        }
    }
    let err = err.expect("truncation must be an error, not a silent EOF");
    let msg = err.to_string();
    assert!(msg.contains(&cut.display().to_string()), "{msg}");
    assert!(msg.contains("truncated"), "{msg}");
    match err {
        TraceError::Truncated { last_good_line, .. } => {
            assert!(
                last_good_line >= 1 && last_good_line <= good,
                "{last_good_line} vs {good}"
            );
        }
        TraceError::Parse { line, .. } => {
            // the cut can land mid-line; then the partial line fails to parse first
            assert_eq!(line, good + 1);
        }
        other => panic!("unexpected error {other:?}"),
    }
    assert!(good > 0 && good < 2001, "{good}");

    // a cut before the footer only (all data present) is still reported
    let cut2 = tmp("nofooter.jsonl.gz");
    std::fs::write(&cut2, &bytes[..bytes.len() - 4]).unwrap();
    let items: Vec<_> = TraceReader::open(&cut2).unwrap().collect();
    assert!(
        matches!(items.last(), Some(Err(TraceError::Truncated { .. }))),
        "{:?}",
        items.last()
    );
}

#[test]
fn unknown_fields_are_ignored() {
    let path = tmp("unknown.jsonl");
    std::fs::write(
        &path,
        concat!(
            "{\"meta\": {\"version\": 9, \"model\": \"m\", \"new_meta_field\": {\"a\": 1}}}\n",
            "{\"prompt_tokens\": 3, \"output_tokens\": 2, \"itl_ms\": [1.5], \"future\": [1, 2], ",
            "\"itl_ctx\": {\"num_running\": [4], \"kv_usage\": [0.5]}, \"spec\": null}\n",
        ),
    )
    .unwrap();
    let items: Vec<_> = TraceReader::open(&path)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let TraceItem::Meta(m) = &items[0] else {
        panic!("{:?}", items[0])
    };
    assert_eq!(
        m.schema_version(),
        9,
        "newer versions are read, not rejected"
    );
    let TraceItem::Record(r) = &items[1] else {
        panic!("{:?}", items[1])
    };
    assert_eq!((r.prompt_tokens, r.output_tokens), (3, 2));
    assert_eq!(r.itl_ctx.num_running, vec![4]);
}

#[test]
fn missing_file_names_the_path() {
    let path = tmp("does-not-exist.jsonl");
    let err = TraceReader::open(&path).err().unwrap();
    assert!(err.to_string().contains(&path.display().to_string()));
}

#[test]
fn hundred_thousand_records_stream() {
    let path = tmp("big.jsonl.gz");
    let mut w = TraceWriter::create(&path, &sample_meta()).unwrap();
    let mut rec = sample_records()[0].clone();
    rec.itl_ms = vec![10.0; 16];
    for i in 0..100_000u32 {
        rec.request_id = Some(format!("replay-{i}"));
        w.write_record(&rec).unwrap();
    }
    w.finish().unwrap();

    let mut n = 0u64;
    let mut gaps = 0usize;
    for r in TraceReader::open(&path).unwrap().records() {
        let r = r.unwrap();
        gaps += r.itl_ms.len();
        n += 1;
    }
    assert_eq!(n, 100_000);
    assert_eq!(gaps, 1_600_000);
}

/// A gzip file is read as gzip whatever its name, and damaged gzip data is reported as
/// damage (naming the file and the last good line), not as a JSON error.
#[test]
fn gzip_is_known_by_its_bytes_and_damage_is_reported_as_damage() {
    let gz = tmp("named-plain.jsonl.gz");
    let mut w = TraceWriter::create(&gz, &sample_meta()).unwrap();
    for i in 0..3000u32 {
        w.write_record(&TraceRecord {
            request_id: Some(format!("r{i}")),
            prompt_tokens: i,
            output_tokens: 3,
            itl_ms: vec![1.25, 2.5],
            ..Default::default()
        })
        .unwrap();
    }
    w.finish().unwrap();
    let renamed = tmp("renamed.jsonl");
    std::fs::copy(&gz, &renamed).unwrap();
    let items: Vec<_> = TraceReader::open(&renamed).unwrap().collect();
    assert_eq!(items.len(), 3001);
    assert!(
        items.iter().all(|i| i.is_ok()),
        "{:?}",
        items.iter().find(|i| i.is_err())
    );

    let mut bytes = std::fs::read(&gz).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x55;
    let damaged = tmp("damaged.jsonl.gz");
    std::fs::write(&damaged, &bytes).unwrap();
    let err = TraceReader::open(&damaged)
        .unwrap()
        .find_map(|i| i.err())
        .expect("damage must be an error");
    assert!(matches!(err, TraceError::Corrupt { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("corrupt gzip data") && msg.contains("damaged"),
        "{msg}"
    );
    assert!(!msg.contains("invalid trace line"), "{msg}");
}

/// A line longer than the cap is an error naming the line and the cap, and the reader
/// never holds the whole line.
#[test]
fn a_line_past_the_cap_is_refused_by_number() {
    let path = tmp("long-line.jsonl");
    let long = format!("{{\"request_id\": \"{}\"}}\n", "x".repeat(10_000));
    std::fs::write(
        &path,
        format!("{{\"prompt_tokens\": 1}}\n{long}{{\"prompt_tokens\": 2}}\n"),
    )
    .unwrap();
    let items: Vec<_> = TraceReader::open(&path)
        .unwrap()
        .with_max_line_bytes(4096)
        .collect();
    assert_eq!(items.len(), 2, "{items:?}");
    assert!(items[0].is_ok());
    let err = items[1].as_ref().unwrap_err();
    assert!(
        matches!(
            err,
            TraceError::LineTooLong {
                line: 2,
                cap: 4096,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("--max-line-bytes"), "{err}");
    // under the cap, the same file reads whole
    let all: Vec<_> = TraceReader::open(&path).unwrap().collect();
    assert!(all.len() == 3 && all.iter().all(|i| i.is_ok()));
}
