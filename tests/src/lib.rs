pub mod fixtures;
pub mod gecko_schema;
pub mod profile_query;
pub mod harness;
