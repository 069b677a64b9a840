//! The build directory that checkouts share, and whose crates it holds.
//!
//! `cargo xtask ci` builds into `~/.cache/vllm-vcr/target`, so a fresh clone compiles only
//! the workspace and not its ~250 dependencies. Sharing has a trap: cargo names a
//! workspace crate's artefacts by the crate's path *within* the workspace, and its
//! dep-info lists the sources by relative path, so every checkout of this repository maps
//! onto the same artefacts. After a build in checkout A, a build in checkout B whose files
//! are older than A's artefacts is "fresh", and B's tests run A's code (a worktree made
//! before A's last build is exactly that).
//!
//! So the directory records the checkout that last built into it ([`CLAIM_FILE`]). When
//! another checkout claims it, the workspace's fingerprints are removed first: cargo then
//! compiles this checkout's crates and keeps every dependency's. The `xtask` binary itself
//! can be another checkout's too (it runs before anything is claimed): it knows where it
//! was compiled, and [`ensure_own_xtask`] has cargo rebuild it when that is elsewhere.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::rig::figures;

/// The file in a build directory that names the checkout that last built into it.
pub const CLAIM_FILE: &str = "vllm-vcr-checkout";

/// Set on the `cargo xtask` that [`ensure_own_xtask`] starts, so a cargo that does not
/// rebuild it ends in an error rather than in a loop.
const REBUILT_ENV: &str = "VLLM_VCR_XTASK_REBUILT";

/// The largest the shared build cache may grow before a run starts it afresh: it holds the
/// dependencies' artefacts (what a warm cache saves) and the workspace's own in every
/// profile and feature set that built them, which pile up run after run.
const BUILD_CACHE_MAX_BYTES: u64 = 16 << 30;

/// Build into `~/.cache/vllm-vcr/target` (unless `CARGO_TARGET_DIR` says otherwise), so
/// a fresh clone compiles only the workspace, not its ~250 dependencies again: the
/// slowest part of a cold run on 2 cores (clippy, the test build and the NIXL feature
/// build, ~8 of ~21 minutes). A cache past [`BUILD_CACHE_MAX_BYTES`] is removed first;
/// either way the directory is claimed for this checkout ([`claim`]).
pub fn use_build_cache(root: &Path) -> Result<()> {
    let dir = match std::env::var_os("CARGO_TARGET_DIR").filter(|v| !v.is_empty()) {
        Some(dir) => std::env::current_dir()
            .context("reading the working directory")?
            .join(dir),
        None => {
            let dir = vcr_host::frontends::cache_root()?.join("target");
            let (_, size) = figures::dir_size(&dir);
            if size > BUILD_CACHE_MAX_BYTES {
                eprintln!(
                    "ci: the build cache {} holds {:.1} GB (more than {} GB): starting it afresh",
                    dir.display(),
                    size as f64 / (1u64 << 30) as f64,
                    BUILD_CACHE_MAX_BYTES >> 30
                );
                std::fs::remove_dir_all(&dir)
                    .with_context(|| format!("removing {}", dir.display()))?;
            }
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            eprintln!("ci: building into {} (CARGO_TARGET_DIR)", dir.display());
            // SAFETY: set before any thread is spawned; every later cargo and e2e build
            // reads it
            unsafe { std::env::set_var("CARGO_TARGET_DIR", &dir) };
            dir
        }
    };
    report(&dir, &claim(&dir, root, &[])?);
    Ok(())
}

/// Before any command: claim the target directory this `xtask` binary was built into (the
/// one `cargo` builds into for this command, unless `ci` picks the shared cache). When the
/// binary was compiled from another checkout, or the directory last held another
/// checkout's crates (which this `xtask` may be linked against), have cargo build and run
/// this checkout's. `Some(success)` when that rebuilt `xtask` ran the command; `None` when
/// this binary is the checkout's own and the command is for it to run.
pub fn ensure_own_xtask(root: &Path, argv: &[String]) -> Result<Option<bool>> {
    let built_from = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap_or(Path::new("/"));
    let own = same_dir(built_from, root);
    let Some(target) = own_target_dir() else {
        return Ok(None);
    };
    if std::env::var_os(REBUILT_ENV).is_some() {
        if own {
            return Ok(None);
        }
        bail!(
            "this xtask was compiled from {}, and cargo did not rebuild it for {} after its \
             fingerprints in {} were removed; remove {} and run again",
            built_from.display(),
            root.display(),
            target.display(),
            target.display()
        );
    }
    let switched = own && claimant(&target).is_some_and(|p| !same_dir(&p, root));
    // a directory nobody claimed yet (a fresh one, or one from before claims) keeps the
    // xtask that cargo has just built from this checkout
    let keep: &[&str] = if own && !switched { &["xtask"] } else { &[] };
    let claimed = claim(&target, root, keep)?;
    report(&target, &claimed);
    if own && !switched {
        return Ok(None);
    }
    if own {
        eprintln!(
            "xtask: rebuilding xtask, which cargo may have linked against that checkout's crates"
        );
    } else {
        eprintln!(
            "xtask: this xtask was compiled from {}: rebuilding it from {}",
            built_from.display(),
            root.display()
        );
    }
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(root)
        .arg("xtask")
        .args(argv)
        .env(REBUILT_ENV, "1")
        .status()
        .context("running cargo xtask again")?;
    Ok(Some(status.success()))
}

