//! A running recording: load and attach (`Recorder::start`), the event loop that drains the
//! ring buffer until a stop condition (`Recorder::run`), snapshots on SIGUSR1, and the end
//! (`Recorder::finish`): final drain, profile export and summary. All stderr output goes
//! through `messages`.

pub mod messages;
mod summary;
mod timer;
pub mod windows;

use std::{
    fmt::Write as _,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use aya::maps::{MapData, RingBuf};
use profiler_common::{Config, FILTER_TARGETS, UNWIND_MODE_FP, counter};
use tokio::{
    io::{Interest, unix::AsyncFd},
    signal::unix::{Signal, SignalKind, signal},
    sync::{mpsc, oneshot},
};

use crate::{
    bpf::{btf, counters::Counters, object::BpfObject, ring, unsent::Unsent},
    cli::plan::{RecordPlan, Target},
    collect::{
        collector::{Collector, CollectorStats},
        facts::{LiveProc, ProcFacts as _, SharedRaw, TeeProc},
        raw::{self, Entry, RawWriter},
    },
    export::{ExportJob, Written, output::PendingOutput, snapshot_dest},
    model::{
        ids::Pid,
        recording::RecordingInfo,
        time::{MonoNs, clock_pair},
    },
    store::{ChunkedStore, StoreStats, chunks::Recycled},
    symbolize::KernelNamer,
    system::{host, launch, procfs},
    usdt::{self, UsdtSession},
    writers::Format,
};
use messages::Messages;
use timer::DrainTimer;

/// The ring is drained at least this often when nothing wakes the loop. On an idle host a
/// recording's own CPU is mostly its wakeups (17 ms over 20 s at 4 drains a second with tokio's
/// timer, 4 ms at one a second on a timerfd: `BENCHMARKS.md`); what needs a drain sooner wakes
/// the loop from BPF (records the unwinder wants, a quarter-full ring).
const MAX_DRAIN_INTERVAL: Duration = Duration::from_secs(1);
/// `-- CMD` waits at most this for the tables its last run loaded (read from the disk cache:
/// tens of milliseconds for a compiler's 350 MB of libraries) before it starts.
const LAUNCH_LIST_WAIT: Duration = Duration::from_secs(1);
/// A drain the BPF programs ask for comes at least this long after the previous one, so a
/// storm of waking records (exec storms with the DWARF unwinder, bursts past the wake
/// threshold) cannot spin the loop. The BPF side wakes at most this often for records the
/// unwinder wants soon, and a drain that saw such records is followed by another this long
/// after, which collects the ones that did not wake us.
const MIN_DRAIN_GAP: Duration = Duration::from_nanos(profiler_common::WAKE_GAP_NS);
/// The drain period's bound while CPython processes run: their code objects are read when
/// their samples are drained, and one freed before that cannot be named (its frames say so);
/// 50 ms names the code of a function that lives a tenth of a second.
const PYTHON_DRAIN_INTERVAL: Duration = Duration::from_millis(50);
/// ...while their samples carry Python frames, up to this long after the last did. A process
/// that maps libpython without running it (perf, which embeds it for scripts) never sends
/// any, and must not keep an agent draining 20 times a second for good.
const PYTHON_FRAMES_RECENT: Duration = Duration::from_secs(2);

/// How often to drain the ring on the timer: at most the time full-depth samples on every CPU
/// at `frequency` take to fill the ring, at most `MAX_DRAIN_INTERVAL`. The timer only bounds
/// the delay when little is sent: past a quarter full, every record wakes the loop from BPF
/// (`output` in profiler-ebpf), whatever filled it (deep stacks, USDT hits, off-CPU records,
/// task events). Two periods per ring had halved the period at 999 Hz on 2 CPUs once the
/// default ring shrank to 4 MiB: two wakeups a second for samples that fill 600 KiB.
pub fn drain_interval(ring_bytes: u32, cpus: usize, frequency: u64) -> Duration {
    // Each record has an 8-byte ring header.
    let record = (std::mem::size_of::<profiler_common::SampleRecord>() + 8) as f64;
    let worst_bytes_per_s = cpus.max(1) as f64 * frequency.max(1) as f64 * record;
    let secs = f64::from(ring_bytes) / worst_bytes_per_s;
    Duration::from_secs_f64(secs).clamp(MIN_DRAIN_GAP, MAX_DRAIN_INTERVAL)
}

/// After a drain: the timer's next drain comes a full period later, or `MIN_DRAIN_GAP` later
/// when the drain saw records whose followers may not wake the loop (`Recorder::drain`).
fn follow_up(poll: &DrainTimer, every: Duration, again: bool) -> std::io::Result<()> {
    poll.reset_after(if again { MIN_DRAIN_GAP } else { every })
}

/// Waits for `n`'s next notification (a permit stored meanwhile counts); never without one.
async fn notified(n: Option<&tokio::sync::Notify>) {
    match n {
        Some(n) => n.notified().await,
        None => std::future::pending().await,
    }
}

/// The next request, or never when there is no channel (or it closed).
async fn next_request(rx: &mut Option<mpsc::Receiver<Request>>) -> Option<Request> {
    match rx {
        Some(rx) => match rx.recv().await {
            Some(r) => Some(r),
            None => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}

/// The signals a recording reacts to, installed before anything slow happens.
pub struct Signals {
    int: Signal,
    term: Signal,
    usr1: Signal,
}

impl Signals {
    /// Needs a tokio runtime entered.
    pub fn install() -> Result<Self> {
        Ok(Self {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            usr1: signal(SignalKind::user_defined1())?,
        })
    }
}

/// The unwind loader's part of [`LiveStats`].
#[derive(Clone, Copy, Debug)]
pub struct LiveUnwind {
    /// Files whose table is in the kernel, and their rows, of `rows_capacity`.
    pub tables: u64,
    pub rows: u64,
    pub rows_capacity: u64,
    pub files_without_cfi: u64,
    /// Walker entries written, and deleted by userspace (the kernel deletes the rest at exit).
    pub process_writes: u64,
    pub process_removals: u64,
}

/// What a recording is doing, read when asked (an agent's metrics scrape) rather than kept
/// up to date per sample.
#[derive(Clone, Debug, Default)]
pub struct LiveStats {
    pub counters: Counters,
    /// Bytes waiting in the ring buffer; None if its positions could not be mapped.
    pub ring_used_bytes: Option<u64>,
    pub ring_size_bytes: u64,
    /// (program, runs, run time) of the BPF programs the kernel counted runs of.
    pub bpf_programs: Vec<(String, u64, Duration)>,
    pub processes: usize,
    pub threads: usize,
    pub modules: usize,
    pub collector: CollectorStats,
    pub drains: DrainStats,
    pub store: StoreStats,
    /// Chunk memory allocated, and its bound.
    pub store_bytes: usize,
    pub store_limit_bytes: usize,
    /// Interned stacks and strings.
    pub store_table_bytes: usize,
    pub recycled: Recycled,
    /// Unwind tables: (tables loaded, rows loaded, rows capacity, files without CFI); None
    /// with `--unwind fp`.
    pub unwind: Option<LiveUnwind>,
    /// The USDT exec gate's counters, when it runs.
    pub exec_gate: Option<crate::usdt::gate::GateStats>,
}

/// Questions another task asks the recording loop, answered between drains.
pub enum Request {
    Stats(oneshot::Sender<LiveStats>),
}

pub struct Recorder<'p> {
    plan: &'p RecordPlan,
    msgs: Messages,
    bpf: BpfObject,
    /// Names kernel addresses through `bpf` for this recording's exports (and an agent's
    /// symbolizer).
    kernel: KernelNamer,
    collector: Collector<ChunkedStore>,
    usdt: UsdtSession,
    /// Unwind tables (None with `--unwind fp`).
    unwind: Option<crate::unwind::UnwindLoader>,
    /// Which processes run CPython, for the kernel (None with `--no-python`).
    python: Option<crate::python::loader::PyLoader>,
    ring: AsyncFd<RingBuf<MapData>>,
    info: RecordingInfo,
    child_exit: Option<oneshot::Receiver<i32>>,
    /// `-p`: resolves when every given process has exited.
    targets_exit: Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>>,
    snapshots: Vec<std::thread::JoinHandle<()>>,
    requests: Option<mpsc::Receiver<Request>>,
    ring_fill: Option<ring::RingFill>,
    /// An agent's: `run_until` returns (None) when notified or on SIGUSR1 (then noted in
    /// `usr1`) instead of writing a snapshot.
    wake: Option<std::sync::Arc<tokio::sync::Notify>>,
    usr1: bool,
    /// The timer's drain period (`drain_interval`).
    drain_every: Duration,
    /// For the summary's `event loop:` line and the agent's metrics.
    drains: DrainStats,
    /// The "start-up unwind tables loaded" line was printed (`-v`).
    startup_said: bool,
    /// `--save-raw`: what the collector is fed, for a replay.
    raw: Option<SharedRaw>,
}

/// The event loop's own work: what a recording costs in userspace per record, for the
/// summary (the BPF side's cost is in the kernel's `bpf_stats`).
#[derive(Clone, Copy, Debug, Default)]
pub struct DrainStats {
    pub drains: u64,
    pub records: u64,
    /// Time in drains: the records, then the unwinder's and USDT's work on what they said.
    pub time: Duration,
    /// The longest drain and its records: at start-up one drain compiles the unwind rules
    /// that stack copies need, which would otherwise hide the steady cost per record.
    pub longest: Duration,
    pub longest_records: u64,
}

impl DrainStats {
    fn add(&mut self, records: usize, took: Duration) {
        self.drains += 1;
        self.records += records as u64;
        self.time += took;
        if took > self.longest {
            self.longest = took;
            self.longest_records = records as u64;
        }
    }

    pub fn render(&self, duration_s: f64) -> String {
        let per_record_us = |t: Duration, n: u64| t.as_secs_f64() * 1e6 / n.max(1) as f64;
        format!(
            "event loop: {} drains ({:.1} a second), {} records in {:.1} ms ({:.2} µs a record, \
             all of a drain's work counted); longest drain {:.1} ms, without it {:.2} µs a record",
            self.drains,
            self.drains as f64 / duration_s.max(1e-9),
            self.records,
            self.time.as_secs_f64() * 1e3,
            per_record_us(self.time, self.records),
            self.longest.as_secs_f64() * 1e3,
            per_record_us(self.time - self.longest, self.records - self.longest_records),
        )
    }
}

impl<'p> Recorder<'p> {
    /// Loads the BPF programs, starts `-- CMD` (held until sampling runs), attaches USDT
    /// probes and the sampler, and says "sampling". Needs a tokio runtime entered.
    /// With `raw` (`--save-raw`), what the collector is fed and reads goes there too.
    pub fn start(plan: &'p RecordPlan, msgs: Messages, raw: Option<RawWriter>) -> Result<Self> {
        let raw: Option<SharedRaw> = raw.map(|w| std::sync::Arc::new(std::sync::Mutex::new(w)));
        let exit_watch = match &plan.target {
            Target::Pids(pids) => {
                let (watch, failed) = launch::ExitWatch::open(pids);
                for (pid, e) in failed {
                    msgs.warn(format_args!(
                        "cannot watch pid {pid} for its exit ({e}): recording until -d or Ctrl-C"
                    ));
                }
                Some(watch)
            }
            _ => None,
        };
        let config = kernel_config(plan)?;
        let cgroup_filter = plan.cgroups.as_ref().map(|c| c.kernel_config()).unwrap_or_default();
        // Frame-pointer mode loads no tables: a one-row array.
        let rows = if plan.unwind_mode == UNWIND_MODE_FP { 1 } else { plan.unwind_rows };
        if let crate::system::tracefs::Tracefs::MountedAt(at) =
            crate::system::tracefs::ensure_mounted()?
        {
            msgs.info(format_args!("tracefs was not mounted: mounted it at {at}"));
        }
        let mut bpf = BpfObject::load(config, cgroup_filter, plan.ring_bytes, rows)?;
        let kernel = kernel_namer(&mut bpf, raw.as_ref(), msgs);
        let (mut unwind, mut python) = runtime_loaders(&mut bpf, plan, msgs)?;
        // Before the gated child is registered: its image is this program's, and the files it
        // shares with the command (ld.so, libc, …) are queued for it first. Listed too, they
        // are in the kernel when the command's exec maps them.
        if let (Some(u), Target::Command(_)) = (&mut unwind, &plan.target) {
            u.keep_launch_list();
        }
        if let Some(c) = &plan.cgroups {
            bpf.add_cgroups(&c.ids())?;
        }
        let gated = match &plan.target {
            Target::Command(cmd) => {
                let to_stdout =
                    plan.output_dest == crate::export::output::Destination::Fd(libc::STDOUT_FILENO);
                Some(launch::spawn_gated(cmd, to_stdout)?)
            }
            _ => None,
        };
        let mut targets: Vec<Pid> = match &plan.target {
            Target::Pids(pids) => pids.clone(),
            _ => Vec::new(),
        };
        targets.extend(gated.as_ref().map(|g| g.pid));
        bpf.add_targets(&targets)?;
        let mut usdt = start_usdt(&mut bpf, plan, msgs)?;

        let mut collector = new_collector(plan, raw.as_ref());
        for &pid in &targets {
            register_existing(&mut collector, &raw, pid);
        }
        // The processes given are published (and their files queued) before sampling starts.
        python_after_drain(&mut python, &mut collector);
        if let Some(u) = &mut unwind {
            u.after_drain(&mut collector);
        }
        let ring = bpf.take_ring()?;
        let (start, start_wall_ms) = clock_pair();
        bpf.attach(plan.frequency)?;
        if let Some(why) = &bpf.code_changes_untracked {
            msgs.warn(format_args!(
                "mprotect/mremap of code is not tracked ({why}): code made executable that way \
                 shows as unmapped addresses"
            ));
        }
        // With --all, every process that exists now has its /proc/PID/maps read once, here;
        // processes started from now on are known from the kernel's records (attached above).
        // With a cgroup filter only the selected cgroups' processes: the others' samples never
        // come, and reading (and writing walker entries for) every process would be wasted.
        if plan.target == Target::All {
            let pids = match &plan.cgroups {
                Some(c) => c.pids().into_iter().map(Pid).collect(),
                None => procfs::all_pids(),
            };
            for pid in pids {
                register_existing(&mut collector, &raw, pid);
            }
        }
        usdt.scan_new_modules(&collector);
        usdt.load_deferred(&mut bpf);
        usdt.initial_scan_done();
        collector.initial_scan_done();
        if let Some(raw) = &raw {
            put(raw, &Entry::ScanDone);
        }
        python_after_drain(&mut python, &mut collector);
        // Queues the tables of every process found (compiled off this loop; processes are
        // published now, their frames in files not loaded yet end as "no table").
        if let Some(u) = &mut unwind {
            u.after_drain(&mut collector);
            u.mark_startup();
        }
        let mut child_exit = None;
        // Said with -v only: the default summary stays short (and `-v` repeats it in the
        // unwind block).
        if let (Some(u), Target::Command(cmd)) = (&mut unwind, &plan.target)
            && let Some((listed, loaded, took)) = u.load_launch_list(cmd, LAUNCH_LIST_WAIT)
            && plan.verbose
        {
            msgs.info(format_args!(
                "loaded {loaded} of the {listed} unwind tables {} used last time in {} ms, \
                 before starting it",
                std::path::Path::new(&cmd[0])
                    .file_name()
                    .map_or(cmd[0].as_str().into(), |n| n.to_string_lossy()),
                took.as_millis()
            ));
        }
        if let Some(g) = gated {
            let pid = g.release()?;
            let (tx, rx) = oneshot::channel();
            std::thread::Builder::new()
                .name("wait-cmd".into())
                .spawn(move || tx.send(launch::wait_exit(pid)))?;
            child_exit = Some(rx);
        }
        let targets_exit = exit_watch.map(|w| Box::pin(w.all_exited()) as _);
        msgs.info(format_args!(
            "sampling {} on {} CPUs at {} Hz; Ctrl-C to stop",
            plan.describe(),
            bpf.cpus.len(),
            plan.frequency
        ));
        // SAFETY: the ring's fd stays open as long as the AsyncFd that owns it.
        let ring = unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) }
            .context("poll ring buffer")?;
        let logical_cpus = bpf.cpus.len() as u32;
        let info = RecordingInfo {
            start,
            start_wall_ms,
            end: start,
            frequency: plan.frequency,
            logical_cpus,
            physical_cpus: host::physical_cpus().unwrap_or(logical_cpus),
            product: product(),
            oscpu: host::oscpu(),
        };
        if let Some(raw) = &raw {
            put(raw, &Entry::Info(Box::new(raw::Info::new(&info))));
        }
        // Only for metrics: a recording goes on without it.
        let ring_fill = ring::RingFill::new(ring.get_ref()).ok();
        Ok(Self {
            plan,
            msgs,
            bpf,
            kernel,
            collector,
            usdt,
            unwind,
            python,
            ring,
            info,
            child_exit,
            targets_exit,
            snapshots: Vec::new(),
            requests: None,
            ring_fill,
            wake: None,
            usr1: false,
            drain_every: drain_interval(plan.ring_bytes, logical_cpus as usize, plan.frequency),
            drains: DrainStats::default(),
            startup_said: false,
            raw,
        })
    }

    fn info_at(&self, end: MonoNs) -> RecordingInfo {
        RecordingInfo { end, ..self.info.clone() }
    }

    /// Drains the ring; true if it held records the BPF side may have held a wakeup back for
    /// (task and mapping events, with the DWARF unwinder), so the caller drains again soon.
    /// Records are sent without wakeups (but for those the DWARF unwinder waits for, and any
    /// past a quarter of the ring), so this runs on a timer.
    /// Feeds the collector (and the raw stream) the off-CPU records the kernel still owes at
    /// `end`, once the programs are detached: blocks open at the stop, cut there, and short
    /// blocks summed but not sent (see `bpf::unsent`).
    fn unsent_off_cpu(&mut self, end: MonoNs) -> Unsent {
        if self.plan.off_cpu == profiler_common::OFF_CPU_NONE {
            return Unsent::default();
        }
        match self.bpf.unsent_off_cpu(end.0) {
            Ok((records, unsent)) => {
                for rec in &records {
                    feed(&mut self.collector, self.raw.as_deref(), rec);
                }
                unsent
            }
            Err(e) => {
                self.msgs.warn(format_args!(
                    "off-CPU time still open at the stop is not in the profile: {e:#}"
                ));
                Unsent::default()
            }
        }
    }

    fn drain(&mut self) -> bool {
        let started = Instant::now();
        let events = |c: &Collector<ChunkedStore>| c.stats.task_events + c.stats.map_events;
        let before = events(&self.collector);
        let collector = &mut self.collector;
        let raw = self.raw.as_deref();
        let records = ring::drain(self.ring.get_mut(), |rec| feed(collector, raw, rec));
        if let Some(raw) = &self.raw {
            put(raw, &Entry::Drain(MonoNs::now()));
        }
        python_after_drain(&mut self.python, &mut self.collector);
        if let Some(u) = &mut self.unwind {
            u.after_drain(&mut self.collector);
            // With -v, when the host's tables are in: what tests wait for before a workload
            // whose stacks must be walked from its first sample.
            if let (false, true, Some(after)) =
                (self.startup_said, self.plan.verbose, u.stats.startup_loaded_after)
            {
                self.startup_said = true;
                self.msgs.info(format_args!(
                    "start-up unwind tables loaded: {} files, {:.0} ms after sampling began",
                    u.stats.startup_files,
                    after.as_secs_f64() * 1e3
                ));
            }
        }
        self.usdt.after_drain(&mut self.collector);
        self.usdt.load_deferred(&mut self.bpf);
        self.drains.add(records, started.elapsed());
        let soon = MonoNs::now() < self.collector.drain_soon_until;
        // Without the BPF side's wakeups (`wake_for_tables` off) nothing was held back.
        soon || (self.unwind.is_some()
            && self.plan.eager_tables
            && events(&self.collector) != before)
    }

    /// Drains now, or, within `MIN_DRAIN_GAP` of the last drain, sets `poll` to drain when
    /// the gap is over; true when it drained.
    fn drain_or_defer(
        &mut self,
        poll: &DrainTimer,
        every: Duration,
        last_drain: &mut Instant,
    ) -> std::io::Result<bool> {
        let since = last_drain.elapsed();
        if since < MIN_DRAIN_GAP {
            poll.reset_after(MIN_DRAIN_GAP - since)?;
            return Ok(false);
        }
        let again = self.drain();
        *last_drain = Instant::now();
        follow_up(poll, self.timer_period(every), again)?;
        Ok(true)
    }

    /// Answers `requests` while collecting (`run_until`).
    pub fn serve(&mut self, requests: mpsc::Receiver<Request>) {
        self.requests = Some(requests);
    }

    fn answer(&mut self, req: Request) {
        match req {
            Request::Stats(reply) => {
                let _ = reply.send(self.live_stats());
            }
        }
    }

    /// Reads the counters and sizes now.
    pub fn live_stats(&self) -> LiveStats {
        let c = &self.collector;
        let buffer = c.store.buffer();
        LiveStats {
            counters: self.bpf.counters().unwrap_or_default(),
            ring_used_bytes: self.ring_fill.as_ref().map(|r| r.used_bytes()),
            ring_size_bytes: u64::from(self.plan.ring_bytes),
            bpf_programs: self.bpf.all_run_stats(),
            processes: c.processes.len(),
            threads: c.processes.processes.values().map(|p| p.meta.threads.len()).sum(),
            modules: c.modules.live(),
            collector: c.stats,
            drains: self.drains,
            store: c.store.stats,
            store_bytes: buffer.allocated_bytes(),
            store_limit_bytes: buffer.limit_bytes(),
            store_table_bytes: c.store.table_bytes(),
            recycled: buffer.recycled(),
            unwind: self.unwind.as_ref().map(|u| {
                let st = &u.stats;
                // What is in the kernel now: loaded less evicted.
                LiveUnwind {
                    tables: st.tables_loaded - st.tables_evicted,
                    rows: st.rows_loaded - st.rows_evicted,
                    rows_capacity: st.rows_capacity,
                    files_without_cfi: st.files_without_cfi,
                    process_writes: st.process_updates,
                    process_removals: st.processes_removed,
                }
            }),
            exec_gate: self.usdt.gate_stats(),
        }
    }

    /// Collects until a stop condition; returns what stopped it.
    pub async fn run(&mut self, signals: &mut Signals) -> Result<String> {
        Ok(self.run_until(signals, None).await?.expect("no deadline"))
    }

    /// Collects until a stop condition (returned) or until `until` (None returned).
    pub async fn run_until(
        &mut self,
        signals: &mut Signals,
        until: Option<tokio::time::Instant>,
    ) -> Result<Option<String>> {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        let every = self.drain_every;
        let poll = DrainTimer::new(every)?;
        // A table the workers finish is published by a drain right away, not at the next
        // timed one: the timer's period (up to 1 s) is the whole life of many processes, and
        // a short command's samples stop for want of the table meanwhile.
        let table_done = self.unwind.as_ref().map(|u| u.table_done());
        let mut last_drain = Instant::now();
        // Off while a BPF wakeup waits out MIN_DRAIN_GAP (the timer then drains).
        let mut ring_armed = true;
        let deadline = self.plan.duration.map(|d| tokio::time::Instant::now() + d);
        let sleep = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(sleep);
        // Put back unless it fired, like `targets_exit`: an agent's window or a snapshot
        // returns here and comes back.
        let mut child_exit = self.child_exit.take();
        let child = async {
            match child_exit.as_mut() {
                Some(rx) => rx.await.unwrap_or(-1),
                None => std::future::pending().await,
            }
        };
        tokio::pin!(child);
        let pause = async {
            match until {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(pause);
        let wake = self.wake.clone();
        let woken = async {
            match &wake {
                Some(n) => n.notified().await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(woken);
        // Put back unless it fired: a snapshot or an agent's window calls this again.
        let mut targets_exit = self.targets_exit.take();
        let targets = async {
            match targets_exit.as_mut() {
                Some(f) => f.await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(targets);
        let started = Instant::now();
        let mut requests = self.requests.take();
        let result = loop {
            tokio::select! {
                ready = self.ring.readable_mut(), if ring_armed => match ready {
                    Ok(mut ready) => {
                        ready.clear_ready();
                        match self.drain_or_defer(&poll, every, &mut last_drain) {
                            // Deferred: the timer drains, and re-arms the ring.
                            Ok(drained) => ring_armed = drained,
                            Err(e) => break Err(e.into()),
                        }
                    }
                    Err(e) => break Err(e.into()),
                },
                fired = poll.expired() => {
                    let again = self.drain();
                    last_drain = Instant::now();
                    ring_armed = true;
                    if let Err(e) = fired.and_then(|()| follow_up(&poll, self.timer_period(every), again)) {
                        break Err(e.into());
                    }
                }
                () = notified(table_done.as_deref()) => {
                    if let Err(e) = self.drain_or_defer(&poll, every, &mut last_drain) {
                        break Err(e.into());
                    }
                }
                Some(req) = next_request(&mut requests) => self.answer(req),
                _ = signals.int.recv() => break Ok(Some("Ctrl-C".to_owned())),
                _ = signals.term.recv() => break Ok(Some("SIGTERM".to_owned())),
                _ = signals.usr1.recv() => {
                    if self.wake.is_none() {
                        if let Err(e) = self.snapshot() {
                            break Err(e);
                        }
                    } else {
                        self.usr1 = true;
                        self.drain();
                        break Ok(None);
                    }
                }
                _ = &mut woken => {
                    self.drain();
                    break Ok(None);
                }
                _ = &mut sleep => break Ok(Some("duration".to_owned())),
                _ = &mut pause => {
                    self.drain();
                    break Ok(None);
                }
                code = &mut child => {
                    child_exit = None;
                    break Ok(Some(format!("command exit (status {code})")));
                }
                _ = &mut targets => {
                    targets_exit = None;
                    let Target::Pids(pids) = &self.plan.target else { unreachable!() };
                    let list = pids.iter().map(Pid::to_string).collect::<Vec<_>>().join(",");
                    let s = if pids.len() > 1 { "s" } else { "" };
                    break Ok(Some(format!("exit of pid{s} {list}")));
                }
                _ = tick.tick(), if self.msgs.has_status_line() => {
                    let lost = self.bpf.counters().map(|c| c.lost_samples()).unwrap_or(0);
                    self.msgs.status(format_args!(
                        "{:.1}s  samples {}  lost {lost}  processes {}",
                        started.elapsed().as_secs_f64(),
                        self.collector.stats.samples,
                        self.collector.processes.len()
                    ));
                }
            }
        };
        self.requests = requests;
        self.targets_exit = targets_exit;
        self.child_exit = child_exit;
        result
    }

    /// Whether SIGUSR1 came since the last call.
    pub fn take_usr1(&mut self) -> bool {
        std::mem::take(&mut self.usr1)
    }

    /// The recording's kernel namer, for a symbolizer that outlives its exports (the agent's).
    pub fn kernel_namer(&self) -> KernelNamer {
        self.kernel.clone()
    }

    /// Kernel counters, for an agent's periodic report.
    pub fn counters(&self) -> Result<crate::bpf::counters::Counters> {
        self.bpf.counters()
    }

    pub fn collector_stats(&self) -> crate::collect::collector::CollectorStats {
        self.collector.stats_now()
    }

    /// Stops sampling and drains what is left (an agent's end; its last window follows).
    pub fn stop(&mut self) {
        self.bpf.detach();
        self.usdt.detach();
        self.drain();
    }

    /// Writes what is recorded so far on another thread, while recording goes on.
    fn snapshot(&mut self) -> Result<()> {
        self.drain();
        let n = self.snapshots.len() as u32 + 1;
        let p = &self.plan;
        let path = snapshot_dest(&p.output, &p.output_dest, n, p.format, p.compress);
        let (schemas, open) = (self.usdt.marker_schemas(), self.usdt.open_markers());
        let mut job =
            ExportJob::capture(&self.collector, self.info_at(MonoNs::now()), schemas, open);
        job.kernel = self.kernel.clone();
        let output = PendingOutput::create(&path).map(|o| o.compress(self.plan.compress));
        let (msgs, format) = (self.msgs, self.plan.format);
        let handle = std::thread::Builder::new().name("snapshot".into()).spawn(move || {
            // Failures are reported, never fatal to the recording.
            let note = "Nothing recorded yet when this snapshot was taken";
            match output.and_then(|o| job.write(o, format, note)) {
                Ok(w) => msgs.info(format_args!(
                    "wrote snapshot {} ({} samples)",
                    path.display(),
                    w.stats.samples
                )),
                Err(e) => msgs.warn(format_args!("snapshot {} failed: {e:#}", path.display())),
            }
        })?;
        self.snapshots.push(handle);
        Ok(())
    }

    /// Stops sampling, drains what is left, writes the profile and prints the summary.
    pub fn finish(mut self, output: PendingOutput, stop_reason: &str) -> Result<()> {
        let end = MonoNs::now();
        let info = self.info_at(end);
        self.bpf.detach();
        self.usdt.detach();
        self.drain();
        let unsent = self.unsent_off_cpu(end);
        self.msgs.clear_status();
        let counters = self.bpf.counters()?;
        for t in self.snapshots.drain(..) {
            let _ = t.join();
        }
        let usdt_report = self.usdt.finish(&mut self.collector, counters)?;
        let marker_schemas = usdt::markers::schemas(&usdt_report.registry);
        let copies_summary = self.collector.copies.render(&counters);
        let duration_s = end.secs_since(info.start);
        let recorded = summary::Recorded {
            target: self.plan.describe(),
            duration_s,
            frequency: self.plan.frequency,
            cpus: self.bpf.cpus.len(),
            stop_reason: stop_reason.to_owned(),
            counters,
            stats: self.collector.stats_now(),
            store: self.collector.store.stats,
            buffer_bytes: self.collector.store.buffer().limit_bytes(),
            off_cpu_at_stop: unsent,
            details: details(parts!(self), duration_s, &copies_summary, &usdt_report),
        };
        let empty_note = format!(
            "Nothing recorded: no sample or marker matched in {duration_s:.2} s (stopped by \
             {stop_reason})"
        );
        if let Some(raw) = &self.raw {
            let paths = &self.collector.processes.cgroup_paths;
            put(raw, &Entry::Cgroups(paths.resolved().map(|(id, p)| (id, p.to_owned())).collect()));
        }
        let mut job = ExportJob::finish(self.collector, info, marker_schemas);
        job.kernel = self.kernel;
        let for_profile = recorded.clone();
        job.report = Some(Box::new(move |profile, symbolize| {
            summary::full(&summary::SummaryInput { recorded: &for_profile, profile, symbolize })
        }));
        let described = output.describe();
        let Written { stats, nothing_recorded, symbolize_errors, bytes } =
            job.write(output, self.plan.format, &empty_note)?;
        if nothing_recorded {
            // Even with -q: an empty profile must not go unexplained.
            let holds = match self.plan.format {
                Format::Gecko => "holds only a note saying so",
                Format::Pprof | Format::Collapsed => "has no samples",
            };
            self.msgs.notice(format_args!(
                "nothing was recorded in {duration_s:.2} s (stopped by {stop_reason}); {described} \
                 {holds}"
            ));
        }
        if let (Some(raw), Some(path)) = (&self.raw, &self.plan.save_raw) {
            // After the profile: the kernel names it used are in the stream.
            let counters = (0..profiler_common::counter::COUNT).map(|i| counters.get(i)).collect();
            let end = raw::End { end_ns: end.0, stop_reason: stop_reason.to_owned(), counters };
            let mut raw = raw.lock().unwrap_or_else(|e| e.into_inner());
            raw.write(&Entry::End(end));
            raw.finish().with_context(|| format!("--save-raw {}", path.display()))?;
            self.msgs.info(format_args!(
                "saved the raw stream to {} ({} entries): rsprof-bpf replay {} -o OUT",
                path.display(),
                raw.entries,
                path.display()
            ));
        }
        if let Some(u) = &mut self.unwind {
            // Mostly done while the profile was written; the rest for the next run's sake.
            u.finish_for_disk(Duration::from_secs(3));
            if let Target::Command(cmd) = &self.plan.target {
                u.save_launch_list(cmd);
            }
        }
        let input = summary::SummaryInput {
            recorded: &recorded,
            profile: &stats,
            symbolize: &symbolize_errors,
        };
        if self.plan.verbose {
            // The details again: the unwind tables' disk cache is written by now.
            let recorded = summary::Recorded {
                details: details(parts!(self), duration_s, &copies_summary, &usdt_report),
                ..recorded.clone()
            };
            let input = summary::SummaryInput { recorded: &recorded, ..input };
            self.msgs.block(&summary::full(&input));
        } else {
            self.msgs.block(&summary::short(&input));
        }
        self.msgs.block(&summary::output_line(&described, self.plan.format, bytes));
        if !self.plan.verbose && self.plan.format == Format::Gecko {
            self.msgs.block(&format!(
                "the full report: -v, or `zcat -f {described} | jq -r .meta.rsprof.report`\n"
            ));
        } else if !self.plan.verbose {
            self.msgs.block("the full report: -v\n");
        }
        if let Some(c) = &self.plan.cgroups {
            let kept = recorded.stats.samples;
            let note = c.end_note(kept, counters.get(counter::SAMPLES_FILTERED));
            // Even with -q: an empty profile must not go unexplained.
            if kept == 0 {
                self.msgs.block_always(&note);
            } else if self.plan.verbose {
                self.msgs.block(&note);
            }
        }
        Ok(())
    }
}

/// The session's fields [`details`] reads (a macro: `self` is partly moved by then).
macro_rules! parts {
    ($s:ident) => {
        DetailParts {
            drains: &$s.drains,
            unwind: $s.unwind.as_ref(),
            bpf: &$s.bpf,
            bpf_timing: $s.plan.bpf_timing,
        }
    };
}
use parts;

/// What [`details`] reads of the session.
struct DetailParts<'a> {
    drains: &'a DrainStats,
    unwind: Option<&'a crate::unwind::UnwindLoader>,
    bpf: &'a BpfObject,
    bpf_timing: bool,
}

/// The session's reports past the counters, for the full summary: the event loop, unwind
/// tables, stack copies, USDT and the BPF programs' run times.
fn details(
    parts: DetailParts,
    duration_s: f64,
    copies: &str,
    usdt: &usdt::report::UsdtReport,
) -> String {
    let DetailParts { drains, unwind, bpf, bpf_timing } = parts;
    let mut s = format!("{}\n", drains.render(duration_s));
    if let Some(u) = unwind {
        s.push_str(&u.render());
    }
    s.push_str(copies);
    if !usdt.is_empty() {
        s.push_str(&usdt.render());
    }
    for (prog, what) in [
        ("on_cpu_clock", "sampler"),
        ("on_sched_switch", "sched_switch hook"),
        ("on_enter_mmap", "mmap entry hook"),
        ("on_exit_mmap", "mmap exit hook"),
        ("on_enter_munmap", "munmap hook"),
        ("on_exit_mprotect", "mprotect exit hook"),
    ] {
        if let Some((runs, time)) = bpf.run_stats(prog) {
            let verified = bpf.verified_insns(prog).unwrap_or(0);
            let _ = writeln!(
                s,
                "rsprof-bpf: BPF {what} (kernel.bpf_stats_enabled): {runs} runs, {:.0} ns \
                 per run, {:.3} s in all; {verified} instructions verified",
                time.as_nanos() as f64 / runs as f64,
                time.as_secs_f64()
            );
        }
    }
    if bpf_timing {
        let _ = match bpf.sampler_timing() {
            Ok(t) => writeln!(s, "rsprof-bpf: {t}"),
            Err(e) => writeln!(s, "rsprof-bpf: --bpf-timing: {e:#}"),
        };
    }
    s
}

/// `Collector::register_existing`, noted in the raw stream after the /proc facts it read.
fn register_existing(collector: &mut Collector<ChunkedStore>, raw: &Option<SharedRaw>, pid: Pid) {
    collector.register_existing(pid);
    if let Some(raw) = raw {
        put(raw, &Entry::Existing(pid));
    }
}

/// Hands a ring record to the collector and, with `--save-raw`, to the stream. Undecodable
/// records are counted in the collector's stats and reported.
fn feed(
    collector: &mut Collector<ChunkedStore>,
    raw: Option<&std::sync::Mutex<RawWriter>>,
    rec: &[u8],
) {
    let _ = collector.handle_record(rec);
    // After: the /proc facts the record made the collector read go first.
    if let Some(raw) = raw {
        raw.lock().unwrap_or_else(|e| e.into_inner()).ring(rec);
    }
}

fn put(raw: &SharedRaw, e: &Entry) {
    raw.lock().unwrap_or_else(|e| e.into_inner()).write(e);
}

fn product() -> String {
    format!("rsprof-bpf {}", env!("CARGO_PKG_VERSION"))
}

impl Recorder<'_> {
    /// The drain timer's period now: `every`, bounded while CPython processes run.
    fn timer_period(&self, every: Duration) -> Duration {
        let recent = self.collector.python_frames_at.is_some_and(|t| {
            MonoNs::now().0.saturating_sub(t.0) < PYTHON_FRAMES_RECENT.as_nanos() as u64
        });
        if recent && self.python.as_ref().is_some_and(crate::python::loader::PyLoader::running) {
            every.min(PYTHON_DRAIN_INTERVAL)
        } else {
            every
        }
    }
}

/// Tells the kernel of processes found running CPython (`python` None: `--no-python`, whose
/// checks are dropped so they do not pile up).
fn python_after_drain(
    python: &mut Option<crate::python::loader::PyLoader>,
    collector: &mut Collector<ChunkedStore>,
) {
    match python {
        Some(p) => p.after_drain(collector),
        None => drop(collector.outbox.take_python_checks()),
    }
}

/// The kernel programs' configuration for `plan` (struct offsets from the kernel's BTF).
fn kernel_config(plan: &RecordPlan) -> Result<Config> {
    let mut config = Config::default();
    btf::fill_offsets(std::path::Path::new(btf::VMLINUX_BTF), &mut config)?;
    if plan.target != Target::All {
        config.filter_mode = FILTER_TARGETS;
        config.follow_children = u32::from(matches!(plan.target, Target::Command(_)));
    }
    config.off_cpu = plan.off_cpu;
    config.off_cpu_min_ns = plan.off_cpu_min_ns;
    config.unwind_mode = plan.unwind_mode;
    config.bpf_timing = u32::from(plan.bpf_timing);
    config.wake_for_tables = u32::from(plan.eager_tables);
    config.early_mappings = u32::from(plan.eager_tables);
    Ok(config)
}

/// The recording's kernel namer: its BPF object's (teed into the raw stream with
/// `--save-raw`), else /proc/kallsyms.
fn kernel_namer(bpf: &mut BpfObject, raw: Option<&SharedRaw>, msgs: Messages) -> KernelNamer {
    let kernel = KernelNamer::default();
    match bpf.kernel_namer() {
        Ok(namer) => kernel.set(match raw {
            Some(raw) => Box::new(crate::symbolize::recorded_names::TeeNames {
                inner: Box::new(namer),
                raw: raw.clone(),
            }),
            None => Box::new(namer),
        }),
        Err(e) => {
            msgs.info(format_args!(
                "kernel addresses are named from /proc/kallsyms (naming them through BPF: \
                 {e:#})"
            ));
            if raw.is_some() {
                msgs.warn(format_args!(
                    "--save-raw: kernel names from kallsyms are not saved; a replay shows \
                     kernel frames as addresses"
                ));
            }
        }
    }
    kernel
}

/// The unwind-table loader (none with `--unwind fp`) and the CPython loader (none with
/// `--no-python`, or when its maps cannot be had: said, and the recording goes on).
fn runtime_loaders(
    bpf: &mut BpfObject,
    plan: &RecordPlan,
    msgs: Messages,
) -> Result<(Option<crate::unwind::UnwindLoader>, Option<crate::python::loader::PyLoader>)> {
    let unwind = if plan.unwind_mode == UNWIND_MODE_FP {
        None
    } else {
        let mut loader = crate::unwind::maps(bpf)?;
        if !plan.eager_tables {
            loader.defer_young(crate::unwind::DEFER_YOUNG);
        }
        Some(loader)
    };
    let python = if plan.python {
        let loader = bpf.take_python_maps().and_then(crate::python::loader::PyLoader::new);
        match loader {
            Ok(l) => Some(l),
            Err(e) => {
                msgs.warn(format_args!("Python frames are not read: {e:#}"));
                None
            }
        }
    } else {
        None
    };
    Ok((unwind, python))
}

/// USDT probes: the session, the exec gate where it applies, and the command's own binary
/// attached before it runs.
fn start_usdt(bpf: &mut BpfObject, plan: &RecordPlan, msgs: Messages) -> Result<UsdtSession> {
    // With `-p`, only the given processes are profiled: no gate.
    let gate = plan.usdt_exec_gate && matches!(plan.target, Target::All | Target::Command(_));
    let mut usdt = UsdtSession::new(
        bpf,
        plan.usdt_requests.clone(),
        plan.usdt_intervals.clone(),
        plan.usdt_dump.as_deref(),
        // No exec gate (`-p`, or an agent not asked for one), so nothing needs the program
        // before a file with probes is found; most processes carry none.
        !gate,
    )?;
    // Programs first exec'd during the recording get their probes before they run.
    if gate {
        usdt.start_gate();
    }
    // The command's own binary is attached before it runs; its libraries are found when the
    // collector sees their mappings.
    // (A command that does not exist fails to launch below, with its own error.)
    if let Target::Command(cmd) = &plan.target
        && let Some(exe) = cmd.first().and_then(|c| usdt::attach::which(c))
        && exe.is_file()
        && let Err(e) = usdt.scan_file(&exe, &exe.display().to_string(), false)
    {
        msgs.warn(format_args!("USDT probes of {}: {e:#}", exe.display()));
    }
    Ok(usdt)
}

/// The collector, reading /proc through the raw stream with `--save-raw` (which then starts
/// with the recording's description).
fn new_collector(plan: &RecordPlan, raw: Option<&SharedRaw>) -> Collector<ChunkedStore> {
    let mut collector = Collector::new(ChunkedStore::new(plan.buffer_bytes));
    collector.copies.fp_fallback = plan.unwind_mode == profiler_common::UNWIND_MODE_DWARF_FP;
    if let Some(raw) = raw {
        collector.set_facts(Box::new(TeeProc { raw: raw.clone() }));
        put(
            raw,
            &Entry::Start(Box::new(raw::Start {
                product: product(),
                host: host::hostname(),
                targets: plan.describe(),
                buffer_bytes: plan.buffer_bytes,
                fp_fallback: collector.copies.fp_fallback,
                vdso_len: LiveProc.vdso_len(),
            })),
        );
    }
    collector
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drain_stats_set_the_longest_drain_apart() {
        let mut d = DrainStats::default();
        d.add(2000, Duration::from_micros(600));
        d.add(100, Duration::from_millis(40));
        d.add(2000, Duration::from_micros(400));
        let line = d.render(2.0);
        assert!(line.starts_with("event loop: 3 drains (1.5 a second), 4100 records in 41.0 ms"));
        assert!(line.contains("(10.00 µs a record,"), "{line}");
        assert!(line.ends_with("longest drain 40.0 ms, without it 0.25 µs a record"), "{line}");
    }

    #[test]
    fn drain_interval_keeps_a_worst_case_period_in_the_ring() {
        // A small host at the default ring (4 MiB at 999 Hz on 2 CPUs, 16 MiB at most): about
        // half the ceiling, two wakeups a second (a worst-case sample has room for 128
        // Python frames, 2 KiB, besides its full native stacks).
        assert_eq!(drain_interval(16 << 20, 2, 99), MAX_DRAIN_INTERVAL);
        assert_eq!(drain_interval(16 << 20, 2, 999), MAX_DRAIN_INTERVAL);
        assert!(drain_interval(4 << 20, 2, 999) > MAX_DRAIN_INTERVAL * 4 / 10);
        // A large host at 999 Hz: full-depth samples for one interval fill at most the ring.
        let d = drain_interval(16 << 20, 256, 999);
        assert!(d < MAX_DRAIN_INTERVAL && d >= MIN_DRAIN_GAP, "{d:?}");
        let record = (std::mem::size_of::<profiler_common::SampleRecord>() + 8) as f64;
        assert!(256.0 * 999.0 * record * d.as_secs_f64() <= f64::from(16u32 << 20) + 1.0);
        // A tiny ring: never below the gap that bounds the loop's wakeups.
        assert_eq!(drain_interval(16 << 10, 2, 999), MIN_DRAIN_GAP);
    }
}
