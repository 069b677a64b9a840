//! The embedded model in the local Hugging Face hub cache, so that tools which take a
//! tokenizer as a repo id (`transformers.AutoTokenizer`, `vllm bench serve`, guidellm,
//! aiperf, inference-perf) find it as `vllm-vcr/tiny` with `HF_HUB_OFFLINE=1`
//! ([`crate::tiny_model::TinyVocab::repo_id`]).
//!
//! The layout is the one `huggingface_hub` reads offline: `models--vllm-vcr--tiny/`
//! holding `refs/main` (a revision) and `snapshots/<revision>/` (the files). The revision is
//! 40 hex digits (what `huggingface_hub` takes for a commit hash) derived from the files'
//! names and contents, so the same files always get the same revision and a snapshot can
//! be checked against its own name: that is how a repository of that name which vllm-vcr
//! did not write (someone else's `vllm-vcr/tiny`) is recognised and left alone.

use std::path::{Path, PathBuf};

/// The hub cache directory, resolved as `huggingface_hub` does: `$HF_HUB_CACHE`, else the
/// legacy `$HUGGINGFACE_HUB_CACHE`, else `$HF_HOME/hub`, else
/// `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`, with `~` and `$VAR`
/// expanded. `None` when that is not an absolute path (no home directory, or a variable set
/// to a relative path: a cache relative to whichever directory a tool starts in is not one
/// the tools would share).
pub fn hub_cache_dir() -> Option<PathBuf> {
    hub_cache_dir_from(&|k| std::env::var(k).ok())
}

/// [`hub_cache_dir`] with the environment given as a lookup (for tests).
pub fn hub_cache_dir_from(env: &dyn Fn(&str) -> Option<String>) -> Option<PathBuf> {
    let expand = |s: &str| expand_vars(&expand_user(s, env), env);
    let home = expand(&env("HF_HOME").unwrap_or_else(|| {
        let xdg = env("XDG_CACHE_HOME").unwrap_or_else(|| expand_user("~/.cache", env));
        format!("{}/huggingface", xdg.trim_end_matches('/'))
    }));
    let legacy = env("HUGGINGFACE_HUB_CACHE")
        .unwrap_or_else(|| format!("{}/hub", home.trim_end_matches('/')));
    let hub = PathBuf::from(expand(&env("HF_HUB_CACHE").unwrap_or(legacy)));
    hub.is_absolute().then_some(hub)
}

/// Python's `os.path.expanduser` for `~` and `~/…` (the only forms a cache path uses).
fn expand_user(s: &str, env: &dyn Fn(&str) -> Option<String>) -> String {
    match (s.strip_prefix('~'), env("HOME")) {
        (Some(rest), Some(home)) if rest.is_empty() || rest.starts_with('/') => {
            format!("{}{rest}", home.trim_end_matches('/'))
        }
        _ => s.to_string(),
    }
}

/// Python's `os.path.expandvars`: `$NAME` and `${NAME}` of set variables are replaced,
/// anything else is left as it is.
fn expand_vars(s: &str, env: &dyn Fn(&str) -> Option<String>) -> String {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = String::new();
    let mut rest = s;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let (name, len) = match after.strip_prefix('{') {
            Some(b) => match b.find('}') {
                Some(end) => (&b[..end], end + 2),
                None => ("", 0),
            },
            None => {
                let end = after.find(|c| !word(c)).unwrap_or(after.len());
                (&after[..end], end)
            }
        };
        match env(name).filter(|_| !name.is_empty()) {
            Some(value) => out.push_str(&value),
            None => out.push_str(&rest[at..at + 1 + len]),
        }
        rest = &after[len..];
    }
    out.push_str(rest);
    out
}

