//! Fused CPU kernels for the `flex` backend: linear layers with their bias, GELU (tanh),
//! LayerNorm, causal attention on the packed q/k/v projection, and softmax cross-entropy,
//! each with its own backward pass.
//!
//! Under autodiff Burn builds these from chains of element-wise ops (attention included),
//! each a pass over memory and a node of the graph. Here each is one Burn backend extension
//! ([`FusedOps`]) implemented for `Flex` and, with a hand-written backward, for
//! `Autodiff<Flex>`. The functions below take the fused path on a `flex` device with f32 or
//! bf16 tensors. With the `cubecl` feature, attention, cross-entropy and LayerNorm on a CubeCL
//! device (wgpu, CUDA, ROCm) take ember's CubeCL kernels instead (`flash.rs`,
//! `cube_cross_entropy.rs`, `cube_layer_norm.rs`, each its own backend extension), and so do
//! the MLP's bias and GELU (`cube_gelu.rs`). Everything
//! else composes Burn's ops (ndarray, f64, and the other ops on CubeCL devices), so the op
//! definitions are the same on every backend.
//!
//! A bf16 tensor is widened to f32 on entry and each result rounded back to bf16
//! (`bf16`); the linear layers multiply in bf16 with f32 sums, on the CPU's bf16
//! dot-product instructions where it has them.

#[cfg(feature = "cubecl")]
mod ahead;
#[cfg(target_arch = "x86_64")]
mod amx;
mod attention;
#[cfg(feature = "cubecl")]
mod attention_products;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod bf16;
mod bits;
#[cfg(feature = "cubecl")]
mod cube;
#[cfg(feature = "cubecl")]
mod cube_cross_entropy;
#[cfg(feature = "cubecl")]
mod cube_gelu;
#[cfg(feature = "cubecl")]
mod cube_layer_norm;
#[cfg(feature = "cubecl")]
mod flash;
mod linear;
mod product;
mod rows;
mod simd;
mod warm;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Backend, Dispatch, Flex, backend_extension};
use burn::nn::Linear;
use burn::tensor::activation::{log_softmax, sigmoid};
use burn::tensor::module::{attention as burn_attention, layer_norm as burn_layer_norm};
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{DType, Device, Int, Shape, Tensor, TensorData};
use burn_flex::FlexTensor;
use rayon::prelude::*;

#[cfg(feature = "cubecl")]
pub use ahead::ahead;
use attention::Dims;
#[cfg(feature = "cubecl")]
pub use attention_products::{CubeAttention, cube_attention, set_cube_attention};
use bf16::Precision;
pub use bf16::{BF16_DOT_PAYS_FROM, Bf16Products, bf16_pays, bf16_products, has_amx, has_bf16_dot};
#[cfg(feature = "cubecl")]
pub use cube_cross_entropy::CubeCrossEntropyOps;
#[cfg(feature = "cubecl")]
pub use cube_gelu::CubeGeluOps;
#[cfg(feature = "cubecl")]
pub use cube_layer_norm::CubeLayerNormOps;
#[cfg(feature = "cubecl")]
pub use flash::FlashOps;
pub use warm::{keepers, warm_threads};

/// The fused operations, as a Burn backend extension.
#[backend_extension(Flex, Autodiff)]
pub trait FusedOps: Backend {
    /// `x W + b` over the last dimension of `x`, with `W` of `[d_in, d_out]`.
    fn fused_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
    /// GELU, tanh approximation, element-wise.
    fn fused_gelu_tanh(x: FloatTensor<Self>) -> FloatTensor<Self>;
    /// LayerNorm over the last dimension.
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self>;
    /// Causal self-attention of a packed `[B, T, 3d]` projection into `[B, T, d]`.
    fn fused_causal_attention(qkv: FloatTensor<Self>, n_head: usize) -> FloatTensor<Self>;
    /// Mean softmax cross-entropy of `[N, V]` logits against `[N]` targets, `[1]`.
    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> FloatTensor<Self>;
}

/// Whether ops on `x` take the fused kernels: f32 or bf16 on the `flex` device, with or
/// without autodiff. Other tensors use Burn's composed ops.
pub fn uses_fused_kernels<const D: usize>(x: &Tensor<D>) -> bool {
    matches!(x.dtype(), DType::F32 | DType::BF16) && x.device().inner() == Device::flex()
}

/// A linear layer with a bias, `x W + b` (Burn's `[d_in, d_out]` weight layout): one
/// pass writes the output, with the bias folded into the product.
///
/// # Shapes
/// - x: `[..., d_in]`
/// - output: `[..., d_out]`
pub fn linear<const D: usize>(x: Tensor<D>, layer: &Linear) -> Tensor<D> {
    match &layer.bias {
        Some(bias) if uses_fused_kernels(&x) => Tensor::from_dispatch(Dispatch::fused_linear(
            x.into_dispatch(),
            layer.weight.val().into_dispatch(),
            bias.val().into_dispatch(),
        )),
        _ => layer.forward(x),
    }
}

/// A linear layer without a bias whose weight is stored transposed, `x W^T` for `W` of
/// `[d_out, d_in]`: the output head tied to the token embedding. On the fused path it is
/// [`linear`] with a zero bias that takes no gradient.
///
/// # Shapes
/// - x: `[..., d_in]`, weight: `[d_out, d_in]`
/// - output: `[..., d_out]`
pub fn linear_transposed<const D: usize>(x: Tensor<D>, weight: Tensor<2>) -> Tensor<D> {
    if uses_fused_kernels(&x) {
        let [d_out, _] = weight.dims();
        let bias = Tensor::<1>::zeros([d_out], (&x.device(), x.dtype()));
        return Tensor::from_dispatch(Dispatch::fused_linear(
            x.into_dispatch(),
            weight.transpose().into_dispatch(),
            bias.into_dispatch(),
        ));
    }
    burn::tensor::module::linear(x, weight.transpose(), None)
}

