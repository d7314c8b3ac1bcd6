//! Decoding of ring-buffer records (layouts in `profiler-common`) into typed events.
//! Records are read by field offset from a byte slice, so a short or malformed record is an
//! error, never an out-of-bounds read.

use profiler_common::{
    EVENT_EXEC, EVENT_EXIT, EVENT_FORK, EVENT_LABEL_DEPTH, EVENT_MMAP, EVENT_MUNMAP, EVENT_OFF_CPU,
    EVENT_OFF_CPU_COPY, EVENT_SAMPLE, EVENT_USDT, EventHeader, LABEL_DEPTH_RECORD_FIXED,
    LABEL_MAX_DEPTH, LabelDepthHeader, MAP_ANON, MAP_EXE_TEXT, MAP_INTERP, MAP_PATH_COMPLETE,
    MAP_RECORD_FIXED, MAX_STACK_DEPTH, MapRecord, OFF_CPU_COPY_RECORD_FIXED, OFF_CPU_RECORD_FIXED,
    OffCpuCopyHeader, OffCpuHeader, SAMPLE_RECORD_FIXED, SAMPLE_STACK_COPY, STACK_COPY_HEADER_SIZE,
    STACK_COPY_MAX, SampleHeader, StackCopyHeader, TASK_RECORD_FIXED, TaskRecord, USDT_MAX_ARGS,
    USDT_MAX_STRS, USDT_RECORD_FIXED, USDT_STR_MAX, UsdtRecord, UsdtString,
};

use crate::model::{
    OffCpu,
    ids::{Pid, ThreadKey, Tid},
    time::MonoNs,
};

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sample {
    pub time: MonoNs,
    pub cpu: u32,
    pub pid: Pid,
    pub tid: Tid,
    pub cgroup_id: u64,
    pub cpu_time_ns: u64,
    pub comm: String,
    pub flags: u32,
    /// Leaf first.
    pub kernel_stack: Vec<u64>,
    /// Leaf first.
    pub user_stack: Vec<u64>,
    /// The thread's `rsprof:label_push` stack, outermost first.
    pub labels: Vec<LabelRef>,
    /// CPython frames the kernel read (code object address, `PY_FRAME_*` word), innermost
    /// first; how that walk went is in `flags` (`SAMPLE_PY_*`).
    pub python: Vec<(u64, u64)>,
    /// Set for off-CPU time (an `EVENT_OFF_CPU` record; `cpu_time_ns` is then 0, `time` is
    /// when the block began and the stacks are where the thread blocked).
    pub off_cpu: Option<OffCpu>,
    /// Off-CPU: when the block whose stacks these are began (the key of its
    /// [`OffCpuCopyEvent`], if one was sent).
    pub stack_ns: MonoNs,
    /// Where the kernel's table walk stopped for want of a table, with a copy of the user
    /// stack from there (`SAMPLE_STACK_COPY`, or an `EVENT_OFF_CPU_COPY` joined to it), for
    /// userspace to continue the walk.
    pub stack_copy: Option<Box<StackCopy>>,
}

/// A sample's copy of its user stack: the stopped frame's registers (that frame is the last
/// of `user_stack`) and `bytes` of user memory from `sp` up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StackCopy {
    pub pc: u64,
    pub sp: u64,
    pub bp: u64,
    /// `STACK_COPY_*`.
    pub flags: u32,
    pub bytes: Vec<u8>,
}

impl Sample {
    /// How the walk of its user stack ended.
    pub fn user_stack_end(&self) -> crate::model::address::UserStackEnd {
        crate::model::address::UserStackEnd::from_flags(self.flags)
    }

    /// The kernel runs each CPU's idle task as pid 0.
    pub fn thread(&self) -> ThreadKey {
        if self.pid.0 == 0 {
            ThreadKey::Idle { cpu: self.cpu }
        } else {
            ThreadKey::Task { pid: self.pid, tid: self.tid }
        }
    }
}

/// One entry of a sampled label stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LabelRef {
    /// User address of the label string: the label's id within its process.
    pub addr: u64,
    /// User frames at the push (the pusher and its callers); 0 until the push's
    /// [`LabelDepthEvent`] fills it in, `LABEL_DEPTH_UNKNOWN` if it never will.
    pub depth: u32,
}

