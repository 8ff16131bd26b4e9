//! What ember's CubeCL kernels share: the element types a launch names, a grid of one cube per
//! row beyond 65535 rows, and reductions over a cube in shared memory.

use burn::tensor::DType;
use cubecl::prelude::*;

/// Units per row of the row kernels (cross-entropy, LayerNorm): they stride over the row,
/// then reduce in shared memory.
pub(crate) const ROW_UNITS: usize = 256;

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