/// GELU, tanh approximation (GPT-2's `gelu_new`): `0.5 x (1 + tanh(u))` with
/// `u = sqrt(2/pi) (x + 0.044715 x^3)`, computed as the identical `x sigmoid(2u)`.
///
/// # Shapes
/// - x: `[...]`
/// - output: `[...]`
pub fn gelu_tanh<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    if uses_fused_kernels(&x) {
        return Tensor::from_dispatch(Dispatch::fused_gelu_tanh(x.into_dispatch()));
    }
    composed_gelu_tanh(x)
}

/// [`gelu_tanh`] composed of Burn's ops on any backend.
fn composed_gelu_tanh<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
    let cube = x.clone() * x.clone() * x.clone();
    let u2 = (x.clone() + cube * 0.044715) * (2.0 * SQRT_2_OVER_PI);
    x * sigmoid(u2)
}

/// `gelu_tanh(linear(x, layer))`: the MLP's expansion. On a CubeCL device the product is
/// Burn's and the bias and GELU one kernel each way (`cube_gelu.rs`), keeping only the product
/// for backward; elsewhere [`linear`] then [`gelu_tanh`].
///
/// # Shapes
/// - x: `[..., d_in]`
/// - output: `[..., d_out]`
pub fn linear_gelu<const D: usize>(x: Tensor<D>, layer: &Linear) -> Tensor<D> {
    #[cfg(feature = "cubecl")]
    if let Some(bias) = &layer.bias
        && uses_cube_kernels(&x)
        && bias.val().dtype() == x.dtype()
    {
        let h = burn::tensor::module::linear(x, layer.weight.val(), None);
        return Tensor::from_dispatch(Dispatch::cube_bias_gelu(
            h.into_dispatch(),
            bias.val().into_dispatch(),
        ));
    }
    gelu_tanh(linear(x, layer))
}

/// [`linear_gelu`] composed of Burn's ops on any backend: the definition the CubeCL kernels
/// are tested against.
pub fn composed_linear_gelu<const D: usize>(x: Tensor<D>, layer: &Linear) -> Tensor<D> {
    composed_gelu_tanh(layer.forward(x))
}

/// LayerNorm over the last dimension: `(x - mean) / sqrt(var + eps) * weight + bias`.
///
/// # Shapes
/// - x: `[..., d]`, weight, bias: `[d]`
/// - output: `[..., d]`
pub fn layer_norm<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<1>,
    bias: Tensor<1>,
    eps: f64,
) -> Tensor<D> {
    if uses_fused_kernels(&x) {
        return Tensor::from_dispatch(Dispatch::fused_layer_norm(
            x.into_dispatch(),
            weight.into_dispatch(),
            bias.into_dispatch(),
            eps,
        ));
    }
    #[cfg(feature = "cubecl")]
    if uses_cube_kernels(&x) && weight.dtype() == x.dtype() && bias.dtype() == x.dtype() {
        return Tensor::from_dispatch(Dispatch::cube_layer_norm(
            x.into_dispatch(),
            weight.into_dispatch(),
            bias.into_dispatch(),
            eps,
        ));
    }
    burn_layer_norm(x, weight, Some(bias), eps)
}

/// Causal multi-head self-attention of a packed q/k/v projection (q, k, v side by side on
/// the last dimension, heads side by side within each), scaled by `1 / sqrt(d / n_head)`.
///
/// # Shapes
/// - qkv: `[B, T, 3d]`
/// - output: `[B, T, d]`, heads side by side
pub fn causal_attention(qkv: Tensor<3>, n_head: usize) -> Tensor<3> {
    if uses_fused_kernels(&qkv) {
        return Tensor::from_dispatch(Dispatch::fused_causal_attention(
            qkv.into_dispatch(),
            n_head,
        ));
    }
    // The flash kernels read a head's columns four at a time, and split them in two halves.
    #[cfg(feature = "cubecl")]
    if uses_cube_kernels(&qkv) && (qkv.dims()[2] / 3 / n_head).is_multiple_of(8) {
        let cap = attention_products::scores_cap(cube_attention());
        return Tensor::from_dispatch(Dispatch::flash_attention(qkv.into_dispatch(), n_head, cap));
    }
    composed_causal_attention(qkv, n_head)
}

/// Whether ops on `x` take ember's CubeCL kernels (attention in `flash.rs`, cross-entropy in
/// `cube_cross_entropy.rs`, LayerNorm in `cube_layer_norm.rs`, the MLP's bias and GELU in
/// `cube_gelu.rs`): a float tensor on a CubeCL device (wgpu, CUDA, ROCm), unless
/// `EMBER_CUBE_KERNELS=0` turned them off for the process. With them off the step composes
/// Burn's generic ops, as PyTorch falls back with `torch.backends.cuda.enable_flash_sdp(False)`:
/// to tell a kernel's fault from the rest on a new device, or to compare. The sharding
/// engine's AdamW kernel reads the same variable (`ember_sharding::plumbing::kernels`).
#[cfg(feature = "cubecl")]
pub fn uses_cube_kernels<const D: usize>(x: &Tensor<D>) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("EMBER_CUBE_KERNELS").as_deref() != Ok("0"))
        && matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && matches!(
            x.device().inner().as_dispatch(),
            burn::backend::DispatchDevice::Cube(_)
        )
}