/// A USDT hit as sent by the kernel; `usdt::ProbeRegistry::resolve` types its arguments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawUsdtHit {
    pub time_ns: u64,
    pub cpu: u32,
    pub pid: Pid,
    pub tid: Tid,
    pub probe_id: u32,
    pub spec_id: u32,
    /// Bit i: argument i could not be read.
    pub arg_errors: u32,
    pub args: Vec<u64>,
    pub strs: Vec<RawUsdtStr>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawUsdtStr {
    /// `USDT_STR_IS_*`.
    pub flags: u16,
    pub bytes: Vec<u8>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TaskKind {
    /// A new task; `parent` is the forking task, `mm` the new task's address space;
    /// `walker_copied`: the kernel gave a new process its parent's walker entry.
    Fork {
        parent_pid: Pid,
        parent_tid: Tid,
        mm: u64,
        walker_copied: bool,
    },
    /// `mm`: the new image's address space; `vdso`: where its vDSO is (0: unknown).
    Exec {
        argv: Vec<String>,
        truncated: bool,
        mm: u64,
        vdso: u64,
    },
    Exit,
}

/// An executable mapping made or removed, as the kernel saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapEvent {
    pub time: MonoNs,
    pub pid: Pid,
    pub tid: Tid,
    /// The address space changed (`mm_struct` pointer): tells images of one pid apart.
    pub mm: u64,
    pub start: u64,
    pub end: u64,
    pub kind: MapKind,
    /// Its number among the process's early walker mappings, 0 if the kernel added none
    /// (`MapRecord::early_seq`).
    pub early_seq: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MapKind {
    /// A file mapping; `dev` is encoded like /proc/PID/maps's (major << 32 | minor).
    File { offset: u64, dev: u64, inode: u64, path: MappedPath },
    /// At exec: the executable's code, `start` being its lowest executable segment's address
    /// (file offsets come from the file's program headers).
    ExeText { dev: u64, inode: u64, path: MappedPath },
    /// At exec: the ELF interpreter was loaded at base `start`; its file as the kernel maps it
    /// (dev, inode, path), unless that could not be looked up.
    Interp { file: Option<(u64, u64, MappedPath)> },
    /// Anonymous executable memory (JIT code).
    Anon,
    /// The range is no longer executable code.
    Unmap,
}

/// The kernel's walk of the mapped file's path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MappedPath {
    /// Absolute when `complete`; otherwise the trailing components that were read.
    pub path: String,
    pub complete: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskEvent {
    pub time: MonoNs,
    pub pid: Pid,
    pub tid: Tid,
    pub comm: Comm,
    pub kind: TaskKind,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelEvent {
    Sample(Sample),
    Task(TaskEvent),
    Usdt(RawUsdtHit),
    Map(MapEvent),
    LabelDepth(LabelDepthEvent),
    OffCpuCopy(OffCpuCopyEvent),
}

/// A thread blocked at `time` where the kernel could not walk its user stack to the end
/// (`EVENT_OFF_CPU_COPY`): the walk continues over `copy` (from the last of the `frames` the
/// kernel walked) when the off-CPU record whose `stack_ns` is `time` arrives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffCpuCopyEvent {
    pub time: MonoNs,
    pub pid: Pid,
    pub tid: Tid,
    pub frames: u32,
    pub copy: StackCopy,
}

/// A label pushed where the kernel's table walk could not finish (`EVENT_LABEL_DEPTH`): the
/// thread's label entry `index` (address `label`) has depth 0 until the walk over `copy`
/// (from the last of the `frames` the kernel walked) says how deep its pusher was.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LabelDepthEvent {
    pub pid: Pid,
    pub tid: Tid,
    pub label: u64,
    pub index: u32,
    pub frames: u32,
    pub copy: StackCopy,
}

#[derive(Debug, PartialEq, Eq)]
pub enum RecordError {
    Short { kind: u32, len: usize },
    UnknownKind(u32),
}

impl std::fmt::Display for RecordError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecordError::Short { kind, len } => {
                write!(f, "record kind {kind} too short ({len} bytes)")
            }
            RecordError::UnknownKind(k) => write!(f, "unknown record kind {k}"),
        }
    }
}

/// The [`StackCopyHeader`] at `at` and the bytes after it; None if the record is too short.
fn stack_copy_at(b: &[u8], at: usize) -> Option<StackCopy> {
    if b.len() < at + STACK_COPY_HEADER_SIZE {
        return None;
    }
    let len = u32_at(b, at + std::mem::offset_of!(StackCopyHeader, len)) as usize;
    let data = at + STACK_COPY_HEADER_SIZE;
    if len > STACK_COPY_MAX || b.len() < data + len {
        return None;
    }
    Some(StackCopy {
        pc: u64_at(b, at + std::mem::offset_of!(StackCopyHeader, pc)),
        sp: u64_at(b, at + std::mem::offset_of!(StackCopyHeader, sp)),
        bp: u64_at(b, at + std::mem::offset_of!(StackCopyHeader, bp)),
        flags: u32_at(b, at + std::mem::offset_of!(StackCopyHeader, flags)),
        bytes: b[data..data + len].to_vec(),
    })
}

fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_ne_bytes(b[off..off + 2].try_into().unwrap())
}
fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_ne_bytes(b[off..off + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], off: usize) -> u64 {
    u64::from_ne_bytes(b[off..off + 8].try_into().unwrap())
}

/// A task's `comm` (at most 15 bytes), held inline when it is UTF-8: an exec storm sends
/// thousands of task records a second, and a `String` each was an allocation and a free.
#[derive(Clone, PartialEq, Eq)]
pub struct Comm(CommRepr);

#[derive(Clone, PartialEq, Eq)]
enum CommRepr {
    /// UTF-8, checked in `Comm::new`.
    Inline { len: u8, bytes: [u8; 16] },
    /// Not UTF-8: its bytes replaced, which may not fit.
    Lossy(String),
}

impl Comm {
    /// From the kernel's NUL-terminated bytes.
    pub fn new(raw: &[u8]) -> Self {
        let raw = until_nul(raw);
        Comm(match std::str::from_utf8(raw) {
            Ok(_) if raw.len() <= 16 => {
                let mut bytes = [0; 16];
                bytes[..raw.len()].copy_from_slice(raw);
                CommRepr::Inline { len: raw.len() as u8, bytes }
            }
            _ => CommRepr::Lossy(String::from_utf8_lossy(raw).into_owned()),
        })
    }

    pub fn as_str(&self) -> &str {
        match &self.0 {
            // SAFETY: `new`, the only constructor, checked these bytes are UTF-8.
            CommRepr::Inline { len, bytes } => unsafe {
                std::str::from_utf8_unchecked(&bytes[..usize::from(*len)])
            },
            CommRepr::Lossy(s) => s,
        }
    }
}

impl std::ops::Deref for Comm {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl From<&str> for Comm {
    fn from(s: &str) -> Self {
        Comm::new(s.as_bytes())
    }
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.as_str().fmt(f)
    }
}

