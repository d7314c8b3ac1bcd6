//! Decoding of ring-buffer records (layouts in `profiler-common`) into typed events.
//! Records are read by field offset from a byte slice, so a short or malformed record is an
//! error, never an out-of-bounds read.

use profiler_common::{
    EVENT_EXEC, EVENT_EXIT, EVENT_FORK, EVENT_SAMPLE, EventHeader, SAMPLE_RECORD_FIXED,
    SampleHeader, TASK_RECORD_FIXED, TaskRecord,
};

use crate::ids::{Pid, Tid};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    pub time_ns: u64,
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
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TaskKind {
    /// A new task; `parent` is the forking task.
    Fork {
        parent_pid: Pid,
        parent_tid: Tid,
    },
    Exec {
        argv: Vec<String>,
        truncated: bool,
    },
    Exit,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskEvent {
    pub time_ns: u64,
    pub pid: Pid,
    pub tid: Tid,
    pub comm: String,
    pub kind: TaskKind,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Sample(Sample),
    Task(TaskEvent),
}

#[derive(Debug, PartialEq, Eq)]
pub enum DecodeError {
    Short { kind: u32, len: usize },
    UnknownKind(u32),
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::Short { kind, len } => {
                write!(f, "record kind {kind} too short ({len} bytes)")
            }
            DecodeError::UnknownKind(k) => write!(f, "unknown record kind {k}"),
        }
    }
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

/// A kernel `comm`: NUL-terminated, not necessarily UTF-8.
pub fn comm_string(raw: &[u8]) -> String {
    let end = raw.iter().position(|&c| c == 0).unwrap_or(raw.len());
    String::from_utf8_lossy(&raw[..end]).into_owned()
}

const HDR: usize = size_of::<EventHeader>();

fn header(b: &[u8]) -> (u32, u32, u64, u32, u32) {
    (u32_at(b, 0), u32_at(b, 4), u64_at(b, 8), u32_at(b, 16), u32_at(b, 20))
}

pub fn decode(b: &[u8]) -> Result<Event, DecodeError> {
    if b.len() < HDR {
        return Err(DecodeError::Short { kind: 0, len: b.len() });
    }
    let (kind, cpu, time_ns, pid, tid) = header(b);
    let short = DecodeError::Short { kind, len: b.len() };
    match kind {
        EVENT_SAMPLE => {
            if b.len() < SAMPLE_RECORD_FIXED {
                return Err(short);
            }
            let o_cg = std::mem::offset_of!(SampleHeader, cgroup_id);
            let o_cpu = std::mem::offset_of!(SampleHeader, cpu_time_ns);
            let o_comm = std::mem::offset_of!(SampleHeader, comm);
            let o_kf = std::mem::offset_of!(SampleHeader, kernel_frames);
            let o_uf = std::mem::offset_of!(SampleHeader, user_frames);
            let o_fl = std::mem::offset_of!(SampleHeader, flags);
            let kn = u16_at(b, o_kf) as usize;
            let un = u16_at(b, o_uf) as usize;
            if b.len() < SAMPLE_RECORD_FIXED + (kn + un) * 8 {
                return Err(short);
            }
            let frame = |i: usize| u64_at(b, SAMPLE_RECORD_FIXED + i * 8);
            Ok(Event::Sample(Sample {
                time_ns,
                cpu,
                pid: Pid(pid),
                tid: Tid(tid),
                cgroup_id: u64_at(b, o_cg),
                cpu_time_ns: u64_at(b, o_cpu),
                comm: comm_string(&b[o_comm..o_comm + 16]),
                flags: u32_at(b, o_fl),
                kernel_stack: (0..kn).map(frame).collect(),
                user_stack: (kn..kn + un).map(frame).collect(),
            }))
        }
        EVENT_FORK | EVENT_EXEC | EVENT_EXIT => {
            if b.len() < TASK_RECORD_FIXED {
                return Err(short);
            }
            let o_comm = std::mem::offset_of!(TaskRecord, comm);
            let comm = comm_string(&b[o_comm..o_comm + 16]);
            let kind = match kind {
                EVENT_FORK => TaskKind::Fork {
                    parent_pid: Pid(u32_at(b, std::mem::offset_of!(TaskRecord, parent_pid))),
                    parent_tid: Tid(u32_at(b, std::mem::offset_of!(TaskRecord, parent_tid))),
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
                    TaskKind::Exec { argv, truncated }
                }
                _ => TaskKind::Exit,
            };
            Ok(Event::Task(TaskEvent { time_ns, pid: Pid(pid), tid: Tid(tid), comm, kind }))
        }
        k => Err(DecodeError::UnknownKind(k)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use profiler_common::{CMDLINE_MAX, MAX_STACK_DEPTH, SampleRecord};

    fn bytes_of<T>(v: &T, len: usize) -> Vec<u8> {
        // SAFETY: test-only view of a repr(C) value as bytes.
        unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), len).to_vec() }
    }

    fn comm(s: &str) -> [u8; 16] {
        let mut c = [0u8; 16];
        c[..s.len()].copy_from_slice(s.as_bytes());
        c
    }

    #[test]
    fn decodes_sample_with_both_stacks() {
        let mut r = SampleRecord {
            sample: SampleHeader {
                header: EventHeader { kind: EVENT_SAMPLE, cpu: 1, time_ns: 42, pid: 10, tid: 11 },
                cgroup_id: 7,
                cpu_time_ns: 99,
                comm: comm("worker"),
                kernel_frames: 2,
                user_frames: 3,
                flags: 0,
            },
            frames: [0; 2 * MAX_STACK_DEPTH],
        };
        r.frames[..5].copy_from_slice(&[0xffff_0001, 0xffff_0002, 0x401, 0x402, 0x403]);
        let b = bytes_of(&r, SAMPLE_RECORD_FIXED + 5 * 8);
        let Event::Sample(s) = decode(&b).unwrap() else { panic!() };
        assert_eq!((s.pid, s.tid, s.cpu, s.time_ns), (Pid(10), Tid(11), 1, 42));
        assert_eq!(s.comm, "worker");
        assert_eq!(s.kernel_stack, vec![0xffff_0001, 0xffff_0002]);
        assert_eq!(s.user_stack, vec![0x401, 0x402, 0x403]);
        // A record cut before its frames is rejected.
        assert!(matches!(decode(&b[..b.len() - 1]), Err(DecodeError::Short { .. })));
    }

    #[test]
    fn decodes_exec_argv() {
        let mut t = TaskRecord {
            header: EventHeader { kind: EVENT_EXEC, cpu: 0, time_ns: 5, pid: 3, tid: 3 },
            parent_pid: 0,
            parent_tid: 0,
            comm: comm("ls"),
            cmdline_len: 8,
            cmdline_truncated: 0,
            cmdline: [0; CMDLINE_MAX],
        };
        t.cmdline[..8].copy_from_slice(b"ls\0-l\0/\0");
        let b = bytes_of(&t, TASK_RECORD_FIXED + 8);
        let Event::Task(e) = decode(&b).unwrap() else { panic!() };
        assert_eq!(
            e.kind,
            TaskKind::Exec { argv: vec!["ls".into(), "-l".into(), "/".into()], truncated: false }
        );
    }

    #[test]
    fn rejects_garbage() {
        assert!(decode(&[1, 2, 3]).is_err());
        let mut b = vec![0u8; 64];
        b[0] = 77;
        assert_eq!(decode(&b), Err(DecodeError::UnknownKind(77)));
    }
}
