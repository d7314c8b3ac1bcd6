//! Profile output. A regular file (or a new name) is written atomically: created before
//! sampling starts (so an unwritable path fails early) as an unnamed `O_TMPFILE` file in the
//! destination's directory, named only once complete, so a recording killed before then
//! (SIGKILL, or SIGTERM before its handlers are installed) leaves the old file, or nothing.
//!
//! Anything else — a character device (`/dev/null`), a FIFO, a socket, `-` (standard output)
//! or one of our own open descriptors (`/dev/stdout`, `/proc/self/fd/N`) — is opened before
//! sampling and written in place, streaming, as `gzip -c` and shell redirections do. Nothing
//! here ever unlinks, renames over or changes the type of an existing file that is not a
//! regular file. A symlink is followed to its target, which is then treated as above (a
//! dangling one creates its target, as `>` does): the link itself is never replaced.

use std::{
    ffi::CString,
    fs::{self, File, OpenOptions},
    io::{self, BufWriter, Write},
    os::unix::{
        ffi::OsStrExt as _,
        fs::{FileTypeExt as _, OpenOptionsExt as _},
        io::{AsRawFd as _, FromRawFd as _, RawFd},
        net::UnixStream,
    },
    path::{Path, PathBuf},
    sync::atomic::{AtomicU32, Ordering},
};

use anyhow::{Context as _, Result, bail};
use flate2::{Compression, write::GzEncoder};

/// `-o -`: standard output.
pub const STDOUT: &str = "-";

pub struct PendingOutput {
    /// As the user named it (for messages).
    dest: PathBuf,
    gzip: bool,
    sink: Sink,
}

enum Sink {
    /// A regular file or a new name: written unnamed, linked to `path` when complete.
    Atomic {
        /// `dest` with symlinks resolved.
        path: PathBuf,
        dir: PathBuf,
        file: Option<File>,
        /// The visible temp file when the filesystem has no `O_TMPFILE`; None for an unnamed
        /// file.
        named_tmp: Option<PathBuf>,
    },
    /// A device, FIFO, socket or open descriptor: written where it is, as it is.
    InPlace(Option<File>),
}

/// Where a path leads, symlinks followed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Destination {
    /// One of this process's descriptors (`-`, `/dev/stdout`, `/proc/self/fd/N`).
    Fd(RawFd),
    /// A regular file, or no file yet: written atomically at this path.
    File(PathBuf),
    /// A device, FIFO or socket (or another process's descriptor): written in place.
    Special(PathBuf),
}

impl Destination {
    pub fn resolve(dest: &Path) -> Result<Self> {
        if dest.as_os_str() == STDOUT {
            return Ok(Self::Fd(libc::STDOUT_FILENO));
        }
        let mut path = dest.to_path_buf();
        // Linux's own bound on links followed in one lookup.
        for _ in 0..40 {
            let Some(name) = path.file_name().map(|n| n.to_owned()) else {
                bail!("output path {} is a directory", dest.display());
            };
            let parent = match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => Path::new("."),
            };
            let parent = fs::canonicalize(parent).with_context(|| {
                format!("cannot write output {}: no directory {}", dest.display(), parent.display())
            })?;
            if let Some(fd) = own_fd(&parent, &name) {
                return Ok(Self::Fd(fd));
            }
            let full = parent.join(&name);
            let meta = match fs::symlink_metadata(&full) {
                Ok(m) => m,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Self::File(full)),
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("cannot write output {}", dest.display()));
                }
            };
            let ty = meta.file_type();
            if ty.is_symlink() {
                // Another process's descriptor is a link with no path behind it (`pipe:[N]`):
                // only opening it reaches the file.
                if parent.starts_with("/proc") && parent.file_name().is_some_and(|n| n == "fd") {
                    return Ok(Self::Special(full));
                }
                let target = fs::read_link(&full)
                    .with_context(|| format!("cannot write output {}", dest.display()))?;
                path = parent.join(target);
            } else if ty.is_file() {
                return Ok(Self::File(full));
            } else if ty.is_dir() {
                bail!("output path {} is a directory", dest.display());
            } else if ty.is_block_device() {
                // A profile written over a disk would destroy what it holds.
                bail!("output path {} is a block device; name a file", dest.display());
            } else {
                return Ok(Self::Special(full));
            }
        }
        bail!("cannot write output {}: too many levels of symbolic links", dest.display())
    }

    /// Written in place rather than atomically.
    pub fn is_stream(&self) -> bool {
        !matches!(self, Self::File(_))
    }
}

