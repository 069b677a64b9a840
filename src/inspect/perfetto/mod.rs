//! `inspect perfetto`: a trace (and its step-stats sidecar) as a timeline for the Perfetto
//! UI — Perfetto's native protobuf trace by default, or Chrome Trace Event JSON (which
//! chrome://tracing opens too), with the same content.
//!
//! - [`timeline`]: what is drawn (lanes, slices, counters, steps), built in two streaming
//!   passes over the trace and handed event by event to a [`sink::Sink`];
//! - `proto.rs` (over the small encoder `pb.rs`) and [`json`]: the two formats;
//! - `serve.rs`: `--open`, the file served to the hosted UI.

pub(crate) mod json;
mod pb;
mod proto;
mod serve;
pub mod sink;
mod time;
pub mod timeline;

use std::fs::File;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use serde_json::json;

pub use serve::PERFETTO_UI_PORT;
pub use timeline::{Summary, convert};

#[derive(Debug, Clone, Args)]
pub struct PerfettoArgs {
    /// The trace (JSONL; `.gz` read transparently). Read twice, so it must be a file.
    pub trace: PathBuf,

    /// Write the timeline here (`.gz` suffix → gzip). A name ending in `.json` (or
    /// `.json.gz`) gets Chrome Trace Event JSON, any other Perfetto's protobuf format
    /// (`trace.pftrace`). Default: stdout, or an unlinked temporary file with `--open`.
    #[arg(short, long, value_name = "PATH")]
    pub output: Option<PathBuf>,

    /// `proto`: Perfetto's native protobuf trace (0.3–0.4 of the JSON's size, written in
    /// under half the time, cheaper to open); `json`: Chrome Trace Event JSON, which
    /// chrome://tracing opens too. Default: `json` when `-o` ends in `.json` or `.json.gz`, else `proto`.
    #[arg(long, value_enum, value_name = "FORMAT")]
    pub format: Option<Format>,

    /// Overlay the step-stats sidecar written by `record --step-stats-out` (`.gz` ok):
    /// scheduler counters and a track of engine steps.
    #[arg(long, value_name = "PATH")]
    pub step_stats: Option<PathBuf>,

    /// Label of the requests' process row (default: the trace's meta model).
    #[arg(long, value_name = "LABEL")]
    pub name: Option<String>,

    /// One row per request, named by its request id, instead of packed lanes (for small
    /// traces: a row per request is hard to read beyond a few hundred).
    #[arg(long)]
    pub track_per_request: bool,

    /// Serve the file on 127.0.0.1 with CORS for the hosted Perfetto UI, print the
    /// ui.perfetto.dev URL that opens it, and block until Ctrl-C.
    #[arg(long)]
    pub open: bool,

    /// Port for `--open`. The hosted UI's Content-Security-Policy only lets it fetch from
    /// 127.0.0.1:9001; another port (0: any free port) suits a self-hosted UI or curl.
    #[arg(long, value_name = "N", default_value_t = PERFETTO_UI_PORT)]
    pub port: u16,

    /// Print a JSON summary on stdout: events written, lanes, requests placed, requests
    /// without arrival_ms, steps, the format and the bytes written. Only when the trace
    /// goes to a file (`-o` or `--open`).
    #[arg(long)]
    pub json: bool,

    /// Only requests arriving at or after this time (ms, the trace's clock), and steps
    /// ending then or later: a window of a big trace the UI can open.
    #[arg(long, value_name = "MS")]
    pub from_ms: Option<f64>,

    /// Only requests arriving before this time (ms), and steps ending before it.
    #[arg(long, value_name = "MS")]
    pub to_ms: Option<f64>,

    /// At most this many requests (the first ones of the window, in file order).
    #[arg(long, value_name = "N")]
    pub max_requests: Option<u64>,
}