/// A kernel string's bytes before its NUL (all of them if it has none).
fn until_nul(raw: &[u8]) -> &[u8] {
    raw.iter().position(|&c| c == 0).map_or(raw, |end| &raw[..end])
}

/// A kernel `comm` (NUL-terminated, not necessarily UTF-8) into an existing string, reusing
/// its buffer.
fn set_comm(s: &mut String, raw: &[u8]) {
    let raw = until_nul(raw);
    // Consecutive samples are mostly of the same thread.
    if s.as_bytes() != raw {
        s.clear();
        match std::str::from_utf8(raw) {
            Ok(name) => s.push_str(name),
            Err(_) => s.push_str(&String::from_utf8_lossy(raw)),
        }
    }
}

const HDR: usize = size_of::<EventHeader>();

fn header(b: &[u8]) -> (u32, u32, u64, u32, u32) {
    (u32_at(b, 0), u32_at(b, 4), u64_at(b, 8), u32_at(b, 16), u32_at(b, 20))
}

/// Decodes a sample or off-CPU record into `s`, reusing its buffers: one such record
/// arrives per sample, and a fresh [`Sample`] would allocate its stacks and name each time.
/// Ok(false) for any other record (see [`decode`]), leaving `s` as it was.
pub fn decode_sample_into(b: &[u8], s: &mut Sample) -> Result<bool, RecordError> {
    if b.len() < HDR {
        return Err(RecordError::Short { kind: 0, len: b.len() });
    }
    let (kind, cpu, time_ns, pid, tid) = header(b);
    let short = RecordError::Short { kind, len: b.len() };
    // Checked before anything is written to `s`, so a bad record leaves no half sample.
    let (fixed, kn, un, ln, pn, o_comm) = match kind {
        EVENT_SAMPLE => {
            if b.len() < SAMPLE_RECORD_FIXED {
                return Err(short);
            }
            let kn = u16_at(b, std::mem::offset_of!(SampleHeader, kernel_frames)) as usize;
            let un = u16_at(b, std::mem::offset_of!(SampleHeader, user_frames)) as usize;
            let ln = u32_at(b, std::mem::offset_of!(SampleHeader, label_count)) as usize;
            let pn = u32_at(b, std::mem::offset_of!(SampleHeader, py_frames)) as usize;
            if ln > LABEL_MAX_DEPTH
                || pn > profiler_common::PY_MAX_FRAMES
                || b.len() < SAMPLE_RECORD_FIXED + (kn + un + ln + 2 * pn) * 8
            {
                return Err(short);
            }
            (SAMPLE_RECORD_FIXED, kn, un, ln, pn, std::mem::offset_of!(SampleHeader, comm))
        }
        EVENT_OFF_CPU => {
            if b.len() < OFF_CPU_RECORD_FIXED {
                return Err(short);
            }
            let kn = u16_at(b, std::mem::offset_of!(OffCpuHeader, kernel_frames)) as usize;
            let un = u16_at(b, std::mem::offset_of!(OffCpuHeader, user_frames)) as usize;
            let pn = u32_at(b, std::mem::offset_of!(OffCpuHeader, py_frames)) as usize;
            if kn > MAX_STACK_DEPTH
                || un > MAX_STACK_DEPTH
                || pn > profiler_common::PY_MAX_FRAMES
                || b.len() < OFF_CPU_RECORD_FIXED + (kn + un + 2 * pn) * 8
            {
                return Err(short);
            }
            (OFF_CPU_RECORD_FIXED, kn, un, 0, pn, std::mem::offset_of!(OffCpuHeader, comm))
        }
        _ => return Ok(false),
    };
    let frame = |i: usize| u64_at(b, fixed + i * 8);
    let mut stack_copy = None;
    let mut stack_ns = 0;
    let (cgroup_id, cpu_time_ns, flags, off_cpu) = if kind == EVENT_SAMPLE {
        let flags = u32_at(b, std::mem::offset_of!(SampleHeader, flags));
        if flags & SAMPLE_STACK_COPY != 0 {
            let at = SAMPLE_RECORD_FIXED + (kn + un + ln + 2 * pn) * 8;
            stack_copy = Some(Box::new(stack_copy_at(b, at).ok_or(short)?));
        }
        let cgroup_id = u64_at(b, std::mem::offset_of!(SampleHeader, cgroup_id));
        (cgroup_id, u64_at(b, std::mem::offset_of!(SampleHeader, cpu_time_ns)), flags, None)
    } else {
        let off_cpu = OffCpu {
            weight_ns: u64_at(b, std::mem::offset_of!(OffCpuHeader, weight_ns)),
            block_ns: u64_at(b, std::mem::offset_of!(OffCpuHeader, block_ns)),
            blocks: u32_at(b, std::mem::offset_of!(OffCpuHeader, blocks)),
            state: u32_at(b, std::mem::offset_of!(OffCpuHeader, state)),
        };
        let cgroup_id = u64_at(b, std::mem::offset_of!(OffCpuHeader, cgroup_id));
        stack_ns = u64_at(b, std::mem::offset_of!(OffCpuHeader, stack_ns));
        (cgroup_id, 0, u32_at(b, std::mem::offset_of!(OffCpuHeader, flags)), Some(off_cpu))
    };
    s.time = MonoNs(time_ns);
    s.cpu = cpu;
    s.pid = Pid(pid);
    s.tid = Tid(tid);
    s.cgroup_id = cgroup_id;
    s.cpu_time_ns = cpu_time_ns;
    set_comm(&mut s.comm, &b[o_comm..o_comm + 16]);
    s.flags = flags;
    s.kernel_stack.clear();
    s.kernel_stack.extend((0..kn).map(frame));
    s.user_stack.clear();
    s.user_stack.extend((kn..kn + un).map(frame));
    s.labels.clear();
    s.labels.extend((kn + un..kn + un + ln).map(|i| {
        let (addr, depth) = profiler_common::split_label_entry(frame(i));
        LabelRef { addr, depth }
    }));
    let py = kn + un + ln;
    s.python.clear();
    s.python.extend((0..pn).map(|i| (frame(py + 2 * i), frame(py + 2 * i + 1))));
    s.off_cpu = off_cpu;
    s.stack_ns = MonoNs(stack_ns);
    s.stack_copy = stack_copy;
    Ok(true)
}

