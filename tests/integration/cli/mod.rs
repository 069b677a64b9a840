//! The command line itself: completions for every shell, `--help` that explains every
//! flag, clear errors for bad values, closed pipes, outputs that never overwrite inputs.
//! The image's entrypoint is checked in [`entrypoint`], the docs' commands in [`docs`].

use std::process::Command;

use crate::support::{TestDir, fixture, process_dir, vcr, vcr_command};
use clap::CommandFactory;
use vllm_vcr::cli::Cli;

mod docs;
mod entrypoint;

#[test]
fn completions_for_every_shell() {
    for shell in ["bash", "zsh", "fish", "powershell", "elvish"] {
        let out = vcr().args(["completions", shell]).output();
        assert!(out.status.success(), "{shell}");
        let text = String::from_utf8(out.stdout).unwrap();
        // fish lists long flags without their dashes
        for word in ["play", "serve", "handshake-address", "inter-token-latency"] {
            assert!(text.contains(word), "{shell} completion lacks {word}");
        }
    }
    let bad = vcr().args(["completions", "tcsh"]).output();
    assert!(!bad.status.success());
}

#[test]
fn every_flag_is_documented() {
    let cmd = Cli::command();
    for sub in cmd.get_subcommands() {
        for arg in sub.get_arguments() {
            let id = arg.get_id().as_str();
            if id == "help" || id == "version" {
                continue;
            }
            assert!(
                arg.get_help().is_some_and(|h| h.to_string().len() > 10),
                "`vllm-vcr {} --{id}` has no help text",
                sub.get_name()
            );
        }
    }
}

#[test]
fn bad_flag_values_get_clear_errors() {
    for (args, needle) in [
        (
            vec!["play", "--vllm-version", "0.24"],
            "outside the supported window",
        ),
        (
            vec!["play", "--vllm-version", "banana"],
            "not a vLLM version",
        ),
        (vec!["play", "--inter-token-latency=-3"], "≥ 0"),
        (vec!["play", "--dtype", "int8"], "bfloat16"),
        // token ranges are refused, never silently changed (one used to emit EOS, the
        // other only empty tokens)
        (
            vec!["serve", "--min-token-id", "300"],
            "--min-token-id (300) must be below --vocab-size (259)",
        ),
        (
            vec!["serve", "--vocab-size", "1000"],
            "larger than the embedded model's 259 token ids",
        ),
        (
            vec!["play", "--vocab-size", "3", "--min-token-id", "0"],
            "only special tokens",
        ),
        (vec!["play", "--tool-call-rate", "2"], "between 0 and 1"),
        (
            vec!["play", "--kv-lease-duration", "0"],
            "--kv-lease-duration",
        ),
        // durations, scales and rates have ranges (each of these used to panic, or pass
        // as 1 ms)
        (
            vec![
                "play",
                "--time-scale",
                "1e-300",
                "--inter-token-latency",
                "10",
            ],
            "the time scale must be between 0.001 and 1000000",
        ),
        (
            vec!["play", "--time-to-first-token", "1e29"],
            "milliseconds must be between 0 and 86400000 (a day)",
        ),
        (
            vec!["play", "--time-factor-under-load", "1e300"],
            "the factor must be between 1 and 1000",
        ),
        (
            vec!["play", "--handshake-timeout", "inf"],
            "seconds must be more than 0 and at most 86400",
        ),
        (
            vec!["play", "--shutdown-timeout", "1e300"],
            "seconds must be between 0 and 86400",
        ),
        (
            vec![
                "pd-proxy",
                "--prefill",
                "http://a",
                "--decode",
                "http://b",
                "--timeout",
                "1e300",
            ],
            "seconds must be more than 0 and at most 86400",
        ),
        (
            vec![
                "pd-proxy",
                "--prefill",
                "http://a",
                "--decode",
                "http://b",
                "--timeout",
                "inf",
            ],
            "seconds must be more than 0",
        ),
        (
            vec![
                "pd-proxy",
                "--prefill",
                "http://a",
                "--decode",
                "http://b",
                "--timeout",
                "NaN",
            ],
            "seconds must be more than 0",
        ),
        (
            vec![
                "record",
                "--frontend-handshake",
                "tcp://127.0.0.1:1",
                "--engine-handshake",
                "tcp://127.0.0.1:0",
                "--trace-out",
                "/nonexistent/t.jsonl",
                "--connect-timeout",
                "1e300",
            ],
            "seconds must be more than 0 and at most 86400",
        ),
        (
            vec![
                "inspect",
                "gen-demo",
                "-o",
                "/nonexistent/d.jsonl",
                "--arrival-rate",
                "1e-300",
            ],
            "requests per second must be between 1e-5 and 1000000",
        ),
    ] {
        let out = vcr_command()
            .args(&args)
            // a `play` that got past its flags gives up on the (absent) frontend at once
            .args(
                (args[0] == "play" && !args.contains(&"--handshake-timeout"))
                    .then_some(["--handshake-timeout", "1"])
                    .into_iter()
                    .flatten(),
            )
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

/// `… --json | head`: the reader left before anything was written; the command ends
/// quietly with 0, not "error: Broken pipe".
#[test]
fn a_closed_stdout_is_not_an_error() {
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/cpu-engine-capture/trace.jsonl.gz"
    );
    let mut child = vcr_command()
        .args(["inspect", "summarize", "--json", trace])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // the reader is gone before the first write
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {err}", out.status);
    assert!(
        !err.contains("Broken pipe") && !err.contains("panicked"),
        "{err}"
    );
}

/// `vllm-vcr completions bash | head -1`: the reader leaves after one line; the command
/// ends quietly (it used to panic inside the completion generator, exit 101).
#[test]
fn completions_into_a_closed_pipe_end_quietly() {
    for shell in ["bash", "zsh", "fish"] {
        let mut child = vcr_command()
            .args(["completions", shell])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take()); // the reader is gone before the first write
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{shell}: {:?}: {err}", out.status);
        assert!(!err.contains("panicked"), "{shell}: {err}");
    }
}

