//! Process address spaces: executable mappings from /proc/PID/maps, and the table of mapped
//! files (modules). User addresses are turned into (module, file offset) while the process is
//! alive, so symbolization works after it exits, and each module keeps an open file handle so a
//! binary deleted or replaced during the recording (or living in another mount namespace) is
//! still the one symbolized.

use std::{
    collections::{HashMap, HashSet},
    fs::File,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    sync::{Arc, OnceLock},
};

use crate::model::ids::ModuleId;
use crate::{
    decode::MappedPath,
    model::ids::Pid,
    system::procfs::{self, MapsLine, ProcError},
};

/// A file as the kernel sees it: (device, inode, mtime ns, size). A file replaced in place
/// keeps its inode but not its mtime.
pub type FileIdentity = (u64, u64, i64, u64);

/// The identity of the file `meta` describes.
pub fn file_identity(meta: &std::fs::Metadata) -> FileIdentity {
    use std::os::unix::fs::MetadataExt as _;
    (meta.dev(), meta.ino(), meta.mtime_nsec() + meta.mtime() * 1_000_000_000, meta.len())
}

/// The file as the kernel's BPF programs name it (`FileKey`): its inode and the kernel's
/// encoding of its device (`sb->s_dev`: major << 20 | minor), not `st_dev`'s.
pub fn kernel_file_key(id: &FileIdentity) -> profiler_common::FileKey {
    let (major, minor) = (libc::major(id.0), libc::minor(id.0));
    profiler_common::FileKey { inode: id.1, dev: (major << 20) | minor, _pad: 0 }
}

#[derive(Debug)]
pub struct Module {
    /// Path as the process saw it (`/usr/lib/x86_64-linux-gnu/libc.so.6`, `[vdso]`).
    pub path: String,
    /// File name shown in profiles (`libc.so.6`).
    pub name: String,
    /// Where this process can read the same file now, if anywhere.
    pub open_path: Option<PathBuf>,
    /// Keeps `open_path` valid when it is `/proc/self/fd/N`; shared with exports in flight
    /// (see [`Module::hold`]), so releasing the module does not close it under them.
    _file: Option<Arc<File>>,
    /// GNU build-id of the file, read when it was first opened.
    pub build_id: Option<Vec<u8>>,
}

impl Module {
    /// What a released slot holds until it is reused.
    /// A handle keeping the file (and `/proc/self/fd/N` paths to it) open.
    pub fn hold(&self) -> Option<Arc<File>> {
        self._file.clone()
    }

    fn released() -> Self {
        let name = "[released]".to_owned();
        Module { path: name.clone(), name, open_path: None, _file: None, build_id: None }
    }

    /// Reads the build-id from the held file, else from `open_path`.
    fn read_build_id(&mut self) {
        self.build_id = match (&self._file, &self.open_path) {
            (Some(f), _) => super::buildid::read(f.as_ref()),
            (None, Some(p)) => File::open(p).ok().and_then(|f| super::buildid::read(&f)),
            (None, None) => None,
        };
    }

    /// Where to read the file now: its path while that still names the file that was mapped,
    /// else the handle held on it.
    pub fn readable_path(&self) -> Option<PathBuf> {
        let p = self.open_path.as_ref()?;
        if let Some(f) = &self._file
            && !p.starts_with("/proc/self/fd")
        {
            let same = match (std::fs::metadata(p), f.metadata()) {
                (Ok(a), Ok(b)) => a.ino() == b.ino() && a.dev() == b.dev(),
                _ => false,
            };
            if !same {
                return Some(fd_path(f));
            }
        }
        Some(p.clone())
    }
}

/// A path that opens the file behind `f` for as long as `f` is open, whatever happens to the
/// path it was opened by (deleted, replaced, its mount namespace gone).
pub fn fd_path(f: &File) -> PathBuf {
    use std::os::fd::AsRawFd as _;
    PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd()))
}

type FastHash = foldhash::fast::RandomState;

/// A module's key: device, inode and the path it was mapped by.
#[derive(Debug, PartialEq, Eq, Hash)]
struct FileKey(u64, u64, String);

/// `FileKey` borrowed, to look one up without building its path. Hashes as `FileKey` does
/// (a `String` hashes as its `str`).
#[derive(Hash)]
struct FileRef<'a>(u64, u64, &'a str);

