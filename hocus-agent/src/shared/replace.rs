//! Replacing a file whole: readers see the old content or the new, never a mix, even
//! across a crash (temporary file beside it, fsync, rename, fsync of the directory).

use std::{
    fs::{self, File, OpenOptions},
    io::{self, BufWriter, Write},
    os::unix::fs::{OpenOptionsExt, PermissionsExt},
    path::Path,
};

use anyhow::Result;

/// Replaces `path` with `bytes` so that readers see the old or the new content, never a
/// mix, even across a crash.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_replacing(path, |w| w.write_all(bytes)).map(|_| ())
}

/// Replaces `path` with what `write` writes, as [`write_atomically`] does; on an error
/// `path` is left as it was.
pub fn replace_with<T>(path: &Path, write: impl FnOnce(&mut dyn Write) -> Result<T>) -> Result<T> {
    write_replacing(path, |w| write(w)).map(|(written, _)| written)
}

/// Replaces `path` by what `write` produces (temporary file, fsync, rename, fsync of the
/// directory), keeping the old file's mode; returns what `write` returned and the bytes
/// written.
pub fn write_replacing<T, E: From<io::Error>>(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<&File>) -> Result<T, E>,
) -> Result<(T, u64), E> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        // Never through a symlink someone put at the temporary name.
        let f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        let mut w = BufWriter::with_capacity(1 << 20, &f);
        let written = write(&mut w)?;
        w.flush()?;
        drop(w);
        f.sync_all()?;
        // Keep the mode of the file being replaced (the state file is 0600); of the file
        // itself, not of what a symlink there points to.
        if let Some(meta) = fs::symlink_metadata(path).ok().filter(|m| m.is_file()) {
            f.set_permissions(fs::Permissions::from_mode(
                meta.permissions().mode() & 0o7777,
            ))?;
        }
        let len = f.metadata()?.len();
        fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()?;
        Ok((written, len))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{MetadataExt, symlink};

    use super::*;

    #[test]
    fn a_file_is_replaced_whole_keeping_its_mode_and_never_through_a_symlink() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("index.json");
        write_atomically(&path, b"old").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o640)).unwrap();
        write_atomically(&path, b"new").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"new");
        assert_eq!(fs::metadata(&path).unwrap().mode() & 0o7777, 0o640);
        // A writer that fails leaves the file as it was, and nothing beside it.
        let failed: Result<()> = replace_with(&path, |w| {
            w.write_all(b"half")?;
            anyhow::bail!("disk gone")
        });
        assert!(failed.is_err());
        assert_eq!(fs::read(&path).unwrap(), b"new");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
        // A symlink at the temporary name is not written through.
        let victim = dir.path().join("victim");
        fs::write(&victim, b"safe").unwrap();
        let tmp = dir
            .path()
            .join(format!(".index.json.tmp-{}", std::process::id()));
        symlink(&victim, &tmp).unwrap();
        assert!(write_atomically(&path, b"newer").is_err());
        assert_eq!(fs::read(&victim).unwrap(), b"safe");
    }
}
