//! Errors of the partitioner. Each message names what is wrong, in the library's terms (the
//! fields of [`crate::ShardConfig`], parameter paths, element ranges), and what to do about it.
//! A binary maps them onto its own flags.

use ember_comm::CommError;

impl ShardError {
    /// A [`ShardError::Setting`].
    pub fn setting(
        field: &'static str,
        value: impl std::fmt::Display,
        reason: impl Into<String>,
    ) -> Self {
        Self::Setting {
            field,
            value: value.to_string(),
            reason: reason.into(),
            fix: None,
        }
    }

    /// The same error, naming the setting that would work (only a [`ShardError::Setting`]
    /// carries one).
    pub fn with_fix(self, field: &'static str, value: impl std::fmt::Display) -> Self {
        match self {
            Self::Setting {
                field: f,
                value: v,
                reason,
                ..
            } => Self::Setting {
                field: f,
                value: v,
                reason,
                fix: Some(Fix {
                    field,
                    value: value.to_string(),
                }),
            },
            other => other,
        }
    }
}

/// A setting that would work instead: set `field` to `value`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fix {
    /// The field, as the configuration's struct names it.
    pub field: &'static str,
    /// The value that works.
    pub value: String,
}

impl std::fmt::Display for Fix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "; set {} to {}", self.field, self.value)
    }
}

/// `fix` rendered, or nothing.
fn fix_text(fix: &Option<Fix>) -> String {
    fix.as_ref().map_or_else(String::new, Fix::to_string)
}

/// What can go wrong building or running a sharded model.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    /// A setting that cannot work: the field of the configuration (of
    /// [`crate::ShardConfig`], or of the caller's run), its value, and why.
    #[error("{field} = {value}: {reason}{}", fix_text(fix))]
    Setting {
        /// The field, as the configuration's struct names it.
        field: &'static str,
        /// Its value.
        value: String,
        /// What is wrong with it.
        reason: String,
        /// A setting that would work, where one does.
        fix: Option<Fix>,
    },
    /// Units that do not cover the module's parameters exactly once, or ranks that disagree.
    #[error("{0}")]
    Units(String),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A parameter source (an initialiser, a checkpoint, a pretrained directory) could not
    /// give a range this rank needs.
    #[error("{0}")]
    Source(String),
    /// Reading or writing a checkpoint failed.
    #[error("{0}")]
    Io(String),
    /// Another rank failed in a phase every rank runs together; this rank stops with it.
    #[error("rank {rank} failed: {message}")]
    OtherRank {
        /// The lowest failing rank.
        rank: usize,
        /// Its error.
        message: String,
    },
    /// The loss or the gradient norm is not finite.
    #[error(
        "training diverged: loss {loss}, gradient norm {norm}; lower the learning rate or \
         lengthen the warmup"
    )]
    Diverged {
        /// The step's loss.
        loss: f64,
        /// The global gradient norm.
        norm: f64,
    },
    /// The model produced something the partitioner cannot use (a missing gradient, a unit
    /// returning the wrong kind of output).
    #[error("{0}")]
    Model(String),
    /// The device failed to run the step (most often: it ran out of memory), as its runtime
    /// reported at the first read after the failure.
    #[error("the device failed: {0}")]
    Device(String),
}

impl ShardError {
    /// A device's failure to run work, from its runtime's report (`err`'s debug text): the
    /// innermost cause, with what to do when the device ran out of memory.
    pub(crate) fn device(err: &dyn std::fmt::Debug) -> Self {
        let why = innermost_cause(err);
        let advice = if why.contains("allocate") || why.contains("memory") {
            "; the step does not fit the device's memory: use smaller micro-batches, recompute \
             the units in backward, or shard over more ranks"
        } else {
            ""
        };
        ShardError::Device(format!("{why}{advice}"))
    }
}

/// The innermost cause in a runtime's error report: its last line that is not the report's
/// scaffolding (`Caused by`, backtrace notes).
pub(crate) fn innermost_cause(err: &dyn std::fmt::Debug) -> String {
    let report = format!("{err:?}");
    report
        .lines()
        .map(str::trim)
        .rfind(|l| {
            !l.is_empty()
                && !l.starts_with("Caused by")
                && !l.starts_with("No backtrace")
                && !l.starts_with("Asked at")
        })
        .unwrap_or_default()
        .to_string()
}
