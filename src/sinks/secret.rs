//! Secrets the sinks need (passwords, tokens), referenced from the config and read at start.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// A secret, read at start from a file or an environment variable. Secrets are never written
/// inline in the config, so `check-config` and logs can show the config safely.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SecretRef {
    /// Read the secret from this file (surrounding whitespace is trimmed).
    #[serde(default)]
    pub file: Option<PathBuf>,
    /// Read the secret from this environment variable.
    #[serde(default)]
    pub env: Option<String>,
}

impl SecretRef {
    /// Why this reference is unusable, if it is: exactly one of `file` and `env` is needed.
    pub fn problem(&self) -> Option<String> {
        match (&self.file, &self.env) {
            (Some(_), None) | (None, Some(_)) => None,
            _ => Some("give exactly one of `file` and `env`".into()),
        }
    }

    /// Reads the secret. The error names where it looked, never the value.
    pub fn resolve(&self) -> std::result::Result<String, String> {
        match (&self.file, &self.env) {
            (Some(path), None) => std::fs::read_to_string(path)
                .map(|s| s.trim().to_owned())
                .map_err(|e| format!("cannot read secret file {}: {e}", path.display())),
            (None, Some(var)) => {
                std::env::var(var).map_err(|_| format!("environment variable {var} is not set"))
            }
            _ => Err("give exactly one of `file` and `env`".into()),
        }
    }
}
