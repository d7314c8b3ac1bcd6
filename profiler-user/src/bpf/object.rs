//! The loaded BPF object: loads the programs, attaches the sampler to one CPU-clock perf
//! event per online CPU and the lifecycle tracepoints, hands out the USDT program and the
//! ring buffer, and reads the kernel-side counters.

use anyhow::{Context as _, Result, anyhow, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray, ProgramArray, RingBuf},
    programs::{
        PerfEvent, RawTracePoint, TracePoint, UProbe,
        perf_event::{
            PerfEventConfig, PerfEventLinkId, PerfEventScope, SamplePolicy, SoftwareEvent,
        },
        raw_trace_point::RawTracePointLinkId,
        trace_point::TracePointLinkId,
    },
    util::online_cpus,
};
use profiler_common::{
    CgroupFilter, Config, FileKey, TIMING_BUCKETS, TIMING_ENTRIES, UnwindFile, UnwindProcess,
    UsdtSpec, timing_bucket_low,
};

use crate::{bpf::counters::Counters, model::ids::Pid};

static BPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/profiler"));

/// The unwind walker's rows array and per-process mapping tables.
/// (The rows array is mapped into memory, hence its bare `MapData`.)
/// `UNWIND_ROWS`, `UNWIND_PROCS` and `UNWIND_FILES`.
pub type UnwindMaps =
    (MapData, BpfHashMap<MapData, u32, UnwindProcess>, BpfHashMap<MapData, FileKey, UnwindFile>);

