//! `cargo xtask containers`: the image and the `deploy/` manifests, run for real.
//!
//! There is no registry and no Docker daemon on the machines this runs on; podman builds
//! and runs images and runs pod manifests (`podman play kube`). What it takes:
//!
//! - podman, runc and debootstrap, from apt when missing;
//! - a Debian base image built once with debootstrap and kept as a tarball in the cache
//!   (`containers/debian-bookworm-minbase.tar.gz`), imported as `localhost/debian:bookworm-slim`;
//! - the image, built from the `prebuilt` target of the Dockerfile with the host-built
//!   `vllm-vcr` (debug build, stripped), the cached `vllm-rs` of the default line and the
//!   tiny model directory;
//! - the checks a user would make: `--version`, a bad and an unknown variable refused with
//!   exit status 2 and the variable's name, `/health`, a chat completion, a streaming
//!   completion paced by `MOCK_ITL_MS`, SIGTERM (a stream in flight completes, exit status
//!   0, nothing left listening), and a frontend that dies taking the container down;
//! - every `deploy/` directory as pods: the mock Deployment, the capture → offline-replay
//!   chain, the P/D pair (`vllm-vcr pd-proxy` in llm-d's routing sidecar's slot) and the
//!   KV-events pod (a Python ZMQ subscriber). Each runs as
//!   a test variant of its manifest: host network, free ports, no probes (podman runs
//!   probes through systemd, which these machines lack), no Services;
//! - every manifest under `deploy/` through `kubernetes-validate` (PyPI; it and the
//!   subscriber's pyzmq and msgspec live in one venv in the cache).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::compat::Compat;
use crate::frontends;
use crate::http::{Client, snippet};

/// The base image the tests build on (the Dockerfile's `BASE` build argument).
const BASE_IMAGE: &str = "localhost/debian:bookworm-slim";
/// The debootstrap root file system, as a tarball in the cache.
const BASE_TARBALL: &str = "debian-bookworm-minbase.tar.gz";
/// Names of everything this stage creates, so a leftover of an interrupted run is found.
const PREFIX: &str = "vllm-vcr-ci";
/// What the manifests call the image (`image: vllm-vcr:vllm0.33`); podman resolves the
/// short name to the local `localhost/vllm-vcr:…`.
const IMAGE_REPO: &str = "localhost/vllm-vcr";

/// podman with the settings these machines need: runc (crun cannot set up cgroups here)
/// and a containers.conf without default ulimits (setting RLIMIT_NOFILE is refused).
struct Podman {
    conf: PathBuf,
}

impl Podman {
    fn command(&self) -> Command {
        let mut cmd = Command::new("podman");
        cmd.env("CONTAINERS_CONF", &self.conf)
            .args(["--runtime", "runc"])
            .stdin(Stdio::null());
        cmd
    }

    /// Run podman, returning its output whatever the status.
    fn output(&self, args: &[&str]) -> Result<Output> {
        let mut cmd = self.command();
        cmd.args(args);
        cmd.output()
            .with_context(|| format!("running podman {}", args.join(" ")))
    }

