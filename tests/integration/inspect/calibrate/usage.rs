//! Using calibrate: bad input refused with a clear error, `--help` explaining every flag, and
//! the documented examples printing what the docs say.

use super::*;

#[test]
fn bad_input_is_refused_with_a_clear_error() {
    let tmp = TestDir::new("bad_input_is_refused_with_a_clear_error");
    let model = fixture_model();
    let (_, e) = exit_1(calibrate(&[
        "/nonexistent/trace.jsonl",
        "--latency-trace",
        s(&model),
    ]));
    assert!(e.contains("/nonexistent/trace.jsonl"), "{e}");

    // the model under test is required
    let (_, e) = exit_1(calibrate(&[s(&cpu_capture("trace.jsonl.gz"))]));
    assert!(e.contains("pass --latency-trace MODEL"), "{e}");

    // a JSON file of another format
    let not_model = tmp.path("not-a-model.json");
    std::fs::write(
        &not_model,
        "{\"format\": \"something-else\", \"version\": 3}\n",
    )
    .unwrap();
    let (_, e) = exit_1(calibrate(&[
        s(&cpu_capture("trace.jsonl.gz")),
        "--latency-trace",
        s(&not_model),
    ]));
    assert!(e.contains("is not a latency model this build reads"), "{e}");
    // a file that is neither a model nor a trace
    let junk = tmp.path("junk.txt");
    std::fs::write(&junk, "hello\n").unwrap();
    let (_, e) = exit_1(calibrate(&[
        s(&cpu_capture("trace.jsonl.gz")),
        "--latency-trace",
        s(&junk),
    ]));
    assert!(e.contains("junk.txt:1: invalid trace line"), "{e}");

    // a converted Mooncake trace has arrivals and lengths, no timing
    let mooncake = tmp.path("mooncake.jsonl");
    inspect(
        "convert",
        &[
            "--from",
            "mooncake",
            s(&fixture("tests/fixtures/mooncake/sample.jsonl")),
            "-o",
            s(&mooncake),
        ],
    )
    .run();
    let (_, e) = exit_1(calibrate(&[s(&mooncake), "--latency-trace", s(&model)]));
    assert!(
        e.contains("no complete record has captured timing (ttft_ms)"),
        "{e}"
    );
    assert!(e.contains("Mooncake"), "{e}");

    // timing without arrivals (a converted client report without them)
    let untimed = tmp.path("no-arrivals.jsonl");
    std::fs::write(
        &untimed,
        "{\"meta\":{\"block_size\":16}}\n{\"prompt_tokens\":8,\"output_tokens\":2,\"ttft_ms\":5,\"itl_ms\":[1]}\n",
    )
    .unwrap();
    let (_, e) = exit_1(calibrate(&[s(&untimed), "--latency-trace", s(&model)]));
    assert!(e.contains("no record has an arrival_ms"), "{e}");

    let trace = cpu_capture("trace.jsonl.gz");
    for (flag, msg) in [
        ("--tolerance=p95=3", "the quantiles are p50, p90 and p99"),
        ("--tolerance=-2", "not a percentage"),
    ] {
        let out = calibrate(&[s(&trace), "--latency-trace", s(&model), flag]).output();
        let (_, e) = texts(&out);
        assert!(!out.status.success() && e.contains(msg), "{flag}: {e}");
    }
    let (_, e) = exit_1(calibrate(&[
        s(&trace),
        "--latency-trace",
        s(&model),
        "--dump-samples",
        s(&trace),
    ]));
    assert!(e.contains("is the same file as the trace"), "{e}");
    // knobs and a model do not mix, as in `play`
    let (_, e) = exit_1(calibrate(&[
        s(&trace),
        "--latency-trace",
        s(&model),
        "--inter-token-latency",
        "5",
    ]));
    assert!(
        e.contains("does not combine with --inter-token-latency"),
        "{e}"
    );
}

#[test]
fn help_explains_every_flag() {
    let (help, _) = texts(&calibrate(&["--help"]).run());
    for flag in [
        "--latency-trace",
        "--replay-arrivals",
        "--replay-sessions",
        "--cold-prompts",
        "--tolerance",
        "--min-requests",
        "--json",
        "--dump-samples",
        "--plot",
        "--max-num-seqs",
        "Exit status",
    ] {
        assert!(help.contains(flag), "{flag} missing from:\n{help}");
    }
    let cli = <vllm_vcr::cli::Cli as clap::CommandFactory>::command();
    let cal = cli
        .find_subcommand("inspect")
        .and_then(|i| i.find_subcommand("calibrate"))
        .unwrap();
    for arg in cal.get_arguments() {
        let id = arg.get_id().as_str();
        assert!(
            id == "help" || arg.get_help().is_some_and(|h| h.to_string().len() > 10),
            "inspect calibrate --{id} has no help text"
        );
    }
}

