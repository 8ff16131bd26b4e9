//! AdamW's step on a CubeCL device as one kernel per buffer: a unit per element reads the
//! master weight, both moments and the gradient once and writes the three new values, with the
//! decoupled weight decay on the buffer's decayed ranges and the gradient's scale factors
//! applied in the same pass. As tensor operations the step is a dozen kernels per buffer (more
//! where decay covers only some ranges: a slice and a write-back each) and as many temporaries
//! of the buffer's size.
//!
//! The operations and their order are those of the tensor operations and the host pass
//! (`super::adamw_pass`), all in f32. A device compiler may contract a multiply and an add
//! into one fused multiply-add where the tensor operations' kernels do not, so the two agree
//! to a few units in the last place, not bit for bit (the test states by how much).

use std::ops::Range;

use burn::tensor::{DType, Int as IntKind, Tensor as BurnTensor, TensorData};
use burn_cubecl::Cube;
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

use super::{Coefficients, FlatState};

/// Units per cube, one per element.
const UNITS: u32 = 256;

/// The CubeCL tensor behind `t`, contiguous; `None` off CubeCL.
fn resolve(t: BurnTensor<1>) -> Option<CubeTensor> {
    crate::transport::cube::primitive(&t).map(|(p, _)| p)
}

/// [`resolve`] for an integer tensor.
fn resolve_int(t: BurnTensor<1, IntKind>) -> Option<CubeTensor> {
    let fused = t.try_into_primitive::<Cube>().ok()?;
    let client = fused.client.clone();
    Some(burn_cubecl::kernel::into_contiguous(
        client.resolve_tensor_int::<CubeBackend>(fused),
    ))
}

/// One unit per element: reads the master, both moments and the gradient (16 bytes) and the
/// decayed ranges' bounds, writes the new master and moments (12 bytes).
#[cube(launch, create_dummy_kernel)]
fn adamw_kernel<I: Int>(
    p: &Tensor<f32>,
    m: &Tensor<f32>,
    v: &Tensor<f32>,
    g: &Tensor<f32>,
    decayed: &Tensor<I>,
    factors: &Tensor<f32>,
    p_out: &mut Tensor<f32>,
    m_out: &mut Tensor<f32>,
    v_out: &mut Tensor<f32>,
    b1: f32,
    b1c: f32,
    b2: f32,
    b2c: f32,
    sqrt_bias2: f32,
    eps: f32,
    step_size: f32,
    decay: f32,
    ranges: usize,
    scales: usize,
    #[define(I)] _int: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i < p_out.len() {
        let mut x = p[i];
        let mut r = 0usize;
        while r < ranges {
            let lo = u32::cast_from(decayed[2 * r]) as usize;
            let hi = u32::cast_from(decayed[2 * r + 1]) as usize;
            if i >= lo && i < hi {
                x *= decay;
            }
            r += 1;
        }
        let mut grad = g[i];
        let mut f = 0usize;
        while f < scales {
            grad *= factors[f];
            f += 1;
        }
        let mm = m[i] * b1 + grad * b1c;
        let vv = v[i] * b2 + (grad * grad) * b2c;
        let denom = f32::sqrt(vv) / sqrt_bias2 + eps;
        p_out[i] = x - (mm / denom) * step_size;
        m_out[i] = mm;
        v_out[i] = vv;
    }
}