/// `N` when `dir/name` is `/proc/<this process>/fd/N` (or a thread's `task/<tid>/fd/N`, which
/// `/proc/thread-self/fd` canonicalizes to).
fn own_fd(dir: &Path, name: &std::ffi::OsStr) -> Option<RawFd> {
    let proc_dir = Path::new("/proc").join(std::process::id().to_string());
    let rest = dir.strip_prefix(&proc_dir).ok()?;
    let ours = rest == Path::new("fd")
        || (rest.starts_with("task") && rest.components().count() == 3 && rest.ends_with("fd"));
    if !ours {
        return None;
    }
    name.to_str()?.parse().ok()
}

impl PendingOutput {
    pub fn create(dest: &Path) -> Result<Self> {
        Self::create_with_mode(dest, 0o666)
    }

    /// With file mode `mode` (before the umask) for a new file, e.g. 0o600 for a dump.
    pub fn create_with_mode(dest: &Path, mode: u32) -> Result<Self> {
        Self::open(dest, &Destination::resolve(dest)?, mode)
    }

    /// Opens `dest`, already resolved to `resolved` (a recording resolves its output once, in
    /// its plan, and decides everything else about it from that).
    pub fn open(dest: &Path, resolved: &Destination, mode: u32) -> Result<Self> {
        let gzip = dest.extension().is_some_and(|e| e == "gz");
        let sink = match resolved.clone() {
            Destination::File(path) => Sink::atomic(dest, path, mode)?,
            Destination::Fd(fd) => Sink::InPlace(Some(dup_writable(dest, fd)?)),
            Destination::Special(path) => Sink::InPlace(Some(open_in_place(dest, &path)?)),
        };
        Ok(Self { dest: dest.to_path_buf(), gzip, sink })
    }

    /// A file the program names itself (an agent's spool): only ever a new or regular file,
    /// never written through a symlink or into a device or FIFO planted under that name.
    pub fn create_file(dest: &Path, mode: u32) -> Result<Self> {
        match fs::symlink_metadata(dest) {
            Ok(m) if !m.file_type().is_file() => {
                bail!("{} exists and is not a regular file; not replacing it", dest.display())
            }
            _ => {}
        }
        let sink = Sink::atomic(dest, dest.to_path_buf(), mode)?;
        // A `.gz` name is gzipped, as `create` does (the spool's `.pb.gz` windows, which
        // `query` and the sinks gunzip).
        let gzip = dest.extension().is_some_and(|e| e == "gz");
        Ok(Self { dest: dest.to_path_buf(), gzip, sink })
    }

    /// Gzip whatever the name (`--compress`); a `.gz` name always is.
    pub fn compress(mut self, on: bool) -> Self {
        self.gzip |= on;
        self
    }

    pub fn path(&self) -> &Path {
        &self.dest
    }

    /// The output as messages name it.
    pub fn describe(&self) -> String {
        if self.dest.as_os_str() == STDOUT {
            "standard output".to_owned()
        } else {
            self.dest.display().to_string()
        }
    }

    /// Written in place (a device, FIFO, socket or descriptor), not as a file of its own.
    pub fn is_stream(&self) -> bool {
        matches!(self.sink, Sink::InPlace(_))
    }

    /// Writes the content through `write` (gzip when asked or the name ends in .gz), then
    /// syncs and names a file; returns `write`'s result and the bytes written.
    pub fn commit<T>(
        mut self,
        write: impl FnOnce(&mut dyn Write) -> io::Result<T>,
    ) -> Result<(T, u64)> {
        let file = match &mut self.sink {
            Sink::Atomic { file, .. } | Sink::InPlace(file) => file.take().expect("commit once"),
        };
        let counted = Counted { inner: file, bytes: 0 };
        let mut buf = BufWriter::with_capacity(1 << 20, counted);
        let (out, counted) = if self.gzip {
            let (out, buf) = compress_aside(buf, write)?;
            (out, buf.into_inner().map_err(|e| e.into_error()).context("write profile")?)
        } else {
            let out = write(&mut buf).context("write profile")?;
            (out, buf.into_inner().map_err(|e| e.into_error()).context("write profile")?)
        };
        let Counted { inner: file, bytes } = counted;
        match &mut self.sink {
            Sink::Atomic { path, dir, named_tmp, .. } => {
                file.sync_all().context("sync profile")?;
                match named_tmp.take() {
                    Some(tmp) => rename(&tmp, path).inspect_err(|_| {
                        let _ = fs::remove_file(&tmp);
                    })?,
                    None => link(&file, dir, path)?,
                }
            }
            // A pipe or device has nothing to sync (fsync fails with EINVAL on a pipe); a
            // regular file behind a descriptor (`> file`) does.
            Sink::InPlace(_) => {
                if file.metadata().is_ok_and(|m| m.is_file()) {
                    file.sync_all().context("sync profile")?;
                }
            }
        }
        Ok((out, bytes))
    }
}

