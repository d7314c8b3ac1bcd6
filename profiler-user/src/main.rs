use clap::Parser as _;
use profiler_user::{
    cli::{Cli, Command},
    record,
};

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Record(a)) => record::run(a),
        Some(Command::ListUsdt(a)) => {
            profiler_user::usdt::list::list(a.path.as_deref(), a.pid.map(profiler_user::ids::Pid))
                .map(|text| print!("{text}"))
        }
        Some(Command::ListContainers) => profiler_user::cgroup_filter::list_containers(),
        None => record::run(cli.record),
    };
    if let Err(e) = result {
        eprintln!("rsprof-bpf: error: {e:#}");
        std::process::exit(1);
    }
}
