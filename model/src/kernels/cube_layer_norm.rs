//! LayerNorm on CubeCL devices as three kernels: forward, a cube per row reducing its mean and
//! variance in shared memory (two passes, for accuracy) and writing the normalised, scaled and
//! shifted row, with each row's mean and reciprocal deviation kept for backward; backward, a
//! cube per row for the input's gradient (two row reductions), and a unit per feature and chunk
//! of 64 rows for the weight's and bias's partial sums, which one Burn reduction adds up.
//!
//! Composed of Burn's ops, LayerNorm is a dozen kernels each way and keeps its intermediate
//! rows for backward; here it keeps two f32 per row. Plugged in as the backend extension
//! [`CubeLayerNormOps`] for CubeCL's backend, its fusion wrapper and autodiff.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::fusion::custom::TensorSpec;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend, TensorMetadata, backend_extension};
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::cube::{Ahead, ROW_UNITS, cube_sum, elem_type, grid_row, row_cubes};

/// LayerNorm over the last dimension, forward and backward, on CubeCL devices.
#[backend_extension(Cube, Fusion, Autodiff)]
pub trait CubeLayerNormOps: Backend {
    /// `(x - mean) / sqrt(var + eps) * weight + bias` over the last dimension; differentiable
    /// where the backend is.
    #[fusion(default)]
    fn cube_layer_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        Self::cube_layer_norm_forward(x, weight, bias, eps).0
    }

    /// The output and each row's mean and reciprocal deviation (f32, one per row).
    #[fusion(meta = forward_meta)]
    fn cube_layer_norm_forward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// The gradients of the input, the weight and the bias.
    #[fusion(meta = backward_meta)]
    fn cube_layer_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

fn rows_of(shape: &Shape) -> usize {
    let d = shape[shape.num_dims() - 1];
    shape.num_elements() / d.max(1)
}

fn forward_meta(
    x: &TensorSpec,
    _w: &TensorSpec,
    _b: &TensorSpec,
    _eps: &f64,
) -> (TensorSpec, TensorSpec, TensorSpec) {
    let rows = Shape::new([rows_of(&x.shape)]);
    (
        x.clone(),
        TensorSpec::new(rows.clone(), DType::F32),
        TensorSpec::new(rows, DType::F32),
    )
}

fn backward_meta(
    x: &TensorSpec,
    w: &TensorSpec,
    _mean: &TensorSpec,
    _rstd: &TensorSpec,
    _dy: &TensorSpec,
) -> (TensorSpec, TensorSpec, TensorSpec) {
    (x.clone(), w.clone(), w.clone())
}

#[cube(launch, create_dummy_kernel)]
fn layer_norm_forward_kernel<E: Float>(
    x: &Tensor<E>,
    w: &Tensor<E>,
    b: &Tensor<E>,
    y: &mut Tensor<E>,
    mean: &mut Tensor<f32>,
    rstd: &mut Tensor<f32>,
    rows: usize,
    d: usize,
    eps: f32,
    units_now: usize,
    #[comptime] units: usize,
    #[define(E)] _dtype: ElemType,
) {
    let r = grid_row();
    let u = UNIT_POS_X as usize;
    let live = r < rows;
    let base = r * d;
    let mut shared = Shared::<[f32]>::new_slice(units);

    let mut s = f32::new(0.0);
    if live {
        let mut j = u;
        while j < d {
            s += f32::cast_from(x[base + j]);
            j += units_now;
        }
    }
    let mu = cube_sum(s, &mut shared, units_now) / f32::cast_from(d as u32);
    let mut q = f32::new(0.0);
    if live {
        let mut j = u;
        while j < d {
            let c = f32::cast_from(x[base + j]) - mu;
            q += c * c;
            j += units_now;
        }
    }
    let var = cube_sum(q, &mut shared, units_now) / f32::cast_from(d as u32);
    let inv = f32::new(1.0) / f32::sqrt(var + eps);
    if live {
        let mut j = u;
        while j < d {
            let xhat = (f32::cast_from(x[base + j]) - mu) * inv;
            y[base + j] = E::cast_from(xhat * f32::cast_from(w[j]) + f32::cast_from(b[j]));
            j += units_now;
        }
        if u == 0 {
            mean[r] = mu;
            rstd[r] = inv;
        }
    }
}

