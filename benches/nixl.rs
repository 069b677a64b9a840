//! NIXL block-READ throughput on this machine vs a plain memcpy of the same bytes
//! (`cargo bench --features nixl --bench nixl`; needs `cargo xtask fetch --nixl`).
//!
//! For each block size, two 64 MiB pools (prefill, decode) on their own NIXL agents (UCX,
//! DRAM, one process): the decode pool READs every block of the prefill pool in one
//! transfer request, the way vLLM reads a request's blocks. "scattered" reads the remote
//! blocks in a shuffled order (NIXL cannot merge neighbours: one descriptor per block);
//! "contiguous" reads them in order (NIXL may merge them into one). memcpy copies the same
//! blocks in the same scattered order with `copy_from_slice`. Each figure is the median of
//! REPS timed runs after one warm-up (the first READ pays the UCX connection set-up, shown
//! apart). Every byte of the last READ is verified against the pattern.

use std::time::{Duration, Instant};

use vllm_vcr::play::pd::nixl::{NixlPool, fill_pattern, load_runtime};

const POOL: usize = 64 << 20;
const REPS: usize = 5;
const T: Duration = Duration::from_secs(30);

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// A deterministic shuffle of 0..n (xorshift Fisher-Yates).
fn shuffled(n: usize, mut seed: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        v.swap(i, (seed % (i as u64 + 1)) as usize);
    }
    v
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn main() {
    if let Err(e) = load_runtime() {
        eprintln!("{e:#}");
        std::process::exit(2);
    }
    println!(
        "NIXL (nixl-cu12 {}) READ, DRAM->DRAM, UCX, one process, {} MiB per READ, median of {REPS}",
        vllm_vcr::frontends::NIXL_VERSION,
        POOL >> 20
    );
    println!(
        "UCX_TLS={} (unset: UCX picks), load average {}",
        std::env::var("UCX_TLS").unwrap_or_else(|_| "unset".into()),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    println!(
        "| block | blocks | first READ ms | NIXL scattered GB/s | NIXL contiguous GB/s | memcpy GB/s | 1-block READ us |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for bs in [4 << 10, 64 << 10, 512 << 10, 2 << 20] {
        let n = POOL / bs;
        let mut p = NixlPool::new(&format!("bench-prefill-{bs}"), n, bs).unwrap();
        let mut d = NixlPool::new(&format!("bench-decode-{bs}"), n, bs).unwrap();
        let remote = shuffled(n, 0x9e37_79b9_7f4a_7c15 ^ bs as u64);
        let local: Vec<usize> = (0..n).collect();
        let req = format!("bench-{bs}");
        p.fill(&req, &remote).unwrap();
        let info = p.info().unwrap();
        d.load_remote(&info).unwrap();

        let first = d.read_blocks(&info, &remote, &local, &req, T).unwrap();
        let mut scattered = Vec::new();
        for _ in 0..REPS {
            let s = d.read_blocks(&info, &remote, &local, &req, T).unwrap();
            scattered.push(gbps(s.bytes, s.elapsed.as_secs_f64()));
        }
        d.verify(&req, &local).unwrap();
        p.wait_notification(d.name(), &format!("{req}:1"), T)
            .unwrap();

        let mut contiguous = Vec::new();
        for _ in 0..REPS {
            let s = d.read_blocks(&info, &local, &local, "c", T).unwrap();
            contiguous.push(gbps(s.bytes, s.elapsed.as_secs_f64()));
        }

        let mut one = Vec::new();
        for i in 0..21 {
            let s = d.read_blocks(&info, &[i % n], &[i % n], "one", T).unwrap();
            one.push(s.elapsed.as_secs_f64() * 1e6);
        }

        // memcpy of the same blocks in the same order
        let mut src = vec![0u8; POOL];
        for (i, &b) in remote.iter().enumerate() {
            fill_pattern(&mut src[b * bs..(b + 1) * bs], &req, i);
        }
        let mut dst = vec![0u8; POOL];
        dst.copy_from_slice(&src); // fault the pages in
        let mut copy = Vec::new();
        for _ in 0..REPS {
            let t = Instant::now();
            for (&l, &r) in local.iter().zip(&remote) {
                dst[l * bs..(l + 1) * bs].copy_from_slice(&src[r * bs..(r + 1) * bs]);
            }
            std::hint::black_box(&mut dst);
            copy.push(gbps(POOL, t.elapsed().as_secs_f64()));
        }
        assert!(dst.chunks(bs).zip(&remote).all(|(c, &r)| c == p.block(r)));

        println!(
            "| {} KiB | {n} | {:.1} | {:.2} | {:.2} | {:.2} | {:.0} |",
            bs >> 10,
            first.elapsed.as_secs_f64() * 1e3,
            median(scattered),
            median(contiguous),
            median(copy),
            median(one),
        );
    }
}
