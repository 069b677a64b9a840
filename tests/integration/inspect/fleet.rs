//! `inspect simulate --engines N --route …`: a fleet of engines behind a router, through
//! the binary — what the report says of each route, the engine each record names, and one
//! engine being the simulation it always was.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::simulate::{SMALL_ENGINE, group_trace, records, simulate, simulate_json};
use crate::support::{TestDir, number, s, texts};

/// Prompt blocks every request of a group shares (block size 16: 512 tokens).
const SHARED_BLOCKS: u64 = 32;
const GROUPS: u64 = 4;
const REQUESTS: u64 = 96;

/// The group of request `i`: a fixed pseudo-random order (a linear congruential
/// generator), so that no round-robin cycle lines up with the groups.
fn groups() -> Vec<u64> {
    let mut x: u64 = 12345;
    (0..REQUESTS)
        .map(|_| {
            x = (x * 1_103_515_245 + 12_345) % (1 << 31);
            (x >> 16) % GROUPS
        })
        .collect()
}

/// Four groups of requests, each group sharing a 32-block prefix, plus two blocks of its
/// own per request; one arrives every 60 ms, the groups interleaved.
fn shared_prefixes(tmp: &TestDir) -> PathBuf {
    group_trace(tmp, "groups.jsonl", &groups(), (SHARED_BLOCKS, 60, 8))
}

/// Two engines of 80 blocks each: one holds two groups' prefixes, not four.
const ENGINE: [&str; 6] = SMALL_ENGINE;

fn fleet_json(trace: &Path, route: &str, dump: &Path) -> Value {
    let mut a = vec![s(trace), "--engines", "2", "--route", route];
    a.extend(ENGINE);
    a.extend(["--dump-trace", s(dump)]);
    simulate_json(&a)
}

#[test]
fn cache_aware_routing_beats_round_robin_on_shared_prefixes() {
    let tmp = TestDir::new("cache_aware_routing_beats_round_robin_on_shared_prefixes");
    let trace = shared_prefixes(&tmp);
    let mut pooled = std::collections::BTreeMap::new();
    for route in ["round-robin", "least-loaded", "prefix-aware", "kv-aware"] {
        let dump = tmp.path(&format!("{route}.jsonl"));
        let v = fleet_json(&trace, route, &dump);
        let f = &v["fleet"];
        assert_eq!(f["engines"], 2, "{v}");
        assert_eq!(f["route"], route);
        let per = f["per_engine"].as_array().unwrap();
        assert_eq!(per.len(), 2);
        // every request served, each by the engine its record names
        let recs = records(&dump);
        assert_eq!(recs.len() as u64, REQUESTS);
        for (e, p) in per.iter().enumerate() {
            assert_eq!(p["engine"], e);
            let served = recs.values().filter(|r| r["engine"] == e).count();
            assert_eq!(p["requests"], served, "{route}: engine {e}");
            assert!(served > 0, "{route}: engine {e} served nothing");
        }
        // the pooled row is the whole run's summary
        assert_eq!(f["pooled"]["requests"], REQUESTS);
        assert_eq!(
            f["pooled"]["prefix_cache_hit_ratio"],
            v["prefix_cache_hit_ratio"]
        );
        assert_eq!(f["pooled"]["ttft_ms"], v["summary"]["ttft_ms"]);
        pooled.insert(
            route,
            (
                number(&v["prefix_cache_hit_ratio"]),
                number(&v["summary"]["ttft_ms"]["p50"]),
            ),
        );
        if route == "prefix-aware" {
            // each group stays on one engine, all but its first requests at most
            let group = groups();
            for g in 0..GROUPS {
                let on: Vec<u64> = recs
                    .values()
                    .filter(|r| {
                        let i: usize = r["request_id"].as_str().unwrap()[7..].parse().unwrap();
                        group[i] == g
                    })
                    .map(|r| r["engine"].as_u64().unwrap())
                    .collect();
                let most = (0..2).map(|e| on.iter().filter(|&&x| x == e).count()).max();
                assert!(
                    most.unwrap() + 2 >= on.len(),
                    "group {g} spread over the engines: {on:?}"
                );
            }
        }
    }
    let (rr_hit, rr_ttft) = pooled["round-robin"];
    let (pa_hit, pa_ttft) = pooled["prefix-aware"];
    // round-robin sends every group to both engines, whose 80 blocks cannot hold four
    // prefixes: they evict each other (measured 44 % of prompt tokens from the cache, TTFT
    // p50 259 ms); prefix-aware keeps each group on one engine (90 %, 21.8 ms)
    assert!(
        pa_hit >= rr_hit + 0.3,
        "hit rate: prefix-aware {pa_hit:.3}, round-robin {rr_hit:.3}"
    );
    assert!(
        pa_ttft <= rr_ttft / 2.0,
        "TTFT p50: prefix-aware {pa_ttft} ms, round-robin {rr_ttft} ms"
    );
    // kv-aware weighs the prefix against the load: it spreads a group when its engine is
    // busy (measured 73 %, TTFT p50 21.8 ms)
    let (kv_hit, kv_ttft) = pooled["kv-aware"];
    assert!(
        kv_hit >= rr_hit + 0.2,
        "hit rate: kv-aware {kv_hit:.3}, round-robin {rr_hit:.3}"
    );
    assert!(
        kv_ttft <= rr_ttft / 2.0,
        "TTFT p50: kv-aware {kv_ttft} ms, round-robin {rr_ttft} ms"
    );

    // the text summary prints the same: a row per engine and the pooled row
    let mut a = vec![s(&trace), "--engines", "2", "--route", "prefix-aware"];
    a.extend(ENGINE);
    let (out, _) = texts(&simulate(&a).run());
    assert!(
        out.contains("fleet: 2 engines, route prefix-aware"),
        "{out}"
    );
    let row = out
        .lines()
        .find(|l| l.trim_start().starts_with("pooled"))
        .unwrap_or_else(|| panic!("no pooled row in\n{out}"));
    let hit = format!("{:.1} %", pa_hit * 100.0);
    let ttft = format!("{pa_ttft:.1} /");
    assert!(row.contains(&hit) && row.contains(&ttft), "{row}");
}

