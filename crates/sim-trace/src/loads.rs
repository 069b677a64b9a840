//! The loads a capture is made under: the conformance corpus's workloads and the
//! calibration suite, each a `vllm bench serve` load (the `vllm-rs bench serve` form,
//! which mirrors Python's `vllm bench serve` flags) plus the engine flags it needs.
//!
//! A fitted model is judged on shapes it was not fitted on, so the loads vary what a fixed
//! 128/64-token sweep holds fixed: prompt and answer lengths (`--random-range-ratio`),
//! prompts near the context limit, prefix-cache mixes (a `timed_trace` dataset of shared
//! and private hash ids), rates, bursts, concurrency, multi-turn sessions, speculative
//! decoding and a KV cache small enough to preempt. The **calibration suite** is the short
//! fixed subset a user runs against their own engine to fit a model for it
//! ([`CALIBRATION_SUITE`]); every other workload is a held-out shape for that model.
//!
//! Both the corpus rig (`cargo xtask corpus`) and `vllm-vcr inspect suite` read this one
//! list, so the suite a user runs is the suite the project's own fidelity table was
//! fitted on.

use std::path::Path;

mod dataset;

/// Tokens per hash id of a `timed_trace` dataset (the engine's block size, so a shared
/// hash id is a cacheable block).
const HASH_BLOCK: u32 = 16;

/// Prompt and answer lengths of a random-dataset load.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    /// Target prompt length, tokens (`--random-input-len`; with a cache mix, the total).
    pub input: u32,
    /// Target answer length, tokens (`--random-output-len`; answers run to it: `--ignore-eos`).
    pub output: u32,
    /// Lengths drawn uniformly from `[len·(1−r), len·(1+r)]` (`--random-range-ratio`),
    /// separately for prompts and answers; `(0, 0)` for exact lengths.
    pub range: (f64, f64),
    /// Prefix-cache mix: the fraction of prompts that start with a shared prefix, and the
    /// share of such a prompt the prefix takes; `None` for unrelated prompts. Sent as a
    /// `timed_trace` dataset of hash ids ([`Workload::dataset`]): `bench serve`'s own
    /// mix (`--random-cache-hit-fraction`) decodes random ids to text and re-encodes
    /// them, which never converges with a byte-level tokenizer, while a hash id stands
    /// for 16 fixed token ids sent as ids, so any tokenizer will do.
    pub cache: Option<(f64, f64)>,
    /// A prefix of this many tokens shared by every prompt, before its own `input` tokens
    /// (`--random-prefix-len`; sent as token ids, so any tokenizer will do). 0: none.
    pub prefix: u32,
}

impl Shape {
    /// Fixed lengths.
    pub const fn fixed(input: u32, output: u32) -> Self {
        Self {
            input,
            output,
            range: (0.0, 0.0),
            cache: None,
            prefix: 0,
        }
    }

    /// Lengths spread by `input_r` and `output_r`.
    pub const fn varied(input: u32, output: u32, input_r: f64, output_r: f64) -> Self {
        Self {
            input,
            output,
            range: (input_r, output_r),
            cache: None,
            prefix: 0,
        }
    }

    /// Every prompt starts with the same `prefix` tokens.
    pub const fn with_prefix(self, prefix: u32) -> Self {
        Self { prefix, ..self }
    }

    /// With a prefix-cache mix.
    pub const fn with_cache(self, hit_fraction: f64, ratio: f64) -> Self {
        Self {
            cache: Some((hit_fraction, ratio)),
            ..self
        }
    }

    /// The longest prompt plus answer this shape can draw, tokens.
    pub fn max_total(&self) -> u32 {
        let up = |len: u32, r: f64| (f64::from(len) * (1.0 + r)).ceil() as u32;
        self.prefix + up(self.input, self.range.0) + up(self.output, self.range.1)
    }

    /// Whether every request has the same lengths.
    pub fn is_fixed(&self) -> bool {
        self.range == (0.0, 0.0) && self.cache.is_none() && self.prefix == 0
    }

    fn describe(&self) -> String {
        let len = |l: u32, r: f64| {
            if r == 0.0 {
                l.to_string()
            } else {
                let lo = (f64::from(l) * (1.0 - r)).floor() as u32;
                let hi = (f64::from(l) * (1.0 + r)).ceil() as u32;
                format!("{lo}–{hi}")
            }
        };
        let mut s = format!(
            "random {}/{} tokens",
            len(self.input, self.range.0),
            len(self.output, self.range.1)
        );
        if self.prefix > 0 {
            s.push_str(&format!(
                " after a {}-token prefix every prompt shares",
                self.prefix
            ));
        }
        if let Some((hit, ratio)) = self.cache {
            s.push_str(&format!(
                ", {:.0} % of prompts share a prefix of {:.0} % of their length",
                hit * 100.0,
                ratio * 100.0
            ));
        }
        s
    }
}

