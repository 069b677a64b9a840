//! Loading: stream every file once, keep what serving needs, then order by arrival and
//! build the prefix trie.

use std::path::{Path, PathBuf};

use super::prefix::Trie;
use super::{
    NO_FINISH, Rec, ReplayError, ReplayIndex, ReplayLoadOptions, ReplayStats, Span, TraceFile,
};
use crate::trace::{BlockHash, TraceError, TraceItem, TraceMeta, TraceReader, TraceRecord};

/// A record as read, before the arrival sort.
struct Staged {
    rec: Rec,
    arrival: Option<f64>,
    /// Its integer chain in `Builder::hashes` (dropped once the trie is built).
    chain: Span,
}

/// Per-file counts behind the load's warnings and errors.
#[derive(Default)]
struct FileCounts {
    records: usize,
    with_tokens: usize,
    with_ttft: usize,
    untimed: usize,
    string_hashes: usize,
}

struct Builder {
    opts: ReplayLoadOptions,
    files: Vec<TraceFile>,
    warnings: Vec<String>,
    /// The first declared block size and the file that declared it.
    block_size: Option<(u32, PathBuf)>,
    staged: Vec<Staged>,
    ids: String,
    finish_names: Vec<Box<str>>,
    tokens: Vec<u32>,
    gaps_ms: Vec<f32>,
    chunk_tokens: Vec<u32>,
    max_chunk_tokens: u32,
    hashes: Vec<u64>,
}

impl ReplayIndex {
    /// Stream `paths` (`.gz` transparently) into an index. See the [module docs](super)
    /// for the order and the matching rules; [`ReplayIndex::warnings`] lists what the load
    /// noticed but accepted.
    ///
    /// Errors: an unreadable file or a line that does not parse (naming file and line);
    /// meta lines that disagree on `block_size`; with `opts.tokens`, a file whose records
    /// carry no `output_token_ids` at all; with `opts.steps`, a file without any `ttft_ms`;
    /// no records at all. A gzip stream cut short (a tap killed mid-capture) is accepted up
    /// to its last complete line, with a warning.
    pub fn load(paths: &[PathBuf], opts: ReplayLoadOptions) -> Result<Self, ReplayError> {
        if paths.is_empty() {
            return Err(ReplayError::NoPaths);
        }
        let mut b = Builder {
            opts,
            files: Vec::with_capacity(paths.len()),
            warnings: Vec::new(),
            block_size: None,
            staged: Vec::new(),
            ids: String::new(),
            finish_names: Vec::new(),
            tokens: Vec::new(),
            gaps_ms: Vec::new(),
            chunk_tokens: Vec::new(),
            max_chunk_tokens: 0,
            hashes: Vec::new(),
        };
        for path in paths {
            b.read_file(path)?;
        }
        b.finish(paths)
    }
}

fn too_large(path: &Path, what: &'static str) -> ReplayError {
    ReplayError::TooLarge {
        path: path.to_path_buf(),
        what,
    }
}

/// Where `len` items appended at `start` of an arena go, if the arena's 32-bit offsets
/// can hold them.
fn span(start: usize, len: usize, path: &Path, what: &'static str) -> Result<Span, ReplayError> {
    match start.checked_add(len) {
        Some(end) if end <= u32::MAX as usize => Ok(Span {
            start: start as u32,
            len: len as u32,
        }),
        _ => Err(too_large(path, what)),
    }
}

/// Append `items` to an arena and return where they went.
fn push_span<T: Copy>(
    arena: &mut Vec<T>,
    items: &[T],
    path: &Path,
    what: &'static str,
) -> Result<Span, ReplayError> {
    let s = span(arena.len(), items.len(), path, what)?;
    arena.extend_from_slice(items);
    Ok(s)
}

impl Builder {
    fn read_file(&mut self, path: &Path) -> Result<(), ReplayError> {
        let file = u32::try_from(self.files.len()).map_err(|_| too_large(path, "files"))?;
        self.files.push(TraceFile {
            path: path.to_path_buf(),
            config_hashes: Vec::new(),
            block_size: None,
            records: 0,
        });
        let mut counts = FileCounts::default();
        let mut reader = TraceReader::open(path)?;
        while let Some(item) = reader.next() {
            let item = match item {
                Ok(item) => item,
                Err(TraceError::Truncated { last_good_line, .. }) => {
                    self.warnings.push(format!(
                        "{}: gzip stream cut short (the capture was killed?); indexed its complete lines up to line {last_good_line}",
                        path.display()
                    ));
                    break;
                }
                Err(e) => return Err(e.into()),
            };
            match item {
                TraceItem::Meta(meta) => self.meta(path, &meta)?,
                TraceItem::Record(r) => self.record(path, file, reader.line(), r, &mut counts)?,
            }
        }
        self.files[file as usize].records = counts.records;
        self.check_file(path, &counts)
    }

