//! Prefill/decode disaggregation end to end (control plane; with `--features nixl` the KV
//! bytes move over NIXL and are checked too — CI's test stage): a prefill `serve`
//! (`--pd-role prefill`), a decode `serve` (`--pd-role decode`), each a real vllm-rs
//! frontend with `play` behind, and `vllm-vcr pd-proxy` in front. What a P/D user checks:
//! the client gets the whole answer (streamed and not); the decode pulled exactly the
//! prompt's blocks and the prefill freed them after the read; unread KV is freed when its
//! lease ends; a pull that fails follows --kv-load-failure-policy; a client that leaves
//! mid-pull leaves nothing behind.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::support::{TestProcess, http_request, vcr_command, wait_until};

/// `vllm-vcr` with `args`, as `name` (`pd-<name>`: its logs' directory), stdout and stderr
/// logged, stopped with SIGINT (10 s grace) when the test ends.
pub(super) fn start(args: &[String], name: &str) -> TestProcess {
    let mut cmd = vcr_command();
    cmd.args(args).env("NO_COLOR", "1");
    TestProcess::start_logged(&format!("pd-{name}"), cmd)
}

pub(super) fn ports(n: usize) -> Vec<u16> {
    vllm_vcr::child::free_ports(n).expect("free ports")
}

pub(super) fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

/// A `serve` with vllm-rs 0.33 and these engine flags, up and answering /health.
pub(super) fn serve(port: u16, extra: &[String], name: &str) -> TestProcess {
    let mut args = strings(&["serve", "--port"]);
    args.push(port.to_string());
    // serve's own wait for its frontend (default 120 s) as long as this hang guard: the
    // Python frontend inspects the model in a subprocess before it listens, and on a
    // loaded 2-core host that outlasted 120 s (a CI run, 2026-11-28)
    args.extend(strings(&["--log-requests", "--startup-timeout", "300"]));
    args.extend_from_slice(extra);
    let p = start(&args, name);
    wait_health(port, &p);
    p
}

/// `vllm-vcr pd-proxy` on `port` in front of the prefill and decode frontends, answering
/// /health.
pub(super) fn proxy(prefill: u16, decode: u16, port: u16, name: &str) -> TestProcess {
    let p = start(
        &strings(&[
            "pd-proxy",
            "--prefill",
            &format!("http://127.0.0.1:{prefill}"),
            "--decode",
            &format!("http://127.0.0.1:{decode}"),
            "--port",
            &port.to_string(),
        ]),
        name,
    );
    wait_health(port, &p);
    p
}

pub(super) fn wait_health(port: u16, p: &TestProcess) {
    // a hang guard, not a timing check: a Python frontend imports for a minute on a
    // 2-core host that is building beside it, then waits for its engine (seen: 120 s
    // passed with the frontend up and still handshaking)
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        if get(port, "/health").0 == 200 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{port} never came up:\n{}",
            p.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `method path` with the JSON text `body` (none if empty): the status and the answer as
/// text, `(0, "")` while nothing answers.
pub(super) fn request(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    let body: Option<serde_json::Value> =
        (!body.is_empty()).then(|| serde_json::from_str(body).expect("a JSON request body"));
    http_request(port, method, path, body.as_ref())
}

pub(super) fn get(port: u16, path: &str) -> (u16, String) {
    request(port, "GET", path, "")
}

pub(super) fn post(port: u16, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let (status, text) = request(port, "POST", path, &body.to_string());
    (
        status,
        serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)),
    )
}

/// A gauge of the frontend's /metrics.
pub(super) fn metric(port: u16, name: &str) -> f64 {
    let (_, text) = get(port, "/metrics");
    text.lines()
        .find(|l| {
            l.starts_with(name)
                && (l.len() == name.len() || l[name.len()..].starts_with(['{', ' ']))
        })
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics of {port}"))
}

