//! The public CSV request traces as workloads: the Azure LLM inference trace (both ways)
//! and BurstGPT (`--from`).
//!
//! Each row is one request: when it arrived and its prompt and output lengths. Nothing
//! else (no latencies, no prompt content), so the trace is a workload for `simulate` and
//! `calibrate-e2e`, not a capture.
//!
//! - Azure (`AzureLLMInferenceTrace_{code,conv}.csv`, 2023 and 2024):
//!   `TIMESTAMP,ContextTokens,GeneratedTokens`, the timestamp a UTC date
//!   `2023-11-16 18:15:46.6805900` (7 fractional digits; `T`, `Z` or `+00:00` also read).
//!   inference-perf's `trace_replay` reads it (`AzurePublicDatasetReader`): columns by
//!   position, the first data row as time zero. `--from azure` does the same: arrivals from
//!   the first row's millisecond (the meta line's `created_unix_ms`), which must be the
//!   earliest; `--to azure` gives the file back to the microsecond. `--to azure` writes that layout in arrival order, dated from the trace's
//!   `created_unix_ms` (1970-01-01 when it has none); a record without `arrival_ms` is
//!   skipped.
//! - BurstGPT (`BurstGPT_*.csv`): `Timestamp,Model,Request tokens,Response tokens,Total
//!   tokens,Log Type`, the timestamp in seconds from the trace's start, read by name as
//!   aiperf's and vLLM's BurstGPT loaders do (only `Timestamp`, `Request tokens` and
//!   `Response tokens` are required). Rows with 0 response tokens are requests that failed
//!   in the original service and are skipped, as vLLM's loader does; `Model` and `Log
//!   Type` ride along on the record under `"burstgpt"`.
//!
//! Both are read a row at a time (`.gz` too), with no quoting beyond plain `"…"` fields.

use std::collections::BTreeMap;

use anyhow::{Result, anyhow, bail};
use serde_json::Value;
use sim_trace::trace::{JsonlReader, TraceMeta, TraceReader, TraceRecord, TraceWriter};

use super::{ConvertArgs, OutputGuard, Report, client, trace_err};
use crate::inspect::progress::Progress;

/// The Azure trace's header, as inference-perf's reader expects it.
pub const AZURE_HEADER: &str = "TIMESTAMP,ContextTokens,GeneratedTokens";

/// Split one CSV row into fields (plain `"…"` quoting with `""` for a quote).
fn fields(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                cur.push('"');
                chars.next();
            }
            ('"', _) => quoted = !quoted,
            (',', false) => out.push(std::mem::take(&mut cur).trim().to_string()),
            (c, _) => cur.push(c),
        }
    }
    out.push(cur.trim().to_string());
    out
}

/// Days from 1970-01-01 to the civil date `y-m-d` (proleptic Gregorian).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The civil date of `days` from 1970-01-01.
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// An Azure timestamp (`2023-11-16 18:15:46.6805900`, UTC) in microseconds since the epoch.
fn parse_azure_time(s: &str) -> Option<i64> {
    let s = s.trim().trim_matches('"');
    let s = s.strip_suffix('Z').unwrap_or(s);
    let s = s.strip_suffix("+00:00").unwrap_or(s);
    let (date, time) = s.split_once([' ', 'T'])?;
    let mut d = date.split('-').map(|p| p.parse::<i64>().ok());
    let (y, mo, da) = (d.next()??, d.next()??, d.next()??);
    let (hms, frac) = time.split_once('.').unwrap_or((time, ""));
    let mut t = hms.split(':').map(|p| p.parse::<i64>().ok());
    let (h, mi, se) = (t.next()??, t.next()??, t.next()??);
    if d.next().is_some()
        || t.next().is_some()
        || !(1..=12).contains(&mo)
        || !(1..=31).contains(&da)
        || h > 23
        || mi > 59
        || se > 60
        || !frac.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    // microseconds: the first 6 digits, rounded by the 7th
    let digits: Vec<i64> = frac.bytes().map(|b| i64::from(b - b'0')).collect();
    let mut us = (0..6).fold(0, |acc, i| acc * 10 + digits.get(i).copied().unwrap_or(0));
    if digits.get(6).is_some_and(|&d| d >= 5) {
        us += 1;
    }
    let secs = days_from_civil(y, mo, da) * 86_400 + h * 3600 + mi * 60 + se;
    Some(secs * 1_000_000 + us)
}

/// An Azure timestamp for `us` microseconds since the epoch (7 fractional digits).
fn format_azure_time(us: i64) -> String {
    let (secs, frac) = (us.div_euclid(1_000_000), us.rem_euclid(1_000_000));
    let (days, sod) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}.{frac:06}0",
        sod / 3600,
        sod % 3600 / 60,
        sod % 60
    )
}

/// A CSV file's rows, one at a time, through the trace reader's line handling (gzip by
/// content, the line-length cap, blank lines skipped).
struct Rows {
    reader: JsonlReader,
}

impl Rows {
    fn open(args: &ConvertArgs) -> Result<Self> {
        Ok(Self {
            reader: JsonlReader::open(&args.input).map_err(trace_err)?,
        })
    }