/// Whether `device` runs TF32 products on tensor cores (CUDA from compute capability 8.0):
/// there Burn's matmul autotune may take f32 operands as TF32 (10 stored mantissa bits, sums
/// in f32) wherever such a kernel is faster, as PyTorch does under
/// `torch.set_float32_matmul_precision("high")`; Burn 0.22 offers no switch to keep them in
/// IEEE f32. `ember bench matmul --dtype f32` measures what each product keeps. False off
/// CubeCL devices.
#[cfg(feature = "cubecl")]
pub fn runs_tf32(device: &burn::tensor::Device) -> bool {
    use cubecl::ir::{ElemType, FloatKind};
    match device.clone().inner().as_dispatch() {
        burn::backend::DispatchDevice::Cube(d) => d
            .client()
            .properties()
            .supports_type(ElemType::Float(FloatKind::TF32)),
        _ => false,
    }
}

/// [`causal_attention`] composed of Burn's ops on any backend: the definition the fused and
/// flash kernels are tested against.
pub fn composed_causal_attention(qkv: Tensor<3>, n_head: usize) -> Tensor<3> {
    let [b, t, d3] = qkv.dims();
    let (d, h) = (d3 / 3, n_head);
    let heads = |m: Tensor<3>| m.reshape([b, t, h, d / h]).swap_dims(1, 2); // [B, H, T, hd]
    let mut parts = qkv.chunk(3, 2).into_iter().map(heads);
    let (q, k, v) = (
        parts.next().unwrap(),
        parts.next().unwrap(),
        parts.next().unwrap(),
    );
    let options = AttentionModuleOptions {
        is_causal: true,
        ..Default::default()
    };
    let y = burn_attention(q, k, v, None, None, options); // [B, H, T, hd]
    y.swap_dims(1, 2).reshape([b, t, d])
}

/// Mean softmax cross-entropy (nats) of each row of `logits` against its target.
///
/// # Shapes
/// - logits: `[N, V]`, targets: `[N]`
/// - output: `[1]`
pub fn softmax_cross_entropy(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    if uses_fused_kernels(&logits) {
        return Tensor::from_dispatch(Dispatch::fused_cross_entropy(
            logits.into_dispatch(),
            targets.into_dispatch(),
        ));
    }
    #[cfg(feature = "cubecl")]
    if uses_cube_kernels(&logits) {
        let dtype = logits.dtype();
        let rows = Tensor::<1>::from_dispatch(Dispatch::cross_entropy_rows(
            logits.into_dispatch(),
            targets.into_dispatch(),
        ));
        let n = rows.dims()[0];
        if n <= cube::SUM_ROWS {
            return rows.mean().cast(dtype);
        }
        // Burn's own mean on wgpu is wrong past 524,288 rows: a sum in blocks, over n.
        let column = rows.reshape([n, 1]).into_dispatch();
        let sum = Tensor::<2>::from_dispatch(cube::sum_rows::<Dispatch>(column, n, 1));
        return sum.reshape([1]).div_scalar(n as f64).cast(dtype);
    }
    composed_softmax_cross_entropy(logits, targets)
}

/// [`softmax_cross_entropy`] composed of Burn's ops on any backend: the definition the fused
/// and CubeCL kernels are tested against.
pub fn composed_softmax_cross_entropy(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    let [n, _] = logits.dims();
    let logp = log_softmax(logits, 1); // [N, V]
    logp.gather(1, targets.reshape([n, 1])).mean().neg()
}

/// Which product f32 operands run on this CPU, for a run's first lines.
pub fn f32_products() -> String {
    #[cfg(target_arch = "x86_64")]
    if avx512::available() {
        let l2 = match ember_cpu::cpu().l2_bytes {
            Some(bytes) => format!("this CPU's {} KiB L2", bytes >> 10),
            None => "an L2 this CPU does not report".into(),
        };
        let ahead = match avx512::panel_ahead() {
            0 => String::new(),
            steps => format!(", panels prefetched {steps} steps ahead"),
        };
        let transposed = if avx512::packs_transposed() {
            ", transposed left operands packed"
        } else {
            ", transposed left operands read in place"
        };
        return format!(
            "f32 products on ember's AVX-512 kernels (FMA, 6 x 64 register tiles, blocks of \
             {} steps{ahead}{transposed} for {l2})",
            avx512::kc()
        );
    }
    if std::env::var("EMBER_F32_PRODUCT").as_deref() == Ok("gemm") {
        "f32 products on the gemm crate's kernels (EMBER_F32_PRODUCT=gemm)".into()
    } else {
        "f32 products on the gemm crate's kernels (this CPU has no AVX-512)".into()
    }
}

/// An operand of [`cpu_product`]: f32 values, or bf16 bits.
#[derive(Debug, Clone, Copy)]
pub enum CpuOperand<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl CpuOperand<'_> {
    fn len(&self) -> usize {
        match self {
            CpuOperand::F32(v) => v.len(),
            CpuOperand::Bf16(v) => v.len(),
        }
    }
}