/// `key=value` of the first log line containing `what` (tracing's field format).
pub(super) fn log_field(log: &str, what: &str, key: &str) -> Option<String> {
    let line = log.lines().find(|l| l.contains(what))?;
    let rest = line.split(&format!("{key}=")).nth(1)?;
    Some(rest.split_whitespace().next()?.to_string())
}

#[test]
fn a_prefill_decode_pair_behind_the_proxy_serves_whole_answers_and_frees_the_kv() {
    let p = ports(4);
    let (pf_port, dec_port, proxy_port, side) = (p[0], p[1], p[2], p[3]);
    let prefill = serve(
        pf_port,
        &strings(&[
            "--pd-role",
            "prefill",
            "--engine-id",
            "prefill-0",
            "--side-channel-port",
            &side.to_string(),
            "--kv-lease-duration",
            "2",
        ]),
        "prefill",
    );
    let decode = serve(
        dec_port,
        &strings(&["--pd-role", "decode", "--engine-id", "decode-0"]),
        "decode",
    );
    let _proxy = proxy(pf_port, dec_port, proxy_port, "proxy");

    // non-streamed: the whole answer, and exactly the prompt's blocks moved
    let prompt = "A prefill/decode pair answers this prompt: 68 bytes, so five blocks.";
    assert_eq!(prompt.len(), 68);
    let (status, body) = post(
        proxy_port,
        "/v1/completions",
        &serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 12}),
    );
    assert_eq!(status, 200, "{body}\n{}", decode.log());
    assert_eq!(body["usage"]["completion_tokens"], 12, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], 68, "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    let blocks = 68usize.div_ceil(16).to_string(); // a partial last block is sent too
    assert!(
        wait_until(Duration::from_secs(5), || log_field(
            &decode.log(),
            "remote KV pulled",
            "blocks"
        )
        .is_some()),
        "{}",
        decode.log()
    );
    // with NIXL the prefill frees the blocks when the READ's notification arrives, a
    // moment after the decode has its bytes
    assert!(
        wait_until(Duration::from_secs(5), || prefill
            .log()
            .contains("KV read by the decode engine")),
        "{}",
        prefill.log()
    );
    let plog = prefill.log();
    assert_eq!(
        log_field(&plog, "prefill done: KV kept", "blocks").as_deref(),
        Some(blocks.as_str()),
        "{plog}"
    );
    assert_eq!(
        log_field(&plog, "KV read by the decode engine", "blocks").as_deref(),
        Some(blocks.as_str()),
        "{plog}"
    );
    // the reader is the decode engine (its NIXL agent is named after it)
    assert!(
        log_field(&plog, "KV read by the decode engine", "reader")
            .is_some_and(|r| r.starts_with("decode-0")),
        "{plog}"
    );
    assert_eq!(
        log_field(&decode.log(), "remote KV pulled", "blocks").as_deref(),
        Some(blocks.as_str())
    );
    // with NIXL, the bytes moved: 4096 per block (--kv-block-bytes), every one checked
    if cfg!(feature = "nixl") {
        let dlog = decode.log();
        assert_eq!(
            log_field(&dlog, "every byte verified", "bytes").as_deref(),
            Some((68usize.div_ceil(16) * 4096).to_string().as_str()),
            "{dlog}"
        );
        assert!(plog.contains("data_plane=nixl"), "{plog}");
    }
    // the read freed the prefill's blocks at once, long before the 2 s lease
    assert!(
        wait_until(Duration::from_millis(1500), || metric(
            pf_port,
            "vllm:kv_cache_usage_perc"
        ) == 0.0),
        "prefill KV still in use after the read"
    );
    // the decode saw the prompt as pulled (external) cache: the frontend counts the prompt
    // as prefilled once on each side
    assert_eq!(metric(dec_port, "vllm:prompt_tokens_total"), 68.0);
    assert_eq!(metric(pf_port, "vllm:prompt_tokens_total"), 68.0);
    assert_eq!(metric(pf_port, "vllm:generation_tokens_total"), 1.0);
    assert_eq!(metric(dec_port, "vllm:generation_tokens_total"), 12.0);

    // streamed chat through the proxy
    let body = serde_json::json!({"model": "tiny", "max_tokens": 9, "stream": true,
        "messages": [{"role": "user", "content": "Stream this answer through the pair."}]});
    let (status, sse) = request(
        proxy_port,
        "POST",
        "/v1/chat/completions",
        &body.to_string(),
    );
    assert_eq!(status, 200, "{sse}");
    let mut text = String::new();
    let mut finish = String::new();
    for line in sse.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if line.trim() == "[DONE]" {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        text.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
        if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    assert!(sse.contains("[DONE]"), "{sse}");
    assert_eq!(finish, "length");
    assert!(!text.is_empty());

    // a prefill whose decode never comes: the KV is held, then freed when the lease ends
    let (status, body) = post(
        pf_port,
        "/v1/completions",
        &serde_json::json!({"model": "tiny", "prompt": "Nobody reads this KV; the lease frees it.",
            "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}),
    );
    assert_eq!(status, 200, "{body}");
    let params = &body["kv_transfer_params"];
    assert_eq!(params["do_remote_prefill"], true, "{body}");
    assert_eq!(params["remote_engine_id"], "prefill-0");
    assert_eq!(params["remote_port"], side);
    assert_eq!(params["transfer_mode"], "pull");
    assert_eq!(params["remote_num_tokens"], 41);
    assert_eq!(params["remote_block_ids"][0].as_array().unwrap().len(), 3);
    // the gauge follows the engine's next stats message
    assert!(
        wait_until(Duration::from_secs(1), || metric(
            pf_port,
            "vllm:kv_cache_usage_perc"
        ) > 0.0),
        "held blocks count as used"
    );
    assert!(
        wait_until(Duration::from_secs(4), || metric(
            pf_port,
            "vllm:kv_cache_usage_perc"
        ) == 0.0),
        "the lease did not free the unread blocks:\n{}",
        prefill.log()
    );
    assert!(prefill.log().contains("before its lease expired"));
}

/// A decode request whose prefill engine is gone: `fail` answers HTTP 500 (vLLM's
/// default), `recompute` prefills locally and answers in full. A client that leaves while
/// the pull is pending leaves the engine empty.
#[test]
fn a_failed_pull_follows_the_load_failure_policy_and_an_abort_mid_pull_cleans_up() {
    let p = ports(3);
    let dead = p[2]; // nothing listens there
    let params = serde_json::json!({"do_remote_prefill": true, "do_remote_decode": false,
        "remote_engine_id": "gone", "remote_request_id": "cmpl-gone-0", "remote_host": "127.0.0.1",
        "remote_port": dead, "remote_block_ids": [[1, 2, 3]], "remote_num_tokens": 40});
    let fail = serve(p[0], &strings(&["--pd-role", "decode"]), "fail");
    let recompute = serve(
        p[1],
        &strings(&[
            "--pd-role",
            "decode",
            "--kv-load-failure-policy",
            "recompute",
        ]),
        "recompute",
    );
    let body = serde_json::json!({"model": "tiny", "prompt": "The prefill engine of this request is gone.",
        "max_tokens": 6, "kv_transfer_params": params});
    let t = Instant::now();
    let (status, got) = post(p[0], "/v1/completions", &body);
    assert_eq!(status, 500, "{got}");
    assert!(
        t.elapsed() < Duration::from_secs(15),
        "a failed pull must end in bounded time"
    );
    assert!(fail.log().contains("KV load failed"), "{}", fail.log());
    let (status, got) = post(p[1], "/v1/completions", &body);
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["usage"]["completion_tokens"], 6);
    assert!(recompute.log().contains("recomputing the prompt locally"));

    // a client that gives up while the pull is pending
    let mut stream = TcpStream::connect(("127.0.0.1", p[0])).unwrap();
    let mut streamed = body.clone();
    streamed["stream"] = serde_json::json!(true);
    let text = streamed.to_string();
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{text}",
        text.len()
    )
    .unwrap();
    let mut first = String::new();
    stream
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let _ = BufReader::new(&stream).read_line(&mut first);
    assert!(
        wait_until(Duration::from_secs(3), || metric(
            p[0],
            "vllm:num_requests_waiting"
        ) >= 1.0),
        "the pending pull is a waiting request"
    );
    drop(stream);
    assert!(
        wait_until(Duration::from_secs(10), || metric(
            p[0],
            "vllm:num_requests_waiting"
        ) == 0.0
            && metric(p[0], "vllm:num_requests_running") == 0.0),
        "the aborted request stayed:\n{}",
        fail.log()
    );
    // and the engine still serves
    let (status, got) = post(
        p[0],
        "/v1/completions",
        &serde_json::json!({"model": "tiny", "prompt": "still here", "max_tokens": 3}),
    );
    assert_eq!(status, 200, "{got}");
}

