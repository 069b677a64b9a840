//! Replay at the wire: a trace's recorded token ids come back for the requests that match
//! them (by `replay-<i>` id or by prompt prefix), with the recorded finish reasons; misses
//! are counted and, under `--replay-miss fail`, finish with an error saying why.

use std::path::Path;

use crate::support::*;
use sim_protocol::{FinishReason, StopReason};
use sim_trace::trace::{BlockHash, TraceMeta, TraceRecord, TraceWriter};
use vllm_vcr::play::content::replay::MatchMode;
use vllm_vcr::play::engine::block_hash;

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

fn write_fixture(dir: &Path) -> std::path::PathBuf {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn index_ids_get_their_records_tokens_and_finish_reasons() {
    let tmp = TestDir::new("replay-index");
    let dir = tmp.root();
    let trace = write_fixture(dir);
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefixes_match_whole_prompts_and_misses_are_loud() {
    let tmp = TestDir::new("replay-prefix");
    let dir = tmp.root();
    let trace = write_fixture(dir);
    let mut a = args();
    a.replay_tokens = Some(trace);
    a.replay_match = MatchMode::Prefix;
    a.replay_miss = vllm_vcr::play::content::replay::MissPolicy::Fail;
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
}

#[test]
fn a_trace_of_another_configuration_is_refused_before_the_handshake() {
    let tmp = TestDir::new("replay-hash");
    let dir = tmp.root();
    let trace = write_fixture(dir);
    let mut a = args();
    a.replay_tokens = Some(trace);
    a.expect_config_hash = Some("ffff".into());
    let err = vllm_vcr::play::config::PlayConfig::try_from(&a).unwrap_err();
    let msg = format!("{err:#}");
    assert!(
        msg.contains("config_hash abc123") && msg.contains("ffff"),
        "{msg}"
    );
}

/// A latency model fitted under another configuration than the replayed capture is
/// called out when `play` starts (without `--expect-config-hash`, which would refuse it):
/// the capture's requests would be paced with another engine's step times.
#[test]
fn a_model_of_another_configuration_than_the_replayed_capture_is_called_out() {
    use std::io::{BufRead, BufReader};
    let tmp = TestDir::new("replay-other-config-model");
    let dir = tmp.root();
    let trace = write_fixture(dir);
    let capture = fixture("tests/fixtures/cpu-engine-capture");
    let port = vllm_vcr::child::free_ports(1).unwrap()[0];
    let mut child = vcr_command()
        .args([
            "play",
            "--handshake-address",
            &format!("tcp://127.0.0.1:{port}"),
        ])
        .arg("--replay-tokens")
        .arg(&trace)
        .arg("--latency-trace")
        .arg(capture.join("trace.jsonl.gz"))
        .arg("--latency-steps")
        .arg(capture.join("steps.jsonl.gz"))
        .env("NO_COLOR", "1")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut seen = Vec::new();
    let found = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.contains("fitted on another configuration") => break line,
            Ok(line) => seen.push(line),
            Err(_) => {
                let _ = child.kill();
                panic!("no warning in time:\n{}", seen.join("\n"));
            }
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        found.contains("WARN") && found.contains("abc123") && found.contains("727153f7"),
        "{found}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recorded_steps_replay_their_bursts_and_gaps_at_concurrency_16() {
    let tmp = TestDir::new("replay-steps");
    let dir = tmp.root();
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
    let disturbance = Disturbance::start();
    let mut wire = Wire::start(a).await;
    let ids: Vec<String> = (0..16).map(|i| format!("cmpl-replay-{i}-x")).collect();
    for id in &ids {
        wire.send(&add(id, &[9; 8], 100)).await;
    }
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let c = wire.collect(&refs).await;
    wire.stop().await.unwrap();
    let stalled_ms = disturbance.worst_ms();
    let mut worst: f64 = 0.0;
    let mut deviations = Vec::new();
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
        deviations.push((chunks[0].0 - planned).abs());
        for (k, gap) in gaps.iter().enumerate() {
            planned += gap / 1e3;
            deviations.push((chunks[k + 1].0 - planned).abs());
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
    // Every chunk at its scripted time, engine-stamped: the median within 1 ms (chunks on
    // a step grid would move it by half a step) and the worst within 5 ms, each plus the
    // longest stall the run suffered from the machine (a probe's overrun of a 1 ms sleep):
    // the loop's lateness is typically under 0.5 ms, and a busy 2-core machine stalls it
    // by as much as it stalls everything else (a median 14.7 ms off was seen at load 10).
    deviations.sort_by(f64::total_cmp);
    let median = deviations[deviations.len() / 2];
    for d in &deviations {
        worst = worst.max(*d);
    }
    assert!(
        median * 1e3 < 1.0 + stalled_ms,
        "median deviation {:.3} ms, allowed 1 ms + the run's longest stall {stalled_ms:.3} ms",
        median * 1e3
    );
    assert!(
        worst * 1e3 < 5.0 + stalled_ms,
        "worst deviation {:.3} ms, allowed 5 ms + the run's longest stall {stalled_ms:.3} ms",
        worst * 1e3
    );
}

/// Hostile replay inputs are refused before the handshake, each naming what is wrong: a
/// recorded gap of 1e300 ms (it used to panic the engine at that request: ENGINE_CORE_DEAD,
/// then 500 for everyone), token ids the frontend's tokenizer does not have (they were
/// served as ""), a block size of 0 under prefix matching (every lookup missed), and a
/// replay summary written over the trace it counts.
#[test]
fn hostile_replay_traces_are_refused_at_load() {
    let tmp = TestDir::new("replay-hostile");
    let dir = tmp.root();
    let try_load = |f: &dyn Fn(&mut vllm_vcr::play::PlayArgs)| -> String {
        let mut a = args();
        f(&mut a);
        match vllm_vcr::play::config::PlayConfig::try_from(&a) {
            Ok(_) => "accepted".to_string(),
            Err(e) => format!("{e:#}"),
        }
    };
    let write = |name: &str, meta: TraceMeta, recs: &[TraceRecord]| {
        let path = dir.join(name);
        let mut w = TraceWriter::create(&path, &meta).unwrap();
        for r in recs {
            w.write_record(r).unwrap();
        }
        w.finish().unwrap();
        path
    };
    let rec = |id: &str, ids: Vec<u32>, itl: f64| TraceRecord {
        request_id: Some(id.to_string()),
        prompt_tokens: 8,
        output_tokens: ids.len() as u32,
        arrival_ms: Some(0.0),
        ttft_ms: Some(5.0),
        itl_ms: vec![itl; ids.len() - 1],
        output_token_ids: Some(ids),
        finish_reason: Some("length".into()),
        ..Default::default()
    };

    // H4: a gap no engine takes
    let huge = write(
        "huge.jsonl",
        TraceMeta::new(),
        &[
            rec("ok", vec![40, 41], 1.0),
            rec("bad", vec![40, 41, 42], 1e300),
        ],
    );
    let e = try_load(&|a| {
        a.replay_tokens = Some(huge.clone());
        a.replay_steps = Some(huge.clone());
    });
    assert!(
        e.contains("huge.jsonl:3") && e.contains("`bad`") && e.contains("itl_ms[0] = 1e300"),
        "{e}"
    );

    // M5: ids past the vocabulary (the embedded tokenizer has 259)
    let oov = write(
        "oov.jsonl",
        TraceMeta::new(),
        &[rec("r0", vec![40, 999_999, 4_294_967_295], 1.0)],
    );
    let e = try_load(&|a| a.replay_tokens = Some(oov.clone()));
    assert!(
        e.contains("oov.jsonl:2")
            && e.contains("output token id 999999")
            && e.contains("outside the vocabulary"),
        "{e}"
    );

    // L4: block size 0 cannot hash a prompt
    let zero = write(
        "zero.jsonl",
        TraceMeta {
            block_size: Some(0),
            ..TraceMeta::new()
        },
        &[rec("r0", vec![40, 41], 1.0)],
    );
    let e = try_load(&|a| {
        a.replay_tokens = Some(zero.clone());
        a.replay_match = MatchMode::Prefix;
    });
    assert!(e.contains("block_size is 0"), "{e}");

    // H5: the summary may not be written over the trace (by another name either)
    let good = write_fixture(dir);
    let alias = dir.join(".").join("trace.jsonl.gz");
    let e = try_load(&|a| {
        a.replay_tokens = Some(good.clone());
        a.replay_summary = Some(alias.clone());
    });
    assert!(
        e.contains("--replay-summary") && e.contains("is the same file as --replay-tokens"),
        "{e}"
    );
}

/// `--replay-tokens A --replay-steps B` of two captures were paired record by record
/// without a word; they are refused (naming every difference) unless
/// `--replay-allow-mismatch` asks for it.
#[test]
fn tokens_and_steps_of_different_captures_are_not_paired_silently() {
    let tmp = TestDir::new("replay-pairing");
    let dir = tmp.root();
    let write = |name: &str, hash: &str, ids: &[&str]| {
        let path = dir.join(name);
        let meta = TraceMeta {
            block_size: Some(BLOCK as u32),
            config_hash: Some(hash.into()),
            ..TraceMeta::new()
        };
        let mut w = TraceWriter::create(&path, &meta).unwrap();
        for (i, id) in ids.iter().enumerate() {
            w.write_record(&TraceRecord {
                request_id: Some(id.to_string()),
                prompt_tokens: 8,
                output_tokens: 2,
                arrival_ms: Some(i as f64),
                ttft_ms: Some(5.0),
                itl_ms: vec![1.0],
                output_token_ids: Some(vec![40, 41]),
                finish_reason: Some("length".into()),
                ..Default::default()
            })
            .unwrap();
        }
        w.finish().unwrap();
        path
    };
    let a = write("a.jsonl", "e32b", &["a0", "a1", "a2"]);
    let b = write("b.jsonl", "7271", &["b0", "b1"]);
    let same_a = write("a-steps.jsonl", "e32b", &["a0", "a1", "a2"]);
    let load = |tokens: &Path, steps: &Path, allow: bool| {
        let mut args = args();
        args.replay_tokens = Some(tokens.to_path_buf());
        args.replay_steps = Some(steps.to_path_buf());
        args.replay_allow_mismatch = allow;
        vllm_vcr::play::config::PlayConfig::try_from(&args).map(|_| ())
    };
    let e = format!("{:#}", load(&a, &b, false).unwrap_err());
    assert!(
        e.contains("are not one capture")
            && e.contains("config_hash e32b vs 7271")
            && e.contains("3 vs 2 records")
            && e.contains("record 0 is request `a0` in one and `b0` in the other")
            && e.contains("--replay-allow-mismatch"),
        "{e}"
    );
    load(&a, &b, true).unwrap();
    // two files of one capture pair as before
    load(&a, &same_a, false).unwrap();
}

/// Generated text on a recorded timeline (`--replay-steps`) thinks for each record's
/// `reasoning_tokens`: 30 between the tags (the embedded model's one token a byte), none
/// for a record of 0, and `--reasoning-share` of the answer for a record without a count
/// (a quarter of the 100 asked for: a block of 25, 8 of them between the tags).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recorded_thinking_lengths_shape_generated_answers() {
    use vllm_vcr::play::TokenMode;
    use vllm_vcr::play::content::reasoning::ReasoningFormat;
    let tmp = TestDir::new("replay-thinking");
    let path = tmp.root().join("thinking.jsonl");
    let mut w = TraceWriter::create(&path, &TraceMeta::new()).unwrap();
    for (i, thinking) in [Some(30), Some(0), None].into_iter().enumerate() {
        w.write_record(&TraceRecord {
            request_id: Some(format!("r{i}")),
            prompt_tokens: 8,
            output_tokens: 80,
            arrival_ms: Some(i as f64),
            ttft_ms: Some(1.0),
            itl_ms: vec![0.1; 79],
            reasoning_tokens: thinking,
            finish_reason: Some("length".into()),
            ..Default::default()
        })
        .unwrap();
    }
    w.finish().unwrap();
    let mut a = args();
    a.replay_steps = Some(path);
    a.tokens = Some(TokenMode::Text);
    a.reasoning_format = Some(ReasoningFormat::Qwen3);
    a.reasoning_share = 0.25;
    let mut wire = Wire::start(a).await;
    let ids = ["cmpl-replay-0-x", "cmpl-replay-1-x", "cmpl-replay-2-x"];
    for id in ids {
        wire.send(&add(id, &[9; 8], 100)).await;
    }
    let c = wire.collect(&ids).await;
    wire.stop().await.unwrap();
    let vocab = vllm_vcr::play::content::vocab::Vocabulary::embedded();
    let thinking = |id: &str| -> Option<usize> {
        let text = vocab.decode(&c.tokens[id]);
        assert_eq!(c.tokens[id].len(), 80, "{id}: {text}");
        let body = text.strip_prefix("<think>")?;
        Some(body.split_once("</think>").expect(&text).0.len())
    };
    assert_eq!(thinking(ids[0]), Some(30));
    assert_eq!(thinking(ids[1]), None);
    assert_eq!(thinking(ids[2]), Some(8));
}
