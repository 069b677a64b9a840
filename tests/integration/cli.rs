//! The command line itself: completions for every shell, and `--help` that explains every
//! flag.

use std::process::Command;

use crate::support::{TestDir, fixture, process_dir, vcr, vcr_command};
use clap::CommandFactory;
use vllm_vcr::cli::Cli;

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

/// The image's entrypoint (docker/entrypoint.sh), run with bash directly: `vllm-vcr` and
/// `vllm-rs` on its PATH are stand-ins that exit 0, so what is checked is the command it
/// would exec (printed on stderr) or the error it stops with. `env` holds the whole
/// environment.
fn entrypoint(mode: &str, env: &[(&str, &str)]) -> (Option<i32>, String) {
    use std::os::unix::fs::PermissionsExt;
    // written once per process: rewriting a shim while another test execs it fails with
    // "Text file busy"
    static SHIMS: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    let bin = SHIMS.get_or_init(|| {
        let bin = process_dir("vcr-entrypoint-shims");
        for name in ["vllm-vcr", "vllm-rs"] {
            let p = bin.join(name);
            std::fs::write(&p, "#!/bin/sh\nexit 0\n").unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        bin
    });
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
    std::fs::write(
        &trace,
        "{\"meta\":{\"block_size\":16}}\n{\"request_id\":\"a\",\"prompt_tokens\":4,\
         \"output_tokens\":2,\"arrival_ms\":0,\"output_token_ids\":[70,71],\
         \"finish_reason\":\"length\"}\n",
    )
    .unwrap();
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

/// Split one shell line into commands of words: quotes and backslashes as the shell reads
/// them, a `#` that starts a word ends the line, and `|`, `&`, `;`, `>` or `<` outside
/// quotes end a command (what follows a redirection is not an argument). Enough for the
/// docs' examples; `$(…)` and `$VAR` stay literal text.
fn shell_commands(line: &str) -> Vec<Vec<String>> {
    let mut commands = vec![Vec::new()];
    let mut word: Option<String> = None;
    let mut skip_next_word = false;
    let mut chars = line.chars().peekable();
    let push = |commands: &mut Vec<Vec<String>>, word: &mut Option<String>, skip: &mut bool| {
        if let Some(w) = word.take() {
            if std::mem::take(skip) {
                return;
            }
            commands.last_mut().unwrap().push(w);
        }
    };
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                let w = word.get_or_insert_with(String::new);
                for c in chars.by_ref() {
                    if c == '\'' {
                        break;
                    }
                    w.push(c);
                }
            }
            '"' => {
                let w = word.get_or_insert_with(String::new);
                while let Some(c) = chars.next() {
                    match c {
                        '"' => break,
                        '\\' => w.extend(chars.next()),
                        c => w.push(c),
                    }
                }
            }
            '\\' => word.get_or_insert_with(String::new).extend(chars.next()),
            '#' if word.is_none() => break,
            c if c.is_whitespace() => push(&mut commands, &mut word, &mut skip_next_word),
            '|' | '&' | ';' => {
                push(&mut commands, &mut word, &mut skip_next_word);
                commands.push(Vec::new());
            }
            '>' | '<' => {
                push(&mut commands, &mut word, &mut skip_next_word);
                while chars.peek().is_some_and(|c| matches!(c, '>' | '&')) {
                    chars.next();
                }
                skip_next_word = true;
            }
            c => word.get_or_insert_with(String::new).push(c),
        }
    }
    push(&mut commands, &mut word, &mut skip_next_word);
    commands.retain(|c| !c.is_empty());
    commands
}