/// `out = lhs rhs`, an `m x k` by `k x n` product (`out` row-major), through the products
/// ember's CPU kernels run: f32 values through the f32 product (ember's own on AVX-512, else
/// `gemm`'s), bf16 bits through the bf16 product ([`bf16_products`]: AMX tiles,
/// `vdpbf16ps`, or the f32 product of the widened values), on rayon's threads. Each operand
/// comes with its [row stride, column stride], so a transposed view is read in place.
///
/// # Panics
/// If an operand's strides reach past its elements, `out` does not hold `m x n`, or the two
/// operands are of different kinds.
pub fn cpu_product(
    [m, n, k]: [usize; 3],
    (lhs, ls): (CpuOperand, [usize; 2]),
    (rhs, rs): (CpuOperand, [usize; 2]),
    out: &mut [f32],
) {
    assert_eq!(Some(out.len()), m.checked_mul(n), "the output holds m x n");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out.fill(0.0);
        return;
    }
    // The last element an operand's strides address, where every offset fits an isize.
    let last = |[r, c]: [usize; 2], [s0, s1]: [usize; 2]| {
        let at = (r - 1)
            .checked_mul(s0)?
            .checked_add((c - 1).checked_mul(s1)?)?;
        isize::try_from(at).ok().map(|_| at)
    };
    let fits = |dims, s, len| last(dims, s).is_some_and(|at| at < len);
    assert!(fits([m, k], ls, lhs.len()), "lhs's strides reach past it");
    assert!(fits([k, n], rs, rhs.len()), "rhs's strides reach past it");
    let strides = |[a, b]: [usize; 2]| [a as isize, b as isize];
    let dst = (out.as_mut_ptr(), n as isize);
    // SAFETY: every element either operand's strides address is in bounds (asserted), and
    // `out` is this call's, m x n.
    unsafe {
        match (lhs, rhs) {
            (CpuOperand::F32(a), CpuOperand::F32(b)) => product::product(
                [m, n, k],
                dst,
                (a.as_ptr(), strides(ls)),
                (b.as_ptr(), strides(rs)),
                1.0,
                false,
                true,
            ),
            (CpuOperand::Bf16(a), CpuOperand::Bf16(b)) => bf16::product(
                [m, n, k],
                dst,
                (bf16::Src::Bf16(a.as_ptr()), strides(ls)),
                (bf16::Src::Bf16(b.as_ptr()), strides(rs)),
                1.0,
                false,
                true,
            ),
            _ => panic!("cpu_product takes two operands of one kind"),
        }
    }
}

/// `len` zeros, written in parallel pieces: a kernel's output buffer, which a serial
/// `vec![0.0; len]` would fill on the calling thread alone while rayon's threads wait.
pub(crate) fn zeros(len: usize) -> Vec<f32> {
    const PIECE: usize = 1 << 15;
    let mut v = Vec::with_capacity(len);
    v.spare_capacity_mut()[..len]
        .par_chunks_mut(PIECE)
        .for_each(|p| p.fill(std::mem::MaybeUninit::new(0.0)));
    // SAFETY: every element below `len` was written above.
    unsafe { v.set_len(len) };
    v
}

/// The elements of an f32 or bf16 tensor as f32, in row-major order.
fn floats(t: &FlexTensor) -> Vec<f32> {
    if t.dtype() == DType::BF16 {
        let widen = |s: &[burn::tensor::bf16]| bf16::widen(bf16_bits(s));
        return match t.as_slice() {
            Some(s) => widen(s),
            None => widen(t.to_contiguous().as_slice().unwrap()),
        };
    }
    match t.as_slice::<f32>() {
        Some(s) => s.to_vec(),
        None => t.to_contiguous().as_slice::<f32>().unwrap().to_vec(),
    }
}

/// Runs `f` on the elements of an f32 or bf16 tensor, in row-major order, copying only when
/// the tensor is not contiguous.
fn with_matrix<R>(t: &FlexTensor, f: impl FnOnce(linear::Matrix) -> R) -> R {
    if t.dtype() == DType::BF16 {
        return match t.as_slice() {
            Some(s) => f(linear::Matrix::Bf16(bf16_bits(s))),
            None => f(linear::Matrix::Bf16(bf16_bits(
                t.to_contiguous().as_slice().unwrap(),
            ))),
        };
    }
    with_floats(t, |v| f(linear::Matrix::F32(v)))
}

/// The bits of a contiguous bf16 tensor's elements, in row-major order.
fn bf16_elements(t: &FlexTensor) -> Option<&[u16]> {
    (t.dtype() == DType::BF16)
        .then(|| t.as_slice::<burn::tensor::bf16>())
        .flatten()
        .map(bf16_bits)
}

