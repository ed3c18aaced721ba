//! Atomic file writes: the contents go to a temporary file next to the target, are
//! flushed to disk, then renamed over it. A reader sees the old file or the new one,
//! never half of one; a failed write leaves the old file untouched.
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Writes `contents` to `path` atomically (same-directory temporary file, then rename).
pub fn write_atomic(path: impl AsRef<Path>, contents: impl AsRef<[u8]>) -> io::Result<()> {
    let path = path.as_ref();
    let temp = temp_path(path)?;
    let result = (|| {
        let mut file = File::create(&temp)?;
        file.write_all(contents.as_ref())?;
        file.sync_all()?;
        fs::rename(&temp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&temp);
    }
    result
}

fn temp_path(path: &Path) -> io::Result<PathBuf> {
    let name = path.file_name().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{}: not a file path", path.display()),
        )
    })?;
    let mut temp_name = std::ffi::OsString::from(".");
    temp_name.push(name);
    temp_name.push(format!(".tmp-{}", std::process::id()));
    Ok(path.with_file_name(temp_name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temporary_file_is_a_hidden_sibling() {
        let t = temp_path(Path::new("out/report.json")).unwrap();
        assert_eq!(t.parent(), Some(Path::new("out")));
        assert!(t
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with(".report.json.tmp-"));
        assert!(temp_path(Path::new("/")).is_err());
    }
}
