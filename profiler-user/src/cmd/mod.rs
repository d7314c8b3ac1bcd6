//! One file per subcommand.

pub mod list_containers;
pub mod list_usdt;
pub mod record;