#[cube(launch, create_dummy_kernel)]
fn layer_norm_backward_dx_kernel<E: Float>(
    x: &Tensor<E>,
    w: &Tensor<E>,
    mean: &Tensor<f32>,
    rstd: &Tensor<f32>,
    dy: &Tensor<E>,
    dx: &mut Tensor<E>,
    rows: usize,
    d: usize,
    units_now: usize,
    #[comptime] units: usize,
    #[define(E)] _dtype: ElemType,
) {
    let r = grid_row();
    let u = UNIT_POS_X as usize;
    let live = r < rows;
    let base = r * d;
    let mut shared = Shared::<[f32]>::new_slice(units);
    let mut mu = f32::new(0.0);
    let mut inv = f32::new(0.0);
    if live {
        mu = mean[r];
        inv = rstd[r];
    }
    let mut a = f32::new(0.0);
    let mut bx = f32::new(0.0);
    if live {
        let mut j = u;
        while j < d {
            let g = f32::cast_from(dy[base + j]) * f32::cast_from(w[j]);
            a += g;
            bx += g * (f32::cast_from(x[base + j]) - mu) * inv;
            j += units_now;
        }
    }
    let n = f32::cast_from(d as u32);
    let a = cube_sum(a, &mut shared, units_now) / n;
    let bx = cube_sum(bx, &mut shared, units_now) / n;
    if live {
        let mut j = u;
        while j < d {
            let g = f32::cast_from(dy[base + j]) * f32::cast_from(w[j]);
            let xhat = (f32::cast_from(x[base + j]) - mu) * inv;
            dx[base + j] = E::cast_from(inv * (g - a - xhat * bx));
            j += units_now;
        }
    }
}

/// Rows each unit of [`layer_norm_backward_dwdb_kernel`] sums: its cube's chunk of the rows.
const ROWS_PER_CHUNK: usize = 64;
/// Features per cube of the weight and bias gradients' partial sums, one unit each.
const DWDB_UNITS: usize = 64;

/// The weight's and bias's gradients of one chunk of rows: a unit per (feature, chunk) sums
/// its feature over the chunk's rows (reading `dy`, `x` and the rows' statistics) and writes
/// two f32 partial sums into the chunk's row of `partials` (the weight's, then the bias's);
/// the chunks' rows are then summed by Burn's reduction. Spread over
/// the rows this way, a step of 8192 rows runs a cube per 64 features and 64 rows, where one
/// unit per feature summing every row would leave most of a GPU idle.
#[cube(launch, create_dummy_kernel)]
fn layer_norm_backward_dwdb_kernel<E: Float>(
    x: &Tensor<E>,
    mean: &Tensor<f32>,
    rstd: &Tensor<f32>,
    dy: &Tensor<E>,
    partials: &mut Tensor<f32>,
    rows: usize,
    d: usize,
    rows_per_chunk: usize,
    #[define(E)] _dtype: ElemType,
) {
    let j = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    let chunk = CUBE_POS_Y as usize;
    if j < d {
        let mut gw = f32::new(0.0);
        let mut gb = f32::new(0.0);
        let start = chunk * rows_per_chunk;
        let end = min(start + rows_per_chunk, rows);
        let mut r = start;
        while r < end {
            let g = f32::cast_from(dy[r * d + j]);
            gw += g * (f32::cast_from(x[r * d + j]) - mean[r]) * rstd[r];
            gb += g;
            r += 1;
        }
        partials[chunk * 2 * d + j] = gw;
        partials[chunk * 2 * d + d + j] = gb;
    }
}