/// `scripts/pd_control.sh`, the smoke users run: it passes, and prints the handoff cost.
#[test]
fn the_pd_control_script_passes() {
    // five ports from the picker every `serve` uses, so they never meet its own choices
    let ports = ports(5)
        .iter()
        .map(u16::to_string)
        .collect::<Vec<_>>()
        .join(" ");
    let out = Command::new("bash")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/pd_control.sh"
        ))
        .arg("10")
        .env("VCR_BIN", env!("CARGO_BIN_EXE_vllm-vcr"))
        .env("VCR_PD_PORTS", ports)
        .env(
            "VCR_EXPECT_NIXL",
            if cfg!(feature = "nixl") { "1" } else { "0" },
        )
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    eprintln!("{text}");
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("pd_control: PASS") && text.contains("handoff overhead"),
        "{text}"
    );
}

/// Subscribe to an engine's KV-events publisher; the events seen until `stop` is set.
fn collect_kv_events(
    port: u16,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<Vec<sim_protocol::kv_events::KvEvent>> {
    use zeromq::{Socket, SocketRecv};
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut sub = zeromq::SubSocket::new();
            sub.connect(&format!("tcp://127.0.0.1:{port}"))
                .await
                .unwrap();
            sub.subscribe("").await.unwrap();
            let mut events = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let Ok(Ok(msg)) =
                    tokio::time::timeout(Duration::from_millis(100), sub.recv()).await
                else {
                    continue;
                };
                let frames = msg.into_vec();
                let payload = frames.last().expect("a KV-events message has frames");
                let (_, batch, _) = sim_protocol::kv_events::decode_kv_event_batch(payload)
                    .expect("a KV-event batch vLLM's subscribers decode");
                events.extend(batch);
            }
            events
        })
    })
}

