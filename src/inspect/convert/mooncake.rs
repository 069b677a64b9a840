//! The Mooncake / "timed trace" JSONL, both ways.
//!
//! One request a line: `{"timestamp": 27482, "input_length": 6472, "output_length": 26,
//! "hash_ids": [46, 47, …]}` — arrival in milliseconds, prompt and output lengths in tokens,
//! and one integer id per block of `--block-size` tokens of the prompt (512 in Mooncake's
//! public traces), the last block possibly partial, so a well-formed line has
//! `ceil(input_length / block size)` ids. Two requests share a prompt prefix exactly as far
//! as their ids agree: an id names its block *and everything before it*, like vLLM's
//! chained block hashes.
//!
//! `--from mooncake`: `arrival_ms` = `timestamp`, `prompt_tokens` = `input_length`,
//! `output_tokens` = `output_length`, `block_hashes` = `hash_ids`; the block size goes into
//! the meta line. Other keys of a line (`session_id`, `delay`, …) are kept in the record
//! line under `"mooncake"`, which trace readers ignore and `--to` writes back.
//!
//! `--to mooncake`: the reverse, in arrival order, with these rules:
//! - a record without `arrival_ms` is skipped (a timed trace needs one);
//! - the ids must cover the prompt: replayers build a prompt of `len(hash_ids) × block size`
//!   tokens cut to `input_length` (`vllm-rs bench serve` sends an empty prompt for `[]`).
//!   Traces recorded by the tap hash only *full* blocks (vLLM caches no partial block), so
//!   the partial tail block — and every block of a record without hashes — gets a fresh id,
//!   used by no other request: "not shared", which is what the trace knows about it;
//! - fresh ids start above the trace's largest integer hash; string hashes are numbered
//!   the same way in first-seen order (the format has integer ids only);
//! - `--block-size` a multiple `m` of the trace's block size merges every `m` hashes into
//!   one id: the hash of a coarse block's last fine block names the same prefix, so sharing
//!   is kept exactly. A finer or non-multiple size cannot be derived and is refused.
//!
//! Round trip: `--from` then `--to` gives back every well-formed line value for value,
//! byte for byte when the file is compact JSON with the four keys in the usual order and
//! integer timestamps (extra keys follow in alphabetical order). A line whose `hash_ids`
//! fall short of its `input_length` comes back padded with fresh ids (`--from` says how
//! many such lines it saw).

use std::collections::{BTreeMap, HashMap};
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use serde_json::Value;
use sim_trace::fastjson;
use sim_trace::trace::{
    BlockHash, JsonlReader, TraceItem, TraceLine, TraceMeta, TraceRecord, TraceWriter,
    contains_bytes, parse_line, parse_line_as,
};

use super::mooncake_line::{
    HashIds, MAX_EXACT, MooncakeIn, write_mooncake_line, write_record_line,
};
use super::{ConvertArgs, OutputGuard, Report, trace_err};
use crate::inspect::progress::Progress;

/// Mooncake's public traces hash 512-token blocks.
pub const MOONCAKE_BLOCK_SIZE: u32 = 512;

/// The key under which a record keeps a Mooncake line's other keys.
const EXTRA_KEY: &str = "mooncake";
const EXTRA_KEY_QUOTED: &[u8] = b"\"mooncake\"";

/// The keys of the format.
const KEYS: [&str; 4] = ["timestamp", "input_length", "output_length", "hash_ids"];

fn line_error(path: &Path, line: u64, what: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("{}:{line}: {what}", path.display())
}

fn uint(path: &Path, line: u64, value: Option<&Value>, key: &str) -> Result<u32> {
    let v = value.ok_or_else(|| line_error(path, line, format!("missing `{key}`")))?;
    let n = v
        .as_u64()
        .or_else(|| {
            v.as_f64()
                .filter(|f| *f >= 0.0 && f.fract() == 0.0 && *f <= u64::MAX as f64)
                .map(|f| f as u64)
        })
        .ok_or_else(|| {
            line_error(
                path,
                line,
                format!("`{key}` must be a non-negative integer, got {v}"),
            )
        })?;
    u32::try_from(n).map_err(|_| line_error(path, line, format!("`{key}` {n} is too large")))
}