impl CubeLayerNormOps for CubeBackend {
    fn cube_layer_norm_forward(
        x: CubeTensor,
        weight: CubeTensor,
        bias: CubeTensor,
        eps: f64,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        let x = into_contiguous(x);
        let (w, b) = (into_contiguous(weight), into_contiguous(bias));
        let shape = x.shape();
        let (rows, d) = (rows_of(&shape), shape[shape.num_dims() - 1]);
        let (client, device, dtype) = (x.client.clone(), x.device.clone(), x.dtype);
        let y = empty_device_contiguous_dtype(client.clone(), device.clone(), shape, dtype);
        let mean = empty_device_contiguous_dtype(
            client.clone(),
            device.clone(),
            Shape::new([rows]),
            DType::F32,
        );
        let rstd =
            empty_device_contiguous_dtype(client.clone(), device, Shape::new([rows]), DType::F32);
        layer_norm_forward_kernel::launch(
            &client,
            row_cubes(rows),
            CubeDim::new_1d(ROW_UNITS as u32),
            x.into_tensor_arg(),
            w.into_tensor_arg(),
            b.into_tensor_arg(),
            y.clone().into_tensor_arg(),
            mean.clone().into_tensor_arg(),
            rstd.clone().into_tensor_arg(),
            rows,
            d,
            eps as f32,
            ROW_UNITS,
            ROW_UNITS,
            elem_type(dtype),
        );
        (y, mean, rstd)
    }

    fn cube_layer_norm_backward(
        x: CubeTensor,
        weight: CubeTensor,
        mean: CubeTensor,
        rstd: CubeTensor,
        dy: CubeTensor,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        let x = into_contiguous(x);
        let w = into_contiguous(weight);
        let (mean, rstd, dy) = (
            into_contiguous(mean),
            into_contiguous(rstd),
            into_contiguous(dy),
        );
        let shape = x.shape();
        let (rows, d) = (rows_of(&shape), shape[shape.num_dims() - 1]);
        let (client, device, dtype) = (x.client.clone(), x.device.clone(), x.dtype);
        let dx = empty_device_contiguous_dtype(client.clone(), device.clone(), shape, dtype);
        let w_dtype = w.dtype;
        layer_norm_backward_dx_kernel::launch(
            &client,
            row_cubes(rows),
            CubeDim::new_1d(ROW_UNITS as u32),
            x.clone().into_tensor_arg(),
            w.into_tensor_arg(),
            mean.clone().into_tensor_arg(),
            rstd.clone().into_tensor_arg(),
            dy.clone().into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            rows,
            d,
            ROW_UNITS,
            ROW_UNITS,
            elem_type(dtype),
        );
        // At most 65535 chunks (the grid's limit along y): past that, longer chunks.
        let chunks = rows.div_ceil(ROWS_PER_CHUNK).clamp(1, 65_535);
        let rows_per_chunk = rows.div_ceil(chunks).max(1);
        // Each chunk's row of partial sums: the weight's `d`, then the bias's `d`.
        let partials = empty_device_contiguous_dtype(
            client.clone(),
            device,
            Shape::new([chunks, 2 * d]),
            DType::F32,
        );
        layer_norm_backward_dwdb_kernel::launch(
            &client,
            CubeCount::Static(d.div_ceil(DWDB_UNITS) as u32, chunks as u32, 1),
            CubeDim::new_1d(DWDB_UNITS as u32),
            x.into_tensor_arg(),
            mean.into_tensor_arg(),
            rstd.into_tensor_arg(),
            dy.into_tensor_arg(),
            partials.clone().into_tensor_arg(),
            rows,
            d,
            rows_per_chunk,
            elem_type(dtype),
        );
        // The chunks' partial sums summed in f32 (one reduction for both), cast to the
        // weight's dtype, and split.
        let summed = CubeBackend::float_sum_dim(partials, 0);
        let summed = CubeBackend::float_reshape(summed, Shape::new([2 * d]));
        let summed = match w_dtype {
            DType::F32 => summed,
            other => CubeBackend::float_cast(summed, other.into()),
        };
        let half = |range: std::ops::Range<usize>| {
            into_contiguous(CubeBackend::float_slice(summed.clone(), &[range.into()]))
        };
        let (dw, db) = (half(0..d), half(d..2 * d));
        (dx, dw, db)
    }
}

#[derive(Debug)]
struct LayerNormBackward;

impl<B: CubeLayerNormOps> Backward<B, 3> for LayerNormBackward {
    /// The input, the weight, and each row's mean and reciprocal deviation.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
    );

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pw, pb] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (x, w, mean, rstd) = ops.state;
        let (dx, dw, db) = B::cube_layer_norm_backward(x, w, mean, rstd, dy);
        for (parent, g) in [(px, dx), (pw, dw), (pb, db)] {
            if let Some(parent) = parent {
                grads.register::<B>(parent.id, g);
            }
        }
    }
}

