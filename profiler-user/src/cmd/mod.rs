//! One file per subcommand.

pub mod agent;
pub mod dump;
pub mod list_containers;
pub mod list_usdt;
pub mod query;
pub mod record;
pub mod replay;