impl PerfettoArgs {
    /// `inspect perfetto TRACE -o OUTPUT --format FORMAT`, every other option at its
    /// default (what the benches run).
    pub fn to_file(trace: PathBuf, output: PathBuf, format: Format) -> PerfettoArgs {
        PerfettoArgs {
            trace,
            output: Some(output),
            format: Some(format),
            step_stats: None,
            name: None,
            track_per_request: false,
            open: false,
            port: PERFETTO_UI_PORT,
            json: false,
            from_ms: None,
            to_ms: None,
            max_requests: None,
        }
    }
}

/// The timeline's file format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Perfetto's protobuf trace (`Trace` of `TracePacket`s).
    Proto,
    /// Chrome Trace Event JSON.
    Json,
}

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::Proto => "proto",
            Format::Json => "json",
        }
    }

    /// Past this many bytes (uncompressed) the hosted UI, which parses the trace in the
    /// browser, runs out of memory: about 1 GiB of JSON, whose parsing needs several
    /// times its size, and about 2 GiB of protobuf (the in-browser trace processor's
    /// memory is capped at 4 GiB).
    fn too_big_for_the_ui(self) -> u64 {
        match self {
            Format::Proto => 2 << 30,
            Format::Json => 1 << 30,
        }
    }

    fn content_type(self) -> &'static str {
        match self {
            Format::Proto => "application/octet-stream",
            Format::Json => "application/json",
        }
    }
}

/// The file name without a `.gz` suffix, lowercased.
fn stem_without_gz(path: &Path) -> String {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    match name.strip_suffix(".gz") {
        Some(s) => s.to_string(),
        None => name,
    }
}

/// The format to write: `--format`, else what the output's name says (`.json`: JSON),
/// else protobuf.
fn choose_format(args: &PerfettoArgs) -> Format {
    let named = args.output.as_deref().map(stem_without_gz);
    let by_name = named
        .as_deref()
        .filter(|n| n.ends_with(".json"))
        .map(|_| Format::Json);
    match (args.format, by_name) {
        (Some(f), _) => {
            let odd = match f {
                Format::Proto => by_name == Some(Format::Json),
                Format::Json => named
                    .as_deref()
                    .is_some_and(|n| n.ends_with(".pftrace") || n.ends_with(".perfetto-trace")),
            };
            if odd && let Some(p) = &args.output {
                crate::errln!(
                    "perfetto: note: writing {} in the {} format, as --format says, though its \
                     name suggests the other",
                    p.display(),
                    f.name()
                );
            }
            f
        }
        (None, Some(f)) => f,
        (None, None) => Format::Proto,
    }
}

/// Draw `args.trace` (and its step stats) into `file` (stdout when `None`) in `format`,
/// gzip-compressed when `gz`.
pub fn write(args: &PerfettoArgs, format: Format, file: Option<File>, gz: bool) -> Result<Summary> {
    let output = sink::Output::new(file, gz);
    let sink: Box<dyn sink::Sink> = match format {
        Format::Proto => Box::new(proto::ProtoSink::new(output)),
        Format::Json => Box::new(json::JsonSink::new(output)?),
    };
    let mut summary = convert(args, sink)?;
    summary.format = format.name();
    Ok(summary)
}

