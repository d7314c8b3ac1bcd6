//! The one table of kernel counters: index (`profiler_common::counter`), name and help text.
//! The summary, the USDT report and metrics all read counters through it.

use profiler_common::counter::{self, COUNT};

pub struct CounterDef {
    pub index: u32,
    /// snake_case, unique; a metric name part.
    pub name: &'static str,
    pub help: &'static str,
}

const fn def(index: u32, name: &'static str, help: &'static str) -> CounterDef {
    CounterDef { index, name, help }
}

/// Every counter the BPF programs keep, in index order.
pub const COUNTERS: &[CounterDef] = &[
    def(counter::SAMPLES_SENT, "samples_sent", "Samples written to the ring buffer"),
    def(
        counter::SAMPLES_FILTERED,
        "samples_filtered",
        "Samples of tasks the filters do not select",
    ),
    def(counter::LOST_RINGBUF_FULL, "samples_lost_ringbuf_full", "Samples lost: ring buffer full"),
    def(
        counter::LOST_NO_SCRATCH,
        "samples_lost_no_scratch",
        "Samples lost: no per-CPU scratch buffer",
    ),
    def(
        counter::KERNEL_STACK_ERRORS,
        "kernel_stack_errors",
        "Samples whose kernel stack could not be read",
    ),
    def(
        counter::USER_STACK_ERRORS,
        "user_stack_errors",
        "Samples whose user stack could not be read",
    ),
    def(
        counter::LOST_TASK_EVENTS,
        "task_events_lost",
        "Fork/exec/exit records lost: ring buffer full",
    ),
    def(
        counter::CPU_TIME_ERRORS,
        "cpu_time_errors",
        "Samples whose task CPU time could not be read",
    ),
    def(
        counter::TARGETS_FULL,
        "targets_full",
        "Children of the command not followed: target set full",
    ),
    def(counter::USDT_SENT, "usdt_hits_sent", "USDT hits written to the ring buffer"),
    def(
        counter::USDT_LOST_RINGBUF_FULL,
        "usdt_hits_lost_ringbuf_full",
        "USDT hits lost: ring buffer full",
    ),
    def(
        counter::USDT_LOST_OTHER,
        "usdt_hits_lost_other",
        "USDT hits lost: no scratch buffer or unknown spec",
    ),
    def(counter::USDT_ARG_ERRORS, "usdt_arg_errors", "USDT arguments that could not be read"),
    def(counter::USDT_STR_NULL, "usdt_str_null", "USDT string arguments that were NULL"),
    def(
        counter::USDT_STR_UNREADABLE,
        "usdt_str_unreadable",
        "USDT string arguments the kernel could not read",
    ),
    def(
        counter::USDT_STR_TRUNCATED,
        "usdt_str_truncated",
        "USDT string arguments cut at the length limit",
    ),
    def(counter::LABEL_PUSHES, "label_pushes", "rsprof:label_push hits"),
    def(counter::LABEL_POPS, "label_pops", "rsprof:label_pop hits"),
    def(counter::LABEL_OVERFLOWS, "label_overflows", "Label pushes beyond the stack depth limit"),
    def(counter::LABEL_UNDERFLOWS, "label_underflows", "Label pops with an empty label stack"),
    def(counter::LABEL_MAP_FULL, "label_map_full", "Label pushes lost: thread label map full"),
    def(counter::SAMPLES_WITH_LABELS, "samples_with_labels", "Samples that carried a label"),
    def(
        counter::CPU_TIME_STALE,
        "cpu_time_stale",
        "Samples whose CPU time is as of the last tick (no context switch seen on the CPU yet)",
    ),
    def(
        counter::OFF_CPU_SENT,
        "off_cpu_blocks_sent",
        "Off-CPU blocks at least --off-cpu-min long, sent one by one",
    ),
    def(
        counter::OFF_CPU_SUMMED,
        "off_cpu_blocks_summed",
        "Off-CPU blocks shorter than --off-cpu-min, summed per thread",
    ),
    def(
        counter::OFF_CPU_LOST_RINGBUF_FULL,
        "off_cpu_blocks_lost_ringbuf_full",
        "Off-CPU blocks lost: ring buffer full",
    ),
    def(
        counter::OFF_CPU_LOST_MAP_FULL,
        "off_cpu_blocks_lost_map_full",
        "Off-CPU blocks not tracked: off-CPU thread map full",
    ),
    def(
        counter::OFF_CPU_SUMS_SENT,
        "off_cpu_sums_sent",
        "Records carrying a thread's summed short off-CPU blocks",
    ),
    def(
        counter::OFF_CPU_SUMS_DEFERRED,
        "off_cpu_sums_deferred",
        "Summed off-CPU records that did not fit in the ring buffer (kept pending)",
    ),
    def(
        counter::OFF_CPU_STACK_ERRORS,
        "off_cpu_stack_errors",
        "Off-CPU stacks (kernel or user) that could not be read",
    ),
    def(
        counter::MAP_EVENTS_SENT,
        "map_events_sent",
        "Executable mappings and removals written to the ring buffer",
    ),
    def(counter::MAP_EVENTS_LOST, "map_events_lost", "Mapping records lost: ring buffer full"),
    def(
        counter::MAP_PATH_INCOMPLETE,
        "map_path_incomplete",
        "Mapped files whose path the kernel could not walk to the root",
    ),
    def(
        counter::OFF_CPU_NOT_CAPTURED,
        "off_cpu_blocks_not_captured",
        "Off-CPU blocks at least --off-cpu-min long sent without a stack (not walked)",
    ),
    def(
        counter::OFF_CPU_WALKS,
        "off_cpu_stack_walks",
        "Off-CPU switch-outs whose stacks were walked",
    ),
    def(counter::UNWIND_COMPLETE, "unwind_complete", "User stacks walked to the outermost frame"),
    def(counter::UNWIND_DEPTH, "unwind_depth_limit", "User stacks cut at the depth limit"),
    def(
        counter::UNWIND_NO_PROCESS,
        "unwind_no_process",
        "User stacks of processes whose mappings were not in the kernel yet",
    ),
    def(counter::UNWIND_NO_MAPPING, "unwind_no_mapping", "User stacks ended at an unmapped PC"),
    def(
        counter::UNWIND_NO_TABLE,
        "unwind_no_table",
        "User stacks ended in a file whose unwind table is not loaded",
    ),
    def(counter::UNWIND_NO_CFI, "unwind_no_cfi", "User stacks ended in code without CFI"),
    def(
        counter::UNWIND_UNSUPPORTED,
        "unwind_unsupported",
        "User stacks ended at a CFI rule the tables cannot express",
    ),
    def(
        counter::UNWIND_READ_FAULT,
        "unwind_read_fault",
        "User stacks ended by an unreadable stack",
    ),
    def(
        counter::UNWIND_FRAME_POINTER,
        "unwind_frame_pointer_end",
        "User stacks ended while following frame pointers",
    ),
    def(
        counter::UNWIND_USED_FP,
        "unwind_used_frame_pointers",
        "User stacks that followed frame pointers through code without tables",
    ),
    def(
        counter::STACK_COPIES,
        "stack_copies",
        "Samples sent with a copy of their user stack (walk stopped for want of a table)",
    ),
    def(counter::STACK_COPY_BYTES, "stack_copy_bytes", "User stack bytes copied into samples"),
    def(
        counter::STACK_COPY_FAILED,
        "stack_copy_failed",
        "Walks stopped for want of a table whose stack could not be copied",
    ),
    def(
        counter::STACK_COPY_OVER_BUDGET,
        "stack_copy_over_budget",
        "Walks stopped for want of a table not copied: the CPU's copy budget was used up",
    ),
    def(
        counter::MAP_VMA_UNREAD,
        "map_vma_unread",
        "mprotect/mremap of code whose mappings the kernel could not look up",
    ),
    def(
        counter::LABEL_DEPTH_RECORDS,
        "label_depth_records",
        "Label pushes whose stack had no table in the kernel yet, sent for userspace to walk",
    ),
    def(
        counter::LABEL_DEPTH_LOST,
        "label_depth_lost",
        "Label pushes whose depth record was lost to a full ring buffer",
    ),
    def(
        counter::FORK_WALKER_COPIES,
        "fork_walker_copies",
        "New processes (fork without exec) given their parent's walker entry at fork",
    ),
    def(
        counter::FORK_WALKER_COPY_FAILED,
        "fork_walker_copy_failed",
        "Forks whose walker entry could not be copied (map full)",
    ),
    def(
        counter::OFF_CPU_COPIES,
        "off_cpu_stack_copies",
        "Off-CPU switch-outs sent with a copy of the user stack (walk stopped for want of a table)",
    ),
    def(
        counter::OFF_CPU_COPY_LOST,
        "off_cpu_stack_copy_lost",
        "Off-CPU switch-outs whose stack copy could not be sent (budget, unreadable, ring full)",
    ),
    def(
        counter::WALKER_EXIT_DELETES,
        "walker_exit_deletes",
        "Walker entries deleted by the kernel at their process's exit",
    ),
    def(
        counter::WALKER_EXEC_CLEARS,
        "walker_exec_clears",
        "Walker entries emptied by the kernel at an exec, until userspace writes the new image's",
    ),
    def(
        counter::EARLY_ADDED,
        "walker_early_mappings",
        "Code mappings of loaded files the kernel gave the walker at mmap/exec, before userspace read them",
    ),
    def(
        counter::EARLY_REMOVED,
        "walker_early_removed",
        "Early walker mappings removed by munmap, mprotect or mremap of their range",
    ),
    def(
        counter::EARLY_BUSY,
        "walker_early_busy",
        "Code mappings not given to the walker early because another thread of the process was adding one",
    ),
    def(
        counter::EARLY_FILE_CHANGED,
        "walker_early_file_changed",
        "Code mappings of a file whose size or mtime no longer match its loaded table (rewritten in place)",
    ),
];