/// How requests are sent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrivals {
    /// Closed loop: at most `C` requests in flight (`--max-concurrency C`).
    Concurrency(u32),
    /// Open loop: `--request-rate R --burstiness B` (1: poisson; below 1: bursty gamma).
    Rate {
        /// Requests per second.
        rate: f64,
        /// Gamma shape of the gaps.
        burstiness: f64,
    },
    /// Multi-turn chat sessions (`--multi-turn`): `concurrency` conversations of `turns`
    /// turns over a shared `prefix`-token system prompt, `first` tokens in the first user
    /// message and `per_turn` in each later one; the answer length is the shape's output.
    Sessions {
        /// Conversations in flight.
        concurrency: u32,
        /// Turns per conversation.
        turns: u32,
        /// Shared system prompt, tokens.
        prefix: u32,
        /// First user message, tokens.
        first: u32,
        /// Each later user message, tokens.
        per_turn: u32,
    },
}

impl Arrivals {
    /// Whether the capture is replayed as a closed loop (`--replay-concurrency auto`).
    pub fn closed_loop(&self) -> bool {
        !matches!(self, Arrivals::Rate { .. })
    }

    fn describe(&self) -> String {
        match *self {
            Arrivals::Concurrency(c) => format!("max-concurrency {c}"),
            Arrivals::Rate {
                rate,
                burstiness: 1.0,
            } => format!("poisson {rate} req/s"),
            Arrivals::Rate { rate, burstiness } => {
                format!("gamma arrivals {rate} req/s burstiness {burstiness}")
            }
            Arrivals::Sessions {
                concurrency,
                turns,
                prefix,
                first,
                per_turn,
            } => format!(
                "multi-turn chat: {concurrency} concurrent conversations of {turns} turns, shared \
                 {prefix}-token prefix, first message {first}, then history + {per_turn} per turn"
            ),
        }
    }
}

/// Which evaluation a workload serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// In the calibration suite: models are fitted on these.
    Suite,
    /// Held out: models are judged on these.
    HeldOut,
}

/// One load of the corpus.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    /// File-name stem and manifest name.
    pub name: &'static str,
    /// Prompt and answer lengths.
    pub shape: Shape,
    /// How requests are sent.
    pub arrivals: Arrivals,
    /// Requests (turns, for sessions): a load of ~20–30 s on the reference host.
    pub requests: u32,
    /// Extra engine flags (`vllm serve …`).
    pub engine_args: &'static [&'static str],
    /// Captures with seed 0 beyond the first (each is a `noise` repeat: the workload's own
    /// run-to-run distance).
    pub repeats: u32,
    /// Suite or held out.
    pub part: Part,
}

/// ngram speculation, 3 draft tokens.
pub const SPEC_NGRAM: &str =
    r#"{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":4}"#;

const fn load(
    name: &'static str,
    shape: Shape,
    arrivals: Arrivals,
    requests: u32,
    engine_args: &'static [&'static str],
    part: Part,
) -> Workload {
    Workload {
        name,
        shape,
        arrivals,
        requests,
        engine_args,
        repeats: 1,
        part,
    }
}

const FIXED: Shape = Shape::fixed(128, 64);
const RATE: f64 = 12.0;
const SESSIONS: Arrivals = Arrivals::Sessions {
    concurrency: 4,
    turns: 4,
    prefix: 256,
    first: 128,
    per_turn: 64,
};

