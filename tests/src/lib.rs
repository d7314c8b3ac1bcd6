pub mod agent;
pub mod cgroups;
pub mod firefox_import;
pub mod fixtures;
pub mod gecko_schema;
pub mod go_pprof;
pub mod harness;
pub mod profile_query;
