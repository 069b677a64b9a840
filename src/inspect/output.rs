//! Output files of the `inspect` commands: never left half-written when the command fails
//! (the guard against writing over an input is `crate::io_guard`, shared by every command).

use std::path::Path;

/// Whether `a` and `b` are the same existing file: the same path, a symlink to it, or a
/// hard link (same device and inode).
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// Deletes a half-written output unless disarmed. Armed only once the command has created
/// the file, so a pre-existing file is never touched by an early error; only a regular
/// file is removed (never a symlink such as `/dev/stdout`, nor a device).
pub struct OutputGuard<'a> {
    path: &'a Path,
    armed: bool,
}

impl<'a> OutputGuard<'a> {
    pub fn new(path: &'a Path) -> Self {
        Self { path, armed: false }
    }

    /// The output is about to be created: remove it if the command fails from now on.
    pub fn arm(&mut self) {
        self.armed = true;
    }

    /// The output is complete: keep it.
    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for OutputGuard<'_> {
    fn drop(&mut self) {
        if self.armed && std::fs::symlink_metadata(self.path).is_ok_and(|m| m.file_type().is_file())
        {
            let _ = std::fs::remove_file(self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hard_links_and_symlinks_are_the_same_file() {
        let dir = std::env::temp_dir().join(format!("vcr-output-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a = dir.join("a");
        std::fs::write(&a, "x").unwrap();
        let hard = dir.join("hard");
        let soft = dir.join("soft");
        let _ = std::fs::remove_file(&hard);
        let _ = std::fs::remove_file(&soft);
        std::fs::hard_link(&a, &hard).unwrap();
        std::os::unix::fs::symlink(&a, &soft).unwrap();
        assert!(same_file(&a, &hard) && same_file(&a, &soft));
        assert!(!same_file(&a, &dir.join("missing")));
        std::fs::remove_dir_all(&dir).ok();
    }
}