/// The blocks an engine's events say it cached, in order.
fn stored_hashes(events: &[sim_protocol::kv_events::KvEvent]) -> Vec<u64> {
    events
        .iter()
        .filter_map(|e| match e {
            sim_protocol::kv_events::KvEvent::BlockStored { block_hashes, .. } => {
                Some(block_hashes.clone())
            }
            _ => None,
        })
        .flatten()
        .collect()
}

/// What a prefix-cache-aware router sees of a P/D pair: the prefill engine publishes the
/// prompt's full blocks when it computes them, and the decode engine publishes the very
/// same block hashes once the pulled KV is in its cache.
#[test]
fn kv_events_of_both_sides_name_the_same_blocks() {
    let p = ports(5);
    let (pf_port, dec_port, proxy_port, side, pf_ev) = (p[0], p[1], p[2], p[3], p[4]);
    let dec_ev = ports(1)[0];
    let events = |port: u16| {
        format!(
            r#"{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{port}"}}"#
        )
    };
    let prefill = serve(
        pf_port,
        &strings(&[
            "--pd-role",
            "prefill",
            "--engine-id",
            "prefill-ev",
            "--side-channel-port",
            &side.to_string(),
            "--kv-events-config",
            &events(pf_ev),
        ]),
        "prefill-ev",
    );
    let decode = serve(
        dec_port,
        &strings(&[
            "--pd-role",
            "decode",
            "--engine-id",
            "decode-ev",
            "--kv-events-config",
            &events(dec_ev),
        ]),
        "decode-ev",
    );
    let _proxy = proxy(pf_port, dec_port, proxy_port, "proxy-ev");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let pf_sub = collect_kv_events(pf_ev, stop.clone());
    let dec_sub = collect_kv_events(dec_ev, stop.clone());
    std::thread::sleep(Duration::from_millis(500)); // the subscriptions reach the publishers

    // 69 tokens: four full blocks (a partial block is never cached, nor published)
    let prompt = "Both engines of this pair publish the same four full KV-cache blocks.";
    assert_eq!(prompt.len(), 69);
    let (status, body) = post(
        proxy_port,
        "/v1/completions",
        &serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 4}),
    );
    assert_eq!(status, 200, "{body}");
    assert!(
        wait_until(Duration::from_secs(5), || log_field(
            &decode.log(),
            "remote KV pulled",
            "blocks"
        )
        .is_some()),
        "{}",
        decode.log()
    );
    std::thread::sleep(Duration::from_millis(800));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let pf_events = pf_sub.join().unwrap();
    let dec_events = dec_sub.join().unwrap();
    let pf_stored = stored_hashes(&pf_events);
    let dec_stored = stored_hashes(&dec_events);
    assert_eq!(
        pf_stored.len(),
        4,
        "prefill events {pf_events:?}\n{}",
        prefill.log()
    );
    assert_eq!(
        dec_stored, pf_stored,
        "decode events {dec_events:?}\nprefill events {pf_events:?}"
    );
}

