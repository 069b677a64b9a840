//! The committed conformance corpus is what its manifest says it is.
//!
//! `conformance/manifest.toml` and `conformance/v2/manifest.toml` (written by `cargo xtask
//! corpus`, see conformance/README.md) list every capture of the two corpora. This test, which needs no engine, fails when the
//! corpus was edited by hand or truncated: every listed trace and step-stats sidecar
//! exists, parses to the end and has the listed sha256; the trace meta's `config_hash` is
//! the listed one; every trace comes from the same host CPU (meta `host_cpu`); roles are
//! `fit`, `gate` or `noise`, no file is listed twice (so none is both fit and gate); and
//! the manifest lists at least one capture.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use crate::support::fixture;
use sha2::{Digest, Sha256};
use sim_trace::steps::StepStatsReader;
use sim_trace::trace::{TraceItem, TraceReader};

type Table = BTreeMap<String, Value>;

#[derive(Debug, Clone, PartialEq)]
enum Value {
    Str(String),
    Int(u64),
}

/// The TOML subset the xtask writes: `#` comments, `[[capture]]` headers, and
/// `key = "basic string"` / `key = integer` lines. Anything else is an error, so a
/// hand-edited manifest in other syntax fails loudly rather than being half read.
fn parse_manifest(text: &str) -> Result<Vec<Table>, String> {
    let mut tables: Vec<Table> = Vec::new();
    for (n, raw) in text.lines().enumerate() {
        let line = raw.trim();
        let at = || format!("manifest line {}: {raw:?}", n + 1);
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if line == "[[capture]]" {
            tables.push(Table::new());
            continue;
        }
        let (key, value) = line
            .split_once('=')
            .ok_or_else(|| format!("{}: expected `key = value`", at()))?;
        let (key, value) = (key.trim(), value.trim());
        if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(format!("{}: bad key", at()));
        }
        let value = if value.starts_with('"') {
            Value::Str(
                serde_json::from_str::<String>(value)
                    .map_err(|e| format!("{}: bad string: {e}", at()))?,
            )
        } else {
            Value::Int(
                value
                    .parse()
                    .map_err(|e| format!("{}: not a string or integer: {e}", at()))?,
            )
        };
        let table = tables
            .last_mut()
            .ok_or_else(|| format!("{}: a key outside any [[capture]]", at()))?;
        if table.insert(key.to_string(), value).is_some() {
            return Err(format!("{}: duplicate key {key}", at()));
        }
    }
    Ok(tables)
}

fn str_field<'a>(t: &'a Table, key: &str) -> &'a str {
    match t.get(key) {
        Some(Value::Str(s)) => s,
        other => panic!("manifest entry {t:?}: `{key}` must be a string, is {other:?}"),
    }
}

fn int_field(t: &Table, key: &str) -> u64 {
    match t.get(key) {
        Some(Value::Int(v)) => *v,
        other => panic!("manifest entry {t:?}: `{key}` must be an integer, is {other:?}"),
    }
}

