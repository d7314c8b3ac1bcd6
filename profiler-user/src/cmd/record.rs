//! `rsprof-bpf record`: validate, check the output and privileges, record until told to
//! stop, then write the profile and the summary.

use anyhow::Result;

use crate::{
    cli::{args::RecordArgs, plan::RecordPlan},
    collect::raw::RawWriter,
    export::output::PendingOutput,
    session::{Recorder, Signals, messages::Messages},
    system::host,
};

pub fn run(args: RecordArgs) -> Result<()> {
    args.debuginfod.apply(args.quiet);
    let plan = RecordPlan::from_args(args)?;
    // Before anything slow: an unwritable path fails now, not after the recording.
    let output =
        PendingOutput::open(&plan.output, &plan.output_dest, 0o666)?.compress(plan.compress);
    let raw = plan.save_raw.as_deref().map(RawWriter::create).transpose()?;
    host::check_privileges()?;
    host::check_kernel()?;
    // One thread only until the command is forked.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let _guard = rt.enter();
    let mut signals = Signals::install()?;
    let mut recorder = Recorder::start(&plan, Messages::new(plan.quiet), raw)?;
    let stop_reason = rt.block_on(recorder.run(&mut signals))?;
    recorder.finish(output, &stop_reason)
}