/// Every kernel counter, summed over CPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counters([u64; COUNT as usize]);

impl Default for Counters {
    fn default() -> Self {
        Self([0; COUNT as usize])
    }
}

impl Counters {
    /// Reads each counter through `read(index)`.
    pub fn read<E>(mut read: impl FnMut(u32) -> Result<u64, E>) -> Result<Self, E> {
        let mut c = Self::default();
        for d in COUNTERS {
            c.0[d.index as usize] = read(d.index)?;
        }
        Ok(c)
    }

    /// One counter by its `profiler_common::counter` index.
    pub fn get(&self, index: u32) -> u64 {
        self.0.get(index as usize).copied().unwrap_or(0)
    }

    /// Samples the kernel took but could not send.
    pub fn lost_samples(&self) -> u64 {
        self.get(counter::LOST_RINGBUF_FULL) + self.get(counter::LOST_NO_SCRATCH)
    }

    /// Off-CPU blocks the kernel tracked but could not send.
    pub fn lost_off_cpu(&self) -> u64 {
        self.get(counter::OFF_CPU_LOST_RINGBUF_FULL) + self.get(counter::OFF_CPU_LOST_MAP_FULL)
    }

    /// (definition, value) of every counter.
    pub fn iter(&self) -> impl Iterator<Item = (&'static CounterDef, u64)> + '_ {
        COUNTERS.iter().map(|d| (d, self.get(d.index)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_lists_every_counter_once_in_order() {
        let indices: Vec<u32> = COUNTERS.iter().map(|d| d.index).collect();
        assert_eq!(indices, (0..COUNT).collect::<Vec<_>>());
        let mut names: Vec<&str> = COUNTERS.iter().map(|d| d.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), COUNTERS.len(), "names are unique");
    }

    #[test]
    fn reads_by_index() {
        let c = Counters::read(|i| Ok::<_, ()>(u64::from(i) * 10)).unwrap();
        assert_eq!(c.get(counter::LOST_NO_SCRATCH), 30);
        assert_eq!(c.lost_samples(), 20 + 30);
        assert_eq!(c.iter().count(), COUNT as usize);
    }
}
