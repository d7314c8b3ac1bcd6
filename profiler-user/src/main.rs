use clap::Parser as _;
use profiler_user::{
    cli::args::{Cli, Command},
    cmd,
};

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Record(a)) => cmd::record::run(a),
        Some(Command::ListUsdt(a)) => cmd::list_usdt::run(a),
        Some(Command::ListContainers) => cmd::list_containers::run(),
        Some(Command::Agent(a)) => cmd::agent::run(a),
        Some(Command::Query(a)) => cmd::query::run(a),
        Some(Command::Dump(a)) => cmd::dump::run(a),
        None => cmd::record::run(cli.record),
    };
    if let Err(e) = result {
        eprintln!("rsprof-bpf: error: {e:#}");
        std::process::exit(1);
    }
}