/// Every `vllm-vcr …` command in the fenced `bash`/`sh` examples of README.md and docs/
/// parses with the binary's own command line (flags renamed or removed in the binary fail
/// here, not in a reader's terminal). What this does not check: that a command runs, or
/// what it prints (the figures of docs/fidelity-table.md are generated by `cargo xtask
/// figures`); commands of other programs (`vllm-rs`, `curl`) are not parsed.
#[test]
fn every_vllm_vcr_command_in_the_docs_parses() {
    use clap::Parser;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut checked = 0;
    let mut failures = Vec::new();
    for (name, start, args) in documented_commands() {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        checked += 1;
        match vllm_vcr::cli::Cli::try_parse_from(&args) {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
                ) => {}
            Err(e) => failures.push(format!(
                "{name}:{start}: {}\n  {}",
                args.join(" "),
                e.to_string().lines().next().unwrap_or_default()
            )),
        }
    }
    assert!(
        checked > 40,
        "only {checked} commands found: is the extraction broken?"
    );
    // docs/inspect.md names the help's heading of the engine flags
    let heading = "Engine (the flags of `play`)";
    let help = vcr().args(["inspect", "simulate", "--help"]).output();
    assert!(String::from_utf8_lossy(&help.stdout).contains(&format!("{heading}:")));
    let inspect_md = std::fs::read_to_string(root.join("docs/inspect.md")).unwrap();
    assert!(inspect_md.contains(heading));
    assert!(
        failures.is_empty(),
        "{} of {checked} documented commands do not parse:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Every `vllm-vcr …` (or `cargo run … -- …`, as `vllm-vcr …`) command in the bash/sh
/// blocks of README.md and docs/*.md, in file and line order: (file, line, argv).
fn documented_commands() -> Vec<(String, usize, Vec<String>)> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md")];
    let mut docs: Vec<_> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    let mut found = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let name = file.strip_prefix(root).unwrap().display().to_string();
        let mut in_shell = false;
        let mut logical = String::new();
        let mut start = 0;
        for (i, line) in text.lines().enumerate() {
            if let Some(fence) = line.trim_start().strip_prefix("```") {
                in_shell = !in_shell && matches!(fence.trim(), "bash" | "sh");
                logical.clear();
                continue;
            }
            if !in_shell {
                continue;
            }
            if logical.is_empty() {
                start = i + 1;
            }
            if let Some(head) = line.strip_suffix('\\') {
                logical.push_str(head);
                logical.push(' ');
                continue;
            }
            logical.push_str(line);
            let full = std::mem::take(&mut logical);
            for words in shell_commands(&full) {
                // leading VAR=value assignments are the environment
                let words: Vec<&str> = words
                    .iter()
                    .map(String::as_str)
                    .skip_while(|w| {
                        w.split_once('=').is_some_and(|(k, _)| {
                            !k.is_empty()
                                && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                        })
                    })
                    .collect();
                let args: Vec<&str> = match words.as_slice() {
                    ["vllm-vcr", ..] => words.clone(),
                    ["cargo", "run", rest @ ..] => match rest.iter().position(|w| *w == "--") {
                        Some(i) => std::iter::once("vllm-vcr")
                            .chain(rest[i + 1..].iter().copied())
                            .collect(),
                        None => vec!["vllm-vcr"],
                    },
                    _ => continue,
                };
                found.push((
                    name.clone(),
                    start,
                    args.iter().map(|a| a.to_string()).collect(),
                ));
            }
        }
    }
    found
}

