//! A prefix-cache mix's prompts as a `timed_trace` dataset file, which `bench serve
//! --dataset-name timed_trace` sends: the shared and private blocks of each prompt, drawn
//! deterministically from a seed.

use std::path::Path;

use super::{HASH_BLOCK, Workload};

impl Workload {
    /// A prefix-cache mix's prompts as a `timed_trace` dataset (`bench serve
    /// --dataset-name timed_trace`: one JSON object a line, `input_length`,
    /// `output_length` and `hash_ids`, each id standing for `HASH_BLOCK` fixed tokens):
    /// the file name and its text, `None` for any other load. Lengths are drawn as
    /// `--random-range-ratio` draws them; a warm prompt (the shape's hit fraction) starts
    /// with the whole blocks of one shared prefix chain that fit its share, the rest of it
    /// and every cold prompt are blocks no other prompt has. Deterministic in `seed`.
    pub fn dataset(&self, requests: u32, seed: u64) -> Option<(String, String)> {
        let (hit, ratio) = self.shape.cache?;
        let mut rng = SplitMix(seed ^ 0x7072_6566_6978_6d69);
        let draw = |rng: &mut SplitMix, len: u32, r: f64| -> u32 {
            let lo = (f64::from(len) * (1.0 - r)).floor() as u32;
            let hi = (f64::from(len) * (1.0 + r)).ceil() as u32;
            lo.max(1) + (rng.unit() * f64::from(hi - lo.max(1) + 1)) as u32
        };
        let blocks = |tokens: u32| tokens.div_ceil(HASH_BLOCK);
        // private ids start past any shared chain a prompt can hold
        let mut next_private = u64::from(blocks(self.shape.max_total())) + 1;
        let mut text = String::new();
        for _ in 0..requests {
            let input = draw(&mut rng, self.shape.input, self.shape.range.0);
            let output = draw(&mut rng, self.shape.output, self.shape.range.1);
            let shared = if rng.unit() < hit {
                (f64::from(input) * ratio) as u32 / HASH_BLOCK
            } else {
                0
            };
            let mut ids: Vec<u64> = (1..=u64::from(shared)).collect();
            for _ in shared..blocks(input) {
                ids.push(next_private);
                next_private += 1;
            }
            let ids: Vec<String> = ids.iter().map(u64::to_string).collect();
            text.push_str(&format!(
                "{{\"timestamp\": 0, \"input_length\": {input}, \"output_length\": {output}, \"hash_ids\": [{}]}}\n",
                ids.join(", ")
            ));
        }
        Some((
            format!("{}-s{seed}-n{requests}.timed-trace.jsonl", self.name),
            text,
        ))
    }
}

impl Workload {
    /// Write [`Self::dataset`]'s file into `dir` (created if missing), where
    /// [`Self::bench_args`] points `--dataset-path`; nothing for a load without one.
    pub fn write_dataset(&self, requests: u32, seed: u64, dir: &Path) -> std::io::Result<()> {
        if let Some((file, text)) = self.dataset(requests, seed) {
            std::fs::create_dir_all(dir)?;
            std::fs::write(dir.join(file), text)?;
        }
        Ok(())
    }
}

/// A seeded stream of uniform draws in [0, 1).
struct SplitMix(u64);

impl SplitMix {
    fn unit(&mut self) -> f64 {
        (crate::rng::splitmix64(&mut self.0) >> 11) as f64 / (1u64 << 53) as f64
    }
}