    /// The next row's fields and its line number.
    fn next(&mut self) -> Result<Option<(Vec<String>, u64)>> {
        let Some(line) = self.reader.next_with(|b| Ok(b.to_vec())) else {
            return Ok(None);
        };
        let line = line.map_err(trace_err)?;
        let text = String::from_utf8(line).map_err(|_| {
            anyhow!(
                "{}:{}: not UTF-8 text",
                self.reader.path().display(),
                self.reader.line()
            )
        })?;
        Ok(Some((fields(&text), self.reader.line())))
    }

    fn err(&self, line: u64, what: impl std::fmt::Display) -> anyhow::Error {
        anyhow!("{}:{line}: {what}", self.reader.path().display())
    }
}

/// A token count in a CSV field.
fn count(rows: &Rows, line: u64, row: &[String], col: usize, name: &str) -> Result<u32> {
    let v = row.get(col).map(String::as_str).unwrap_or("");
    // some exports write counts as floats (`12.0`)
    v.parse::<u32>()
        .ok()
        .or_else(|| {
            v.parse::<f64>()
                .ok()
                .filter(|f| *f >= 0.0 && f.fract() == 0.0 && *f <= f64::from(u32::MAX))
                .map(|f| f as u32)
        })
        .ok_or_else(|| rows.err(line, format!("`{name}` {v:?} is not a token count")))
}

/// One workload record: an arrival and two lengths.
fn workload(arrival_ms: f64, prompt: u32, output: u32) -> TraceRecord {
    TraceRecord {
        prompt_tokens: prompt,
        output_tokens: output,
        arrival_ms: Some(arrival_ms),
        ..TraceRecord::default()
    }
}

pub fn from_azure(args: &ConvertArgs, guard: &mut OutputGuard) -> Result<Report> {
    let mut rows = Rows::open(args)?;
    let mut out = Report::default();
    let Some((header, hline)) = rows.next()? else {
        bail!("{}: empty: no header", args.input.display());
    };
    let lower: Vec<String> = header.iter().map(|h| h.to_ascii_lowercase()).collect();
    if lower.len() < 3
        || lower[0] != "timestamp"
        || lower[1] != "contexttokens"
        || lower[2] != "generatedtokens"
    {
        bail!(rows.err(
            hline,
            format!(
                "expected the Azure trace's header `{AZURE_HEADER}`, got `{}`",
                header.join(",")
            )
        ));
    }
    let mut writer: Option<TraceWriter> = None;
    let mut zero = 0i64;
    let mut progress = Progress::new("convert: rows");
    while let Some((row, line)) = rows.next()? {
        progress.tick();
        let Some(t) = row.first().and_then(|s| parse_azure_time(s)) else {
            bail!(rows.err(
                line,
                format!(
                    "`TIMESTAMP` {:?} is not a date like 2023-11-16 18:15:46.6805900",
                    row.first().map(String::as_str).unwrap_or("")
                )
            ));
        };
        let prompt = count(&rows, line, &row, 1, "ContextTokens")?;
        let output = count(&rows, line, &row, 2, "GeneratedTokens")?;
        let w = match &mut writer {
            Some(w) => w,
            None => {
                // the zero is the first row's millisecond (the meta line's unit), so that
                // `--to azure` writes every timestamp back to the microsecond
                zero = t.div_euclid(1000) * 1000;
                let mut meta = TraceMeta::new();
                meta.created_unix_ms = u64::try_from(zero / 1000).ok();
                guard.arm();
                writer.insert(TraceWriter::create(&args.output, &meta).map_err(trace_err)?)
            }
        };
        if t < zero {
            bail!(rows.err(
                line,
                "earlier than the first row: inference-perf and this reader take the first row as time zero, so the rows must be in time order"
            ));
        }
        w.write_record(&workload((t - zero) as f64 / 1000.0, prompt, output))
            .map_err(trace_err)?;
        out.written += 1;
    }
    progress.finish();
    match writer {
        Some(w) => w.finish().map_err(trace_err)?,
        None => bail!("{}: a header and no rows", args.input.display()),
    }
    out.notes.push(
        "a workload: arrivals and lengths only (no latencies); arrivals from the first row"
            .to_string(),
    );
    Ok(out)
}

