//! Blockwise quantization of device tensors for the quantized collectives: quantize a tensor
//! into the bytes an MPI call sends, and dequantize (and sum) received bytes into a tensor on
//! the device. On CubeCL devices (feature `cubecl`, which `wgpu`, `cuda` and `rocm` turn on)
//! the CubeCL kernels of `ember-comm` run where the data lives (`cube.rs`); on host backends
//! (flex, ndarray) its host kernels run on the tensor's own buffer. The numerics are the same on every runtime (see `ember_comm::quant`).

use burn::tensor::{Device, Tensor};
use ember_comm::quant::host::HostKernels;
use ember_comm::quant::{BlockSize, QuantFormat, QuantKernels, Quantized};

use crate::error::ShardError;
use crate::transport::staging;

/// `x` (f32) quantized blockwise; the result is host bytes, ready to send. A kernel that
/// failed on the device to produce `x` is the error.
pub(crate) fn quantize(
    x: Tensor<1>,
    format: QuantFormat,
    block: BlockSize,
) -> Result<Quantized, ShardError> {
    // On the device, the packed bytes and scales are what crosses to the host (its clock
    // starting once the kernels that produce `x` are done).
    #[cfg(feature = "cubecl")]
    {
        staging::await_kernels(&x)?;
        let start = std::time::Instant::now();
        if let Some(q) = crate::transport::cube::quantize(&x, format, block) {
            let q = q?;
            let wire = Quantized::wire_bytes(format, block, q.len);
            staging::record(staging::Way::ToHost, wire, start);
            return Ok(q);
        }
    }
    Ok(HostKernels.quantize(&staging::read_f32(x)?, format, block))
}

/// [`quantize`], and its values dequantized on `device` (what the quantization kept of `x`):
/// on a CubeCL device from the bytes where the kernels wrote them, so only the bytes sent
/// cross, to the host.
pub(crate) fn quantize_and_back(
    x: Tensor<1>,
    format: QuantFormat,
    block: BlockSize,
    device: &Device,
) -> Result<(Quantized, Tensor<1>), ShardError> {
    #[cfg(feature = "cubecl")]
    {
        staging::await_kernels(&x)?;
        let start = std::time::Instant::now();
        if let Some(r) = crate::transport::cube::quantize_and_back(&x, format, block) {
            let (q, back) = r?;
            let wire = Quantized::wire_bytes(format, block, q.len);
            staging::record(staging::Way::ToHost, wire, start);
            return Ok((q, back));
        }
    }
    let q = quantize(x, format, block)?;
    let back = dequantize_sum(std::slice::from_ref(&q), device);
    Ok((q, back))
}

/// The element-wise sum of the dequantized `parts` (same format, block and length), added in
/// part order from zero, as an f32 tensor on `device`.
pub(crate) fn dequantize_sum(parts: &[Quantized], device: &Device) -> Tensor<1> {
    #[cfg(feature = "cubecl")]
    {
        let start = std::time::Instant::now();
        if let Some(t) = crate::transport::cube::dequantize_sum(parts, device) {
            staging::record(staging::Way::ToDevice, wire_bytes(parts), start);
            return t;
        }
    }
    staging::from_f32(HostKernels.dequantize_sum(parts), device)
}

/// `parts` dequantized one after another into one f32 tensor on `device` (the whole unit a
/// quantized all-gather delivers).
pub(crate) fn dequantize_concat(parts: &[Quantized], device: &Device) -> Tensor<1> {
    #[cfg(feature = "cubecl")]
    {
        let start = std::time::Instant::now();
        if let Some(t) = crate::transport::cube::dequantize_concat(parts, device) {
            staging::record(staging::Way::ToDevice, wire_bytes(parts), start);
            return t;
        }
    }
    let mut out = Vec::with_capacity(parts.iter().map(|p| p.len).sum());
    for p in parts {
        out.extend(HostKernels.dequantize(p));
    }
    staging::from_f32(out, device)
}

/// Bytes of `parts` on the wire: what a dequantization on the device takes there.
#[cfg(feature = "cubecl")]
fn wire_bytes(parts: &[Quantized]) -> usize {
    parts
        .iter()
        .map(|p| Quantized::wire_bytes(p.format, p.block, p.len))
        .sum()
}

/// The quantization kernels the training step runs on `device`'s tensors (the CubeCL kernels
/// on a CubeCL device, through Burn's fusion; the host kernels on a host backend), as one
/// [`QuantKernels`] runtime: what `ember selftest` checks against the reference, bit for bit.
/// Each call copies its input to the device and its output back.
#[derive(Debug, Clone)]
pub struct DeviceKernels {
    device: Device,
}

impl DeviceKernels {
    /// The kernels on `device`'s tensors.
    pub fn new(device: Device) -> Self {
        Self { device }
    }

    /// The device as its runtime names it (`NVIDIA H100 80GB HBM3 (ptx_sm90)`, `llvmpipe`),
    /// or `host` where the device's memory is host memory.
    pub fn device_name(&self) -> String {
        #[cfg(feature = "cubecl")]
        if let Some(name) = crate::transport::cube::device_name(&self.device) {
            return name;
        }
        "host".to_string()
    }
}

/// A check's runtime has no way to say a device failed but to stop: the failure, named.
fn or_stop<T>(r: Result<T, ShardError>) -> T {
    r.unwrap_or_else(|e| panic!("the training path's kernels on the device: {e}"))
}

impl QuantKernels for DeviceKernels {
    fn name(&self) -> String {
        format!("training path on {}", self.device_name())
    }

    fn quantize(&self, x: &[f32], format: QuantFormat, block: BlockSize) -> Quantized {
        or_stop(quantize(
            staging::from_f32(x.to_vec(), &self.device),
            format,
            block,
        ))
    }

    fn dequantize(&self, q: &Quantized) -> Vec<f32> {
        or_stop(staging::to_f32(dequantize_concat(
            std::slice::from_ref(q),
            &self.device,
        )))
    }

    fn dequantize_sum(&self, parts: &[Quantized]) -> Vec<f32> {
        or_stop(staging::to_f32(dequantize_sum(parts, &self.device)))
    }
}