/// The BPF programs and maps of one recording.
pub struct BpfObject {
    ebpf: Ebpf,
    pub cpus: Vec<u32>,
    perf_links: Vec<PerfEventLinkId>,
    tp_links: Vec<(&'static str, RawTracePointLinkId)>,
    map_links: Vec<(&'static str, TracePointLinkId)>,
    /// Why mprotect(2)/mremap(2) of code is not tracked (their programs need `bpf_find_vma`,
    /// Linux 5.17+), if it is not: code made executable that way shows as unmapped.
    pub code_changes_untracked: Option<String>,
}

/// mmap/munmap tracking: (program, syscall tracepoint).
const MAP_PROGRAMS: [(&str, &str); 3] = [
    ("on_enter_mmap", "sys_enter_mmap"),
    ("on_exit_mmap", "sys_exit_mmap"),
    ("on_enter_munmap", "sys_enter_munmap"),
];
/// mprotect/mremap tracking (code made executable or moved): all four or none.
const CODE_CHANGE_PROGRAMS: [(&str, &str); 4] = [
    ("on_enter_mprotect", "sys_enter_mprotect"),
    ("on_exit_mprotect", "sys_exit_mprotect"),
    ("on_enter_mremap", "sys_enter_mremap"),
    ("on_exit_mremap", "sys_exit_mremap"),
];
/// The VMA walks the mprotect/mremap hooks tail-call, by slot of `CODE_RANGE_PROGS`.
const CODE_RANGE_WALKS: [(&str, u32); 2] = [
    ("check_code_range", profiler_common::code_range::CHECK_CODE_RANGE),
    ("send_code_range", profiler_common::code_range::SEND_CODE_RANGE),
];
/// Process lifecycle and scheduling: (program, raw tracepoint).
const LIFECYCLE_PROGRAMS: [(&str, &str); 4] = [
    ("on_fork", "sched_process_fork"),
    ("on_exec", "sched_process_exec"),
    ("on_exit", "sched_process_exit"),
    ("on_sched_switch", "sched_switch"),
];

impl BpfObject {
    /// Loads the programs (not yet attached). `ring_bytes` must be a power-of-two multiple of
    /// the page size.
    /// `unwind_rows`: capacity of the unwind table rows array (at least 1).
    pub fn load(
        mut config: Config,
        cgroups: CgroupFilter,
        ring_bytes: u32,
        unwind_rows: u32,
    ) -> Result<Self> {
        bump_memlock_rlimit();
        let cpus = online_cpus().map_err(|(what, e)| anyhow!("{what}: {e}"))?;
        // Stack copies may take a quarter of the ring per 100 ms, shared by the CPUs (label
        // pushes a quarter of that more): at that rate the quarter-full ring wakes the loop
        // within 100 ms, and the rest of the ring holds another 300 ms before a sample is lost.
        // A tenth had been right for a 16 MiB ring at 999 Hz on 2 CPUs, but starved the 4 MiB
        // one it has now: an exec storm (1,000 new processes a second, each wanting copies
        // until its tables land) had 7,664 copies over budget in 20 s, against none; a
        // recording's start-up, while its tables load, wants a third of its samples copied.
        config.stack_copy_budget = ring_bytes / (cpus.len() as u32).max(1) / 4;
        let ebpf = EbpfLoader::new()
            .override_global("CONFIG", &config, true)
            .override_global("CGROUP_FILTER", &cgroups, true)
            .map_max_entries("EVENTS", ring_bytes)
            .map_max_entries("UNWIND_ROWS", unwind_rows.max(1))
            .load(BPF_OBJECT)
            .context("load BPF programs")?;
        Ok(Self {
            ebpf,
            cpus,
            perf_links: Vec::new(),
            tp_links: Vec::new(),
            map_links: Vec::new(),
            code_changes_untracked: None,
        })
    }

    /// Selects processes for the `-p` / `-- CMD` filter; call before `attach`.
    pub fn add_targets(&mut self, pids: &[Pid]) -> Result<()> {
        let mut map: BpfHashMap<&mut MapData, u32, u8> =
            BpfHashMap::try_from(self.ebpf.map_mut("TARGETS").context("TARGETS map")?)?;
        for pid in pids {
            map.insert(pid.0, 1, 0).with_context(|| format!("add pid {pid} to filter"))?;
        }
        Ok(())
    }

    /// Selects cgroups (by cgroup v2 id) for the cgroup filter; call before `attach`.
    pub fn add_cgroups(&mut self, ids: &[u64]) -> Result<()> {
        let mut map: BpfHashMap<&mut MapData, u64, u8> = BpfHashMap::try_from(
            self.ebpf.map_mut("SELECTED_CGROUPS").context("SELECTED_CGROUPS map")?,
        )?;
        for &id in ids {
            map.insert(id, 1, 0).with_context(|| format!("add cgroup id {id} to filter"))?;
        }
        Ok(())
    }

    /// Loads every program first (the verifier takes most of start-up: hundreds of
    /// milliseconds), then attaches them in quick succession: the mapping records, then the
    /// lifecycle tracepoints, so no fork/exec between the steps is missed, and sched_switch so
    /// most CPUs have seen a switch (making CPU time current) by the first sample, then the
    /// sampler on every online CPU. Loading between attaches left a window in which new
    /// processes had their mappings recorded but not their fork or exec.
    pub fn attach(&mut self, frequency: u64) -> Result<()> {
        for prog in MAP_PROGRAMS.iter().map(|(p, _)| p) {
            let p: &mut TracePoint = self.ebpf.program_mut(prog).context(*prog)?.try_into()?;
            p.load().with_context(|| format!("load {prog}"))?;
        }
        // mprotect/mremap tracking needs bpf_find_vma (5.17+); without it the rest works.
        let code_changes_loaded = CODE_CHANGE_PROGRAMS.iter().try_for_each(|(prog, _)| {
            let p: &mut TracePoint = self.ebpf.program_mut(prog).context(*prog)?.try_into()?;
            p.load().with_context(|| format!("load {prog}"))
        });
        let code_changes_loaded = code_changes_loaded.and_then(|()| self.load_code_range_walks());
        for (prog, _) in LIFECYCLE_PROGRAMS {
            let p: &mut RawTracePoint = self.ebpf.program_mut(prog).context(prog)?.try_into()?;
            p.load().with_context(|| format!("load {prog}"))?;
        }
        let sampler: &mut PerfEvent =
            self.ebpf.program_mut("on_cpu_clock").context("on_cpu_clock")?.try_into()?;
        sampler.load().context("load the CPU-clock sampler")?;

        self.attach_maptrack(code_changes_loaded)?;
        for (prog, tp) in LIFECYCLE_PROGRAMS {
            let p: &mut RawTracePoint = self.ebpf.program_mut(prog).context(prog)?.try_into()?;
            let link = p.attach(tp).with_context(|| format!("attach {prog} to {tp}"))?;
            self.tp_links.push((prog, link));
        }
        let p: &mut PerfEvent =
            self.ebpf.program_mut("on_cpu_clock").context("on_cpu_clock")?.try_into()?;
        for &cpu in &self.cpus {
            let link = p
                .attach(
                    PerfEventConfig::Software(SoftwareEvent::CpuClock),
                    PerfEventScope::AllProcessesOneCpu { cpu },
                    SamplePolicy::Frequency(frequency),
                    false,
                )
                .with_context(|| format!("attach CPU-clock sampler to CPU {cpu}"))?;
            self.perf_links.push(link);
        }
        Ok(())
    }

    /// Loads the VMA walks and puts them in the slots the mprotect/mremap hooks tail-call.
    fn load_code_range_walks(&mut self) -> Result<()> {
        let mut fds = Vec::new();
        for (prog, slot) in CODE_RANGE_WALKS {
            let p: &mut TracePoint = self.ebpf.program_mut(prog).context(prog)?.try_into()?;
            p.load().with_context(|| format!("load {prog}"))?;
            fds.push((slot, p.fd()?.try_clone()?));
        }
        // The map stays in `self.ebpf`: the kernel empties a program array once userspace
        // holds no reference to it.
        let map = self.ebpf.map_mut("CODE_RANGE_PROGS").context("CODE_RANGE_PROGS map")?;
        let mut slots = ProgramArray::try_from(map)?;
        for (slot, fd) in &fds {
            slots.set(*slot, fd, 0).context("fill CODE_RANGE_PROGS")?;
        }
        Ok(())
    }

    /// Mapping records (profiler-ebpf maptrack.rs), attached before the lifecycle tracepoints:
    /// a process exec'd after the attach has all its mappings recorded. `code_changes` says
    /// whether the mprotect/mremap programs loaded.
    fn attach_maptrack(&mut self, code_changes: Result<()>) -> Result<()> {
        for (prog, tp) in MAP_PROGRAMS {
            let p: &mut TracePoint = self.ebpf.program_mut(prog).context(prog)?.try_into()?;
            let link =
                p.attach("syscalls", tp).with_context(|| format!("attach {prog} to {tp}"))?;
            self.map_links.push((prog, link));
        }
        let mut attached = Vec::new();
        let result = code_changes.and_then(|()| {
            for (prog, tp) in CODE_CHANGE_PROGRAMS {
                let p: &mut TracePoint = self.ebpf.program_mut(prog).context(prog)?.try_into()?;
                let link =
                    p.attach("syscalls", tp).with_context(|| format!("attach {prog} to {tp}"))?;
                attached.push((prog, link));
            }
            Ok(())
        });
        if let Err(e) = result {
            // Without the exit half, an entry would only fill RANGE_PENDING.
            for (prog, link) in attached.drain(..) {
                if let Some(Ok(p)) = self.ebpf.program_mut(prog).map(<&mut TracePoint>::try_from) {
                    let _ = p.detach(link);
                }
            }
            self.code_changes_untracked = Some(format!("{e:#}"));
        }
        self.map_links.extend(attached);
        Ok(())
    }

    pub fn take_ring(&mut self) -> Result<RingBuf<MapData>> {
        let map = self.ebpf.take_map("EVENTS").context("EVENTS map")?;
        Ok(RingBuf::try_from(map)?)
    }

    /// Loads `name_kernel_addrs` and hands it, with its batch map, to a namer of kernel
    /// addresses (see `bpf::ksym`).
    pub fn kernel_namer(&mut self) -> Result<super::ksym::KernelNamer> {
        use std::os::fd::AsFd as _;
        let prog = "name_kernel_addrs";
        let p: &mut RawTracePoint = self.ebpf.program_mut(prog).context(prog)?.try_into()?;
        p.load().with_context(|| format!("load {prog}"))?;
        let fd = p.fd()?.as_fd().try_clone_to_owned()?;
        let map = self.ebpf.take_map("KSYM_BATCH").context("KSYM_BATCH map")?;
        Ok(super::ksym::KernelNamer::new(fd, Array::try_from(map)?))
    }

    /// The unwind walker's rows array and per-process mapping tables.
    pub fn take_unwind_maps(&mut self) -> Result<UnwindMaps> {
        let rows = self.ebpf.take_map("UNWIND_ROWS").context("UNWIND_ROWS map")?;
        let procs = self.ebpf.take_map("UNWIND_PROCS").context("UNWIND_PROCS map")?;
        let files = self.ebpf.take_map("UNWIND_FILES").context("UNWIND_FILES map")?;
        let aya::maps::Map::Array(rows) = rows else { bail!("UNWIND_ROWS is not an array") };
        Ok((rows, BpfHashMap::try_from(procs)?, BpfHashMap::try_from(files)?))
    }

    /// The processes running CPython and the interpreter files known, for the Python frame
    /// walker (`crate::python::loader`).
    pub fn take_python_maps(&mut self) -> Result<crate::python::loader::PyMaps> {
        let procs = self.ebpf.take_map("PY_PROCS").context("PY_PROCS map")?;
        let files = self.ebpf.take_map("PY_FILES").context("PY_FILES map")?;
        Ok((BpfHashMap::try_from(procs)?, BpfHashMap::try_from(files)?))
    }

    /// Loads the USDT uprobe program; returns its fd (for links `usdt::attach` creates) and
    /// the spec array its cookies index.
    pub fn usdt_program(&mut self) -> Result<(std::os::fd::OwnedFd, Array<MapData, UsdtSpec>)> {
        use std::os::fd::AsFd as _;
        let p: &mut UProbe = self.ebpf.program_mut("on_usdt").context("on_usdt")?.try_into()?;
        p.load().context("load the USDT program")?;
        let fd = p.fd()?.as_fd().try_clone_to_owned()?;
        let map = self.ebpf.take_map("USDT_SPECS").context("USDT_SPECS map")?;
        Ok((fd, Array::try_from(map)?))
    }

    /// One kernel counter (`profiler_common::counter`), summed over CPUs.
    pub fn counter(&self, index: u32) -> Result<u64> {
        let arr: PerCpuArray<&MapData, u64> =
            PerCpuArray::try_from(self.ebpf.map("COUNTERS").context("COUNTERS map")?)?;
        Ok(arr.get(&index, 0)?.iter().sum())
    }

    /// Every kernel counter, summed over CPUs.
    /// The off-CPU records the kernel still owes at `now_ns` (see `unsent`): read after
    /// `detach`, so no switch changes an entry while it is read.
    pub fn unsent_off_cpu(&self, now_ns: u64) -> Result<(Vec<Vec<u8>>, super::unsent::Unsent)> {
        let map = self.ebpf.map("OFF_CPU").context("OFF_CPU map")?;
        let map = BpfHashMap::<_, u32, profiler_common::OffCpuRecord>::try_from(map)?;
        let (mut unsent, mut out) = (super::unsent::Unsent::default(), Vec::new());
        for entry in map.iter() {
            // An entry removed (its thread exited) between two reads: nothing owed.
            let Ok((_, e)) = entry else { continue };
            super::unsent::records(&e, now_ns, &mut unsent, &mut out);
        }
        Ok((out, unsent))
    }

    pub fn counters(&self) -> Result<Counters> {
        Counters::read(|i| self.counter(i))
    }

    /// (runs, total run time) of BPF program `prog` (`on_cpu_clock`, `on_sched_switch`, ...),
    /// counted by the kernel only while `kernel.bpf_stats_enabled` is 1; None when it was off.
    pub fn run_stats(&self, prog: &str) -> Option<(u64, std::time::Duration)> {
        let info = self.ebpf.program(prog)?.info().ok()?;
        (info.run_count() > 0).then(|| (info.run_count(), info.run_time()))
    }

    /// (name, runs, total run time) of every loaded program the kernel counted runs of
    /// (`kernel.bpf_stats_enabled` is or was 1), by name.
    pub fn all_run_stats(&self) -> Vec<(String, u64, std::time::Duration)> {
        let mut v: Vec<_> = self
            .ebpf
            .programs()
            .filter_map(|(name, p)| {
                let info = p.info().ok()?;
                (info.run_count() > 0).then(|| (name.to_owned(), info.run_count(), info.run_time()))
            })
            .collect();
        v.sort();
        v
    }

    /// The sampler's per-sample run times (`--bpf-timing`), summed over CPUs.
    pub fn sampler_timing(&self) -> Result<SamplerTiming> {
        let arr: PerCpuArray<&MapData, u64> =
            PerCpuArray::try_from(self.ebpf.map("SAMPLER_TIMING").context("SAMPLER_TIMING map")?)?;
        let mut all = vec![0u64; TIMING_ENTRIES as usize];
        for (i, slot) in all.iter_mut().enumerate() {
            *slot = arr.get(&(i as u32), 0)?.iter().sum();
        }
        let (buckets, tail) = all.split_at(TIMING_BUCKETS as usize);
        Ok(SamplerTiming {
            buckets: buckets.to_vec(),
            samples: tail[0],
            user_frames: tail[1],
            ring_bytes: tail[2],
        })
    }

    /// Instructions the verifier processed to load `prog` (its `verified_insns`).
    pub fn verified_insns(&self, prog: &str) -> Option<u32> {
        self.ebpf.program(prog)?.info().ok()?.verified_instruction_count()
    }

    /// Stops sampling and lifecycle events; maps stay readable for the final drain.
    pub fn detach(&mut self) {
        if let Some(p) = self.ebpf.program_mut("on_cpu_clock") {
            let p: &mut PerfEvent = p.try_into().expect("on_cpu_clock is a perf_event program");
            for link in self.perf_links.drain(..) {
                let _ = p.detach(link);
            }
        }
        for (prog, link) in self.map_links.drain(..) {
            if let Some(Ok(p)) = self.ebpf.program_mut(prog).map(<&mut TracePoint>::try_from) {
                let _ = p.detach(link);
            }
        }
        for (prog, link) in self.tp_links.drain(..) {
            if let Some(p) = self.ebpf.program_mut(prog) {
                let p: &mut RawTracePoint = p.try_into().expect("raw tracepoint program");
                let _ = p.detach(link);
            }
        }
    }
}

/// `--bpf-timing`: a histogram of the sampler's run time per sample.
pub struct SamplerTiming {
    /// Samples per `profiler_common::timing_bucket`.
    pub buckets: Vec<u64>,
    pub samples: u64,
    pub user_frames: u64,
    /// Ring buffer bytes the timed samples took.
    pub ring_bytes: u64,
}

impl SamplerTiming {
    /// The `q` quantile (0..=1) in ns: the middle of the bucket holding it; None without
    /// samples.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total: u64 = self.buckets.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        for (i, &n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Some(Self::middle(i as u32));
            }
        }
        None
    }

    /// The mean in ns, each sample counted at the middle of its bucket (so within 6.25 % of
    /// the true mean); None without samples.
    pub fn mean(&self) -> Option<f64> {
        let total: u64 = self.buckets.iter().sum();
        let sum: f64 =
            self.buckets.iter().enumerate().map(|(i, &n)| n as f64 * Self::middle(i as u32)).sum();
        (total > 0).then(|| sum / total as f64)
    }

    /// The middle of bucket `i` (its one value below 8 ns).
    fn middle(i: u32) -> f64 {
        let (lo, hi) = (timing_bucket_low(i), timing_bucket_low(i + 1));
        (lo as f64 + hi.max(lo + 1) as f64 - 1.0) / 2.0
    }
}

