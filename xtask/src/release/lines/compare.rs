//! The wire structs of two vLLM releases, side by side: what changed, and which entries of
//! the per-line layout table (`crates/sim-protocol/src/line.rs`) the change calls for.
//!
//! A [`Snapshot`] is what `wire_structs.py` reads out of one release's Python source.
//! Array structs (msgspec `array_like=True`) are compared by position, because that is how
//! they travel: a field inserted in the middle moves every later field, which is the drift
//! that breaks a frontend silently. Map structs (dataclasses and the other msgspec
//! structs) are compared by key.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Deserialize;

/// One declared field.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Field {
    pub name: String,
    #[serde(rename = "type")]
    pub ty: String,
    /// The default as written in the source; `None` = required.
    pub default: Option<String>,
}

impl Field {
    fn describe(&self) -> String {
        match &self.default {
            Some(d) => format!("{}: {} = {d}", self.name, self.ty),
            None => format!("{}: {} (required)", self.name, self.ty),
        }
    }
}

/// One struct as declared.
#[derive(Debug, Clone, Deserialize)]
pub struct Struct {
    pub file: String,
    /// `array` (positional) or `map` (by key).
    pub kind: String,
    #[serde(default)]
    pub tagged: bool,
    pub fields: Vec<Field>,
}

impl Struct {
    pub fn is_array(&self) -> bool {
        self.kind == "array"
    }

    pub fn names(&self) -> Vec<&str> {
        self.fields.iter().map(|f| f.name.as_str()).collect()
    }
}

/// The wire surface of one release.
#[derive(Debug, Clone, Deserialize)]
pub struct Snapshot {
    /// The release (`0.33.0`); set by the reader, not the script.
    #[serde(default)]
    pub release: String,
    pub structs: BTreeMap<String, Struct>,
    pub enums: BTreeMap<String, Vec<(String, String)>>,
    /// Public methods of the engine object (the names utility calls dispatch to).
    pub methods: BTreeMap<String, Vec<String>>,
    #[serde(default)]
    pub missing_files: Vec<String>,
}

/// What happened to one field between the releases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// New field at `index` of the new release; `shifts` when later fields moved because
    /// of it (an array field inserted before existing ones).
    Added {
        index: usize,
        field: Field,
        shifts: bool,
    },
    /// Field gone from `index` of the old release; `shifts` as for `Added`.
    Removed {
        index: usize,
        field: Field,
        shifts: bool,
    },
    Retyped {
        name: String,
        old: String,
        new: String,
    },
    Redefaulted {
        name: String,
        old: Option<String>,
        new: Option<String>,
    },
}

/// One struct's comparison.
#[derive(Debug, Clone)]
pub struct StructDiff {
    pub name: String,
    pub old: Option<Struct>,
    pub new: Option<Struct>,
    pub changes: Vec<Change>,
}

impl StructDiff {
    /// Whether positions of existing fields moved (array structs only).
    pub fn shifts(&self) -> bool {
        self.changes.iter().any(|c| {
            matches!(
                c,
                Change::Added { shifts: true, .. } | Change::Removed { shifts: true, .. }
            )
        })
    }

    pub fn unchanged(&self) -> bool {
        self.old.is_some()
            && self.new.is_some()
            && self.changes.is_empty()
            && self.old.as_ref().map(|o| o.tagged) == self.new.as_ref().map(|n| n.tagged)
    }
}

/// The longest common subsequence of two name lists, as index pairs.
fn common(old: &[&str], new: &[&str]) -> Vec<(usize, usize)> {
    let (n, m) = (old.len(), new.len());
    let mut t = vec![vec![0usize; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            t[i][j] = if old[i] == new[j] {
                t[i + 1][j + 1] + 1
            } else {
                t[i + 1][j].max(t[i][j + 1])
            };
        }
    }
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    while i < n && j < m {
        if old[i] == new[j] {
            out.push((i, j));
            i += 1;
            j += 1;
        } else if t[i + 1][j] >= t[i][j + 1] {
            i += 1;
        } else {
            j += 1;
        }
    }
    out
}

