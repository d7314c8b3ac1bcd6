//! What a long-lived symbolizer keeps between calls, bounded so an agent's memory stays flat:
//! the frames of each address it named, by (file identity, offset), or of each function for
//! files named from their symbol tables alone, and the files blazesym holds parsed. Both are keyed by what the file is (device, inode, size, mtime, build-id),
//! never by its path or module id alone: a library replaced on disk, or a module id reused
//! for another file, must not get the old file's names.

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    hash::{Hash, Hasher as _},
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    sync::Arc,
};

use crate::model::stacks::{Frame, FrameKind};

/// A file's identity: changes when the file at a path is replaced or rewritten.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct FileId {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_s: i64,
    mtime_ns: i64,
    /// Hash of the GNU build-id (0: none).
    build_id: u64,
}

impl FileId {
    /// Stands for the kernel in `Key::Function` (no file has inode 0).
    pub const KERNEL: FileId =
        FileId { dev: 0, ino: 0, size: 0, mtime_s: 0, mtime_ns: 0, build_id: 0 };

    /// The identity of the file `path` names now (as blazesym will open it); `None` when it
    /// cannot be stat'ed.
    pub fn of(path: &Path, build_id: Option<&str>) -> Option<Self> {
        let m = std::fs::metadata(path).ok()?;
        let build_id = build_id.map_or(0, |b| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            b.hash(&mut h);
            h.finish() | 1
        });
        Some(Self {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime_s: m.mtime(),
            mtime_ns: m.mtime_nsec(),
            build_id,
        })
    }

    pub fn size(&self) -> u64 {
        self.size
    }
}

/// What a cached name is for.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Key {
    /// A file offset in a file.
    File(FileId, u64),
    /// A kernel address (kallsyms).
    Kernel(u64),
    /// A function of a file, by its first file offset (see [`FrameCache::insert_function`]).
    Function(FileId, u64),
}

struct Entry {
    frames: Vec<CachedFrame>,
    /// `Key::Function`: the last offset known to get these frames (from the function's start
    /// on, every offset up to it does).
    verified_end: u64,
    /// Window (call) that last used it.
    used: u64,
    /// Estimated heap bytes, counted against the bound.
    bytes: usize,
}

/// A [`Frame`] as the cache holds it: its strings shared with every other entry that names
/// the same function, file or module. Addresses of one function repeat its name and file,
/// so per-address entries held each their own copies, about half of an entry's bytes.
struct CachedFrame {
    kind: FrameKind,
    function: Arc<str>,
    module: Arc<str>,
    file: Option<Arc<str>>,
    line: Option<u32>,
    column: Option<u32>,
    inlined: bool,
}

impl CachedFrame {
    fn to_frame(&self) -> Frame {
        Frame {
            kind: self.kind,
            function: self.function.to_string(),
            module: self.module.to_string(),
            file: self.file.as_deref().map(str::to_owned),
            line: self.line,
            column: self.column,
            inlined: self.inlined,
            elf: None,
        }
    }
}

/// The strings entries share, each held once.
#[derive(Default)]
struct Strings {
    set: HashSet<Arc<str>>,
    /// Estimated heap bytes of the set.
    bytes: usize,
}

impl Strings {
    fn intern(&mut self, s: &str) -> Arc<str> {
        if let Some(a) = self.set.get(s) {
            return Arc::clone(a);
        }
        let a: Arc<str> = Arc::from(s);
        self.bytes += string_bytes(s);
        self.set.insert(Arc::clone(&a));
        a
    }

    /// Releases the strings of an entry being dropped: each one no other entry uses leaves
    /// the set.
    fn release(&mut self, frames: Vec<CachedFrame>) {
        let mut held: Vec<Arc<str>> = Vec::with_capacity(frames.len() * 3);
        for f in frames {
            held.extend([f.function, f.module]);
            held.extend(f.file);
        }
        // Inlined frames of one entry often share a file: count each string once.
        held.sort_unstable_by_key(|a| Arc::as_ptr(a) as *const u8 as usize);
        held.dedup_by(|a, b| Arc::ptr_eq(a, b));
        for a in held {
            // Held by the set and by `a` only: no entry left.
            if Arc::strong_count(&a) == 2 && self.set.remove(&*a) {
                self.bytes -= string_bytes(&a);
            }
        }
    }
}

/// Heap bytes of one interned string: the `Arc`'s two counts, the text, the set's slot.
fn string_bytes(s: &str) -> usize {
    16 + s.len() + size_of::<Arc<str>>() + 8
}

