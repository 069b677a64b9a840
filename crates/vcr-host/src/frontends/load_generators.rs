//! The load generators users point at `serve` (aiperf, guidellm, inference-perf), pinned
//! from PyPI into venvs of the cache like the frontends, installed once and reused: what
//! the e2e tests run, and what `docs/load-generators.md` tells users to run.
//!
//! Two of them do not install as they are on this project's Python (3.11):
//!
//! - guidellm 0.8.1 lists torch as a hard dependency, and it is one: its only data loader
//!   is torch's `DataLoader` (`guidellm/data/loaders/torch.py` imports torch at the top).
//!   PyPI's torch for Linux is the CUDA build, several GB with the NVIDIA libraries it
//!   pulls. The cache already holds such a torch (the Python frontend's venv and the real
//!   CPU engine's have one), so guidellm is installed without torch (`--excludes torch`)
//!   and a `.pth` line appends that venv's `site-packages` to guidellm's `sys.path`: its
//!   own packages come first, only what it lacks (torch and torch's own dependencies) is
//!   found there.
//! - inference-perf 0.7.0 declares `Requires-Python >=3.12` but runs on 3.11 (no 3.12-only
//!   syntax or library calls on the paths used here): the package itself is installed
//!   ignoring that declaration, its dependencies resolved for the Python at hand
//!   ([`super::Pins::ignore_requires_python`]).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use super::{Pins, fetch_tool, install_venv, python_version, site_packages};

pub const AIPERF_PACKAGE: &str = "aiperf";
pub const AIPERF_VERSION: &str = "0.13.0";

pub const GUIDELLM_PACKAGE: &str = "guidellm";
pub const GUIDELLM_VERSION: &str = "0.8.1";

pub const INFERENCE_PERF_PACKAGE: &str = "inference-perf";
pub const INFERENCE_PERF_VERSION: &str = "0.7.0";

/// The `.pth` file in guidellm's `site-packages` naming the `site-packages` that holds torch.
const TORCH_PTH: &str = "vllm_vcr_torch.pth";

/// Ensure aiperf is installed; returns its venv (`bin/aiperf`).
pub fn fetch_aiperf(cache: &Path) -> Result<PathBuf> {
    fetch_tool(cache, AIPERF_PACKAGE, AIPERF_VERSION, |v| {
        v.join("bin").join("aiperf").is_file()
    })
}

/// Ensure inference-perf is installed for the Python the cache uses (3.11 on CI, though
/// it declares 3.12); returns its venv (`bin/inference-perf`).
pub fn fetch_inference_perf(cache: &Path) -> Result<PathBuf> {
    install_venv(
        cache,
        INFERENCE_PERF_PACKAGE,
        INFERENCE_PERF_VERSION,
        &Pins {
            what: "load generator",
            overrides: "",
            excludes: &[],
            overrides_optional: false,
            no_deps: false,
            ignore_requires_python: true,
            // a venv some other Python made (a 3.12 one by hand) is not this install
            ready: |v| v.join("bin").join("inference-perf").is_file() && made_by_our_python(v),
        },
    )
}

/// Ensure guidellm is installed, without torch of its own but with the cache's torch on
/// its path; returns its venv (`bin/guidellm`). Fails, saying what to fetch, when no venv
/// of the cache holds a torch for this Python.
pub fn fetch_guidellm(cache: &Path) -> Result<PathBuf> {
    let (major, minor) = python_version()?;
    let torch = torch_site_packages(cache, major, minor).with_context(|| {
        format!(
            "guidellm {GUIDELLM_VERSION} imports torch (its data loader is torch's), and no \
             venv under {} holds a torch for Python {major}.{minor}: install the Python \
             frontend first (`cargo xtask fetch --python`), whose venv has one",
            cache.join("py").display()
        )
    })?;
    let venv = install_venv(
        cache,
        GUIDELLM_PACKAGE,
        GUIDELLM_VERSION,
        &Pins {
            what: "load generator",
            overrides: "",
            excludes: &["torch"],
            overrides_optional: false,
            no_deps: false,
            ignore_requires_python: false,
            ready: |v| v.join("bin").join("guidellm").is_file(),
        },
    )?;
    let site = site_packages(&venv)
        .with_context(|| format!("the guidellm venv {} has no site-packages", venv.display()))?;
    let pth = site.join(TORCH_PTH);
    let line = format!("{}\n", torch.display());
    // rewritten when the torch moved (the venv that held it was removed or replaced)
    if std::fs::read_to_string(&pth).ok().as_deref() != Some(line.as_str()) {
        std::fs::write(&pth, &line).with_context(|| format!("writing {}", pth.display()))?;
        crate::errln!(
            "fetch: guidellm uses the torch of {} ({})",
            torch.display(),
            pth.display()
        );
    }
    Ok(venv)
}

/// Whether the venv `venv` was made by the Python the cache installs with (its
/// `pyvenv.cfg` names the same major.minor).
fn made_by_our_python(venv: &Path) -> bool {
    let Ok((major, minor)) = python_version() else {
        return false;
    };
    std::fs::read_to_string(venv.join("pyvenv.cfg")).is_ok_and(|cfg| {
        cfg.lines().any(|l| {
            l.split_once('=').is_some_and(|(k, v)| {
                k.trim() == "version" && v.trim().starts_with(&format!("{major}.{minor}."))
            })
        })
    })
}

/// The `site-packages` of a finished venv of the cache that holds torch for Python
/// `major.minor` (the first by name, so the choice is stable), guidellm's own excluded.
fn torch_site_packages(cache: &Path, major: u32, minor: u32) -> Option<PathBuf> {
    let mut venvs: Vec<PathBuf> = std::fs::read_dir(cache.join("py"))
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|v| v.join(".installed").is_file())
        .filter(|v| {
            v.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| !n.starts_with(&format!("{GUIDELLM_PACKAGE}-")))
        })
        .collect();
    venvs.sort();
    venvs.into_iter().find_map(|v| {
        let site = v
            .join("lib")
            .join(format!("python{major}.{minor}"))
            .join("site-packages");
        site.join("torch")
            .join("__init__.py")
            .is_file()
            .then_some(site)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_is_found_in_a_finished_venv_of_the_same_python_only() {
        let root = std::env::temp_dir().join(format!("vllm-vcr-torch-{}", std::process::id()));
        let py = root.join("py");
        let touch = |p: PathBuf| {
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, b"").unwrap();
        };
        let torch = |venv: &str, py_dir: &str| {
            py.join(venv)
                .join("lib")
                .join(py_dir)
                .join("site-packages/torch/__init__.py")
        };
        // unfinished, another Python, guidellm's own: none of them
        touch(torch("aaa-1.0", "python3.11"));
        touch(torch("bbb-1.0", "python3.12"));
        touch(py.join("bbb-1.0/.installed"));
        touch(torch("guidellm-0.8.1", "python3.11"));
        touch(py.join("guidellm-0.8.1/.installed"));
        assert_eq!(torch_site_packages(&root, 3, 11), None);
        touch(torch("vllm-0.33.0", "python3.11"));
        touch(py.join("vllm-0.33.0/.installed"));
        assert_eq!(
            torch_site_packages(&root, 3, 11),
            Some(py.join("vllm-0.33.0/lib/python3.11/site-packages"))
        );
        std::fs::remove_dir_all(&root).unwrap();
    }
}
