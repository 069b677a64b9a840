//! `inspect` trace tools (`cargo bench --bench inspect`): MB of input read per CPU-second
//! on every path of the budget (≥ 100): `summarize` (plain and `.gz`), `convert --to
//! mooncake` (in arrival order and not), `--from mooncake`, `--from guidellm`, and
//! `perfetto` (protobuf and JSON). A report, not a timed test: it fails only if a command
//! does.
//!
//! CPU seconds are the process's user + system time (`getrusage`, every thread: the gunzip
//! thread of a `.gz` input counts) around each command, which a busy machine inflates far
//! less than the wall clock. MB are the uncompressed input's. Inputs, written once into a
//! temporary directory: `gen-demo --arrival-rate 50` (`INSPECT_BENCH_REQUESTS`, default
//! 50,000, about 63 MB; `BENCH_QUICK=1`: 2,000), its `.gz`, its `--to mooncake` file four
//! times over (Mooncake lines), that file `--from mooncake` (a trace out of arrival
//! order), and the guidellm fixture's report with its requests repeated to a fifth of
//! the requests.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use vllm_vcr::inspect::convert::{ConvertArgs, Format as ConvertFormat, run as convert};
use vllm_vcr::inspect::gen_demo::{GenDemoArgs, run as gen_demo};
use vllm_vcr::inspect::perfetto::{Format, PerfettoArgs, write};
use vllm_vcr::inspect::summarize::Summary;

#[path = "common/cpu.rs"]
mod cpu;

/// User + system CPU seconds of this process so far, all threads.
fn cpu_seconds() -> f64 {
    cpu::rusage_seconds(libc::RUSAGE_SELF)
}

fn size(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

fn convert_args(
    from: Option<ConvertFormat>,
    to: Option<ConvertFormat>,
    input: &Path,
    output: &Path,
) -> ConvertArgs {
    ConvertArgs {
        from,
        to,
        input: input.to_path_buf(),
        output: output.to_path_buf(),
        block_size: None,
        all_requests: false,
        benchmark: None,
        json: false,
    }
}

/// The guidellm fixture's report with its successful requests repeated to `n`.
fn guidellm_report(n: usize, out: &Path) {
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/guidellm/report.json.gz");
    let mut text = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(&fixture).expect("the guidellm fixture"))
        .read_to_string(&mut text)
        .expect("reading the guidellm fixture");
    let mut report: serde_json::Value = serde_json::from_str(&text).expect("the fixture's JSON");
    let list = report["benchmarks"][0]["requests"]["successful"]
        .as_array_mut()
        .expect("the fixture's successful requests");
    let one = list.clone();
    list.clear();
    list.extend(one.iter().cycle().take(n).cloned());
    let file = std::fs::File::create(out).expect("writing the report");
    serde_json::to_writer(std::io::BufWriter::new(file), &report).expect("writing the report");
}

fn main() {
    let requests: u64 = std::env::var("INSPECT_BENCH_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if std::env::var_os("BENCH_QUICK").is_some() {
            2_000
        } else {
            50_000
        });
    let dir = std::env::temp_dir().join(format!("vllm-vcr-bench-inspect-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let at = |name: &str| -> PathBuf { dir.join(name) };

    let trace = at("demo.jsonl");
    gen_demo(&GenDemoArgs {
        output: trace.clone(),
        records: requests,
        seed: 0,
        fast: false,
        arrival_rate: Some(50.0),
        json: false,
    })
    .expect("gen-demo");
    {
        let mut gz = flate2::write::GzEncoder::new(
            std::fs::File::create(at("demo.jsonl.gz")).expect("the .gz input"),
            flate2::Compression::default(),
        );
        std::io::copy(
            &mut std::fs::File::open(&trace).expect("the trace"),
            &mut gz,
        )
        .expect("gzip");
        gz.finish().expect("gzip");
    }
    let mooncake_once = at("once.mooncake.jsonl");
    convert(&convert_args(
        None,
        Some(ConvertFormat::Mooncake),
        &trace,
        &mooncake_once,
    ))
    .expect("--to mooncake");
    {
        let once = std::fs::read(&mooncake_once).expect("the Mooncake file");
        let mut f = std::fs::File::create(at("mooncake.jsonl")).expect("the Mooncake input");
        for _ in 0..4 {
            f.write_all(&once).expect("the Mooncake input");
        }
    }
    convert(&convert_args(
        Some(ConvertFormat::Mooncake),
        None,
        &at("mooncake.jsonl"),
        &at("unsorted.jsonl"),
    ))
    .expect("--from mooncake");
    guidellm_report((requests / 5).max(50) as usize, &at("guidellm.json"));

    println!(
        "inspect: MB of input per CPU-second ({requests} requests of gen-demo --arrival-rate 50)"
    );
    println!(
        "{:<32} {:>10} {:>10} {:>10}",
        "path", "input MB", "CPU s", "MB/CPU-s"
    );
    let out = at("out");
    let perfetto = |format: Format, output: &Path| {
        let args = PerfettoArgs::to_file(trace.clone(), output.to_path_buf(), format);
        let file = std::fs::File::create(output).expect("creating the output");
        write(&args, format, Some(file), false).map(drop)
    };
    type Run<'a> = Box<dyn Fn() -> anyhow::Result<()> + 'a>;
    let paths: Vec<(&str, PathBuf, Run)> = vec![
        (
            "summarize",
            trace.clone(),
            Box::new(|| Summary::of(&trace).map(drop)),
        ),
        (
            "summarize .gz",
            trace.clone(),
            Box::new(|| Summary::of(&at("demo.jsonl.gz")).map(drop)),
        ),
        (
            "convert --to mooncake",
            trace.clone(),
            Box::new(|| {
                convert(&convert_args(
                    None,
                    Some(ConvertFormat::Mooncake),
                    &trace,
                    &out,
                ))
            }),
        ),
        (
            "convert --to mooncake, unsorted",
            at("unsorted.jsonl"),
            Box::new(|| {
                convert(&convert_args(
                    None,
                    Some(ConvertFormat::Mooncake),
                    &at("unsorted.jsonl"),
                    &out,
                ))
            }),
        ),
        (
            "convert --from mooncake",
            at("mooncake.jsonl"),
            Box::new(|| {
                convert(&convert_args(
                    Some(ConvertFormat::Mooncake),
                    None,
                    &at("mooncake.jsonl"),
                    &out,
                ))
            }),
        ),
        (
            "convert --from guidellm",
            at("guidellm.json"),
            Box::new(|| {
                convert(&convert_args(
                    Some(ConvertFormat::Guidellm),
                    None,
                    &at("guidellm.json"),
                    &out,
                ))
            }),
        ),
        (
            "perfetto (protobuf)",
            trace.clone(),
            Box::new(|| perfetto(Format::Proto, &at("out.pftrace"))),
        ),
        (
            "perfetto (JSON)",
            trace.clone(),
            Box::new(|| perfetto(Format::Json, &at("out.json"))),
        ),
    ];
    for (name, input, run) in &paths {
        let before = cpu_seconds();
        run().unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let cpu = cpu_seconds() - before;
        let mb = size(input) as f64 / 1e6;
        println!(
            "{name:<32} {mb:>10.1} {cpu:>10.2} {:>10.0}",
            mb / cpu.max(1e-6)
        );
        let _ = std::fs::remove_file(&out);
        let _ = std::fs::remove_file(at("out.pftrace"));
        let _ = std::fs::remove_file(at("out.json"));
    }
    let _ = std::fs::remove_dir_all(&dir);
}