/// A vLLM decode engine's first step against a prefill `play`: the side-channel handshake.
/// vLLM 0.33's own `NixlHandshakePayload` and `NixlAgentMetadata` decoders read the answer
/// (tests/clients/nixl_handshake.py, in the Python frontend's venv).
#[cfg(feature = "nixl")]
#[test]
fn vllms_own_decoders_read_the_prefill_handshake() {
    let cache = vllm_vcr::frontends::cache_root().expect("cache root");
    let python = vllm_vcr::frontends::python_venv(&cache, "vllm", "0.33.0")
        .join("bin")
        .join("python");
    assert!(
        python.exists(),
        "{} is missing: install it with `cargo xtask fetch --python-only`",
        python.display()
    );
    let p = ports(2);
    let prefill = serve(
        p[0],
        &strings(&[
            "--pd-role",
            "prefill",
            "--engine-id",
            "prefill-hs",
            "--side-channel-port",
            &p[1].to_string(),
            "--num-gpu-blocks",
            "1024",
        ]),
        "prefill-hs",
    );
    let out = Command::new(&python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/clients/nixl_handshake.py"
        ))
        .args(["127.0.0.1", &p[1].to_string(), "prefill-hs"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        prefill.log()
    );
    assert!(
        stdout.contains("engine_id=prefill-hs num_blocks=1024 block_lens=[4096]"),
        "{stdout}"
    );
}