/// Compare one struct between releases.
pub fn diff_struct(name: &str, old: Option<&Struct>, new: Option<&Struct>) -> StructDiff {
    let mut changes = Vec::new();
    if let (Some(o), Some(n)) = (old, new) {
        let (on, nn) = (o.names(), n.names());
        let pairs = common(&on, &nn);
        let positional = o.is_array() && n.is_array();
        let kept_new: Vec<usize> = pairs.iter().map(|p| p.1).collect();
        let kept_old: Vec<usize> = pairs.iter().map(|p| p.0).collect();
        // a map compares by key: a field that moved is neither added nor removed
        let in_old = |f: &str| on.contains(&f);
        let in_new = |f: &str| nn.contains(&f);
        for (i, f) in o.fields.iter().enumerate() {
            let gone = if positional {
                !kept_old.contains(&i)
            } else {
                !in_new(&f.name)
            };
            if gone {
                changes.push(Change::Removed {
                    index: i,
                    field: f.clone(),
                    shifts: positional && kept_old.iter().any(|&k| k > i),
                });
            }
        }
        for (j, f) in n.fields.iter().enumerate() {
            let fresh = if positional {
                !kept_new.contains(&j)
            } else {
                !in_old(&f.name)
            };
            if fresh {
                changes.push(Change::Added {
                    index: j,
                    field: f.clone(),
                    shifts: positional && kept_new.iter().any(|&k| k > j),
                });
            }
        }
        for nf in &n.fields {
            let Some(of) = o.fields.iter().find(|f| f.name == nf.name) else {
                continue;
            };
            if of.ty != nf.ty {
                changes.push(Change::Retyped {
                    name: nf.name.clone(),
                    old: of.ty.clone(),
                    new: nf.ty.clone(),
                });
            }
            if of.default != nf.default {
                changes.push(Change::Redefaulted {
                    name: nf.name.clone(),
                    old: of.default.clone(),
                    new: nf.default.clone(),
                });
            }
        }
    }
    StructDiff {
        name: name.to_string(),
        old: old.cloned(),
        new: new.cloned(),
        changes,
    }
}

/// Compare every struct either release declares (a struct that appears or vanishes too).
pub fn diff(old: &Snapshot, new: &Snapshot) -> Vec<StructDiff> {
    let mut names: Vec<&String> = old.structs.keys().chain(new.structs.keys()).collect();
    names.sort();
    names.dedup();
    names
        .into_iter()
        .map(|n| diff_struct(n, old.structs.get(n), new.structs.get(n)))
        .collect()
}

/// `mm_cache_miss_hashes` → `MmCacheMissHashes`, the spelling of `OutputField` variants.
pub fn variant_name(field: &str) -> String {
    field
        .split('_')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let mut c = p.chars();
            match c.next() {
                Some(f) => f.to_ascii_uppercase().to_string() + c.as_str(),
                None => String::new(),
            }
        })
        .collect()
}

fn describe_change(c: &Change, positional: bool) -> String {
    match c {
        Change::Added {
            index,
            field,
            shifts,
        } => {
            if !positional {
                format!("+ {}", field.describe())
            } else if *shifts {
                format!(
                    "+ [{index}] {}   INSERTED: every later field moves one position up",
                    field.describe()
                )
            } else {
                format!("+ [{index}] {}   (appended)", field.describe())
            }
        }
        Change::Removed {
            index,
            field,
            shifts,
        } => {
            if !positional {
                format!("- {}", field.describe())
            } else if *shifts {
                format!(
                    "- [{index}] {}   REMOVED from the middle: every later field moves one position down",
                    field.describe()
                )
            } else {
                format!("- [{index}] {}   (dropped from the end)", field.describe())
            }
        }
        Change::Retyped { name, old, new } => format!("~ {name}: type {old} → {new}"),
        Change::Redefaulted { name, old, new } => {
            let d = |x: &Option<String>| x.clone().unwrap_or_else(|| "(required)".into());
            format!("~ {name}: default {} → {}", d(old), d(new))
        }
    }
}