impl<B: CubeLayerNormOps, C: CheckpointStrategy> CubeLayerNormOps for Autodiff<B, C> {
    fn cube_layer_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        let (xp, wp, bp) = (
            x.primitive().clone(),
            weight.primitive().clone(),
            bias.primitive().clone(),
        );
        let prep = LayerNormBackward
            .prepare::<C>([x.node(), weight.node(), bias.node()])
            .compute_bound()
            .stateful();
        let (y, mean, rstd) = B::cube_layer_norm_forward(xp.clone(), wp.clone(), bp, eps);
        match prep {
            OpsKind::Tracked(prep) => prep.finish((xp, wp, mean, rstd), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    /// Untracked: only [`CubeLayerNormOps::cube_layer_norm`] has a gradient.
    fn cube_layer_norm_forward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (y, mean, rstd) = B::cube_layer_norm_forward(
            x.primitive().clone(),
            weight.primitive().clone(),
            bias.primitive().clone(),
            eps,
        );
        (
            Self::from_inner(y),
            Self::from_inner(mean),
            Self::from_inner(rstd),
        )
    }

    /// Untracked, as the forward.
    fn cube_layer_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dx, dw, db) = B::cube_layer_norm_backward(
            x.primitive().clone(),
            weight.primitive().clone(),
            mean.primitive().clone(),
            rstd.primitive().clone(),
            dy.primitive().clone(),
        );
        (
            Self::from_inner(dx),
            Self::from_inner(dw),
            Self::from_inner(db),
        )
    }
}

/// The forward and both backward kernels as a gpt2 step launches them ([`Ahead`]).
pub(super) fn ahead(a: &mut Ahead) {
    let (rows, d) = (Ahead::B * Ahead::T, Ahead::D);
    let chunks = rows.div_ceil(ROWS_PER_CHUNK).clamp(1, 65_535);
    let rows_per_chunk = rows.div_ceil(chunks).max(1);
    let stats = || Ahead::tensor(&[rows], DType::F32);
    for dtype in Ahead::DTYPES {
        let t = |s: &[usize]| Ahead::tensor(s, dtype);
        a.push(format!("layer_norm_forward {dtype:?}"), |device, target| {
            layer_norm_forward_kernel::create_dummy_kernel(
                device,
                target,
                row_cubes(rows),
                CubeDim::new_1d(ROW_UNITS as u32),
                t(&[rows, d]),
                t(&[d]),
                t(&[d]),
                t(&[rows, d]),
                stats(),
                stats(),
                rows,
                d,
                1e-5,
                ROW_UNITS,
                ROW_UNITS,
                elem_type(dtype),
            )
        });
        a.push(
            format!("layer_norm_backward_dx {dtype:?}"),
            |device, target| {
                layer_norm_backward_dx_kernel::create_dummy_kernel(
                    device,
                    target,
                    row_cubes(rows),
                    CubeDim::new_1d(ROW_UNITS as u32),
                    t(&[rows, d]),
                    t(&[d]),
                    stats(),
                    stats(),
                    t(&[rows, d]),
                    t(&[rows, d]),
                    rows,
                    d,
                    ROW_UNITS,
                    ROW_UNITS,
                    elem_type(dtype),
                )
            },
        );
        a.push(
            format!("layer_norm_backward_dwdb {dtype:?}"),
            |device, target| {
                layer_norm_backward_dwdb_kernel::create_dummy_kernel(
                    device,
                    target,
                    CubeCount::Static(d.div_ceil(DWDB_UNITS) as u32, chunks as u32, 1),
                    CubeDim::new_1d(DWDB_UNITS as u32),
                    t(&[rows, d]),
                    stats(),
                    stats(),
                    t(&[rows, d]),
                    Ahead::tensor(&[chunks, 2 * d], DType::F32),
                    rows,
                    d,
                    rows_per_chunk,
                    elem_type(dtype),
                )
            },
        );
    }
}
