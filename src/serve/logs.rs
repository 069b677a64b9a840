//! Where `serve` writes the frontend's log (the cache's `logs/`, else the temp dir), and
//! keeping that directory from growing run after run.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// Where the frontend's log goes by default: the cache's logs/, else the temp dir.
pub(super) fn default_log(cache: &Path, port: u16) -> PathBuf {
    let file = format!("frontend-{port}.log");
    let dir = cache.join("logs");
    match std::fs::create_dir_all(&dir) {
        Ok(()) => {
            prune_logs(&dir, KEPT_LOGS, STALE_LOG);
            dir.join(file)
        }
        Err(e) => {
            // SAFETY: getuid has no preconditions.
            let uid = unsafe { libc::getuid() };
            let tmp = std::env::temp_dir().join(format!("vllm-vcr-{uid}-{file}"));
            tracing::warn!(
                "cannot create {} ({e}); the frontend log goes to {}",
                dir.display(),
                tmp.display()
            );
            tmp
        }
    }
}

/// `serve` writes one frontend log per port it ever served on; these bound how many pile
/// up in the cache: a log is removed once it is both past the newest [`KEPT_LOGS`] and
/// untouched for [`STALE_LOG`] (so a running frontend's log is never the one removed).
const KEPT_LOGS: usize = 64;
const STALE_LOG: Duration = Duration::from_secs(7 * 24 * 3600);

/// Remove the `frontend-*.log` files of `dir` beyond the newest `keep` (by modification
/// time) that were last written more than `stale` ago. Best effort: a file that cannot be
/// read or removed stays.
fn prune_logs(dir: &Path, keep: usize, stale: Duration) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut logs: Vec<(std::time::SystemTime, PathBuf)> = entries
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.starts_with("frontend-") && name.ends_with(".log")
        })
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    logs.sort_by_key(|(modified, _)| std::cmp::Reverse(*modified));
    let now = std::time::SystemTime::now();
    for (modified, path) in logs.into_iter().skip(keep) {
        if now.duration_since(modified).is_ok_and(|age| age > stale) {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Old frontend logs beyond the newest few are removed; the newest `keep` (however
    /// old), any written within `stale`, and other files stay.
    #[test]
    fn old_frontend_logs_beyond_the_newest_are_pruned() {
        let dir = std::env::temp_dir().join(format!("vllm-vcr-prune-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let day = Duration::from_secs(24 * 3600);
        let now = std::time::SystemTime::now();
        let write = |name: &str, age: Duration| {
            let f = std::fs::File::create(dir.join(name)).unwrap();
            f.set_modified(now - age).unwrap();
        };
        for i in 0..6 {
            write(&format!("frontend-{i}.log"), day * (10 + i)); // old
        }
        write("frontend-100.log", day); // recent
        write("notes.log", day * 30); // not a frontend log
        let left = || {
            let mut names: Vec<String> = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            names
        };
        prune_logs(&dir, 3, day * 7);
        // the newest three by time stay: 100 (1 day), 0 (10 days), 1 (11 days)
        assert_eq!(
            left(),
            [
                "frontend-0.log",
                "frontend-1.log",
                "frontend-100.log",
                "notes.log"
            ]
        );
        // keeping none, a log written within the week still stays
        prune_logs(&dir, 0, day * 7);
        assert_eq!(left(), ["frontend-100.log", "notes.log"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
