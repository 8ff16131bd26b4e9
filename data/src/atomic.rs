//! Atomic file replacement: write a temporary file beside the target, fsync it, rename it
//! over the target. Readers (and other MPI ranks) see the old file or the new one, never a
//! torn one. It deliberately does not lock: two writers of the same path both succeed and
//! the last rename wins, which is fine because our writers are deterministic.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::DataError;

/// Distinguishes temporary names made by threads of one process; the pid separates
/// processes. A counter, not randomness, so that no RNG dependency is needed.
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A name in `dir` that no other live writer uses: `.<stem>.tmp-<pid>-<nanos>-<n>`. The
/// clock reading separates processes on different hosts that share a filesystem (MPI ranks
/// on NFS) and happen to have the same pid.
pub(crate) fn unique_temp_path(dir: &Path, stem: &str) -> PathBuf {
    let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    dir.join(format!(".{stem}.tmp-{}-{nanos}-{n}", std::process::id()))
}

/// Writes `path` atomically: `fill` streams the contents into a buffered temporary file in
/// the same directory (a rename is only atomic within one filesystem), which is then
/// fsynced and renamed over `path`. On any error the temporary file is removed.
pub(crate) fn write_atomic(
    path: &Path,
    fill: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>,
) -> Result<(), DataError> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let stem = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "file".to_owned());
    let tmp = unique_temp_path(dir, &stem);

    let result = (|| {
        let file = File::create(&tmp).map_err(|e| DataError::io("create", &tmp, e))?;
        let mut writer = BufWriter::new(file);
        fill(&mut writer).map_err(|e| DataError::io("write", &tmp, e))?;
        let file = writer
            .into_inner()
            .map_err(|e| DataError::io("write", &tmp, e.into_error()))?;
        // fsync before rename: otherwise a crash can leave the new name pointing at an
        // empty or partial file on filesystems that reorder metadata and data writes.
        file.sync_all()
            .map_err(|e| DataError::io("fsync", &tmp, e))?;
        fs::rename(&tmp, path).map_err(|e| DataError::io("rename into place", path, e))
    })();
    if result.is_err() {
        // Best effort: the original error is what the caller needs to see.
        let _ = fs::remove_file(&tmp);
    }
    result?;
    sync_dir(dir);
    Ok(())
}

/// Best-effort fsync of a directory so a completed rename survives a crash. Errors are
/// ignored: some filesystems refuse to open or sync directories, and the data is already safe
/// from the point of view of concurrent readers.
pub(crate) fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Writes `bytes` to `path` atomically (see [`write_atomic`]).
pub(crate) fn write_bytes_atomic(path: &Path, bytes: &[u8]) -> Result<(), DataError> {
    write_atomic(path, |w| w.write_all(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_contents_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.txt");
        write_bytes_atomic(&path, b"first").unwrap();
        write_bytes_atomic(&path, b"second").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"second");
        let names: Vec<_> = fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "temporary file left behind: {names:?}");
    }

    #[test]
    fn failed_fill_keeps_old_file_and_removes_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.txt");
        write_bytes_atomic(&path, b"old").unwrap();
        let err = write_atomic(&path, |w| {
            w.write_all(b"partial")?;
            Err(std::io::Error::other("boom"))
        })
        .unwrap_err();
        assert!(err.to_string().contains("boom"), "{err}");
        assert_eq!(fs::read(&path).unwrap(), b"old");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
