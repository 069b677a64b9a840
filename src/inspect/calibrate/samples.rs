//! Each request's samples: what the capture says about it, and the `--dump-samples` CSV
//! with one row per request.

use std::io::Write;
use std::path::Path;

use anyhow::Result;
use serde_json::json;

use super::compare::{self, BUCKETS, SOURCES, Sample};

/// What the capture says about one request.
pub(super) struct Captured {
    pub(super) request_id: Option<String>,
    pub(super) arrival_ms: Option<f64>,
    pub(super) concurrency: Option<u32>,
    pub(super) sample: Option<Sample>,
}

/// `--dump-samples`: one row per request, in arrival order.
pub(super) struct Rows<'a> {
    pub(super) cap: &'a [&'a Captured],
    pub(super) concurrency: &'a [Option<u32>],
    pub(super) runs: [&'a [Option<Sample>]; 2],
}

impl Rows<'_> {
    pub(super) fn write(&self, path: &Path) -> Result<()> {
        let csv = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("csv"));
        let file = std::fs::File::create(path)?;
        let mut w = std::io::BufWriter::new(file);
        if csv {
            let mut head = vec![
                "index",
                "request_id",
                "arrival_ms",
                "concurrency",
                "cohort",
                "compared",
            ];
            let cols: Vec<String> = ["ttft_ms", "total_ms", "itl_ms"]
                .iter()
                .flat_map(|m| SOURCES.iter().map(move |s| format!("{s}_{m}")))
                .collect();
            head.extend(cols.iter().map(String::as_str));
            writeln!(w, "{}", head.join(","))?;
        }
        for (i, c) in self.cap.iter().enumerate() {
            let srcs = [
                c.sample.as_ref(),
                self.runs[0][i].as_ref(),
                self.runs[1][i].as_ref(),
            ];
            let compared = srcs.iter().all(Option::is_some);
            let cohort = self.concurrency[i].map(|x| BUCKETS[compare::bucket(x)].2);
            if csv {
                let opt = |v: Option<f64>| v.map_or(String::new(), |x| x.to_string());
                let mut row = vec![
                    i.to_string(),
                    csv_field(c.request_id.as_deref().unwrap_or("")),
                    opt(c.arrival_ms),
                    self.concurrency[i].map_or(String::new(), |x| x.to_string()),
                    cohort.unwrap_or("").to_string(),
                    compared.to_string(),
                ];
                row.extend(srcs.iter().map(|s| opt(s.map(|s| s.ttft_ms))));
                row.extend(srcs.iter().map(|s| opt(s.map(|s| s.total_ms))));
                row.extend(srcs.iter().map(|s| {
                    s.map_or(String::new(), |s| {
                        let g: Vec<String> = s.itl_ms.iter().map(f64::to_string).collect();
                        g.join(" ")
                    })
                }));
                writeln!(w, "{}", row.join(","))?;
            } else {
                let sample = |s: Option<&Sample>| {
                    s.map(|s| json!({"ttft_ms": s.ttft_ms, "total_ms": s.total_ms, "itl_ms": s.itl_ms}))
                };
                let row = json!({
                    "index": i,
                    "request_id": c.request_id,
                    "arrival_ms": c.arrival_ms,
                    "concurrency": self.concurrency[i],
                    "cohort": cohort,
                    "compared": compared,
                    "captured": sample(srcs[0]),
                    "modelled": sample(srcs[1]),
                    "knobs": sample(srcs[2]),
                });
                writeln!(w, "{row}")?;
            }
        }
        w.flush()?;
        Ok(())
    }
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}
