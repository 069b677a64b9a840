//! `cargo xtask layout`: the shape of the house, checked — no Rust file past
//! [`MAX_LINES`] lines and no import cycle between the modules of a crate.
//!
//! A file that grows past the limit usually holds two ideas, and a cycle means two modules
//! cannot be read (or moved) apart; both creep in one commit at a time, so the test suite
//! checks them on every run (the unit test at the bottom).
//!
//! The module graph is read from the source text, file by file: module A depends on module
//! B when A names one of B's items through `crate::b::…`, `super::…`, `self::b::…` or a bare
//! `b::…` of a child module A declares. A parent's `pub use child::X` is a re-export (it
//! declares what the parent offers), not a use, and `#[cfg(test)]` modules are left out:
//! a test module may reach anywhere.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// The longest a Rust file may be.
pub const MAX_LINES: usize = 800;

/// The source roots whose modules form one graph each (relative to the repository).
const CRATE_ROOTS: [&str; 5] = [
    "src",
    "xtask/src",
    "crates/sim-protocol/src",
    "crates/sim-trace/src",
    "crates/vcr-host/src",
];

/// Directories whose `.rs` files are held to [`MAX_LINES`] (besides the crate roots).
const OTHER_RUST_DIRS: [&str; 5] = [
    "tests",
    "benches",
    "crates/sim-protocol/tests",
    "crates/sim-trace/tests",
    "crates/sim-protocol/benches",
];

/// What is wrong with the layout, one line per finding.
pub fn findings(root: &Path) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let mut files = Vec::new();
    for dir in CRATE_ROOTS.iter().chain(OTHER_RUST_DIRS.iter()) {
        rust_files(&root.join(dir), &mut files)?;
    }
    files.sort();
    files.dedup();
    for file in &files {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        let lines = text.lines().count();
        if lines > MAX_LINES {
            let rel = file.strip_prefix(root).unwrap_or(file);
            out.push(format!(
                "{} has {lines} lines (more than {MAX_LINES}): split it by idea",
                rel.display()
            ));
        }
    }
    for src in CRATE_ROOTS {
        let dir = root.join(src);
        if !dir.is_dir() {
            continue;
        }
        for cycle in cycles(&dir)? {
            out.push(format!(
                "import cycle in {src} among {}: each names another's items",
                cycle.join(", ")
            ));
        }
    }
    Ok(out)
}

/// `cargo xtask layout`: print the findings; an error when there is any.
pub fn run(root: &Path) -> Result<()> {
    let found = findings(root)?;
    for f in &found {
        crate::errln!("layout: {f}");
    }
    anyhow::ensure!(found.is_empty(), "{} layout finding(s)", found.len());
    crate::outln!(
        "layout: every Rust file within {MAX_LINES} lines, no import cycle in {}",
        CRATE_ROOTS.join(", ")
    );
    Ok(())
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in entries {
        let path = entry?.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n == "fixtures") {
                continue;
            }
            rust_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// A module's path inside its crate (`[]` is the crate root).
type ModPath = Vec<String>;

/// Every module of the crate under `src`, by path, with its file.
fn modules(src: &Path) -> Result<BTreeMap<ModPath, PathBuf>> {
    let mut files = Vec::new();
    rust_files(src, &mut files)?;
    let mut mods = BTreeMap::new();
    for file in files {
        let rel = file.strip_prefix(src).unwrap_or(&file).with_extension("");
        let mut path: ModPath = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if path.first().is_some_and(|p| p == "bin") {
            continue;
        }
        if path.last().is_some_and(|p| p == "mod") {
            path.pop();
        }
        if path == ["lib"] || path == ["main"] {
            path.clear();
        }
        mods.insert(path, file);
    }
    Ok(mods)
}

/// The cycles among the modules under `src`, each as a list of module names.
pub fn cycles(src: &Path) -> Result<Vec<Vec<String>>> {
    let mods = modules(src)?;
    let mut edges: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
    for (module, file) in &mods {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        let targets = if module.is_empty() {
            // the crate root declares and re-exports; it is the top of every graph
            BTreeSet::new()
        } else {
            uses(module, &code_only(&text), &mods)
        };
        edges.insert(module.clone(), targets);
    }
    let name = |m: &ModPath| {
        if m.is_empty() {
            "crate".to_string()
        } else {
            m.join("::")
        }
    };
    Ok(strongly_connected(&edges)
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|c| {
            let mut names: Vec<String> = c.iter().map(name).collect();
            names.sort();
            names
        })
        .collect())
}

