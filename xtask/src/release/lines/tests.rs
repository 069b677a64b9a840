//! Tests of the line rotation: compat.toml edits on temporary copies (the real file is
//! never written), the refusals, and the struct comparison — on a made-up pair of source
//! trees with a known insertion, and on the real 0.32 and 0.33 sources against the layout
//! table the engine speaks.

use std::path::{Path, PathBuf};

use sim_protocol::VllmLine;

use super::compare::{self, variant_name};
use super::*;

fn root() -> PathBuf {
    crate::root()
}

/// A scratch directory, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!(
            "vllm-vcr-lines-{name}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    /// A copy of the repository's compat.toml in the scratch directory.
    fn compat_copy(&self) -> PathBuf {
        let path = self.0.join("compat.toml");
        std::fs::copy(root().join("compat.toml"), &path).unwrap();
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn lines_of(path: &Path) -> Vec<String> {
    let (_, c) = read_compat(path).unwrap();
    c.vllm.iter().map(|l| l.line.clone()).collect()
}

fn real_compat_text() -> String {
    std::fs::read_to_string(root().join("compat.toml")).unwrap()
}

#[test]
fn the_matrix_lists_every_line_oldest_first() {
    let compat = Compat::load(&root()).unwrap();
    let v: serde_json::Value = serde_json::from_str(&matrix_json(&compat).unwrap()).unwrap();
    let include = v["include"].as_array().unwrap();
    assert_eq!(include.len(), compat.vllm.len());
    let first = &include[0];
    let oldest = sorted_lines(&compat).unwrap()[0].clone();
    assert_eq!(first["line"], oldest.line.as_str());
    assert_eq!(first["tag"], oldest.tag.as_str());
    assert_eq!(
        include.iter().filter(|e| e["default"] == true).count(),
        1,
        "{v}"
    );
    assert!(include.iter().all(|e| e["fidelity_validated"].is_boolean()));
}

#[test]
fn drop_line_removes_the_oldest_and_keeps_the_rest_of_the_file() {
    let before = real_compat_text();
    let s = Scratch::new("drop");
    let path = s.compat_copy();
    let all = lines_of(&path);
    let oldest = all[0].clone();
    drop_line(&path, &oldest).unwrap();
    let after = lines_of(&path);
    assert_eq!(after, all[1..].to_vec());
    let text = std::fs::read_to_string(&path).unwrap();
    // the header comments and the python frontend table are untouched
    assert!(text.starts_with(before.lines().next().unwrap()));
    assert!(text.contains("[python_frontend]"));
    assert!(
        !text.contains("\n\n\n"),
        "no double blank line left behind:\n{text}"
    );
    // the repository's file is never written by the tests
    assert_eq!(real_compat_text(), before);
}

#[test]
fn drop_line_refuses_all_but_the_oldest_and_the_default() {
    let s = Scratch::new("drop-refuse");
    let path = s.compat_copy();
    let all = lines_of(&path);
    let err = drop_line(&path, &all[2]).unwrap_err().to_string();
    assert!(err.contains("is not the oldest line"), "{err}");
    assert!(err.contains(&all[0]), "names the oldest: {err}");
    let err = drop_line(&path, "0.9").unwrap_err().to_string();
    assert!(err.contains("is not in"), "{err}");
    let err = drop_line(&path, "latest").unwrap_err().to_string();
    assert!(err.contains("expected MAJOR.MINOR"), "{err}");
    assert_eq!(lines_of(&path), all, "a refused drop changes nothing");

    // a window whose oldest line is the default one
    let small = s.0.join("small.toml");
    std::fs::write(
        &small,
        "[[vllm]]\nline = \"0.32\"\ntag = \"0.32.0\"\ndefault = true\n\n\
         [[vllm]]\nline = \"0.33\"\ntag = \"0.33.0\"\n\n\
         [python_frontend]\npackage = \"vllm\"\nversion = \"0.33.0\"\n",
    )
    .unwrap();
    let err = drop_line(&small, "0.32").unwrap_err().to_string();
    assert!(err.contains("is the default line"), "{err}");
}

#[test]
fn add_line_refuses_known_older_and_mismatched_lines_before_any_download() {
    let s = Scratch::new("add-refuse");
    let path = s.compat_copy();
    let all = lines_of(&path);
    let cache = s.0.join("no-cache");
    let run = |line: &str, tag: Option<&str>| {
        add_line(&AddLine {
            compat: &path,
            cache: &cache,
            line,
            tag,
        })
        .unwrap_err()
        .to_string()
    };
    let newest = all.last().unwrap();
    assert!(run(newest, None).contains("is already in"));
    let err = run("0.1", None);
    assert!(err.contains("newer than the newest"), "{err}");
    let err = run("9.1", Some("9.2.0"));
    assert!(err.contains("is not a release of the 9.1 line"), "{err}");
    let err = run("9.1", Some("9.1.0rc1"));
    assert!(err.contains("not a final release"), "{err}");
    assert_eq!(lines_of(&path), all);
    assert!(!cache.exists(), "nothing was fetched");
}

#[test]
fn an_added_entry_lands_after_the_last_line_and_before_the_frontend_table() {
    let text = real_compat_text();
    let edited = with_line_added(&text, "9.1", "9.1.2").unwrap();
    let c: Compat = toml::from_str(&edited).unwrap();
    let last = c.vllm.last().unwrap();
    assert_eq!(
        (
            last.line.as_str(),
            last.tag.as_str(),
            last.default,
            last.fidelity_validated
        ),
        ("9.1", "9.1.2", false, false)
    );
    let entry = edited.find("line = \"9.1\"").unwrap();
    assert!(entry < edited.find("\n[python_frontend]").unwrap());
    assert!(edited.contains("fidelity_validated = false\n\n[python_frontend]"));
    // and the round trip through drop gives the original back
    assert_eq!(with_line_removed(&edited, "9.1").unwrap(), text);
}

/// A made-up release: `vllm/v1/engine/__init__.py` with the given `EngineCoreOutput` fields
/// (plus a minimal request and envelope), and `vllm/v1/engine/core.py` with `methods`.
fn fake_tree(dir: &Path, output_fields: &[&str], methods: &[&str]) {
    let engine = dir.join("vllm/v1/engine");
    std::fs::create_dir_all(&engine).unwrap();
    let mut src = String::from(
        "import msgspec\n\nclass FinishReason(enum.IntEnum):\n    STOP = 0\n    LENGTH = 1\n\n\
         class EngineCoreRequest(msgspec.Struct, array_like=True):\n    request_id: str\n\n\
         class EngineCoreOutputs(msgspec.Struct, array_like=True):\n    engine_index: int = 0\n\n\
         class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):\n    request_id: str\n",
    );
    for f in output_fields {
        src.push_str(&format!("    {f}: int | None = None\n"));
    }
    std::fs::write(engine.join("__init__.py"), src).unwrap();
    let mut core = String::from("class EngineCore:\n    def _private(self): pass\n");
    for m in methods {
        core.push_str(&format!("    def {m}(self, level: int): pass\n"));
    }
    std::fs::write(engine.join("core.py"), core).unwrap();
}

#[test]
fn an_inserted_output_field_is_reported_as_a_shift_with_a_new_table() {
    let s = Scratch::new("fake");
    let (a, b) = (s.0.join("a"), s.0.join("b"));
    fake_tree(&a, &["kv_transfer_params", "trace_headers"], &["sleep"]);
    fake_tree(
        &b,
        &["kv_transfer_params", "ec_transfer_params", "trace_headers"],
        &["sleep", "wake_up"],
    );
    let old = snapshot_of(&a, "9.0.0").unwrap();
    let new = snapshot_of(&b, "9.1.0").unwrap();
    let report = compare::render(&old, &new, "9.1");
    assert!(
        report.contains("EngineCoreOutput         array  3 → 4 elements  POSITIONS SHIFT"),
        "{report}"
    );
    assert!(
        report.contains(
            "+ [2] ec_transfer_params: int | None = None   INSERTED: every later field moves one position up"
        ),
        "{report}"
    );
    assert!(report.contains("EngineCoreRequest        array  1 elements  unchanged"));
    assert!(report.contains("FinishReason             enum   unchanged"));
    assert!(report.contains("+ wake_up(level)"), "{report}");
    assert!(
        report.contains("VllmLine::output_layout: 9.1 → 4 fields — positions SHIFT"),
        "{report}"
    );
    assert!(report.contains(
        "[RequestId, KvTransferParams, EcTransferParams (new OutputField variant), TraceHeaders]"
    ));
    assert!(report.contains("NEWEST = VllmLine::new(9, 1)"));
}

#[test]
fn a_tree_without_the_engine_structs_is_refused() {
    let s = Scratch::new("empty");
    std::fs::create_dir_all(s.0.join("vllm")).unwrap();
    let err = snapshot_of(&s.0, "9.0.0").unwrap_err().to_string();
    assert!(err.contains("declares no EngineCoreRequest"), "{err}");
    assert!(err.contains("vllm/v1/engine/__init__.py"), "{err}");
}

/// The sources of two supported lines, read from the cache (`cargo xtask fetch --python
/// --cpu-engine` installs both; otherwise their wheels are downloaded once).
fn real(tag: &str) -> compare::Snapshot {
    let cache = vcr_host::frontends::cache_root().unwrap();
    snapshot_for(&cache, tag).unwrap_or_else(|e| {
        panic!("the vllm {tag} sources are needed (and could not be had): {e:#}")
    })
}

/// What the layout table says about one line, in the spelling of the printed comparison.
fn table(line: VllmLine) -> (Vec<String>, usize, usize) {
    let output = line
        .output_layout()
        .iter()
        .map(|f| format!("{f:?}"))
        .collect();
    (output, line.request_len(), line.outputs_len())
}

fn declared(snap: &compare::Snapshot) -> (Vec<String>, usize, usize) {
    let output = snap.structs["EngineCoreOutput"]
        .fields
        .iter()
        .map(|f| variant_name(&f.name))
        .collect();
    (
        output,
        snap.structs["EngineCoreRequest"].fields.len(),
        snap.structs["EngineCoreOutputs"].fields.len(),
    )
}

#[test]
fn the_032_to_033_comparison_matches_the_layout_table() {
    let old = real("0.32.0");
    let new = real("0.33.0");
    // the sources parse into exactly the layouts the engine speaks for both lines
    assert_eq!(declared(&old), table(VllmLine::new(0, 32)));
    assert_eq!(declared(&new), table(VllmLine::new(0, 33)));

    let report = compare::render(&old, &new, "0.33");
    // the one positional change: `error` appended to EngineCoreOutput
    assert!(
        report.contains("EngineCoreOutput         array  18 → 19 elements   ("),
        "{report}"
    );
    assert!(
        report.contains("+ [18] error: RequestError | None = None   (appended)"),
        "{report}"
    );
    assert!(report.contains("EngineCoreRequest        array  22 elements  unchanged"));
    assert!(report.contains("EngineCoreOutputs        array  9 elements  unchanged"));
    assert!(report.contains("LoRARequest              array  6 elements  unchanged"));
    assert!(!report.contains("POSITIONS SHIFT"), "{report}");
    // keyed changes of 0.33: the ready response's coordinator keys (all optional)
    assert!(report.contains("+ coord_store_port: int = 0"), "{report}");
    assert!(report.contains("optional keys only"), "{report}");
    assert!(report.contains("+ pause_generation("), "{report}");
    // the entry the table needs is the one it has: 0.33 = 0.32's layout + Error
    let (t32, t33) = (table(VllmLine::new(0, 32)).0, table(VllmLine::new(0, 33)).0);
    assert_eq!(t33[..t32.len()], t32[..]);
    assert_eq!(t33[t32.len()..], ["Error".to_string()]);
    let listed = format!("[{}, Error (new OutputField variant)]", t32.join(", "));
    assert!(
        report.contains(&format!(
            "VllmLine::output_layout: 0.33 → 19 fields:\n       {listed}"
        )),
        "{report}"
    );
    assert!(!report.contains("VllmLine::request_len"), "{report}");
    assert!(!report.contains("VllmLine::outputs_len"), "{report}");
}

#[test]
fn add_line_on_a_window_ending_at_032_adds_033_and_prints_its_differences() {
    let s = Scratch::new("add");
    let path = s.0.join("compat.toml");
    // the window as it stood before 0.33: drop the 0.33 entry, 0.32 default
    let text = with_line_removed(&real_compat_text(), "0.33")
        .unwrap()
        .replace(
            "line = \"0.32\"\ntag = \"0.32.0\"\n",
            "line = \"0.32\"\ntag = \"0.32.0\"\ndefault = true\n",
        );
    std::fs::write(&path, &text).unwrap();
    let before = lines_of(&path);
    assert_eq!(before.last().map(String::as_str), Some("0.32"));
    let cache = vcr_host::frontends::cache_root().unwrap();
    let report = add_line(&AddLine {
        compat: &path,
        cache: &cache,
        line: "0.33",
        tag: Some("0.33.0"),
    })
    .unwrap();
    assert!(report.starts_with("Wire structs: vllm 0.32.0 → vllm 0.33.0"));
    assert!(report.contains("+ [18] error"), "{report}");
    let (_, c) = read_compat(&path).unwrap();
    let added = c.vllm.iter().find(|l| l.line == "0.33").unwrap();
    assert_eq!(added.tag, "0.33.0");
    assert!(!added.fidelity_validated && !added.default);
    assert_eq!(
        c.vllm.iter().find(|l| l.default).map(|l| l.line.as_str()),
        Some("0.32"),
        "the default does not move by itself"
    );
}

#[test]
fn the_025_to_026_comparison_reports_the_insertion_the_table_encodes() {
    // 0.26 inserted `ec_transfer_params` in the middle of EngineCoreOutput: the layout
    // table gives 0.25 a table of its own for it (the wheels are downloaded once when no
    // cache has their sources: ~300 MB each, ~35 MB of them kept)
    let old = real("0.25.1");
    let new = real("0.26.0");
    assert_eq!(declared(&old), table(VllmLine::new(0, 25)));
    assert_eq!(declared(&new), table(VllmLine::new(0, 26)));

    let report = compare::render(&old, &new, "0.26");
    assert!(
        report.contains("EngineCoreOutput         array  13 → 14 elements  POSITIONS SHIFT"),
        "{report}"
    );
    assert!(
        report.contains(
            "+ [9] ec_transfer_params: dict[str, Any] | None = None   INSERTED: every later field moves one position up"
        ),
        "{report}"
    );
    // where the table puts the inserted field, and what moved
    let (t25, t26) = (table(VllmLine::new(0, 25)).0, table(VllmLine::new(0, 26)).0);
    assert_eq!(t26[9], "EcTransferParams");
    assert!(!t25.contains(&"EcTransferParams".to_string()));
    let pos = |t: &[String], f: &str| t.iter().position(|x| x == f).unwrap();
    assert_eq!(pos(&t25, "PrefillStats") + 1, pos(&t26, "PrefillStats"));
    assert!(report.contains("positions SHIFT: older lines keep their own layout"));
    assert!(report.contains("EcTransferParams (new OutputField variant)"));
    // the keyed additions of 0.26
    assert!(
        report.contains("+ num_cache_creation_tokens: int = 0"),
        "{report}"
    );
    assert!(report.contains("EngineCoreRequest        array  20 elements  unchanged"));
}