/// Every offline `inspect` example in the docs runs as written, in the docs' order, in a
/// directory that holds the files the examples name (the repo's CPU-engine capture as
/// `trace.jsonl.gz`, its sidecar as `steps.jsonl.gz`, the Mooncake and guidellm fixtures
/// under the names the examples use, `tests/` and `conformance/` as in the repo): each
/// exits 0, except a `calibrate` whose gate fails, which exits 1 with its FAIL report.
/// Left out: `--open` (a server until Ctrl-C), `calibrate-e2e` (a real frontend: its own
/// tests run it) and placeholder synopses (`TRACE…`).
#[test]
fn every_offline_inspect_example_in_the_docs_runs() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let tmp = TestDir::new("doc-examples");
    let dir = tmp.root();
    let fixtures = root.join("tests/fixtures");
    let copy = |from: &str, to: &str| {
        std::fs::copy(fixtures.join(from), dir.join(to)).unwrap();
    };
    for name in [
        "trace.jsonl.gz",
        "a.jsonl.gz",
        "b.jsonl.gz",
        "capture.jsonl.gz",
    ] {
        copy("cpu-engine-capture/trace.jsonl.gz", name);
    }
    for name in ["steps.jsonl.gz", "a-steps.jsonl.gz", "b-steps.jsonl.gz"] {
        copy("cpu-engine-capture/steps.jsonl.gz", name);
    }
    copy("mooncake/sample.jsonl", "mooncake_trace.jsonl");
    {
        use std::io::Read;
        let mut json = String::new();
        flate2::read::GzDecoder::new(
            std::fs::File::open(fixtures.join("guidellm/report.json.gz")).unwrap(),
        )
        .read_to_string(&mut json)
        .unwrap();
        std::fs::write(dir.join("report.json"), json).unwrap();
    }
    for linked in ["tests", "conformance"] {
        std::os::unix::fs::symlink(root.join(linked), dir.join(linked)).unwrap();
    }
    let mut ran = 0;
    let mut failures = Vec::new();
    for (name, line, args) in documented_commands() {
        let runnable = args.get(1).is_some_and(|a| a == "inspect")
            && !args.iter().any(|a| {
                a == "--open" || a == "calibrate-e2e" || a.contains('…') || a.starts_with('[')
            });
        if !runnable {
            continue;
        }
        let out = vcr().args(&args[1..]).current_dir(dir).output();
        ran += 1;
        // calibrate gates every run: exit 1 with a FAIL verdict is its answer, not an error
        let stdout = String::from_utf8_lossy(&out.stdout);
        let verdict = args.get(2).is_some_and(|a| a == "calibrate")
            && out.status.code() == Some(1)
            && (stdout.contains("result: FAIL") || stdout.contains("\"pass\": false"));
        let ok = out.status.success() || verdict;
        if !ok {
            failures.push(format!(
                "{name}:{line}: {} → {:?}\n  {}",
                args.join(" "),
                out.status.code(),
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .rev()
                    .take(3)
                    .collect::<Vec<_>>()
                    .join(" | ")
            ));
        }
    }
    assert!(
        ran >= 25,
        "only {ran} examples ran: is the extraction broken?"
    );
    assert!(
        failures.is_empty(),
        "{} of {ran} documented inspect examples fail:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// `record` mode names the trace's model as clients send it: SERVED_MODEL_NAME before
/// MODEL (docs/deploy.md); SERVED_MODEL_NAME alone used to leave the meta without a model.
#[test]
fn the_entrypoint_names_the_traced_model_as_clients_do() {
    for (env, want) in [
        (vec![("MODEL", "org/m")], Some("--model org/m ")),
        (vec![("SERVED_MODEL_NAME", "s")], Some("--model s ")),
        (
            vec![("MODEL", "org/m"), ("SERVED_MODEL_NAME", "s")],
            Some("--model s "),
        ),
        (vec![], None),
    ] {
        let (code, err) = entrypoint("record", &env);
        assert_eq!(code, Some(0), "{env:?}: {err}");
        match want {
            Some(w) => assert!(err.contains(w), "{env:?}: {err}"),
            None => assert!(!err.contains("--model"), "{err}"),
        }
    }
}

/// The README's table names every `inspect` subcommand (it used to omit `compare` and
/// `calibrate-e2e`), and docs/deploy.md names every image the manifests in deploy/ run (it
/// said they all run vllm-vcr's own).
#[test]
fn the_docs_name_every_inspect_command_and_every_deployed_image() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let row = readme
        .lines()
        .find(|l| l.starts_with("| `vllm-vcr inspect`"))
        .expect("the README's inspect row");
    let cmd = Cli::command();
    let inspect = cmd.find_subcommand("inspect").unwrap();
    for sub in inspect.get_subcommands() {
        let name = sub.get_name();
        assert!(
            row.contains(&format!("`{name}`")),
            "README lacks `{name}`: {row}"
        );
    }

    let deploy = std::fs::read_to_string(root.join("docs/deploy.md")).unwrap();
    let mut stack = vec![root.join("deploy")];
    let mut images = std::collections::BTreeSet::new();
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
                for l in std::fs::read_to_string(&p).unwrap().lines() {
                    if let Some(img) = l.trim().strip_prefix("image:") {
                        images.insert(img.trim().trim_matches('"').to_string());
                    }
                }
            }
        }
    }
    assert!(!images.is_empty());
    for img in &images {
        assert!(deploy.contains(img), "docs/deploy.md does not name {img}");
    }
}