    fn meta(&mut self, path: &Path, meta: &TraceMeta) -> Result<(), ReplayError> {
        if let Some(w) = meta.newer_schema_warning() {
            let w = format!("{}: {w}", path.display());
            if !self.warnings.contains(&w) {
                self.warnings.push(w);
            }
        }
        let info = self.files.last_mut().expect("read_file pushed the file");
        if let Some(h) = &meta.config_hash
            && !info.config_hashes.contains(h)
        {
            info.config_hashes.push(h.clone());
        }
        let Some(size) = meta.block_size else {
            return Ok(());
        };
        info.block_size.get_or_insert(size);
        match &self.block_size {
            None => self.block_size = Some((size, path.to_path_buf())),
            Some((expected, first)) if *expected != size => {
                return Err(ReplayError::BlockSizeMismatch {
                    path: path.to_path_buf(),
                    found: size,
                    first: first.clone(),
                    expected: *expected,
                });
            }
            Some(_) => {}
        }
        Ok(())
    }

    fn record(
        &mut self,
        path: &Path,
        file: u32,
        line: u64,
        r: TraceRecord,
        counts: &mut FileCounts,
    ) -> Result<(), ReplayError> {
        counts.records += 1;
        let id = match &r.request_id {
            Some(id) => {
                let s = span(self.ids.len(), id.len(), path, "request id bytes")?;
                self.ids.push_str(id);
                Some(s)
            }
            None => None,
        };
        // Only integer hashes can be compared with the prompt's; a record with any string
        // hash is left out of the trie rather than matched on a misleading partial chain.
        let chain_start = self.hashes.len();
        let mut ints = true;
        for h in &r.block_hashes {
            match h {
                BlockHash::Int(v) => self.hashes.push(*v),
                BlockHash::Str(_) => {
                    ints = false;
                    break;
                }
            }
        }
        if !ints {
            self.hashes.truncate(chain_start);
            counts.string_hashes += 1;
        }
        let chain = span(
            chain_start,
            self.hashes.len() - chain_start,
            path,
            "block hashes",
        )?;
        let blocks = chain.len;

        let tokens = match (&r.output_token_ids, self.opts.tokens) {
            (Some(ids), true) => Some(push_span(&mut self.tokens, ids, path, "token ids")?),
            _ => None,
        };
        counts.with_tokens += usize::from(r.output_token_ids.is_some());
        counts.with_ttft += usize::from(r.ttft_ms.is_some());
        counts.untimed += usize::from(r.arrival_ms.is_none());

        let (mut gaps, mut chunk_tokens, mut first_chunk) = (Span::default(), None, 0);
        if self.opts.steps {
            // a gap past a day is a damaged or hostile trace: refuse it here, naming it,
            // rather than let the engine try to wait that long
            r.check_times().map_err(|why| TraceError::Invalid {
                path: path.to_path_buf(),
                line,
                why: format!(
                    "record {}: {why}",
                    crate::trace::record_name(&r, counts.records as u64 - 1)
                ),
            })?;
            first_chunk = r.first_chunk_tokens();
            gaps = span(self.gaps_ms.len(), r.itl_ms.len(), path, "gaps")?;
            self.gaps_ms.extend(r.itl_ms.iter().map(|&v| v as f32));
            if !r.itl_tokens.is_empty() {
                let max = r.itl_tokens.iter().copied().max().unwrap_or(1);
                self.max_chunk_tokens = self.max_chunk_tokens.max(max);
                let s = push_span(&mut self.chunk_tokens, &r.itl_tokens, path, "chunks")?;
                chunk_tokens = Some(s);
            } else if !r.itl_ms.is_empty() {
                self.max_chunk_tokens = self.max_chunk_tokens.max(1);
            }
        }

        let finish = match &r.finish_reason {
            None => NO_FINISH,
            Some(f) => match self.finish_names.iter().position(|n| **n == **f) {
                Some(i) => i as u16,
                None => {
                    let i = u16::try_from(self.finish_names.len())
                        .ok()
                        .filter(|&i| i != NO_FINISH)
                        .ok_or_else(|| too_large(path, "distinct finish reasons"))?;
                    self.finish_names.push(f.as_str().into());
                    i
                }
            },
        };

        self.staged.push(Staged {
            rec: Rec {
                id,
                file,
                line,
                prompt_tokens: r.prompt_tokens,
                output_tokens: r.output_tokens,
                blocks,
                finish,
                incomplete: r.incomplete,
                // a count of u32::MAX tokens is no count a trace holds: read as unknown
                reasoning: r.reasoning_tokens.unwrap_or(super::NO_REASONING),
                tokens,
                ttft_ms: r.ttft_ms,
                first_chunk,
                gaps,
                chunk_tokens,
            },
            arrival: r.arrival_ms,
            chain,
        });
        Ok(())
    }