/// Every workload of the corpus, in capture order. The calibration suite first.
pub const WORKLOADS: &[Workload] = &[
    // ---- the calibration suite: few minutes of engine time, every term of the model
    // varied on its own (lengths from short to near the 2,048-token context, batch sizes
    // from 1 to 12, cache hits at several depths, mixed prefill/decode steps, step sizes
    // run once and run again, an engine busy and one that falls idle)
    load(
        "suite-lengths-c2",
        Shape::varied(900, 128, 0.9, 0.9),
        Arrivals::Concurrency(2),
        64,
        &[],
        Part::Suite,
    ),
    load(
        "suite-batch-c12",
        Shape::varied(256, 128, 0.75, 0.75),
        Arrivals::Concurrency(12),
        192,
        &[],
        Part::Suite,
    ),
    load(
        "suite-prefix-poisson6",
        Shape::varied(128, 64, 0.5, 0.5).with_prefix(384),
        Arrivals::Rate {
            rate: 6.0,
            burstiness: 1.0,
        },
        160,
        &[],
        Part::Suite,
    ),
    // Fixed lengths in a closed loop: the engine runs the same step sizes over and over
    // (rounds of six prompts prefilled together, then six decodes), so the fit can tell a
    // prefill step's own cost from the cost of a step size the engine runs for the first
    // time, which varied lengths pay on nearly every prefill.
    load(
        "suite-fixed-c6",
        Shape::fixed(192, 48),
        Arrivals::Concurrency(6),
        240,
        &[],
        Part::Suite,
    ),
    // ---- held out: the fixed 128/64 sweep of the first corpus
    load(
        "concurrency-1",
        FIXED,
        Arrivals::Concurrency(1),
        96,
        &[],
        Part::HeldOut,
    ),
    load(
        "concurrency-2",
        FIXED,
        Arrivals::Concurrency(2),
        128,
        &[],
        Part::HeldOut,
    ),
    load(
        "concurrency-4",
        FIXED,
        Arrivals::Concurrency(4),
        192,
        &[],
        Part::HeldOut,
    ),
    load(
        "concurrency-8",
        FIXED,
        Arrivals::Concurrency(8),
        320,
        &[],
        Part::HeldOut,
    ),
    load(
        "concurrency-16",
        FIXED,
        Arrivals::Concurrency(16),
        448,
        &[],
        Part::HeldOut,
    ),
    load(
        "poisson",
        FIXED,
        Arrivals::Rate {
            rate: RATE,
            burstiness: 1.0,
        },
        320,
        &[],
        Part::HeldOut,
    ),
    load(
        "bursts",
        FIXED,
        Arrivals::Rate {
            rate: RATE,
            burstiness: 0.2,
        },
        320,
        &[],
        Part::HeldOut,
    ),
    load(
        "sessions",
        Shape::fixed(0, 32),
        SESSIONS,
        256,
        &["--enable-prefix-caching"],
        Part::HeldOut,
    ),
    load(
        "sessions-no-prefix-cache",
        Shape::fixed(0, 32),
        SESSIONS,
        256,
        &["--no-enable-prefix-caching"],
        Part::HeldOut,
    ),
    load(
        "spec-ngram",
        FIXED,
        Arrivals::Concurrency(4),
        192,
        &["--speculative-config", SPEC_NGRAM],
        Part::HeldOut,
    ),
    // ---- held out: shapes that vary
    load(
        "varlen-c6",
        Shape::varied(384, 96, 0.9, 0.9),
        Arrivals::Concurrency(6),
        192,
        &[],
        Part::HeldOut,
    ),
    load(
        "varlen-poisson8",
        Shape::varied(384, 96, 0.9, 0.9),
        Arrivals::Rate {
            rate: 8.0,
            burstiness: 1.0,
        },
        192,
        &[],
        Part::HeldOut,
    ),
    load(
        "varlen-bursts8",
        Shape::varied(384, 96, 0.9, 0.9),
        Arrivals::Rate {
            rate: 8.0,
            burstiness: 0.2,
        },
        192,
        &[],
        Part::HeldOut,
    ),
    load(
        "prefix-mix-poisson4",
        Shape::varied(512, 64, 0.5, 0.0).with_cache(0.6, 0.5),
        Arrivals::Rate {
            rate: 4.0,
            burstiness: 1.0,
        },
        128,
        &[],
        Part::HeldOut,
    ),
    load(
        "prefix-mix-c8",
        Shape::varied(512, 64, 0.5, 0.0).with_cache(0.6, 0.5),
        Arrivals::Concurrency(8),
        192,
        &[],
        Part::HeldOut,
    ),
    load(
        "long-c4",
        Shape::varied(1200, 64, 0.5, 0.5),
        Arrivals::Concurrency(4),
        96,
        &[],
        Part::HeldOut,
    ),
    load(
        "long-c1",
        Shape::varied(1200, 128, 0.5, 0.5),
        Arrivals::Concurrency(1),
        32,
        &[],
        Part::HeldOut,
    ),
    load(
        "preempt-small-kv-c16",
        Shape::fixed(256, 128),
        Arrivals::Concurrency(16),
        160,
        &["--num-gpu-blocks-override", "160"],
        Part::HeldOut,
    ),
];

/// The seeds the calibration suite runs each of its loads under (`inspect suite`): a model
/// is fitted on both runs. Two sets of prompts and lengths give the fit twice the steps to
/// tell the terms apart by: fitted on one seed of corpus v2's suite, the depth term (a
/// prefilled token's attention over the tokens below it) stayed 2.05 standard errors from
/// zero and was dropped, and short prompts were then charged the long ones' cost per token;
/// fitted on both, it is kept and the held-out TTFT of batched short prompts moves from
/// +23–25 % to within ±11 %.
pub const SUITE_SEEDS: [u64; 2] = [0, 1];

