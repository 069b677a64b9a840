//! Replay index cost (`cargo bench -p sim-trace --bench replay`): load time, memory and
//! per-lookup cost with 100k records indexed. A report, not a timed test.
//!
//! The synthetic trace has, per record, 64 output token ids, 63 inter-chunk gaps and 8
//! chained block hashes (block size 16). Prompts come in 1000 families sharing their
//! first 2 blocks (a system prompt), and every 100th record repeats the previous prompt
//! exactly. Records are written in a shuffled (finish-like) order, so the load sorts.
//! The file goes to `std::env::temp_dir()` and is removed at the end.
//!
//! `BENCH_QUICK=1` shrinks the run to 10k records.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::Instant;

use sim_trace::replay::{ReplayIndex, ReplayLoadOptions};
use sim_trace::trace::{BlockHash, TraceMeta, TraceRecord, TraceWriter};

const BLOCKS: usize = 8;
const BLOCK_SIZE: u32 = 16;
const OUTPUT: usize = 64;

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The prompt of record `i`: which distinct prompt it is (duplicates share it).
fn prompt_of(i: u64) -> u64 {
    if i % 100 == 99 { i - 1 } else { i }
}

fn chain(i: u64) -> [u64; BLOCKS] {
    let p = prompt_of(i);
    let family = p % 1000;
    let mut h = 0x5eed;
    let mut out = [0; BLOCKS];
    for (k, slot) in out.iter_mut().enumerate() {
        let content = if k < 2 { family } else { 1_000_000 + p };
        h = splitmix(h ^ splitmix(content * 8 + k as u64));
        *slot = h;
    }
    out
}

fn prompt_tokens(i: u64) -> u32 {
    BLOCKS as u32 * BLOCK_SIZE + (prompt_of(i) % 16) as u32
}

fn record(i: u64) -> TraceRecord {
    let r = splitmix(i);
    TraceRecord {
        request_id: Some(format!("cmpl-{r:016x}-0")),
        prompt_tokens: prompt_tokens(i),
        output_tokens: OUTPUT as u32,
        arrival_ms: Some(i as f64 * 2.5),
        ttft_ms: Some(20.0 + (r % 1000) as f64 / 100.0),
        itl_ms: (0..OUTPUT as u64 - 1)
            .map(|j| 5.0 + (splitmix(r ^ j) % 1000) as f64 / 1000.0)
            .collect(),
        block_hashes: chain(i).iter().map(|&h| BlockHash::Int(h)).collect(),
        output_token_ids: Some(
            (0..OUTPUT as u64)
                .map(|j| (splitmix(r.wrapping_add(j)) % 151_000) as u32)
                .collect(),
        ),
        finish_reason: Some("length".into()),
        ..TraceRecord::default()
    }
}

/// Write `n` records in a finish-like order: arrival order shuffled within windows of 256.
fn write_trace(path: &Path, n: u64) {
    let meta = TraceMeta {
        block_size: Some(BLOCK_SIZE),
        ..TraceMeta::new()
    };
    let mut w = TraceWriter::create(path, &meta).unwrap();
    let mut window: Vec<u64> = Vec::with_capacity(256);
    let mut start = 0;
    while start < n {
        window.clear();
        window.extend(start..(start + 256).min(n));
        for k in (1..window.len()).rev() {
            let j = (splitmix(start ^ k as u64) % (k as u64 + 1)) as usize;
            window.swap(k, j);
        }
        for &i in &window {
            w.write_record(&record(i)).unwrap();
        }
        start += 256;
    }
    w.finish().unwrap();
}

/// `VmHWM` / `VmRSS` of this process, MiB.
fn mem_mib(key: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with(key))?;
            line.split_whitespace().nth(1)?.parse::<f64>().ok()
        })
        .map_or(f64::NAN, |kib| kib / 1024.0)
}

fn per_op(label: &str, n: usize, t: Instant) {
    let ns = t.elapsed().as_nanos() as f64 / n as f64;
    println!("{label:<44} {:>9.0} ns/lookup ({n} lookups)", ns);
}

