//! Synthetic but well-formed logprobs: the shapes, dtypes and invariants vLLM's sampler
//! produces, with made-up numbers.
//!
//! - [`sample_logprobs`]: one request's `EngineCoreOutput.new_logprobs` (`LogprobsLists`);
//! - [`sample_prompt_logprobs`]: one request's `new_prompt_logprobs_tensors`
//!   (`LogprobsTensors`, as an opaque msgpack value the encoder passes through).
//!
//! Every row describes one position: column 0 is the token that was actually there (the
//! sampled token, or the next prompt token), columns `1..=k` the position's top-k tokens with
//! logprobs in descending order, and the rank is the 1-based rank of the column-0 token in
//! the whole vocabulary. The numbers come from a random probability distribution per row
//! (stick-breaking, so the top-k probabilities are strictly decreasing and sum to less than
//! 1), and the column-0 token's rank is drawn from that same distribution, so a row is always
//! self-consistent: rank `r ≤ k` puts the token at column `r` with the same logprob, rank
//! `r > k` keeps it out of the top-k with a smaller logprob.

use std::collections::HashSet;
use std::ops::Range;

use rmpv::Value;
use sim_protocol::LogprobsLists;

use crate::play::content::tokens::SplitMix64;

/// msgpack ext code of raw array bytes (`CUSTOM_TYPE_RAW_VIEW`, `vllm/v1/serial_utils.py`).
const RAW_VIEW_EXT: i8 = 3;

/// A request's `logprobs` / `prompt_logprobs` as the engine receives it (`SamplingParams`),
/// resolved to a column count: `-1` means the whole vocabulary, as vLLM's sampler reads it
/// (`sampling_params.py::_validate_logprobs`, `v1/sample/sampler.py`: `max_num_logprobs ==
/// -1` → vocab size). Other negative values (the frontend rejects them) give 0.
pub fn resolve_num_logprobs(requested: i64, vocab_size: u32) -> u32 {
    match requested {
        -1 => vocab_size,
        n if n < 0 => 0,
        n => u32::try_from(n).unwrap_or(u32::MAX),
    }
}

/// `new_logprobs` for one output message of one request: one row per token in `sampled`
/// (the message's new token ids), `num_logprobs + 1` columns.
///
/// Mirrors `v1/sample/sampler.py::Sampler.gather_logprobs` (column 0 = the sampled token,
/// then `torch.topk`; rank = `(logprobs >= sampled_logprob).sum()`, so 1-based) and
/// `v1/outputs.py::LogprobsLists.slice_request`, which the scheduler uses to cut one
/// request's rows out of the batch (`v1/core/sched/scheduler.py::update_from_output`) and
/// which sets `cu_num_generated_tokens` to `None`.
///
/// Top-k ids other than the sampled token are distinct ids from `id_range`; the sampled id
/// itself may lie outside it (an EOS below `--min-token-id`, an echoed prompt id). `k` is
/// capped at `id_range.len()`, since a top-k needs k distinct ids. vLLM computes one `k` per
/// batch (the largest `num_logprobs` of the step), so a request sharing a step with a larger
/// request gets extra columns the frontend ignores; pass that batch maximum to mimic it.
pub fn sample_logprobs(
    rng: &mut SplitMix64,
    sampled: &[u32],
    num_logprobs: u32,
    id_range: Range<u32>,
) -> LogprobsLists {
    let rows = generate_rows(rng, sampled.iter().copied(), num_logprobs, &id_range);
    LogprobsLists {
        token_ids: rows.ids,
        logprobs: rows.logprobs,
        ranks: rows.ranks,
        rows: sampled.len(),
        cols: rows.cols,
        cu_num_generated_tokens: None,
    }
}

