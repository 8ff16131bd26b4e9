//! What the `ember` binary builds on beyond the library's own API: the plan's parts and its
//! cost model (network, CPU profile, step simulation, schedule), resident-memory probes, and
//! the checkpoint format's files. A model sharded with [`Shard`](crate::Shard) needs none of
//! it; it is public so the binary, a launcher or a tool can reuse it, and it changes as the
//! binary needs.

/// The plan's parts: units and their slots, level groups, collectives, memory terms, traffic.
pub mod plan {
    pub use crate::plan::*;
}

/// Link and cluster profiles (`ember plan --profile`).
pub mod profile {
    pub use crate::plan::profile::*;
}

/// The network model a profile describes: links shared by ranks, latency, each algorithm's
/// bytes per link.
pub mod network {
    pub use crate::plan::network::*;
}

/// The step's events in issue order (gathers, reductions, compute visits).
pub mod schedule {
    pub use crate::plan::schedule::*;
}

/// The step simulated on a profile: a timeline of compute and communication.
pub mod simulate {
    pub use crate::plan::simulate::*;
}

/// Resident memory and device memory in use, as the operating system and allocator report.
pub mod memory {
    pub use crate::transport::memory::*;
}

/// The checkpoint format: manifest, file names, writers and readers.
pub mod checkpoint {
    pub use crate::checkpoint::*;
}

/// Unit assignment from declarations.
pub mod stage {
    pub use crate::stage::assign;
}

/// The quantization kernels the step runs on a device's tensors, as one runtime a check can
/// hold against the reference (`ember selftest`).
pub mod kernels {
    pub use crate::transport::kernels::DeviceKernels;
}

/// Collective helpers the binary shares with the engine.
pub mod engine {
    pub use crate::engine::all_ranks_sum;
}