impl hashbrown::Equivalent<FileKey> for FileRef<'_> {
    fn equivalent(&self, k: &FileKey) -> bool {
        self.0 == k.0 && self.1 == k.1 && self.2 == k.2
    }
}

/// Files keyed by (device, inode) so one library mapped by many processes is one module.
#[derive(Default, Debug)]
pub struct ModuleTable {
    modules: Vec<Module>,
    /// Looked up by a borrowed key (`FileRef`): every mapping record of an exec storm asks.
    by_key: hashbrown::HashMap<FileKey, ModuleId, FastHash>,
    /// Files by (dev, inode) alone, for kernel records whose path walk was cut short.
    by_file: HashMap<(u64, u64), ModuleId, FastHash>,
    /// Program headers of executables and interpreters, read once per module.
    layouts: HashMap<ModuleId, Option<ElfLayout>, FastHash>,
    /// Slots of released modules, reused by the next new ones.
    free: Vec<ModuleId>,
    /// (creation number, id) of the modules held, by creation: what
    /// [`ModuleTable::created_since`] reports. Released ones leave it.
    creations: std::collections::VecDeque<(u64, ModuleId)>,
    created: u64,
    /// Creation number of the module in each slot: a slot's module changes when it is reused.
    serials: Vec<u64>,
    /// Modules released so far (see [`ModuleTable::release_unreferenced`]).
    pub released: u64,
}

/// Where the ELF loader put a file's code (see [`ModuleTable::loaded_code`]).
#[derive(Clone, Copy, Debug)]
pub enum LoadedAt {
    /// Its lowest executable segment starts here (`mm->start_code` of an executable).
    LowestCode(u64),
    /// Its load base (`AT_BASE` of an interpreter).
    Base(u64),
}

/// What placing an ELF file's code needs from its program headers.
#[derive(Clone, Debug, Default)]
pub struct ElfLayout {
    /// Executable PT_LOAD segments: (p_vaddr, p_memsz, p_offset), by address.
    pub code: Vec<(u64, u64, u64)>,
    /// Lowest PT_LOAD p_vaddr, page-aligned down (the loader maps it at the base).
    pub first_vaddr: u64,
    /// PT_INTERP.
    pub interp: Option<String>,
    /// PT_LOAD segments never written (no PF_W): (p_vaddr, p_filesz, p_offset). Bytes there
    /// in any process are the file's bytes.
    pub readonly: Vec<(u64, u64, u64)>,
}

impl ElfLayout {
    /// Reads the program headers (and the interpreter's name) of the file at `path`.
    pub fn read(path: &Path) -> Option<ElfLayout> {
        use object::{elf, read::elf::ProgramHeader as _};

        let file = File::open(path).ok()?;
        let headers = super::elf::ProgramHeaders::read(&file)?;
        let endian = headers.endian;
        let mut layout = ElfLayout { first_vaddr: u64::MAX, ..Default::default() };
        for ph in headers.iter() {
            match ph.p_type(endian) {
                elf::PT_LOAD => {
                    let vaddr = ph.p_vaddr(endian);
                    layout.first_vaddr = layout.first_vaddr.min(vaddr & !0xfff);
                    if ph.p_flags(endian) & elf::PF_X != 0 {
                        layout.code.push((vaddr, ph.p_memsz(endian), ph.p_offset(endian)));
                    }
                    if ph.p_flags(endian) & elf::PF_W == 0 {
                        layout.readonly.push((vaddr, ph.p_filesz(endian), ph.p_offset(endian)));
                    }
                }
                elf::PT_INTERP => {
                    if let Some(raw) = headers.segment_bytes(&file, ph, 4096) {
                        let end = raw.iter().position(|&c| c == 0).unwrap_or(raw.len());
                        layout.interp = Some(String::from_utf8_lossy(&raw[..end]).into_owned());
                    }
                }
                _ => {}
            }
        }
        layout.code.sort_unstable();
        (!layout.code.is_empty()).then_some(layout)
    }
}

impl ModuleTable {
    /// Which module a slot holds: changes when a released slot is reused.
    pub fn serial(&self, id: ModuleId) -> u64 {
        self.serials[id.0 as usize]
    }

