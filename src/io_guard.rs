//! The one guard every command runs before it opens anything for writing: no output may
//! be one of the command's inputs, nor another of its outputs.
//!
//! Paths are compared as files, not as strings: `x.jsonl` and `./x.jsonl`, a symlink and
//! its target, two hard links of one inode are the same file. An output that does not
//! exist yet is compared by where it would be created (its parent directory resolved, its
//! name joined; a dangling symlink by where it points), so two outputs that would land on
//! one new file are caught too. `-` (standard input or output) and files that are not
//! regular files (`/dev/null`, a pipe) are left alone: writing them destroys nothing.

use std::path::{Component, Path, PathBuf};

use anyhow::{Result, bail};

/// How a path is identified.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Identity {
    /// An existing regular file: its device and inode.
    Inode(u64, u64),
    /// A file that does not exist yet: the absolute path it would be created at.
    Path(PathBuf),
    /// Standard input/output, a device, a pipe, a directory: not compared.
    Ignored,
}

/// The identity of `path` (symlinks followed, up to a bound against loops).
fn identity(path: &Path) -> Identity {
    use std::os::unix::fs::MetadataExt;
    if path.as_os_str() == "-" {
        return Identity::Ignored;
    }
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => Identity::Inode(m.dev(), m.ino()),
        Ok(_) => Identity::Ignored,
        Err(_) => Identity::Path(would_create(path)),
    }
}

/// Where writing `path` (which does not exist) would create a file: a dangling symlink
/// followed to its target, then the parent directory resolved and the name joined.
fn would_create(path: &Path) -> PathBuf {
    let mut p = absolute(path);
    for _ in 0..40 {
        match std::fs::read_link(&p) {
            Ok(target) => {
                let base = p.parent().map(Path::to_path_buf).unwrap_or_default();
                p = absolute(&base.join(target));
            }
            Err(_) => break,
        }
    }
    match (p.parent(), p.file_name()) {
        (Some(dir), Some(name)) => match std::fs::canonicalize(dir) {
            Ok(dir) => dir.join(name),
            Err(_) => p.clone(),
        },
        _ => p,
    }
}

/// `path` made absolute and `.`/`..` folded lexically (for a parent that does not exist,
/// where the file system cannot resolve it).
fn absolute(path: &Path) -> PathBuf {
    let joined = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir().unwrap_or_default().join(path)
    };
    let mut out = PathBuf::new();
    for c in joined.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// One path a command reads or writes, and the flag (or argument) that named it.
#[derive(Debug, Clone)]
pub struct Named<'a> {
    pub what: String,
    pub path: &'a Path,
}

/// `what` (e.g. `--dump-trace`, `the trace`) names `path`.
pub fn named<'a>(what: impl Into<String>, path: &'a Path) -> Named<'a> {
    Named {
        what: what.into(),
        path,
    }
}

/// Refuse when an output is an input, or two outputs are one file. Run it in a command's
/// argument checks, before any file is opened for writing.
pub fn check_outputs(inputs: &[Named], outputs: &[Named]) -> Result<()> {
    let inputs: Vec<(&Named, Identity)> = inputs.iter().map(|n| (n, identity(n.path))).collect();
    let outputs: Vec<(&Named, Identity)> = outputs.iter().map(|n| (n, identity(n.path))).collect();
    for (i, (out, id)) in outputs.iter().enumerate() {
        if *id == Identity::Ignored {
            continue;
        }
        if let Some((input, _)) = inputs.iter().find(|(_, other)| other == id) {
            bail!(
                "{} {} is the same file as {} {}: writing it would destroy the input (write elsewhere)",
                out.what,
                out.path.display(),
                input.what,
                input.path.display()
            );
        }
        if let Some((other, _)) = outputs[..i].iter().find(|(_, other)| other == id) {
            bail!(
                "{} {} is the same file as {} {}: one would overwrite the other (give each its own file)",
                out.what,
                out.path.display(),
                other.what,
                other.path.display()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("vcr-io-guard-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn the_same_file_by_any_name_is_refused() {
        let d = dir();
        let input = d.join("trace.jsonl");
        std::fs::write(&input, "{}\n").unwrap();
        let hard = d.join("hard.jsonl");
        let soft = d.join("soft.jsonl");
        let _ = std::fs::remove_file(&hard);
        let _ = std::fs::remove_file(&soft);
        std::fs::hard_link(&input, &hard).unwrap();
        std::os::unix::fs::symlink(&input, &soft).unwrap();
        let dotted = d.join(".").join("trace.jsonl");
        for out in [&input, &hard, &soft, &dotted] {
            let e = check_outputs(&[named("the trace", &input)], &[named("-o", out)])
                .unwrap_err()
                .to_string();
            assert!(e.contains("-o") && e.contains("the trace"), "{e}");
        }
        // two new outputs that land on one file
        let a = d.join("new.jsonl");
        let b = d.join("sub").join("..").join("new.jsonl");
        std::fs::create_dir_all(d.join("sub")).unwrap();
        let e = check_outputs(
            &[],
            &[named("--trace-out", &a), named("--step-stats-out", &b)],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("one would overwrite the other"), "{e}");
        // a dangling symlink is where it points
        let link = d.join("dangling");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(d.join("target.jsonl"), &link).unwrap();
        let e = check_outputs(
            &[],
            &[named("-o", &link), named("--dump", &d.join("target.jsonl"))],
        );
        assert!(e.is_err());
        // distinct files, standard output and devices pass
        let other = d.join("other.jsonl");
        let null = Path::new("/dev/null");
        let dash = Path::new("-");
        check_outputs(
            &[named("the trace", &input)],
            &[
                named("-o", &other),
                named("--a", null),
                named("--b", null),
                named("--c", dash),
                named("--d", dash),
            ],
        )
        .unwrap();
        std::fs::remove_dir_all(&d).ok();
    }
}
