//! The MLP's bias and GELU (tanh) on CubeCL devices as one kernel each way: forward, a unit per
//! element writing `gelu(x + bias)`; backward, a unit per element writing the pre-activation's
//! gradient `dy gelu'(x + bias)`, recomputing `x + bias` from the kept `x`. The bias's gradient
//! (a sum over the rows) is Burn's reduction.
//!
//! Composed of Burn's ops under autodiff, the bias add and GELU keep four `[B, T, 4d]` tensors
//! per block for backward (measured on lavapipe; the biased product, its square and its
//! sigmoid among them) and run a dozen element-wise ops in backward; here only the product
//! before the bias is kept. Plugged
//! in as the backend extension [`CubeGeluOps`] for CubeCL's backend, its fusion wrapper and
//! autodiff.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend, TensorMetadata, backend_extension};
use burn::tensor::Shape;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

use super::cube::{Ahead, elem_type};

/// `gelu(x + bias)` over the last dimension, forward and backward, on CubeCL devices.
#[backend_extension(Cube, Fusion, Autodiff)]
pub trait CubeGeluOps: Backend {
    /// `gelu(x + bias)`, GELU's tanh approximation, `bias` broadcast over the rows of `x`;
    /// differentiable where the backend is.
    ///
    /// # Shapes
    /// - x: `[..., d]`, bias: `[d]`
    /// - output: `[..., d]`
    #[fusion(default)]
    fn cube_bias_gelu(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::cube_bias_gelu_forward(x, bias)
    }

    /// The forward alone.
    #[fusion(dtype = x, shape = x)]
    fn cube_bias_gelu_forward(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self>;

    /// The gradient of `x + bias` (so of `x`) from the output's `dy`.
    #[fusion(dtype = x, shape = x)]
    fn cube_bias_gelu_backward(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

const GELU_A: f32 = 0.044715;
const TWO_SQRT_2_OVER_PI: f32 = 2.0 * 0.797_884_6;

/// `x sigmoid(2u)` with `u = sqrt(2/pi) (x + 0.044715 x^3)`: the host kernels' formula
/// (`rows.rs`), evaluated in f32.
#[cube]
fn gelu_of(x: f32) -> f32 {
    let u2 = (x + x * x * x * GELU_A) * TWO_SQRT_2_OVER_PI;
    x * (f32::new(1.0) / (f32::new(1.0) + f32::exp(-u2)))
}

/// `dy` times the derivative of [`gelu_of`] at `x`.
#[cube]
fn gelu_grad_of(x: f32, dy: f32) -> f32 {
    let x2 = x * x;
    let u2 = (x + x2 * x * GELU_A) * TWO_SQRT_2_OVER_PI;
    let s = f32::new(1.0) / (f32::new(1.0) + f32::exp(-u2));
    let du2 = (f32::new(1.0) + x2 * (3.0 * GELU_A)) * TWO_SQRT_2_OVER_PI;
    dy * (s + x * s * (f32::new(1.0) - s) * du2)
}

/// One unit per element: reads `x` and its column's bias, writes `gelu(x + bias)`.
#[cube(launch, create_dummy_kernel)]
fn bias_gelu_forward_kernel<E: Float>(
    x: &Tensor<E>,
    bias: &Tensor<E>,
    y: &mut Tensor<E>,
    d: usize,
    #[define(E)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i < y.len() {
        let v = f32::cast_from(x[i]) + f32::cast_from(bias[i % d]);
        y[i] = E::cast_from(gelu_of(v));
    }
}

/// One unit per element: reads `x`, its column's bias and `dy`, writes the gradient of
/// `x + bias`.
#[cube(launch, create_dummy_kernel)]
fn bias_gelu_backward_kernel<E: Float>(
    x: &Tensor<E>,
    bias: &Tensor<E>,
    dy: &Tensor<E>,
    dx: &mut Tensor<E>,
    d: usize,
    #[define(E)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i < dx.len() {
        let v = f32::cast_from(x[i]) + f32::cast_from(bias[i % d]);
        dx[i] = E::cast_from(gelu_grad_of(v, f32::cast_from(dy[i])));
    }
}

/// Units per cube of the element-wise kernels.
const UNITS: u32 = 256;

impl CubeGeluOps for CubeBackend {
    fn cube_bias_gelu_forward(x: CubeTensor, bias: CubeTensor) -> CubeTensor {
        let (x, bias) = (into_contiguous(x), into_contiguous(bias));
        let shape = x.shape();
        let (n, d) = (shape.num_elements(), shape[shape.num_dims() - 1]);
        let (client, device, dtype) = (x.client.clone(), x.device.clone(), x.dtype);
        let y = empty_device_contiguous_dtype(client.clone(), device, shape, dtype);
        if n == 0 {
            return y;
        }
        let cube_dim = CubeDim::new_1d(UNITS);
        bias_gelu_forward_kernel::launch(
            &client,
            calculate_cube_count_elemwise(&client, n, cube_dim),
            cube_dim,
            x.into_tensor_arg(),
            bias.into_tensor_arg(),
            y.clone().into_tensor_arg(),
            d,
            elem_type(dtype),
        );
        y
    }

