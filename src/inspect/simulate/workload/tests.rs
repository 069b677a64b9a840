//! Workload tests: synthesized prompts, turns of a conversation, a closed loop's
//! turnaround and ramp, prefix caching read from a capture.

use std::collections::HashMap;

use super::*;

fn workload(records: &[(f64, u32, &[u64], Option<f64>)], bs: usize) -> Workload {
    let mut hashes = Vec::new();
    let reqs = records
        .iter()
        .map(|(a, p, h, e2e)| {
            let start = hashes.len() as u32;
            hashes.extend_from_slice(h);
            Planned {
                arrival_ms: Some(*a),
                sent_ms: None,
                prompt_tokens: *p,
                output_tokens: 4,
                e2e_ms: *e2e,
                ttft_ms: None,
                concurrency: None,
                source: 0,
                hashes: (start, h.len() as u32),
            }
        })
        .collect();
    Workload {
        meta: TraceMeta::default(),
        trace_block_size: bs,
        reqs,
        hashes,
        records_in_trace: records.len() as u64,
        without_arrival: 0,
        cached_tokens: None,
        stream: None,
    }
}

#[test]
fn shared_hashes_give_shared_blocks_and_the_rest_is_unique() {
    let w = workload(
        &[
            (0.0, 10, &[7, 8], None),
            (1.0, 9, &[7, 9], None),
            (2.0, 10, &[7, 8], None),
        ],
        4,
    );
    let p: Vec<Vec<u32>> = (0..3).map(|i| w.prompt(i, 3..259, false)).collect();
    assert_eq!(p[0].len(), 10);
    assert_eq!(p[0][..4], p[1][..4], "hash 7 is one block");
    assert_ne!(p[0][4..8], p[1][4..8], "hashes 8 and 9 differ");
    assert_eq!(p[0][..8], p[2][..8], "the same chain");
    assert_ne!(
        p[0][8..],
        p[2][8..],
        "the partial tail is the request's own"
    );
    assert!(p.iter().flatten().all(|t| (3..259).contains(t)));
    let cold: Vec<Vec<u32>> = (0..3).map(|i| w.prompt(i, 3..259, true)).collect();
    assert_ne!(cold[0][..4], cold[1][..4]);
    assert_ne!(cold[0][..4], cold[2][..4]);
    assert_eq!(w.prompt(1, 3..259, false), p[1], "deterministic");
}

#[test]
fn synthesized_ids_stay_in_the_vocabulary_range() {
    // four ids a draw (with a tail of 1–3), and one a draw past 2^16 ids
    for n in [1, 3, 4, 7, 512] {
        let mut out = Vec::new();
        fill_block(&mut out, SplitMix64(n as u64), 3, 256, n);
        assert_eq!(out.len(), n);
        assert!(out.iter().all(|t| (3..259).contains(t)));
        let mut wide = Vec::new();
        fill_block(&mut wide, SplitMix64(n as u64), 3, 150_000, n);
        assert!(wide.iter().all(|t| (3..150_003).contains(t)));
    }
    let mut out = Vec::new();
    fill_block(&mut out, SplitMix64(1), 0, 4, 4096);
    assert!(
        (0..4).all(|id| out.contains(&id)),
        "every id of the range is drawn"
    );
}

