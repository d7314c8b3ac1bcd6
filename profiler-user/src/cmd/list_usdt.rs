//! `rsprof-bpf list-usdt PATH | -p PID`: the USDT probes of a file or of every file a process
//! maps, with their arguments and semaphores.

use anyhow::Result;

use crate::{cli::args::ListUsdtArgs, model::ids::Pid, usdt};

pub fn run(args: ListUsdtArgs) -> Result<()> {
    print!("{}", usdt::list::list(args.path.as_deref(), args.pid.map(Pid))?);
    Ok(())
}