/// The revision of a set of files: 40 hex digits from their names and contents, in
/// any order. Not a Hub commit hash (nothing is fetched from the Hub), but of its shape.
pub fn revision_of(files: &[(&str, String)]) -> String {
    let mut sorted: Vec<&(&str, String)> = files.iter().collect();
    sorted.sort_by_key(|(name, _)| *name);
    // three FNV-1a lanes of different offsets: 160 bits, stable across builds and hosts
    let mut lanes = [
        0xcbf2_9ce4_8422_2325u64,
        0x6c62_272e_07bb_0142,
        0x1234_5678_9abc_def1,
    ];
    for (name, contents) in sorted {
        for part in [name.as_bytes(), &[0], contents.as_bytes(), &[0xff]] {
            for &b in part {
                for lane in &mut lanes {
                    *lane = (*lane ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
                }
            }
        }
    }
    format!("{:016x}{:016x}{:08x}", lanes[0], lanes[1], lanes[2] >> 32)
}

/// Where a repo's files are in the hub cache: `models--<org>--<name>`.
pub fn repo_dir(hub: &Path, repo_id: &str) -> PathBuf {
    hub.join(format!("models--{}", repo_id.replace('/', "--")))
}

/// What [`register`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// The snapshot directory holding the files.
    pub snapshot: PathBuf,
    /// Its revision.
    pub revision: String,
    /// `Some(rev)` when `refs/main` names a revision vllm-vcr did not write (another repo of
    /// that name): it was left as it is, so the repo id resolves to that one, and only
    /// `--revision <ours>` reaches these files.
    pub foreign_main: Option<String>,
}

