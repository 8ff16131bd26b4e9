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
            CliError::Runtime(e) if e.downcast_ref::<InitFromMismatch>().is_some() => 2,
            CliError::Runtime(_) => 1,
        }
    }
}

/// An `--init-from` directory whose weights are not those of the model its config
/// describes (a tensor missing, or of another shape): found only while the ranks read their
/// ranges, deep in the run, but a usage error all the same (exit code 2).
#[derive(Debug)]
pub struct InitFromMismatch(pub String);

impl fmt::Display for InitFromMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InitFromMismatch {}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CliError::Usage(msg) => write!(f, "{msg}"),
            // `{:#}` prints the whole context chain on one line: "loading X: reading Y: ...".
            CliError::Runtime(err) => {
                write!(f, "{err:#}")?;
                let device = err.chain().any(|e| {
                    matches!(
                        e.downcast_ref::<ember_sharding::ShardError>(),
                        Some(ember_sharding::ShardError::Device(_))
                    )
                });
                if device {
                    // The library's advice in the binary's flags.
                    write!(
                        f,
                        " (ember: a larger --grad-accum for smaller micro-batches, --recompute \
                         unit, or more ranks sharding the model with --shard)"
                    )?;
                }
                Ok(())
            }
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
            } => CliError::Usage(flagged(field, &value.to_string(), &reason, None)),
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
                fix,
            } => CliError::Usage(flagged(
                field,
                &value,
                &reason,
                fix.as_ref().map(|f| (f.field, f.value.as_str())),
            )),
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
    ("accumulate", "--accumulate-at"),
    ("quantize_weights", "--quantize-weights"),
    ("quantize_grads", "--quantize-grads"),
    ("error_feedback", "--error-feedback"),
    ("quant_block", "--quant-block"),
    ("prefetch", "--prefetch"),
    ("block_size", "--block-size"),
    ("grad_accum", "--grad-accum"),
    ("global_batch", "--batch-size"),
];

/// The flag that sets library field `field`, or the field's own name where no flag does.
fn flag_of(field: &str) -> &str {
    FLAGS
        .iter()
        .find(|(name, _)| *name == field)
        .map_or(field, |(_, flag)| *flag)
}

/// A library's error about `field` = `value`, told in the CLI's flags: `--flag value: reason`,
/// then `; use --other value` where the library names a setting that would work (`fix`).
pub fn flagged(field: &str, value: &str, reason: &str, fix: Option<(&str, &str)>) -> String {
    let fix = fix.map_or_else(String::new, |(field, value)| {
        format!("; use {} {value}", flag_of(field))
    });
    match value {
        "true" => format!("{}: {reason}{fix}", flag_of(field)),
        value => format!("{} {value}: {reason}{fix}", flag_of(field)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember_comm::Topology;
    use ember_sharding::{GradQuant, Preset};

    #[test]
    fn library_settings_are_told_in_flags_with_the_fix_the_library_names() {
        let topology = Topology::parse("2x2x1").unwrap();
        let mut c = Preset::Ddp.config(topology.depth());
        let e = CliError::from(c.set_quantize_grads(GradQuant::Int4).unwrap_err());
        assert_eq!(e.exit_code(), 2);
        let text = e.to_string();
        assert!(text.starts_with("--quantize-grads int4: "), "{text}");
        assert!(text.ends_with("; use --quantize-grads off"), "{text}");
        let mut c = Preset::Zero3.config(topology.depth());
        let text = CliError::from(c.set_error_feedback(true).unwrap_err()).to_string();
        assert!(text.starts_with("--error-feedback: "), "{text}");
        assert!(text.ends_with("; use --quantize-grads int4"), "{text}");
    }
}
