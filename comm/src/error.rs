//! The one error type of this crate: every message says what went wrong and what to do.
//! It deliberately has no variant for MPI failures: MPI's default error handler aborts the job,
//! and timeouts abort it too (see `fault`), so a returned error is always a caller mistake.

use std::fmt;

/// Why a topology, a configuration or a collective call was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommError {
    /// The topology string or level list is malformed.
    Topology(String),
    /// The topology's rank count differs from the MPI world size.
    WorldSize {
        /// Ranks the topology describes (product of the level sizes).
        topology: usize,
        /// Ranks `mpirun` started.
        world: usize,
    },
    /// A buffer has the wrong length for the collective.
    Shape(String),
    /// The operation is not defined for this element type or configuration.
    Unsupported(String),
}

impl fmt::Display for CommError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CommError::Topology(msg) => write!(f, "invalid topology: {msg}"),
            CommError::WorldSize { topology, world } => write!(
                f,
                "the topology describes {topology} ranks but MPI started {world}: \
                 launch with `mpirun -np {topology}` or use a topology whose product is {world}"
            ),
            CommError::Shape(msg) => write!(f, "buffer shape: {msg}"),
            CommError::Unsupported(msg) => write!(f, "unsupported: {msg}"),
        }
    }
}

impl std::error::Error for CommError {}