pub fn decode(b: &[u8]) -> Result<KernelEvent, RecordError> {
    if b.len() < HDR {
        return Err(RecordError::Short { kind: 0, len: b.len() });
    }
    let (kind, cpu, time_ns, pid, tid) = header(b);
    let short = RecordError::Short { kind, len: b.len() };
    match kind {
        EVENT_SAMPLE | EVENT_OFF_CPU => {
            let mut s = Sample::default();
            decode_sample_into(b, &mut s)?;
            Ok(KernelEvent::Sample(s))
        }
        EVENT_LABEL_DEPTH => {
            let copy = stack_copy_at(b, LABEL_DEPTH_RECORD_FIXED).ok_or(short)?;
            Ok(KernelEvent::LabelDepth(LabelDepthEvent {
                pid: Pid(pid),
                tid: Tid(tid),
                label: u64_at(b, std::mem::offset_of!(LabelDepthHeader, label)),
                index: u32_at(b, std::mem::offset_of!(LabelDepthHeader, index)),
                frames: u32_at(b, std::mem::offset_of!(LabelDepthHeader, frames)),
                copy,
            }))
        }
        EVENT_OFF_CPU_COPY => {
            let copy = stack_copy_at(b, OFF_CPU_COPY_RECORD_FIXED).ok_or(short)?;
            Ok(KernelEvent::OffCpuCopy(OffCpuCopyEvent {
                time: MonoNs(time_ns),
                pid: Pid(pid),
                tid: Tid(tid),
                frames: u32_at(b, std::mem::offset_of!(OffCpuCopyHeader, frames)),
                copy,
            }))
        }
        EVENT_FORK | EVENT_EXEC | EVENT_EXIT => {
            if b.len() < TASK_RECORD_FIXED {
                return Err(short);
            }
            let o_comm = std::mem::offset_of!(TaskRecord, comm);
            let comm = Comm::new(&b[o_comm..o_comm + 16]);
            let mm = u64_at(b, std::mem::offset_of!(TaskRecord, mm));
            let kind = match kind {
                EVENT_FORK => TaskKind::Fork {
                    parent_pid: Pid(u32_at(b, std::mem::offset_of!(TaskRecord, parent_pid))),
                    parent_tid: Tid(u32_at(b, std::mem::offset_of!(TaskRecord, parent_tid))),
                    mm,
                    walker_copied: u32_at(b, std::mem::offset_of!(TaskRecord, flags))
                        & profiler_common::TASK_WALKER_COPIED
                        != 0,
                },
                EVENT_EXEC => {
                    let n = u32_at(b, std::mem::offset_of!(TaskRecord, cmdline_len)) as usize;
                    let truncated =
                        u32_at(b, std::mem::offset_of!(TaskRecord, cmdline_truncated)) != 0;
                    let raw = b.get(TASK_RECORD_FIXED..TASK_RECORD_FIXED + n).ok_or(short)?;
                    let argv = raw
                        .split(|&c| c == 0)
                        .filter(|a| !a.is_empty())
                        .map(|a| String::from_utf8_lossy(a).into_owned())
                        .collect();
                    let vdso = u64_at(b, std::mem::offset_of!(TaskRecord, vdso));
                    TaskKind::Exec { argv, truncated, mm, vdso }
                }
                _ => TaskKind::Exit,
            };
            Ok(KernelEvent::Task(TaskEvent {
                time: MonoNs(time_ns),
                pid: Pid(pid),
                tid: Tid(tid),
                comm,
                kind,
            }))
        }
        EVENT_USDT => {
            if b.len() < USDT_RECORD_FIXED {
                return Err(short);
            }
            let nargs = u16_at(b, std::mem::offset_of!(UsdtRecord, arg_count)) as usize;
            let nstr = u16_at(b, std::mem::offset_of!(UsdtRecord, str_count)) as usize;
            let str_size = size_of::<UsdtString>();
            if nargs > USDT_MAX_ARGS
                || nstr > USDT_MAX_STRS
                || b.len() < USDT_RECORD_FIXED + nstr * str_size
            {
                return Err(short);
            }
            let o_args = std::mem::offset_of!(UsdtRecord, args);
            let mut strs = Vec::with_capacity(nstr);
            for i in 0..nstr {
                let o = USDT_RECORD_FIXED + i * str_size;
                let len = (u16_at(b, o + std::mem::offset_of!(UsdtString, len)) as usize)
                    .min(USDT_STR_MAX - 1);
                let flags = u16_at(b, o + std::mem::offset_of!(UsdtString, flags));
                let ob = o + std::mem::offset_of!(UsdtString, bytes);
                strs.push(RawUsdtStr { flags, bytes: b[ob..ob + len].to_vec() });
            }
            Ok(KernelEvent::Usdt(RawUsdtHit {
                time_ns,
                cpu,
                pid: Pid(pid),
                tid: Tid(tid),
                probe_id: u32_at(b, std::mem::offset_of!(UsdtRecord, probe_id)),
                spec_id: u32_at(b, std::mem::offset_of!(UsdtRecord, spec_id)),
                arg_errors: u32_at(b, std::mem::offset_of!(UsdtRecord, arg_errors)),
                args: (0..nargs).map(|i| u64_at(b, o_args + i * 8)).collect(),
                strs,
            }))
        }
        EVENT_MMAP | EVENT_MUNMAP => {
            if b.len() < MAP_RECORD_FIXED {
                return Err(short);
            }
            let field = |off: usize| u64_at(b, off);
            let start = field(std::mem::offset_of!(MapRecord, start));
            let end = start.saturating_add(field(std::mem::offset_of!(MapRecord, len)));
            let flags = u32_at(b, std::mem::offset_of!(MapRecord, flags));
            let kind = if kind == EVENT_MUNMAP {
                MapKind::Unmap
            } else if flags & MAP_ANON != 0 {
                MapKind::Anon
            } else {
                let n = u32_at(b, std::mem::offset_of!(MapRecord, path_len)) as usize;
                let raw = b.get(MAP_RECORD_FIXED..MAP_RECORD_FIXED + n).ok_or(short)?;
                let dev = u32_at(b, std::mem::offset_of!(MapRecord, dev));
                let dev = u64::from(dev >> 20) << 32 | u64::from(dev & 0xf_ffff);
                let inode = field(std::mem::offset_of!(MapRecord, inode));
                let path = mapped_path(raw, flags & MAP_PATH_COMPLETE != 0);
                if flags & MAP_INTERP != 0 {
                    MapKind::Interp { file: (inode != 0).then_some((dev, inode, path)) }
                } else if flags & MAP_EXE_TEXT != 0 {
                    MapKind::ExeText { dev, inode, path }
                } else {
                    let offset = field(std::mem::offset_of!(MapRecord, offset));
                    MapKind::File { offset, dev, inode, path }
                }
            };
            Ok(KernelEvent::Map(MapEvent {
                time: MonoNs(time_ns),
                pid: Pid(pid),
                tid: Tid(tid),
                mm: field(std::mem::offset_of!(MapRecord, mm)),
                start,
                end,
                kind,
                early_seq: u32_at(b, std::mem::offset_of!(MapRecord, early_seq)),
            }))
        }
        k => Err(RecordError::UnknownKind(k)),
    }
}

