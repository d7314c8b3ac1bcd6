//! A small recording for writers' unit tests: a stack tree with an inlined call, a kernel
//! frame, an unnamed function, a label and a name with a semicolon; a process in a container;
//! and a way to run events through a writer.

use std::collections::HashMap;

use crate::model::{
    Sample,
    container::{Identity, Runtime},
    ids::{LabelId, Pid, StackId, ThreadKey, Tid},
    process::{ProcessMeta, ProcessesMeta, ThreadMeta},
    recording::{RecordingInfo, Recycled},
    stacks::{Frame, FrameIndex, FrameKind, SymbolizedStacks},
    time::MonoNs,
};

use super::{Format, ProfileContext};

pub const APP: Pid = Pid(100);
pub const MAIN: ThreadKey = ThreadKey::Task { pid: APP, tid: Tid(100) };
pub const WORKER: ThreadKey = ThreadKey::Task { pid: APP, tid: Tid(101) };
/// A process nothing is known about.
pub const STRANGER: ThreadKey = ThreadKey::Task { pid: Pid(7), tid: Tid(8) };
pub const IDLE: ThreadKey = ThreadKey::Idle { cpu: 1 };

/// Stack ids of [`stacks`].
pub const S_MAIN: StackId = StackId(0);
/// main → work with `inl` inlined into it.
pub const S_WORK: StackId = StackId(1);
/// main → work/inl → hot.
pub const S_HOT: StackId = StackId(2);
/// … → hot → do_syscall_64 (kernel).
pub const S_SYSCALL: StackId = StackId(3);
/// main → 0x1234 in libc.so.6.
pub const S_UNNAMED: StackId = StackId(4);
/// main → `a;b` → label `phase 1`.
pub const S_LABEL: StackId = StackId(6);

/// A frame with no file or line.
pub fn frame(kind: FrameKind, function: &str, module: &str) -> Frame {
    Frame {
        kind,
        function: function.into(),
        module: module.into(),
        file: None,
        line: None,
        column: None,
        inlined: false,
        elf: None,
    }
}

pub fn stacks() -> SymbolizedStacks {
    let mut work = frame(FrameKind::User, "work", "app");
    work.file = Some("src/main.c".into());
    work.line = Some(12);
    work.column = Some(5);
    let mut inl = frame(FrameKind::User, "inl", "app");
    inl.file = Some("src/inl.h".into());
    inl.line = Some(3);
    inl.inlined = true;
    let f = |i: u32| FrameIndex(i);
    let mut stacks = SymbolizedStacks::from_parts(
        vec![
            frame(FrameKind::User, "main", "app"),
            work,
            inl,
            frame(FrameKind::User, "hot", "app"),
            frame(FrameKind::Kernel, "do_syscall_64", "[kernel.kallsyms]"),
            frame(FrameKind::User, "0x1234", "libc.so.6"),
            frame(FrameKind::User, "a;b", "app"),
            frame(FrameKind::Label, "phase 1", "rsprof label"),
        ],
        vec![
            (None, vec![f(0)]),
            (Some(S_MAIN), vec![f(1), f(2)]),
            (Some(S_WORK), vec![f(3)]),
            (Some(S_HOT), vec![f(4)]),
            (Some(S_MAIN), vec![f(5)]),
            (Some(S_MAIN), vec![f(6)]),
            (Some(StackId(5)), vec![f(7)]),
        ],
    );
    stacks.module_build_ids.insert("app".into(), "0123abcd".into());
    stacks
}

pub fn info() -> RecordingInfo {
    RecordingInfo {
        start: MonoNs(5_000_000_000),
        start_wall_ms: 1.7e12,
        end: MonoNs(7_500_000_000),
        frequency: 1000,
        logical_cpus: 2,
        physical_cpus: 2,
        product: "rsprof-bpf test".into(),
        oscpu: "Linux".into(),
    }
}

pub fn processes() -> ProcessesMeta {
    let thread = |name: &str| ThreadMeta { name: name.into(), ..Default::default() };
    let app = ProcessMeta {
        name: "app".into(),
        exe: "/opt/app/bin/app".into(),
        argv: vec!["app".into(), "--serve".into(), "port 80".into()],
        threads: [(Tid(100), thread("app")), (Tid(101), thread("worker;1"))].into_iter().collect(),
        container: Some(Identity {
            runtime: Runtime::Docker,
            id: "3f2a9c1b0d4e".into(),
            pod_uid: None,
            qos: None,
            cgroup: "/system.slice/docker-3f2a9c1b0d4e.scope".into(),
            container_cgroup: "/system.slice/docker-3f2a9c1b0d4e.scope".into(),
        }),
        labels: HashMap::from([(LabelId(1), "phase 1".to_owned())]),
        ..Default::default()
    };
    HashMap::from([(APP, app)])
}

pub fn sample(ms: u64, cpu_delta_ns: u64, stack: Option<StackId>) -> Sample {
    Sample { time: MonoNs(5_000_000_000 + ms * 1_000_000), cpu_delta_ns, stack, off_cpu: None }
}

/// Runs `events` through a `format` writer; returns the file's bytes.
pub fn write(format: Format, events: &[(ThreadKey, Sample)]) -> Vec<u8> {
    let (stacks, info, processes) = (stacks(), info(), processes());
    let ctx = ProfileContext {
        info: &info,
        stacks: &stacks,
        processes: &processes,
        marker_schemas: &[],
        recycled: Recycled::default(),
        buffer_bytes: 1 << 20,
        report: Default::default(),
    };
    let mut w = format.writer(&ctx);
    for (t, s) in events {
        w.sample(*t, s);
    }
    let mut out = Vec::new();
    w.write(&[], &mut out).unwrap();
    out
}
