//! One thread's tables ([`ThreadTables`]: strings, frames, stacks, samples, markers), filled in
//! one pass over storage (the model of Gecko's ThreadStreamingContext), and the thread's JSON.
//! Frame and stack rows exist only for what its samples use.

use std::io::{self, Write};

use serde::Serialize;
use serde_json::Value;

use super::{
    categories::{CATEGORY_IDLE, CATEGORY_OFF_CPU},
    frame_table::FrameTable,
    marker_table::MarkerTable,
    profile::Shared,
    sample_table::SampleTable,
    stack_table::StackTable,
    string_table::StringTable,
};
use crate::model::{
    ids::{Pid, StackId, Tid},
    stacks::SymbolizedStacks,
};

pub struct GeckoThread {
    pub tid: Tid,
    pub name: String,
    /// The process's main thread (tid == pid).
    pub is_main: bool,
    /// ms since profile start.
    pub register_time_ms: f64,
    pub unregister_time_ms: Option<f64>,
    pub tables: ThreadTables,
}

#[derive(Default)]
pub struct ThreadTables {
    pub(super) strings: StringTable,
    pub(super) frames: FrameTable,
    pub(super) stacks: StackTable,
    pub(super) samples: SampleTable,
    pub(super) markers: MarkerTable,
}

impl ThreadTables {
    pub fn sample_count(&self) -> u64 {
        self.samples.count
    }

    /// Time of the first sample, ms (0 without samples).
    pub fn first_sample_ms(&self) -> f64 {
        self.samples.first_ms
    }

    /// Time of the last sample, ms (0 without samples).
    pub fn last_sample_ms(&self) -> f64 {
        self.samples.last_ms
    }

    /// Appends a sample. Samples must come in time order (storage keeps each thread's events
    /// in order); an earlier time is raised to the previous one so the table stays sorted.
    pub fn add_sample(
        &mut self,
        tree: &SymbolizedStacks,
        time_ms: f64,
        stack: Option<StackId>,
        cpu_delta_ns: Option<u64>,
        idle: bool,
    ) {
        if !time_ms.is_finite() {
            return;
        }
        let time_ms = self.samples.in_order(time_ms);
        let over = idle.then_some(CATEGORY_IDLE);
        let row = stack.and_then(|s| self.stack(tree, s, over));
        self.samples.push(time_ms, cpu_delta_ns, row, !idle);
    }

    /// Appends off-CPU time as the samples a wall-clock sampler with period `interval_ns`
    /// would have taken: the Gecko format has no sample weights (the importer resets them), so
    /// `weight_ns` becomes whole samples (the remainder carries over to the thread's next
    /// off-CPU time), spread over the block `[time, time + block_ns]`. They have no CPU time and
    /// every frame in the Off-CPU category.
    pub fn add_off_cpu(
        &mut self,
        tree: &SymbolizedStacks,
        time_ms: f64,
        stack: Option<StackId>,
        weight_ns: u64,
        block_ns: u64,
        interval_ns: u64,
    ) -> u64 {
        if !time_ms.is_finite() || interval_ns == 0 {
            return 0;
        }
        let n = self.samples.off_cpu_samples(weight_ns, interval_ns);
        if n == 0 {
            return 0;
        }
        let row = stack.and_then(|s| self.stack(tree, s, Some(CATEGORY_OFF_CPU)));
        let step_ms = block_ns as f64 / 1e6 / n as f64;
        for i in 0..n {
            let t = self.samples.in_order(time_ms + (i as f64 + 0.5) * step_ms);
            self.samples.push(t, Some(0), row, false);
        }
        n
    }

    /// Appends a marker row; `data` is its payload object (with `type` naming its schema).
    pub fn add_marker(
        &mut self,
        name: &str,
        start_ms: Option<f64>,
        end_ms: Option<f64>,
        phase: u8,
        category: u32,
        data: &Value,
    ) {
        let name = self.strings.own(name);
        self.markers.push(name, start_ms, end_ms, phase, category, data);
    }

    fn stack(&mut self, tree: &SymbolizedStacks, id: StackId, over: Option<u32>) -> Option<u32> {
        self.stacks.row(&mut self.frames, &mut self.strings, tree, id, over)
    }
}

/// A thread's fields before its tables.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ThreadHead<'a> {
    name: &'a str,
    process_type: &'static str,
    process_name: &'a str,
    pid: u32,
    tid: u32,
    /// Ignored by the front-end (it only knows "GeckoMain"); kept for other readers.
    is_main_thread: bool,
    register_time: f64,
    unregister_time: Option<f64>,
}

pub(super) fn write_thread<W: Write>(
    w: &mut W,
    shared: &mut Shared<'_>,
    tree: &SymbolizedStacks,
    pid: Pid,
    process_name: &str,
    t: GeckoThread,
) -> io::Result<()> {
    let head = ThreadHead {
        name: &t.name,
        process_type: "default",
        process_name,
        pid: pid.0,
        tid: t.tid.0,
        is_main_thread: t.is_main,
        register_time: t.register_time_ms,
        unregister_time: t.unregister_time_ms,
    };
    let head = serde_json::to_string(&head)?;
    // Reopen the header object to append the tables.
    w.write_all(&head.as_bytes()[..head.len() - 1])?;
    let tables = t.tables;
    w.write_all(b",\"stringTable\":")?;
    tables.strings.write(w, &mut shared.locations, tree)?;
    w.write_all(b",\"frameTable\":{\"schema\":")?;
    w.write_all(shared.frame_schema.get().as_bytes())?;
    w.write_all(b",\"data\":")?;
    tables.frames.write(w, tree)?;
    w.write_all(b"},\"stackTable\":{\"schema\":")?;
    w.write_all(shared.stack_schema.get().as_bytes())?;
    w.write_all(b",\"data\":")?;
    tables.stacks.write(w)?;
    w.write_all(b"},\"samples\":{\"schema\":")?;
    w.write_all(shared.sample_schema.get().as_bytes())?;
    w.write_all(b",\"data\":")?;
    tables.samples.write(w)?;
    w.write_all(b"},\"markers\":{\"schema\":")?;
    w.write_all(shared.marker_columns.get().as_bytes())?;
    w.write_all(b",\"data\":")?;
    tables.markers.write(w)?;
    w.write_all(b"}}")
}
