//! A thread's `samples` table, kept compact until written.

use std::io::{self, Write};

/// Column order; rows follow it.
pub(super) const SCHEMA: &[&str] = &["stack", "time", "eventDelay", "threadCPUDelta"];

/// A sample row; `u32::MAX` / `u64::MAX` stand for null.
#[derive(Clone, Copy)]
pub(super) struct Row {
    pub(super) time_ms: f64,
    pub(super) cpu_delta_ns: u64,
    pub(super) stack: u32,
}

#[derive(Default)]
pub(super) struct SampleTable {
    pub(super) rows: Vec<Row>,
    pub(super) count: u64,
    /// Samples that are neither idle nor off-CPU: how busy the thread was.
    pub(super) busy: u64,
    pub(super) first_ms: f64,
    pub(super) last_ms: f64,
    /// Off-CPU time not yet written as a sample (less than one sampling interval).
    off_cpu_carry_ns: u64,
}

impl SampleTable {
    /// `time_ms`, raised to the last sample's time: the table stays sorted.
    pub(super) fn in_order(&self, time_ms: f64) -> f64 {
        time_ms.max(if self.count > 0 { self.last_ms } else { f64::MIN })
    }

    pub(super) fn push(
        &mut self,
        time_ms: f64,
        cpu_delta_ns: Option<u64>,
        stack: Option<u32>,
        busy: bool,
    ) {
        self.rows.push(Row {
            time_ms,
            cpu_delta_ns: cpu_delta_ns.unwrap_or(u64::MAX),
            stack: stack.unwrap_or(u32::MAX),
        });
        if self.count == 0 {
            self.first_ms = time_ms;
        }
        self.count += 1;
        self.busy += u64::from(busy);
        self.last_ms = time_ms;
    }

    /// How many whole samples of period `interval_ns` off-CPU time `weight_ns` makes, the
    /// remainder carried over to the thread's next off-CPU time.
    pub(super) fn off_cpu_samples(&mut self, weight_ns: u64, interval_ns: u64) -> u64 {
        self.off_cpu_carry_ns += weight_ns;
        let n = self.off_cpu_carry_ns / interval_ns;
        self.off_cpu_carry_ns -= n * interval_ns;
        n
    }

    pub(super) fn write<W: Write>(&self, w: &mut W) -> io::Result<()> {
        w.write_all(b"[")?;
        for (i, r) in self.rows.iter().enumerate() {
            if i > 0 {
                w.write_all(b",")?;
            }
            let stack = (r.stack != u32::MAX).then_some(r.stack);
            let cpu = (r.cpu_delta_ns != u64::MAX).then_some(r.cpu_delta_ns);
            serde_json::to_writer(&mut *w, &(stack, r.time_ms, 0, cpu))?;
        }
        w.write_all(b"]")
    }
}
