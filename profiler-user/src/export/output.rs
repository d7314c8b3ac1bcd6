//! Atomic profile output: a temp file beside the destination, created before sampling starts
//! (so an unwritable path fails early), renamed over the destination only once complete.

use std::{
    fs::{self, File, OpenOptions},
    io::{self, BufWriter, Write},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};
use flate2::{Compression, write::GzEncoder};

pub struct PendingOutput {
    dest: PathBuf,
    tmp: PathBuf,
    file: Option<File>,
}

impl PendingOutput {
    pub fn create(dest: &Path) -> Result<Self> {
        let dir = match dest.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if dest.is_dir() {
            anyhow::bail!("output path {} is a directory", dest.display());
        }
        let name = dest.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .with_context(|| format!("cannot write output {}", dest.display()))?;
        Ok(Self { dest: dest.to_path_buf(), tmp, file: Some(file) })
    }

    pub fn path(&self) -> &Path {
        &self.dest
    }

    /// Writes the content through `write` (gzip when the name ends in .gz), syncs and renames.
    pub fn commit<T>(mut self, write: impl FnOnce(&mut dyn Write) -> io::Result<T>) -> Result<T> {
        let file = self.file.take().expect("commit once");
        let gz = self.dest.extension().is_some_and(|e| e == "gz");
        let mut buf = BufWriter::with_capacity(1 << 20, file);
        let (out, file) = if gz {
            let mut enc = GzEncoder::new(buf, Compression::fast());
            let out = write(&mut enc).context("write profile")?;
            (out, enc.finish().context("write profile")?.into_inner().map_err(|e| e.into_error())?)
        } else {
            let out = write(&mut buf).context("write profile")?;
            (out, buf.into_inner().map_err(|e| e.into_error())?)
        };
        file.sync_all().context("sync profile")?;
        fs::rename(&self.tmp, &self.dest)
            .with_context(|| format!("rename {} to {}", self.tmp.display(), self.dest.display()))?;
        Ok(out)
    }
}

impl Drop for PendingOutput {
    fn drop(&mut self) {
        if self.file.is_some() || self.tmp.exists() {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rsprof-out-{tag}-{}", std::process::id()));
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn writes_atomically_and_gzips() {
        let d = tmpdir("gz");
        let dest = d.join("p.json.gz");
        let out = PendingOutput::create(&dest).unwrap();
        assert!(!dest.exists(), "nothing at the destination before commit");
        out.commit(|w| w.write_all(b"{}")).unwrap();
        let raw = fs::read(&dest).unwrap();
        assert_eq!(&raw[..2], &[0x1f, 0x8b]);
        assert_eq!(fs::read_dir(&d).unwrap().count(), 1, "temp file renamed away");
    }

    #[test]
    fn unwritable_path_fails_at_create() {
        let e = PendingOutput::create(Path::new("/nonexistent-dir/p.json")).err().unwrap();
        assert!(format!("{e:#}").contains("cannot write output"));
    }

    #[test]
    fn dropped_output_leaves_nothing() {
        let d = tmpdir("drop");
        drop(PendingOutput::create(&d.join("p.json")).unwrap());
        assert_eq!(fs::read_dir(&d).unwrap().count(), 0);
    }
}