    /// Run podman and fail (with its stderr) unless it succeeds; returns stdout.
    fn ok(&self, args: &[&str]) -> Result<String> {
        let out = self.output(args)?;
        if !out.status.success() {
            bail!(
                "podman {} failed ({}): {}",
                args.join(" "),
                out.status,
                snippet(&String::from_utf8_lossy(&out.stderr))
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// Run podman with its output on our stderr (long builds show progress).
    fn loud(&self, args: &[&str]) -> Result<()> {
        let mut cmd = self.command();
        cmd.args(args)
            .stdout(std::io::stderr())
            .stderr(std::io::stderr());
        eprintln!("  $ podman {}", args.join(" "));
        let status = cmd
            .status()
            .with_context(|| format!("running podman {}", args.join(" ")))?;
        if !status.success() {
            bail!("podman {} failed ({status})", args.join(" "));
        }
        Ok(())
    }

    fn logs(&self, name: &str) -> String {
        match self.output(&["logs", "--tail", "40", name]) {
            Ok(o) => format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => format!("(no logs: {e:#})"),
        }
    }

    fn running(&self, name: &str) -> bool {
        self.ok(&["inspect", "--format", "{{.State.Running}}", name])
            .is_ok_and(|s| s == "true")
    }

    /// Wait for a container to stop (at most `timeout`); its exit code.
    fn wait_exit(&self, name: &str, timeout: Duration) -> Result<String> {
        let t = Instant::now();
        while self.running(name) {
            if t.elapsed() > timeout {
                bail!(
                    "{name} still runs {timeout:?} later; its log:\n{}",
                    self.logs(name)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        self.ok(&["inspect", "--format", "{{.State.ExitCode}}", name])
    }
}

/// Removes a container or a pod manifest's pods however the check ends.
enum Cleanup<'a> {
    Container(&'a Podman, String),
    Kube(&'a Podman, PathBuf),
}

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        match self {
            Cleanup::Container(p, name) => {
                let _ = p.output(&["rm", "-f", "-t", "2", name]);
            }
            Cleanup::Kube(p, file) => {
                let _ = p.output(&["play", "kube", "--down", &file.to_string_lossy()]);
            }
        }
    }
}

/// Time and report each part of the stage.
struct Timings(Vec<(String, f64)>);

impl Timings {
    fn step<T>(&mut self, name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        eprintln!("\ncontainers: {name}");
        let t = Instant::now();
        let r = f().with_context(|| format!("containers: {name}"));
        let secs = t.elapsed().as_secs_f64();
        eprintln!(
            "containers: {name}: {} ({secs:.1} s)",
            if r.is_ok() { "ok" } else { "FAILED" }
        );
        self.0.push((name.to_string(), secs));
        r
    }

    fn report(&self, total: f64) {
        eprintln!("\ncontainers stage cost:");
        for (name, secs) in &self.0 {
            eprintln!("  {name:<40} {secs:>7.1} s");
        }
        eprintln!("  {:<40} {total:>7.1} s", "total");
    }
}

pub fn run(root: &Path) -> Result<()> {
    let started = Instant::now();
    let mut t = Timings(Vec::new());
    let result = run_steps(root, &mut t);
    t.report(started.elapsed().as_secs_f64());
    result
}

fn run_steps(root: &Path, t: &mut Timings) -> Result<()> {
    let cache = frontends::cache_root()?;
    let dir = cache.join("containers");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let conf = dir.join("containers.conf");
    std::fs::write(&conf, "[containers]\ndefault_ulimits = []\n")?;
    let podman = Podman { conf };
    let compat = Compat::load(root)?;
    let line = compat
        .vllm
        .iter()
        .find(|l| l.default)
        .cloned()
        .context("compat.toml has no default line")?;

    t.step("tools (podman, runc, debootstrap)", ensure_tools)?;
    remove_leftovers(&podman);
    t.step("base image", || base_image(&podman, &dir))?;
    let tools = t.step("python tools (kubernetes-validate, pyzmq)", || {
        frontends::fetch_container_tools(&cache)
    })?;
    t.step("validate deploy/ manifests", || {
        validate_manifests(root, &tools.join("bin").join("kubernetes-validate"))
    })?;
    let (engine, frontend) = t.step("binaries (cargo build, cached vllm-rs)", || {
        Ok((
            crate::e2e::build_engine(root)?,
            frontends::fetch_vllm_rs(&cache, &line.tag)?,
        ))
    })?;
    let image = t.step("image (prebuilt target)", || {
        build_image(root, &podman, &engine, &frontend, &line.line, &line.tag)
    })?;
    t.step("image: --version, bad variables", || {
        check_cli(&podman, &image)
    })?;
    t.step("image: serve (health, chat, stream, SIGTERM)", || {
        check_serve(&podman, &image)
    })?;
    t.step("image: the frontend dies", || {
        check_frontend_death(&podman, &image)
    })?;
    t.step("pod: deploy/mock", || check_mock_pod(root, &podman, &dir))?;
    t.step("pods: deploy/trace-capture (capture, then replay)", || {
        check_capture_replay(root, &podman, &dir)
    })?;
    t.step("pods: deploy/llm-d-pd (pd-proxy as the sidecar)", || {
        check_pd_pods(root, &podman, &dir)
    })?;
    t.step("pod: deploy/kv-events (a ZMQ subscriber)", || {
        check_kv_events_pod(root, &podman, &dir, &tools)
    })?;
    Ok(())
}

/// A binary on $PATH or in the sbin directories (root's tools live there).
fn have(bin: &str) -> bool {
    frontends::which(bin).is_some()
        || ["/usr/sbin", "/sbin", "/usr/bin"]
            .iter()
            .any(|d| Path::new(d).join(bin).is_file())
}

fn ensure_tools() -> Result<()> {
    for (bin, package) in [
        ("podman", "podman"),
        ("runc", "runc"),
        ("debootstrap", "debootstrap"),
    ] {
        if have(bin) {
            eprintln!("  {bin}: installed");
            continue;
        }
        frontends::apt_install(
            package,
            &format!("{bin} is missing (the container checks need it)"),
            "the container checks need podman, runc and debootstrap and installing them with \
             apt-get failed: run this as root or install them yourself",
        )?;
        if !have(bin) {
            bail!("{package} was installed but {bin} is still not found");
        }
    }
    Ok(())
}

/// Containers and pods a killed earlier run left behind (names start with PREFIX).
fn remove_leftovers(podman: &Podman) {
    if let Ok(names) = podman.ok(&["ps", "-a", "--format", "{{.Names}}"]) {
        for name in names.lines().filter(|n| n.starts_with(PREFIX)) {
            eprintln!("  removing the leftover container {name}");
            let _ = podman.output(&["rm", "-f", "-t", "0", name]);
        }
    }
    if let Ok(names) = podman.ok(&["pod", "ps", "--format", "{{.Name}}"]) {
        for name in names.lines().filter(|n| n.starts_with(PREFIX)) {
            eprintln!("  removing the leftover pod {name}");
            let _ = podman.output(&["pod", "rm", "-f", "-t", "0", name]);
        }
    }
}

/// `localhost/debian:bookworm-slim`: already imported, or imported from the cached
/// tarball, or debootstrapped (once) into that tarball first.
fn base_image(podman: &Podman, dir: &Path) -> Result<()> {
    if podman
        .output(&["image", "exists", BASE_IMAGE])?
        .status
        .success()
    {
        eprintln!("  {BASE_IMAGE}: present");
        return Ok(());
    }
    let tarball = dir.join(BASE_TARBALL);
    if !tarball.is_file() {
        debootstrap(&tarball)?;
    }
    // the registry image sets PATH and a shell command; an imported tarball has neither
    podman.loud(&[
        "import",
        "--change",
        "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "--change",
        "CMD [\"bash\"]",
        &tarball.to_string_lossy(),
        BASE_IMAGE,
    ])
}

/// A minimal Debian bookworm root file system from the mirror apt uses, without the
/// downloaded packages and package lists (as the slim registry image), as a tarball.
fn debootstrap(tarball: &Path) -> Result<()> {
    let sources =
        std::fs::read_to_string("/etc/apt/sources.list.d/debian.sources").unwrap_or_default();
    let mirror = sources
        .lines()
        .find_map(|l| l.strip_prefix("URIs:"))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or("http://deb.debian.org/debian")
        .to_string();
    let work = std::env::temp_dir().join(format!("{PREFIX}-debootstrap-{}", std::process::id()));
    let rootfs = work.join("rootfs");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    let result = (|| -> Result<()> {
        let mut cmd = Command::new("debootstrap");
        cmd.args(["--variant=minbase", "bookworm"])
            .arg(&rootfs)
            .arg(&mirror)
            .stdout(Stdio::null())
            .stderr(std::io::stderr());
        eprintln!("  $ {} (about 30-90 s)", frontends::describe(&cmd));
        let status = cmd.status().context("running debootstrap")?;
        if !status.success() {
            bail!("debootstrap failed ({status})");
        }
        for d in ["var/cache/apt/archives", "var/lib/apt/lists"] {
            for e in std::fs::read_dir(rootfs.join(d))?.flatten() {
                if e.path().is_file() {
                    std::fs::remove_file(e.path())?;
                }
            }
        }
        let tmp = tarball.with_extension("tmp");
        let script = format!(
            "tar -C '{}' --numeric-owner -c . | gzip -1 > '{}'",
            rootfs.display(),
            tmp.display()
        );
        let status = Command::new("sh").args(["-c", &script]).status()?;
        if !status.success() {
            bail!("packing the root file system failed ({status})");
        }
        std::fs::rename(&tmp, tarball)?;
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&work);
    result
}

/// Build the `prebuilt` target from a small context (the binaries, the tiny model, the
/// entrypoint); returns the versioned tag.
fn build_image(
    root: &Path,
    podman: &Podman,
    engine: &Path,
    frontend: &Path,
    line: &str,
    tag: &str,
) -> Result<String> {
    let ctx = std::env::temp_dir().join(format!("{PREFIX}-context-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&ctx);
    std::fs::create_dir_all(ctx.join("prebuilt"))?;
    std::fs::create_dir_all(ctx.join("docker"))?;
    let result = (|| -> Result<String> {
        std::fs::copy(
            root.join("docker/entrypoint.sh"),
            ctx.join("docker/entrypoint.sh"),
        )?;
        // the debug build carries ~10x its code in debug info: strip it for the image
        let bin = ctx.join("prebuilt/vllm-vcr");
        let stripped = Command::new("strip")
            .arg("-o")
            .arg(&bin)
            .arg(engine)
            .status()
            .is_ok_and(|s| s.success());
        if !stripped {
            std::fs::copy(engine, &bin).with_context(|| format!("copying {}", engine.display()))?;
        }
        std::fs::copy(frontend, ctx.join("prebuilt/vllm-rs"))
            .with_context(|| format!("copying {}", frontend.display()))?;
        crate::tiny_model::write_to(&ctx.join("prebuilt/model"))?;
        let version = env!("CARGO_PKG_VERSION");
        let versioned = format!("{IMAGE_REPO}:{version}-vllm{line}");
        let floating = format!("{IMAGE_REPO}:vllm{line}");
        let previous = podman
            .ok(&["image", "inspect", "--format", "{{.Id}}", &versioned])
            .ok();
        podman.loud(&[
            "build",
            "--network",
            "host",
            "--target",
            "prebuilt",
            "--build-arg",
            &format!("BASE={BASE_IMAGE}"),
            "--build-arg",
            &format!("VLLM_TAG={tag}"),
            "-f",
            &root.join("Dockerfile").to_string_lossy(),
            "-t",
            &versioned,
            "-t",
            &floating,
            &ctx.to_string_lossy(),
        ])?;
        // the image of the previous run, untagged now: not kept (a failure to remove it
        // means something still uses it)
        let id = podman.ok(&["image", "inspect", "--format", "{{.Id}}", &versioned])?;
        if let Some(old) = previous.filter(|old| *old != id) {
            let _ = podman.output(&["rmi", &old]);
        }
        let size = podman.ok(&["image", "inspect", "--format", "{{.Size}}", &versioned])?;
        let mb = size.parse::<f64>().unwrap_or(0.0) / 1e6;
        eprintln!("  built {versioned} and {floating} ({mb:.0} MB)");
        Ok(versioned)
    })();
    let _ = std::fs::remove_dir_all(&ctx);
    result
}

/// `podman run --rm IMAGE ARGS` with environment `env`: (exit code, stdout, stderr).
fn run_once(
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

fn check_cli(podman: &Podman, image: &str) -> Result<()> {
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
fn wait_health(podman: &Podman, container: &str, port: u16, timeout: Duration) -> Result<f64> {
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
fn chat(client: &Client, model: &str, prompt: &str, max_tokens: u32) -> Result<String> {
    let r = client.post(
        "/v1/chat/completions",
        &json!({"model": model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens}),
    )?;
    if r.status != 200 {
        bail!("chat completion: HTTP {} {}", r.status, snippet(&r.text()));
    }
    let v = r.json()?;
    let finish = v
        .pointer("/choices/0/finish_reason")
        .and_then(Value::as_str);
    let used = v
        .pointer("/usage/completion_tokens")
        .and_then(Value::as_u64);
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
fn complete(
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
fn stream(
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
fn start(podman: &Podman, image: &str, name: &str, env: &[String], args: &[&str]) -> Result<()> {
    let mut a: Vec<&str> = vec!["run", "-d", "--name", name, "--network", "host"];
    for e in env {
        a.push("-e");
        a.push(e);
    }
    a.push(image);
    a.extend_from_slice(args);
    podman.ok(&a).map(|_| ())
}

fn check_serve(podman: &Podman, image: &str) -> Result<()> {
    let port = crate::proc::free_ports(1)?[0];
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
    if crate::proc::is_listening(port) {
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
fn check_frontend_death(podman: &Podman, image: &str) -> Result<()> {
    let port = crate::proc::free_ports(1)?[0];
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

/// The test variant of a manifest for podman: only Pods, Deployments and volume claims
/// (podman runs no Services), host networking, no `ports:` lists (podman refuses port
/// mappings on the host network), no probes (podman runs them through systemd timers), and
/// every port in `ports` renumbered (whole numbers only).
fn test_variant(yaml: &str, ports: &[(u16, u16)]) -> String {
    let mut docs = Vec::new();
    for doc in yaml.split("\n---\n") {
        let kind = doc
            .lines()
            .find_map(|l| l.strip_prefix("kind:"))
            .map(str::trim)
            .unwrap_or_default();
        if !matches!(kind, "Deployment" | "Pod" | "PersistentVolumeClaim") {
            continue;
        }
        let mut out: Vec<String> = Vec::new();
        let mut skip_deeper_than: Option<usize> = None;
        for line in doc.lines() {
            let indent = line.len() - line.trim_start().len();
            if let Some(d) = skip_deeper_than {
                if line.trim().is_empty() || indent > d {
                    continue;
                }
                skip_deeper_than = None;
            }
            let key = line.trim();
            if matches!(
                key,
                "ports:" | "startupProbe:" | "readinessProbe:" | "livenessProbe:"
            ) {
                skip_deeper_than = Some(indent);
                continue;
            }
            out.push(renumber(line, ports));
            if key == "enableServiceLinks: false" {
                out.push(format!("{}hostNetwork: true", " ".repeat(indent)));
            }
        }
        docs.push(out.join("\n"));
    }
    docs.join("\n---\n") + "\n"
}

/// Replace whole numbers `from` by `to` in one line.
fn renumber(line: &str, ports: &[(u16, u16)]) -> String {
    let mut out = String::new();
    let mut digits = String::new();
    let flush = |digits: &mut String, out: &mut String| {
        let replaced = ports
            .iter()
            .find(|(from, _)| from.to_string() == *digits)
            .map(|(_, to)| to.to_string());
        out.push_str(&replaced.unwrap_or_else(|| digits.clone()));
        digits.clear();
    };
    for c in line.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
        } else {
            flush(&mut digits, &mut out);
            out.push(c);
        }
    }
    flush(&mut digits, &mut out);
    out
}

/// Write the test variant of `manifest` (relative to deploy/) to the cache; returns it.
fn variant_file(root: &Path, dir: &Path, manifest: &str, ports: &[(u16, u16)]) -> Result<PathBuf> {
    let src = root.join("deploy").join(manifest);
    let text =
        std::fs::read_to_string(&src).with_context(|| format!("reading {}", src.display()))?;
    let out = dir.join(format!("{PREFIX}-{}", manifest.replace('/', "-")));
    std::fs::write(&out, test_variant(&text, ports))?;
    Ok(out)
}

/// `podman play kube` a test variant and wait until its frontend answers /health.
fn play(podman: &Podman, file: &Path, pod: &str, frontend: &str, port: u16) -> Result<f64> {
    podman.ok(&["play", "kube", &file.to_string_lossy()])?;
    let container = format!("{pod}-{frontend}");
    wait_health(podman, &container, port, Duration::from_secs(120))
}

fn check_mock_pod(root: &Path, podman: &Podman, dir: &Path) -> Result<()> {
    let port = crate::proc::free_ports(1)?[0];
    let file = variant_file(root, dir, "mock/deployment.yaml", &[(8000, port)])?;
    let _down = Cleanup::Kube(podman, file.clone());
    let secs = play(podman, &file, "vllm-vcr-mock-pod-0", "vllm", port)?;
    eprintln!("  /health 200 after {secs:.1} s");
    let client = Client::new(port, Duration::from_secs(30));
    let text = chat(&client, "tiny", "Hello from a pod", 8)?;
    eprintln!("  chat completion through the pod: 8 tokens, length: {text:?}");
    let (chunks, finish, done, _) = stream(&client, "tiny", 6)?;
    if chunks != 6 || finish.as_deref() != Some("length") || !done {
        bail!(
            "streaming through the pod: {chunks} events, finish_reason {finish:?}, [DONE] {done}"
        );
    }
    eprintln!("  streaming completion through the pod: 6 tokens, length, [DONE]");
    Ok(())
}

/// Capture three completions through frontend > record > play, stop the pod (the tap
/// writes its trace to the volume), then serve the same prompts from the trace with the
/// offline-replay pod: the same text, token for token; a prompt the capture never saw is
/// refused (MOCK_REPLAY_MISS=fail).
fn check_capture_replay(root: &Path, podman: &Podman, dir: &Path) -> Result<()> {
    let volume = "vllm-vcr-traces";
    let _ = podman.output(&["volume", "rm", "-f", volume]);
    let p = crate::proc::free_ports(5)?;
    let capture = variant_file(
        root,
        dir,
        "trace-capture/capture/capture.yaml",
        &[(8000, p[0]), (29550, p[1]), (29551, p[2])],
    )?;
    let storage = variant_file(root, dir, "trace-capture/storage/pvc.yaml", &[])?;
    podman.ok(&["play", "kube", &storage.to_string_lossy()])?;
    let prompts = [
        "The first prompt of the capture",
        "A second, different prompt",
        "And a third one, longer than the others by a few words",
    ];
    let mut captured = Vec::new();
    {
        let _down = Cleanup::Kube(podman, capture.clone());
        let secs = play(podman, &capture, "vllm-vcr-capture-pod-0", "frontend", p[0])?;
        eprintln!("  capture pod: /health 200 after {secs:.1} s");
        let client = Client::new(p[0], Duration::from_secs(30));
        for prompt in prompts {
            let (status, text, finish) = complete(&client, "tiny", prompt, 16)?;
            if status != 200 || finish != "length" || text.is_empty() {
                bail!(
                    "capture: {prompt:?}: HTTP {status}, finish_reason {finish:?}, text {text:?}"
                );
            }
            captured.push(text);
        }
        eprintln!("  captured 3 completions through frontend > record > play");
        // SIGTERM, as a pod deletion sends it: the tap closes the trace with every record
        // (`play kube --down` alone does not leave the tap time to write the last one)
        podman.ok(&["pod", "stop", "-t", "20", "vllm-vcr-capture-pod-0"])?;
        let tap = podman.logs("vllm-vcr-capture-pod-0-tap");
        let wrote = "wrote /trace/trace.jsonl (3 request records, 0 incomplete";
        if !tap.contains(wrote) {
            bail!("the tap's log does not say {wrote:?}:\n{tap}");
        }
        eprintln!("  SIGTERM: the tap says \"{wrote} …\"");
        podman.ok(&["play", "kube", "--down", &capture.to_string_lossy()])?;
    }
    let replay = variant_file(
        root,
        dir,
        "trace-capture/replay/offline-replay.yaml",
        &[(8000, p[3]), (29550, p[4])],
    )?;
    let _down = Cleanup::Kube(podman, replay.clone());
    let secs = play(podman, &replay, "vllm-vcr-replay-pod-0", "frontend", p[3])?;
    eprintln!("  replay pod: /health 200 after {secs:.1} s");
    let client = Client::new(p[3], Duration::from_secs(30));
    for (prompt, want) in prompts.iter().zip(&captured) {
        let (status, text, finish) = complete(&client, "tiny", prompt, 16)?;
        if status != 200 || finish != "length" || &text != want {
            bail!(
                "replay of {prompt:?}: HTTP {status}, finish_reason {finish:?}, text {text:?}; captured {want:?}\nengine log:\n{}",
                podman.logs("vllm-vcr-replay-pod-0-engine")
            );
        }
    }
    eprintln!("  replayed the 3 prompts: the captured text, token for token");
    let (status, body, _) = complete(&client, "tiny", "zzz never captured qqq", 16)?;
    if status == 200 {
        bail!(
            "a prompt the capture never saw was answered (HTTP 200: {}) despite MOCK_REPLAY_MISS=fail",
            snippet(&body)
        );
    }
    eprintln!("  an uncaptured prompt: HTTP {status} ({})", snippet(&body));
    drop(_down);
    let _ = podman.output(&["play", "kube", "--down", &storage.to_string_lossy()]);
    let _ = podman.output(&["volume", "rm", "-f", volume]);
    Ok(())
}

/// The P/D pods: prefill, and decode behind the routing sidecar's slot. llm-d's sidecar
/// (a Go program no registry serves here) is replaced by `vllm-vcr pd-proxy`, which makes
/// the same two requests; the pod IP (`status.podIP`) is the loopback on the host network.
fn check_pd_pods(root: &Path, podman: &Podman, dir: &Path) -> Result<()> {
    let p = crate::proc::free_ports(4)?;
    let (prefill_port, side_port, proxy_port, decode_port) = (p[0], p[1], p[2], p[3]);
    let prefill = variant_file(
        root,
        dir,
        "llm-d-pd/prefill.yaml",
        &[(8000, prefill_port), (5600, side_port)],
    )?;
    let text = std::fs::read_to_string(&prefill)?;
    let text = without_block(&text, "valueFrom:").replace("$(POD_IP)", "127.0.0.1");
    std::fs::write(&prefill, text)?;
    let decode = variant_file(
        root,
        dir,
        "llm-d-pd/decode.yaml",
        &[(8000, proxy_port), (8200, decode_port)],
    )?;
    let text = std::fs::read_to_string(&decode)?;
    let sidecar = text
        .lines()
        .find(|l| {
            l.trim_start()
                .starts_with("image: ghcr.io/llm-d/llm-d-routing-sidecar")
        })
        .context("decode.yaml has no llm-d routing sidecar")?
        .to_string();
    let indent = " ".repeat(sidecar.len() - sidecar.trim_start().len());
    let proxy = format!(
        "{indent}image: vllm-vcr:vllm0.33\n{indent}args: [\"pd-proxy\", \"--prefill\", \"http://127.0.0.1:{prefill_port}\", \"--decode\", \"http://127.0.0.1:{decode_port}\", \"--port\", \"{proxy_port}\"]"
    );
    // the sidecar's own flags are the first block `args:` (the server's is inline)
    let text = without_block(&text, "args:").replace(&sidecar, &proxy);
    std::fs::write(&decode, text)?;

    let _down_prefill = Cleanup::Kube(podman, prefill.clone());
    let _down_decode = Cleanup::Kube(podman, decode.clone());
    let secs = play(
        podman,
        &prefill,
        "vllm-vcr-prefill-pod-0",
        "vllm",
        prefill_port,
    )?;
    eprintln!("  prefill pod: /health 200 after {secs:.1} s");
    let secs = play(
        podman,
        &decode,
        "vllm-vcr-decode-pod-0",
        "vllm",
        decode_port,
    )?;
    eprintln!("  decode pod: /health 200 after {secs:.1} s");
    let count = |port: u16| -> Result<f64> {
        let m = Client::new(port, Duration::from_secs(10)).get("/metrics")?;
        let samples = crate::http::parse_metrics(&m.text());
        Ok(crate::http::metric_sum(&samples, "vllm:request_success_total", &[]).unwrap_or(0.0))
    };
    let (p0, d0) = (count(prefill_port)?, count(decode_port)?);
    let client = Client::new(proxy_port, Duration::from_secs(30));
    let t = Instant::now();
    let r = loop {
        // the proxy container may still be starting
        match client.post(
            "/v1/completions",
            &json!({"model": "tiny", "prompt": "Disaggregated hello", "max_tokens": 12}),
        ) {
            Ok(r) => break r,
            Err(e) if t.elapsed() < Duration::from_secs(20) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return Err(e.context("the pd-proxy in the sidecar's slot never answered")),
        }
    };
    let v = r.json()?;
    let finish = v
        .pointer("/choices/0/finish_reason")
        .and_then(Value::as_str);
    let used = v
        .pointer("/usage/completion_tokens")
        .and_then(Value::as_u64);
    if r.status != 200 || finish != Some("length") || used != Some(12) {
        bail!(
            "completion through the decode pod: HTTP {}, finish_reason {finish:?}, completion_tokens {used:?}: {}\ndecode engine log:\n{}",
            r.status,
            snippet(&r.text()),
            podman.logs("vllm-vcr-decode-pod-0-vllm")
        );
    }
    let (p1, d1) = (count(prefill_port)?, count(decode_port)?);
    if p1 - p0 != 1.0 || d1 - d0 != 1.0 {
        bail!(
            "vllm:request_success_total moved by {} on prefill and {} on decode, expected 1 and 1",
            p1 - p0,
            d1 - d0
        );
    }
    eprintln!(
        "  a completion through the decode pod: 12 tokens, length; one request finished on each of prefill and decode"
    );
    Ok(())
}

/// A KV-events subscriber for the test: binds a ZMQ SUB socket (the router's side of
/// llm-d's layout) and prints one JSON line per message: topic, and per event its tag,
/// block count and token count. Runs in the tools venv (pyzmq, msgspec).
const KV_SUBSCRIBER: &str = r#"
import json, sys, msgspec, zmq
sock = zmq.Context().socket(zmq.SUB)
sock.setsockopt(zmq.SUBSCRIBE, b"")
sock.setsockopt(zmq.RCVTIMEO, int(float(sys.argv[2]) * 1000))
sock.bind(sys.argv[1])
print(json.dumps({"ready": True}), flush=True)
while True:
    try:
        frames = sock.recv_multipart()
    except zmq.Again:
        break
    ts, events, rank = msgspec.msgpack.decode(frames[-1])
    out = []
    for e in events:
        # vLLM's events are tagged maps: {"type": "BlockStored", "block_hashes": …}
        out.append([e.get("type"), len(e.get("block_hashes") or []), len(e.get("token_ids") or [])])
    print(json.dumps({"topic": frames[0].decode(), "events": out}), flush=True)
"#;

/// The KV-events pod publishes to a subscriber socket: a prompt of three full blocks is
/// announced as BlockStored events of those blocks, on the pod's topic.
fn check_kv_events_pod(root: &Path, podman: &Podman, dir: &Path, venv: &Path) -> Result<()> {
    use std::io::BufRead;
    let p = crate::proc::free_ports(2)?;
    let (port, sub_port) = (p[0], p[1]);
    let file = variant_file(root, dir, "kv-events/deployment.yaml", &[(8000, port)])?;
    let text = std::fs::read_to_string(&file)?;
    let text = without_block(&text, "valueFrom:")
        .replace("$(POD_IP)", "127.0.0.1")
        .replace(
            "kv-events-subscriber:5557",
            &format!("127.0.0.1:{sub_port}"),
        )
        // one pod on the host network (two would share its ports)
        .replace("replicas: 2", "replicas: 1");
    std::fs::write(&file, text)?;

    let script = dir.join(format!("{PREFIX}-kv-subscriber.py"));
    std::fs::write(&script, KV_SUBSCRIBER)?;
    let mut sub = Command::new(venv.join("bin").join("python"))
        .arg(&script)
        .arg(format!("tcp://127.0.0.1:{sub_port}"))
        .arg("30")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::io::stderr())
        .spawn()
        .context("starting the KV-events subscriber")?;
    let mut lines =
        std::io::BufReader::new(sub.stdout.take().context("subscriber stdout")?).lines();
    let result = (|| -> Result<()> {
        match lines.next() {
            Some(Ok(l)) if l.contains("ready") => {}
            other => bail!("the subscriber did not start: {other:?}"),
        }
        let _down = Cleanup::Kube(podman, file.clone());
        let secs = play(podman, &file, "vllm-vcr-kv-events-pod-0", "vllm", port)?;
        eprintln!("  /health 200 after {secs:.1} s");
        // 48 one-byte tokens (the tiny model's tokenizer) and a few of the chat template:
        // at least three full blocks of 16
        let prompt = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUV";
        let (status, _, finish) = complete(
            &Client::new(port, Duration::from_secs(30)),
            "tiny",
            prompt,
            4,
        )?;
        if status != 200 || finish != "length" {
            bail!("completion: HTTP {status}, finish_reason {finish:?}");
        }
        let mut stored = 0;
        let mut topic = String::new();
        for line in lines.by_ref() {
            let v: Value = serde_json::from_str(&line?)?;
            topic = v["topic"].as_str().unwrap_or_default().to_string();
            for e in v["events"].as_array().into_iter().flatten() {
                if e[0] == "BlockStored" {
                    stored += e[1].as_u64().unwrap_or(0);
                }
            }
            if stored >= 3 {
                break;
            }
        }
        if stored < 3 || topic != "kv@127.0.0.1@tiny" {
            bail!(
                "the subscriber saw {stored} stored blocks on topic {topic:?}, expected >= 3 on kv@127.0.0.1@tiny; log:\n{}",
                podman.logs("vllm-vcr-kv-events-pod-0-vllm")
            );
        }
        eprintln!("  a 48-token prompt: BlockStored for {stored} blocks on topic {topic}");
        Ok(())
    })();
    let _ = sub.kill();
    let _ = sub.wait();
    result
}

/// `yaml` without the first mapping key `key` and the lines nested under it.
fn without_block(yaml: &str, key: &str) -> String {
    let mut out = Vec::new();
    let mut skip: Option<usize> = None;
    let mut done = false;
    for line in yaml.lines() {
        let indent = line.len() - line.trim_start().len();
        if let Some(d) = skip {
            if line.trim().is_empty() || indent > d {
                continue;
            }
            skip = None;
        }
        if !done && line.trim() == key {
            skip = Some(indent);
            done = true;
            continue;
        }
        out.push(line);
    }
    out.join("\n") + "\n"
}

/// Every manifest under deploy/ through kubernetes-validate. Kustomization files are
/// kustomize's input, not Kubernetes objects (there is no schema for them): they are
/// listed as not validated.
fn validate_manifests(root: &Path, validator: &Path) -> Result<()> {
    let mut files = Vec::new();
    collect_yaml(&root.join("deploy"), &mut files)?;
    files.sort();
    let (mut check, mut not) = (Vec::new(), Vec::new());
    for f in files {
        let text = std::fs::read_to_string(&f)?;
        if text.contains("kind: Kustomization") {
            not.push(f);
        } else {
            check.push(f);
        }
    }
    if check.is_empty() {
        bail!("no manifests under deploy/");
    }
    let mut cmd = Command::new(validator);
    cmd.arg("--strict").args(&check).stdin(Stdio::null());
    let out = cmd.output().context("running kubernetes-validate")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        bail!("kubernetes-validate failed ({}):\n{text}", out.status);
    }
    let passed = text.lines().filter(|l| l.contains("passed")).count();
    eprintln!(
        "  kubernetes-validate --strict: {} files, {passed} objects passed",
        check.len()
    );
    for f in &not {
        let rel = f.strip_prefix(root).unwrap_or(f);
        let refs = kustomization_refs(f)?;
        eprintln!(
            "  {}: no schema (kustomize input); its {} references exist",
            rel.display(),
            refs
        );
    }
    Ok(())
}

/// Check that every `resources:` entry and patch `path:` of a kustomization exists;
/// returns how many there are.
fn kustomization_refs(file: &Path) -> Result<usize> {
    let dir = file.parent().context("a file has a directory")?;
    let text = std::fs::read_to_string(file)?;
    let mut section = "";
    let mut n = 0;
    for line in text.lines() {
        if line.trim_start().starts_with('#') {
            continue;
        }
        if !line.starts_with(' ') && !line.starts_with('-') {
            section = line.split(':').next().unwrap_or_default();
            continue;
        }
        let entry = line.trim().trim_start_matches("- ").trim();
        let path = match section {
            "resources" => Some(entry),
            "patches" => entry.strip_prefix("path:").map(str::trim),
            _ => None,
        };
        if let Some(p) = path.filter(|p| !p.is_empty()) {
            if !dir.join(p).exists() {
                bail!("{}: {section} entry {p:?} does not exist", file.display());
            }
            n += 1;
        }
    }
    if n == 0 {
        bail!("{}: no resources", file.display());
    }
    Ok(n)
}

fn collect_yaml(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let p = e?.path();
        if p.is_dir() {
            collect_yaml(&p, out)?;
        } else if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
            out.push(p);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_test_variant_runs_on_the_host_network_without_probes_or_services() {
        let yaml = "kind: Deployment\nspec:\n  template:\n    spec:\n      enableServiceLinks: false\n      containers:\n        - name: a\n          env:\n            - name: PORT\n              value: \"8000\"\n          ports:\n            - name: http\n              containerPort: 8000\n          readinessProbe:\n            httpGet:\n              port: http\n          volumeMounts: []\n---\nkind: Service\nspec:\n  ports:\n    - port: 8000\n";
        let v = test_variant(yaml, &[(8000, 18123)]);
        assert!(v.contains("      hostNetwork: true\n"), "{v}");
        assert!(v.contains("value: \"18123\""), "{v}");
        assert!(
            !v.contains("Probe") && !v.contains("ports:") && !v.contains("kind: Service"),
            "{v}"
        );
        assert!(v.contains("          volumeMounts: []"), "{v}");
    }

    #[test]
    fn renumber_replaces_whole_numbers_only() {
        assert_eq!(renumber("a 8000 18000 8000x", &[(8000, 9)]), "a 9 18000 9x");
    }
}