/// Joins path components sent leaf first (`libc.so.6\0lib\0usr\0`) into `/usr/lib/libc.so.6`.
fn mapped_path(raw: &[u8], complete: bool) -> MappedPath {
    // One allocation and one UTF-8 check: an exec storm sends thousands of these a second.
    let mut path = Vec::with_capacity(raw.len() + 1);
    let parts = raw.split(|&c| c == 0).filter(|p| !p.is_empty());
    for (i, p) in parts.rev().enumerate() {
        if complete || i > 0 {
            path.push(b'/');
        }
        path.extend_from_slice(p);
    }
    if path.is_empty() && complete {
        path.push(b'/');
    }
    let path = String::from_utf8(path)
        .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
    MappedPath { path, complete }
}

#[cfg(test)]
mod tests {
    use super::*;
    use profiler_common::{CMDLINE_MAX, MAX_STACK_DEPTH, SampleRecord, label_entry};

    fn bytes_of<T>(v: &T, len: usize) -> Vec<u8> {
        // SAFETY: test-only view of a repr(C) value as bytes.
        unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), len).to_vec() }
    }

    fn comm(s: &str) -> [u8; 16] {
        let mut c = [0u8; 16];
        c[..s.len()].copy_from_slice(s.as_bytes());
        c
    }

    /// A sample record: 2 kernel frames, 3 user frames, 2 labels.
    fn sample_with_labels() -> Vec<u8> {
        let mut r = SampleRecord {
            sample: SampleHeader {
                header: EventHeader { kind: EVENT_SAMPLE, cpu: 1, time_ns: 42, pid: 10, tid: 11 },
                cgroup_id: 7,
                cpu_time_ns: 99,
                comm: comm("worker"),
                kernel_frames: 2,
                user_frames: 3,
                flags: 0,
                label_count: 2,
                py_frames: 0,
            },
            frames: [0; 2 * MAX_STACK_DEPTH + LABEL_MAX_DEPTH + 2 * profiler_common::PY_MAX_FRAMES],
        };
        let (l1, l2) = (label_entry(0x7000, 2), label_entry(0x8000, 3));
        r.frames[..7].copy_from_slice(&[0xffff_0001, 0xffff_0002, 0x401, 0x402, 0x403, l1, l2]);
        bytes_of(&r, SAMPLE_RECORD_FIXED + 7 * 8)
    }

    #[test]
    fn decodes_sample_with_both_stacks() {
        let b = sample_with_labels();
        let KernelEvent::Sample(s) = decode(&b).unwrap() else { panic!() };
        assert_eq!((s.pid, s.tid, s.cpu, s.time), (Pid(10), Tid(11), 1, MonoNs(42)));
        assert_eq!(s.thread(), ThreadKey::Task { pid: Pid(10), tid: Tid(11) });
        assert_eq!(s.comm, "worker");
        assert_eq!(s.kernel_stack, vec![0xffff_0001, 0xffff_0002]);
        assert_eq!(s.user_stack, vec![0x401, 0x402, 0x403]);
        let l = |addr, depth| LabelRef { addr, depth };
        assert_eq!(s.labels, vec![l(0x7000, 2), l(0x8000, 3)]);
        // A record cut before its frames is rejected.
        assert!(matches!(decode(&b[..b.len() - 1]), Err(RecordError::Short { .. })));
    }

    #[test]
    fn decodes_sample_with_stack_copy() {
        let mut r = profiler_common::SampleScratch {
            rec: SampleRecord {
                sample: SampleHeader {
                    header: EventHeader { kind: EVENT_SAMPLE, cpu: 0, time_ns: 1, pid: 5, tid: 5 },
                    cgroup_id: 0,
                    cpu_time_ns: 0,
                    comm: comm("new"),
                    kernel_frames: 0,
                    user_frames: 1,
                    flags: SAMPLE_STACK_COPY,
                    label_count: 0,
                    py_frames: 0,
                },
                frames: [0; 2 * MAX_STACK_DEPTH
                    + LABEL_MAX_DEPTH
                    + 2 * profiler_common::PY_MAX_FRAMES],
            },
            copy: [0; STACK_COPY_HEADER_SIZE + STACK_COPY_MAX],
        };
        // The header and bytes go right after the used frames (here the one user frame).
        r.rec.frames[0] = 0x401;
        let hdr = StackCopyHeader { pc: 0x401, sp: 0x7ff0, bp: 3, len: 16, flags: 1 };
        let hdr_bytes = bytes_of(&hdr, STACK_COPY_HEADER_SIZE);
        let mut b = bytes_of(&r.rec, SAMPLE_RECORD_FIXED + 8);
        b.extend_from_slice(&hdr_bytes);
        b.extend((0..16u8).collect::<Vec<_>>());
        let KernelEvent::Sample(s) = decode(&b).unwrap() else { panic!() };
        let c = s.stack_copy.expect("copy decoded");
        assert_eq!((c.pc, c.sp, c.bp, c.flags), (0x401, 0x7ff0, 3, 1));
        assert_eq!(c.bytes, (0..16u8).collect::<Vec<_>>());
        assert_eq!(s.user_stack, vec![0x401]);
        // A copy shorter than its header says is rejected.
        assert!(matches!(decode(&b[..b.len() - 1]), Err(RecordError::Short { .. })));
    }

    #[test]
    fn decodes_label_depth_record() {
        let h = profiler_common::LabelDepthHeader {
            header: EventHeader { kind: EVENT_LABEL_DEPTH, cpu: 0, time_ns: 1, pid: 5, tid: 6 },
            label: 0x5000,
            index: 2,
            frames: 3,
        };
        let copy = StackCopyHeader { pc: 0x401, sp: 0x7ff0, bp: 3, len: 8, flags: 1 };
        let mut b = bytes_of(&h, LABEL_DEPTH_RECORD_FIXED);
        b.extend_from_slice(&bytes_of(&copy, STACK_COPY_HEADER_SIZE));
        b.extend([7u8; 8]);
        let KernelEvent::LabelDepth(e) = decode(&b).unwrap() else { panic!() };
        assert_eq!((e.pid, e.tid, e.label, e.index, e.frames), (Pid(5), Tid(6), 0x5000, 2, 3));
        let c = e.copy;
        assert_eq!((c.pc, c.sp, c.bytes.len()), (0x401, 0x7ff0, 8));
        assert!(matches!(decode(&b[..b.len() - 1]), Err(RecordError::Short { .. })));
        // A record cut before its copy's header is rejected too.
        assert!(matches!(
            decode(&b[..LABEL_DEPTH_RECORD_FIXED + 4]),
            Err(RecordError::Short { .. })
        ));
    }

    #[test]
    fn decodes_off_cpu_copy_record() {
        let h = OffCpuCopyHeader {
            header: EventHeader { kind: EVENT_OFF_CPU_COPY, cpu: 0, time_ns: 40, pid: 10, tid: 12 },
            frames: 1,
            _pad: 0,
        };
        let copy = StackCopyHeader { pc: 0x401, sp: 0x7ff0, bp: 3, len: 16, flags: 1 };
        let mut b = bytes_of(&h, OFF_CPU_COPY_RECORD_FIXED);
        b.extend_from_slice(&bytes_of(&copy, STACK_COPY_HEADER_SIZE));
        b.extend([7u8; 16]);
        let KernelEvent::OffCpuCopy(e) = decode(&b).unwrap() else { panic!() };
        assert_eq!((e.time, e.pid, e.tid, e.frames), (MonoNs(40), Pid(10), Tid(12), 1));
        assert_eq!((e.copy.pc, e.copy.sp, e.copy.bytes.len()), (0x401, 0x7ff0, 16));
        assert!(matches!(decode(&b[..b.len() - 1]), Err(RecordError::Short { .. })));
        // The off-CPU record names the block the copy was taken at.
        let KernelEvent::Sample(s) = decode(&off_cpu_record()).unwrap() else { panic!() };
        assert_eq!(s.stack_ns, MonoNs(40));
    }

    /// An off-CPU record: 2 kernel frames, 1 user frame.
    fn off_cpu_record() -> Vec<u8> {
        let mut r = profiler_common::OffCpuRecord {
            off: OffCpuHeader {
                header: EventHeader { kind: EVENT_OFF_CPU, cpu: 1, time_ns: 50, pid: 10, tid: 12 },
                cgroup_id: 7,
                weight_ns: 3_000_000,
                block_ns: 400_000,
                blocks: 9,
                state: 1,
                comm: comm("reader"),
                kernel_frames: 2,
                user_frames: 1,
                flags: 0,
                pending_ns: 123,
                pending_blocks: 4,
                off_cpu: 0,
                stack_ns: 40,
                py_frames: 0,
                _pad: 0,
            },
            frames: [0; 2 * MAX_STACK_DEPTH + 2 * profiler_common::PY_MAX_FRAMES],
            track: profiler_common::OffCpuTrack {
                short_max_ns: 0,
                site: 0,
                long_sites: [0; profiler_common::OFF_CPU_LONG_SITES],
                next_long_site: 0,
                seen_sites: [0; profiler_common::OFF_CPU_SEEN_SITES],
                next_seen_site: 0,
                _pad: 0,
                flags: 0,
            },
        };
        r.frames[..3].copy_from_slice(&[0xffff_0001, 0xffff_0002, 0x401]);
        bytes_of(&r, OFF_CPU_RECORD_FIXED + 3 * 8)
    }

    #[test]
    fn decodes_offcpu_record() {
        let b = off_cpu_record();
        let KernelEvent::Sample(s) = decode(&b).unwrap() else { panic!() };
        assert_eq!(
            (s.pid, s.tid, s.time, s.comm.as_str()),
            (Pid(10), Tid(12), MonoNs(50), "reader")
        );
        assert_eq!(s.kernel_stack, vec![0xffff_0001, 0xffff_0002]);
        assert_eq!(s.user_stack, vec![0x401]);
        assert_eq!(
            s.off_cpu,
            Some(OffCpu { weight_ns: 3_000_000, block_ns: 400_000, blocks: 9, state: 1 })
        );
        assert!(decode(&b[..b.len() - 1]).is_err());
    }

    /// Records decoded into one reused `Sample` come out as they do decoded alone: nothing of
    /// the previous record (labels, off-CPU data, longer stacks) is left; a bad record and a
    /// record of another kind leave it as it was.
    #[test]
    fn decoding_into_a_reused_sample_leaves_nothing_of_the_last() {
        let alone = |b: &[u8]| match decode(b).unwrap() {
            KernelEvent::Sample(s) => s,
            e => panic!("{e:?}"),
        };
        let mut s = Sample::default();
        for b in [sample_with_labels(), off_cpu_record(), sample_with_labels()] {
            assert!(decode_sample_into(&b, &mut s).unwrap());
            assert_eq!(s, alone(&b));
        }
        let before = s.clone();
        let b = off_cpu_record();
        assert!(decode_sample_into(&b[..b.len() - 1], &mut s).is_err());
        let exit = TaskRecord {
            header: EventHeader { kind: EVENT_EXIT, cpu: 0, time_ns: 5, pid: 3, tid: 3 },
            parent_pid: 0,
            parent_tid: 0,
            mm: 0,
            vdso: 0,
            comm: comm("ls"),
            cmdline_len: 0,
            cmdline_truncated: 0,
            flags: 0,
            _pad: 0,
            cmdline: [0; CMDLINE_MAX],
        };
        assert!(!decode_sample_into(&bytes_of(&exit, TASK_RECORD_FIXED), &mut s).unwrap());
        assert_eq!(s, before);
    }

    #[test]
    fn decodes_exec_argv() {
        let mut t = TaskRecord {
            header: EventHeader { kind: EVENT_EXEC, cpu: 0, time_ns: 5, pid: 3, tid: 3 },
            parent_pid: 0,
            parent_tid: 0,
            mm: 0xffff_1000,
            vdso: 0x7fff_0000,
            comm: comm("ls"),
            cmdline_len: 8,
            cmdline_truncated: 0,
            flags: 0,
            _pad: 0,
            cmdline: [0; CMDLINE_MAX],
        };
        t.cmdline[..8].copy_from_slice(b"ls\0-l\0/\0");
        let b = bytes_of(&t, TASK_RECORD_FIXED + 8);
        let KernelEvent::Task(e) = decode(&b).unwrap() else { panic!() };
        assert_eq!(
            e.kind,
            TaskKind::Exec {
                argv: vec!["ls".into(), "-l".into(), "/".into()],
                truncated: false,
                mm: 0xffff_1000,
                vdso: 0x7fff_0000
            }
        );
    }

    #[test]
    fn decodes_a_fork_and_whether_the_walker_entry_was_copied() {
        let mut t = TaskRecord {
            header: EventHeader { kind: EVENT_FORK, cpu: 0, time_ns: 5, pid: 9, tid: 9 },
            parent_pid: 3,
            parent_tid: 4,
            mm: 0xffff_1000,
            vdso: 0,
            comm: comm("postgres"),
            cmdline_len: 0,
            cmdline_truncated: 0,
            flags: profiler_common::TASK_WALKER_COPIED,
            _pad: 0,
            cmdline: [0; CMDLINE_MAX],
        };
        let fork = |t: &TaskRecord| match decode(&bytes_of(t, TASK_RECORD_FIXED)).unwrap() {
            KernelEvent::Task(e) => e.kind,
            _ => panic!(),
        };
        let want = |walker_copied| TaskKind::Fork {
            parent_pid: Pid(3),
            parent_tid: Tid(4),
            mm: 0xffff_1000,
            walker_copied,
        };
        assert_eq!(fork(&t), want(true));
        t.flags = 0;
        assert_eq!(fork(&t), want(false));
    }

    #[test]
    fn mapped_path_joins_components_root_first() {
        assert_eq!(mapped_path(b"", true).path, "/");
        assert_eq!(mapped_path(b"", false).path, "");
        // Empty components are skipped; bytes that are not UTF-8 are replaced, not dropped.
        assert_eq!(mapped_path(b"a\xff\0\0d\0", true).path, "/d/a\u{fffd}");
        assert_eq!(mapped_path(b"a\0d", false).path, "d/a");
        assert_eq!(mapped_path(b"libc.so.6\0lib\0usr\0", false).path, "usr/lib/libc.so.6");
        assert_eq!(mapped_path(b"\0\0x\0\0", true).path, "/x");
        assert_eq!(mapped_path(b"\0\0", false).path, "");
    }

    #[test]
    fn comm_is_inline_utf8_or_replaced() {
        assert_eq!(Comm::new(b"true\0\0\0").as_str(), "true");
        assert_eq!(Comm::new(b"0123456789abcdef").as_str(), "0123456789abcdef");
        assert_eq!(Comm::new(b"a\xffb\0").as_str(), "a\u{fffd}b");
        assert_eq!(Comm::from("sh"), Comm::new(b"sh\0"));
    }

    #[test]
    fn decodes_mapping_with_path_and_device() {
        let mut r = MapRecord {
            header: EventHeader { kind: EVENT_MMAP, cpu: 0, time_ns: 5, pid: 3, tid: 4 },
            start: 0x7f00_0000_0000,
            len: 0x2000,
            offset: 0x1000,
            mm: 0xffff_2000,
            inode: 77,
            dev: (254 << 20) | 1,
            flags: MAP_PATH_COMPLETE,
            path_len: 0,
            early_seq: 0,
            path: [0; profiler_common::MAP_PATH_MAX + profiler_common::MAP_NAME_MAX],
        };
        let parts = b"libc.so.6\0lib\0usr\0";
        r.path[..parts.len()].copy_from_slice(parts);
        r.path_len = parts.len() as u32;
        let b = bytes_of(&r, MAP_RECORD_FIXED + parts.len());
        let KernelEvent::Map(m) = decode(&b).unwrap() else { panic!() };
        assert_eq!(
            (m.pid, m.tid, m.start, m.end, m.mm),
            (Pid(3), Tid(4), r.start, r.start + 0x2000, r.mm)
        );
        let path = MappedPath { path: "/usr/lib/libc.so.6".into(), complete: true };
        assert_eq!(m.kind, MapKind::File { offset: 0x1000, dev: 254 << 32 | 1, inode: 77, path });
        // A walk that stopped early keeps the trailing components, relative.
        r.flags = 0;
        let KernelEvent::Map(m) = decode(&bytes_of(&r, MAP_RECORD_FIXED + parts.len())).unwrap()
        else {
            panic!()
        };
        let MapKind::File { path, .. } = m.kind else { panic!() };
        assert_eq!(path, MappedPath { path: "usr/lib/libc.so.6".into(), complete: false });
        // A path longer than the record is rejected.
        assert!(decode(&b[..b.len() - 1]).is_err());
        // The interpreter at exec: named like any file when the kernel found its mapping,
        // without a file when it did not (userspace then reads PT_INTERP).
        r.flags = MAP_INTERP | MAP_PATH_COMPLETE;
        let KernelEvent::Map(m) = decode(&bytes_of(&r, MAP_RECORD_FIXED + parts.len())).unwrap()
        else {
            panic!()
        };
        let path = MappedPath { path: "/usr/lib/libc.so.6".into(), complete: true };
        assert_eq!(m.kind, MapKind::Interp { file: Some((254 << 32 | 1, 77, path)) });
        (r.inode, r.path_len, r.flags) = (0, 0, MAP_INTERP);
        let KernelEvent::Map(m) = decode(&bytes_of(&r, MAP_RECORD_FIXED)).unwrap() else {
            panic!()
        };
        assert_eq!(m.kind, MapKind::Interp { file: None });
    }

    #[test]
    fn decodes_usdt_hit_with_strings() {
        let empty = UsdtString { len: 0, flags: 0, _pad: 0, bytes: [0; USDT_STR_MAX] };
        let mut r = UsdtRecord {
            header: EventHeader { kind: EVENT_USDT, cpu: 2, time_ns: 9, pid: 5, tid: 6 },
            probe_id: 3,
            spec_id: 4,
            arg_count: 2,
            str_count: 2,
            arg_errors: 0,
            args: [0x1000, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            strs: [empty; USDT_MAX_STRS],
        };
        r.strs[0].len = 2;
        r.strs[0].bytes[..3].copy_from_slice(b"hi\0");
        r.strs[1].flags = profiler_common::USDT_STR_IS_NULL;
        let full = bytes_of(&r, size_of::<UsdtRecord>());
        let KernelEvent::Usdt(h) = decode(&full).unwrap() else { panic!() };
        assert_eq!((h.pid, h.tid, h.probe_id, h.spec_id), (Pid(5), Tid(6), 3, 4));
        assert_eq!(h.args, vec![0x1000, 0]);
        assert_eq!(h.strs[0], RawUsdtStr { flags: 0, bytes: b"hi".to_vec() });
        assert_eq!(h.strs[1].flags, profiler_common::USDT_STR_IS_NULL);
        // Missing string slots, too many args or a bogus length are rejected or clamped.
        assert!(decode(&full[..full.len() - 1]).is_err());
        let mut bad = full.clone();
        bad[std::mem::offset_of!(UsdtRecord, arg_count)] = USDT_MAX_ARGS as u8 + 1;
        assert!(decode(&bad).is_err());
        let mut long = full.clone();
        long[USDT_RECORD_FIXED..USDT_RECORD_FIXED + 2].copy_from_slice(&u16::MAX.to_ne_bytes());
        let KernelEvent::Usdt(h) = decode(&long).unwrap() else { panic!() };
        assert_eq!(h.strs[0].bytes.len(), USDT_STR_MAX - 1);
    }

    #[test]
    fn rejects_garbage() {
        assert!(decode(&[1, 2, 3]).is_err());
        let mut b = vec![0u8; 64];
        b[0] = 77;
        assert_eq!(decode(&b), Err(RecordError::UnknownKind(77)));
    }
}