/// The modules `module`'s code names.
fn uses(module: &ModPath, code: &str, mods: &BTreeMap<ModPath, PathBuf>) -> BTreeSet<ModPath> {
    let children: BTreeSet<String> = code
        .lines()
        .filter_map(|l| declared_child(l.trim()))
        .collect();
    let mut out = BTreeSet::new();
    for line in code.lines() {
        let reexport = is_reexport(line.trim());
        for path in paths(line) {
            let first = path[0].as_str();
            let target: ModPath = match first {
                "crate" => path[1..].to_vec(),
                "self" => module.iter().chain(&path[1..]).cloned().collect(),
                "super" => {
                    let mut base = module.clone();
                    let mut rest = &path[..];
                    while rest.first().is_some_and(|p| p == "super") {
                        base.pop();
                        rest = &rest[1..];
                    }
                    base.into_iter().chain(rest.iter().cloned()).collect()
                }
                child if children.contains(child) && !reexport => {
                    module.iter().chain(&path[..]).cloned().collect()
                }
                _ => continue,
            };
            if let Some(t) = longest_module(mods, &target)
                && &t != module
            {
                out.insert(t);
            }
        }
    }
    out
}

fn longest_module(mods: &BTreeMap<ModPath, PathBuf>, path: &[String]) -> Option<ModPath> {
    (0..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|p| mods.contains_key(p))
}

/// `mod x;` / `pub(crate) mod x;` → `x`.
fn declared_child(line: &str) -> Option<String> {
    let rest = strip_visibility(line).strip_prefix("mod ")?;
    let name = rest.strip_suffix(';')?.trim();
    name.chars()
        .all(|c| c.is_alphanumeric() || c == '_')
        .then(|| name.to_string())
}

fn is_reexport(line: &str) -> bool {
    line.starts_with("pub") && strip_visibility(line).starts_with("use ")
}

fn strip_visibility(line: &str) -> &str {
    let Some(rest) = line.strip_prefix("pub") else {
        return line;
    };
    let rest = if rest.starts_with('(') {
        rest.find(')').map_or(rest, |i| &rest[i + 1..])
    } else {
        rest
    };
    rest.trim_start()
}

/// Every `a::b::c` path on a line (a path not itself preceded by `::`), as its segments.
fn paths(line: &str) -> Vec<Vec<String>> {
    let bytes = line.as_bytes();
    let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if !ident(bytes[i]) || (i > 0 && ident(bytes[i - 1])) {
            i += 1;
            continue;
        }
        let preceded = i >= 2 && &bytes[i - 2..i] == b"::";
        let mut segs = Vec::new();
        let mut j = i;
        loop {
            let start = j;
            while j < bytes.len() && ident(bytes[j]) {
                j += 1;
            }
            if start == j {
                break;
            }
            segs.push(line[start..j].to_string());
            if bytes.get(j..j + 2) == Some(b"::") {
                j += 2;
            } else {
                break;
            }
        }
        if segs.len() > 1 && !preceded {
            out.push(segs);
        }
        i = j.max(i + 1);
    }
    out
}

