//! `rsprof-bpf agent`: validate, then run the agent (`agent::run`) until SIGTERM/SIGINT.

use anyhow::Result;

use crate::{agent::config::AgentPlan, cli::args::AgentArgs};

pub fn run(args: AgentArgs) -> Result<()> {
    crate::agent::run::run(AgentPlan::from_args(args)?)
}