fn sha256_hex(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn manifest_parser_rejects_what_it_does_not_know() {
    assert!(parse_manifest("[[capture]]\nfile = 'x'\n").is_err());
    assert!(parse_manifest("file = \"x\"\n").is_err());
    assert!(parse_manifest("[[capture]]\nseed = 1\nseed = 2\n").is_err());
    assert!(parse_manifest("[capture]\n").is_err());
    let t = parse_manifest("# c\n[[capture]]\nfile = \"a\\\"b\"\nseed = 3\n").unwrap();
    assert_eq!(t[0]["file"], Value::Str("a\"b".into()));
    assert_eq!(t[0]["seed"], Value::Int(3));
}

#[test]
fn conformance_corpus_matches_its_manifest() {
    check_corpus(&fixture("conformance"));
}

#[test]
fn corpus_v2_matches_its_manifest() {
    check_corpus(&fixture("conformance").join("v2"));
}

fn check_corpus(dir: &Path) {
    let path = dir.join("manifest.toml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "reading {}: {e} (regenerate: cargo xtask corpus)",
            path.display()
        )
    });
    let entries = parse_manifest(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(
        !entries.is_empty(),
        "{} lists no captures: an empty corpus checks nothing (regenerate: cargo xtask corpus)",
        path.display()
    );

    let mut files = BTreeSet::new();
    let mut hosts: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut roles: BTreeMap<&str, usize> = BTreeMap::new();
    for e in &entries {
        let file = str_field(e, "file");
        let steps = str_field(e, "steps");
        let role = str_field(e, "role");
        let workload = str_field(e, "workload");
        let line = str_field(e, "line");
        let _ = (int_field(e, "seed"), str_field(e, "load"));
        let requests = int_field(e, "requests");
        assert!(
            ["fit", "gate", "noise"].contains(&role),
            "{file}: role {role:?} is not fit, gate or noise"
        );
        assert!(
            files.insert(file.to_string()) && files.insert(steps.to_string()),
            "{file} (or its sidecar {steps}) is listed twice: a trace has one role"
        );
        assert!(
            file.starts_with(&format!("{line}/{workload}-s")),
            "{file}: not under its line {line} or not named for its workload {workload}"
        );
        *roles.entry(role).or_default() += 1;

        // the trace: present, its hash, its meta, readable to the end
        let trace = dir.join(file);
        assert!(trace.is_file(), "{} is listed but missing", trace.display());
        assert_eq!(
            sha256_hex(&trace),
            str_field(e, "sha256"),
            "{file}: sha256 differs from the manifest"
        );
        let mut items =
            TraceReader::open(&trace).unwrap_or_else(|err| panic!("opening {file}: {err}"));
        let meta = match items.next() {
            Some(Ok(TraceItem::Meta(m))) => m,
            other => panic!("{file}: the first line is not a meta: {other:?}"),
        };
        let version = meta.vllm_version.clone().unwrap_or_default();
        assert!(
            version == line || version.starts_with(&format!("{line}.")),
            "{file}: listed under line {line}, but its engine reported vLLM {version:?}"
        );
        assert_eq!(
            meta.config_hash.as_deref(),
            Some(str_field(e, "config_hash")),
            "{file}: the meta's config_hash differs from the manifest"
        );
        let host = meta
            .host_cpu
            .as_ref()
            .map(|c| c.describe())
            .unwrap_or_else(|| panic!("{file}: the meta has no host_cpu"));
        hosts.entry(host).or_default().push(file.to_string());
        let mut records = 0u64;
        for item in items {
            match item.unwrap_or_else(|err| panic!("{file}: {err} (truncated?)")) {
                TraceItem::Record(_) => records += 1,
                TraceItem::Meta(_) => panic!("{file}: a second meta line"),
            }
        }
        assert!(
            records >= requests,
            "{file}: {records} request records, the manifest says {requests} requests"
        );

        // the step-stats sidecar: present, its hash, readable to the end
        let sidecar = dir.join(steps);
        assert!(
            sidecar.is_file(),
            "{} is listed but missing",
            sidecar.display()
        );
        assert_eq!(
            sha256_hex(&sidecar),
            str_field(e, "steps_sha256"),
            "{steps}: sha256 differs from the manifest"
        );
        let mut n = 0;
        for s in
            StepStatsReader::open(&sidecar).unwrap_or_else(|err| panic!("opening {steps}: {err}"))
        {
            s.unwrap_or_else(|err| panic!("{steps}: {err} (truncated?)"));
            n += 1;
        }
        assert!(n > 0, "{steps}: no steps");
    }
    assert_eq!(
        hosts.len(),
        1,
        "the corpus mixes host CPUs (one corpus, one machine): {hosts:?}"
    );
    eprintln!(
        "conformance: {} captures checked ({roles:?}), host {}",
        entries.len(),
        hosts.keys().next().unwrap()
    );
}
