//! [`TestDir`]: one test's own scratch directory, gone when the test passes, kept (and
//! named on stderr) when it fails.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

pub struct TestDir {
    root: PathBuf,
}

impl TestDir {
    /// An empty directory `<temp>/vllm-vcr-tests/<name>-<pid>-<n>`, `n` counting the
    /// directories this process made.
    pub fn new(name: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let root = std::env::temp_dir()
            .join("vllm-vcr-tests")
            .join(format!("{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", root.display()));
        TestDir { root }
    }

    /// `name` inside the directory (not created).
    pub fn path(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("test failed: its files are kept in {}", self.root.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

/// A directory shared by the tests of one process (a file made once and read by several
/// tests), under Cargo's scratch space for integration tests (`target/tmp`): no test owns
/// it, so none removes it.
pub fn process_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    dir
}