pub fn from_burstgpt(args: &ConvertArgs, guard: &mut OutputGuard) -> Result<Report> {
    let mut rows = Rows::open(args)?;
    let mut out = Report::default();
    let Some((header, hline)) = rows.next()? else {
        bail!("{}: empty: no header", args.input.display());
    };
    let col = |name: &str| header.iter().position(|h| h.eq_ignore_ascii_case(name));
    let (Some(ts), Some(req), Some(resp)) = (
        col("Timestamp"),
        col("Request tokens"),
        col("Response tokens"),
    ) else {
        bail!(rows.err(
            hline,
            format!(
                "expected BurstGPT's columns `Timestamp`, `Request tokens` and `Response tokens`, got `{}`",
                header.join(",")
            )
        ));
    };
    let (model, log_type) = (col("Model"), col("Log Type"));
    // BurstGPT's clock starts at the trace's start: no date
    let mut meta = TraceMeta::new();
    meta.created_unix_ms = None;
    guard.arm();
    let mut w = TraceWriter::create(&args.output, &meta).map_err(trace_err)?;
    let mut progress = Progress::new("convert: rows");
    while let Some((row, line)) = rows.next()? {
        progress.tick();
        let t = row.get(ts).map(String::as_str).unwrap_or("");
        let Some(t) = t.parse::<f64>().ok().filter(|t| t.is_finite() && *t >= 0.0) else {
            bail!(rows.err(
                line,
                format!("`Timestamp` {t:?} is not seconds from the trace's start")
            ));
        };
        let prompt = count(&rows, line, &row, req, "Request tokens")?;
        let output = count(&rows, line, &row, resp, "Response tokens")?;
        if output == 0 {
            out.skip("0 response tokens (failed in the original service)", || {
                format!("line {line}")
            });
            continue;
        }
        let mut extra = BTreeMap::new();
        for (key, c) in [("model", model), ("log_type", log_type)] {
            if let Some(v) = c.and_then(|c| row.get(c)).filter(|v| !v.is_empty()) {
                extra.insert(key.to_string(), Value::from(v.as_str()));
            }
        }
        let record = workload(client::ms(t * 1000.0), prompt, output);
        client::write_line(&mut w, &record, "burstgpt", &extra)?;
        out.written += 1;
    }
    progress.finish();
    w.finish().map_err(trace_err)?;
    out.notes.push(
        "a workload: arrivals and lengths only (no latencies); arrivals are the file's Timestamp"
            .to_string(),
    );
    Ok(out)
}

pub fn to_azure(args: &ConvertArgs, guard: &mut OutputGuard) -> Result<Report> {
    let mut reader = TraceReader::open(&args.input).map_err(trace_err)?;
    let (meta, first) = reader.read_header().map_err(trace_err)?;
    let mut out = Report::default();
    // (arrival µs, prompt, output): one small entry per request, to write in arrival order
    let mut rows: Vec<(i64, u32, u32)> = Vec::new();
    let mut progress = Progress::new("convert: records");
    let mut keep = |r: TraceRecord, out: &mut Report| {
        progress.tick();
        match r.arrival_ms {
            Some(a) if a.is_finite() && a >= 0.0 => {
                rows.push((
                    (a * 1000.0).round() as i64,
                    r.prompt_tokens,
                    r.output_tokens,
                ));
            }
            _ => out.skip("no arrival_ms (a timed trace needs one)", || {
                r.request_id.clone().unwrap_or_else(|| "a record".into())
            }),
        }
    };
    if let Some(r) = first {
        keep(r, &mut out);
    }
    for r in reader.records() {
        keep(r.map_err(trace_err)?, &mut out);
    }
    progress.finish();
    rows.sort_by_key(|r| r.0);
    let created = meta.as_ref().and_then(|m| m.created_unix_ms);
    let base_us = created.map_or(0, |ms| ms as i64 * 1000);
    guard.arm();
    let mut w = TraceWriter::create_without_meta(&args.output).map_err(trace_err)?;
    w.write_raw_line(AZURE_HEADER.as_bytes())
        .map_err(trace_err)?;
    for (us, prompt, output) in rows {
        let line = format!("{},{prompt},{output}", format_azure_time(base_us + us));
        w.write_raw_line(line.as_bytes()).map_err(trace_err)?;
        out.written += 1;
    }
    w.finish().map_err(trace_err)?;
    if created.is_none() {
        out.notes.push(
            "the trace has no created_unix_ms: dated from 1970-01-01 00:00:00 (replayers use only the differences)"
                .to_string(),
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn azure_dates_both_ways() {
        let us = parse_azure_time("2023-11-16 18:15:46.6805900").unwrap();
        assert_eq!(format_azure_time(us), "2023-11-16 18:15:46.6805900");
        // 1700158546 s is 2023-11-16 18:15:46 UTC
        assert_eq!(us, 1_700_158_546_680_590);
        assert_eq!(
            parse_azure_time("2024-05-10T00:00:00Z"),
            Some(1_715_299_200_000_000)
        );
        assert_eq!(
            parse_azure_time("2024-05-10 00:00:00.0090000+00:00"),
            Some(1_715_299_200_009_000)
        );
        assert_eq!(format_azure_time(0), "1970-01-01 00:00:00.0000000");
        assert_eq!(
            format_azure_time(951_782_400_000_001),
            "2000-02-29 00:00:00.0000010"
        );
        for bad in [
            "",
            "2023-13-01 00:00:00",
            "2023-11-16",
            "2023-11-16 18:15:xx",
            "12.5",
        ] {
            assert_eq!(parse_azure_time(bad), None, "{bad}");
        }
    }

    #[test]
    fn csv_fields_trim_and_unquote() {
        assert_eq!(
            fields("a, b ,\"c,d\",\"e\"\"f\""),
            ["a", "b", "c,d", "e\"f"]
        );
        assert_eq!(fields(""), [""]);
    }
}
