//! Kernels defined for a device that is not here. Each ember crate lists its CubeCL kernels as
//! a training step launches them (cube dimensions, compile-time arguments, element types),
//! built against given device properties without a client. A compiler for the device's
//! language then compiles them on any machine: `ember selftest --ptx` compiles every one to
//! CUDA's PTX on a machine without a GPU, so a kernel that a GPU's compiler would refuse is
//! found before a GPU runs it.

use std::sync::Arc;

use cubecl::CubeKernel;
use cubecl::ir::{DeviceProperties, TargetProperties};
use cubecl::prelude::*;
use cubecl::server::Handle;

/// The device a kernel is defined for: what its runtime reports, and its target's properties.
#[derive(Clone, Debug)]
pub struct Target {
    pub device: Arc<DeviceProperties>,
    pub target: Arc<TargetProperties>,
}

/// Kernels as launches would compile them, each named by the launch it stands for (dtype,
/// compile-time arguments).
pub type Kernels = Vec<(String, Box<dyn CubeKernel>)>;

/// A handle to no memory: a definition reads its argument's kind, never its bytes.
fn nowhere(bytes: usize) -> Handle {
    let device = cubecl::device::DeviceId {
        type_id: 0,
        index_id: 0,
    };
    Handle::new(
        cubecl_common::device::ServiceId::of::<Target>(device),
        cubecl_environment::stream::StreamId { value: 0 },
        bytes as u64,
    )
}

/// A contiguous tensor argument of `shape` (elements of `elem_bytes`) for a definition only.
pub fn tensor_arg(shape: &[usize], elem_bytes: usize) -> TensorArg {
    let mut strides = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    let len = shape.iter().product::<usize>();
    // SAFETY: the argument is only registered to define a kernel; nothing is launched with it.
    unsafe { TensorArg::from_raw_parts(nowhere(len * elem_bytes), strides.into(), shape.into()) }
}

/// A buffer argument of `len` elements of `elem_bytes` for a definition only.
pub fn buffer_arg(len: usize, elem_bytes: usize) -> BufferArg {
    // SAFETY: as for `tensor_arg`.
    unsafe { BufferArg::from_raw_parts(nowhere(len * elem_bytes), len) }
}