#[test]
fn a_turn_continues_the_longest_chain_whose_prompt_and_answer_it_holds() {
    // block size 4, 4 output tokens each: a record's chain is the hashes of its complete
    // blocks, and a turn's prompt holds its parent's prompt and 4 more tokens at least
    let w = workload(
        &[
            (0.0, 8, &[1, 2], Some(100.0)),         // 0: chain [1,2]
            (50.0, 8, &[1, 3], Some(10.0)),         // 1: shares block 1 only: a root
            (300.0, 14, &[1, 2, 4, 5], Some(40.0)), // 2: chain [1,2,4] (5 is partial)
            (400.0, 22, &[1, 2, 4, 6, 7], None),    // 3: extends 2's chain (and 0's)
            (600.0, 3, &[], None),                  // 4: no hashes
            (700.0, 8, &[1, 2], None),              // 5: 0's prompt again
        ],
        4,
    );
    let t = w.sessions();
    let ms = |x: f64| Duration::from_secs_f64(x / 1000.0);
    assert_eq!(t[0], Turn::Root);
    assert_eq!(t[1], Turn::Root);
    // 300 − (0 + 100)
    let gap = ms(200.0);
    assert_eq!(t[2], Turn::After { parent: 0, gap });
    // [1,2,4] (request 2) beats [1,2] (request 0); 400 − (300 + 40)
    let gap = ms(60.0);
    assert_eq!(t[3], Turn::After { parent: 2, gap });
    assert_eq!(t[4], Turn::Root);
    // the same 8 tokens cannot hold 0's prompt and answer: a new conversation
    assert_eq!(t[5], Turn::Root);
    let c = Children::of(&t);
    assert_eq!(c.of_request(0).collect::<Vec<_>>(), vec![2]);
    assert_eq!(c.of_request(2).collect::<Vec<_>>(), vec![3]);
    assert_eq!(c.of_request(1).count(), 0);
    assert_eq!(Workload::turn_numbers(&t), vec![1, 1, 2, 3, 1, 1]);
    let g = Sessions::of(&t);
    assert_eq!(g.roots, vec![0, 1, 4, 5]);
    assert_eq!(g.root_of, vec![0, 1, 0, 0, 4, 5]);
    assert_eq!((g.size[0], g.size[1], g.size[4], g.size[2]), (3, 1, 1, 0));
    // session 0 spans 0..340 (3 untimed), session 1 50..60: two at once
    assert_eq!(g.captured_concurrency(&w), Some(2));
}

#[test]
fn conversations_that_open_alike_each_keep_their_own_turns() {
    // a shared system prompt [1,2]; A and B open with the same first message (chain
    // [1,2,3]), C with another; then a round of second turns, and of third ones
    let w = workload(
        &[
            (0.0, 13, &[1, 2, 3], Some(10.0)),                  // 0: A0
            (1.0, 13, &[1, 2, 3], Some(10.0)),                  // 1: B0
            (2.0, 13, &[1, 2, 9], Some(10.0)),                  // 2: C0
            (30.0, 21, &[1, 2, 3, 10, 11], Some(10.0)),         // 3: A1
            (31.0, 21, &[1, 2, 3, 20, 21], Some(10.0)),         // 4: B1
            (32.0, 21, &[1, 2, 9, 30, 31], Some(10.0)),         // 5: C1
            (60.0, 29, &[1, 2, 3, 10, 11, 12, 13], Some(10.0)), // 6: A2
            (61.0, 29, &[1, 2, 3, 20, 21, 22, 23], Some(10.0)), // 7: B2
        ],
        4,
    );
    let t = w.sessions();
    let parents: Vec<Option<u32>> = t
        .iter()
        .map(|t| match *t {
            Turn::Root => None,
            Turn::After { parent, .. } | Turn::NotBefore { parent } => Some(parent),
        })
        .collect();
    let want = [
        None,
        None,
        None,
        Some(0),
        Some(1),
        Some(2),
        Some(3),
        Some(4),
    ];
    assert_eq!(parents, want);
    // B1 arrived 31 − (1 + 10) after B0's answer
    let gap = Duration::from_millis(20);
    assert_eq!(t[4], Turn::After { parent: 1, gap });
    assert_eq!(Workload::turn_numbers(&t), vec![1, 1, 1, 2, 2, 2, 3, 3]);
    let g = Sessions::of(&t);
    assert_eq!(g.roots, vec![0, 1, 2]);
    assert_eq!((g.size[0], g.size[1], g.size[2]), (3, 3, 2));
    // A spans 0..70, B 1..71, C 2..42
    assert_eq!(g.captured_concurrency(&w), Some(3));
}

#[test]
fn a_prompt_that_shares_only_the_system_prompt_is_a_new_conversation() {
    // D opens with the system prompt [1,2] and one token more
    let mut w = workload(
        &[
            (0.0, 9, &[1, 2], Some(10.0)),         // 0: D0, ends at 10
            (5.0, 13, &[1, 2, 7], Some(10.0)),     // 1: while D0 runs: a root
            (20.0, 12, &[1, 2, 8], Some(10.0)),    // 2: too short for D0 + answer: a root
            (30.0, 17, &[1, 2, 5, 6], Some(10.0)), // 3: D1
            (50.0, 6, &[4], Some(10.0)),           // 4: one block and 2 tokens
            (70.0, 7, &[4], None),                 // 5: no new block, yet 4's next turn
        ],
        4,
    );
    w.reqs[4].output_tokens = 1;
    let t = w.sessions();
    assert_eq!(t[1], Turn::Root);
    assert_eq!(t[2], Turn::Root);
    let gap = Duration::from_millis(20);
    assert_eq!(t[3], Turn::After { parent: 0, gap });
    assert!(matches!(t[5], Turn::After { parent: 4, .. }));
    assert_eq!(Workload::turn_numbers(&t), vec![1, 1, 1, 2, 1, 2]);
}

