//! Process and thread metadata as a profile shows it.

use std::collections::HashMap;

use super::{
    container::Identity,
    ids::{LabelId, Pid, ThreadKey, Tid},
    stacks::JitLanguage,
    time::MonoNs,
};

/// A thread's metadata as recorded.
#[derive(Clone, Debug, Default)]
pub struct ThreadMeta {
    /// Last name the thread had (its `comm`): what the profile names it. Earlier names are
    /// not kept (no output shows them, and an exec storm renames every child once).
    pub name: String,
    /// Its creation, if it happened during the recording.
    pub start: Option<MonoNs>,
    pub end: Option<MonoNs>,
}

impl ThreadMeta {
    /// Records the thread's current name, in the buffer of the last.
    pub fn observe_name(&mut self, name: &str) {
        if !name.is_empty() && self.name != name {
            self.name.clear();
            self.name.push_str(name);
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct ProcessMeta {
    /// Executable name (`comm` of the main thread after exec).
    pub name: String,
    /// Path of its executable as it was mapped (empty if never seen).
    pub exe: String,
    /// Command line, read by the kernel at exec (or from /proc/PID/cmdline once, for a
    /// process that existed before the recording).
    pub argv: Vec<String>,
    /// `argv` was longer than the kernel copies (`CMDLINE_MAX` bytes) and was cut.
    pub argv_truncated: bool,
    pub start: Option<MonoNs>,
    pub end: Option<MonoNs>,
    /// Looked up for every sample: a fast hash (pids and tids are no secret to protect).
    pub threads: HashMap<Tid, ThreadMeta, foldhash::fast::RandomState>,
    /// The container or systemd service it runs in (from its cgroup), if any.
    pub container: Option<Identity>,
    /// `rsprof:label_push` texts.
    pub labels: HashMap<LabelId, String>,
    /// JIT functions its perf map or jitdump named in samples, by `JitSymbolId`.
    pub jit_symbols: Vec<JitSymbol>,
    /// Addresses of `FrameAddr::Anon` frames that lines or records read after their samples
    /// named.
    pub jit_late: HashMap<u64, super::ids::JitSymbolId>,
}

/// A JIT function as its runtime named it in its perf map or jitdump (with the file and line
/// of the code sampled, where the jitdump's debug info gave them), or a Python function (and
/// line) read from the interpreter's frames.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JitSymbol {
    pub name: String,
    pub language: JitLanguage,
    /// Source file and line, where the runtime tells them.
    pub file: Option<String>,
    pub line: Option<u32>,
    /// Named from a jitdump (else a perf map).
    pub from_dump: bool,
    /// Read from the interpreter's own frames (`crate::collect::python`), not named by a perf map.
    pub interpreter: bool,
}

impl ProcessMeta {
    /// `argv` as one line, arguments with spaces or quotes single-quoted (shell style), `…`
    /// appended when it was cut; empty when unknown.
    pub fn command_line(&self) -> String {
        let mut s = String::new();
        for (i, a) in self.argv.iter().enumerate() {
            if i > 0 {
                s.push(' ');
            }
            if !a.is_empty() && !a.contains(|c: char| c.is_whitespace() || "'\"\\$`".contains(c)) {
                s.push_str(a);
            } else {
                s.push('\'');
                s.push_str(&a.replace('\'', r"'\''"));
                s.push('\'');
            }
        }
        if self.argv_truncated {
            s.push('…');
        }
        s
    }
}

pub type ProcessesMeta = HashMap<Pid, ProcessMeta>;

/// Names of the idle task, which the kernel does not give a process of its own.
pub const IDLE_PROCESS_NAME: &str = "[idle]";

pub fn idle_thread_name(cpu: u32) -> String {
    format!("swapper/{cpu}")
}

/// (process name, thread name) of a thread as profiles show them: the recorded names, else
/// the idle task's names, else the numbers.
pub fn display_names(processes: &ProcessesMeta, thread: ThreadKey) -> (String, String) {
    match thread {
        ThreadKey::Idle { cpu } => (IDLE_PROCESS_NAME.to_owned(), idle_thread_name(cpu)),
        ThreadKey::Task { pid, tid } => {
            let p = processes.get(&pid);
            let process = p.map(|p| p.name.clone()).filter(|n| !n.is_empty());
            let thread = p.and_then(|p| p.threads.get(&tid)).map(|t| t.name.clone());
            (
                process.unwrap_or_else(|| pid.to_string()),
                thread.filter(|n| !n.is_empty()).unwrap_or_else(|| tid.to_string()),
            )
        }
    }
}