    pub fn get(&self, id: ModuleId) -> &Module {
        &self.modules[id.0 as usize]
    }

    /// Slots, released ones included: ids are below this.
    pub fn len(&self) -> usize {
        self.modules.len()
    }

    /// The modules created since `cursor` (0 at first) that are still held, and the cursor
    /// to pass next time. Ids are reused after a release, so "ids above the last seen" would
    /// miss files.
    pub fn created_since(&self, cursor: u64) -> (Vec<ModuleId>, u64) {
        let from = self.creations.partition_point(|&(n, _)| n < cursor);
        (self.creations.range(from..).map(|&(_, id)| id).collect(), self.created)
    }

    /// Modules held now (not released).
    pub fn live(&self) -> usize {
        self.modules.len() - self.free.len()
    }

    /// Releases every module but those in `referenced` (and the vDSO and anonymous memory,
    /// which cost nothing): its open file is closed and its slot reused by a later module.
    /// `referenced` must hold every id that anything may still look up, i.e. those in live
    /// processes' address spaces and those in stored stacks; an export already captured keeps
    /// its files through the handles in its `ModuleSource`s. Returns how many were released.
    pub fn release_unreferenced(&mut self, referenced: &HashSet<ModuleId>) -> usize {
        let keep = |key: &FileKey| key.0 == 0 && key.1 == 0;
        let mut gone = HashSet::new();
        self.by_key.retain(|key, id| {
            let live = keep(key) || referenced.contains(id);
            if !live {
                gone.insert(*id);
            }
            live
        });
        self.by_file.retain(|_, id| !gone.contains(id));
        self.creations.retain(|(_, id)| !gone.contains(id));
        for &id in &gone {
            self.layouts.remove(&id);
            self.modules[id.0 as usize] = Module::released();
        }
        self.free.extend(&gone);
        self.released += gone.len() as u64;
        gone.len()
    }

    pub fn is_empty(&self) -> bool {
        self.modules.is_empty()
    }

    fn intern(&mut self, key: FileRef, make: impl FnOnce() -> Module) -> ModuleId {
        if let Some(&id) = self.by_key.get(&key) {
            return id;
        }
        let mut m = make();
        m.read_build_id();
        let id = match self.free.pop() {
            Some(id) => {
                self.modules[id.0 as usize] = m;
                self.serials[id.0 as usize] = self.created;
                id
            }
            None => {
                self.modules.push(m);
                self.serials.push(self.created);
                ModuleId(self.modules.len() as u32 - 1)
            }
        };
        self.creations.push_back((self.created, id));
        self.created += 1;
        self.by_key.insert(FileKey(key.0, key.1, key.2.to_owned()), id);
        id
    }

    /// The module for a mapping line of `pid`.
    fn module_for(&mut self, pid: Pid, m: &MapsLine) -> ModuleId {
        self.intern(FileRef(m.dev, m.inode, &m.path), || open_module(pid, m))
    }

    fn layout(&mut self, module: ModuleId) -> Option<&ElfLayout> {
        let m = &self.modules[module.0 as usize];
        self.layouts
            .entry(module)
            .or_insert_with(|| ElfLayout::read(m.open_path.as_deref()?))
            .as_ref()
    }

    /// Adds to `out` the executable mappings of `module`'s code as the ELF loader placed it;
    /// none when the file cannot be read.
    pub fn loaded_code(&mut self, module: ModuleId, at: LoadedAt, out: &mut Vec<Mapping>) {
        let Some(layout) = self.layout(module) else { return };
        let bias = match at {
            LoadedAt::LowestCode(start) => start.wrapping_sub(layout.code[0].0),
            LoadedAt::Base(base) => base.wrapping_sub(layout.first_vaddr),
        };
        out.extend(layout.code.iter().map(|&(vaddr, memsz, offset)| {
            let start = vaddr.wrapping_add(bias);
            Mapping { start, end: start + memsz, file_offset: offset, module }
        }));
    }