#[test]
fn a_second_answer_to_the_same_question_continues_the_same_turn() {
    let w = workload(
        &[
            (0.0, 8, &[1, 2], Some(10.0)),      // 0
            (20.0, 13, &[1, 2, 3], Some(10.0)), // 1: its next turn
            (40.0, 13, &[1, 2, 3], Some(10.0)), // 2: the same question asked again
            (60.0, 9, &[1, 2], None),           // 3: untimed 0 again: a root
        ],
        4,
    );
    let t = w.sessions();
    assert!(matches!(t[1], Turn::After { parent: 0, .. }));
    // 2 cannot hold 1 and its answer: it is 0's, whose turn 1 already is
    assert!(matches!(t[2], Turn::After { parent: 0, .. }));
    assert_eq!(t[3], Turn::Root);
    assert_eq!(Workload::turn_numbers(&t), vec![1, 2, 2, 1]);
    assert_eq!(Sessions::of(&t).roots, vec![0, 3]);
}

#[test]
fn a_closed_loops_turnaround_is_the_median_gap_from_a_finish_to_the_next_send_plus_intake() {
    // two in flight, each 10 ms long; the engine queued each send 1 ms after it
    let records: Vec<(f64, u32, &[u64], Option<f64>)> = [0.0, 0.0, 13.0, 14.0, 28.0, 29.0]
        .iter()
        .map(|&a| (a, 8, &[][..], Some(10.0)))
        .collect();
    let mut w = workload(&records, 4);
    assert_eq!(
        w.turnaround_ms(&w.loop_units(None), 2),
        None,
        "no sends recorded"
    );
    for p in &mut w.reqs {
        p.sent_ms = p.arrival_ms.map(|a| a - 1.0);
    }
    // the first two found an idle engine
    assert_eq!(w.intake_ms(), Some(1.0));
    // sends at 12, 13, 27, 28 after ends at 10, 10, 24, 24: gaps 2, 3, 3, 4
    assert_eq!(w.turnaround_ms(&w.loop_units(None), 2), Some(3.0 + 1.0));
}

#[test]
fn a_closed_loop_over_sessions_counts_sessions_and_ends_each_with_its_last_turn() {
    // A: 0 (0–10) and its turn 2 (20–30); B: 1 (1–6); C: 3, sent at 31, queued at 32
    let records: Vec<(f64, u32, &[u64], Option<f64>)> = vec![
        (0.0, 8, &[][..], Some(10.0)),
        (1.0, 8, &[][..], Some(5.0)),
        (20.0, 8, &[][..], Some(10.0)),
        (32.0, 8, &[][..], Some(5.0)),
    ];
    let mut w = workload(&records, 4);
    w.reqs[3].sent_ms = Some(31.0);
    let gap = Duration::from_millis(10);
    let turns = [
        Turn::Root,
        Turn::Root,
        Turn::After { parent: 0, gap },
        Turn::Root,
    ];
    let sessions = Sessions::of(&turns);
    let units = w.loop_units(Some(&sessions));
    let ends: Vec<_> = units.iter().map(|u| u.end_ms).collect();
    assert_eq!(ends, vec![Some(30.0), Some(6.0), Some(37.0)]);
    assert_eq!(
        units[2].sent_ms,
        Some(31.0),
        "a session is sent as its root"
    );
    // B's arrival found A under way: two sessions in flight from the second on
    assert_eq!(ramp(&units, 2), 2);
    // C was sent 1 ms after A's last turn ended, and queued 1 ms after that
    assert_eq!(w.turnaround_ms(&units, 2), Some(1.0 + 1.0));
    assert_eq!(
        w.turnarounds_ms(&units),
        vec![None, None, Some(1.0 + 1.0)],
        "each session its own, from the latest session end before its root's send"
    );
    // over requests, C was sent 1 ms after request 2 (A's last turn) ended, too
    let requests = w.loop_units(None);
    assert_eq!(requests.len(), 4);
    assert_eq!(w.turnaround_ms(&requests, 2), Some(1.0 + 1.0));
    // a session with a request that has no recorded end stays in flight
    w.reqs[2].e2e_ms = None;
    assert_eq!(w.loop_units(Some(&sessions))[0].end_ms, None);
}

