//! How tensors move: the collectives a plan implies on device tensors (`route`), the threads
//! that run them beside compute (`worker`), the crossings between device and host memory an
//! MPI call needs (`staging`), the quantization kernels where the data lives (`kernels`, with
//! `cube` on CubeCL devices), the element-wise host passes over flex tensors (`host`), and
//! memory as the operating system and allocator report it (`memory`). Nothing here decides
//! what moves: that is the plan's (`crate::plan`), run in order by the engine.

#[cfg(feature = "cubecl")]
pub mod cube;
pub mod host;
pub mod kernels;
pub mod memory;
pub mod route;
pub mod staging;
pub mod worker;
