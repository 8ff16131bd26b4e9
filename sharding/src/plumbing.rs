//! What the `ember` binary builds on beyond the library's own API: resident-memory probes,
//! the checkpoint format's files, the device's quantization kernels and one collective. A
//! model sharded with [`Shard`](crate::Shard) needs none of it, and no public signature names
//! it; it is public so the binary, a launcher or a tool can reuse it, and it changes as the
//! binary needs. The planner ([`plan`](crate::plan): units, spans, collectives, memory,
//! traffic, and the cost model that times a step) is a public module of its own.

/// Resident memory and device memory in use, as the operating system and allocator report.
pub mod memory {
    pub use crate::transport::memory::*;
}

/// The checkpoint format: manifest, file names, writers and readers.
pub mod checkpoint {
    pub use crate::checkpoint::*;
}

/// The quantization kernels the step runs on a device's tensors, as one runtime a check can
/// hold against the reference (`ember selftest`).
pub mod kernels {
    pub use crate::transport::kernels::DeviceKernels;

    /// The engine's own CubeCL kernels (AdamW, the quantized collectives'), defined for
    /// `target` without a client: for compiling them where the device is not
    /// (`ember selftest --ptx`).
    #[cfg(feature = "cubecl")]
    pub fn ahead(target: &ember_comm::ahead::Target) -> ember_comm::ahead::Kernels {
        let mut out = crate::optim::cube::ahead(target);
        out.extend(ember_comm::quant::cube::ahead(target));
        out
    }

    /// Whether the AdamW kernel runs on CubeCL devices: `EMBER_CUBE_KERNELS=0` turns it off
    /// for the process, with the model's own kernels (`ember_model::kernels`), and the step
    /// runs AdamW as tensor operations. Read once.
    pub fn cube_kernels_on() -> bool {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| std::env::var("EMBER_CUBE_KERNELS").as_deref() != Ok("0"))
    }
}

/// The crossings between device and host memory an MPI call makes, measured alone.
pub mod staging {
    pub use crate::transport::staging::{CrossingRates, crossing_rates};
}

/// Collective helpers the binary shares with the engine.
pub mod engine {
    pub use crate::engine::all_ranks_sum;
}