fn main() {
    let n: u64 = if std::env::var_os("BENCH_QUICK").is_some() {
        10_000
    } else {
        100_000
    };
    let dir = std::env::temp_dir();
    let plain: PathBuf = dir.join(format!(
        "vllm-vcr-replay-bench-{}.jsonl",
        std::process::id()
    ));
    let gz = plain.with_extension("jsonl.gz");

    let t = Instant::now();
    write_trace(&plain, n);
    let size = std::fs::metadata(&plain).map_or(0, |m| m.len());
    println!(
        "wrote {n} records ({:.0} MiB) in {:.2} s",
        size as f64 / (1 << 20) as f64,
        t.elapsed().as_secs_f64()
    );

    let before = (mem_mib("VmHWM:"), mem_mib("VmRSS:"));
    let all = ReplayLoadOptions {
        tokens: true,
        steps: true,
    };
    let t = Instant::now();
    let mut index = ReplayIndex::load(std::slice::from_ref(&plain), all).unwrap();
    let load = t.elapsed().as_secs_f64();
    println!(
        "load (tokens+steps, plain):                 {load:.2} s ({:.0} records/s)",
        n as f64 / load
    );
    println!(
        "memory: index {:.1} MiB (memory_bytes); VmRSS {:.1} -> {:.1} MiB; VmHWM {:.1} -> {:.1} MiB",
        index.memory_bytes() as f64 / (1 << 20) as f64,
        before.1,
        mem_mib("VmRSS:"),
        before.0,
        mem_mib("VmHWM:"),
    );
    assert_eq!(index.len(), n as usize);

    // precomputed inputs, so the timings are the lookups alone
    let chains: Vec<[u64; BLOCKS]> = (0..n).map(chain).collect();
    let t = Instant::now();
    for (i, c) in chains.iter().enumerate() {
        let hit = index.lookup_prefix(c, prompt_tokens(i as u64)).unwrap();
        black_box(index.record(hit.record).tokens());
    }
    per_op("prefix lookup, hit (first pass)", n as usize, t);
    let t = Instant::now();
    for (i, c) in chains.iter().enumerate() {
        black_box(index.lookup_prefix(c, prompt_tokens(i as u64)).unwrap());
    }
    per_op("prefix lookup, hit (second pass, re-serves)", n as usize, t);
    let diverging: Vec<[u64; BLOCKS]> = chains
        .iter()
        .map(|c| {
            let mut c = *c;
            c[5] ^= 1;
            c
        })
        .collect();
    let t = Instant::now();
    for c in &diverging {
        black_box(index.lookup_prefix(c, 130).unwrap_err());
    }
    per_op("prefix lookup, miss at block 5 of 8", n as usize, t);
    println!("stats: {}", index.stats());

    let ids: Vec<String> = (0..n)
        .map(|i| format!("cmpl-replay-{i}-0-3f2a9c1b"))
        .collect();
    let mut index = ReplayIndex::load(std::slice::from_ref(&plain), all).unwrap();
    let t = Instant::now();
    for id in &ids {
        let hit = index.lookup_index(id).unwrap();
        black_box(index.record(hit.record).steps());
    }
    per_op("index lookup (cmpl-replay-<i>-0-<hex>)", n as usize, t);
    drop(index);

    let shape = ReplayIndex::load(std::slice::from_ref(&plain), ReplayLoadOptions::default());
    println!(
        "index without tokens/steps (prefix + shape only): {:.1} MiB",
        shape.unwrap().memory_bytes() as f64 / (1 << 20) as f64
    );

    let t = Instant::now();
    write_trace(&gz, n);
    let gz_write = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let index = ReplayIndex::load(std::slice::from_ref(&gz), all).unwrap();
    println!(
        "load (tokens+steps, gzip):                  {:.2} s ({:.0} MiB file, written in {gz_write:.1} s)",
        t.elapsed().as_secs_f64(),
        std::fs::metadata(&gz).map_or(0, |m| m.len()) as f64 / (1 << 20) as f64
    );
    assert_eq!(index.len(), n as usize);
    let _ = std::fs::remove_file(&plain);
    let _ = std::fs::remove_file(&gz);
}
