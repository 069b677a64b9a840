//! The image run alone: `--version` and bad variables, `serve` (health, chat, stream,
//! SIGTERM) and a frontend that dies; the HTTP helpers the pod checks share.

use super::*;

/// `podman run --rm IMAGE ARGS` with environment `env`: (exit code, stdout, stderr).
pub(super) fn run_once(
    podman: &Podman,
    image: &str,
    env: &[&str],
    args: &[&str],
) -> Result<(i32, String, String)> {
    let mut a: Vec<&str> = vec!["run", "--rm", "--network", "host"];
    for e in env {
        a.push("-e");
        a.push(e);
    }
    a.push(image);
    a.extend_from_slice(args);
    let out = podman.output(&a)?;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

pub(super) fn check_cli(podman: &Podman, image: &str) -> Result<()> {
    let (code, out, err) = run_once(podman, image, &[], &["--version"])?;
    let version = env!("CARGO_PKG_VERSION");
    if code != 0 || !out.contains(version) {
        bail!(
            "`--version`: exit {code}, stdout {out:?}, stderr {}",
            snippet(&err)
        );
    }
    eprintln!("  --version: {}", out.trim());
    for (env, must_say) in [
        (
            "MOCK_MAX_NUM_SEQS=abc",
            "MOCK_MAX_NUM_SEQS=\"abc\": expected a whole number",
        ),
        (
            "MOCK_PD_ROLE=prefil",
            "MOCK_PD_ROLE=\"prefil\": expected one of prefill, decode, both",
        ),
        (
            "MOCK_TTFT=40",
            "unknown variable MOCK_TTFT (did you mean: MOCK_TTFT_MS",
        ),
        (
            "MOCK_REPLAY_TOKENS=/trace/none.jsonl",
            "not found: /trace/none.jsonl",
        ),
        (
            "MOCK_REPLAY_TOKENS=/trace/none.jsonl MOCK_WAIT_FOR_TRACE_S=1",
            "not there after 1 s: /trace/none.jsonl",
        ),
    ] {
        let vars: Vec<&str> = env.split(' ').collect();
        let (code, _, err) = run_once(podman, image, &vars, &[])?;
        if code != 2 || !err.contains(must_say) {
            bail!(
                "{env}: expected exit status 2 and {must_say:?}, got exit {code} and {}",
                snippet(&err)
            );
        }
        eprintln!("  {env}: refused (exit 2): {}", err.trim());
    }
    Ok(())
}

/// Poll /health until 200, failing early if the container stops.
pub(super) fn wait_health(
    podman: &Podman,
    container: &str,
    port: u16,
    timeout: Duration,
) -> Result<f64> {
    let t = Instant::now();
    let client = Client::new(port, Duration::from_secs(2));
    loop {
        if let Ok(r) = client.get("/health")
            && r.status == 200
        {
            return Ok(t.elapsed().as_secs_f64());
        }
        if !podman.running(container) {
            bail!(
                "{container} stopped before /health answered; its log:\n{}",
                podman.logs(container)
            );
        }
        if t.elapsed() > timeout {
            bail!(
                "/health on port {port} did not answer 200 within {timeout:?}; log of {container}:\n{}",
                podman.logs(container)
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// A non-streaming chat completion of `max_tokens`: its text (checked: HTTP 200,
/// finish_reason `length`, that many completion tokens).
pub(super) fn chat(client: &Client, model: &str, prompt: &str, max_tokens: u32) -> Result<String> {
    let r = client.post(
        "/v1/chat/completions",
        &json!({"model": model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens}),
    )?;
    if r.status != 200 {
        bail!("chat completion: HTTP {} {}", r.status, snippet(&r.text()));
    }
    let v = r.json()?;
    let (finish, used) = finish_and_used(&v);
    let text = v
        .pointer("/choices/0/message/content")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    if finish != Some("length") || used != Some(u64::from(max_tokens)) || text.is_empty() {
        bail!(
            "chat completion: finish_reason {finish:?}, completion_tokens {used:?}, text {text:?}"
        );
    }
    Ok(text)
}

/// A non-streaming completion: (text, finish_reason).
pub(super) fn complete(
    client: &Client,
    model: &str,
    prompt: &str,
    max_tokens: u32,
) -> Result<(u16, String, String)> {
    let r = client.post(
        "/v1/completions",
        &json!({"model": model, "prompt": prompt, "max_tokens": max_tokens}),
    )?;
    let text = r.text();
    if r.status != 200 {
        return Ok((r.status, text, String::new()));
    }
    let v = r.json()?;
    Ok((
        r.status,
        v.pointer("/choices/0/text")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        v.pointer("/choices/0/finish_reason")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
    ))
}

/// A streaming completion read to its end: (token chunks, last finish_reason, saw
/// `[DONE]`, seconds from the first to the last token).
pub(super) fn stream(
    client: &Client,
    model: &str,
    max_tokens: u32,
) -> Result<(u32, Option<String>, bool, f64)> {
    let mut s = client.post_sse(
        "/v1/completions",
        &json!({"model": model, "prompt": "Count to ten:", "max_tokens": max_tokens,
                "stream": true}),
    )?;
    if s.status != 200 {
        let status = s.status;
        bail!("streaming completion: HTTP {status} {}", snippet(&s.rest()));
    }
    let (mut chunks, mut finish, mut done) = (0u32, None, false);
    let (mut first, mut last) = (None, Instant::now());
    while let Some(data) = s.next_data()? {
        if data.trim() == "[DONE]" {
            done = true;
            break;
        }
        let v: Value =
            serde_json::from_str(&data).with_context(|| format!("event {}", snippet(&data)))?;
        if v.pointer("/choices/0/text")
            .and_then(Value::as_str)
            .is_some_and(|t| !t.is_empty())
        {
            chunks += 1;
            first.get_or_insert_with(Instant::now);
            last = Instant::now();
        }
        if let Some(f) = v
            .pointer("/choices/0/finish_reason")
            .and_then(Value::as_str)
        {
            finish = Some(f.to_string());
        }
    }
    let span = first.map_or(0.0, |f| (last - f).as_secs_f64());
    Ok((chunks, finish, done, span))
}

/// Start the image in the background (serve mode unless `args` say otherwise).
pub(super) fn start(
    podman: &Podman,
    image: &str,
    name: &str,
    env: &[String],
    args: &[&str],
) -> Result<()> {
    let mut a: Vec<&str> = vec!["run", "-d", "--name", name, "--network", "host"];
    for e in env {
        a.push("-e");
        a.push(e);
    }
    a.push(image);
    a.extend_from_slice(args);
    podman.ok(&a).map(|_| ())
}

pub(super) fn check_serve(podman: &Podman, image: &str) -> Result<()> {
    let port = vcr_host::child::free_ports(1)?[0];
    let name = format!("{PREFIX}-serve");
    let itl_ms = 20.0;
    let env = [
        format!("PORT={port}"),
        "MOCK_MAX_NUM_SEQS=8".into(),
        "MOCK_TTFT_MS=10".into(),
        format!("MOCK_ITL_MS={itl_ms}"),
        "MOCK_KV_CACHE_SIZE=65536".into(),
        // SIGTERM: the frontend drains its responses in flight for up to this long
        "MOCK_SHUTDOWN_TIMEOUT_S=10".into(),
    ];
    start(podman, image, &name, &env, &[])?;
    let _cleanup = Cleanup::Container(podman, name.clone());
    let secs = wait_health(podman, &name, port, Duration::from_secs(90))?;
    eprintln!("  /health 200 after {secs:.1} s");
    let client = Client::new(port, Duration::from_secs(30));

    let text = chat(&client, "tiny", "Hello!", 12)?;
    eprintln!("  chat completion: 12 tokens, finish_reason length: {text:?}");

    let (chunks, finish, done, span) = stream(&client, "tiny", 10)?;
    // 10 tokens are 9 inter-token gaps of MOCK_ITL_MS each
    let floor = 9.0 * itl_ms / 1000.0 * 0.8;
    if chunks != 10 || finish.as_deref() != Some("length") || !done || span < floor {
        bail!(
            "streaming completion: {chunks} token events, finish_reason {finish:?}, [DONE] {done}, \
             first to last token {span:.3} s (expected 10, length, true, >= {floor:.3} s)"
        );
    }
    eprintln!(
        "  streaming completion: 10 token events over {span:.2} s (MOCK_ITL_MS={itl_ms}), finish_reason length, [DONE]"
    );

    // SIGTERM with a stream in flight: the stream completes, both processes stop, exit 0
    let long = 60;
    let streamer = {
        let client = client.clone();
        std::thread::spawn(move || stream(&client, "tiny", long))
    };
    std::thread::sleep(Duration::from_millis(400));
    let t = Instant::now();
    podman.ok(&["kill", "--signal", "TERM", &name])?;
    let code = podman.wait_exit(&name, Duration::from_secs(30))?;
    let stop_secs = t.elapsed().as_secs_f64();
    let streamed = streamer
        .join()
        .map_err(|_| anyhow::anyhow!("the streaming thread panicked"))?;
    let log = podman.logs(&name);
    if code != "0" {
        bail!("after SIGTERM the container exited with {code}, not 0; its log:\n{log}");
    }
    if stop_secs > 8.0 {
        bail!("the container took {stop_secs:.1} s to stop after SIGTERM");
    }
    // (the frontend's output shares the container's stderr: match the words alone)
    if !log.contains("stopped on SIGTERM (exit status: 0)") {
        bail!("the log does not show the frontend stopping on SIGTERM:\n{log}");
    }
    if vcr_host::child::is_listening(port) {
        bail!("port {port} still listens after the container stopped");
    }
    match streamed {
        Ok((n, Some(f), true, _)) if n == long && f == "length" => {
            eprintln!("  SIGTERM: the stream in flight completed ({n} tokens, length)");
        }
        other => bail!(
            "SIGTERM mid-stream: the stream in flight did not complete: {other:?}; log:\n{log}"
        ),
    }
    eprintln!(
        "  SIGTERM: exit status 0 after {stop_secs:.1} s, frontend stopped on SIGTERM, port {port} closed"
    );
    Ok(())
}

/// The frontend dies (SIGKILL): the container must stop too, with a failing status.
pub(super) fn check_frontend_death(podman: &Podman, image: &str) -> Result<()> {
    let port = vcr_host::child::free_ports(1)?[0];
    let name = format!("{PREFIX}-crash");
    start(podman, image, &name, &[format!("PORT={port}")], &[])?;
    let _cleanup = Cleanup::Container(podman, name.clone());
    wait_health(podman, &name, port, Duration::from_secs(90))?;
    // pids as the container sees them
    let top = podman.ok(&["top", &name, "pid", "args"])?;
    let pid = top
        .lines()
        .find(|l| l.contains("vllm-rs serve"))
        .and_then(|l| l.split_whitespace().next())
        .with_context(|| format!("no vllm-rs process in `podman top`:\n{top}"))?
        .to_string();
    podman.ok(&["exec", &name, "bash", "-c", &format!("kill -KILL {pid}")])?;
    let t = Instant::now();
    let code = podman.wait_exit(&name, Duration::from_secs(15))?;
    let log = podman.logs(&name);
    // the frontend's status: killed by signal 9
    if code != "137" {
        bail!(
            "the frontend was killed (SIGKILL) but the container exited with {code}, not 137; log:\n{log}"
        );
    }
    if !log.contains("the frontend exited") {
        bail!("the log does not say the frontend exited:\n{log}");
    }
    eprintln!(
        "  vllm-rs killed: the container stopped after {:.1} s with the frontend's status, {code} (128 + SIGKILL)",
        t.elapsed().as_secs_f64()
    );
    Ok(())
}