/// The printed comparison: every struct (changed ones with their fields), the enums, the
/// engine methods, then the layout-table entries the new line needs.
pub fn render(old: &Snapshot, new: &Snapshot, new_line: &str) -> String {
    let mut s = String::new();
    let diffs = diff(old, new);
    let _ = writeln!(
        s,
        "Wire structs: vllm {} → vllm {} (array = positional msgpack array, map = by key)\n",
        old.release, new.release
    );
    for d in &diffs {
        let (kind, file) = match (&d.new, &d.old) {
            (Some(st), _) | (None, Some(st)) => (st.kind.as_str(), st.file.as_str()),
            (None, None) => continue,
        };
        let unit = if kind == "array" { "elements" } else { "keys" };
        let size = match (&d.old, &d.new) {
            (Some(o), Some(n)) if o.fields.len() == n.fields.len() => {
                format!("{} {unit}", n.fields.len())
            }
            (Some(o), Some(n)) => format!("{} → {} {unit}", o.fields.len(), n.fields.len()),
            (None, Some(n)) => format!("NEW, {} {unit}", n.fields.len()),
            (Some(_), None) => "GONE".to_string(),
            (None, None) => unreachable!(),
        };
        let tag_note = match (&d.old, &d.new) {
            (Some(o), Some(n)) if o.tagged != n.tagged => {
                if n.tagged {
                    "  NOW TAGGED (a \"type\" key names the class)"
                } else {
                    "  NO LONGER TAGGED (no \"type\" key)"
                }
            }
            _ => "",
        };
        let status = if !tag_note.is_empty() {
            tag_note
        } else if d.unchanged() {
            "  unchanged"
        } else if d.shifts() {
            "  POSITIONS SHIFT"
        } else {
            ""
        };
        let _ = writeln!(s, "{:<24} {kind:<5}  {size}{status}   ({file})", d.name);
        match (&d.old, &d.new) {
            (None, Some(n)) => {
                for (i, f) in n.fields.iter().enumerate() {
                    let _ = writeln!(s, "    [{i}] {}", f.describe());
                }
            }
            _ => {
                for c in &d.changes {
                    let _ = writeln!(s, "    {}", describe_change(c, kind == "array"));
                }
            }
        }
    }
    let _ = writeln!(s);
    let mut enum_names: Vec<&String> = old.enums.keys().chain(new.enums.keys()).collect();
    enum_names.sort();
    enum_names.dedup();
    for name in enum_names {
        match (old.enums.get(name), new.enums.get(name)) {
            (Some(a), Some(b)) if a == b => {
                let _ = writeln!(s, "{name:<24} enum   unchanged");
            }
            (a, b) => {
                let _ = writeln!(s, "{name:<24} enum   CHANGED");
                let a = a.cloned().unwrap_or_default();
                let b = b.cloned().unwrap_or_default();
                for m in &a {
                    if !b.contains(m) {
                        let _ = writeln!(s, "    - {} = {}", m.0, m.1);
                    }
                }
                for m in &b {
                    if !a.contains(m) {
                        let _ = writeln!(s, "    + {} = {}", m.0, m.1);
                    }
                }
            }
        }
    }
    let added: Vec<String> = new
        .methods
        .iter()
        .filter(|(k, _)| !old.methods.contains_key(*k))
        .map(|(k, a)| format!("+ {k}({})", a.join(", ")))
        .collect();
    let removed: Vec<String> = old
        .methods
        .keys()
        .filter(|k| !new.methods.contains_key(*k))
        .map(|k| format!("- {k}"))
        .collect();
    let changed: Vec<String> = new
        .methods
        .iter()
        .filter_map(|(k, a)| {
            let o = old.methods.get(k)?;
            (o != a).then(|| format!("~ {k}({}) → {k}({})", o.join(", "), a.join(", ")))
        })
        .collect();
    if added.is_empty() && removed.is_empty() && changed.is_empty() {
        let _ = writeln!(s, "{:<24} utility methods unchanged", "EngineCore");
    } else {
        let _ = writeln!(
            s,
            "{:<24} utility methods (calls dispatch to these by name):",
            "EngineCore"
        );
        for l in added.iter().chain(&removed).chain(&changed) {
            let _ = writeln!(s, "    {l}");
        }
    }
    let _ = writeln!(s, "\n{}", layout_entries(&diffs, new_line, old, new));
    s
}

