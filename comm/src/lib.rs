//! Topology-aware collectives over MPI for ZeRO-style sharding: flat all-gather /
//! reduce-scatter / all-reduce / broadcast / all-to-all on host buffers over any group of
//! consecutive levels (`Scope`), the same composed hop by hop along a `Path` with exactly the
//! flat layout, the wire exchange of ZeRO++ qgZ and the blockwise quantization kernels, byte
//! accounting per scope and op, and fault handling.
//! It deliberately knows nothing about models, tensors or Burn.

#[cfg(feature = "cubecl")]
pub mod ahead;
pub mod bench;
pub mod collective;
pub mod comm;
pub mod counters;
pub mod device_memory;
pub mod element;
pub mod error;
pub mod fault;
pub mod hier;
pub mod padding;
pub mod path;
pub mod quant;
pub mod quantized;
pub mod topology;

pub use collective::Reduce;
pub use comm::{Comm, CommConfig, Disagreement, Group, PanicPolicy, TOPOLOGY_ENV, TopologySource};
pub use counters::{Counters, OffGpu, Op, Role, Traffic};
pub use device_memory::{Crossing, DeviceMemorySupport, GpuMemory, Support};
pub use element::{Bf16, Dtype, Element};
pub use error::CommError;
pub use padding::ShardLayout;
pub use path::Path;
pub use topology::{Level, Scope, Topology};
