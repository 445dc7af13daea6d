//! Settings of a `stdout` sink.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Settings of a `stdout` sink.
#[derive(Debug, Clone, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StdoutSinkConfig {
    /// Append to this file instead of writing to standard output.
    #[serde(default)]
    pub path: Option<PathBuf>,
}