/// `new_prompt_logprobs_tensors` for one request's prompt: a `LogprobsTensors` NamedTuple
/// (msgspec encodes it as the 5-array `[logprob_token_ids, logprobs, selected_token_ranks,
/// cu_num_generated_tokens, cu_num_generated_tokens_tensor]`), each tensor a `[dtype, shape,
/// ext 3 raw little-endian bytes]` triple (`serial_utils.py::_encode_tensor`).
///
/// vLLM scores every prompt position but the last one against the *next* prompt token, so
/// there are `prompt.len() - 1` rows (the frontend prepends `None` for the first token:
/// `vllm/logprobs.py::create_prompt_logprobs`). Returns `None` when there is no row (a
/// one-token prompt): the 0.33 default model runner then sends no tensors at all.
///
/// Mirrors the 0.33 default (V2) model runner, `v1/worker/gpu/sample/prompt_logprob.py`
/// (`compute_prompt_logprobs_with_chunking` → `logprob.py::compute_topk_scores`): token ids
/// are `int64` (the prompt ids are cast to int64 and `torch.topk` indices are int64),
/// logprobs `float32`, ranks `int64`, both cu fields `None`; the whole prompt arrives in one
/// message, with the request's first sampled token (chunked prefills are held back until
/// the last chunk). The deprecated V1 runner (`v1/worker/gpu_model_runner.py::
/// _get_prompt_logprobs_dict`) copies into `LogprobsTensors.empty_cpu`, i.e. `int32` ids and
/// `int32` ranks (`new_empty` inherits int32), and sends a 0-row tensor for a one-token
/// prompt; both frontends accept either. The data always travels inline (the output encoder
/// passes this value through as is).
///
/// vLLM skips the prefix cache for requests that ask for prompt logprobs
/// (`SamplingParams.skip_reading_prefix_cache`), so every position is scored.
pub fn sample_prompt_logprobs(
    rng: &mut SplitMix64,
    prompt: &[u32],
    num_logprobs: u32,
    id_range: Range<u32>,
) -> Option<Value> {
    let targets = prompt.get(1..).filter(|t| !t.is_empty())?;
    let rows = generate_rows(rng, targets.iter().copied(), num_logprobs, &id_range);
    let n = targets.len() as u64;
    let cols = rows.cols as u64;
    Some(Value::Array(vec![
        tensor(
            "int64",
            &[n, cols],
            rows.ids
                .iter()
                .flat_map(|&x| i64::from(x).to_le_bytes())
                .collect(),
        ),
        tensor(
            "float32",
            &[n, cols],
            rows.logprobs.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ),
        tensor(
            "int64",
            &[n],
            rows.ranks.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ),
        Value::Nil,
        Value::Nil,
    ]))
}

/// A torch tensor as `MsgpackEncoder._encode_tensor` writes it inline: `[str(dtype) without
/// "torch.", shape, Ext(3, bytes)]`.
fn tensor(dtype: &str, shape: &[u64], data: Vec<u8>) -> Value {
    Value::Array(vec![
        Value::from(dtype),
        Value::Array(shape.iter().map(|&d| Value::from(d)).collect()),
        Value::Ext(RAW_VIEW_EXT, data),
    ])
}

/// Row-major rows of `cols` ids and logprobs, and one rank per row.
struct Rows {
    cols: usize,
    ids: Vec<i32>,
    logprobs: Vec<f32>,
    ranks: Vec<i64>,
}

fn generate_rows(
    rng: &mut SplitMix64,
    targets: impl ExactSizeIterator<Item = u32>,
    num_logprobs: u32,
    id_range: &Range<u32>,
) -> Rows {
    let range_len = id_range.end.saturating_sub(id_range.start);
    let k = num_logprobs.min(range_len) as usize;
    let cols = k + 1;
    let n = targets.len();
    let mut rows = Rows {
        cols,
        ids: Vec::with_capacity(n * cols),
        logprobs: Vec::with_capacity(n * cols),
        ranks: Vec::with_capacity(n),
    };
    let mut scratch = Scratch::default();
    for target in targets {
        let rank = row(rng, target, k, id_range, &mut scratch);
        rows.ids.extend(scratch.ids.iter().map(|&t| to_i32(t)));
        rows.logprobs.extend_from_slice(&scratch.logprobs);
        rows.ranks.push(rank);
    }
    rows
}

/// Buffers reused across rows.
#[derive(Default)]
struct Scratch {
    /// Log-probabilities of the virtual top positions (f64, strictly decreasing).
    top: Vec<f64>,
    /// The same as f32, strictly decreasing after rounding.
    top32: Vec<f32>,
    others: Vec<u32>,
    pool: Vec<u32>,
    seen: HashSet<u32>,
    /// The row being built: `cols` ids and logprobs.
    ids: Vec<u32>,
    logprobs: Vec<f32>,
}