/// `serve … 2>&1 | tee log`, then Ctrl-C: tee is gone, so is serve's stderr; serve still
/// stops cleanly (it used to abort with SIGABRT on the failed print).
#[test]
fn serve_stops_cleanly_when_its_output_pipes_are_closed() {
    let port = vllm_vcr::child::free_ports(1).unwrap()[0];
    let mut child = vcr_command()
        .args(["serve", "--port", &port.to_string()])
        .env("NO_COLOR", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
    let ready = lines.any(|l| l.is_ok_and(|l| l.contains("http://")));
    assert!(ready, "serve never printed its URL");
    drop(lines);
    drop(child.stderr.take());
    // one Ctrl-C as a forwarding wrapper delivers it: twice within a millisecond
    unsafe {
        libc::kill(child.id() as i32, libc::SIGINT);
        libc::kill(child.id() as i32, libc::SIGINT);
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(std::time::Instant::now() < deadline, "serve did not stop");
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert_eq!(
        status.code(),
        Some(0),
        "{status:?} (130 = taken as a second Ctrl-C, 134 = abort)"
    );
}

/// No command writes an output over one of its inputs, nor two outputs over one file, by
/// any name: each is refused before anything is opened for writing, and the inputs are
/// left byte for byte. (Each of these overwrote an input; the record case left a
/// meta-only file.)
#[test]
fn outputs_never_overwrite_inputs() {
    let tmp = TestDir::new("cli-outputs");
    let dir = tmp.root();
    let fixtures = fixture("tests/fixtures/cpu-engine-capture");
    // copies: a regression must not destroy the fixtures
    let trace = dir.join("trace.jsonl.gz");
    let steps = dir.join("steps.jsonl.gz");
    std::fs::copy(fixtures.join("trace.jsonl.gz"), &trace).unwrap();
    std::fs::copy(fixtures.join("steps.jsonl.gz"), &steps).unwrap();
    let model = dir.join("model.json");
    let run = |args: &[&str]| vcr().current_dir(dir).args(args).output();
    let fit = run(&["inspect", "fit", "trace.jsonl.gz", "-o", "model.json"]);
    assert!(
        fit.status.success(),
        "{}",
        String::from_utf8_lossy(&fit.stderr)
    );
    let before: Vec<Vec<u8>> = [&trace, &steps, &model]
        .iter()
        .map(|p| std::fs::read(p).unwrap())
        .collect();
    let t = "trace.jsonl.gz";
    for (args, needle) in [
        (
            vec!["inspect", "fit", t, "-o", "./trace.jsonl.gz"],
            "the trace",
        ),
        (
            vec![
                "inspect",
                "fit",
                t,
                "--steps",
                "steps.jsonl.gz",
                "-o",
                "steps.jsonl.gz",
            ],
            "--steps",
        ),
        (
            vec![
                "inspect",
                "simulate",
                t,
                "--latency-trace",
                "model.json",
                "--dump-trace",
                "model.json",
            ],
            "--latency-trace",
        ),
        (
            vec![
                "inspect",
                "simulate",
                t,
                "--latency-trace",
                t,
                "--latency-steps",
                "steps.jsonl.gz",
                "--dump-trace",
                "../${DIR}/steps.jsonl.gz",
            ],
            "--latency-steps",
        ),
        (
            vec![
                "inspect",
                "calibrate",
                t,
                "--latency-trace",
                "model.json",
                "--dump-samples",
                "model.json",
            ],
            "--latency-trace",
        ),
        (
            vec![
                "play",
                "--handshake-timeout",
                "1",
                "--replay-tokens",
                t,
                "--replay-summary",
                t,
            ],
            "--replay-tokens",
        ),
        (
            vec![
                "record",
                "--frontend-handshake",
                "tcp://127.0.0.1:9",
                "--engine-handshake",
                "tcp://127.0.0.1:0",
                "--connect-timeout",
                "1",
                "--trace-out",
                "x.jsonl",
                "--step-stats-out",
                "./x.jsonl",
            ],
            "--trace-out",
        ),
    ] {
        let dir_name = dir.file_name().unwrap().to_str().unwrap().to_string();
        let args: Vec<String> = args
            .iter()
            .map(|a| a.replace("${DIR}", &dir_name))
            .collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = run(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("is the same file as") && err.contains(needle),
            "{args:?}: {err}"
        );
        for (p, b) in [&trace, &steps, &model].iter().zip(&before) {
            assert_eq!(
                &std::fs::read(p).unwrap(),
                b,
                "{args:?} changed {}",
                p.display()
            );
        }
        assert!(
            !dir.join("x.jsonl").exists(),
            "{args:?}: record created its trace"
        );
    }
}

/// `serve -- --max-model-len 10 --bogus-flag --served-model-name other`: vllm-rs takes all
/// three without a word and acts on none of them (it would hand them to a Python engine;
/// the second name is only an alias). `serve` says so on stderr.
#[test]
fn serve_warns_about_frontend_flags_that_have_no_effect() {
    let port = vllm_vcr::child::free_ports(1).unwrap()[0];
    let tmp = TestDir::new("cli-ignored");
    let log = tmp.path("serve.err");
    let mut child = vcr_command()
        .args(["serve", "--port", &port.to_string(), "--"])
        .args(["--max-model-len", "10", "--bogus-flag"])
        .args(["--served-model-name", "other"])
        .env("NO_COLOR", "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut err = String::new();
    while std::time::Instant::now() < deadline {
        err = std::fs::read_to_string(&log).unwrap_or_default();
        if err.contains("starting the frontend") || child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let _ = child.wait();
    for needle in [
        "serve -- --max-model-len: an engine setting",
        "`vllm-vcr serve --max-model-len …` (before `--`)",
        "serve -- --bogus-flag: not a flag",
        "serve -- --served-model-name: vllm-rs only adds it as an alias",
    ] {
        assert!(err.contains(needle), "{needle:?} not in:\n{err}");
    }
}

/// `serve --replay-tokens T` reads and indexes the trace once: the check before anything
/// starts and the engine share it (the "indexed" line used to be printed twice, the trace
/// read twice).
#[test]
fn serve_indexes_a_replay_trace_once() {
    let tmp = TestDir::new("cli-replay");
    let trace = tmp.path("replay.jsonl");
    let log = tmp.path("serve.err");
    crate::support::write_one_record_replay_trace(&trace);
    let port = vllm_vcr::child::free_ports(1).unwrap()[0];
    let mut child = vcr_command()
        .args(["serve", "--port", &port.to_string(), "--replay-tokens"])
        .arg(&trace)
        .env("NO_COLOR", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
    let ready = lines.any(|l| l.is_ok_and(|l| l.contains("http://")));
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let _ = child.wait();
    let err = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(ready, "serve never printed its URL:\n{err}");
    assert_eq!(err.matches(": indexed").count(), 1, "{err}");
}
