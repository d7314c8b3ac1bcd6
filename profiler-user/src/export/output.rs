//! Atomic profile output. The file is created before sampling starts (so an unwritable path
//! fails early) as an unnamed `O_TMPFILE` file in the destination's directory and gets its name
//! only once complete: a recording killed before then (SIGKILL, or SIGTERM before its handlers
//! are installed) leaves nothing behind, as the kernel frees an unnamed file with its last fd.

use std::{
    ffi::CString,
    fs::{self, File, OpenOptions},
    io::{self, BufWriter, Write},
    os::unix::{
        ffi::OsStrExt as _,
        fs::OpenOptionsExt as _,
        io::{AsRawFd as _, RawFd},
    },
    path::{Path, PathBuf},
    sync::atomic::{AtomicU32, Ordering},
};

use anyhow::{Context as _, Result};
use flate2::{Compression, write::GzEncoder};

pub struct PendingOutput {
    dest: PathBuf,
    dir: PathBuf,
    file: Option<File>,
    /// The visible temp file when the filesystem has no `O_TMPFILE`; None for an unnamed file.
    named_tmp: Option<PathBuf>,
}

impl PendingOutput {
    pub fn create(dest: &Path) -> Result<Self> {
        Self::create_with_mode(dest, 0o666)
    }

    /// With file mode `mode` (before the umask), e.g. 0o600 for an agent's spool.
    pub fn create_with_mode(dest: &Path, mode: u32) -> Result<Self> {
        let dir = match dest.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if dest.is_dir() {
            anyhow::bail!("output path {} is a directory", dest.display());
        }
        let cannot = || format!("cannot write output {}", dest.display());
        let unnamed =
            OpenOptions::new().write(true).custom_flags(libc::O_TMPFILE).mode(mode).open(&dir);
        let (file, named_tmp) = match unnamed {
            Ok(file) => (file, None),
            // No O_TMPFILE on this filesystem (EOPNOTSUPP: some FUSE and network filesystems;
            // EISDIR: kernels before 3.11 see only its O_DIRECTORY bit). Fall back to a named
            // temp file, which a killed recording does leave behind.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EISDIR)) => {
                let (file, tmp) = create_named(&dir, dest, mode).with_context(cannot)?;
                (file, Some(tmp))
            }
            Err(e) => return Err(e).with_context(cannot),
        };
        Ok(Self { dest: dest.to_path_buf(), dir, file: Some(file), named_tmp })
    }

    pub fn path(&self) -> &Path {
        &self.dest
    }

    /// Writes the content through `write` (gzip when the name ends in .gz), syncs, and gives the
    /// file its name.
    pub fn commit<T>(mut self, write: impl FnOnce(&mut dyn Write) -> io::Result<T>) -> Result<T> {
        let file = self.file.take().expect("commit once");
        let gz = self.dest.extension().is_some_and(|e| e == "gz");
        let mut buf = BufWriter::with_capacity(1 << 20, file);
        let (out, file) = if gz {
            let (out, buf) = compress_aside(buf, write)?;
            (out, buf.into_inner().map_err(|e| e.into_error())?)
        } else {
            let out = write(&mut buf).context("write profile")?;
            (out, buf.into_inner().map_err(|e| e.into_error())?)
        };
        file.sync_all().context("sync profile")?;
        match self.named_tmp.take() {
            Some(tmp) => rename(&tmp, &self.dest).inspect_err(|_| {
                let _ = fs::remove_file(&tmp);
            })?,
            None => self.link(&file)?,
        }
        Ok(out)
    }

    /// Names the unnamed file. It is linked straight to the destination when that does not exist
    /// (atomic; nothing else ever becomes visible). linkat cannot replace a file (Linux has no
    /// flag for that), so an existing destination is replaced by linking under a hidden name and
    /// renaming that over it; only a kill between those two calls, after the profile is complete,
    /// leaves the hidden file.
    fn link(&self, file: &File) -> Result<()> {
        let fd = file.as_raw_fd();
        match link_fd(fd, &self.dest) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e).with_context(|| format!("create {}", self.dest.display())),
        }
        for tmp in hidden_names(&self.dir, &self.dest) {
            match link_fd(fd, &tmp) {
                Ok(()) => {
                    return rename(&tmp, &self.dest).inspect_err(|_| {
                        let _ = fs::remove_file(&tmp);
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e).with_context(|| format!("create {}", tmp.display())),
            }
        }
        unreachable!("hidden_names never ends")
    }
}

/// Uncompressed bytes handed to the compressing thread at a time.
const CHUNK: usize = 1 << 20;

/// Gzips what `write` writes into `out` on a thread of its own, so that producing a large
/// profile and compressing it (a third of the time) overlap.
fn compress_aside<T, W: Write + Send>(
    out: W,
    write: impl FnOnce(&mut dyn Write) -> io::Result<T>,
) -> Result<(T, W)> {
    std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(4);
        let compressor = scope.spawn(move || {
            let mut enc = GzEncoder::new(out, Compression::fast());
            for chunk in rx {
                enc.write_all(&chunk)?;
            }
            enc.finish()
        });
        let mut chunks = Chunks { tx, buf: Vec::with_capacity(CHUNK) };
        let written = write(&mut chunks).and_then(|t| chunks.flush().map(|()| t));
        drop(chunks);
        // The compressor's own error first: a failed send only says that it stopped.
        let out =
            compressor.join().expect("the compressor does not panic").context("write profile")?;
        Ok((written.context("write profile")?, out))
    })
}