/// A `/proc/<pid>/status` field in KiB (`VmHWM`: the peak resident memory).
fn proc_status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Everything the peer sends until it closes (or resets, or `limit` passes).
fn read_all(c: &mut TcpStream, limit: Duration) -> String {
    c.set_read_timeout(Some(limit)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = c.read(&mut buf) {
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// A hostile client cannot make the proxy hold what it sends: a 300 MB body is refused
/// with 413 while the proxy's memory stays small (it used to buffer it whole: RSS 9 ->
/// 315 MB), and connections that stop in the middle of their headers are answered 408 and
/// closed after `--header-timeout` (they used to be held open for ever). No frontend is
/// needed: neither request reaches one.
#[test]
fn the_proxy_refuses_a_huge_body_and_drops_clients_stalled_in_their_headers() {
    let [port, nobody] = ports(2)[..] else {
        unreachable!()
    };
    let nobody = format!("http://127.0.0.1:{nobody}");
    let p = start(
        &strings(&[
            "pd-proxy",
            "--prefill",
            &nobody,
            "--decode",
            &nobody,
            "--port",
            &port.to_string(),
            "--header-timeout",
            "1",
        ]),
        "limits",
    );
    assert!(
        wait_until(Duration::from_secs(30), || p.log().contains("pd-proxy on")),
        "{}",
        p.log()
    );
    let pid = p.pid();

    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 300000000\r\n\r\n",
    )
    .unwrap();
    let mut w = c.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        let chunk = vec![b' '; 1 << 20];
        for _ in 0..300 {
            if w.write_all(&chunk).is_err() {
                break;
            }
        }
    });
    let answer = read_all(&mut c, Duration::from_secs(60));
    drop(c);
    writer.join().unwrap();
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer:.300}");
    assert!(answer.contains("--max-body-mib"), "{answer:.300}");
    let peak = proc_status_kib(pid, "VmHWM:");
    assert!(peak < 100 * 1024, "the proxy's peak RSS is {peak} KiB");

    let before = open_fds(pid);
    let mut stalled: Vec<TcpStream> = (0..50)
        .map(|_| {
            let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
            c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
                .unwrap();
            c
        })
        .collect();
    let t0 = Instant::now();
    let answer = read_all(&mut stalled[0], Duration::from_secs(20));
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
    assert!(answer.contains("--header-timeout"), "{answer}");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    // every stalled connection is closed, not only the first
    assert!(
        wait_until(Duration::from_secs(10), || open_fds(pid) <= before),
        "{} fds open, {before} before the stalled clients",
        open_fds(pid)
    );
    drop(stalled);
}

/// Fuzz: whatever bytes a client sends the proxy (random bytes, broken request lines,
/// absurd lengths, a cut-off body), the proxy answers or closes that connection within
/// its header timeout and stays up; a well-formed request afterwards is still answered
/// (502: both frontends are down here). 160 cases, well under a second.
#[test]
fn the_proxy_survives_any_bytes_a_client_sends() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};
    let p = ports(3);
    // the frontends are never started: the proxy answers 502 for a request it can parse
    let proc_ = start(
        &strings(&[
            "pd-proxy",
            "--prefill",
            &format!("http://127.0.0.1:{}", p[0]),
            "--decode",
            &format!("http://127.0.0.1:{}", p[1]),
            "--port",
            &p[2].to_string(),
            "--header-timeout",
            "2",
        ]),
        "fuzz",
    );
    assert!(
        wait_until(Duration::from_secs(20), || TcpStream::connect((
            "127.0.0.1",
            p[2]
        ))
        .is_ok()),
        "the proxy did not listen: {}",
        proc_.log()
    );
    let send = |bytes: &[u8]| {
        let Ok(mut c) = TcpStream::connect(("127.0.0.1", p[2])) else {
            return;
        };
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = c.write_all(bytes);
        let _ = c.shutdown(std::net::Shutdown::Write);
        let mut sink = Vec::new();
        let _ = c.read_to_end(&mut sink);
    };
    let nasty = prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..2048),
        (any::<u64>(), "[ -~]{0,40}").prop_map(|(n, junk)| format!(
            "POST /v1/completions HTTP/1.1\r\nContent-Length: {n}\r\n{junk}\r\n\r\n{{\"prompt\":"
        )
        .into_bytes()),
        "[A-Z]{0,8} [ -~]{0,64} HTTP/1\\.[01]\r\n([ -~]{0,30}\r\n){0,5}\r\n[ -~]{0,64}"
            .prop_map(String::into_bytes),
    ];
    let mut runner = TestRunner::new(Config {
        cases: 160,
        ..Config::default()
    });
    runner
        .run(&nasty, |bytes| {
            send(&bytes);
            Ok(())
        })
        .unwrap();
    let mut child = proc_;
    assert!(
        child.try_wait().is_none(),
        "the proxy died: {}",
        child.log()
    );
    let (status, _) = request(
        p[2],
        "POST",
        "/v1/completions",
        r#"{"model":"tiny","prompt":"hi","max_tokens":2}"#,
    );
    assert_eq!(status, 502, "{}", child.log());
}
