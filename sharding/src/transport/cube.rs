//! The CubeCL quantization kernels of `ember-comm` on the buffers of Burn tensors that live on
//! a CubeCL device (wgpu, CUDA, ROCm): quantizing reads the tensor where it is and brings back
//! only the packed bytes and scales a collective sends; dequantizing takes received bytes to
//! the device and writes a new tensor there. Every function answers `None` for a tensor or
//! device of another backend, which the host kernels then serve.
//!
//! With the `cubecl` feature Burn's fusion is on, so a device tensor is a fusion handle: it is
//! resolved to its CubeCL tensor (running what fusion has queued for it) before a kernel reads
//! or writes its buffer.

use burn::tensor::{DType, Device, Tensor};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{Cube, CubeBackend};
use ember_comm::quant::cube::CubeKernels;
use ember_comm::quant::{BlockSize, QuantFormat, Quantized};

use crate::error::ShardError;

/// The CubeCL tensor behind `t`; `None` off CubeCL.
fn resolve(t: Tensor<1>) -> Option<CubeTensor> {
    let fused = t.try_into_primitive::<Cube>().ok()?;
    let client = fused.client.clone();
    Some(client.resolve_tensor_float::<CubeBackend>(fused))
}

/// `t`'s CubeCL tensor, contiguous, and its element count; `None` off CubeCL.
pub(crate) fn primitive(t: &Tensor<1>) -> Option<(CubeTensor, usize)> {
    let n = t.dims()[0];
    let p = resolve(t.clone())?;
    Some((burn_cubecl::kernel::into_contiguous(p), n))
}

fn kernels(t: &CubeTensor) -> CubeKernels {
    CubeKernels::on(t.client.clone(), "burn")
}

/// `x` (f32) quantized on its device; the device's failure to run the kernels or read their
/// output back is the error. `None` off CubeCL.
pub(crate) fn quantize(
    x: &Tensor<1>,
    format: QuantFormat,
    block: BlockSize,
) -> Option<Result<Quantized, ShardError>> {
    let (p, n) = primitive(x)?;
    Some(
        kernels(&p)
            .quantize_device(p.handle.clone(), n, format, block)
            .map_err(ShardError::Device),
    )
}

/// `x` (f32) quantized on its device, and the quantized values dequantized there into a new
/// tensor, from the bytes where the kernels wrote them (none cross back to the device). The
/// error as for [`quantize`]; `None` off CubeCL.
pub(crate) fn quantize_and_back(
    x: &Tensor<1>,
    format: QuantFormat,
    block: BlockSize,
) -> Option<Result<(Quantized, Tensor<1>), ShardError>> {
    let (p, n) = primitive(x)?;
    let (back, out) = output(n, &x.device())?;
    let q = kernels(&p).quantize_device_and_back(
        p.handle.clone(),
        n,
        format,
        block,
        out.handle.clone(),
    );
    Some(q.map(|q| (q, back)).map_err(ShardError::Device))
}

/// A new f32 tensor of `len` elements on `device`, and the CubeCL tensor that holds its
/// buffer (a kernel writing there writes the tensor); `None` off CubeCL.
fn output(len: usize, device: &Device) -> Option<(Tensor<1>, CubeTensor)> {
    let t = Tensor::<1>::empty([len], (device, DType::F32));
    let p = resolve(t.clone())?;
    Some((t, p))
}

/// The sum of the dequantized `parts`, written on `device`.
pub(crate) fn dequantize_sum(parts: &[Quantized], device: &Device) -> Option<Tensor<1>> {
    let len = parts.first().map_or(0, |p| p.len);
    let (t, out) = output(len, device)?;
    if len > 0 {
        kernels(&out).dequantize_sum_device(parts, out.handle.clone());
    }
    Some(t)
}

/// `parts` dequantized one after another into one tensor on `device`. Parts of whole blocks
/// laid end to end are one quantized buffer (their packed words and scales concatenate), so
/// one kernel writes the whole tensor; otherwise each part is dequantized into its own buffer
/// and the buffers joined (a storage offset into one buffer would have to meet the device's
/// binding alignment, which a shard of a few blocks need not).
pub(crate) fn dequantize_concat(parts: &[Quantized], device: &Device) -> Option<Tensor<1>> {
    if let Some(whole) = end_to_end(parts) {
        return dequantize_sum(std::slice::from_ref(&whole), device);
    }
    let pieces = parts
        .iter()
        .map(|p| dequantize_sum(std::slice::from_ref(p), device))
        .collect::<Option<Vec<_>>>()?;
    if pieces.is_empty() {
        return Some(output(0, device)?.0);
    }
    Some(Tensor::cat(pieces, 0))
}