/// A bf16 tensor of `bits`.
fn bf16_tensor(bits: Vec<u16>, shape: Shape) -> FlexTensor {
    let mut bits = std::mem::ManuallyDrop::new(bits);
    // SAFETY: `bf16` is a transparent wrapper of its `u16` bits, so the allocation, length
    // and capacity carry over unchanged.
    let values = unsafe {
        Vec::from_raw_parts(
            bits.as_mut_ptr().cast::<burn::tensor::bf16>(),
            bits.len(),
            bits.capacity(),
        )
    };
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// The bits of bf16 values.
fn bf16_bits(s: &[burn::tensor::bf16]) -> &[u16] {
    // SAFETY: `bf16` is a transparent wrapper of its `u16` bits.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), s.len()) }
}

/// Runs `f` on the elements of a float tensor as f32, in row-major order, copying only when
/// the tensor is not contiguous f32.
fn with_floats<R>(t: &FlexTensor, f: impl FnOnce(&[f32]) -> R) -> R {
    match t.as_slice::<f32>() {
        Some(s) if t.dtype() == DType::F32 => f(s),
        _ => f(&floats(t)),
    }
}

/// LayerNorm of `x` as a tensor of `x`'s dtype and `shape`, with each row's mean and
/// reciprocal standard deviation: on bf16 bits in one pass where `x` is contiguous bf16.
fn layer_norm_flex(
    x: &FlexTensor,
    weight: &FlexTensor,
    bias: &FlexTensor,
    eps: f64,
    shape: Shape,
) -> (FlexTensor, [Vec<f32>; 2]) {
    let (w, b) = (floats(weight), floats(bias));
    if let Some(xs) = bf16_elements(x) {
        let (y, stats) = rows::layer_norm_bf16(xs, &w, &b, eps as f32);
        return (bf16_tensor(y, shape), stats);
    }
    let [y, mean, rstd] = with_floats(x, |xs| rows::layer_norm(xs, &w, &b, eps as f32));
    (flex(y, shape, x.dtype()), [mean, rstd])
}

/// Causal attention of the packed projection `qkv` as a tensor of its dtype, with each
/// query's log-sum-exp: on bf16 bits, a head at a time, where `qkv` is contiguous bf16.
fn attention_flex(qkv: &FlexTensor, dims: Dims) -> (FlexTensor, Vec<f32>) {
    let shape = Shape::from(vec![dims.b, dims.t, dims.h * dims.hd]);
    if let Some(bits) = bf16_elements(qkv) {
        let (out, lse) = attention::forward_bf16(bits, dims);
        return (bf16_tensor(out, shape), lse);
    }
    let how = precision(qkv.dtype());
    let (out, lse) = with_floats(qkv, |q| attention::forward(q, dims, how));
    (flex(out, shape, qkv.dtype()), lse)
}

/// The mean softmax cross-entropy of `logits` against `targets`, and each row's log-sum-exp:
/// on bf16 bits, a row at a time, where `logits` is contiguous bf16.
fn cross_entropy_of(logits: &FlexTensor, targets: &[usize]) -> (f32, Vec<f32>) {
    match bf16_elements(logits) {
        Some(bits) => rows::cross_entropy_bf16(bits, targets),
        None => with_floats(logits, |l| rows::cross_entropy(l, targets)),
    }
}

/// The elements of an integer tensor as indices.
fn indices(t: &FlexTensor) -> Vec<usize> {
    let t = t.to_contiguous();
    match t.dtype() {
        DType::I64 => t
            .as_slice::<i64>()
            .unwrap()
            .iter()
            .map(|&i| i as usize)
            .collect(),
        DType::I32 => t
            .as_slice::<i32>()
            .unwrap()
            .iter()
            .map(|&i| i as usize)
            .collect(),
        other => panic!("cross-entropy targets must be i32 or i64, not {other:?}"),
    }
}

/// A tensor of `values`, rounded to bf16 when `dtype` is bf16.
fn flex(values: Vec<f32>, shape: Shape, dtype: DType) -> FlexTensor {
    if dtype == DType::BF16 {
        return FlexTensor::from_data(TensorData::new(bf16::round_to_bf16(&values), shape));
    }
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// How the products of kernels on tensors of `dtype` round their operands.
fn precision(dtype: DType) -> Precision {
    if dtype == DType::BF16 {
        Precision::Bf16
    } else {
        Precision::F32
    }
}

fn dims(t: &FlexTensor) -> Vec<usize> {
    t.layout().shape().iter().copied().collect()
}

/// The attention shapes of a packed `[B, T, 3d]` projection.
fn attention_dims(qkv: &FlexTensor, n_head: usize) -> Dims {
    let [b, t, d3] = dims(qkv)[..] else {
        panic!("fused attention takes a [B, T, 3d] projection");
    };
    let d = d3 / 3;
    assert!(
        d3 % 3 == 0 && d % n_head == 0,
        "3d = {d3} does not split into {n_head} heads"
    );
    Dims {
        b,
        t,
        h: n_head,
        hd: d / n_head,
    }
}

/// Checks that every index is below `v` (the vocabulary size), as Burn's gather would.
fn check_targets(targets: &[usize], v: usize) {
    if let Some(t) = targets.iter().find(|&&t| t >= v) {
        panic!("cross-entropy target {t} is out of range for {v} classes");
    }
}

/// `shape` with its last dimension replaced by `last`.
fn with_last(shape: &Shape, last: usize) -> Shape {
    let mut dims: Vec<usize> = shape.iter().copied().collect();
    *dims
        .last_mut()
        .expect("a linear layer's input has a feature dimension") = last;
    Shape::from(dims)
}

impl FusedOps for Flex {
    fn fused_linear(x: FlexTensor, weight: FlexTensor, bias: FlexTensor) -> FlexTensor {
        let b = floats(&bias);
        let (shape, dtype) = (with_last(x.layout().shape(), b.len()), x.dtype());
        if dtype == DType::BF16 {
            let bits = with_matrix(&x, |x| {
                with_matrix(&weight, |w| linear::forward_bits(x, w, &b))
            });
            if let Some(y) = bits {
                return bf16_tensor(y, shape);
            }
        }
        let y = with_matrix(&x, |x| {
            with_matrix(&weight, |w| linear::forward(x, w, &b, precision(dtype)))
        });
        flex(y, shape, dtype)
    }

    fn fused_gelu_tanh(x: FlexTensor) -> FlexTensor {
        let shape = x.layout().shape().clone();
        if let Some(x) = bf16_elements(&x) {
            return bf16_tensor(rows::gelu_bf16(x), shape);
        }
        flex(with_floats(&x, rows::gelu), shape, x.dtype())
    }

    fn fused_layer_norm(
        x: FlexTensor,
        weight: FlexTensor,
        bias: FlexTensor,
        eps: f64,
    ) -> FlexTensor {
        let shape = x.layout().shape().clone();
        layer_norm_flex(&x, &weight, &bias, eps, shape).0
    }

    fn fused_causal_attention(qkv: FlexTensor, n_head: usize) -> FlexTensor {
        attention_flex(&qkv, attention_dims(&qkv, n_head)).0
    }

    fn fused_cross_entropy(logits: FlexTensor, targets: FlexTensor) -> FlexTensor {
        let targets = indices(&targets);
        let v = dims(&logits)[1];
        check_targets(&targets, v);
        let (loss, _) = cross_entropy_of(&logits, &targets);
        flex(vec![loss], Shape::from(vec![1]), logits.dtype())
    }
}

#[derive(Debug)]
struct LinearBackward;

impl Backward<Flex, 3> for LinearBackward {
    /// The input, the weight and the bias's dtype.
    type State = (FlexTensor, FlexTensor, DType);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pw, pb] = ops.parents;
        let dy = grads.consume::<Flex>(&ops.node);
        let (x, w, bias) = &ops.state;
        let [d_in, d_out] = dims(w)[..] else {
            panic!("a linear layer's weight is [d_in, d_out]");
        };
        let how = precision(x.dtype());
        let shape = x.layout().shape().clone();
        let bits = if x.dtype() == DType::BF16 {
            with_matrix(x, |xs| {
                with_matrix(w, |ws| {
                    with_matrix(&dy, |dy| linear::backward_bits(xs, ws, dy, d_out))
                })
            })
        } else {
            None
        };
        let (dx, [dw, db]) = match bits {
            Some((dx, dwdb)) => (bf16_tensor(dx, shape), dwdb),
            None => {
                let [dx, dw, db] = with_matrix(x, |xs| {
                    with_matrix(w, |ws| {
                        with_matrix(&dy, |dy| linear::backward(xs, ws, dy, d_out, how))
                    })
                });
                (flex(dx, shape, x.dtype()), [dw, db])
            }
        };
        if let Some(p) = px {
            grads.register::<Flex>(p.id, dx);
        }
        if let Some(p) = pw {
            let shape = Shape::from(vec![d_in, d_out]);
            grads.register::<Flex>(p.id, flex(dw, shape, w.dtype()));
        }
        if let Some(p) = pb {
            grads.register::<Flex>(p.id, flex(db, Shape::from(vec![d_out]), *bias));
        }
    }
}

