//! Errors of the partitioner. Each message names what is wrong and what to do about it.

use ember_comm::CommError;

/// What can go wrong building or running a sharded model.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    /// An invalid `ShardConfig` or a flag that contradicts it.
    #[error("{0}")]
    Config(String),
    /// Units that do not cover the module's parameters exactly once, or ranks that disagree.
    #[error("{0}")]
    Units(String),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The model produced something the partitioner cannot use (a missing gradient, a NaN).
    #[error("{0}")]
    Model(String),
}