pub fn run(args: &PerfettoArgs) -> Result<()> {
    let gz = |p: &Path| p.extension().is_some_and(|e| e.eq_ignore_ascii_case("gz"));
    let format = choose_format(args);
    if format == Format::Proto
        && args.output.is_none()
        && !args.open
        && std::io::stdout().is_terminal()
    {
        bail!(
            "the protobuf trace is binary and stdout is a terminal: write it to a file \
             (-o trace.pftrace), pipe it, or pass --format json"
        );
    }
    // inputs are checked before the output is created: a missing trace must not leave an
    // empty output behind, and the output must never be one of the inputs
    for (p, what) in std::iter::once((&args.trace, "the trace")).chain(
        args.step_stats
            .as_ref()
            .map(|s| (s, "the --step-stats file")),
    ) {
        std::fs::metadata(p).with_context(|| format!("{what} {}", p.display()))?;
    }
    let mut guard = None;
    if let Some(out) = &args.output {
        let mut inputs = vec![crate::io_guard::named("the trace", &args.trace)];
        if let Some(s) = &args.step_stats {
            inputs.push(crate::io_guard::named("the --step-stats file", s));
        }
        crate::io_guard::check_outputs(&inputs, &[crate::io_guard::named("-o", out)])?;
        guard = Some(super::output::OutputGuard::new(out));
    }
    // With --open and no -o: a temporary file, unlinked once open (served from the
    // handle), so nothing is left behind when Ctrl-C ends the process.
    let (out, shown, temp): (Option<File>, Option<PathBuf>, bool) = match (&args.output, args.open)
    {
        (Some(p), _) => (
            Some(
                sim_trace::trace::create_output(p)
                    .with_context(|| format!("creating {}", p.display()))?,
            ),
            Some(p.clone()),
            false,
        ),
        (None, true) => {
            let p = std::env::temp_dir().join(format!(
                "vllm-vcr-perfetto-{}.{}",
                std::process::id(),
                match format {
                    Format::Proto => "pftrace",
                    Format::Json => "json",
                }
            ));
            let f = File::create(&p).with_context(|| format!("creating {}", p.display()))?;
            (Some(f), Some(p), true)
        }
        (None, false) => (None, None, false),
    };
    // the output exists now: a failure from here on removes it
    if let Some(g) = &mut guard {
        g.arm();
    }
    let served = match &shown {
        Some(p) if args.open => {
            Some(File::open(p).with_context(|| format!("opening {}", p.display()))?)
        }
        _ => None,
    };
    if temp && let Some(p) = &shown {
        let _ = std::fs::remove_file(p);
    }
    let summary = write(args, format, out, shown.as_deref().is_some_and(gz))
        .with_context(|| format!("converting {}", args.trace.display()))?;
    if summary.without_arrival > 0 {
        crate::errln!(
            "perfetto: {} record(s) have no arrival_ms and cannot be placed on the timeline",
            summary.without_arrival
        );
    }
    if summary.late_samples > 0 {
        crate::errln!(
            "perfetto: {} step counter sample(s) were out of time order and were drawn at the \
             previous sample's time",
            summary.late_samples
        );
    }
    if summary.bytes > format.too_big_for_the_ui() {
        crate::errln!(
            "perfetto: warning: the {} trace is {} MiB{}; the Perfetto UI runs out of memory on \
             {} traces past about {} GiB: draw a window (--from-ms/--to-ms) or fewer requests \
             (--max-requests){}",
            format.name(),
            summary.bytes >> 20,
            if shown.as_deref().is_some_and(gz) {
                " uncompressed"
            } else {
                ""
            },
            format.name(),
            format.too_big_for_the_ui() >> 30,
            match format {
                Format::Json => ", or write the protobuf format (--format proto)",
                Format::Proto => ", or open it with a native trace_processor --httpd",
            }
        );
    }
    if let Some(p) = &shown {
        crate::errln!(
            "perfetto: wrote {} ({}, {:.1} MB, {} events, {} requests in {} {}{})",
            if temp {
                "a temporary file".to_string()
            } else {
                p.display().to_string()
            },
            format.name(),
            summary.bytes as f64 / 1e6,
            summary.events,
            summary.requests,
            summary.lanes,
            if args.track_per_request {
                "rows"
            } else {
                "lanes"
            },
            if summary.steps > 0 {
                format!(", {} steps", summary.steps)
            } else {
                String::new()
            }
        );
        if args.json {
            let mut v = serde_json::to_value(&summary)?;
            if !temp && let Some(o) = v.as_object_mut() {
                o.insert("output".into(), json!(p));
            }
            writeln!(std::io::stdout(), "{v}")?;
        }
    }
    if let Some(g) = &mut guard {
        g.disarm();
    }
    if let (Some(file), Some(p)) = (served, &shown) {
        serve::serve(file, &serve::url_name(p), args.port, format.content_type())?;
    }
    Ok(())
}