    /// Where `addr`, in a process whose code mappings are `space`, lies in a read-only
    /// segment of one of its files: (readable path, file offset, bytes to the segment's end).
    /// Such bytes can be read from the file after the process is gone.
    pub fn readonly_location(
        &mut self,
        space: &AddressSpace,
        addr: u64,
    ) -> Option<(PathBuf, u64, u64)> {
        let mut tried: Vec<ModuleId> = Vec::new();
        for m in &space.mappings {
            if tried.contains(&m.module) {
                continue;
            }
            tried.push(m.module);
            let Some(layout) = self.layout(m.module) else { continue };
            // The code segment holding the mapping's file offset gives its link-time address.
            let Some(&(vaddr, _, off)) = layout.code.iter().find(|&&(_, memsz, off)| {
                off & !0xfff <= m.file_offset && m.file_offset < off + memsz
            }) else {
                continue;
            };
            let bias = m.start.wrapping_sub(vaddr.wrapping_sub(off).wrapping_add(m.file_offset));
            let target = addr.wrapping_sub(bias);
            let Some(&(v, filesz, o)) =
                layout.readonly.iter().find(|&&(v, filesz, _)| v <= target && target < v + filesz)
            else {
                continue;
            };
            let path = self.modules[m.module.0 as usize].readable_path()?;
            return Some((path, target - v + o, v + filesz - target));
        }
        None
    }

    /// The ELF interpreter named by executable `exe` (`PT_INTERP`), as process `pid` sees it:
    /// through its root while it lives, else on this host.
    pub fn interpreter(&mut self, pid: Pid, exe: ModuleId) -> Option<ModuleId> {
        let interp = self.layout(exe)?.interp.clone()?;
        let in_root = PathBuf::from(format!("/proc/{}/root{interp}", pid.0));
        let (open, meta) = [in_root, PathBuf::from(&interp)]
            .into_iter()
            .find_map(|p| Some((std::fs::metadata(&p).ok()?, p)))
            .map(|(m, p)| (p, m))?;
        let dev = (libc::major(meta.dev()) as u64) << 32 | libc::minor(meta.dev()) as u64;
        if let Some(&id) = self.by_key.get(&FileRef(dev, meta.ino(), &interp)) {
            return Some(id);
        }
        if let Some(&id) = self.by_file.get(&(dev, meta.ino())) {
            return Some(id);
        }
        // Held open: the process's root (and so this path) goes away with it.
        let file = File::open(&open).ok()?;
        let id = self.intern(FileRef(dev, meta.ino(), &interp), || {
            let fd_path = fd_path(&file);
            Module {
                name: file_name(&interp),
                path: interp.clone(),
                open_path: Some(fd_path),
                _file: Some(Arc::new(file)),
                build_id: None,
            }
        });
        self.by_file.entry((dev, meta.ino())).or_insert(id);
        Some(id)
    }

    /// The vDSO (the same image in every process).
    pub fn vdso(&mut self) -> ModuleId {
        self.intern(FileRef(0, 0, "[vdso]"), || Module {
            path: "[vdso]".into(),
            name: "[vdso]".into(),
            open_path: vdso_image(),
            _file: None,
            build_id: None,
        })
    }

    /// Anonymous executable memory (JIT code): no file.
    pub fn anon(&mut self) -> ModuleId {
        self.intern(FileRef(0, 0, "[anon]"), || Module {
            path: "[anon]".into(),
            name: "[anon]".into(),
            open_path: None,
            _file: None,
            build_id: None,
        })
    }

    /// The module for a file mapping the kernel reported at `start..end` of `pid`. A file
    /// already known by (dev, inode) under a complete path is that module; otherwise it is
    /// opened by the kernel's path if that is still the same file, else through the process's
    /// map_files entry (or for its executable, `exe`, its /proc/PID/exe) while it lives; failing
    /// that it keeps its offsets, named by file name.
    pub fn kernel_module(
        &mut self,
        pid: Pid,
        (start, end): (u64, u64),
        (dev, inode): (u64, u64),
        path: &MappedPath,
        exe: bool,
    ) -> ModuleId {
        let key = FileRef(dev, inode, &path.path);
        if let Some(&id) = self.by_key.get(&key) {
            return id;
        }
        if !path.complete
            && let Some(&id) = self.by_file.get(&(dev, inode))
        {
            return id;
        }
        let id = self.intern(key, || {
            let line = MapsLine {
                start,
                end,
                readable: true,
                writable: false,
                exec: true,
                offset: 0,
                dev,
                inode,
                path: path.path.clone(),
            };
            // A relative path (walk cut short) can only be opened through map_files.
            if path.complete { open_module(pid, &line) } else { open_map_file(pid, &line) }
        });
        if path.complete {
            self.by_file.entry((dev, inode)).or_insert(id);
        }
        let m = &mut self.modules[id.0 as usize];
        if exe
            && m.open_path.is_none()
            && let Ok(f) = File::open(format!("/proc/{}/exe", pid.0))
            && f.metadata().is_ok_and(|meta| meta.ino() == inode && dev_matches(meta.dev(), dev))
        {
            m.open_path = Some(fd_path(&f));
            m._file = Some(Arc::new(f));
            m.read_build_id();
        }
        id
    }
}

