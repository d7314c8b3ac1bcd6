//! `rsprof-bpf query`: merges an agent's spooled windows into one profile.

use anyhow::Result;

use crate::{agent::query, cli::args::QueryArgs};

pub fn run(args: QueryArgs) -> Result<()> {
    let q = query::Query::from_args(&args)?;
    let written = q.run()?;
    eprintln!(
        "rsprof-bpf: {} windows ({} samples) of {} tracks written to {} ({})",
        written.windows,
        written.samples,
        written.tracks,
        if args.output.as_os_str() == "-" {
            "standard output".into()
        } else {
            args.output.display().to_string()
        },
        written.format
    );
    Ok(())
}