#[derive(Debug)]
struct GeluBackward;

impl Backward<Flex, 1> for GeluBackward {
    /// The input.
    type State = FlexTensor;

    fn backward(self, ops: Ops<FlexTensor, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let dy = grads.consume::<Flex>(&ops.node);
        if let Some(parent) = parent {
            let x = &ops.state;
            let shape = x.layout().shape().clone();
            let dx = match (bf16_elements(x), bf16_elements(&dy)) {
                (Some(x), Some(dy)) => bf16_tensor(rows::gelu_backward_bf16(x, dy), shape),
                _ => {
                    let dx = with_floats(x, |x| with_floats(&dy, |dy| rows::gelu_backward(x, dy)));
                    flex(dx, shape, x.dtype())
                }
            };
            grads.register::<Flex>(parent.id, dx);
        }
    }
}

#[derive(Debug)]
struct LayerNormBackward;

impl Backward<Flex, 3> for LayerNormBackward {
    /// The input, weight, the bias's dtype, and each row's mean and reciprocal standard
    /// deviation.
    type State = (FlexTensor, FlexTensor, DType, Vec<f32>, Vec<f32>);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pw, pb] = ops.parents;
        let dy = grads.consume::<Flex>(&ops.node);
        let (x, w, bias, mean, rstd) = &ops.state;
        let shape = x.layout().shape().clone();
        let (dx, [dw, db]) = match (bf16_elements(x), bf16_elements(&dy)) {
            (Some(xs), Some(dys)) => {
                let (dx, dwdb) = rows::layer_norm_backward_bf16(xs, &floats(w), mean, rstd, dys);
                (bf16_tensor(dx, shape), dwdb)
            }
            _ => {
                let [dx, dw, db] = with_floats(x, |xs| {
                    with_floats(&dy, |dy| {
                        rows::layer_norm_backward(xs, &floats(w), mean, rstd, dy)
                    })
                });
                (flex(dx, shape, x.dtype()), [dw, db])
            }
        };
        let d = dw.len();
        if let Some(p) = px {
            grads.register::<Flex>(p.id, dx);
        }
        if let Some(p) = pw {
            grads.register::<Flex>(p.id, flex(dw, Shape::from(vec![d]), w.dtype()));
        }
        if let Some(p) = pb {
            grads.register::<Flex>(p.id, flex(db, Shape::from(vec![d]), *bias));
        }
    }
}

#[derive(Debug)]
struct AttentionBackward;

impl Backward<Flex, 1> for AttentionBackward {
    /// The projection, the output, each query's log-sum-exp, and the shapes.
    type State = (FlexTensor, FlexTensor, Vec<f32>, Dims);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let dout = grads.consume::<Flex>(&ops.node);
        if let Some(parent) = parent {
            let (qkv, out, lse, dims) = &ops.state;
            let shape = qkv.layout().shape().clone();
            let bits = (bf16_elements(qkv), bf16_elements(out), bf16_elements(&dout));
            let dqkv = if let (Some(qkv), Some(out), Some(dout)) = bits {
                bf16_tensor(attention::backward_bf16(qkv, out, lse, dout, *dims), shape)
            } else {
                let how = precision(qkv.dtype());
                let dqkv = with_floats(qkv, |qkv| {
                    with_floats(out, |out| {
                        with_floats(&dout, |dout| {
                            attention::backward(qkv, out, lse, dout, *dims, how)
                        })
                    })
                });
                flex(dqkv, shape, qkv.dtype())
            };
            grads.register::<Flex>(parent.id, dqkv);
        }
    }
}

#[derive(Debug)]
struct CrossEntropyBackward;

