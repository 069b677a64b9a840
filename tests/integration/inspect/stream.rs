//! `inspect simulate` reads a trace as a stream, sorting what is out of arrival order as it
//! reads: a file in order and the same records out of order must simulate the same
//! requests, in the same order, under the same names (the held workload's order against
//! the stream's is `stream.rs`'s unit test).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{Value, json};

use super::simulate::{SMALL_ENGINE, records, simulate, write_trace};
use crate::support::{TestDir, s, texts};

/// 30 requests in prefix groups, arriving three at a time (ties), one of them too long
/// for the engine's KV cache (refused): in arrival order, each tie in file order.
fn in_order() -> Vec<Value> {
    (0..30u64)
        .map(|i| {
            let group = i % 4;
            let mut hashes: Vec<u64> = (0..3).map(|b| group * 1000 + b).collect();
            hashes.extend([100_000 + 2 * i, 100_001 + 2 * i]);
            let prompt = if i == 13 { 16 * 200 } else { 16 * 5 + i % 7 };
            json!({"prompt_tokens": prompt, "output_tokens": 3 + i % 5,
                   "arrival_ms": 40 * (i / 3), "block_hashes": hashes})
        })
        .collect()
}

/// The same records with the ties' groups in reverse order, each tie's records still in
/// the order above: sorted by arrival (stably), it is the file above again.
fn out_of_order() -> Vec<Value> {
    let recs = in_order();
    recs.chunks(3).rev().flatten().cloned().collect()
}

/// The summary a user reads, without the lines naming the file and the wall time.
fn summary(trace: &Path, extra: &[&str]) -> String {
    let mut args = vec![s(trace)];
    args.extend_from_slice(&SMALL_ENGINE);
    args.extend_from_slice(extra);
    let (out, _) = texts(&simulate(&args).run());
    out.lines()
        .filter(|l| !l.starts_with("simulated:") && !l.starts_with("wall:"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The records of a `--dump-trace`, by request id.
fn dumped(tmp: &TestDir, trace: &Path, name: &str) -> BTreeMap<String, Value> {
    let dump = tmp.path(name);
    let mut args = vec![s(trace)];
    args.extend_from_slice(&SMALL_ENGINE);
    args.extend_from_slice(&["--dump-trace", s(&dump)]);
    simulate(&args).run();
    records(&dump)
}

#[test]
fn a_trace_in_arrival_order_simulates_as_the_same_trace_out_of_order() {
    let tmp = TestDir::new("a_trace_in_arrival_order_simulates_as_the_same_trace_out_of_order");
    let meta = json!({"block_size": 16});
    let streamed = write_trace(&tmp, "in-order.jsonl", meta.clone(), &in_order());
    let reordered = write_trace(&tmp, "out-of-order.jsonl", meta, &out_of_order());

    for extra in [
        &[][..],
        &["--requests", "7"][..],
        &["--engines", "2", "--route", "kv-aware"][..],
        &["--cold-prompts"][..],
    ] {
        let a = summary(&streamed, extra);
        assert!(a.contains("requests:"), "{a}");
        assert_eq!(a, summary(&reordered, extra), "with {extra:?}");
    }
    let a = summary(&streamed, &[]);
    assert!(
        a.contains("refused before the engine: 1"),
        "the long one is refused: {a}"
    );

    // every request's record: same name, arrival, latencies, cache hits and block hashes
    let strip = |mut r: BTreeMap<String, Value>| {
        for v in r.values_mut() {
            v.as_object_mut().map(|o| o.remove("engine"));
        }
        r
    };
    let a = strip(dumped(&tmp, &streamed, "a.jsonl"));
    let b = strip(dumped(&tmp, &reordered, "b.jsonl"));
    assert_eq!(a.len(), 30);
    assert_eq!(a, b);
    // the ties keep file order: the first three arrive together, named 0, 1, 2
    let first: Vec<f64> = (0..3)
        .map(|i| a[&format!("replay-{i}")]["prompt_tokens"].as_f64().unwrap())
        .collect();
    assert_eq!(first, vec![80.0, 81.0, 82.0]);
}
