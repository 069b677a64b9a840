//! Every manifest under `deploy/` through `kubernetes-validate`, and the references of
//! each kustomization.

use super::*;

/// Every manifest under deploy/ through kubernetes-validate. Kustomization files are
/// kustomize's input, not Kubernetes objects (there is no schema for them): they are
/// listed as not validated.
pub(super) fn validate_manifests(root: &Path, validator: &Path) -> Result<()> {
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
pub(super) fn kustomization_refs(file: &Path) -> Result<usize> {
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

pub(super) fn collect_yaml(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
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
