//! `rsprof-bpf query`: merges an agent's spooled windows into one profile.

use anyhow::Result;

use crate::{agent::query, cli::args::QueryArgs};

pub fn run(args: QueryArgs) -> Result<()> {
    let q = query::Query::from_args(&args)?;
    let written = q.run()?;
    if args.quiet {
        return Ok(());
    }
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
    let n = &written.names;
    if n.named + n.unnamed + n.from_store > 0 {
        let database = match args.clickhouse {
            Some(_) => {
                format!(" ({} by names the database held, {} stored there)", n.from_store, n.stored)
            }
            None => String::new(),
        };
        eprintln!(
            "rsprof-bpf: addresses agents left unnamed (stripped files): {} named{database}, {} \
             left as addresses",
            n.named + n.from_store,
            n.unnamed
        );
        eprintln!(
            "rsprof-bpf: their debug files: {} from --debug-dir, {} found nowhere{}",
            n.from_dir,
            n.missing,
            match (args.debug_dir.is_some(), args.debuginfod.config(true).is_some()) {
                (false, false) => " (no --debug-dir, no debuginfod)",
                _ => "",
            }
        );
    }
    let d = &n.debuginfod;
    if !d.is_empty() {
        eprintln!(
            "rsprof-bpf: debuginfod: {} files fetched ({:.1} MiB), {} not found, {} errors; {} \
             from the cache",
            d.fetched,
            d.bytes as f64 / (1 << 20) as f64,
            d.not_found,
            d.errors,
            d.cached
        );
        if let Some(e) = &d.last_error {
            eprintln!("rsprof-bpf: warning: debuginfod: {e}");
        }
    }
    if let Some(e) = &n.store_error {
        eprintln!("rsprof-bpf: warning: ClickHouse's names of unnamed addresses: {e}");
    }
    if let Some(e) = &n.last_error {
        eprintln!("rsprof-bpf: warning: {} debug files unreadable: {e}", n.errors);
    }
    Ok(())
}
