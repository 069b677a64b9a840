//! Replay at the wire: a trace's recorded token ids come back for the requests that match
//! them (by `replay-<i>` id or by prompt prefix), with the recorded finish reasons; misses
//! are counted and, under `--replay-miss fail`, finish with an error saying why.

mod support;

use std::path::Path;

use sim_protocol::{FinishReason, StopReason};
use sim_trace::trace::{BlockHash, TraceMeta, TraceRecord, TraceWriter};
use support::*;
use vllm_vcr::play::block_hash;
use vllm_vcr::play::replay::MatchMode;

const BLOCK: usize = 4;

fn hashes(prompt: &[u32]) -> Vec<BlockHash> {
    let none = block_hash::default_none_hash();
    block_hash::chain(&none, prompt, BLOCK, None, None)
        .iter()
        .map(|h| BlockHash::Int(block_hash::hash_u64(h)))
        .collect()
}

/// (request id, prompt, recorded output, finish reason, arrival ms)
type Rec<'a> = (&'a str, Vec<u32>, Vec<u32>, &'a str, f64);

/// Records written in finish order (the reverse of arrival): the index orders them.
fn write_trace(path: &Path, recs: &[Rec]) {
    let meta = TraceMeta {
        block_size: Some(BLOCK as u32),
        config_hash: Some("abc123".into()),
        ..TraceMeta::new()
    };
    let mut w = TraceWriter::create(path, &meta).unwrap();
    for (id, prompt, out, finish, arrival) in recs.iter().rev() {
        w.write_record(&TraceRecord {
            request_id: Some(id.to_string()),
            prompt_tokens: prompt.len() as u32,
            output_tokens: out.len() as u32,
            arrival_ms: Some(*arrival),
            ttft_ms: Some(5.0),
            itl_ms: vec![1.0; out.len().saturating_sub(1)],
            block_hashes: hashes(prompt),
            output_token_ids: Some(out.clone()),
            finish_reason: Some(finish.to_string()),
            ..Default::default()
        })
        .unwrap();
    }
    w.finish().unwrap();
}