/// What a [`FrameCache`] did over its life.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    /// Entries evicted to stay within the bound.
    pub evicted: u64,
}

/// Frames by [`Key`], least recently used evicted first once past `max_entries` or
/// `max_bytes` (then down to 7/8 of them, so eviction is not paid every call).
pub struct FrameCache {
    map: HashMap<Key, Entry>,
    /// The `Key::Function` entries' (file, start), ordered to find the one before an offset.
    functions: BTreeSet<(FileId, u64)>,
    strings: Strings,
    /// Estimated heap bytes of the entries (their strings are in `strings`).
    bytes: usize,
    max_entries: usize,
    max_bytes: usize,
    window: u64,
    pub stats: CacheStats,
}

impl FrameCache {
    pub fn new(max_entries: usize, max_bytes: usize) -> Self {
        Self {
            map: HashMap::new(),
            functions: BTreeSet::new(),
            strings: Strings::default(),
            bytes: 0,
            max_entries,
            max_bytes,
            window: 0,
            stats: CacheStats::default(),
        }
    }

    /// Starts a new call: what it uses counts as more recent than anything before.
    pub fn next_window(&mut self) -> u64 {
        self.window += 1;
        self.window
    }

    /// The frames of `key`: its own entry, else (a file offset or a kernel address) the
    /// function entry covering it.
    pub fn lookup(&mut self, key: &Key) -> Option<Vec<Frame>> {
        let function = match *key {
            Key::File(file, offset) => Some((file, offset)),
            Key::Kernel(addr) => Some((FileId::KERNEL, addr)),
            Key::Function(..) => None,
        };
        let found = match self.map.contains_key(key) {
            true => Some(*key),
            false => function.and_then(|(file, offset)| self.function_key(file, offset)),
        };
        let Some(e) = found.and_then(|k| self.map.get_mut(&k)) else {
            self.stats.misses += 1;
            return None;
        };
        e.used = self.window;
        self.stats.hits += 1;
        Some(e.frames.iter().map(CachedFrame::to_frame).collect())
    }

    /// The function entry covering `offset` of `file`: the function starting nearest below
    /// it, named at `offset` or at a later offset before.
    fn function_key(&self, file: FileId, offset: u64) -> Option<Key> {
        let &(f, start) = self.functions.range(..=(file, offset)).next_back()?;
        let key = Key::Function(file, start);
        let e = self.map.get(&key).filter(|_| f == file)?;
        (offset <= e.verified_end).then_some(key)
    }

    /// Remembers that `offset` of `file` (the kernel: `FileId::KERNEL`) is in the function
    /// starting at `start`, and so is every offset between. Callers know it: within one ELF
    /// symbol table blazesym names an address after the symbols with the largest start at or
    /// below it, so for a file named from its `.dynsym` alone (no `.symtab`, no DWARF, see
    /// `symbolize::dynsym_only`) no symbol starts in `start..=offset`; kallsyms gives a kernel
    /// symbol's whole span. An entry per function rather than per address: a busy program
    /// keeps landing on addresses not named before, which per address made the cache grow for
    /// hours. Another name at the same start is kept for its offset alone.
    pub fn insert_function(&mut self, file: FileId, offset: u64, start: u64, frames: &[Frame]) {
        let key = Key::Function(file, start);
        if let Some(e) = self.map.get_mut(&key) {
            let same = e.frames.len() == frames.len()
                && e.frames.iter().zip(frames).all(|(c, f)| *c.function == *f.function);
            if same {
                e.verified_end = e.verified_end.max(offset);
                e.used = self.window;
            } else {
                self.insert(Key::File(file, offset), frames);
            }
            return;
        }
        self.insert(key, frames);
        if let Some(e) = self.map.get_mut(&key) {
            e.verified_end = offset;
        }
        self.functions.insert((file, start));
    }

    pub fn insert(&mut self, key: Key, frames: &[Frame]) {
        let frames: Vec<CachedFrame> = frames
            .iter()
            .map(|f| CachedFrame {
                kind: f.kind,
                function: self.strings.intern(&f.function),
                module: self.strings.intern(&f.module),
                file: f.file.as_deref().map(|p| self.strings.intern(p)),
                line: f.line,
                column: f.column,
                inlined: f.inlined,
            })
            .collect();
        let bytes = entry_bytes(&key, &frames);
        self.bytes += bytes;
        let entry = Entry { frames, verified_end: 0, used: self.window, bytes };
        if let Some(old) = self.map.insert(key, entry) {
            self.bytes -= old.bytes;
            self.strings.release(old.frames);
        }
    }