impl Sink {
    fn atomic(dest: &Path, path: PathBuf, mode: u32) -> Result<Self> {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let cannot = || format!("cannot write output {}", dest.display());
        let unnamed =
            OpenOptions::new().write(true).custom_flags(libc::O_TMPFILE).mode(mode).open(&dir);
        let (file, named_tmp) = match unnamed {
            Ok(file) => (file, None),
            // No O_TMPFILE on this filesystem (EOPNOTSUPP: some FUSE and network filesystems;
            // EISDIR: kernels before 3.11 see only its O_DIRECTORY bit). Fall back to a named
            // temp file, which a killed recording does leave behind.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EISDIR)) => {
                let (file, tmp) = create_named(&dir, &path, mode).with_context(cannot)?;
                (file, Some(tmp))
            }
            Err(e) => return Err(e).with_context(cannot),
        };
        Ok(Sink::Atomic { path, dir, file: Some(file), named_tmp })
    }
}

/// A writer counting the bytes it passes on.
pub struct Counted<W> {
    pub inner: W,
    pub bytes: u64,
}

impl<W: Write> Write for Counted<W> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(data)?;
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// A duplicate of our descriptor `fd`, checked to be open for writing: it shares the file
/// offset (and `O_APPEND`) of the original, exactly as writing to `fd` itself would.
fn dup_writable(dest: &Path, fd: RawFd) -> Result<File> {
    let what = match fd {
        libc::STDOUT_FILENO => "standard output".to_owned(),
        _ => format!("descriptor {fd}"),
    };
    // SAFETY: fcntl on any integer is defined; a closed descriptor gives EBADF.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        bail!("cannot write output {}: {what} is not open", dest.display());
    }
    if flags & libc::O_ACCMODE == libc::O_RDONLY {
        bail!("cannot write output {}: {what} is open read-only", dest.display());
    }
    // SAFETY: as above; the new descriptor is ours alone.
    let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
    if new < 0 {
        return Err(io::Error::last_os_error()).with_context(|| format!("dup {what}"));
    }
    // SAFETY: `new` is a fresh descriptor owned by nothing else.
    Ok(unsafe { File::from_raw_fd(new) })
}

/// Opens a device, FIFO or socket for writing where it is. A FIFO with no reader yet waits for
/// one (as `cat > fifo` does), after saying so.
fn open_in_place(dest: &Path, path: &Path) -> Result<File> {
    let cannot = || format!("cannot write output {}", dest.display());
    let open = |nonblock: bool| {
        let flags = libc::O_NOCTTY | if nonblock { libc::O_NONBLOCK } else { 0 };
        OpenOptions::new().write(true).custom_flags(flags).open(path)
    };
    let file = match open(true) {
        Ok(f) => f,
        // A FIFO without a reader.
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) && is_fifo(path) => {
            eprintln!("rsprof-bpf: waiting for a reader of {}", dest.display());
            open(false).with_context(cannot)?
        }
        // A Unix socket cannot be opened, only connected to.
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) && is_socket(path) => {
            let s = UnixStream::connect(path).with_context(cannot)?;
            File::from(std::os::fd::OwnedFd::from(s))
        }
        Err(e) => return Err(e).with_context(cannot),
    };
    set_blocking(&file).with_context(cannot)?;
    // Another process's descriptor may lead to a regular file: replace its content, as `>`.
    if file.metadata().is_ok_and(|m| m.is_file()) {
        file.set_len(0).with_context(cannot)?;
    }
    Ok(file)
}

fn is_fifo(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|m| m.file_type().is_fifo())
}

fn is_socket(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|m| m.file_type().is_socket())
}