/// `parts` as one quantized buffer, where each is of whole blocks in one format and block
/// size: element `i` of part `k` is then element `k * len + i` of the concatenation, with the
/// same packed bits and the same scale.
fn end_to_end(parts: &[Quantized]) -> Option<Quantized> {
    let first = parts.first()?;
    let (format, block) = (first.format, first.block);
    let whole_blocks =
        |p: &Quantized| p.format == format && p.block == block && p.len.is_multiple_of(block.get());
    if parts.len() < 2 || !parts.iter().all(whole_blocks) {
        return None;
    }
    Some(Quantized {
        format,
        block,
        len: parts.iter().map(|p| p.len).sum(),
        data: parts.iter().flat_map(|p| p.data.iter().copied()).collect(),
        scales: parts
            .iter()
            .flat_map(|p| p.scales.iter().copied())
            .collect(),
    })
}

/// Bytes in use on `device`'s memory, as its CubeCL client reports them; `None` off CubeCL.
pub(crate) fn device_bytes_in_use(device: &Device) -> Option<u64> {
    device_usage(device).map(|u| u.bytes_in_use)
}

/// Bytes `device`'s CubeCL memory pools hold from the driver (in use or not): what the driver
/// counts against the process, short of its context; `None` off CubeCL.
pub(crate) fn device_bytes_reserved(device: &Device) -> Option<u64> {
    device_usage(device).map(|u| u.bytes_reserved)
}

fn device_usage(device: &Device) -> Option<burn_cubecl::cubecl::MemoryUsage> {
    let (_, probe) = output(1, device)?;
    Some(
        probe
            .client
            .memory_report(burn_cubecl::cubecl::MemoryScope::Device)
            .usage(),
    )
}