/// AdamW's step on `state` (master and two moments, f32 on a CubeCL device) for `grad` scaled
/// by each of `factors` in turn, with `k`'s decay on `decayed`. `None` (and `state` untouched)
/// where the buffers are not CubeCL's or not all f32.
pub(super) fn adamw(
    k: &Coefficients,
    [beta1, beta2, eps]: [f64; 3],
    state: &mut FlatState,
    grad: &BurnTensor<1>,
    factors: &[f64],
    decayed: &[Range<usize>],
) -> Option<()> {
    if state.slots.len() != 2 {
        return None;
    }
    let buffers = [&state.master, &state.slots[0], &state.slots[1], grad];
    if buffers.iter().any(|t| t.dtype() != DType::F32) {
        return None;
    }
    let n = state.len();
    let device = state.master.device();
    let p = resolve(state.master.clone())?;
    let m = resolve(state.slots[0].clone())?;
    let v = resolve(state.slots[1].clone())?;
    let g = resolve(grad.clone())?;
    // The small inputs, each at least one element long (a kernel binds no empty buffer).
    let mut bounds: Vec<i64> = decayed
        .iter()
        .flat_map(|r| [r.start as i64, r.end as i64])
        .collect();
    bounds.resize(bounds.len().max(1), 0);
    let mut scales: Vec<f32> = factors.iter().map(|&f| f as f32).collect();
    scales.resize(scales.len().max(1), 1.0);
    let nb = bounds.len();
    let bounds = resolve_int(BurnTensor::<1, IntKind>::from_data(
        TensorData::new(bounds, [nb]),
        &device,
    ))?;
    let ns = scales.len();
    let scales = resolve(BurnTensor::<1>::from_data(
        TensorData::new(scales, [ns]),
        (&device, DType::F32),
    ))?;
    let outputs: Vec<BurnTensor<1>> = (0..3)
        .map(|_| BurnTensor::<1>::empty([n], (&device, DType::F32)))
        .collect();
    let out: Vec<CubeTensor> = outputs
        .iter()
        .map(|t| resolve(t.clone()))
        .collect::<Option<_>>()?;
    if n > 0 {
        let client = p.client.clone();
        let cube_dim = CubeDim::new_1d(UNITS);
        let int = burn::backend::cubecl::dtype_to_storage_type(bounds.dtype);
        adamw_kernel::launch(
            &client,
            calculate_cube_count_elemwise(&client, n, cube_dim),
            cube_dim,
            p.into_tensor_arg(),
            m.into_tensor_arg(),
            v.into_tensor_arg(),
            g.into_tensor_arg(),
            bounds.into_tensor_arg(),
            scales.into_tensor_arg(),
            out[0].clone().into_tensor_arg(),
            out[1].clone().into_tensor_arg(),
            out[2].clone().into_tensor_arg(),
            beta1 as f32,
            (1.0 - beta1) as f32,
            beta2 as f32,
            (1.0 - beta2) as f32,
            k.sqrt_bias2 as f32,
            eps as f32,
            k.step_size as f32,
            k.decay as f32,
            decayed.len(),
            factors.len(),
            int,
        );
    }
    let mut outputs = outputs.into_iter();
    state.master = outputs.next()?;
    state.slots[0] = outputs.next()?;
    state.slots[1] = outputs.next()?;
    Some(())
}

/// The kernel as the optimizer launches it on a buffer, over i32 and i64 range bounds (the
/// device's integer dtype decides), defined for `target` without a client
/// ([`ember_comm::ahead`]).
pub(crate) fn ahead(target: &ember_comm::ahead::Target) -> ember_comm::ahead::Kernels {
    use ember_comm::ahead::tensor_arg;
    let n = 1 << 20;
    let f32s = || tensor_arg(&[n], 4);
    let mut out: ember_comm::ahead::Kernels = Vec::new();
    for int in [DType::I32, DType::I64] {
        out.push((
            format!("adamw {int:?} bounds"),
            Box::new(adamw_kernel::create_dummy_kernel(
                target.device.clone(),
                target.target.clone(),
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(UNITS),
                f32s(),
                f32s(),
                f32s(),
                f32s(),
                tensor_arg(&[2], int.size()),
                tensor_arg(&[1], 4),
                f32s(),
                f32s(),
                f32s(),
                0.9,
                0.1,
                0.95,
                0.05,
                1.0,
                1e-8,
                1e-3,
                0.999,
                1,
                1,
                burn::backend::cubecl::dtype_to_storage_type(int),
            )),
        ));
    }
    out
}