/// Put `files` into the hub cache under `repo_id` and point `refs/main` at them, unless it
/// points at a revision vllm-vcr did not write. Idempotent; every write is a temp file or
/// directory renamed into place, so a tool reading the cache meanwhile sees the old state or
/// the new one, never half of either.
pub fn register(
    hub: &Path,
    repo_id: &str,
    files: &[(&str, String)],
) -> std::io::Result<Registration> {
    let repo = repo_dir(hub, repo_id);
    let revision = revision_of(files);
    let snapshots = repo.join("snapshots");
    let snapshot = snapshots.join(&revision);
    std::fs::create_dir_all(&snapshots)?;
    if !is_ours(&snapshot, &revision) {
        let tmp = snapshots.join(format!(".{revision}.tmp{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir(&tmp)?;
        for (name, contents) in files {
            std::fs::write(tmp.join(name), contents)?;
        }
        if let Err(e) = std::fs::rename(&tmp, &snapshot) {
            // another process put the same revision there first (a directory is not
            // renamed over a non-empty one), or a broken copy is in the way
            if is_ours(&snapshot, &revision) {
                let _ = std::fs::remove_dir_all(&tmp);
            } else if snapshot.exists() {
                std::fs::remove_dir_all(&snapshot)?;
                std::fs::rename(&tmp, &snapshot)?;
            } else {
                let _ = std::fs::remove_dir_all(&tmp);
                return Err(e);
            }
        }
    }
    let main = repo.join("refs").join("main");
    let current = std::fs::read_to_string(&main)
        .ok()
        .map(|s| s.trim().to_string());
    let foreign_main = match current {
        Some(rev) if rev == revision => None,
        Some(rev) if !is_ours(&snapshots.join(&rev), &rev) => Some(rev),
        _ => {
            std::fs::create_dir_all(repo.join("refs"))?;
            let tmp = repo
                .join("refs")
                .join(format!(".main.tmp{}", std::process::id()));
            std::fs::write(&tmp, &revision)?;
            std::fs::rename(&tmp, &main)?;
            None
        }
    };
    Ok(Registration {
        snapshot,
        revision,
        foreign_main,
    })
}

/// The largest file a snapshot of vllm-vcr's holds (its `tokenizer.json` is about 10 KiB).
const MAX_OWN_FILE: u64 = 4 << 20;

/// Whether `snapshot` holds files whose revision is its name `revision`: a snapshot
/// vllm-vcr wrote, complete and unchanged.
fn is_ours(snapshot: &Path, revision: &str) -> bool {
    let Ok(entries) = std::fs::read_dir(snapshot) else {
        return false;
    };
    let mut files = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        // a real repo of that name may hold weights: never read those to find out
        if !std::fs::metadata(e.path()).is_ok_and(|m| m.len() <= MAX_OWN_FILE) {
            return false;
        }
        match std::fs::read_to_string(e.path()) {
            Ok(text) => files.push((name, text)),
            Err(_) => return false,
        }
    }
    let named: Vec<(&str, String)> = files.iter().map(|(n, t)| (n.as_str(), t.clone())).collect();
    !named.is_empty() && revision_of(&named) == revision
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn the_cache_is_found_as_huggingface_hub_finds_it() {
        let dir = |pairs: &[(&str, &str)]| hub_cache_dir_from(&env_of(pairs));
        let home = ("HOME", "/home/u");
        assert_eq!(dir(&[home]), Some("/home/u/.cache/huggingface/hub".into()));
        assert_eq!(
            dir(&[home, ("XDG_CACHE_HOME", "/x")]),
            Some("/x/huggingface/hub".into())
        );
        assert_eq!(
            dir(&[home, ("XDG_CACHE_HOME", "/x"), ("HF_HOME", "~/hf")]),
            Some("/home/u/hf/hub".into())
        );
        assert_eq!(
            dir(&[
                home,
                ("HF_HOME", "/h"),
                ("HUGGINGFACE_HUB_CACHE", "/legacy")
            ]),
            Some("/legacy".into())
        );
        assert_eq!(
            dir(&[
                home,
                ("HF_HOME", "/h"),
                ("HUGGINGFACE_HUB_CACHE", "/legacy"),
                ("HF_HUB_CACHE", "$HOME/${X}/hub$NOPE")
            ]),
            Some("/home/u/${X}/hub$NOPE".into())
        );
        assert_eq!(dir(&[("HF_HOME", "relative")]), None);
        assert_eq!(dir(&[]), None, "no home directory");
    }

    #[test]
    fn the_revision_is_a_stable_hash_of_the_files() {
        let a = [("a.json", "1".to_string()), ("b.json", "2".to_string())];
        let b = [("b.json", "2".to_string()), ("a.json", "1".to_string())];
        let rev = revision_of(&a);
        assert_eq!(rev.len(), 40);
        assert!(
            rev.bytes()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert_eq!(
            rev,
            revision_of(&b),
            "the order of the files does not matter"
        );
        assert_ne!(
            rev,
            revision_of(&[("a.json", "1".into()), ("b.json", "3".into())])
        );
        assert_ne!(
            rev,
            revision_of(&[("a.json", "12".into()), ("b.json", String::new())])
        );
    }

    const ID: &str = "vllm-vcr/tiny";

    #[test]
    fn register_writes_the_layout_once_and_leaves_another_repo_alone() {
        let hub = std::env::temp_dir().join(format!("vcr-hf-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&hub);
        let files = crate::tiny_model::files();
        let r = register(&hub, ID, &files).unwrap();
        let repo = hub.join("models--vllm-vcr--tiny");
        assert_eq!(r.snapshot, repo.join("snapshots").join(&r.revision));
        assert_eq!(r.foreign_main, None);
        let main = std::fs::read_to_string(repo.join("refs/main")).unwrap();
        assert_eq!(main, r.revision);
        for (name, contents) in &files {
            assert_eq!(
                &std::fs::read_to_string(r.snapshot.join(name)).unwrap(),
                contents
            );
        }
        assert_eq!(register(&hub, ID, &files).unwrap(), r);
        let entries = |d: &Path| std::fs::read_dir(d).unwrap().count();
        assert_eq!(entries(&repo.join("snapshots")), 1, "no temp left behind");

        // other files (another context length) move refs/main: it was ours
        let mut other = files.clone();
        other[0].1.push(' ');
        let r2 = register(&hub, ID, &other).unwrap();
        assert_ne!(r2.revision, r.revision);
        assert_eq!(
            std::fs::read_to_string(repo.join("refs/main")).unwrap(),
            r2.revision
        );

        // someone else's repo of that name: refs/main stays theirs
        let theirs = repo.join("snapshots/0123456789abcdef0123456789abcdef01234567");
        std::fs::create_dir_all(&theirs).unwrap();
        std::fs::write(theirs.join("tokenizer.json"), "{}").unwrap();
        std::fs::write(
            repo.join("refs/main"),
            "0123456789abcdef0123456789abcdef01234567",
        )
        .unwrap();
        let r3 = register(&hub, ID, &files).unwrap();
        assert_eq!(
            r3.foreign_main.as_deref(),
            Some("0123456789abcdef0123456789abcdef01234567")
        );
        assert_eq!(
            std::fs::read_to_string(repo.join("refs/main")).unwrap(),
            "0123456789abcdef0123456789abcdef01234567"
        );
        assert!(r3.snapshot.join("tokenizer.json").is_file());

        // a damaged snapshot of ours is repaired
        std::fs::write(r.snapshot.join("config.json"), "{").unwrap();
        register(&hub, ID, &files).unwrap();
        assert_eq!(
            std::fs::read_to_string(r.snapshot.join("config.json")).unwrap(),
            files[0].1
        );
        std::fs::remove_dir_all(&hub).unwrap();
    }
}