impl Backward<Flex, 1> for CrossEntropyBackward {
    /// The logits, the targets and each row's log-sum-exp.
    type State = (FlexTensor, Vec<usize>, Vec<f32>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<Flex>(&ops.node);
        if let Some(parent) = parent {
            let (logits, targets, lse) = &ops.state;
            let g = floats(&grad)[0];
            let shape = logits.layout().shape().clone();
            let dlogits = match bf16_elements(logits) {
                Some(l) => {
                    bf16_tensor(rows::cross_entropy_backward_bf16(l, targets, lse, g), shape)
                }
                None => {
                    let dlogits =
                        with_floats(logits, |l| rows::cross_entropy_backward(l, targets, lse, g));
                    flex(dlogits, shape, logits.dtype())
                }
            };
            grads.register::<Flex>(parent.id, dlogits);
        }
    }
}

impl<C: CheckpointStrategy> FusedOps for Autodiff<Flex, C> {
    fn fused_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let (xp, wp, bp) = (
            x.primitive().clone(),
            weight.primitive().clone(),
            bias.primitive().clone(),
        );
        let prep = LinearBackward
            .prepare::<C>([x.node(), weight.node(), bias.node()])
            .compute_bound()
            .stateful();
        let bias = bp.dtype();
        let y = Flex::fused_linear(xp.clone(), wp.clone(), bp);
        match prep {
            OpsKind::Tracked(prep) => prep.finish((xp, wp, bias), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn fused_gelu_tanh(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let input = x.primitive().clone();
        match GeluBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let y = Flex::fused_gelu_tanh(input.clone());
                prep.finish(input, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::fused_gelu_tanh(input)),
        }
    }

    fn fused_layer_norm(
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
        let shape = xp.layout().shape().clone();
        let prep = LayerNormBackward
            .prepare::<C>([x.node(), weight.node(), bias.node()])
            .compute_bound()
            .stateful();
        let (y, [mean, rstd]) = layer_norm_flex(&xp, &wp, &bp, eps, shape);
        match prep {
            OpsKind::Tracked(prep) => prep.finish((xp, wp, bp.dtype(), mean, rstd), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn fused_causal_attention(qkv: FloatTensor<Self>, n_head: usize) -> FloatTensor<Self> {
        let input = qkv.primitive().clone();
        let dims = attention_dims(&input, n_head);
        let prep = AttentionBackward
            .prepare::<C>([qkv.node()])
            .compute_bound()
            .stateful();
        let (out, lse) = attention_flex(&input, dims);
        match prep {
            OpsKind::Tracked(prep) => prep.finish((input, out.clone(), lse, dims), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn fused_cross_entropy(logits: FloatTensor<Self>, targets: FlexTensor) -> FloatTensor<Self> {
        let input = logits.primitive().clone();
        let targets = indices(&targets);
        check_targets(&targets, dims(&input)[1]);
        let prep = CrossEntropyBackward
            .prepare::<C>([logits.node()])
            .compute_bound()
            .stateful();
        let (loss, lse) = cross_entropy_of(&input, &targets);
        let loss = flex(vec![loss], Shape::from(vec![1]), input.dtype());
        match prep {
            OpsKind::Tracked(prep) => prep.finish((input, targets, lse), loss),
            OpsKind::UnTracked(prep) => prep.finish(loss),
        }
    }
}

#[cfg(test)]
mod cpu_product_tests {
    use super::{CpuOperand, cpu_product};

    /// An empty inner dimension gives zeros, reading nothing; strides that reach past an
    /// operand, or overflow, are refused.
    #[test]
    fn cpu_product_checks_its_operands() {
        let mut out = vec![7.0f32; 4];
        cpu_product(
            [2, 2, 0],
            (CpuOperand::Bf16(&[]), [0, 1]),
            (CpuOperand::Bf16(&[]), [2, 1]),
            &mut out,
        );
        assert_eq!(out, [0.0; 4]);
        let a = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut out = vec![0.0f32; 4];
        cpu_product(
            [2, 2, 3],
            (CpuOperand::F32(&a), [3, 1]),
            (CpuOperand::F32(&a), [2, 1]),
            &mut out,
        );
        assert_eq!(out, [22.0, 28.0, 49.0, 64.0]);
        for strides in [[3, 2], [2, usize::MAX]] {
            let refused = std::panic::catch_unwind(|| {
                let mut out = vec![0.0f32; 4];
                cpu_product(
                    [2, 2, 3],
                    (CpuOperand::F32(&a), strides),
                    (CpuOperand::F32(&a), [2, 1]),
                    &mut out,
                );
            });
            assert!(refused.is_err(), "lhs strides {strides:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::bf16::Precision::{Bf16, F32};
    use super::linear::Matrix;
    use super::simd::LEVEL_CAP;
    use super::{attention, bf16, linear, rows};

    /// Deterministic values in [-scale, scale).
    pub(super) fn values(n: usize, seed: u32, scale: f32) -> Vec<f32> {
        let mut z = seed.wrapping_mul(2_654_435_761) | 1;
        (0..n)
            .map(|_| {
                z ^= z << 13;
                z ^= z >> 17;
                z ^= z << 5;
                (z as f32 / u32::MAX as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    /// Every kernel's result, run with versions up to `level` (single-threaded pieces run on
    /// rayon's workers, so the cap is set there too).
    fn all_results(level: u8) -> Vec<Vec<f32>> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .start_handler(move |_| LEVEL_CAP.with(|c| c.set(level)))
            .build()
            .unwrap();
        pool.install(|| {
            LEVEL_CAP.with(|c| c.set(level));
            let x = values(3 * 40 * 70, 1, 3.0);
            let dy = values(3 * 40 * 70, 2, 1.0);
            let w = values(70, 3, 1.0);
            let b = values(70, 4, 1.0);
            let mut out = vec![rows::gelu(&x), rows::gelu_backward(&x, &dy)];
            // GELU on bf16 bits, against widening, the f32 kernel and rounding.
            let (xb, dyb) = (bf16::round(&x), bf16::round(&dy));
            let widened = |v: &[u16]| bf16::widen(v);
            let gelu = bf16::round(&rows::gelu(&widened(&xb)));
            assert_eq!(rows::gelu_bf16(&xb), gelu, "gelu on bf16 bits");
            let grad = bf16::round(&rows::gelu_backward(&widened(&xb), &widened(&dyb)));
            assert_eq!(
                rows::gelu_backward_bf16(&xb, &dyb),
                grad,
                "gelu backward on bf16 bits"
            );
            let [y, mean, rstd] = rows::layer_norm(&x, &w, &b, 1e-5);
            // LayerNorm on bf16 bits, against widening, the f32 kernels and rounding.
            let [yw, mean_w, rstd_w] = rows::layer_norm(&widened(&xb), &w, &b, 1e-5);
            let (yb, [mean_b, rstd_b]) = rows::layer_norm_bf16(&xb, &w, &b, 1e-5);
            assert_eq!(yb, bf16::round(&yw), "layer norm on bf16 bits");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                (bits(&mean_b), bits(&rstd_b)),
                (bits(&mean_w), bits(&rstd_w))
            );
            let [dxw, dww, dbw] =
                rows::layer_norm_backward(&widened(&xb), &w, &mean_w, &rstd_w, &widened(&dyb));
            let (dxb, [dwb, dbb]) = rows::layer_norm_backward_bf16(&xb, &w, &mean_w, &rstd_w, &dyb);
            assert_eq!(dxb, bf16::round(&dxw), "layer norm's dx on bf16 bits");
            assert_eq!((bits(&dwb), bits(&dbb)), (bits(&dww), bits(&dbw)));
            out.extend([y, mean.clone(), rstd.clone()]);
            out.extend(rows::layer_norm_backward(&x, &w, &mean, &rstd, &dy));
            let targets: Vec<usize> = (0..120).map(|i| (i * 7) % 70).collect();
            let (loss, lse) = rows::cross_entropy(&x, &targets);
            // Cross-entropy on bf16 bits, against widening, the f32 kernels and rounding.
            let (loss_w, lse_w) = rows::cross_entropy(&widened(&xb), &targets);
            let (loss_b, lse_b) = rows::cross_entropy_bf16(&xb, &targets);
            assert_eq!(
                (loss_b.to_bits(), bits(&lse_b)),
                (loss_w.to_bits(), bits(&lse_w))
            );
            let dl = rows::cross_entropy_backward(&widened(&xb), &targets, &lse_w, 0.7);
            let dl_b = rows::cross_entropy_backward_bf16(&xb, &targets, &lse_w, 0.7);
            assert_eq!(
                dl_b,
                bf16::round(&dl),
                "cross-entropy's gradient on bf16 bits"
            );
            out.push(vec![loss]);
            out.push(rows::cross_entropy_backward(&x, &targets, &lse, 0.7));
            out.push(lse);
            let dims = attention::Dims {
                b: 2,
                t: 70,
                h: 2,
                hd: 12,
            };
            let qkv = values(2 * 70 * 72, 5, 2.0);
            let dout = values(2 * 70 * 24, 6, 1.0);
            let (o, lse) = attention::forward(&qkv, dims, F32);
            out.push(attention::backward(&qkv, &o, &lse, &dout, dims, F32));
            // Attention on bf16 bits, against widening, the bf16-product kernels and rounding.
            let (qkv_b, dout_b) = (bf16::round(&qkv), bf16::round(&dout));
            let (ow, lse_w) = attention::forward(&widened(&qkv_b), dims, Bf16);
            let (ob, lse_b) = attention::forward_bf16(&qkv_b, dims);
            assert_eq!(ob, bf16::round(&ow), "attention on bf16 bits");
            assert_eq!(
                bits(&lse_b),
                bits(&lse_w),
                "attention's log-sum-exp on bf16 bits"
            );
            let (ow, dw) = (widened(&ob), widened(&dout_b));
            let grad = attention::backward(&widened(&qkv_b), &ow, &lse_w, &dw, dims, Bf16);
            let grad_b = attention::backward_bf16(&qkv_b, &ob, &lse_w, &dout_b, dims);
            assert_eq!(
                grad_b,
                bf16::round(&grad),
                "attention's gradient on bf16 bits"
            );
            out.extend([o, lse]);
            let wl = values(70 * 9, 7, 0.5);
            let (xm, wm) = (Matrix::F32(&x), Matrix::F32(&wl));
            out.push(linear::forward(xm, wm, &values(9, 8, 0.5), F32));
            let dy = values(120 * 9, 9, 1.0);
            out.extend(linear::backward(xm, wm, Matrix::F32(&dy), 9, F32));
            out
        })
    }

    #[test]
    fn every_instruction_set_gives_the_same_bits() {
        let best = all_results(2);
        for level in [3, 1, 0] {
            for (i, (got, want)) in all_results(level).iter().zip(&best).enumerate() {
                let same = got
                    .iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "kernel result {i} differs at level {level}");
            }
        }
    }

    /// Only a device with TF32 tensor cores says its f32 products may run as TF32: not the
    /// CPU, and not wgpu, whose runtime registers no TF32 type.
    #[cfg(feature = "wgpu")]
    #[test]
    fn tf32_only_where_the_device_runs_it() {
        use burn::tensor::{Device, DeviceKind};
        assert!(!super::runs_tf32(&Device::flex()));
        assert!(!super::runs_tf32(&Device::wgpu(DeviceKind::DefaultDevice)));
    }
}