/// What the layout table and the codecs need for the new line, one entry per change that
/// touches them.
pub fn layout_entries(
    diffs: &[StructDiff],
    new_line: &str,
    old: &Snapshot,
    new: &Snapshot,
) -> String {
    let mut out = format!(
        "Layout-table entries for {new_line} (crates/sim-protocol/src/line.rs unless named):\n"
    );
    let mut n = 0;
    let mut entry = |text: String| {
        n += 1;
        out.push_str(&format!("  {n}. {text}\n"));
    };
    entry(format!(
        "NEWEST = VllmLine::new({}) (the window's newest line)",
        new_line.replacen('.', ", ", 1)
    ));
    for d in diffs.iter().filter(|d| !d.unchanged()) {
        let Some(st) = d.new.as_ref().or(d.old.as_ref()) else {
            continue;
        };
        let len = d.new.as_ref().map(|n| n.fields.len()).unwrap_or(0);
        let shift = if d.shifts() {
            " — positions SHIFT: older lines keep their own layout, so this line needs a new table, not a longer slice of the old one"
        } else {
            ""
        };
        match d.name.as_str() {
            "EngineCoreRequest" => {
                entry(format!(
                    "VllmLine::request_len: {new_line} → {len}{shift}; crates/sim-protocol/src/decode/input.rs REQUEST_FIELDS lists the longest layout by position"
                ));
            }
            "EngineCoreOutput" => {
                let fields = d.new.as_ref().map(|n| n.names()).unwrap_or_default();
                let known: Vec<&str> = d.old.as_ref().map(|o| o.names()).unwrap_or_default();
                let variants: Vec<String> = fields
                    .iter()
                    .map(|f| {
                        if known.contains(f) {
                            variant_name(f)
                        } else {
                            format!("{} (new OutputField variant)", variant_name(f))
                        }
                    })
                    .collect();
                entry(format!(
                    "VllmLine::output_layout: {new_line} → {len} fields{shift}:\n       [{}]",
                    variants.join(", ")
                ));
            }
            "EngineCoreOutputs" => {
                entry(format!("VllmLine::outputs_len: {new_line} → {len}{shift}"));
            }
            "EngineCoreReadyResponse" => {
                let required: Vec<String> = d
                    .changes
                    .iter()
                    .filter_map(|c| match c {
                        Change::Added { field, .. } if field.default.is_none() => {
                            Some(field.name.clone())
                        }
                        Change::Redefaulted {
                            name, new: None, ..
                        } => Some(name.clone()),
                        _ => None,
                    })
                    .collect();
                if required.is_empty() {
                    entry(
                        "crates/sim-protocol/src/ready.rs: optional keys only (decoders ignore unknown keys; send them when play has a value)"
                            .to_string(),
                    );
                } else {
                    entry(format!(
                        "crates/sim-protocol/src/ready.rs: REQUIRED keys {} — a ready response without them is refused at the handshake",
                        required.join(", ")
                    ));
                }
            }
            _ if st.is_array() => {
                entry(format!(
                    "{} ({}, positional): no per-line table yet — check its encoder/decoder for the new positions{shift}",
                    d.name, st.file
                ));
            }
            _ => {
                entry(format!(
                    "{} (map, {}): keyed, decoders ignore unknown keys — add a key only where play should send it",
                    d.name, st.file
                ));
            }
        }
    }
    let method_change = new.methods.keys().any(|k| !old.methods.contains_key(k))
        || old.methods.keys().any(|k| !new.methods.contains_key(k));
    if method_change {
        entry(
            "src/play utility dispatch: answer the new methods the frontends call; keep the old ones older lines use"
                .to_string(),
        );
    }
    if n == 1 {
        out.push_str(
            "  (no wire struct changed: the new line can reuse the newest line's layout)\n",
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(kind: &str, names: &[&str]) -> Struct {
        Struct {
            file: "f.py".into(),
            kind: kind.into(),
            tagged: false,
            fields: names
                .iter()
                .map(|n| Field {
                    name: n.to_string(),
                    ty: "int".into(),
                    default: Some("0".into()),
                })
                .collect(),
        }
    }

    #[test]
    fn an_insertion_in_an_array_shifts_an_append_does_not() {
        let old = st("array", &["a", "b", "c"]);
        let inserted = st("array", &["a", "x", "b", "c"]);
        let d = diff_struct("S", Some(&old), Some(&inserted));
        assert!(d.shifts());
        assert!(matches!(
            &d.changes[..],
            [Change::Added {
                index: 1,
                shifts: true,
                ..
            }]
        ));

        let appended = st("array", &["a", "b", "c", "x"]);
        let d = diff_struct("S", Some(&old), Some(&appended));
        assert!(!d.shifts());
        assert!(matches!(
            &d.changes[..],
            [Change::Added {
                index: 3,
                shifts: false,
                ..
            }]
        ));

        let removed = st("array", &["a", "c"]);
        let d = diff_struct("S", Some(&old), Some(&removed));
        assert!(matches!(
            &d.changes[..],
            [Change::Removed {
                index: 1,
                shifts: true,
                ..
            }]
        ));
    }

    #[test]
    fn a_map_compares_by_key() {
        let old = st("map", &["a", "b"]);
        let new = st("map", &["b", "a", "c"]);
        let d = diff_struct("M", Some(&old), Some(&new));
        assert!(!d.shifts());
        assert_eq!(d.changes.len(), 1);
        assert!(matches!(&d.changes[0], Change::Added { field, .. } if field.name == "c"));
    }

    #[test]
    fn variant_names_follow_the_rust_spelling() {
        assert_eq!(variant_name("mm_cache_miss_hashes"), "MmCacheMissHashes");
        assert_eq!(variant_name("error"), "Error");
    }
}
