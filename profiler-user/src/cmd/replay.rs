//! `rsprof-bpf replay`: writes the profile of a raw stream saved by `record --save-raw`. No
//! BPF is loaded and nothing needs root: the collector, store and writers run on what the
//! recording saved (`rsprof_core::replay`); ELF files are read again from disk.

use anyhow::{Context as _, Result};

use crate::{
    bpf::counters::Counters,
    cli::{args::ReplayArgs, plan::output_format},
    collect::raw::RawReader,
    export::{
        ExportJob, Written,
        output::{Destination, PendingOutput},
    },
};

pub fn run(args: ReplayArgs) -> Result<()> {
    let format = output_format(&args.output, args.format)?;
    // Before the replay: an unwritable output fails now.
    let output = PendingOutput::open(&args.output, &Destination::resolve(&args.output)?, 0o666)?
        .compress(args.compress);
    let reader = RawReader::open(&args.raw)?;
    let r = rsprof_core::replay::replay(reader)
        .with_context(|| format!("replay {}", args.raw.display()))?;
    let names = r.kernel_names.len();
    let stats = r.collector.stats_now();
    let described = output.describe();
    let counters = Counters::read(|i| {
        Ok::<_, std::convert::Infallible>(r.end.counters.get(i as usize).copied().unwrap_or(0))
    })
    .unwrap_or_else(|e| match e {});
    let note = format!("Nothing recorded (replay of {})", args.raw.display());
    let job = ExportJob::finish(r.collector, r.info, Vec::new());
    // The recording's kernel names only: kallsyms here is hidden, or of another boot.
    job.kernel.set(Box::new(r.kernel_names));
    let Written { stats: profile, .. } = job.write(output, format, &note)?;
    if args.quiet {
        return Ok(());
    }
    let s = &r.stats;
    let mut out = format!(
        "replayed {}: {} on {} ({}), stopped by {}: {} records in {} drains, {} kernel names\n",
        args.raw.display(),
        r.start.targets,
        r.start.host,
        r.start.product,
        r.end.stop_reason,
        s.records,
        s.drains,
        names,
    );
    out += &format!(
        "wrote {described}: {} samples ({} idle), {} off-CPU records, {} processes, {} threads\n",
        profile.samples,
        profile.idle_samples,
        profile.off_cpu_records,
        profile.processes,
        profile.threads
    );
    out += &format!(
        "as recorded: {} samples lost in the kernel, {} records that did not decode, {} user \
         frames unmapped\n",
        counters.lost_samples(),
        stats.decode_errors,
        stats.unmapped_frames
    );
    out += &format!(
        "not replayed (they need the live processes): USDT markers ({} hits), Python frames, \
         JIT names from perf maps and jitdumps\n",
        s.usdt_hits_not_replayed
    );
    if s.facts_missing > 0 {
        out += &format!(
            "warning: {} /proc reads had no answer in the stream (their processes show no \
             mappings)\n",
            s.facts_missing
        );
    }
    eprint!("{out}");
    Ok(())
}