impl std::fmt::Display for SamplerTiming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ns = |q| self.quantile(q).map_or_else(|| "n/a".to_owned(), |v| format!("{v:.0}"));
        write!(
            f,
            "BPF sampler per sample (--bpf-timing): {} samples, median {} ns, p99 {} ns, mean {} \
             ns; {:.1} user frames and {:.0} ring buffer bytes per sample; p10 {} ns (the least \
             disturbed by other work on a busy host)",
            self.samples,
            ns(0.5),
            ns(0.99),
            self.mean().map_or_else(|| "n/a".to_owned(), |v| format!("{v:.0}")),
            self.user_frames as f64 / self.samples.max(1) as f64,
            self.ring_bytes as f64 / self.samples.max(1) as f64,
            ns(0.1)
        )
    }
}

/// Kernels before 5.11 charge BPF maps to RLIMIT_MEMLOCK.
fn bump_memlock_rlimit() {
    let r = libc::rlimit { rlim_cur: libc::RLIM_INFINITY, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: plain syscall with a valid struct.
    unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &r) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timing_mean_and_quantiles_use_bucket_middles() {
        let mut buckets = vec![0u64; TIMING_BUCKETS as usize];
        let b = |ns| profiler_common::timing_bucket(ns) as usize;
        buckets[b(1000)] = 3;
        buckets[b(5000)] = 1;
        let t = SamplerTiming { buckets, samples: 4, user_frames: 0, ring_bytes: 0 };
        let mid = |ns| SamplerTiming::middle(profiler_common::timing_bucket(ns));
        assert_eq!(t.quantile(0.5), Some(mid(1000)));
        assert_eq!(t.quantile(0.99), Some(mid(5000)));
        let mean = t.mean().unwrap();
        assert_eq!(mean, (3.0 * mid(1000) + mid(5000)) / 4.0);
        // A bucket's middle is within its 12.5 %-wide range.
        assert!((mid(5000) - 5000.0).abs() <= 5000.0 / 8.0);
        assert!(text_has_mean(&t.to_string()));
    }

    fn text_has_mean(s: &str) -> bool {
        s.contains(", mean ") && s.contains(" ns; ")
    }
}
