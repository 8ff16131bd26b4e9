//! What ember's CubeCL kernels share: the element types a launch names, a grid of one cube per
//! row beyond 65535 rows, reductions over a cube in shared memory, and sums over many rows
//! in blocks.

use std::sync::Arc;

use burn::backend::Backend;
use burn::backend::tensor::FloatTensor;
use burn::tensor::{DType, Shape, Slice};
use cubecl::CubeKernel;
use cubecl::ir::{DeviceProperties, TargetProperties};
use cubecl::prelude::*;

/// Units per row of the row kernels (cross-entropy, LayerNorm): they stride over the row,
/// then reduce in shared memory.
pub(crate) const ROW_UNITS: usize = 256;

/// Rows of a `[rows, d]` tensor that one `sum_dim` over them takes, at most: Burn's
/// `sum_dim` on wgpu (Burn 0.22 over lavapipe) is wrong along an axis of 65,536 or more.
pub(crate) const SUM_ROWS: usize = 4096;

/// `t` of `[rows, d]` summed over its rows, as `[1, d]`: blocks of [`SUM_ROWS`] rows first,
/// then the blocks' sums, so that no axis Burn sums is longer than [`SUM_ROWS`]. At most
/// [`SUM_ROWS`] rows, it is Burn's `sum_dim` alone.
pub(crate) fn sum_rows<B: Backend>(
    mut t: FloatTensor<B>,
    mut rows: usize,
    d: usize,
) -> FloatTensor<B> {
    while rows > SUM_ROWS {
        let blocks = rows / SUM_ROWS;
        let whole = blocks * SUM_ROWS;
        let body = B::float_slice(t.clone(), &[Slice::from(0..whole), Slice::from(0..d)]);
        let body = B::float_reshape(body, Shape::new([blocks, SUM_ROWS, d]));
        let body = B::float_reshape(B::float_sum_dim(body, 1), Shape::new([blocks, d]));
        t = if whole < rows {
            let rest = B::float_slice(t, &[Slice::from(whole..rows), Slice::from(0..d)]);
            B::float_cat(vec![body, B::float_sum_dim(rest, 0)], 0)
        } else {
            body
        };
        rows = blocks + usize::from(whole < rows);
    }
    B::float_sum_dim(t, 0)
}

/// CubeCL's element type of a Burn dtype, as a launch's `#[define]` takes it.
pub(crate) fn elem_type(dtype: DType) -> ElemType {
    burn::backend::cubecl::dtype_to_storage_type(dtype)
}

/// A grid of `rows` cubes, at most 65535 along x (the limit of most runtimes).
pub(crate) fn row_cubes(rows: usize) -> CubeCount {
    let x = rows.clamp(1, 65_535) as u32;
    CubeCount::Static(x, (rows as u32).div_ceil(x).max(1), 1)
}

/// The row of this cube in a [`row_cubes`] grid.
#[cube]
pub(crate) fn grid_row() -> usize {
    (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize
}

/// The sum of every unit's `value` over the cube, in every unit.
#[cube]
pub(crate) fn cube_sum(value: f32, shared: &mut Shared<[f32]>, units_now: usize) -> f32 {
    cube_reduce(value, shared, units_now, false)
}

/// The largest of every unit's `value` over the cube, in every unit.
#[cube]
pub(crate) fn cube_max(value: f32, shared: &mut Shared<[f32]>, units_now: usize) -> f32 {
    cube_reduce(value, shared, units_now, true)
}

/// Every unit's `value` summed (or the largest, with `take_max`) over the cube by halving
/// strides in shared memory, in every unit. `units_now` is the cube's unit count at run time,
/// so the stride is a run-time variable.
#[cube]
fn cube_reduce(
    value: f32,
    shared: &mut Shared<[f32]>,
    units_now: usize,
    #[comptime] take_max: bool,
) -> f32 {
    let u = UNIT_POS_X as usize;
    shared[u] = value;
    sync_cube();
    let mut step = units_now / 2;
    while step > 0 {
        if u < step {
            if take_max {
                shared[u] = max(shared[u], shared[u + step]);
            } else {
                shared[u] += shared[u + step];
            }
        }
        sync_cube();
        step /= 2;
    }
    let total = shared[0];
    sync_cube();
    total
}

/// Kernels defined for a device that is not here: each kernel as a gpt2 step launches it, built
/// against the device's properties without a client, for a compiler of the device's language
/// to compile on any machine (`ember selftest --ptx`).
pub(crate) struct Ahead {
    pub device: Arc<DeviceProperties>,
    pub target: Arc<TargetProperties>,
    pub kernels: Vec<(String, Box<dyn CubeKernel>)>,
}

impl Ahead {
    /// gpt2's step: batch 8 of 1024 tokens, width 768 in 12 heads, vocabulary 50304.
    pub const B: usize = 8;
    pub const T: usize = 1024;
    pub const D: usize = 768;
    pub const HEADS: usize = 12;
    pub const VOCAB: usize = 50304;
    /// The dtypes a step computes in.
    pub const DTYPES: [DType; 2] = [DType::F32, DType::BF16];

    /// Adds the kernel `define` builds for this device (its properties and its target's).
    pub fn push<K: CubeKernel + 'static>(
        &mut self,
        name: String,
        define: impl FnOnce(Arc<DeviceProperties>, Arc<TargetProperties>) -> K,
    ) {
        let kernel = define(self.device.clone(), self.target.clone());
        self.kernels.push((name, Box::new(kernel)));
    }

    /// A contiguous tensor argument of `shape` in `dtype`, for a definition only: it names no
    /// memory.
    pub fn tensor(shape: &[usize], dtype: DType) -> TensorArg {
        let mut strides = vec![1; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * shape[i + 1];
        }
        let bytes = shape.iter().product::<usize>() * dtype.size();
        let device = cubecl::device::DeviceId {
            type_id: 0,
            index_id: 0,
        };
        let service = cubecl_common::device::ServiceId::of::<Ahead>(device);
        let stream = cubecl_environment::stream::StreamId { value: 0 };
        let handle = cubecl::server::Handle::new(service, stream, bytes as u64);
        // SAFETY: the argument is only registered to define a kernel; nothing is launched with
        // it.
        unsafe { TensorArg::from_raw_parts(handle, strides.into(), shape.into()) }
    }
}