    /// Evicts the least recently used entries if past the bound; returns how many.
    pub fn trim(&mut self) -> usize {
        if self.map.len() <= self.max_entries && self.bytes() <= self.max_bytes {
            return 0;
        }
        let (entries, bytes) =
            (self.max_entries - self.max_entries / 8, self.max_bytes - self.max_bytes / 8);
        let mut by_age: Vec<(u64, Key)> = self.map.iter().map(|(k, e)| (e.used, *k)).collect();
        by_age.sort_unstable_by_key(|(used, _)| *used);
        let mut n = 0;
        for (_, k) in by_age {
            if self.map.len() <= entries && self.bytes() <= bytes {
                break;
            }
            if let Some(e) = self.map.remove(&k) {
                self.bytes -= e.bytes;
                self.strings.release(e.frames);
                if let Key::Function(file, start) = k {
                    self.functions.remove(&(file, start));
                }
                n += 1;
            }
        }
        self.stats.evicted += n as u64;
        n
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Estimated heap bytes held: entries and the strings they share.
    pub fn bytes(&self) -> usize {
        self.bytes + self.strings.bytes
    }
}

/// Heap bytes of one entry but its shared strings: its frames, the map's slot, and a function
/// entry's place in the ordered set.
fn entry_bytes(key: &Key, frames: &[CachedFrame]) -> usize {
    let ordered = match key {
        Key::Function(..) => size_of::<(FileId, u64)>(),
        _ => 0,
    };
    size_of::<Key>() + size_of::<Entry>() + 8 + size_of_val(frames) + ordered
}

/// The files a blazesym `Symbolizer` holds parsed (by the path it was given), so they can be
/// evicted from it: when their module was released, when the file at the path changed, and
/// least recently used beyond `max_files` files or `max_bytes` of file size.
pub struct HeldFiles {
    files: HashMap<PathBuf, Held>,
    max_files: usize,
    max_bytes: u64,
    bytes: u64,
    /// Files evicted so far.
    pub evicted: u64,
}

struct Held {
    id: FileId,
    used: u64,
}

impl HeldFiles {
    pub fn new(max_files: usize, max_bytes: u64) -> Self {
        Self { files: HashMap::new(), max_files, max_bytes, bytes: 0, evicted: 0 }
    }

    /// Notes that the symbolizer is about to read `path` as file `id` in `window`. True when
    /// it holds another file at that path, which must be evicted first (blazesym would keep
    /// both).
    pub fn use_file(&mut self, path: &Path, id: FileId, window: u64) -> bool {
        match self.files.get_mut(path) {
            Some(h) if h.id == id => {
                h.used = window;
                false
            }
            Some(h) => {
                self.bytes = self.bytes - h.id.size() + id.size();
                *h = Held { id, used: window };
                self.evicted += 1;
                true
            }
            None => {
                self.bytes += id.size();
                self.files.insert(path.to_owned(), Held { id, used: window });
                false
            }
        }
    }

    /// Removes and returns the paths to evict from the symbolizer: those no module in `live`
    /// reads any more, then the least recently used beyond the bound.
    pub fn take_evictions(&mut self, live: &HashSet<&Path>) -> Vec<PathBuf> {
        let mut out: Vec<PathBuf> =
            self.files.keys().filter(|p| !live.contains(p.as_path())).cloned().collect();
        for p in &out {
            self.remove(p);
        }
        if self.files.len() > self.max_files || self.bytes > self.max_bytes {
            let mut by_age: Vec<(u64, PathBuf)> =
                self.files.iter().map(|(p, h)| (h.used, p.clone())).collect();
            by_age.sort_unstable_by_key(|(used, _)| *used);
            for (_, p) in by_age {
                if self.files.len() <= self.max_files && self.bytes <= self.max_bytes {
                    break;
                }
                self.remove(&p);
                out.push(p);
            }
        }
        self.evicted += out.len() as u64;
        out
    }

    /// Stops tracking `path` without counting an eviction: blazesym does not hold it.
    pub fn forget(&mut self, path: &Path) {
        self.remove(path);
    }

    fn remove(&mut self, path: &Path) {
        if let Some(h) = self.files.remove(path) {
            self.bytes -= h.id.size();
        }
    }

    /// After the symbolizer was rebuilt: it holds nothing.
    pub fn clear(&mut self) {
        self.files.clear();
        self.bytes = 0;
    }

