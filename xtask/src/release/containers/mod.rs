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
//!   KV-events pod (a Python ZMQ subscriber); then the `prebuilt-nixl` image (`--features
//!   nixl`, the cached NIXL runtime) and the P/D pair again on it, moving KV bytes over
//!   NIXL. Each runs as a test variant of its manifest: host network, free ports, no probes
//!   (podman runs probes through systemd, which these machines lack), no Services;
//! - every manifest under `deploy/` through `kubernetes-validate` (PyPI; it and the
//!   subscriber's pyzmq and msgspec live in one venv in the cache).

mod image;
mod manifests;
mod pods;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use vcr_host::frontends;

use crate::compat::Compat;
use crate::fetch;
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
        fetch::fetch_container_tools(&cache)
    })?;
    t.step("validate deploy/ manifests", || {
        validate_manifests(root, &tools.join("bin").join("kubernetes-validate"))
    })?;
    let (engine, frontend) = t.step("binaries (cargo build, cached vllm-rs)", || {
        Ok((
            crate::stack::engine::build_engine(root)?,
            frontends::fetch_vllm_rs(&cache, &line.tag)?,
        ))
    })?;
    let image = t.step("image (prebuilt target)", || {
        build_image(
            root, &podman, &engine, &frontend, &line.line, &line.tag, None,
        )
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
        check_pd_pods(root, &podman, &dir, &image, false)
    })?;
    let nixl_image = t.step(
        "image (prebuilt-nixl target: --features nixl, NIXL runtime)",
        || {
            // the runtime first: it also installs libclang, which building nixl-sys needs
            let lib = fetch::fetch_nixl(&cache)?;
            let engine = crate::stack::engine::build_engine_with(root, &["nixl"])?;
            build_image(
                root,
                &podman,
                &engine,
                &frontend,
                &line.line,
                &line.tag,
                Some(&lib),
            )
        },
    )?;
    t.step(
        "pods: deploy/llm-d-pd on the nixl image (KV bytes over NIXL)",
        || check_pd_pods(root, &podman, &dir, &nixl_image, true),
    )?;
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
        fetch::apt_install(
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

/// Copy the executable `from` to `to` without its symbols and debug info (a plain copy
/// where `strip` is missing or fails).
fn copy_stripped(from: &Path, to: &Path) -> Result<()> {
    let stripped = Command::new("strip")
        .arg("-o")
        .arg(to)
        .arg(from)
        .status()
        .is_ok_and(|s| s.success());
    if !stripped {
        std::fs::copy(from, to).with_context(|| format!("copying {}", from.display()))?;
    }
    Ok(())
}

/// Build the `prebuilt` target from a small context (the binaries, the tiny model, the
/// entrypoint), or with `nixl` (the NIXL runtime's library directory) the
/// `prebuilt-nixl` target, tagged `…-nixl`; returns the versioned tag.
fn build_image(
    root: &Path,
    podman: &Podman,
    engine: &Path,
    frontend: &Path,
    line: &str,
    tag: &str,
    nixl: Option<&Path>,
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
        // the debug build carries ~10x its code in debug info, and the wheel's vllm-rs
        // its symbol table (9 of 61 MB): the image needs neither
        copy_stripped(engine, &ctx.join("prebuilt/vllm-vcr"))?;
        copy_stripped(frontend, &ctx.join("prebuilt/vllm-rs"))?;
        vcr_host::tiny_model::write_to(&ctx.join("prebuilt/model"))?;
        let (target, suffix) = match nixl {
            None => ("prebuilt", ""),
            Some(lib) => {
                copy_nixl_runtime(lib, &ctx.join("prebuilt/nixl"))?;
                ("prebuilt-nixl", "-nixl")
            }
        };
        let version = env!("CARGO_PKG_VERSION");
        let versioned = format!("{IMAGE_REPO}:{version}-vllm{line}{suffix}");
        let floating = format!("{IMAGE_REPO}:vllm{line}{suffix}");
        let previous = podman
            .ok(&["image", "inspect", "--format", "{{.Id}}", &versioned])
            .ok();
        podman.loud(&[
            "build",
            "--network",
            "host",
            "--target",
            target,
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

/// The wheel's two library directories (`…mesonpy.libs` holding `libnixl_capi.so`, and the
/// bundled libraries beside it), side by side under `to` as their `$ORIGIN` rpaths expect.
fn copy_nixl_runtime(lib: &Path, to: &Path) -> Result<()> {
    let site = lib
        .parent()
        .context("the NIXL library directory has no parent")?;
    std::fs::create_dir_all(to)?;
    for dir in [lib.to_path_buf(), site.join("nixl_cu12.libs")] {
        let status = Command::new("cp")
            .arg("-a")
            .arg(&dir)
            .arg(to)
            .status()
            .context("running cp")?;
        if !status.success() {
            bail!("copying {} into the image context failed", dir.display());
        }
    }
    Ok(())
}

use image::{check_cli, check_frontend_death, check_serve};
use manifests::validate_manifests;
use pods::{check_capture_replay, check_kv_events_pod, check_mock_pod, check_pd_pods};

/// An answer's first finish reason and its completion-token count.
fn finish_and_used(v: &serde_json::Value) -> (Option<&str>, Option<u64>) {
    (
        v.pointer("/choices/0/finish_reason")
            .and_then(serde_json::Value::as_str),
        v.pointer("/usage/completion_tokens")
            .and_then(serde_json::Value::as_u64),
    )
}
