//! `rsprof-bpf dump`: asks a running agent's flight recorder for its last minutes over the
//! agent's root-only socket and writes them as a Gecko profile (atomically, mode 0600; or in
//! place to `-`, a pipe or a device).

use anyhow::{Result, bail};
use flate2::read::GzDecoder;

use crate::{
    agent::flight::{DEFAULT_SOCKET, request},
    cli::args::DumpArgs,
    export::output::PendingOutput,
    writers::Format,
};

pub fn run(args: DumpArgs) -> Result<()> {
    match Format::from_path(&args.output) {
        Some((Format::Gecko, _)) => {}
        _ if args.output.as_os_str() == crate::export::output::STDOUT => {}
        _ => {
            bail!("{}: a dump is a Gecko profile; name it .json or .json.gz", args.output.display())
        }
    }
    // Created first, so an unwritable path fails before the agent does any work.
    let out = PendingOutput::create_with_mode(&args.output, 0o600)?;
    let described = out.describe();
    let socket = args.socket.unwrap_or_else(|| DEFAULT_SOCKET.into());
    let (gz, samples, markers) = request(&socket, args.last)?;
    // The agent sends gzip; the output compresses again only if its name ends in .gz.
    out.commit(|w| std::io::copy(&mut GzDecoder::new(&gz[..]), w))?;
    eprintln!(
        "rsprof-bpf: wrote {} ({samples} samples, {markers} markers{})",
        described,
        match args.last {
            Some(d) => format!(", the last {}", humantime::format_duration(d)),
            None => String::new(),
        }
    );
    Ok(())
}
