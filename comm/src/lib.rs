//! Topology-aware collectives over MPI for ZeRO-style sharding: flat and hierarchical
//! all-gather / reduce-scatter / all-reduce / broadcast / all-to-all on host buffers, quantized
//! (ZeRO++ qwZ / qgZ) forms, byte accounting per level and op, and fault handling.
//! It deliberately knows nothing about models, tensors or Burn.

pub mod bench;
pub mod collective;
pub mod comm;
pub mod counters;
pub mod element;
pub mod error;
pub mod fault;
pub mod hier;
pub mod padding;
pub mod pending;
pub mod quant;
pub mod quantized;
pub mod topology;

pub use collective::Reduce;
pub use comm::{Comm, CommConfig, Group, PanicPolicy, TopologySource};
pub use counters::{Counters, Op, Role, Traffic};
pub use element::{Bf16, Dtype, Element};
pub use error::CommError;
pub use padding::ShardLayout;
pub use pending::Pending;
pub use topology::{Level, Scope, Topology};