/// The records of a dumped trace, its meta line left out (it holds the time it was
/// written and the process's instance id).
fn record_lines(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    text.split_once('\n').unwrap().1.to_string()
}

/// The text summary without its wall-clock line.
fn without_wall(out: &str) -> String {
    out.lines()
        .filter(|l| !l.starts_with("wall:"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn one_engine_is_the_single_engine_simulation() {
    let tmp = TestDir::new("one_engine_is_the_single_engine_simulation");
    let trace = shared_prefixes(&tmp);
    for arrivals in [
        &[][..],
        &["--replay-concurrency", "3"][..],
        &["--replay-sessions"][..],
    ] {
        let run = |fleet: &[&str], name: &str| {
            let dump = tmp.path(name);
            let mut a = vec![s(&trace)];
            a.extend(arrivals);
            a.extend(ENGINE);
            a.extend(fleet);
            a.extend(["--dump-trace", s(&dump)]);
            let (out, _) = texts(&simulate(&a).run());
            (record_lines(&dump), without_wall(&out))
        };
        let (plain, plain_out) = run(&[], "plain.jsonl");
        // the prefix-aware router follows the engine's cache events: with one engine it
        // has nothing to choose, and following them changes nothing
        let (one, one_out) = run(&["--engines", "1", "--route", "prefix-aware"], "one.jsonl");
        assert_eq!(plain, one, "{arrivals:?}: the records differ");
        assert_eq!(plain_out, one_out, "{arrivals:?}: the summaries differ");
        assert!(!plain.contains("\"engine\""), "no engine named: {plain}");
        assert!(!plain_out.contains("fleet:"));
    }
    let v = simulate_json(&[s(&trace), "--engines", "1"]);
    assert!(v.get("fleet").is_none(), "{v}");
}

#[test]
fn a_fleet_run_is_deterministic() {
    let tmp = TestDir::new("a_fleet_run_is_deterministic");
    let trace = shared_prefixes(&tmp);
    let run = |name: &str| {
        let dump = tmp.path(name);
        let mut a = vec![s(&trace), "--engines", "3", "--route", "prefix-aware"];
        a.extend(ENGINE);
        a.extend(["--replay-concurrency", "6", "--dump-trace", s(&dump)]);
        let mut v = simulate_json(&a);
        // what differs between any two runs: the wall clock, the file's name, and the
        // meta's time of writing and process id
        for k in ["wall_s", "speedup", "dump_trace"] {
            v[k] = Value::Null;
        }
        v["summary"]["meta"] = Value::Null;
        (record_lines(&dump), v)
    };
    let (first, v1) = run("first.jsonl");
    let (again, v2) = run("again.jsonl");
    assert_eq!(first, again, "the records differ between two runs");
    assert_eq!(v1, v2);
    assert_eq!(v1["fleet"]["per_engine"].as_array().unwrap().len(), 3);
}

#[test]
fn bad_fleet_flags_are_refused_clearly() {
    let tmp = TestDir::new("bad_fleet_flags_are_refused_clearly");
    let trace = shared_prefixes(&tmp);
    for n in ["0", "-1", "two", "1025"] {
        let flag = format!("--engines={n}");
        let e = simulate(&[s(&trace), &flag]).run_failing();
        assert!(
            e.contains(&format!("`{n}` is not a number of engines from 1 to 1024")),
            "--engines {n}: {e}"
        );
    }
    let e = simulate(&[s(&trace), "--engines", "2", "--route", "nearest"]).run_failing();
    assert!(
        e.contains("invalid value 'nearest'")
            && ["round-robin", "least-loaded", "prefix-aware", "kv-aware"]
                .iter()
                .all(|r| e.contains(r)),
        "{e}"
    );
    let e = simulate(&[s(&trace), "--engines", "2", "--replay-steps", s(&trace)]).run_failing();
    assert!(
        e.contains("--engines 2 with --replay-tokens or --replay-steps"),
        "{e}"
    );
    assert!(!e.contains("panicked"), "{e}");
}