fn file_name(path: &str) -> String {
    Path::new(path)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.to_owned())
}

/// The vDSO as a readable ELF file: the kernel maps the same image into every 64-bit process,
/// so ours is copied once into a memfd (mapping offsets are offsets into the image). `None` if
/// it cannot be read; its frames then keep their offsets.
fn vdso_image() -> Option<PathBuf> {
    static IMAGE: OnceLock<Option<(File, PathBuf)>> = OnceLock::new();
    IMAGE.get_or_init(copy_vdso).as_ref().map(|(_, p)| p.clone())
}

fn copy_vdso() -> Option<(File, PathBuf)> {
    use std::{
        io::Write as _,
        os::{fd::FromRawFd as _, unix::fs::FileExt as _},
    };
    let line = procfs::self_vdso()?;
    let mut image = vec![0u8; (line.end - line.start) as usize];
    File::open("/proc/self/mem").ok()?.read_exact_at(&mut image, line.start).ok()?;
    if !image.starts_with(b"\x7fELF") {
        return None;
    }
    // SAFETY: plain syscall with a NUL-terminated name.
    let fd = unsafe { libc::memfd_create(c"rsprof-vdso".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` is valid and owned by nothing else.
    let mut file = unsafe { File::from_raw_fd(fd) };
    file.write_all(&image).ok()?;
    Some((file, PathBuf::from(format!("/proc/self/fd/{fd}"))))
}

fn open_module(pid: Pid, m: &MapsLine) -> Module {
    let path = m.path.clone();
    let name = file_name(&path);
    if path == "[vdso]" {
        return Module { open_path: vdso_image(), path, name, _file: None, build_id: None };
    }
    if m.inode == 0 {
        // [anon:...] and other pseudo mappings have no file.
        return Module { path, name, open_path: None, _file: None, build_id: None };
    }
    // Prefer the plain path when it is the very same file (debug-link lookups work relative
    // to it); otherwise hold the process's own handle on the mapped file.
    if let Ok(meta) = std::fs::metadata(&path)
        && meta.ino() == m.inode
        && dev_matches(meta.dev(), m.dev)
    {
        // Also held open, for when the path stops naming this file (deleted or replaced
        // before the profile is symbolized); see `Module::readable_path`.
        let held = File::open(&path)
            .ok()
            .filter(|f| f.metadata().is_ok_and(|h| h.ino() == meta.ino() && h.dev() == meta.dev()));
        return Module {
            open_path: Some(PathBuf::from(&path)),
            path,
            name,
            _file: held.map(Arc::new),
            build_id: None,
        };
    }
    open_map_file(pid, m)
}

/// Holds the process's own handle on the mapped file (also a deleted one, or one in another
/// mount namespace) while the process and the mapping exist, checked against (dev, inode).
fn open_map_file(pid: Pid, m: &MapsLine) -> Module {
    let (path, name) = (m.path.clone(), file_name(&m.path));
    let map_file = format!("/proc/{}/map_files/{:x}-{:x}", pid.0, m.start, m.end);
    // map_files names whole VMAs; an exec record's range is the image's code (start_code to
    // end_code), which need not be one, so look for the VMA holding its start.
    let opened = File::open(&map_file).or_else(|e| map_file_holding(pid, m.start).ok_or(e));
    match opened {
        Ok(f)
            if f.metadata()
                .is_ok_and(|meta| meta.ino() == m.inode && dev_matches(meta.dev(), m.dev)) =>
        {
            let fd_path = fd_path(&f);
            Module {
                path,
                name,
                open_path: Some(fd_path),
                _file: Some(Arc::new(f)),
                build_id: None,
            }
        }
        _ => Module { path, name, open_path: None, _file: None, build_id: None },
    }
}

/// The process's own handle on the file mapped at `addr` (/proc/PID/map_files/START-END).
fn map_file_holding(pid: Pid, addr: u64) -> Option<File> {
    let dir = std::fs::read_dir(format!("/proc/{}/map_files", pid.0)).ok()?;
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some((start, end)) = name.to_str().and_then(|n| n.split_once('-')) else { continue };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16))
        else {
            continue;
        };
        if start <= addr && addr < end {
            return File::open(entry.path()).ok();
        }
    }
    None
}

/// /proc/PID/maps prints the device as major:minor from the kernel's dev_t.
pub fn dev_matches(st_dev: u64, maps_dev: u64) -> bool {
    let major = libc::major(st_dev) as u64;
    let minor = libc::minor(st_dev) as u64;
    (major << 32 | minor) == maps_dev
}

#[derive(Clone, Copy, Debug)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub file_offset: u64,
    pub module: ModuleId,
}

/// The executable mappings of one process image, sorted by address.
#[derive(Clone, Debug)]
pub struct AddressSpace {
    mappings: Vec<Mapping>,
    /// Names these mappings (see [`AddressSpace::version`]).
    version: u64,
    /// The highest number of the kernel's early walker mappings (`UnwindEarly`) among the
    /// records these mappings came from: an entry written from them has seen those.
    early_seen: u32,
}

/// Versions are unique across all address spaces: a new space and every change takes the next.
/// They start at 1: the stack cache keys idle tasks' stacks, which have no space, under 0.
fn next_version() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Default for AddressSpace {
    fn default() -> Self {
        Self { mappings: Vec::new(), version: next_version(), early_seen: 0 }
    }
}

impl AddressSpace {
    /// Two spaces with the same version hold the same mappings (a clone keeps it; a new space
    /// and every change get a new one), so what was worked out from one space's mappings (a
    /// normalized stack) holds for as long as the version does.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Gives the space a new version though its mappings did not change: what depended on
    /// more than them changed (its perf map named more code, or the space was copied to a
    /// new process, whose JIT frames are named by its own map).
    pub fn touch(&mut self) {
        self.version = next_version();
    }

    /// Notes a record's early walker mapping number (0: none).
    pub fn saw_early(&mut self, seq: u32) {
        self.early_seen = self.early_seen.max(seq);
    }

    /// See `early_seen`; a forked child's early mappings are numbered anew, as its own.
    pub fn early_seen(&self) -> u32 {
        self.early_seen
    }

    pub fn forget_early(&mut self) {
        self.early_seen = 0;
    }

    /// The modules mapped (with repeats).
    pub fn modules(&self) -> impl Iterator<Item = ModuleId> + '_ {
        self.mappings.iter().map(|m| m.module)
    }

    pub fn lookup(&self, addr: u64) -> Option<(ModuleId, u64)> {
        let i = self.mappings.partition_point(|m| m.start <= addr);
        let m = self.mappings.get(i.checked_sub(1)?)?;
        (addr < m.end).then(|| (m.module, addr - m.start + m.file_offset))
    }

    pub fn len(&self) -> usize {
        self.mappings.len()
    }

    /// The mappings, sorted by address, non-overlapping.
    pub fn mappings(&self) -> &[Mapping] {
        &self.mappings
    }

    pub fn is_empty(&self) -> bool {
        self.mappings.is_empty()
    }

    /// Maps `m` over whatever was at its range, as mmap does.
    pub fn insert(&mut self, m: Mapping) {
        self.remove(m.start, m.end);
        self.version = next_version();
        let i = self.mappings.partition_point(|x| x.start < m.start);
        self.mappings.insert(i, m);
    }

    /// Unmaps `start..end`: mappings inside go, those across an edge are cut.
    pub fn remove(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        // Sorted and non-overlapping: the mappings the range touches are consecutive. Most
        // unmaps touch no code (a process's data, its exit): nothing changes then.
        let first = self.mappings.partition_point(|m| m.end <= start);
        let last = first + self.mappings[first..].partition_point(|m| m.start < end);
        if first == last {
            return;
        }
        self.version = next_version();
        let (head, tail) = (self.mappings[first], self.mappings[last - 1]);
        let left = (head.start < start).then_some(Mapping { end: start, ..head });
        let right = (tail.end > end).then(|| {
            let file_offset = tail.file_offset + (end - tail.start);
            Mapping { start: end, file_offset, ..tail }
        });
        self.mappings.splice(first..last, left.into_iter().chain(right));
    }
}

/// Parses a maps file's text into the executable mappings, registering their modules.
pub fn parse_maps(pid: Pid, text: &str, modules: &mut ModuleTable) -> AddressSpace {
    let mut mappings: Vec<Mapping> = procfs::parse_maps(text)
        .into_iter()
        .filter(|m| m.exec)
        .map(|m| {
            let module =
                if m.path.is_empty() { modules.anon() } else { modules.module_for(pid, &m) };
            Mapping { start: m.start, end: m.end, file_offset: m.offset, module }
        })
        .collect();
    mappings.sort_by_key(|m| m.start);
    AddressSpace { mappings, version: next_version(), early_seen: 0 }
}

/// Reads the live address space of `pid`.
pub fn read_address_space(pid: Pid, modules: &mut ModuleTable) -> Result<AddressSpace, ProcError> {
    Ok(parse_maps(pid, &procfs::read_maps_text(pid)?, modules))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0c0a00000-55d0c0a01000 r--p 00000000 fd:01 1234   /usr/bin/demo
55d0c0a01000-55d0c0a05000 r-xp 00001000 fd:01 1234   /usr/bin/demo
7f0000000000-7f0000100000 r-xp 00028000 fd:01 99 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000200000-7f0000201000 rwxp 00000000 00:00 0 
7ffd00000000-7ffd00002000 r-xp 00000000 00:00 0                          [vdso]
";

    #[test]
    fn parses_exec_mappings_and_translates_addresses() {
        let mut mods = ModuleTable::default();
        let space = parse_maps(Pid(1), MAPS, &mut mods);
        assert_eq!(space.len(), 4, "only executable mappings are kept");
        let (m, off) = space.lookup(0x55d0c0a01234).unwrap();
        assert_eq!(mods.get(m).name, "demo");
        assert_eq!(off, 0x1234);
        let (m, off) = space.lookup(0x7f0000000010).unwrap();
        assert_eq!(mods.get(m).name, "libc.so.6");
        assert_eq!(off, 0x28010);
        assert!(space.lookup(0x55d0c0a00010).is_none(), "read-only mapping is not code");
        assert!(space.lookup(0x55d0c0a05000).is_none(), "end is exclusive");
        let (m, _) = space.lookup(0x7ffd00000100).unwrap();
        assert_eq!(mods.get(m).name, "[vdso]");
        let (m, _) = space.lookup(0x7f0000200010).unwrap();
        assert_eq!(mods.get(m).name, "[anon]");
    }

    #[test]
    fn same_file_in_two_processes_is_one_module() {
        let mut mods = ModuleTable::default();
        let a = parse_maps(Pid(1), MAPS, &mut mods);
        let b = parse_maps(Pid(2), MAPS, &mut mods);
        assert_eq!(a.lookup(0x7f0000000010).unwrap().0, b.lookup(0x7f0000000010).unwrap().0);
        assert_eq!(mods.len(), 4);
    }

    #[test]
    fn mapping_over_a_range_replaces_it_and_unmapping_cuts() {
        let mut mods = ModuleTable::default();
        let mut space = parse_maps(Pid(1), MAPS, &mut mods);
        let anon = mods.anon();
        let libc = space.lookup(0x7f0000000010).unwrap().0;
        // Unmap the middle of libc's text: both ends stay, the right one at its file offset.
        space.remove(0x7f0000010000, 0x7f0000020000);
        assert!(space.lookup(0x7f0000010000).is_none());
        assert_eq!(space.lookup(0x7f0000020010), Some((libc, 0x28000 + 0x20010)));
        assert_eq!(space.lookup(0x7f000000fff0), Some((libc, 0x28000 + 0xfff0)));
        // Map JIT code over part of what is left.
        let jit =
            Mapping { start: 0x7f0000030000, end: 0x7f0000040000, file_offset: 0, module: anon };
        space.insert(jit);
        assert_eq!(space.lookup(0x7f0000030010), Some((anon, 0x10)));
        assert_eq!(space.lookup(0x7f0000040010), Some((libc, 0x28000 + 0x40010)));
        assert_eq!(space.lookup(0x7f000002fff0), Some((libc, 0x28000 + 0x2fff0)));
        assert_eq!(space.len(), 7, "libc cut in three around the hole and the JIT code");
        space.remove(0x7f0000030000, 0x7f0000040000);
        assert!(space.lookup(0x7f0000030010).is_none());
    }

    proptest::proptest! {
        /// Any sequence of maps and unmaps leaves what a page-by-page model holds, and an
        /// unmap of memory without code keeps the space's version.
        #[test]
        fn maps_and_unmaps_agree_with_a_page_model(
            ops in proptest::collection::vec((proptest::bool::ANY, 0u64..40, 1u64..12), 1..60)
        ) {
            const PAGE: u64 = 0x1000;
            let mut space = AddressSpace::default();
            let mut pages: [Option<(u32, u64)>; 52] = [None; 52];
            for (i, &(map, first, n)) in ops.iter().enumerate() {
                let (start, end) = (first * PAGE, (first + n) * PAGE);
                if map {
                    let module = ModuleId(i as u32);
                    space.insert(Mapping { start, end, file_offset: 7 * PAGE, module });
                    for p in first..first + n {
                        pages[p as usize] = Some((i as u32, 7 * PAGE + (p - first) * PAGE));
                    }
                } else {
                    let touched = (first..first + n).any(|p| pages[p as usize].is_some());
                    let before = space.version();
                    space.remove(start, end);
                    proptest::prop_assert_eq!(space.version() != before, touched);
                    for p in first..first + n {
                        pages[p as usize] = None;
                    }
                }
                for (p, want) in pages.iter().enumerate() {
                    let got = space.lookup(p as u64 * PAGE + 8).map(|(m, off)| (m.0, off - 8));
                    proptest::prop_assert_eq!(got, *want);
                }
                let m = space.mappings();
                proptest::prop_assert!(m.windows(2).all(|w| w[0].end <= w[1].start));
            }
        }
    }

    #[test]
    fn kernel_reported_files_are_keyed_by_device_and_inode() {
        let mut mods = ModuleTable::default();
        let exe = std::fs::canonicalize("/proc/self/exe").unwrap();
        let meta = std::fs::metadata(&exe).unwrap();
        let dev = (libc::major(meta.dev()) as u64) << 32 | libc::minor(meta.dev()) as u64;
        let full = MappedPath { path: exe.display().to_string(), complete: true };
        let a = mods.kernel_module(Pid(1), (0, 0x1000), (dev, meta.ino()), &full, false);
        assert_eq!(mods.get(a).open_path.as_deref(), Some(exe.as_path()));
        // Its build-id was read when it was opened.
        let own = crate::collect::buildid::read(&File::open(&exe).unwrap());
        assert!(own.is_some(), "the test binary has a build-id");
        assert_eq!(mods.get(a).build_id, own);
        // A cut walk finds the same file by (dev, inode).
        let name = exe.file_name().unwrap().to_string_lossy().into_owned();
        let cut = MappedPath { path: name, complete: false };
        assert_eq!(mods.kernel_module(Pid(1), (0, 0x1000), (dev, meta.ino()), &cut, false), a);
        // A path that now names another file (replaced, other namespace) is not trusted.
        let other = MappedPath { path: "/bin/sh".into(), complete: true };
        let b = mods.kernel_module(Pid(u32::MAX), (0, 0x1000), (dev, meta.ino()), &other, true);
        assert_ne!(a, b);
        assert!(mods.get(b).open_path.is_none());
    }

    #[test]
    fn reads_own_address_space() {
        let mut mods = ModuleTable::default();
        let space = read_address_space(Pid(std::process::id()), &mut mods).unwrap();
        let f = reads_own_address_space as *const () as usize as u64;
        let (m, _) = space.lookup(f).expect("own code is mapped");
        assert!(mods.get(m).open_path.is_some());
    }
}