    pub fn len(&self) -> usize {
        self.files.len()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::stacks::FrameKind;

    fn frame(name: &str) -> Vec<Frame> {
        vec![Frame {
            kind: FrameKind::User,
            function: name.into(),
            module: "lib.so".into(),
            file: None,
            line: None,
            column: None,
            inlined: false,
            elf: None,
        }]
    }

    /// A directory of this test's own, removed at the end.
    pub(crate) struct TempDir(PathBuf);

    impl TempDir {
        pub(crate) fn new(test: &str) -> Self {
            let p = std::env::temp_dir().join(format!("rsprof-{test}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            Self(p)
        }

        pub(crate) fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn temp_file(dir: &Path, name: &str, body: &[u8]) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, body).unwrap();
        p
    }

    #[test]
    fn frame_cache_stays_within_its_entry_bound_evicting_least_recently_used() {
        let dir = TempDir::new("symcache-entries");
        let id = FileId::of(&temp_file(dir.path(), "a", b"x"), None).unwrap();
        let mut c = FrameCache::new(100, usize::MAX);
        for w in 0..50u64 {
            c.next_window();
            // Offset 0 is used every window: it must never be the one evicted.
            if c.lookup(&Key::File(id, 0)).is_none() {
                assert_eq!(w, 0, "the hot entry was evicted in window {w}");
                c.insert(Key::File(id, 0), &frame("hot"));
            }
            for i in 0..20 {
                let k = Key::File(id, 1 + w * 20 + i);
                assert!(c.lookup(&k).is_none());
                c.insert(k, &frame("cold"));
            }
            c.trim();
            assert!(c.len() <= 100, "{} entries after window {w}", c.len());
        }
        assert_eq!(c.lookup(&Key::File(id, 0)).unwrap()[0].function, "hot");
        // Every entry made is held or was counted evicted.
        assert_eq!(c.stats.evicted + c.len() as u64, 1 + 50 * 20);
        assert_eq!(c.stats.hits, 49 + 1);
        assert!(c.stats.evicted > 0);
    }

    #[test]
    fn frame_cache_stays_within_its_byte_bound() {
        let dir = TempDir::new("symcache-bytes");
        let id = FileId::of(&temp_file(dir.path(), "a", b"x"), None).unwrap();
        let long = "f".repeat(1000);
        let mut c = FrameCache::new(usize::MAX, 64 * 1024);
        for i in 0..1000 {
            c.next_window();
            // Each name its own: all bytes are the strings'.
            c.insert(Key::File(id, i), &frame(&format!("{long}{i}")));
            c.trim();
            assert!(c.bytes() <= 64 * 1024, "{} bytes", c.bytes());
        }
        assert!(c.len() >= 40, "only {} entries of ~1 KiB held in 64 KiB", c.len());
        assert_eq!(c.stats.evicted + c.len() as u64, 1000);
    }

    #[test]
    fn frame_cache_holds_a_shared_name_once_and_frees_it_with_its_last_entry() {
        let dir = TempDir::new("symcache-shared");
        let id = FileId::of(&temp_file(dir.path(), "a", b"x"), None).unwrap();
        let long = "g".repeat(4000);
        let mut c = FrameCache::new(usize::MAX, usize::MAX);
        c.next_window();
        for i in 0..100 {
            c.insert(Key::File(id, i), &frame(&long));
        }
        // 100 addresses of one function: its 4000-byte name is held once.
        assert!(c.bytes() < 2 * 4000 + 100 * 200, "{} bytes", c.bytes());
        assert_eq!(c.lookup(&Key::File(id, 7)).unwrap(), frame(&long));
        // Evicting every entry (a bound of 0 entries) frees the name too.
        let mut c2 = FrameCache::new(0, usize::MAX);
        c2.next_window();
        c2.insert(Key::File(id, 0), &frame(&long));
        c2.trim();
        assert_eq!((c2.len(), c2.bytes()), (0, 0));
    }

    #[test]
    fn function_entries_name_the_offsets_known_to_be_theirs() {
        let dir = TempDir::new("symcache-functions");
        let id = FileId::of(&temp_file(dir.path(), "a", b"x"), None).unwrap();
        let other = FileId::of(&temp_file(dir.path(), "b", b"y"), None).unwrap();
        let mut c = FrameCache::new(usize::MAX, usize::MAX);
        c.next_window();
        // `outer` named at 0x110: 0x100..=0x110 are its.
        c.insert_function(id, 0x110, 0x100, &frame("outer"));
        let name =
            |c: &mut FrameCache, f, o| c.lookup(&Key::File(f, o)).map(|v| v[0].function.clone());
        assert_eq!(name(&mut c, id, 0x100).as_deref(), Some("outer"));
        assert_eq!(name(&mut c, id, 0x110).as_deref(), Some("outer"));
        // Past the last offset named, before the start, another file: asked again.
        assert_eq!(name(&mut c, id, 0x111), None);
        assert_eq!(name(&mut c, id, 0xff), None);
        assert_eq!(name(&mut c, other, 0x105), None);
        // Named later further in: the range grows; one entry still.
        c.insert_function(id, 0x180, 0x100, &frame("outer"));
        assert_eq!(name(&mut c, id, 0x150).as_deref(), Some("outer"));
        assert_eq!(c.len(), 1);
        // A symbol starting inside (blazesym names 0x125 after it): from its start on, only
        // what it was named at is its, and nothing past it is taken for `outer`'s.
        c.insert_function(id, 0x125, 0x120, &frame("inner"));
        assert_eq!(name(&mut c, id, 0x122).as_deref(), Some("inner"));
        assert_eq!(name(&mut c, id, 0x130), None);
        assert_eq!(name(&mut c, id, 0x11f).as_deref(), Some("outer"));
        // Another name at the same start is held for its offset alone.
        c.insert_function(id, 0x108, 0x100, &frame("alias"));
        assert_eq!(name(&mut c, id, 0x108).as_deref(), Some("alias"));
        assert_eq!(name(&mut c, id, 0x107).as_deref(), Some("outer"));
        // A kernel symbol: its whole span is known at once.
        c.insert_function(
            FileId::KERNEL,
            0xffff_0000_0000_01ff,
            0xffff_0000_0000_0100,
            &frame("k"),
        );
        assert_eq!(name(&mut c, FileId::KERNEL, 0xffff_0000_0000_0150).as_deref(), Some("k"));
        assert_eq!(name(&mut c, FileId::KERNEL, 0xffff_0000_0000_0200), None);
        assert_eq!(name(&mut c, id, 0x105).as_deref(), Some("outer"));
        // Evicted, a function entry names nothing any more.
        let mut small = FrameCache::new(0, usize::MAX);
        small.next_window();
        small.insert_function(id, 0x10, 0x0, &frame("f"));
        small.trim();
        assert_eq!((small.len(), small.lookup(&Key::File(id, 0x8))), (0, None));
    }

    #[test]
    fn a_file_replaced_at_the_same_path_is_another_file() {
        let dir = TempDir::new("symcache-replaced");
        let p = temp_file(dir.path(), "lib.so", b"first");
        let first = FileId::of(&p, None).unwrap();
        // Same size, written in place: the mtime (and, if the clock is coarse, the build-id)
        // must tell them apart; replaced by rename: the inode does.
        let tmp = temp_file(dir.path(), "new", b"other");
        std::fs::rename(&tmp, &p).unwrap();
        let second = FileId::of(&p, None).unwrap();
        assert_ne!(first, second);
        assert_ne!(FileId::of(&p, Some("aa")), FileId::of(&p, Some("bb")));
        let mut c = FrameCache::new(10, usize::MAX);
        c.next_window();
        c.insert(Key::File(first, 0x10), &frame("old"));
        assert!(c.lookup(&Key::File(second, 0x10)).is_none());
    }

    #[test]
    fn held_files_evicts_released_replaced_and_least_recently_used() {
        let dir = TempDir::new("symcache-held");
        let paths: Vec<PathBuf> =
            (0..5).map(|i| temp_file(dir.path(), &format!("f{i}"), b"12345678")).collect();
        let ids: Vec<FileId> = paths.iter().map(|p| FileId::of(p, None).unwrap()).collect();
        let mut h = HeldFiles::new(3, u64::MAX);
        let all: HashSet<&Path> = paths.iter().map(PathBuf::as_path).collect();
        for (w, (p, id)) in paths.iter().zip(&ids).enumerate() {
            assert!(!h.use_file(p, *id, w as u64));
        }
        // Five held, three allowed: the two used first go.
        let gone = h.take_evictions(&all);
        assert_eq!(gone, vec![paths[0].clone(), paths[1].clone()]);
        assert_eq!(h.len(), 3);
        // A module released: its file goes though within the bound.
        let live: HashSet<&Path> = paths[3..].iter().map(PathBuf::as_path).collect();
        assert_eq!(h.take_evictions(&live), vec![paths[2].clone()]);
        // Another file at a held path must be evicted before use.
        assert!(h.use_file(&paths[3], ids[0], 10));
        assert_eq!(h.evicted, 4);
    }
}