/// The target directory this `xtask` binary was built into (`<target>/<profile>/xtask`).
fn own_target_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    Some(exe.parent()?.parent()?.to_path_buf())
}

fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// What [`claim`] found and did.
#[derive(Debug, PartialEq, Eq)]
pub struct Claimed {
    /// The checkout that had claimed the directory (`None`: nobody, or not recorded).
    pub previous: Option<PathBuf>,
    /// Whether the directory was already this checkout's.
    pub already: bool,
    /// Workspace fingerprints removed.
    pub dropped: usize,
}

fn report(dir: &Path, c: &Claimed) {
    if c.already {
        return;
    }
    let by = c
        .previous
        .as_ref()
        .map_or("no checkout recorded yet".to_string(), |p| {
            format!("last built by {}", p.display())
        });
    eprintln!(
        "build directory {}: {by}; {} fingerprints of this workspace's crates removed, so \
         cargo compiles this checkout's",
        dir.display(),
        c.dropped
    );
}

/// Make `target` this checkout's: unless [`CLAIM_FILE`] already names `root`, remove the
/// fingerprints of the workspace's crates (but those in `keep`) in every profile, then
/// name `root` in it.
pub fn claim(target: &Path, root: &Path, keep: &[&str]) -> Result<Claimed> {
    let me = root.canonicalize().unwrap_or_else(|_| root.to_path_buf());
    let previous = claimant(target);
    if previous.as_deref().is_some_and(|p| same_dir(p, &me)) {
        return Ok(Claimed {
            previous,
            already: true,
            dropped: 0,
        });
    }
    let packages = workspace_packages(root)?;
    let mut dropped = 0;
    for dir in fingerprint_dirs(target) {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let Some(package) = name.to_str().and_then(package_of) else {
                continue;
            };
            if packages.iter().any(|p| p == package) && !keep.contains(&package) {
                std::fs::remove_dir_all(e.path())
                    .with_context(|| format!("removing {}", e.path().display()))?;
                dropped += 1;
            }
        }
    }
    std::fs::create_dir_all(target).with_context(|| format!("creating {}", target.display()))?;
    let tmp = target.join(format!("{CLAIM_FILE}.{}", std::process::id()));
    std::fs::write(&tmp, format!("{}\n", me.display()))
        .with_context(|| format!("writing {}", tmp.display()))?;
    let file = target.join(CLAIM_FILE);
    std::fs::rename(&tmp, &file).with_context(|| format!("writing {}", file.display()))?;
    Ok(Claimed {
        previous,
        already: false,
        dropped,
    })
}

/// The checkout `target`'s [`CLAIM_FILE`] names, if any.
fn claimant(target: &Path) -> Option<PathBuf> {
    std::fs::read_to_string(target.join(CLAIM_FILE))
        .ok()
        .map(|s| PathBuf::from(s.trim_end()))
}

/// The package a fingerprint directory belongs to: `<package>-<16 hex digits>`.
fn package_of(name: &str) -> Option<&str> {
    let (package, hash) = name.rsplit_once('-')?;
    (hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit())).then_some(package)
}

/// `<target>/<profile>/.fingerprint` and `<target>/<triple>/<profile>/.fingerprint`.
fn fingerprint_dirs(target: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let subdirs = |d: &Path| -> Vec<PathBuf> {
        std::fs::read_dir(d)
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.path())
                    .filter(|p| p.is_dir())
                    .collect()
            })
            .unwrap_or_default()
    };
    for level1 in subdirs(target) {
        if level1.join(".fingerprint").is_dir() {
            out.push(level1.join(".fingerprint"));
        }
        for level2 in subdirs(&level1) {
            if level2.join(".fingerprint").is_dir() {
                out.push(level2.join(".fingerprint"));
            }
        }
    }
    out
}