/// One position: fills `s.ids`/`s.logprobs` with `k + 1` columns and returns the rank of
/// `target`.
fn row(rng: &mut SplitMix64, target: u32, k: usize, range: &Range<u32>, s: &mut Scratch) -> i64 {
    // The distribution's head: at least one position, so that k = 0 (only the sampled
    // token's own logprob) still has a top-1 to be ranked against.
    let m = k.max(1);
    s.top.clear();
    s.top32.clear();
    let mut log_rest = 0.0f64; // log of the probability mass not yet handed out
    for _ in 0..m {
        // Stick-breaking with a share in [0.5, 0.9): each probability is at least the mass
        // left after it, so the sequence strictly decreases and the sum stays below 1.
        let share = 0.5 + 0.4 * rng.unit();
        s.top.push(log_rest + share.ln());
        log_rest += (1.0 - share).ln();
    }
    let mut prev = f32::INFINITY;
    for &lp in &s.top {
        s.top32.push(strictly_below(lp as f32, prev));
        prev = *s.top32.last().unwrap_or(&prev);
    }

    // Tokens other than `target` that could outrank it: the range minus the target.
    let range_len = u64::from(range.end.saturating_sub(range.start));
    let others_len = range_len - u64::from(range.contains(&target));
    // A rank past the head needs `m` other tokens above the target.
    let tail_possible = others_len >= m as u64;

    // Draw the target's rank from the distribution itself (renormalised over the head when
    // the vocabulary has nothing past it).
    let head_mass: f64 = s.top.iter().map(|lp| lp.exp()).sum();
    let mut u = rng.unit() * if tail_possible { 1.0 } else { head_mass };
    let mut rank = 0usize;
    for (i, lp) in s.top.iter().enumerate() {
        let p = lp.exp();
        if u < p {
            rank = i + 1;
            break;
        }
        u -= p;
    }
    if rank == 0 && !tail_possible {
        rank = m; // rounding left u just past the head
    }
    let target_lp = if rank == 0 {
        // In the tail: below the rest mass (hence below every head logprob), at a rank a
        // few places past the head, capped by the number of tokens that can outrank it.
        let spread = (-rng.unit().max(f64::MIN_POSITIVE).ln() * 4.0) as u64;
        let r = (m as u64 + 1 + spread).min(others_len + 1);
        rank = usize::try_from(r).unwrap_or(usize::MAX);
        let lp = log_rest + (0.05 + 0.9 * rng.unit()).ln();
        strictly_below(lp as f32, s.top32[m - 1])
    } else {
        s.top32[rank - 1]
    };

    // The top-k ids: distinct, from the range, the target at column `rank` when it is in the
    // top-k and nowhere else.
    let in_top_k = rank <= k;
    let n_others = k - usize::from(in_top_k);
    distinct_ids(rng, range, target, n_others, s);
    s.ids.clear();
    s.logprobs.clear();
    s.ids.push(target);
    s.logprobs.push(target_lp);
    let mut others = s.others.iter();
    for col in 1..=k {
        let id = if in_top_k && col == rank {
            target
        } else {
            *others.next().unwrap_or(&target)
        };
        s.ids.push(id);
        s.logprobs.push(s.top32[col - 1]);
    }
    rank as i64
}

/// `n` distinct ids from `range` other than `exclude`, in random order, into `s.others`.
/// The caller guarantees the range holds at least `n` such ids.
fn distinct_ids(rng: &mut SplitMix64, range: &Range<u32>, exclude: u32, n: usize, s: &mut Scratch) {
    s.others.clear();
    if n == 0 {
        return;
    }
    let len = u64::from(range.end - range.start);
    if (n as u64) * 2 <= len {
        // Sparse: rejection sampling (each draw succeeds with probability > 1/2).
        s.seen.clear();
        while s.others.len() < n {
            let id = range.start + rng.below(len) as u32;
            if id == exclude {
                continue;
            }
            let fresh = if n <= 32 {
                !s.others.contains(&id)
            } else {
                s.seen.insert(id)
            };
            if fresh {
                s.others.push(id);
            }
        }
    } else {
        // Dense: a partial Fisher–Yates shuffle of the whole range.
        s.pool.clear();
        s.pool.extend(range.clone().filter(|&id| id != exclude));
        for i in 0..n {
            let j = i + rng.below((s.pool.len() - i) as u64) as usize;
            s.pool.swap(i, j);
        }
        s.others.extend_from_slice(&s.pool[..n]);
    }
}