fn fixture(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("trace.jsonl.gz");
    write_trace(
        &path,
        &[
            // stop by EOS (2), by a stop token id (0), by length, and an aborted record
            ("a", vec![10, 11, 12, 13, 14], vec![40, 41, 2], "stop", 0.0),
            (
                "b",
                vec![10, 11, 12, 13, 20, 21, 22, 23],
                vec![50, 51, 0],
                "stop",
                1.0,
            ),
            (
                "c",
                vec![30, 31, 32, 33, 34, 35],
                vec![60, 61, 62, 63],
                "length",
                2.0,
            ),
            ("d", vec![30, 31, 32, 33, 36], vec![70, 71], "abort", 3.0),
        ],
    );
    path
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("vllm-vcr-replay-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn index_ids_get_their_records_tokens_and_finish_reasons() {
    let dir = tmp("index");
    let trace = fixture(&dir);
    let mut a = args();
    a.replay_tokens = Some(trace.clone());
    a.replay_summary = Some(dir.join("summary.json"));
    a.expect_config_hash = Some("ABC123".into());
    let mut w = Wire::start(a).await;
    // frontends wrap the client's id: prefix and random suffix
    w.send(&add("cmpl-replay-0-1f2e3d4c", &[1, 2, 3], 50)).await;
    w.send(&add("cmpl-replay-1-00000007", &[1, 2, 3], 50)).await;
    w.send(&add("chatcmpl-replay-2-9a", &[1, 2, 3], 50)).await;
    w.send(&add("cmpl-replay-3-aa", &[1, 2, 3], 50)).await;
    // the client asks for fewer tokens than were recorded: its own limit wins
    w.send(&add("cmpl-replay-2-bb", &[1, 2, 3], 2)).await;
    let ids = [
        "cmpl-replay-0-1f2e3d4c",
        "cmpl-replay-1-00000007",
        "chatcmpl-replay-2-9a",
        "cmpl-replay-3-aa",
        "cmpl-replay-2-bb",
    ];
    let c = w.collect(&ids).await;
    assert_eq!(c.tokens[ids[0]], vec![40, 41, 2]);
    assert_eq!(c.finished[ids[0]], (FinishReason::Stop, None));
    assert_eq!(c.tokens[ids[1]], vec![50, 51, 0]);
    assert_eq!(
        c.finished[ids[1]],
        (FinishReason::Stop, Some(StopReason::Token(0)))
    );
    assert_eq!(c.tokens[ids[2]], vec![60, 61, 62, 63]);
    assert_eq!(c.finished[ids[2]], (FinishReason::Length, None));
    assert_eq!(c.tokens[ids[3]], vec![70, 71]);
    assert_eq!(c.finished[ids[3]], (FinishReason::Abort, None));
    assert_eq!(c.tokens[ids[4]], vec![60, 61]);
    assert_eq!(c.finished[ids[4]], (FinishReason::Length, None));
    w.stop().await.unwrap();
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["tokens"]["served"], 5, "{summary}");
    assert_eq!(summary["tokens"]["reserved"], 1, "{summary}");
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefixes_match_whole_prompts_and_misses_are_loud() {
    let dir = tmp("prefix");
    let trace = fixture(&dir);
    let mut a = args();
    a.replay_tokens = Some(trace);
    a.replay_match = MatchMode::Prefix;
    a.replay_miss = vllm_vcr::play::replay::MissPolicy::Fail;
    a.replay_summary = Some(dir.join("summary.json"));
    let mut w = Wire::start(a).await;
    // b's prompt, the client's own id
    w.send(&add("mine-1", &[10, 11, 12, 13, 20, 21, 22, 23], 50))
        .await;
    // c's first block and a different second one: diverges after 1 of 2 blocks
    w.send(&add("mine-2", &[30, 31, 32, 33, 99, 99, 99, 99], 50))
        .await;
    // shorter than a block
    w.send(&add("mine-3", &[30, 31], 50)).await;
    // c's prompt (6 tokens: one full block + a tail) and d's (5 tokens): same block, the
    // prompt length picks the record
    w.send(&add("mine-4", &[30, 31, 32, 33, 36], 50)).await;
    w.send(&add("mine-5", &[30, 31, 32, 33, 34, 35], 50)).await;
    let c = w
        .collect(&["mine-1", "mine-2", "mine-3", "mine-4", "mine-5"])
        .await;
    assert_eq!(c.tokens["mine-1"], vec![50, 51, 0]);
    assert_eq!(c.tokens["mine-4"], vec![70, 71]);
    assert_eq!(c.tokens["mine-5"], vec![60, 61, 62, 63]);
    for id in ["mine-2", "mine-3"] {
        assert_eq!(c.finished[id].0, FinishReason::Error, "{id}");
    }
    let errors: Vec<String> = c
        .envelopes
        .iter()
        .flat_map(|e| &e.outputs)
        .filter_map(|o| {
            o.error
                .as_ref()
                .map(|e| format!("{}: {}", e.code, e.message))
        })
        .collect();
    assert!(
        errors.iter().any(
            |e| e.starts_with("validation_error: replay_miss: no recorded output")
                && e.contains("1 of 2 blocks")
        ),
        "{errors:?}"
    );
    assert!(
        errors.iter().any(|e| e.contains("shorter than one block")),
        "{errors:?}"
    );
    w.stop().await.unwrap();
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["tokens"]["served"], 3, "{summary}");
    assert_eq!(
        summary["tokens"]["missed"]["partial_prefix"], 1,
        "{summary}"
    );
    assert_eq!(summary["tokens"]["missed"]["short_prompt"], 1, "{summary}");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn a_trace_of_another_configuration_is_refused_before_the_handshake() {
    let dir = tmp("hash");
    let trace = fixture(&dir);
    let mut a = args();
    a.replay_tokens = Some(trace);
    a.expect_config_hash = Some("ffff".into());
    let err = vllm_vcr::play::config::PlayConfig::try_from(&a).unwrap_err();
    let msg = format!("{err:#}");
    assert!(
        msg.contains("config_hash abc123") && msg.contains("ffff"),
        "{msg}"
    );
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recorded_steps_replay_their_bursts_and_gaps_at_concurrency_16() {
    let dir = tmp("steps");
    let path = dir.join("steps.jsonl");
    let meta = TraceMeta {
        block_size: Some(BLOCK as u32),
        ..TraceMeta::new()
    };
    let mut w = TraceWriter::create(&path, &meta).unwrap();
    let mut recorded = Vec::new();
    for i in 0..16u32 {
        // 1 + 3 + 1 + 4 + 2 tokens: a speculative capture with K = 3
        let gaps: Vec<f64> = (0..4).map(|j| 4.0 + f64::from((i + j) % 5) * 1.5).collect();
        let sizes = vec![3, 1, 4, 2];
        recorded.push((20.0 + f64::from(i), gaps.clone(), sizes.clone()));
        w.write_record(&TraceRecord {
            request_id: Some(format!("r{i}")),
            prompt_tokens: 8,
            output_tokens: 11,
            arrival_ms: Some(f64::from(i)),
            ttft_ms: Some(20.0 + f64::from(i)),
            itl_ms: gaps,
            itl_tokens: sizes,
            finish_reason: Some("length".into()),
            ..Default::default()
        })
        .unwrap();
    }
    w.finish().unwrap();
    let mut a = args();
    a.replay_steps = Some(path);
    let mut wire = Wire::start(a).await;
    let ids: Vec<String> = (0..16).map(|i| format!("cmpl-replay-{i}-x")).collect();
    for id in &ids {
        wire.send(&add(id, &[9; 8], 100)).await;
    }
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let c = wire.collect(&refs).await;
    wire.stop().await.unwrap();
    let mut worst: f64 = 0.0;
    for (i, id) in ids.iter().enumerate() {
        let mut queued = None;
        let mut chunks: Vec<(f64, usize)> = Vec::new();
        for env in &c.envelopes {
            for o in env.outputs.iter().filter(|o| &o.request_id == id) {
                if let Some(q) = o
                    .events
                    .iter()
                    .find(|e| e.kind == sim_protocol::EventType::Queued)
                {
                    queued = Some(q.timestamp);
                }
                if !o.new_token_ids.is_empty() {
                    chunks.push((env.timestamp, o.new_token_ids.len()));
                }
            }
        }
        let (ttft, gaps, sizes) = &recorded[i];
        let got: Vec<usize> = chunks.iter().map(|c| c.1).collect();
        let want: Vec<usize> = std::iter::once(1)
            .chain(sizes.iter().map(|&n| n as usize))
            .collect();
        assert_eq!(got, want, "{id}: chunk sizes");
        assert_eq!(c.finished[id.as_str()].0, FinishReason::Length);
        // engine-stamped times against the script: TTFT from arrival, then each gap
        let q = queued.expect("a QUEUED event");
        let mut planned = q + ttft / 1e3;
        worst = worst.max((chunks[0].0 - planned).abs());
        for (k, gap) in gaps.iter().enumerate() {
            planned += gap / 1e3;
            worst = worst.max((chunks[k + 1].0 - planned).abs());
        }
    }
    // spec-decode stats re-derived from the bursts: K = 4 − 1, a burst of N = 1 + N−1
    let (mut drafts, mut accepted, mut k) = (0, 0, 0);
    for s in c
        .envelopes
        .iter()
        .filter_map(|e| e.scheduler_stats.as_ref())
    {
        if let Some(sd) = &s.spec_decoding_stats {
            drafts += sd.num_drafts;
            accepted += sd.num_accepted_tokens;
            k = sd.num_spec_tokens;
        }
    }
    assert_eq!((k, drafts, accepted), (3, 16 * 4, 16 * (2 + 3 + 1)));
    // every chunk within 5 ms of its scripted time: the loop's lateness on a busy machine
    // (typically under 0.5 ms; 3.7 ms seen once with the whole test suite running in
    // parallel on 2 cores)
    assert!(worst < 0.005, "worst deviation {:.3} ms", worst * 1e3);
    std::fs::remove_dir_all(dir).ok();
}