fn set_blocking(file: &File) -> io::Result<()> {
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor we own.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Names the unnamed file `path`. It is linked straight there when that does not exist
/// (atomic; nothing else ever becomes visible). linkat cannot replace a file (Linux has no
/// flag for that), so an existing regular file is replaced by linking under a hidden name and
/// renaming that over it; only a kill between those two calls, after the profile is complete,
/// leaves the hidden file.
fn link(file: &File, dir: &Path, path: &Path) -> Result<()> {
    let fd = file.as_raw_fd();
    match link_fd(fd, path) {
        Ok(()) => return Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e).with_context(|| format!("create {}", path.display())),
    }
    // Checked again now, not only at the start: what a rename replaces must still be a
    // regular file (something may have put a FIFO or a device there while we recorded).
    match fs::symlink_metadata(path) {
        Ok(m) if !m.file_type().is_file() => bail!(
            "{} is no longer a regular file; not replacing it (the profile is lost)",
            path.display()
        ),
        _ => {}
    }
    for tmp in hidden_names(dir, path) {
        match link_fd(fd, &tmp) {
            Ok(()) => {
                return rename(&tmp, path).inspect_err(|_| {
                    let _ = fs::remove_file(&tmp);
                });
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e).with_context(|| format!("create {}", tmp.display())),
        }
    }
    unreachable!("hidden_names never ends")
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
        if let Sink::Atomic { named_tmp: Some(tmp), .. } = &self.sink {
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
        assert!(
            matches!(out.sink, Sink::Atomic { named_tmp: None, .. }),
            "{} supports O_TMPFILE",
            d.display()
        );
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
        let sink = Sink::Atomic {
            path: dest.clone(),
            dir: d.clone(),
            file: Some(file),
            named_tmp: Some(tmp),
        };
        let out = PendingOutput { dest: dest.clone(), gzip: false, sink };
        assert_eq!(entries(&d), [name.as_str()]);
        out.commit(|w| w.write_all(b"{}")).unwrap();
        assert_eq!(entries(&d), ["p.json"]);
        assert_eq!(fs::read_to_string(&dest).unwrap(), "{}");

        let (file, tmp) = create_named(&d, &dest, 0o666).unwrap();
        assert_ne!(tmp.file_name().unwrap().to_string_lossy(), name, "a fresh name each time");
        let sink = Sink::Atomic {
            path: dest.clone(),
            dir: d.clone(),
            file: Some(file),
            named_tmp: Some(tmp),
        };
        drop(PendingOutput { dest, gzip: false, sink });
        assert_eq!(entries(&d), ["p.json"]);
    }

    /// The type, device and inode of `p` (symlinks not followed).
    fn identity(p: &Path) -> (u32, u64, u64) {
        use std::os::unix::fs::MetadataExt as _;
        let m = fs::symlink_metadata(p).unwrap();
        (m.mode() & libc::S_IFMT, m.rdev(), m.ino())
    }

    #[test]
    fn resolves_streams_files_and_links() {
        let d = tmpdir("resolve");
        assert_eq!(Destination::resolve(Path::new("-")).unwrap(), Destination::Fd(1));
        assert_eq!(Destination::resolve(Path::new("/dev/stdout")).unwrap(), Destination::Fd(1));
        assert_eq!(Destination::resolve(Path::new("/proc/self/fd/2")).unwrap(), Destination::Fd(2));
        assert_eq!(
            Destination::resolve(Path::new("/proc/thread-self/fd/1")).unwrap(),
            Destination::Fd(1)
        );
        assert_eq!(Destination::resolve(&d.join("new")).unwrap(), Destination::File(d.join("new")));
        fs::write(d.join("real"), "x").unwrap();
        std::os::unix::fs::symlink("real", d.join("link")).unwrap();
        std::os::unix::fs::symlink(d.join("link"), d.join("link2")).unwrap();
        assert_eq!(
            Destination::resolve(&d.join("link2")).unwrap(),
            Destination::File(d.join("real"))
        );
        std::os::unix::fs::symlink("missing", d.join("dangling")).unwrap();
        assert_eq!(
            Destination::resolve(&d.join("dangling")).unwrap(),
            Destination::File(d.join("missing"))
        );
        std::os::unix::fs::symlink("loop", d.join("loop")).unwrap();
        assert!(
            format!("{:#}", Destination::resolve(&d.join("loop")).unwrap_err())
                .contains("too many levels")
        );
        let e = Destination::resolve(&d).unwrap_err();
        assert!(format!("{e:#}").contains("is a directory"), "{e:#}");
        assert_eq!(
            Destination::resolve(Path::new("/dev/null")).unwrap(),
            Destination::Special("/dev/null".into())
        );
        let fifo = d.join("fifo");
        let c = CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert_eq!(Destination::resolve(&fifo).unwrap(), Destination::Special(fifo));
    }

    /// A symlink to a regular file: the target gets the new content, the link stays a link.
    #[test]
    fn writes_through_a_symlink() {
        let d = tmpdir("symlink");
        fs::write(d.join("real.json"), "old").unwrap();
        std::os::unix::fs::symlink("real.json", d.join("p.json")).unwrap();
        let before = identity(&d.join("p.json"));
        let out = PendingOutput::create(&d.join("p.json")).unwrap();
        assert!(!out.is_stream());
        out.commit(|w| w.write_all(b"new")).unwrap();
        assert_eq!(identity(&d.join("p.json")), before, "the link itself is untouched");
        assert_eq!(fs::read_to_string(d.join("real.json")).unwrap(), "new");
        assert_eq!(entries(&d), ["p.json", "real.json"]);
    }

    /// A FIFO is written in place, whole, to its reader, and stays a FIFO.
    #[test]
    fn streams_into_a_fifo() {
        let d = tmpdir("fifo");
        let fifo = d.join("out.json.gz");
        let c = CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let before = identity(&fifo);
        let reader = {
            let fifo = fifo.clone();
            std::thread::spawn(move || fs::read(fifo).unwrap())
        };
        let out = PendingOutput::create(&fifo).unwrap();
        assert!(out.is_stream());
        let body = vec![b'x'; 3 << 20];
        let ((), n) = out.commit(|w| w.write_all(&body)).unwrap();
        let got = reader.join().unwrap();
        assert_eq!(n, got.len() as u64);
        let mut plain = Vec::new();
        io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&got[..]), &mut plain).unwrap();
        assert_eq!(plain, body, "gzip for a .gz name");
        assert_eq!(identity(&fifo), before, "still the same FIFO");
        assert_eq!(entries(&d), ["out.json.gz"]);
    }

    /// `/proc/self/fd/N` writes to our descriptor N itself (here a pipe), compressed on demand.
    #[test]
    fn writes_to_an_open_descriptor() {
        let mut fds = [0; 2];
        // SAFETY: fds has room for two descriptors.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both are fresh descriptors owned by this test.
        let (mut rd, wr) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
        let dest = PathBuf::from(format!("/proc/self/fd/{}", fds[1]));
        let out = PendingOutput::create(&dest).unwrap().compress(true);
        assert!(out.is_stream());
        let reader = std::thread::spawn(move || {
            let mut v = Vec::new();
            io::Read::read_to_end(&mut rd, &mut v).unwrap();
            v
        });
        out.commit(|w| w.write_all(b"{\"meta\":{}}")).unwrap();
        drop(wr);
        let got = reader.join().unwrap();
        assert_eq!(&got[..2], &[0x1f, 0x8b], "--compress gzips");

        let e = PendingOutput::create(Path::new("/proc/self/fd/987")).err().unwrap();
        assert!(format!("{e:#}").contains("descriptor 987 is not open"), "{e:#}");
    }

    /// A Unix socket is connected to and written.
    #[test]
    fn writes_to_a_unix_socket() {
        let d = tmpdir("sock");
        let sock = d.join("s");
        let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let before = identity(&sock);
        let reader = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut v = Vec::new();
            io::Read::read_to_end(&mut s, &mut v).unwrap();
            v
        });
        PendingOutput::create(&sock).unwrap().commit(|w| w.write_all(b"abc")).unwrap();
        assert_eq!(reader.join().unwrap(), b"abc");
        assert_eq!(identity(&sock), before);
    }

    /// The spool's files are never written into something planted under their name.
    #[test]
    fn create_file_refuses_what_is_not_a_regular_file() {
        let d = tmpdir("fileonly");
        std::os::unix::fs::symlink("/etc/passwd", d.join("w.pb.gz")).unwrap();
        let e = PendingOutput::create_file(&d.join("w.pb.gz"), 0o600).err().unwrap();
        assert!(format!("{e:#}").contains("not a regular file"), "{e:#}");
        PendingOutput::create_file(&d.join("new"), 0o600)
            .unwrap()
            .commit(|w| w.write_all(b"x"))
            .unwrap();
        assert_eq!(fs::read(d.join("new")).unwrap(), b"x");
        // A spool window's `.pb.gz` is gzipped.
        let gz = d.join("w2.pb.gz");
        PendingOutput::create_file(&gz, 0o600).unwrap().commit(|w| w.write_all(b"x")).unwrap();
        assert_eq!(fs::read(&gz).unwrap()[..2], [0x1f, 0x8b]);
    }
}