/// The corpus roles of the suite's runs under [`SUITE_SEEDS`] (`fit` is seed 0, `gate`
/// seed 1): the captures the project's own suite model is fitted on.
pub const SUITE_FIT_ROLES: [&str; 2] = ["fit", "gate"];

/// The calibration suite: the workloads a user captures from their own engine to fit a
/// model for it.
pub const CALIBRATION_SUITE: &[&str] = &[
    "suite-lengths-c2",
    "suite-batch-c12",
    "suite-prefix-poisson6",
    "suite-fixed-c6",
];

/// The workload named `name`.
pub fn workload(name: &str) -> Option<&'static Workload> {
    WORKLOADS.iter().find(|w| w.name == name)
}

impl Workload {
    /// Requests actually sent for `requests` (sessions: whole conversations).
    pub fn sent(&self, requests: u32) -> u32 {
        match self.arrivals {
            Arrivals::Sessions { turns, .. } => (requests / turns).max(1) * turns,
            _ => requests,
        }
    }

    /// `inspect calibrate`'s replay of this workload's arrivals.
    pub fn calibrate_args(&self) -> &'static str {
        if self.arrivals.closed_loop() {
            "--replay-concurrency auto"
        } else {
            ""
        }
    }

    /// One line saying what the load is.
    pub fn describe(&self) -> String {
        match self.arrivals {
            Arrivals::Sessions { .. } => format!(
                "{}, {} output tokens",
                self.arrivals.describe(),
                self.shape.output
            ),
            _ => format!("{}, {}", self.shape.describe(), self.arrivals.describe()),
        }
    }

    /// The batch size of a steady closed loop (for a capture's "full batch" steps).
    pub fn full_batch(&self) -> Option<u32> {
        match self.arrivals {
            Arrivals::Concurrency(c) => Some(c),
            Arrivals::Sessions { concurrency, .. } => Some(concurrency),
            Arrivals::Rate { .. } => None,
        }
    }

    /// The `bench serve` arguments of this load for `requests` requests and `seed`, less
    /// the target (`--base-url`/`--model`/`--tokenizer`, which the caller adds). A
    /// prefix-cache mix reads its prompts from `dataset_dir`/[`Self::dataset`]'s file,
    /// which the caller writes there first.
    pub fn bench_args(&self, requests: u32, seed: u64, dataset_dir: &Path) -> Vec<String> {
        let s = |v: u32| v.to_string();
        let mut a: Vec<String> = Vec::new();
        let mut push = |xs: &[&str]| a.extend(xs.iter().map(|x| x.to_string()));
        match self.arrivals {
            Arrivals::Sessions {
                concurrency,
                turns,
                prefix,
                first,
                per_turn,
            } => {
                let conversations = (requests / turns).max(1);
                push(&[
                    "--backend",
                    "openai-chat",
                    "--dataset-name",
                    "random",
                    "--multi-turn",
                    "--multi-turn-num-turns",
                    &s(turns),
                    "--multi-turn-concurrency",
                    &s(concurrency),
                    "--random-prefix-len",
                    &s(prefix),
                    "--random-input-len",
                    &s(first),
                    "--per-turn-input-len",
                    &s(per_turn),
                    "--random-output-len",
                    &s(self.shape.output),
                    "--num-prompts",
                    &s(conversations),
                ]);
            }
            _ if self.shape.cache.is_some() => {
                let (file, _) = self.dataset(requests, seed).unwrap_or_default();
                push(&[
                    "--dataset-name",
                    "timed_trace",
                    "--dataset-path",
                    &dataset_dir.join(file).to_string_lossy(),
                    "--timed-trace-chunk-hash-size",
                    &s(HASH_BLOCK),
                    // the arrivals below, not the dataset's timestamps
                    "--no-self-timed",
                    "--num-prompts",
                    &s(requests),
                    "--prompt-token-ids",
                ]);
            }
            _ => {
                push(&[
                    "--dataset-name",
                    "random",
                    "--random-input-len",
                    &s(self.shape.input),
                    "--random-output-len",
                    &s(self.shape.output),
                    "--num-prompts",
                    &s(requests),
                    "--prompt-token-ids",
                ]);
                let (ri, ro) = self.shape.range;
                if ri != 0.0 || ro != 0.0 {
                    push(&[
                        "--random-range-ratio",
                        &format!(r#"{{"input":{ri},"output":{ro}}}"#),
                    ]);
                }
                if self.shape.prefix > 0 {
                    push(&["--random-prefix-len", &s(self.shape.prefix)]);
                }
            }
        }
        push(&["--ignore-eos", "--seed", &seed.to_string()]);
        match self.arrivals {
            Arrivals::Concurrency(c) => push(&["--max-concurrency", &s(c)]),
            Arrivals::Rate { rate, burstiness } => push(&[
                "--request-rate",
                &rate.to_string(),
                "--burstiness",
                &burstiness.to_string(),
            ]),
            Arrivals::Sessions { .. } => {}
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The captures run with a 2,048-token context.
    const CONTEXT: u32 = 2048;

    #[test]
    fn every_workload_fits_the_capture_context_and_has_a_unique_name() {
        let mut names = std::collections::BTreeSet::new();
        for w in WORKLOADS {
            assert!(names.insert(w.name), "{} twice", w.name);
            assert!(
                w.shape.max_total() <= CONTEXT,
                "{}: up to {} tokens",
                w.name,
                w.shape.max_total()
            );
            assert!(
                w.repeats >= 1,
                "{}: every workload has its own noise",
                w.name
            );
        }
    }

    #[test]
    fn the_suite_is_the_suite_part_and_nothing_else() {
        let suite: Vec<&str> = WORKLOADS
            .iter()
            .filter(|w| w.part == Part::Suite)
            .map(|w| w.name)
            .collect();
        assert_eq!(suite, CALIBRATION_SUITE);
    }

    #[test]
    fn a_varied_cached_load_asks_bench_serve_for_both() {
        let w = workload("suite-prefix-poisson6").unwrap();
        let dir = Path::new("/data");
        let a = w.bench_args(10, 3, dir).join(" ");
        assert!(
            a.contains(r#"--random-range-ratio {"input":0.5,"output":0.5}"#),
            "{a}"
        );
        assert!(a.contains("--random-prefix-len 384"), "{a}");
        assert!(a.contains("--request-rate 6 --burstiness 1"), "{a}");
        let mix = workload("prefix-mix-poisson4")
            .unwrap()
            .bench_args(10, 0, dir)
            .join(" ");
        assert!(
            mix.contains(
                "--dataset-name timed_trace --dataset-path \
                 /data/prefix-mix-poisson4-s0-n10.timed-trace.jsonl"
            ),
            "{mix}"
        );
        assert!(mix.contains("--no-self-timed"), "{mix}");
        assert!(mix.contains("--request-rate 4 --burstiness 1"), "{mix}");
        assert!(a.contains("--seed 3"), "{a}");
        assert!(a.contains("--prompt-token-ids"), "{a}");
        let fixed = workload("concurrency-8")
            .unwrap()
            .bench_args(320, 0, dir)
            .join(" ");
        assert!(!fixed.contains("range-ratio"), "{fixed}");
        assert!(fixed.ends_with("--max-concurrency 8"), "{fixed}");
    }

    #[test]
    fn a_prefix_mix_shares_whole_blocks_of_one_chain_in_its_warm_share_of_prompts() {
        let w = workload("prefix-mix-c8").unwrap();
        let (name, text) = w.dataset(400, 1).unwrap();
        assert_eq!(name, "prefix-mix-c8-s1-n400.timed-trace.jsonl");
        assert_eq!(w.dataset(400, 1).unwrap().1, text, "deterministic");
        let (mut warm, mut seen) = (0, std::collections::BTreeSet::new());
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let input = v["input_length"].as_u64().unwrap();
            let ids: Vec<u64> = v["hash_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i.as_u64().unwrap())
                .collect();
            assert!((256..=768).contains(&input), "{line}");
            assert_eq!(ids.len() as u64, input.div_ceil(16), "{line}");
            let shared = ids.iter().take_while(|&&i| i <= 48).count() as u64;
            assert!(
                ids[..shared as usize].iter().copied().eq(1..=shared),
                "{line}"
            );
            if shared > 0 {
                warm += 1;
                assert_eq!(
                    shared,
                    input / 2 / 16,
                    "half the prompt, whole blocks: {line}"
                );
            }
            for id in &ids[shared as usize..] {
                assert!(seen.insert(*id), "private block {id} twice");
            }
        }
        assert!((200..280).contains(&warm), "60 % of 400 warm, got {warm}");
        assert!(workload("concurrency-8").unwrap().dataset(10, 0).is_none());
    }

    #[test]
    fn descriptions_give_the_length_ranges() {
        let w = workload("varlen-c6").unwrap();
        assert_eq!(
            w.describe(),
            "random 38–730/9–183 tokens, max-concurrency 6"
        );
    }
}
