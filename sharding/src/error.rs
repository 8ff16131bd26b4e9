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
        }
    }
}

/// What can go wrong building or running a sharded model.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    /// A setting that cannot work: the field of the configuration (of
    /// [`crate::ShardConfig`], or of the caller's run), its value, and why.
    #[error("{field} = {value}: {reason}")]
    Setting {
        /// The field, as the configuration's struct names it.
        field: &'static str,
        /// Its value.
        value: String,
        /// What is wrong with it and what would work.
        reason: String,
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
}
