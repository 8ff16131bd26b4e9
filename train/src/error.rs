//! The two kinds of failure the CLI reports, and their exit codes: a usage error (bad flag
//! values, inconsistent configuration) exits 2 like clap's own; anything that goes wrong
//! while running (files, data, numerics) exits 1. Both print one line, never a backtrace.

use std::fmt;

/// A failure to report to the user.
#[derive(Debug)]
pub enum CliError {
    /// The command line or config file asks for something invalid; exit code 2.
    Usage(String),
    /// The command was valid but could not complete; exit code 1.
    Runtime(anyhow::Error),
}

impl CliError {
    /// The process exit code for this error.
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::Usage(_) => 2,
            CliError::Runtime(_) => 1,
        }
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CliError::Usage(msg) => write!(f, "{msg}"),
            // `{:#}` prints the whole context chain on one line: "loading X: reading Y: ...".
            CliError::Runtime(err) => write!(f, "{err:#}"),
        }
    }
}

impl From<anyhow::Error> for CliError {
    fn from(err: anyhow::Error) -> Self {
        CliError::Runtime(err)
    }
}

/// Shorthand for results of CLI commands.
pub type CliResult<T> = Result<T, CliError>;

/// Builds a usage error.
pub fn usage(msg: impl Into<String>) -> CliError {
    CliError::Usage(msg.into())
}

impl From<ember_data::DataError> for CliError {
    fn from(err: ember_data::DataError) -> Self {
        CliError::Runtime(err.into())
    }
}

impl From<ember_sharding::ShardError> for CliError {
    fn from(err: ember_sharding::ShardError) -> Self {
        match err {
            ember_sharding::ShardError::Config(msg) => CliError::Usage(msg),
            other => CliError::Runtime(other.into()),
        }
    }
}