    fn cube_bias_gelu_backward(x: CubeTensor, bias: CubeTensor, dy: CubeTensor) -> CubeTensor {
        let (x, bias, dy) = (
            into_contiguous(x),
            into_contiguous(bias),
            into_contiguous(dy),
        );
        let shape = x.shape();
        let (n, d) = (shape.num_elements(), shape[shape.num_dims() - 1]);
        let (client, device, dtype) = (x.client.clone(), x.device.clone(), x.dtype);
        let dx = empty_device_contiguous_dtype(client.clone(), device, shape, dtype);
        if n == 0 {
            return dx;
        }
        let cube_dim = CubeDim::new_1d(UNITS);
        bias_gelu_backward_kernel::launch(
            &client,
            calculate_cube_count_elemwise(&client, n, cube_dim),
            cube_dim,
            x.into_tensor_arg(),
            bias.into_tensor_arg(),
            dy.into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            d,
            elem_type(dtype),
        );
        dx
    }
}

#[derive(Debug)]
struct BiasGeluBackward;

impl<B: CubeGeluOps> Backward<B, 2> for BiasGeluBackward {
    /// The input before the bias, and the bias.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pb] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (x, bias) = ops.state;
        let shape = x.shape();
        let d = shape[shape.num_dims() - 1];
        let rows = shape.num_elements() / d.max(1);
        let dx = B::cube_bias_gelu_backward(x, bias, dy);
        if let Some(pb) = pb {
            let rowed = B::float_reshape(dx.clone(), Shape::new([rows, d]));
            let db = B::float_reshape(super::cube::sum_rows::<B>(rowed, rows, d), Shape::new([d]));
            grads.register::<B>(pb.id, db);
        }
        if let Some(px) = px {
            grads.register::<B>(px.id, dx);
        }
    }
}

impl<B: CubeGeluOps, C: CheckpointStrategy> CubeGeluOps for Autodiff<B, C> {
    fn cube_bias_gelu(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self> {
        let (xp, bp) = (x.primitive().clone(), bias.primitive().clone());
        let prep = BiasGeluBackward
            .prepare::<C>([x.node(), bias.node()])
            .compute_bound()
            .stateful();
        let y = B::cube_bias_gelu_forward(xp.clone(), bp.clone());
        match prep {
            OpsKind::Tracked(prep) => prep.finish((xp, bp), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    /// Untracked: only [`CubeGeluOps::cube_bias_gelu`] has a gradient.
    fn cube_bias_gelu_forward(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::from_inner(B::cube_bias_gelu_forward(
            x.primitive().clone(),
            bias.primitive().clone(),
        ))
    }

    /// Untracked, as the forward.
    fn cube_bias_gelu_backward(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::cube_bias_gelu_backward(
            x.primitive().clone(),
            bias.primitive().clone(),
            dy.primitive().clone(),
        ))
    }
}

/// The forward and backward as a gpt2 step launches them ([`Ahead`]).
pub(super) fn ahead(a: &mut Ahead) {
    let shape = [Ahead::B, Ahead::T, 4 * Ahead::D];
    let d = shape[2];
    for dtype in Ahead::DTYPES {
        let t = |s: &[usize]| Ahead::tensor(s, dtype);
        a.push(format!("bias_gelu_forward {dtype:?}"), |device, target| {
            bias_gelu_forward_kernel::create_dummy_kernel(
                device,
                target,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(UNITS),
                t(&shape),
                t(&[d]),
                t(&shape),
                d,
                elem_type(dtype),
            )
        });
        a.push(format!("bias_gelu_backward {dtype:?}"), |device, target| {
            bias_gelu_backward_kernel::create_dummy_kernel(
                device,
                target,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(UNITS),
                t(&shape),
                t(&[d]),
                t(&shape),
                t(&shape),
                d,
                elem_type(dtype),
            )
        });
    }
}