    /// Per-file errors and warnings, once the file is read.
    fn check_file(&mut self, path: &Path, c: &FileCounts) -> Result<(), ReplayError> {
        let p = path.display();
        if c.records == 0 {
            self.warnings.push(format!("{p}: no request records"));
            return Ok(());
        }
        if self.opts.tokens && c.with_tokens == 0 {
            return Err(ReplayError::NoTokenIds {
                path: path.to_path_buf(),
            });
        }
        if self.opts.steps && c.with_ttft == 0 {
            return Err(ReplayError::NoTiming {
                path: path.to_path_buf(),
            });
        }
        let n = c.records;
        if self.opts.tokens && c.with_tokens < n {
            self.warnings.push(format!(
                "{p}: {} of {n} records have no output_token_ids; requests paired with them miss (no_tokens)",
                n - c.with_tokens
            ));
        }
        if self.opts.steps && c.with_ttft < n {
            self.warnings.push(format!(
                "{p}: {} of {n} records have no ttft_ms (no output before they ended); requests paired with them miss (no_steps)",
                n - c.with_ttft
            ));
        }
        if c.untimed > 0 {
            self.warnings.push(format!(
                "{p}: {} of {n} records have no arrival_ms; they are indexed after every timed record, in file order",
                c.untimed
            ));
        }
        if c.string_hashes > 0 {
            self.warnings.push(format!(
                "{p}: {} of {n} records carry string (non-integer) block hashes, which prompt hashes cannot match; --replay-match prefix will never serve them",
                c.string_hashes
            ));
        }
        Ok(())
    }

    fn finish(mut self, paths: &[PathBuf]) -> Result<ReplayIndex, ReplayError> {
        if self.staged.is_empty() {
            let paths: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
            return Err(ReplayError::Empty {
                paths: paths.join(", "),
            });
        }
        let last = paths.last().expect("paths is not empty");
        if u32::try_from(self.staged.len()).is_err() {
            return Err(too_large(last, "records"));
        }
        // Stable sort: equal arrivals keep file then line order; untimed records sort
        // after every timed one.
        let key = |s: &Staged| s.arrival.unwrap_or(f64::INFINITY);
        self.staged.sort_by(|a, b| key(a).total_cmp(&key(b)));

        let chains = self
            .staged
            .iter()
            .enumerate()
            .map(|(i, s)| (i as u32, &self.hashes[s.chain.range()], s.rec.prompt_tokens));
        let trie = Trie::build(chains).ok_or_else(|| too_large(last, "trie nodes"))?;
        if trie.indexed > 0 && self.block_size.is_none() {
            self.warnings.push(
                "no meta line declares block_size, so prompt hashes cannot be computed to match the traces' block_hashes".to_string(),
            );
        }
        let mut records: Vec<Rec> = self.staged.into_iter().map(|s| s.rec).collect();
        records.shrink_to_fit();
        let n = records.len();
        let mut tokens = self.tokens;
        let mut gaps_ms = self.gaps_ms;
        let mut chunk_tokens = self.chunk_tokens;
        let mut ids = self.ids;
        tokens.shrink_to_fit();
        gaps_ms.shrink_to_fit();
        chunk_tokens.shrink_to_fit();
        ids.shrink_to_fit();
        Ok(ReplayIndex {
            opts: self.opts,
            block_size: self.block_size.map(|b| b.0),
            files: self.files,
            warnings: self.warnings,
            records,
            ids,
            finish_names: self.finish_names,
            tokens,
            gaps_ms,
            chunk_tokens,
            max_chunk_tokens: self.max_chunk_tokens,
            trie,
            consumed: vec![false; n],
            stats: ReplayStats {
                records: n,
                ..ReplayStats::default()
            },
        })
    }
}