/// A closed loop of two: thirteen pairs of requests, each pair finishing together and its
/// successors sent 2 ms after that finish and `spacing` ms apart (the engine queues each
/// send 1 ms after it).
fn pairs_sent(spacing: f64) -> Workload {
    let mut arrivals = Vec::new();
    let mut at = 0.0;
    for _ in 0..13 {
        arrivals.extend([at, at + spacing]);
        // both finish at `at + spacing + 10`; the next pair arrives 2 + 1 ms later
        at += spacing + 13.0;
    }
    let records: Vec<(f64, u32, &[u64], Option<f64>)> = arrivals
        .iter()
        .enumerate()
        .map(|(i, &a)| {
            let e2e = if i % 2 == 0 { 10.0 + spacing } else { 10.0 };
            (a, 8, &[][..], Some(e2e))
        })
        .collect();
    let mut w = workload(&records, 4);
    for p in &mut w.reqs {
        p.sent_ms = p.arrival_ms.map(|a| a - 1.0);
    }
    w
}

#[test]
fn a_client_that_sends_one_answer_at_a_time_is_told_by_the_spacing_of_its_sends() {
    assert_eq!(
        client_spacing_ms(&pairs_sent(0.5).loop_units(None)),
        Some(0.5)
    );
    assert_eq!(
        client_spacing_ms(&pairs_sent(0.0).loop_units(None)),
        Some(0.0),
        "a load generator refills every freed slot at once"
    );
    let mut few = pairs_sent(0.5);
    few.reqs.truncate(12);
    assert_eq!(
        client_spacing_ms(&few.loop_units(None)),
        None,
        "five pairs say nothing"
    );
}

#[test]
fn each_requests_own_turnaround_is_its_send_after_the_latest_finish_plus_intake() {
    let w = pairs_sent(0.5);
    let own = w.turnarounds_ms(&w.loop_units(None));
    assert_eq!(own[0], None, "sent before any finish");
    // the engine queued each send 1 ms after it; sends 2 and 2.5 ms after the finish
    assert_eq!(own[2], Some(2.0 + 1.0));
    assert_eq!(own[3], Some(2.5 + 1.0));
}

#[test]
fn a_ramp_request_queued_as_an_earlier_ones_first_token_came_out_arrives_just_after_it() {
    // a burst sent at once, which the engine took in two steps
    let records: Vec<(f64, u32, &[u64], Option<f64>)> = [5.0, 5.0, 40.0]
        .iter()
        .map(|&a| (a, 8, &[][..], Some(100.0)))
        .collect();
    let mut w = workload(&records, 4);
    for (p, t) in w.reqs.iter_mut().zip([1.0, 1.5, 2.0]) {
        p.ttft_ms = Some(35.0);
        p.sent_ms = Some(t);
    }
    assert_eq!(
        ramp_sends(&w.loop_units(None), 3),
        vec![Some(5.0), Some(5.0), Some(5.01)]
    );
}

#[test]
fn a_capture_without_cache_hits_despite_shared_blocks_had_no_prefix_caching() {
    let shared: Vec<(f64, u32, &[u64], Option<f64>)> = (0..6)
        .map(|i| (f64::from(i), 8, &[1u64, 2][..], Some(1.0)))
        .collect();
    let mut w = workload(&shared, 4);
    assert_eq!(w.sharing_requests(), 5);
    assert!(
        !w.captured_without_prefix_caching(),
        "no cached_tokens field"
    );
    w.cached_tokens = Some(0);
    assert!(w.captured_without_prefix_caching());
    w.cached_tokens = Some(640);
    assert!(
        !w.captured_without_prefix_caching(),
        "the cache served some"
    );
    let firsts = [[1u64], [2], [3], [4], [5], [6]];
    let distinct: Vec<(f64, u32, &[u64], Option<f64>)> = firsts
        .iter()
        .enumerate()
        .map(|(i, h)| (i as f64, 8, &h[..], Some(1.0)))
        .collect();
    let mut w = workload(&distinct, 4);
    w.cached_tokens = Some(0);
    assert!(!w.captured_without_prefix_caching(), "nothing to share");
    // prompts of exactly one shared block: vLLM computes the last token, no hit
    let whole: Vec<(f64, u32, &[u64], Option<f64>)> = (0..6)
        .map(|i| (f64::from(i), 4, &[1u64][..], Some(1.0)))
        .collect();
    let mut w = workload(&whole, 4);
    w.cached_tokens = Some(0);
    assert_eq!(w.sharing_requests(), 0);
    assert!(!w.captured_without_prefix_caching());
}

