use clap::Parser as _;
use profiler_user::{
    cli::{Cli, Command},
    record,
};

fn main() {
    let cli = Cli::parse();
    let args = match cli.command {
        Some(Command::Record(a)) => a,
        None => cli.record,
    };
    if let Err(e) = record::run(args) {
        eprintln!("rsprof-bpf: error: {e:#}");
        std::process::exit(1);
    }
}