/// A writer sending its bytes in chunks of [`CHUNK`].
struct Chunks {
    tx: std::sync::mpsc::SyncSender<Vec<u8>>,
    buf: Vec<u8>,
}

impl Write for Chunks {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= CHUNK {
            let full = std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK));
            self.tx.send(full).map_err(|_| io::Error::from(io::ErrorKind::BrokenPipe))?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        if !self.buf.is_empty() {
            let rest = std::mem::take(&mut self.buf);
            self.tx.send(rest).map_err(|_| io::Error::from(io::ErrorKind::BrokenPipe))?;
        }
        Ok(())
    }
}

impl Drop for PendingOutput {
    fn drop(&mut self) {
        // An unnamed file goes with its fd; a named one is removed unless commit renamed it.
        if let Some(tmp) = &self.named_tmp {
            let _ = fs::remove_file(tmp);
        }
    }
}

fn rename(from: &Path, to: &Path) -> Result<()> {
    fs::rename(from, to).with_context(|| format!("rename {} to {}", from.display(), to.display()))
}

/// `.NAME.PID.N.tmp` beside the destination, N counting up (past files left by a killed run
/// whose pid was reused, or by another output of this process).
fn hidden_names<'a>(dir: &'a Path, dest: &'a Path) -> impl Iterator<Item = PathBuf> + 'a {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let name = dest.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let pid = std::process::id();
    std::iter::repeat_with(move || {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        dir.join(format!(".{name}.{pid}.{n}.tmp"))
    })
}

/// A new named temp file beside `dest`.
fn create_named(dir: &Path, dest: &Path, mode: u32) -> io::Result<(File, PathBuf)> {
    for tmp in hidden_names(dir, dest) {
        match OpenOptions::new().write(true).create_new(true).mode(mode).open(&tmp) {
            Ok(file) => return Ok((file, tmp)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    unreachable!("hidden_names never ends")
}

/// Gives the file open at `fd` the name `to` (which must not exist).
fn link_fd(fd: RawFd, to: &Path) -> io::Result<()> {
    let to = CString::new(to.as_os_str().as_bytes())?;
    let proc_fd = CString::new(format!("/proc/self/fd/{fd}")).expect("no NUL");
    // SAFETY: both paths are NUL-terminated strings that outlive the call.
    let r = unsafe {
        libc::linkat(
            libc::AT_FDCWD,
            proc_fd.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::AT_SYMLINK_FOLLOW,
        )
    };
    if r == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.kind() != io::ErrorKind::NotFound || Path::new("/proc/self/fd").exists() {
        return Err(err);
    }
    // /proc is not mounted: AT_EMPTY_PATH links the fd itself (needs CAP_DAC_READ_SEARCH, which
    // the root-run profiler has).
    // SAFETY: as above; the empty path is a NUL-terminated literal.
    let r =
        unsafe { libc::linkat(fd, c"".as_ptr(), libc::AT_FDCWD, to.as_ptr(), libc::AT_EMPTY_PATH) };
    if r == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rsprof-out-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    fn entries(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn writes_atomically_and_gzips() {
        let d = tmpdir("gz");
        let dest = d.join("p.json.gz");
        let out = PendingOutput::create(&dest).unwrap();
        assert!(out.named_tmp.is_none(), "{} supports O_TMPFILE", d.display());
        assert_eq!(entries(&d), Vec::<String>::new(), "nothing visible before commit");
        out.commit(|w| w.write_all(b"{}")).unwrap();
        let raw = fs::read(&dest).unwrap();
        assert_eq!(&raw[..2], &[0x1f, 0x8b]);
        assert_eq!(entries(&d), ["p.json.gz"]);
    }

    #[test]
    fn replaces_an_existing_file() {
        let d = tmpdir("replace");
        let dest = d.join("p.json");
        fs::write(&dest, "old").unwrap();
        let out = PendingOutput::create(&dest).unwrap();
        assert_eq!(fs::read_to_string(&dest).unwrap(), "old", "untouched until commit");
        out.commit(|w| w.write_all(b"new")).unwrap();
        assert_eq!(fs::read_to_string(&dest).unwrap(), "new");
        assert_eq!(entries(&d), ["p.json"], "no hidden name left");
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
        assert_eq!(entries(&d), Vec::<String>::new());
    }

    /// The fallback for filesystems without O_TMPFILE: a hidden named file, renamed on commit
    /// and removed when dropped.
    #[test]
    fn named_fallback_renames_or_removes() {
        let d = tmpdir("named");
        let dest = d.join("p.json");
        let (file, tmp) = create_named(&d, &dest, 0o666).unwrap();
        let name = tmp.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with(".p.json.") && name.ends_with(".tmp"), "{name}");
        let out = PendingOutput {
            dest: dest.clone(),
            dir: d.clone(),
            file: Some(file),
            named_tmp: Some(tmp.clone()),
        };
        assert_eq!(entries(&d), [name.as_str()]);
        out.commit(|w| w.write_all(b"{}")).unwrap();
        assert_eq!(entries(&d), ["p.json"]);
        assert_eq!(fs::read_to_string(&dest).unwrap(), "{}");

        let (file, tmp) = create_named(&d, &dest, 0o666).unwrap();
        assert_ne!(tmp.file_name().unwrap().to_string_lossy(), name, "a fresh name each time");
        drop(PendingOutput { dest, dir: d.clone(), file: Some(file), named_tmp: Some(tmp) });
        assert_eq!(entries(&d), ["p.json"]);
    }
}