/// `x` if it is below `bound`, else the largest f32 below `bound` (f32 rounding must not
/// create ties: a tie would change the rank vLLM's `>=` count gives).
fn strictly_below(x: f32, bound: f32) -> f32 {
    if x < bound { x } else { bound.next_down() }
}

fn to_i32(id: u32) -> i32 {
    i32::try_from(id).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sim_protocol::encode::{EncodeOptions, encode_outputs_with};
    use sim_protocol::{
        DecodedOutputs, EngineCoreOutput, EngineCoreOutputs, VllmLine, decode_outputs_for,
        encode_outputs,
    };

    /// Every invariant of one row set, as the frontend relies on them.
    fn check(lp: &LogprobsLists, targets: &[u32], k: usize, range: &Range<u32>) {
        assert_eq!(lp.rows, targets.len());
        assert_eq!(lp.cols, k + 1);
        assert_eq!(lp.token_ids.len(), lp.rows * lp.cols);
        assert_eq!(lp.logprobs.len(), lp.rows * lp.cols);
        assert_eq!(lp.ranks.len(), lp.rows);
        for (r, &target) in targets.iter().enumerate() {
            let ids = &lp.token_ids[r * lp.cols..(r + 1) * lp.cols];
            let lps = &lp.logprobs[r * lp.cols..(r + 1) * lp.cols];
            let rank = lp.ranks[r];
            assert_eq!(ids[0], target as i32, "column 0 is the sampled token");
            assert!(lps.iter().all(|x| x.is_finite() && *x < 0.0), "{lps:?}");
            let top = &ids[1..];
            let top_lps = &lps[1..];
            assert!(
                top_lps.windows(2).all(|w| w[0] > w[1]),
                "top-k strictly descending: {top_lps:?}"
            );
            let mut sorted = top.to_vec();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), top.len(), "top-k ids distinct: {top:?}");
            assert!(
                top.iter()
                    .all(|&t| t == target as i32 || range.contains(&(t as u32))),
                "{top:?}"
            );
            // probabilities of distinct tokens sum to at most 1
            let mass: f64 = top_lps.iter().map(|&x| f64::from(x).exp()).sum::<f64>()
                + if top.contains(&(target as i32)) {
                    0.0
                } else {
                    f64::from(lps[0]).exp()
                };
            assert!(mass <= 1.0 + 1e-6, "mass {mass}");
            assert!(rank >= 1);
            if (rank as usize) <= k {
                let col = rank as usize;
                assert_eq!(top[col - 1], target as i32, "rank {rank} at its column");
                assert_eq!(top_lps[col - 1], lps[0], "same logprob at its column");
                assert_eq!(top.iter().filter(|&&t| t == target as i32).count(), 1);
            } else {
                assert!(!top.contains(&(target as i32)), "rank {rank} > k={k}");
                if k > 0 {
                    assert!(lps[0] < top_lps[k - 1]);
                }
            }
            // rank as vLLM counts it (`>=`), over the visible tokens
            let visible_above = top_lps.iter().filter(|&&x| x >= lps[0]).count() as i64;
            if (rank as usize) <= k {
                assert_eq!(visible_above, rank);
            } else {
                assert_eq!(visible_above, k as i64);
            }
        }
    }

    #[test]
    fn shapes_sortedness_and_ranks() {
        let range = 3..259;
        for (seed, k) in [(1u64, 0u32), (2, 1), (3, 5), (4, 20)] {
            let mut rng = SplitMix64(seed);
            let sampled: Vec<u32> = (0..200).map(|i| 3 + (i * 37) % 256).collect();
            let lp = sample_logprobs(&mut rng, &sampled, k, range.clone());
            check(&lp, &sampled, k as usize, &range);
            assert_eq!(lp.cu_num_generated_tokens, None);
        }
    }

    #[test]
    fn ranks_cover_top1_and_beyond() {
        let mut rng = SplitMix64(9);
        let sampled = vec![50u32; 2000];
        let lp = sample_logprobs(&mut rng, &sampled, 3, 3..259);
        check(&lp, &sampled, 3, &(3..259));
        let top1 = lp.ranks.iter().filter(|&&r| r == 1).count();
        let tail = lp.ranks.iter().filter(|&&r| r > 3).count();
        // top-1 probability is 0.5..0.9 by construction
        assert!((1000..1800).contains(&top1), "{top1}");
        assert!(tail > 0, "some sampled tokens fall outside the top-k");
    }

    #[test]
    fn sampled_outside_the_range_and_tiny_ranges() {
        // EOS (2) below the random range; a range exactly k wide; a range narrower than k.
        let mut rng = SplitMix64(5);
        let lp = sample_logprobs(&mut rng, &[2, 2, 10, 11], 4, 10..14);
        check(&lp, &[2, 2, 10, 11], 4, &(10..14));
        let lp = sample_logprobs(&mut rng, &[10, 12], 8, 10..14);
        check(&lp, &[10, 12], 4, &(10..14));
        // a target inside a range of k ids must be in the top-k
        assert!(lp.ranks.iter().all(|&r| r <= 4));
        let lp = sample_logprobs(&mut rng, &[7], 3, 7..8);
        check(&lp, &[7], 1, &(7..8));
        assert_eq!(lp.ranks, vec![1]);
        let lp = sample_logprobs(&mut rng, &[7], 3, 7..7);
        check(&lp, &[7], 0, &(7..7));
        let lp = sample_logprobs(&mut rng, &[], 3, 3..259);
        assert_eq!((lp.rows, lp.cols, lp.token_ids.len()), (0, 4, 0));
    }

    #[test]
    fn full_vocabulary_logprobs() {
        let mut rng = SplitMix64(6);
        let k = resolve_num_logprobs(-1, 256);
        assert_eq!(k, 256);
        let lp = sample_logprobs(&mut rng, &[3, 100, 258], k, 3..259);
        check(&lp, &[3, 100, 258], 256, &(3..259));
        assert_eq!(resolve_num_logprobs(5, 256), 5);
        assert_eq!(resolve_num_logprobs(-7, 256), 0);
    }

    #[test]
    fn deterministic_per_seed() {
        let sampled = [5u32, 6, 7, 8];
        let a = sample_logprobs(&mut SplitMix64(42), &sampled, 5, 3..259);
        let b = sample_logprobs(&mut SplitMix64(42), &sampled, 5, 3..259);
        let c = sample_logprobs(&mut SplitMix64(43), &sampled, 5, 3..259);
        assert_eq!(a, b);
        assert_ne!(a, c);
        let p = sample_prompt_logprobs(&mut SplitMix64(42), &[1, 2, 3], 2, 3..259);
        let q = sample_prompt_logprobs(&mut SplitMix64(42), &[1, 2, 3], 2, 3..259);
        assert_eq!(p, q);
    }

    /// A decoded `[dtype, shape, ext3]` triple.
    fn triple(v: &Value) -> (&str, Vec<u64>, &[u8]) {
        let Value::Array(a) = v else {
            panic!("not a triple: {v:?}")
        };
        let dtype = a[0].as_str().unwrap();
        let shape = a[1]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        let Value::Ext(3, data) = &a[2] else {
            panic!("data is not ext 3: {:?}", a[2])
        };
        (dtype, shape, data)
    }

    /// The prompt tensors back as `LogprobsLists` (for `check`).
    fn prompt_as_lists(v: &Value) -> LogprobsLists {
        let a = v.as_array().unwrap();
        assert_eq!(a.len(), 5, "LogprobsTensors has 5 fields");
        assert_eq!((&a[3], &a[4]), (&Value::Nil, &Value::Nil));
        let (d_ids, s_ids, ids) = triple(&a[0]);
        let (d_lps, s_lps, lps) = triple(&a[1]);
        let (d_rk, s_rk, rk) = triple(&a[2]);
        assert_eq!((d_ids, d_lps, d_rk), ("int64", "float32", "int64"));
        assert_eq!(s_ids, s_lps);
        assert_eq!(s_rk, vec![s_ids[0]]);
        LogprobsLists {
            token_ids: ids
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as i32)
                .collect(),
            logprobs: lps
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect(),
            ranks: rk
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                .collect(),
            rows: s_ids[0] as usize,
            cols: s_ids[1] as usize,
            cu_num_generated_tokens: None,
        }
    }

    #[test]
    fn prompt_logprobs_skip_the_first_token() {
        let prompt = [1u32, 40, 41, 42, 300];
        let v = sample_prompt_logprobs(&mut SplitMix64(3), &prompt, 4, 3..259).unwrap();
        let lists = prompt_as_lists(&v);
        check(&lists, &prompt[1..], 4, &(3..259));
        assert!(sample_prompt_logprobs(&mut SplitMix64(3), &[7], 4, 3..259).is_none());
        assert!(sample_prompt_logprobs(&mut SplitMix64(3), &[], 4, 3..259).is_none());
    }

    fn envelope(lp: LogprobsLists, prompt: Option<Value>) -> EngineCoreOutputs {
        EngineCoreOutputs {
            outputs: vec![EngineCoreOutput {
                request_id: "req-0".into(),
                new_token_ids: vec![10, 11, 12].into(),
                new_logprobs: Some(Box::new(lp)),
                new_prompt_logprobs_tensors: prompt.map(Box::new),
                ..Default::default()
            }],
            timestamp: 1.5,
            ..Default::default()
        }
    }

    fn decoded(line: VllmLine, frames: &[bytes::Bytes]) -> EngineCoreOutput {
        match decode_outputs_for(line, frames).unwrap() {
            DecodedOutputs::Outputs(o) => o.outputs.into_iter().next().unwrap(),
            DecodedOutputs::Dead => panic!("dead"),
        }
    }

    #[test]
    fn round_trip_inline_and_aux_frames() {
        let line = VllmLine::parse("0.33").unwrap();
        let mut rng = SplitMix64(11);
        let lp = sample_logprobs(&mut rng, &[10, 11, 12], 5, 3..259);
        let prompt = sample_prompt_logprobs(&mut rng, &[1, 2, 3, 4], 5, 3..259);
        let out = envelope(lp.clone(), prompt.clone());

        // default threshold (256 bytes): 3×6 arrays are inline
        let frames = encode_outputs(line, &out).unwrap();
        assert_eq!(frames.len(), 1);
        let got = decoded(line, &frames);
        assert_eq!(got.new_logprobs.as_deref(), Some(&lp));
        assert_eq!(got.new_prompt_logprobs_tensors.as_deref(), prompt.as_ref());

        // threshold 1: every LogprobsLists array travels in its own aux frame
        let frames = encode_outputs_with(
            line,
            &out,
            &EncodeOptions {
                inline_threshold: 1,
            },
        )
        .unwrap();
        assert_eq!(frames.len(), 4, "payload + ids + logprobs + ranks");
        assert_eq!(frames[1].len(), 3 * 6 * 4);
        assert_eq!(frames[2].len(), 3 * 6 * 4);
        assert_eq!(frames[3].len(), 3 * 8);
        let got = decoded(line, &frames);
        assert_eq!(got.new_logprobs.as_deref(), Some(&lp));
        assert_eq!(got.new_prompt_logprobs_tensors.as_deref(), prompt.as_ref());
        check(
            &prompt_as_lists(got.new_prompt_logprobs_tensors.as_ref().unwrap()),
            &[2, 3, 4],
            5,
            &(3..259),
        );
    }

    #[test]
    fn round_trip_every_line() {
        let mut rng = SplitMix64(12);
        let lp = sample_logprobs(&mut rng, &[10], 2, 3..259);
        for name in ["0.25", "0.28", "0.31", "0.33"] {
            let line = VllmLine::parse(name).unwrap();
            let frames = encode_outputs(line, &envelope(lp.clone(), None)).unwrap();
            assert_eq!(
                decoded(line, &frames).new_logprobs.as_deref(),
                Some(&lp),
                "{name}"
            );
        }
    }
}
