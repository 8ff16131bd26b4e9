//! Blockwise quantization of device tensors for the quantized collectives: quantize a tensor
//! into the bytes an MPI call sends, and dequantize (and sum) received bytes into a tensor on
//! the device. On CubeCL devices (feature `cubecl`, which `wgpu`, `cuda` and `rocm` turn on)
//! the CubeCL kernels of `ember-comm` run where the data lives (`cube.rs`); on host backends
//! (flex, ndarray) its host kernels run on the tensor's own buffer. The numerics are the same on every runtime (see `ember_comm::quant`).

use burn::tensor::{Device, Tensor};
use ember_comm::quant::host::HostKernels;
use ember_comm::quant::{BlockSize, QuantFormat, QuantKernels, Quantized};

use crate::staging;

/// `x` (f32) quantized blockwise; the result is host bytes, ready to send.
pub(crate) fn quantize(x: Tensor<1>, format: QuantFormat, block: BlockSize) -> Quantized {
    #[cfg(feature = "cubecl")]
    if let Some(q) = crate::cube::quantize(&x, format, block) {
        return q;
    }
    HostKernels.quantize(&staging::to_f32(x), format, block)
}

/// The element-wise sum of the dequantized `parts` (same format, block and length), added in
/// part order from zero, as an f32 tensor on `device`.
pub(crate) fn dequantize_sum(parts: &[Quantized], device: &Device) -> Tensor<1> {
    #[cfg(feature = "cubecl")]
    if let Some(t) = crate::cube::dequantize_sum(parts, device) {
        return t;
    }
    staging::from_f32(HostKernels.dequantize_sum(parts), device)
}

/// `parts` dequantized one after another into one f32 tensor on `device` (the whole unit a
/// quantized all-gather delivers).
pub(crate) fn dequantize_concat(parts: &[Quantized], device: &Device) -> Tensor<1> {
    #[cfg(feature = "cubecl")]
    if let Some(t) = crate::cube::dequantize_concat(parts, device) {
        return t;
    }
    let mut out = Vec::with_capacity(parts.iter().map(|p| p.len).sum());
    for p in parts {
        out.extend(HostKernels.dequantize(p));
    }
    staging::from_f32(out, device)
}