/// `device` as its CubeCL runtime names it, with what kernels are compiled for; `None` off
/// CubeCL.
pub(crate) fn device_name(device: &Device) -> Option<String> {
    let (_, probe) = output(1, device)?;
    let identity = probe.client.properties().identity.clone();
    Some(format!("{} ({})", identity.name, identity.fingerprint))
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use ember_comm::quant::QuantKernels;
    use ember_comm::quant::host::HostKernels;

    /// The CubeCL path really runs on a wgpu tensor under Burn's fusion (it does not fall back
    /// to the host), and agrees with the host kernels bit for bit, also on a tensor that fusion
    /// has not computed yet and on a dequantized tensor that fused operations then read.
    #[test]
    fn wgpu_tensors_quantize_on_the_device_exactly_as_the_host() {
        let device = Device::wgpu(burn::tensor::DeviceKind::DefaultDevice);
        let n = 4096 + 24;
        let values: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 1001) as f32 - 500.0) / 97.0)
            .collect();
        let x = crate::transport::staging::from_f32(values.clone(), &device);
        let block = BlockSize::new(64).unwrap();
        for format in [QuantFormat::Int8, QuantFormat::Int4] {
            let q = quantize(&x, format, block)
                .expect("a wgpu tensor takes the CubeCL path")
                .unwrap();
            assert!(
                q.bit_eq(&HostKernels.quantize(&values, format, block)),
                "{format:?}"
            );
            let (again, back) = quantize_and_back(&x, format, block)
                .expect("on the device")
                .unwrap();
            assert!(again.bit_eq(&q), "{format:?}");
            assert_eq!(
                crate::transport::staging::to_f32(back).unwrap(),
                HostKernels.dequantize(&q),
                "{format:?}: dequantized where the bytes were written"
            );
            // Parts of whole blocks dequantize as one buffer, others one by one: the same
            // values either way.
            let whole = HostKernels.quantize(&values[..4096], format, block);
            let other = HostKernels.quantize(&values[24..4120], format, block);
            let odd = HostKernels.quantize(&values[..100], format, block);
            assert!(end_to_end(&[whole.clone(), other.clone()]).is_some());
            assert!(end_to_end(&[whole.clone(), odd.clone()]).is_none());
            for parts in [vec![whole.clone(), other], vec![whole, odd]] {
                let joined = dequantize_concat(&parts, &device).expect("on the device");
                let want: Vec<f32> = parts
                    .iter()
                    .flat_map(|p| HostKernels.dequantize_sum(std::slice::from_ref(p)))
                    .collect();
                assert_eq!(
                    crate::transport::staging::to_f32(joined).unwrap(),
                    want,
                    "{format:?}"
                );
            }
            let parts = [q.clone(), q.clone()];
            let sum = dequantize_sum(&parts, &device).expect("on the device");
            assert_eq!(
                crate::transport::staging::to_f32(sum).unwrap(),
                HostKernels.dequantize_sum(&parts),
                "{format:?}"
            );
        }
        let in_use = device_bytes_in_use(&device).expect("wgpu reports its memory");
        assert!(in_use > 0);
        assert!(device_bytes_reserved(&device).is_some_and(|r| r >= in_use));
        // Fusion is on: the tensor is a fusion handle, not a bare CubeCL tensor.
        assert!(x.clone().try_into_primitive::<Cube>().is_ok());
        // A tensor fusion has only queued (2x + 1, exact in f32), and a dequantized tensor
        // that queued operations then read.
        let lazy = x.clone() * 2.0 + 1.0;
        let twice: Vec<f32> = values.iter().map(|v| v * 2.0 + 1.0).collect();
        let q = quantize(&lazy, QuantFormat::Int8, block)
            .expect("on the device")
            .unwrap();
        assert!(q.bit_eq(&HostKernels.quantize(&twice, QuantFormat::Int8, block)));
        let sum = dequantize_sum(std::slice::from_ref(&q), &device).expect("on the device");
        let doubled: Vec<f32> = HostKernels
            .dequantize_sum(std::slice::from_ref(&q))
            .iter()
            .map(|v| v + v)
            .collect();
        assert_eq!(
            crate::transport::staging::to_f32(sum.clone() + sum).unwrap(),
            doubled
        );
        // A flex tensor is not CubeCL's: the host kernels serve it.
        let flex = crate::transport::staging::from_f32(values, &Device::flex());
        assert!(quantize(&flex, QuantFormat::Int8, block).is_none());
    }

    /// A tensor whose buffer holds more than its elements (a slice of a larger tensor, the way
    /// a shard is cut from a flat buffer) quantizes its own elements only: the values past its
    /// end, 1000 times larger here, touch neither the last block's scale nor the packed words.
    /// CubeCL gives a kernel the length of the buffer it is bound to, not the tensor's.
    #[test]
    fn a_slice_of_a_larger_buffer_quantizes_only_its_own_elements() {
        let device = Device::wgpu(burn::tensor::DeviceKind::DefaultDevice);
        let big: Vec<f32> = (0..2048)
            .map(|i| ((i * 37 % 1001) as f32 - 500.0) / if i < 1500 { 97.0 } else { 0.097 })
            .collect();
        let x = crate::transport::staging::from_f32(big.clone(), &device);
        for (start, len) in [(0, 1000), (0, 1003), (64, 1000), (8, 37)] {
            let part = x.clone().slice(start..start + len);
            let want = &big[start..start + len];
            for block in [8, 64, 2048] {
                let block = BlockSize::new(block).unwrap();
                for format in [QuantFormat::Int8, QuantFormat::Int4] {
                    let q = quantize(&part, format, block)
                        .expect("on the device")
                        .unwrap();
                    let host = HostKernels.quantize(want, format, block);
                    assert!(q.bit_eq(&host), "{start}..+{len} {format:?} {block:?}");
                    let (again, back) = quantize_and_back(&part, format, block)
                        .expect("device")
                        .unwrap();
                    assert!(again.bit_eq(&host), "{start}..+{len} {format:?} {block:?}");
                    assert_eq!(
                        crate::transport::staging::to_f32(back).unwrap(),
                        HostKernels.dequantize(&host),
                        "{start}..+{len} {format:?} {block:?}"
                    );
                }
            }
        }
    }

    /// A tensor the device could not allocate (1 GiB, past wgpu's buffer limit) quantizes to
    /// the device's error, for the step to report, not a panic.
    #[test]
    fn a_tensor_the_device_could_not_allocate_quantizes_to_an_error() {
        let device = Device::wgpu(burn::tensor::DeviceKind::DefaultDevice);
        let t = Tensor::<1>::ones([1 << 28], (&device, DType::F32));
        let block = BlockSize::new(64).unwrap();
        match quantize(&t, QuantFormat::Int8, block) {
            Some(Err(ShardError::Device(why))) => assert!(!why.is_empty()),
            other => panic!("{:?}", other.map(|r| r.map(|q| q.len))),
        }
        assert!(matches!(
            quantize_and_back(&t, QuantFormat::Int4, block),
            Some(Err(ShardError::Device(_)))
        ));
    }
}
