//! Process and thread metadata as a profile shows it.

use std::collections::HashMap;

use super::{
    container::Identity,
    ids::{LabelId, Pid, ThreadKey, Tid},
    time::MonoNs,
};

/// A thread's metadata as recorded.
#[derive(Clone, Debug, Default)]
pub struct ThreadMeta {
    /// Last name the thread had (its `comm`).
    pub name: String,
    /// Earlier names, oldest first, when the thread renamed itself.
    pub previous_names: Vec<String>,
    /// Its creation, if it happened during the recording.
    pub start: Option<MonoNs>,
    pub end: Option<MonoNs>,
}

impl ThreadMeta {
    /// Records the thread's current name, keeping earlier ones.
    pub fn observe_name(&mut self, name: &str) {
        if name.is_empty() || self.name == name {
            return;
        }
        if !self.name.is_empty() {
            let old = std::mem::replace(&mut self.name, name.to_owned());
            self.previous_names.push(old);
        } else {
            self.name = name.to_owned();
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct ProcessMeta {
    /// Executable name (`comm` of the main thread after exec).
    pub name: String,
    pub argv: Vec<String>,
    pub start: Option<MonoNs>,
    pub end: Option<MonoNs>,
    pub threads: HashMap<Tid, ThreadMeta>,
    /// The container or systemd service it runs in (from its cgroup), if any.
    pub container: Option<Identity>,
    /// `rsprof:label_push` texts.
    pub labels: HashMap<LabelId, String>,
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