#[test]
fn prompts_built_with_their_hashes_are_what_the_engine_would_hash() {
    use crate::inspect::simulate::prehash::PromptHashes;
    use crate::play::engine::block_hash::{chain, default_none_hash};
    // ids 7, 8 sent again by request 2; request 3 extends that chain by a third block
    let w = workload(
        &[
            (0.0, 10, &[7, 8], None),
            (1.0, 9, &[7, 9], None),
            (2.0, 10, &[7, 8], None),
            (3.0, 13, &[7, 8, 5], None),
        ],
        4,
    );
    let (root, vocab) = (default_none_hash(), 3..259);
    let full: Vec<Vec<u32>> = (0..4).map(|i| w.prompt(i, vocab.clone(), false)).collect();
    let vllm: Vec<_> = full
        .iter()
        .map(|p| chain(&root, p, 4, None, None))
        .collect();
    // every block drawn, vLLM's hashes
    let mut m = PromptHashes::new(root, 4, false);
    for i in 0..4 {
        assert_eq!(
            m.prompt_and_hashes(w.plan(i), &vocab, false),
            (full[i].clone(), vllm[i].clone())
        );
    }
    // placeholders: a block the memo already hashed is not drawn, the hashes are the same
    let mut m = PromptHashes::new(root, 4, false);
    let lazy: Vec<_> = (0..4)
        .map(|i| m.prompt_and_hashes(w.plan(i), &vocab, true))
        .collect();
    for i in 0..4 {
        assert_eq!(lazy[i].1, vllm[i]);
        assert_eq!(lazy[i].0.len(), full[i].len());
    }
    assert_eq!(
        lazy[0].0, full[0],
        "the first sight of every block is drawn"
    );
    assert!(lazy[2].0[..8].iter().all(|&t| t == 0), "blocks 7, 8 again");
    assert_eq!(lazy[2].0[8..], full[2][8..], "the partial tail is drawn");
    assert_eq!(
        lazy[3].0[8..],
        full[3][8..],
        "block 5 and the tail are drawn"
    );
    // keyed: other values, equal exactly where vLLM's are
    let mut m = PromptHashes::new(root, 4, true);
    let keyed: Vec<_> = (0..4)
        .flat_map(|i| m.prompt_and_hashes(w.plan(i), &vocab, true).1)
        .collect();
    let vllm: Vec<_> = vllm.into_iter().flatten().collect();
    assert_eq!(keyed.len(), vllm.len());
    for a in 0..keyed.len() {
        assert_ne!(keyed[a], vllm[a]);
        for b in 0..keyed.len() {
            assert_eq!(
                keyed[a] == keyed[b],
                vllm[a] == vllm[b],
                "blocks {a} and {b}"
            );
        }
    }
}

#[test]
fn a_closed_loop_sends_each_next_request_after_its_own_turnaround_when_told_to() {
    use super::super::arrivals::Arrivals;
    use super::super::options::{OwnTurnarounds, RunOptions};
    let w = pairs_sent(0.5);
    let ms = |x: f64| Duration::from_secs_f64(x / 1000.0);
    for (own, after) in [(false, [7.0, 7.0]), (true, [3.0, 3.5])] {
        let opts = RunOptions {
            concurrency: Some(2),
            think: ms(7.0),
            own_turnarounds: own.then_some(OwnTurnarounds {
                client_spacing_ms: None,
            }),
            ..Default::default()
        };
        let mut a = Arrivals::new(&w, &opts);
        while a.pop_due(Duration::MAX).is_some() {} // the ramp: requests 0 and 1
        a.finished(0, ms(100.0));
        a.finished(1, ms(100.0));
        let next: Vec<(Duration, usize)> =
            std::iter::from_fn(|| a.pop_due(Duration::MAX)).collect();
        assert_eq!(
            next,
            vec![(ms(100.0 + after[0]), 2), (ms(100.0 + after[1]), 3)],
            "own turnarounds: {own}"
        );
    }
}