/// The calibrate examples of docs/inspect.md are what the binary prints: the in-sample
/// run's whole output block (the `wall:` time aside, which is the machine's; its count of
/// simulations is checked), the knob TTFT, the knob row's figures quoted in the prose,
/// and the synthetic run's knob line. The docs' figures used to drift from the binary.
#[test]
fn the_documented_calibrate_examples_are_what_the_binary_prints() {
    let tmp = TestDir::new("the_documented_calibrate_examples_are_what_the_binary_prints");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/inspect.md")).unwrap();
    // the commands as written, from a directory where the fixture's relative path holds
    let dir = tmp.path("doc-example");
    std::fs::create_dir_all(&dir).unwrap();
    let _ = std::os::unix::fs::symlink(root.join("tests"), dir.join("tests"));
    let in_dir = |args: &[&str]| {
        let mut c = vcr();
        c.current_dir(&dir).args(args);
        c
    };
    let trace = "tests/fixtures/cpu-engine-capture/trace.jsonl.gz";
    in_dir(&[
        "inspect",
        "fit",
        trace,
        "--steps",
        "tests/fixtures/cpu-engine-capture/steps.jsonl.gz",
        "-o",
        "model.json",
    ])
    .run();
    let (out, _) = exit_1(in_dir(&[
        "inspect",
        "calibrate",
        trace,
        "--latency-trace",
        "model.json",
        "--plot",
        "figures",
        "--dump-samples",
        "samples.jsonl",
    ]));
    let first = out.lines().next().unwrap();
    let start = doc
        .find(first)
        .expect("the first line of the run in docs/inspect.md");
    let block: Vec<&str> = doc[start..].lines().take_while(|l| *l != "```").collect();
    let printed: Vec<&str> = out.lines().collect();
    assert_eq!(
        block.len(),
        printed.len(),
        "docs:\n{}\nrun:\n{out}",
        block.join("\n")
    );
    for (d, p) in block.iter().zip(&printed) {
        if let (Some(d), Some(p)) = (d.strip_prefix("wall: "), p.strip_prefix("wall: ")) {
            let sims = |l: &str| l.split_once('(').map(|(_, r)| r.to_string());
            assert_eq!(sims(d), sims(p), "wall line: docs {d} run {p}");
            assert!(doc.contains(&format!(
                "({} on the fixture",
                sims(p).unwrap().split(' ').next().unwrap()
            )));
            continue;
        }
        assert_eq!(d, p, "docs/inspect.md and the run differ");
    }
    // the prose on the knob row quotes the knob TTFT and the row's pooled p99 and c=1 p50
    let knob_ttft = out
        .split("--time-to-first-token ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap();
    assert!(
        doc.contains(&format!("or seven ({knob_ttft} ms")),
        "{knob_ttft}"
    );
    let ttft_rows: Vec<&str> = out.lines().skip_while(|l| !l.starts_with("TTFT")).collect();
    let last = |l: &str| l.split_whitespace().last().unwrap().replace('-', "−");
    assert!(doc.contains(&format!("TTFT p99 is {} %", last(ttft_rows[3]))));
    assert!(doc.contains(&format!("lone requests {} %", last(ttft_rows[4]))));

    // the synthetic example: the knob row gives back what made the capture
    in_dir(&[
        "inspect",
        "simulate",
        trace,
        "--time-to-first-token",
        "50",
        "--inter-token-latency",
        "10",
        "--dump-trace",
        "synthetic.jsonl.gz",
    ])
    .run();
    in_dir(&[
        "inspect",
        "fit",
        "synthetic.jsonl.gz",
        "-o",
        "synthetic-model.json",
    ])
    .run();
    let (out, _) = texts(
        &in_dir(&[
            "inspect",
            "calibrate",
            "synthetic.jsonl.gz",
            "--latency-trace",
            "synthetic-model.json",
        ])
        .run(),
    );
    let ttft = out
        .split("--time-to-first-token ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap();
    assert!(
        doc.contains(&format!(
            "`--time-to-first-token {ttft} … --inter-token-latency 10`"
        )),
        "{ttft}"
    );
    assert!(
        doc.contains(&format!("gives back {ttft} ± 0 / 10 ± 0")),
        "{ttft}"
    );
}
