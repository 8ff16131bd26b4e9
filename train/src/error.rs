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
        match err {
            ember_data::DataError::Setting {
                field,
                value,
                reason,
            } => CliError::Usage(flagged(field, &value.to_string(), &reason)),
            other => CliError::Runtime(other.into()),
        }
    }
}

impl From<ember_sharding::ShardError> for CliError {
    fn from(err: ember_sharding::ShardError) -> Self {
        match err {
            ember_sharding::ShardError::Setting {
                field,
                value,
                reason,
            } => CliError::Usage(flagged(field, &value, &reason)),
            other => CliError::Runtime(other.into()),
        }
    }
}

/// The flag that sets each configuration field the libraries name in their errors.
const FLAGS: &[(&str, &str)] = &[
    ("preset", "--shard"),
    ("params", "--shard"),
    ("optimizer", "--shard"),
    ("grad_hops", "--shard"),
    ("shard_grads", "--shard"),
    ("secondary", "--secondary"),
    ("quantize_weights", "--quantize-weights"),
    ("quantize_grads", "--quantize-grads"),
    ("error_feedback", "--error-feedback"),
    ("quant_block", "--quant-block"),
    ("prefetch", "--prefetch"),
    ("block_size", "--block-size"),
    ("grad_accum", "--grad-accum"),
    ("global_batch", "--batch-size"),
];

/// A library's error about `field` = `value`, told in the CLI's flags: `--flag value: reason`,
/// with every other field the reason names replaced by its flag.
pub fn flagged(field: &str, value: &str, reason: &str) -> String {
    let flag = |f: &str| {
        FLAGS
            .iter()
            .find(|(name, _)| *name == f)
            .map(|(_, flag)| *flag)
    };
    let mut reason = reason.to_owned();
    for (name, flag) in FLAGS {
        reason = reason.replace(&format!("set {name} to "), &format!("use {flag} "));
    }
    for (name, flag) in FLAGS.iter().filter(|(name, _)| name.contains('_')) {
        reason = reason.replace(name, flag);
    }
    match (flag(field), value) {
        (Some(flag), "true") => format!("{flag}: {reason}"),
        (Some(flag), value) => format!("{flag} {value}: {reason}"),
        (None, value) => format!("{field} {value}: {reason}"),
    }
}