/// The code of a file without comments, string and char literals, and without what follows
/// a `#[cfg(test)]` module (test modules sit at the end by this project's convention).
fn code_only(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod ") {
        Some(i) => &text[..i],
        None => text,
    };
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let mut depth = 0;
                while i < b.len() {
                    if b[i..].starts_with(b"/*") {
                        depth += 1;
                        i += 2;
                    } else if b[i..].starts_with(b"*/") {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        if b[i] == b'\n' {
                            out.push('\n');
                        }
                        i += 1;
                    }
                }
            }
            b'r' if (b.get(i + 1) == Some(&b'#') || b.get(i + 1) == Some(&b'"'))
                && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')) =>
            {
                let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
                if b.get(i + 1 + hashes) != Some(&b'"') {
                    out.push('r');
                    i += 1;
                    continue;
                }
                let close: Vec<u8> = std::iter::once(b'"')
                    .chain(std::iter::repeat_n(b'#', hashes))
                    .collect();
                i += 2 + hashes;
                while i < b.len() && !b[i..].starts_with(&close) {
                    if b[i] == b'\n' {
                        out.push('\n');
                    }
                    i += 1;
                }
                i += close.len();
                out.push_str("\"\"");
            }
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    if b[i] == b'\\' {
                        i += 1;
                    }
                    if b.get(i) == Some(&b'\n') {
                        out.push('\n');
                    }
                    i += 1;
                }
                i += 1;
                out.push_str("\"\"");
            }
            b'\'' => {
                // a char literal ('x', '\n', '\u{..}') or a lifetime ('a)
                if b.get(i + 1) == Some(&b'\\') {
                    i += 2;
                    while i < b.len() && b[i] != b'\'' {
                        i += 1;
                    }
                    i += 1;
                } else if let Some(len) = text[i + 1..].chars().next().map(char::len_utf8)
                    && b.get(i + 1 + len) == Some(&b'\'')
                {
                    i += 2 + len;
                } else {
                    out.push('\'');
                    i += 1;
                }
            }
            _ => {
                let ch_len = text[i..].chars().next().map_or(1, char::len_utf8);
                out.push_str(&text[i..i + ch_len]);
                i += ch_len;
            }
        }
    }
    out
}

/// Tarjan's strongly connected components.
fn strongly_connected(edges: &BTreeMap<ModPath, BTreeSet<ModPath>>) -> Vec<Vec<ModPath>> {
    struct State<'a> {
        edges: &'a BTreeMap<ModPath, BTreeSet<ModPath>>,
        index: BTreeMap<&'a ModPath, usize>,
        low: BTreeMap<&'a ModPath, usize>,
        stack: Vec<&'a ModPath>,
        on_stack: BTreeSet<&'a ModPath>,
        out: Vec<Vec<ModPath>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a ModPath) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.edges.get(v).into_iter().flatten() {
            let Some((w, _)) = s.edges.get_key_value(w) else {
                continue;
            };
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                comp.push(w.clone());
                if w == v {
                    break;
                }
            }
            s.out.push(comp);
        }
    }
    let mut s = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(files: &[(&str, &str)]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "vcr-layout-{}-{}",
            std::process::id(),
            files.len() * 1000 + files[0].1.len()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        for (path, text) in files {
            let p = dir.join(path);
            std::fs::create_dir_all(p.parent().expect("a file has a parent")).expect("mkdir");
            std::fs::write(p, text).expect("write");
        }
        dir
    }

    #[test]
    fn a_child_naming_its_parent_that_names_it_is_a_cycle() {
        let dir = tree(&[
            ("lib.rs", "mod a;\n"),
            ("a/mod.rs", "mod b;\npub struct Args;\nfn f() { b::g(); }\n"),
            ("a/b.rs", "use super::Args;\npub fn g() {}\n"),
        ]);
        assert_eq!(cycles(&dir).expect("reads"), vec![vec!["a", "a::b"]]);
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn a_re_export_comments_strings_and_tests_are_not_uses() {
        let dir = tree(&[
            ("lib.rs", "mod a;\nmod c;\n"),
            (
                "a/mod.rs",
                "mod b;\npub use b::g;\n// c::x\nconst S: &str = \"crate::c::y\";\n",
            ),
            (
                "a/b.rs",
                "use super::super::c::Z;\npub fn g() { let _ = '\"'; }\n",
            ),
            (
                "c.rs",
                "pub struct Z;\n#[cfg(test)]\nmod tests {\n use crate::a::g;\n}\n",
            ),
        ]);
        assert!(cycles(&dir).expect("reads").is_empty());
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn the_repository_keeps_its_layout() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("xtask sits in the repository");
        let found = findings(root).expect("the tree reads");
        assert!(found.is_empty(), "layout findings:\n{}", found.join("\n"));
    }
}