/// A record's conversation and turn, from the request id `bench serve --multi-turn` gives
/// it (`chatcmpl-bench-<run>-conv-<n>-turn<k>-<suffix>`).
fn conv_turn(id: &str) -> Option<(u32, u32)> {
    let mut it = id.split("conv-").nth(1)?.split('-');
    let conv = it.next()?.parse().ok()?;
    let turn = it.next()?.strip_prefix("turn")?.parse().ok()?;
    Some((conv, turn))
}

#[test]
fn every_turn_of_the_corpus_multi_turn_captures_continues_its_own_conversation() {
    // 64 conversations of 4 turns over one system prompt, many opening with the same
    // blocks, sent round by round; the client's request ids tell each turn's conversation
    for capture in ["sessions-s0", "sessions-s1", "sessions-no-prefix-cache-s1"] {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(format!("conformance/v2/0.32/{capture}.trace.jsonl.gz"));
        let mut ids: Vec<Option<(u32, u32)>> = Vec::new();
        let w = Workload::load_with(&path, None, None, |_, r| {
            ids.push(r.request_id.as_deref().and_then(conv_turn));
        })
        .unwrap();
        let of = |i: usize| ids[w.reqs[i].source as usize];
        let index: HashMap<(u32, u32), usize> = (0..w.reqs.len())
            .filter_map(|i| Some((of(i)?, i)))
            .collect();
        let turns = w.sessions();
        for (i, t) in turns.iter().enumerate() {
            let truth = of(i).and_then(|(c, k)| Some(index[&(c, k.checked_sub(1)?)]));
            let found = match *t {
                Turn::Root => None,
                Turn::After { parent, .. } | Turn::NotBefore { parent } => Some(parent as usize),
            };
            // two first turns with the same blocks, lengths, arrival and end cannot be told
            // apart, and either is as good a parent
            let alike = |a: usize, b: usize| {
                let (x, y) = (&w.reqs[a], &w.reqs[b]);
                let end = |p: &Planned| p.arrival_ms.unwrap_or(0.0) + p.e2e_ms.unwrap_or(0.0);
                w.hashes(a) == w.hashes(b)
                    && x.prompt_tokens == y.prompt_tokens
                    && x.output_tokens == y.output_tokens
                    && (end(x) - end(y)).abs() < 1.0
            };
            let right = match (found, truth) {
                (Some(f), Some(t)) => f == t || alike(f, t),
                (f, t) => f == t,
            };
            assert!(
                right,
                "{capture}: request {i} {:?} continues {found:?}, not {truth:?}",
                of(i)
            );
        }
        let g = Sessions::of(&turns);
        // 64 conversations and the warm-up request; every conversation under way at once
        assert_eq!(g.roots.len(), 65, "{capture}");
        assert_eq!(g.captured_concurrency(&w), Some(64), "{capture}");
    }
}

#[test]
fn only_a_burst_that_opened_with_nothing_in_flight_chains_its_ramp_sends() {
    let unit = |a: f64, ttft: f64, end: f64| LoopUnit {
        arrival_ms: Some(a),
        sent_ms: None,
        ttft_ms: Some(ttft),
        end_ms: Some(end),
    };
    let units = [
        // opens a burst; the next was queued as its first token came out
        unit(0.0, 10.0, 100.0),
        unit(10.2, 10.0, 1000.0),
        // starts while the second is under way; the next meets its first token by chance
        unit(500.0, 20.0, 2000.0),
        unit(520.5, 20.0, 2000.0),
    ];
    assert_eq!(
        ramp_sends(&units, 4),
        vec![Some(0.0), Some(0.01), Some(500.0), Some(520.5)]
    );
    // after a warm-up that finished, the burst opens with the next send
    let warm = [
        unit(0.0, 1.0, 5.0),
        unit(50.0, 10.0, 100.0),
        unit(50.05, 10.0, 100.0),
        unit(60.4, 10.0, 100.0),
    ];
    assert_eq!(
        ramp_sends(&warm, 4),
        vec![Some(0.0), Some(50.0), Some(50.0), Some(50.01)]
    );
}
