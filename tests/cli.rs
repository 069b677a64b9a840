//! The command line itself: completions for every shell, and `--help` that explains every
//! flag.

use std::process::Command;

use clap::CommandFactory;
use vllm_vcr::cli::Cli;

#[test]
fn completions_for_every_shell() {
    for shell in ["bash", "zsh", "fish", "powershell", "elvish"] {
        let out = Command::new(env!("CARGO_BIN_EXE_vllm-vcr"))
            .args(["completions", shell])
            .output()
            .unwrap();
        assert!(out.status.success(), "{shell}");
        let text = String::from_utf8(out.stdout).unwrap();
        // fish lists long flags without their dashes
        for word in ["play", "serve", "handshake-address", "inter-token-latency"] {
            assert!(text.contains(word), "{shell} completion lacks {word}");
        }
    }
    let bad = Command::new(env!("CARGO_BIN_EXE_vllm-vcr"))
        .args(["completions", "tcsh"])
        .output()
        .unwrap();
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
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_vllm-vcr"))
            .args(&args)
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
    let mut child = Command::new(env!("CARGO_BIN_EXE_vllm-vcr"))
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
        let mut child = Command::new(env!("CARGO_BIN_EXE_vllm-vcr"))
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
    let mut child = Command::new(env!("CARGO_BIN_EXE_vllm-vcr"))
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

/// The image's entrypoint (docker/entrypoint.sh), run with bash directly: `vllm-vcr` and
/// `vllm-rs` on its PATH are stand-ins that exit 0, so what is checked is the command it
/// would exec (printed on stderr) or the error it stops with. `env` holds the whole
/// environment.
fn entrypoint(mode: &str, env: &[(&str, &str)]) -> (Option<i32>, String) {
    use std::os::unix::fs::PermissionsExt;
    let bin = std::env::temp_dir().join(format!("vcr-entrypoint-shims-{}", std::process::id()));
    std::fs::create_dir_all(&bin).unwrap();
    for name in ["vllm-vcr", "vllm-rs"] {
        let p = bin.join(name);
        std::fs::write(&p, "#!/bin/sh\nexit 0\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let out = Command::new("bash")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/docker/entrypoint.sh"))
        .arg(mode)
        .env_clear()
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A typo in a MOCK_* name ending in `_PORT` is an error naming it, not a Kubernetes
/// service link (it used to be ignored silently); real service links, which come with
/// their `<SERVICE>_SERVICE_HOST`, still pass.
#[test]
fn the_entrypoint_takes_only_real_service_links_for_links() {
    for typo in ["MOCK_SIDE_CHANEL_PORT", "MOCK_MAX_NUM_SEQ_PORT"] {
        let (code, err) = entrypoint("play", &[(typo, "5600")]);
        assert_eq!(code, Some(2), "{typo}: {err}");
        assert!(err.contains(&format!("unknown variable {typo}")), "{err}");
    }
    // what a Service named `mock` (one port, named http) puts into every pod
    let links = [
        ("MOCK_SERVICE_HOST", "10.0.0.7"),
        ("MOCK_SERVICE_PORT", "8000"),
        ("MOCK_SERVICE_PORT_HTTP", "8000"),
        ("MOCK_PORT", "tcp://10.0.0.7:8000"),
        ("MOCK_PORT_8000_TCP", "tcp://10.0.0.7:8000"),
        ("MOCK_PORT_8000_TCP_PROTO", "tcp"),
        ("MOCK_PORT_8000_TCP_PORT", "8000"),
        ("MOCK_PORT_8000_TCP_ADDR", "10.0.0.7"),
    ];
    let (code, err) = entrypoint("play", &links);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("exec vllm-vcr play"), "{err}");
    // the same link names without their service host are not links
    let (code, err) = entrypoint("play", &links[1..]);
    assert_eq!(code, Some(2), "{err}");
}

/// `PORT=08080` is port 8080 (bash used to read it as octal and fail with "value too great
/// for base"); an enum value matches one choice exactly (`prefill,decode` used to pass).
#[test]
fn the_entrypoint_reads_numbers_in_base_10_and_enums_exactly() {
    let (code, err) = entrypoint("serve", &[("PORT", "08080")]);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("--port 8080 "), "{err}");
    let (code, err) = entrypoint("serve", &[("PORT", "070000")]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("PORT=\"070000\": expected a port number"),
        "{err}"
    );
    for bad in ["prefill,decode", "decode,", ",both", "prefil"] {
        let (code, err) = entrypoint("play", &[("MOCK_PD_ROLE", bad)]);
        assert_eq!(code, Some(2), "{bad}: {err}");
        assert!(err.contains("MOCK_PD_ROLE"), "{err}");
    }
    let (code, err) = entrypoint("play", &[("MOCK_PD_ROLE", "decode")]);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("--pd-role decode"), "{err}");
}

/// `serve -- --max-model-len 10 --bogus-flag --served-model-name other`: vllm-rs takes all
/// three without a word and acts on none of them (it would hand them to a Python engine;
/// the second name is only an alias). `serve` says so on stderr.
#[test]
fn serve_warns_about_frontend_flags_that_have_no_effect() {
    let port = vllm_vcr::child::free_ports(1).unwrap()[0];
    let log = std::env::temp_dir().join(format!("vcr-cli-ignored-{}.err", std::process::id()));
    let mut child = Command::new(env!("CARGO_BIN_EXE_vllm-vcr"))
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
    let dir = std::env::temp_dir();
    let trace = dir.join(format!("vcr-cli-replay-{}.jsonl", std::process::id()));
    let log = dir.join(format!("vcr-cli-replay-{}.err", std::process::id()));
    std::fs::write(
        &trace,
        "{\"meta\":{\"block_size\":16}}\n{\"request_id\":\"a\",\"prompt_tokens\":4,\
         \"output_tokens\":2,\"arrival_ms\":0,\"output_token_ids\":[70,71],\
         \"finish_reason\":\"length\"}\n",
    )
    .unwrap();
    let port = vllm_vcr::child::free_ports(1).unwrap()[0];
    let mut child = Command::new(env!("CARGO_BIN_EXE_vllm-vcr"))
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