/// The names of the workspace's packages, from its manifests.
fn workspace_packages(root: &Path) -> Result<Vec<String>> {
    let manifest = |dir: &Path| -> Result<toml::Table> {
        let path = dir.join("Cargo.toml");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    };
    let top = manifest(root)?;
    let members = top
        .get("workspace")
        .and_then(|w| w.get("members"))
        .and_then(|m| m.as_array())
        .context("the workspace's Cargo.toml lists no members")?;
    let mut names = Vec::new();
    for m in members {
        let dir = root.join(
            m.as_str()
                .context("a workspace member that is not a path")?,
        );
        let name = manifest(&dir)?
            .get("package")
            .and_then(|p| p.get("name"))
            .and_then(|n| n.as_str())
            .map(str::to_string)
            .with_context(|| format!("{} has no package name", dir.display()))?;
        names.push(name);
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .unwrap()
            .to_path_buf()
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("xtask-claim-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    /// A target directory with fingerprints of three workspace crates and a dependency, in
    /// a host profile and a cross profile.
    fn fake_target(t: &Path) {
        for fp in [
            "debug/.fingerprint/sim-protocol-0123456789abcdef",
            "debug/.fingerprint/serde-0123456789abcdef",
            "debug/.fingerprint/xtask-fedcba9876543210",
            "x86_64-unknown-linux-gnu/release/.fingerprint/vllm-vcr-00112233445566ff",
        ] {
            std::fs::create_dir_all(t.join(fp)).unwrap();
        }
    }

    fn exists(t: &Path, fp: &str) -> bool {
        t.join(fp).is_dir()
    }

    #[test]
    fn the_workspace_packages_are_read_from_the_manifests() {
        let mut names = workspace_packages(&root()).unwrap();
        names.sort();
        assert_eq!(
            names,
            ["sim-protocol", "sim-trace", "vcr-host", "vllm-vcr", "xtask"]
        );
    }

    #[test]
    fn another_checkouts_crates_are_dropped_and_the_dependencies_kept() {
        let t = scratch("other");
        fake_target(&t);
        std::fs::write(t.join(CLAIM_FILE), "/somewhere/else\n").unwrap();
        let c = claim(&t, &root(), &["xtask"]).unwrap();
        assert_eq!(c.previous, Some(PathBuf::from("/somewhere/else")));
        assert!(!c.already);
        assert_eq!(c.dropped, 2);
        assert!(!exists(
            &t,
            "debug/.fingerprint/sim-protocol-0123456789abcdef"
        ));
        assert!(!exists(
            &t,
            "x86_64-unknown-linux-gnu/release/.fingerprint/vllm-vcr-00112233445566ff"
        ));
        assert!(exists(&t, "debug/.fingerprint/serde-0123456789abcdef"));
        assert!(exists(&t, "debug/.fingerprint/xtask-fedcba9876543210"));
        let named = std::fs::read_to_string(t.join(CLAIM_FILE)).unwrap();
        assert_eq!(
            named.trim_end(),
            root().canonicalize().unwrap().display().to_string()
        );
        std::fs::remove_dir_all(&t).unwrap();
    }

    #[test]
    fn a_directory_this_checkout_claimed_is_left_alone() {
        let t = scratch("own");
        fake_target(&t);
        assert_eq!(claim(&t, &root(), &[]).unwrap().dropped, 3);
        fake_target(&t);
        let again = claim(&t, &root(), &[]).unwrap();
        assert!(again.already);
        assert_eq!(again.dropped, 0);
        assert!(exists(
            &t,
            "debug/.fingerprint/sim-protocol-0123456789abcdef"
        ));
        std::fs::remove_dir_all(&t).unwrap();
    }

    #[test]
    fn only_names_with_a_cargo_hash_are_fingerprints() {
        assert_eq!(package_of("vllm-vcr-00112233445566ff"), Some("vllm-vcr"));
        assert_eq!(package_of("sim-trace-0123456789ABCDEF"), Some("sim-trace"));
        assert_eq!(package_of("vllm-vcr-checkout"), None);
        assert_eq!(package_of("xtask"), None);
    }
}