pub fn from_mooncake(args: &ConvertArgs, guard: &mut OutputGuard) -> Result<Report> {
    let input = &args.input;
    let block_size = args.block_size.unwrap_or(MOONCAKE_BLOCK_SIZE);
    let mut reader = JsonlReader::open(input).map_err(trace_err)?;
    let mut meta = TraceMeta::new();
    meta.block_size = Some(block_size);
    guard.arm();
    let mut w = TraceWriter::create(&args.output, &meta).map_err(trace_err)?;
    let mut report = Report::default();
    let mut extra_keys = std::collections::BTreeSet::new();
    // Lines whose ids do not cover the prompt at `block_size` tokens an id.
    let mut off_count = 0u64;
    let mut off_example = None;
    let mut without_ids = 0u64;
    let mut progress = Progress::new("convert: lines");
    let mut index = 0u64;
    let mut buf = Vec::with_capacity(4096);
    while let Some(item) = reader.next_with(fastjson::from_slice::<MooncakeIn>) {
        let obj = item.map_err(trace_err)?;
        let line = reader.line();
        progress.tick();
        if !obj.object {
            bail!(line_error(input, line, "expected a JSON object"));
        }
        let timestamp = match &obj.timestamp {
            Some(Value::Number(n)) => {
                if n.as_u64().is_some_and(|t| t > MAX_EXACT) {
                    bail!(line_error(
                        input,
                        line,
                        format!("`timestamp` {n} is too large to keep exactly (ms fit in 2^53)")
                    ));
                }
                match n.as_f64() {
                    Some(t) if t.is_finite() && t >= 0.0 => t,
                    _ => bail!(line_error(
                        input,
                        line,
                        format!("`timestamp` must be a non-negative number of ms, got {n}")
                    )),
                }
            }
            Some(other) => bail!(line_error(
                input,
                line,
                format!("`timestamp` must be a number of ms, got {other}")
            )),
            None => bail!(line_error(input, line, "missing `timestamp`")),
        };
        let input_length = uint(input, line, obj.input_length.as_ref(), "input_length")?;
        let output_length = uint(input, line, obj.output_length.as_ref(), "output_length")?;
        let hash_ids = match obj.hash_ids {
            None | Some(HashIds::Null) => {
                without_ids += 1;
                None
            }
            Some(HashIds::Ints(ids)) => Some(ids),
            Some(HashIds::BadElement(v)) => bail!(line_error(
                input,
                line,
                format!("`hash_ids` must hold non-negative integers, got {v}")
            )),
            Some(HashIds::NotArray(other)) => bail!(line_error(
                input,
                line,
                format!("`hash_ids` must be an array, got {other}")
            )),
        };
        let wanted = input_length.div_ceil(block_size) as usize;
        if let Some(ids) = &hash_ids
            && ids.len() != wanted
        {
            off_count += 1;
            off_example.get_or_insert_with(|| {
                format!(
                    "line {line}: {} ids for {input_length} tokens, {wanted} expected",
                    ids.len()
                )
            });
        }
        for k in obj.extra.keys() {
            if !extra_keys.contains(k) {
                extra_keys.insert(k.clone());
            }
        }
        write_record_line(
            &mut buf,
            index,
            (input_length, output_length, timestamp),
            hash_ids.as_deref().unwrap_or_default(),
            &obj.extra,
        )?;
        w.write_raw_line(&buf).map_err(trace_err)?;
        index += 1;
        report.written += 1;
    }
    progress.finish();
    w.finish().map_err(trace_err)?;
    if !extra_keys.is_empty() {
        report.notes.push(format!(
            "kept keys the trace schema has no field for under \"{EXTRA_KEY}\" in each record (--to mooncake writes them back): {}",
            extra_keys.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    if without_ids > 0 {
        report.notes.push(format!(
            "{without_ids} lines have no hash_ids (no prefix sharing known); --to mooncake gives them fresh ids"
        ));
    }
    if let Some(example) = off_example {
        report.notes.push(format!(
            "{off_count} lines have a hash_ids count other than ceil(input_length / {block_size}) (e.g. {example}): is --block-size right? --to mooncake pads short ones with fresh ids"
        ));
    }
    Ok(report)
}

/// One line of a trace, with the Mooncake keys a record kept.
enum Line {
    Meta,
    Record(Box<TraceRecord>, BTreeMap<String, Value>),
}

/// The keys a record kept under `"mooncake"` (the rest of the line skipped unparsed).
#[derive(Deserialize)]
struct Kept {
    #[serde(default)]
    mooncake: Option<Value>,
}

/// Reads a trace, with the keys under `"mooncake"`: the record straight from the line's
/// text as every trace reader does, and the kept keys from a second look at the lines that
/// name them (going through a `serde_json::Value` for every line cost half the run).
struct Lines {
    reader: JsonlReader,
}

impl Lines {
    fn open(path: &Path) -> Result<Self> {
        Ok(Self {
            reader: JsonlReader::open(path).map_err(trace_err)?,
        })
    }

    fn line(&self) -> u64 {
        self.reader.line()
    }
}

impl Iterator for Lines {
    type Item = Result<Line>;

    fn next(&mut self) -> Option<Result<Line>> {
        Some(self.reader.next_with(parse)?.map_err(trace_err))
    }
}

fn parse(text: &[u8]) -> std::result::Result<Line, serde_json::Error> {
    let record = match parse_line(text)? {
        TraceItem::Meta(_) => return Ok(Line::Meta),
        TraceItem::Record(r) => r,
    };
    // Only a line that names the key can keep any.
    let mut extra = BTreeMap::new();
    if contains_bytes(text, EXTRA_KEY_QUOTED)
        && text.trim_ascii_start().starts_with(b"{")
        && let Some(Value::Object(kept)) = fastjson::from_slice::<Kept>(text)?.mooncake
    {
        extra.extend(
            kept.into_iter()
                .filter(|(k, _)| !KEYS.contains(&k.as_str())),
        );
    }
    Ok(Line::Record(Box::new(record), extra))
}

/// What the first pass reads of a record; the rest of the line (its latencies: most of a
/// tap trace) is skipped undecoded, and read by the second pass.
#[derive(Deserialize)]
struct ScanRecord {
    #[serde(default)]
    arrival_ms: Option<f64>,
    #[serde(default)]
    block_hashes: Vec<BlockHash>,
}

/// What the first pass learns.
#[derive(Default)]
struct Scan {
    block_size: Option<u32>,
    any_hashes: bool,
    max_int: Option<u64>,
    /// Records with an arrival, and whether they arrive in file order.
    timed: u64,
    sorted: bool,
}

fn scan(path: &Path) -> Result<Scan> {
    let mut s = Scan {
        sorted: true,
        ..Scan::default()
    };
    let mut last = f64::NEG_INFINITY;
    let mut lines = JsonlReader::open(path).map_err(trace_err)?;
    let mut progress = Progress::new("convert: scanning");
    while let Some(item) = lines.next_with(parse_line_as::<ScanRecord>) {
        match item.map_err(trace_err)? {
            // A block size of 0 says nothing.
            TraceLine::Meta(m) => match (s.block_size, m.block_size.filter(|&b| b > 0)) {
                (Some(a), Some(b)) if a != b => bail!(
                    "{}:{}: a second meta line says block_size {b}, the first {a}: one trace, one block size",
                    path.display(),
                    lines.line()
                ),
                (None, b) => s.block_size = b,
                _ => {}
            },
            TraceLine::Record(r) => {
                progress.tick();
                for h in &r.block_hashes {
                    s.any_hashes = true;
                    if let BlockHash::Int(v) = h {
                        s.max_int = Some(s.max_int.map_or(*v, |m| m.max(*v)));
                    }
                }
                if let Some(a) = r.arrival_ms {
                    s.timed += 1;
                    if a < last {
                        s.sorted = false;
                    }
                    last = last.max(a);
                }
            }
        }
    }
    progress.finish();
    Ok(s)
}

/// Turns block hashes into Mooncake ids.
struct Ids {
    /// Trace hashes per output id (1, or the coarsening factor).
    factor: usize,
    /// Tokens per output id.
    block_size: u32,
    /// The next fresh id; `None` once the integers ran out.
    next: Option<u64>,
    strings: HashMap<String, u64>,
    fresh: u64,
    records_with_fresh: u64,
}

impl Ids {
    /// An id no hash of the trace has.
    fn unused(&mut self) -> Result<u64> {
        let Some(id) = self.next else {
            bail!("no unused id left: the trace's block hashes reach u64::MAX");
        };
        self.next = id.checked_add(1);
        Ok(id)
    }

    /// An id for a block no other request shares.
    fn fresh(&mut self) -> Result<u64> {
        self.fresh += 1;
        self.unused()
    }

    fn id(&mut self, h: &BlockHash) -> Result<u64> {
        match h {
            BlockHash::Int(v) => Ok(*v),
            BlockHash::Str(s) => {
                if let Some(id) = self.strings.get(s) {
                    return Ok(*id);
                }
                let id = self.unused()?;
                self.strings.insert(s.clone(), id);
                Ok(id)
            }
        }
    }

    /// The ids of one record: its hashes (merged by `factor`), then fresh ids for the
    /// blocks of the prompt they do not cover.
    fn of(&mut self, r: &TraceRecord) -> Result<Vec<u64>> {
        let wanted = r.prompt_tokens.div_ceil(self.block_size) as usize;
        let hashes = &r.block_hashes;
        let mut ids = Vec::with_capacity(wanted.max(hashes.len()));
        if self.factor == 1 {
            for h in hashes {
                ids.push(self.id(h)?);
            }
        } else {
            // Coarse block j ends at token min((j+1)·B, P); the trace hash of the fine
            // block holding that last token names the same prefix.
            let fine = (self.block_size as usize) / self.factor;
            let prompt = r.prompt_tokens as usize;
            for j in 0..wanted {
                let end = ((j + 1) * self.block_size as usize).min(prompt);
                match hashes.get((end - 1) / fine) {
                    Some(h) => ids.push(self.id(h)?),
                    None => break,
                }
            }
        }
        let before = self.fresh;
        while ids.len() < wanted {
            let id = self.fresh()?;
            ids.push(id);
        }
        if self.fresh > before {
            self.records_with_fresh += 1;
        }
        Ok(ids)
    }
}

/// A temporary file next to the output, removed when dropped.
struct Temp {
    path: PathBuf,
}

impl Drop for Temp {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

pub fn to_mooncake(args: &ConvertArgs, guard: &mut OutputGuard) -> Result<Report> {
    let input = &args.input;
    let scan = scan(input)?;
    let mut report = Report::default();

    // The unit of the trace's hashes, and of the ids to write.
    let (trace_bs, block_size) = match (scan.block_size, args.block_size) {
        (Some(t), None) => (t, t),
        (Some(t), Some(b)) => (t, b),
        (None, Some(b)) => {
            if scan.any_hashes {
                report.notes.push(format!(
                    "the trace's meta line gives no block_size: took its block hashes to cover {b} tokens each (--block-size)"
                ));
            }
            (b, b)
        }
        (None, None) if scan.any_hashes => bail!(
            "{}: the trace has block hashes but its meta line does not say how many tokens each covers; pass --block-size N (vLLM's default block size is 16)",
            input.display()
        ),
        (None, None) => (MOONCAKE_BLOCK_SIZE, MOONCAKE_BLOCK_SIZE),
    };
    if block_size != trace_bs {
        if block_size < trace_bs || block_size % trace_bs != 0 {
            bail!(
                "{}: the trace's block hashes cover {trace_bs} tokens each (meta block_size); --block-size {block_size} is not a multiple of that, and finer ids cannot be derived from coarser hashes (use --block-size {trace_bs}, or a multiple of it)",
                input.display()
            );
        }
        report.notes.push(format!(
            "merged every {} block hashes of {trace_bs} tokens into one id of {block_size} tokens",
            block_size / trace_bs
        ));
    }
    let mut ids = Ids {
        factor: (block_size / trace_bs) as usize,
        block_size,
        next: match scan.max_int {
            None => Some(0),
            Some(m) => m.checked_add(1),
        },
        strings: HashMap::new(),
        fresh: 0,
        records_with_fresh: 0,
    };

    // In arrival order: straight to the output when the trace is already, else through an
    // index of (arrival, offset) over a temporary file.
    guard.arm();
    let mut sink = TraceWriter::create_without_meta(&args.output).map_err(trace_err)?;
    let mut temp = None;
    let mut index: Vec<(f64, u64, u32)> = Vec::new();
    let mut temp_writer = None;
    if !scan.sorted {
        let name = args
            .output
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "mooncake".into());
        let path = args
            .output
            .with_file_name(format!(".{name}.unsorted-{}", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .with_context(|| format!("creating {}", path.display()))?;
        temp = Some(Temp { path });
        temp_writer = Some(BufWriter::with_capacity(1 << 16, file));
        index.reserve(scan.timed as usize);
    }

    let mut lines = Lines::open(input)?;
    let mut incomplete = 0u64;
    let mut buf = Vec::with_capacity(4096);
    let mut offset = 0u64;
    let mut progress = Progress::new("convert: records");
    while let Some(item) = lines.next() {
        let (record, extra) = match item? {
            Line::Meta => continue,
            Line::Record(r, extra) => (r, extra),
        };
        progress.tick();
        let Some(arrival) = record.arrival_ms else {
            report.skip("no arrival_ms (a timed trace needs one)", || {
                format!("{}:{}", input.display(), lines.line())
            });
            continue;
        };
        if record.incomplete {
            incomplete += 1;
        }
        let hash_ids = ids.of(&record)?;
        buf.clear();
        write_mooncake_line(
            &mut buf,
            (arrival, record.prompt_tokens, record.output_tokens),
            &hash_ids,
            &extra,
        )?;
        match temp_writer.as_mut() {
            None => sink.write_raw_line(&buf).map_err(trace_err)?,
            Some(t) => {
                buf.push(b'\n');
                t.write_all(&buf).context("writing the temporary file")?;
                index.push((arrival, offset, buf.len() as u32));
                offset += buf.len() as u64;
            }
        }
        report.written += 1;
    }
    progress.finish();

    if let (Some(t), Some(temp)) = (temp_writer, temp.as_ref()) {
        let file = t
            .into_inner()
            .map_err(|e| e.into_error())
            .context("writing the temporary file")?;
        index.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut progress = Progress::new("convert: sorting by arrival");
        for &(_, at, len) in &index {
            progress.tick();
            buf.resize(len as usize, 0);
            file.read_exact_at(&mut buf, at)
                .with_context(|| format!("reading {}", temp.path.display()))?;
            sink.write_raw_line(&buf[..buf.len() - 1])
                .map_err(trace_err)?;
        }
        progress.finish();
        report
            .notes
            .push("records were not in arrival order (the tap writes them as requests finish): wrote them sorted by arrival".into());
    }
    drop(temp);
    sink.finish().map_err(trace_err)?;

    if ids.fresh > 0 {
        report.notes.push(format!(
            "{} records got {} fresh ids (used by no other request) for prompt blocks without a block hash: the partial last block, or every block of a record without hashes",
            ids.records_with_fresh, ids.fresh
        ));
    }
    if !ids.strings.is_empty() {
        report.notes.push(format!(
            "{} distinct string block hashes were numbered in first-seen order",
            ids.strings.len()
        ));
    }
    if incomplete > 0 {
        report.notes.push(format!(
            "{incomplete} incomplete records were written with the output they produced before they ended"
        ));
    }
    report.notes.push(format!(
        "each hash id stands for {block_size} tokens: replay with `vllm-rs bench serve --dataset-name timed_trace --dataset-path {} --timed-trace-chunk-hash-size {block_size} --timed-trace-sec-multiplier 0.001`",
        args.output.display()
    ));
    Ok(report)
}
