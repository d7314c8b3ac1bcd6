//! Sample storage: per-thread sample lists and interned, normalized stacks.
//!
//! Stacks are stored as [`FrameAddr`]s — kernel addresses and (module, file offset) pairs —
//! so they mean the same thing after the process is gone. This is the in-memory store; the
//! chunked, memory-bounded store (issue 3) implements the same `SampleSink` interface.

use std::collections::HashMap;

use crate::{
    ids::{Pid, Tid},
    intern::Interner,
    procmaps::ModuleId,
};

/// A normalized return address / instruction pointer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FrameAddr {
    Kernel(u64),
    /// Offset into the module's file.
    User {
        module: ModuleId,
        offset: u64,
    },
    /// A user address in no known mapping.
    Unmapped(u64),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StackId(pub u32);

/// A thread as it appears in the profile. Idle tasks all have tid 0, so they are keyed by CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ThreadKey {
    pub pid: Pid,
    pub tid: Tid,
}

impl ThreadKey {
    pub fn idle(cpu: u32) -> Self {
        Self { pid: Pid(0), tid: Tid(cpu) }
    }
    pub fn is_idle(&self) -> bool {
        self.pid.0 == 0
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StoredSample {
    pub time_ns: u64,
    pub cpu_delta_ns: u64,
    pub stack: Option<StackId>,
}

/// Where the collector puts samples.
pub trait SampleSink {
    /// `frames` is root first.
    fn intern_stack(&mut self, frames: &[FrameAddr]) -> StackId;
    fn push_sample(&mut self, thread: ThreadKey, sample: StoredSample);
}

#[derive(Default)]
pub struct MemoryStore {
    stacks: Interner<Vec<FrameAddr>>,
    threads: HashMap<ThreadKey, Vec<StoredSample>>,
    sample_count: u64,
}

impl SampleSink for MemoryStore {
    fn intern_stack(&mut self, frames: &[FrameAddr]) -> StackId {
        StackId(self.stacks.intern(frames))
    }

    fn push_sample(&mut self, thread: ThreadKey, sample: StoredSample) {
        self.threads.entry(thread).or_default().push(sample);
        self.sample_count += 1;
    }
}

impl MemoryStore {
    pub fn stack(&self, id: StackId) -> &[FrameAddr] {
        self.stacks.get(id.0)
    }

    pub fn stack_count(&self) -> usize {
        self.stacks.len()
    }

    pub fn sample_count(&self) -> u64 {
        self.sample_count
    }

    /// Threads with their samples, sorted by time.
    pub fn threads(&mut self) -> impl Iterator<Item = (&ThreadKey, &Vec<StoredSample>)> {
        for v in self.threads.values_mut() {
            v.sort_by_key(|s| s.time_ns);
        }
        self.threads.iter()
    }

    /// Every distinct frame address in any stack.
    pub fn unique_frames(&self) -> Vec<FrameAddr> {
        let mut v: Vec<FrameAddr> = self.stacks.items().iter().flatten().copied().collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_stacks_share_an_id() {
        let mut s = MemoryStore::default();
        let a = [FrameAddr::Kernel(1), FrameAddr::Unmapped(2)];
        let b = [FrameAddr::Kernel(1)];
        let ia = s.intern_stack(&a);
        assert_eq!(s.intern_stack(&a), ia);
        let ib = s.intern_stack(&b);
        assert_ne!(ia, ib);
        assert_eq!(s.stack(ia), &a);
        assert_eq!(s.unique_frames(), vec![FrameAddr::Kernel(1), FrameAddr::Unmapped(2)]);
    }

    #[test]
    fn samples_come_back_sorted_per_thread() {
        let mut s = MemoryStore::default();
        let t = ThreadKey { pid: Pid(5), tid: Tid(6) };
        for time in [30, 10, 20] {
            s.push_sample(t, StoredSample { time_ns: time, cpu_delta_ns: 0, stack: None });
        }
        let (_, v) = s.threads().next().unwrap();
        assert_eq!(v.iter().map(|x| x.time_ns).collect::<Vec<_>>(), vec![10, 20, 30]);
        assert_eq!(s.sample_count(), 3);
    }
}
