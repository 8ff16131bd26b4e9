//! Device tensors to and from the host buffers an MPI call reads and writes. On a backend whose
//! memory is host memory (flex) a uniquely owned tensor hands its buffer over without a copy;
//! elsewhere these are the staging copies of the call and live only as long as it does.

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use ember_comm::Bf16;

/// The values of an f32 tensor, on the host (cast from any other float dtype).
pub(crate) fn to_f32(t: Tensor<1>) -> Vec<f32> {
    crate::host::cast(t, DType::F32)
        .into_data()
        .try_into_vec::<f32>()
        .expect("an f32 tensor reads back as f32")
}

/// An f32 tensor of `values` on `device`.
pub(crate) fn from_f32(values: Vec<f32>, device: &Device) -> Tensor<1> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), (device, DType::F32))
}

/// The values of a bf16 tensor as bf16 bits, on the host.
pub(crate) fn to_bf16(t: Tensor<1>) -> Vec<Bf16> {
    let t = if t.dtype() == DType::BF16 {
        t
    } else {
        t.cast(DType::BF16)
    };
    t.into_data()
        .as_bytes()
        .chunks_exact(2)
        .map(|c| Bf16(u16::from_le_bytes([c[0], c[1]])))
        .collect()
}

/// A bf16 tensor of `values` on `device`.
pub(crate) fn from_bf16(values: &[Bf16], device: &Device) -> Tensor<1> {
    let bytes: Vec<u8> = values.iter().flat_map(|b| b.0.to_le_bytes()).collect();
    let data = TensorData::from_bytes_vec(bytes, [values.len()], DType::BF16);
    Tensor::from_data(data, (device, DType::BF16))
}

/// Bytes kept on the device as little-endian i32 words (the tail word zero-padded): how the
/// int8 secondary copy is held.
pub(crate) fn bytes_to_device(bytes: &[u8], device: &Device) -> Tensor<1, Int> {
    let words: Vec<i32> = bytes
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            i32::from_le_bytes(w)
        })
        .collect();
    let n = words.len();
    Tensor::from_data(TensorData::new(words, [n]), (device, DType::I32))
}

/// The first `len` bytes of words written by [`bytes_to_device`].
pub(crate) fn bytes_from_device(t: Tensor<1, Int>, len: usize) -> Vec<u8> {
    let data = t.into_data();
    let mut bytes = data.as_bytes().to_vec();
    bytes.truncate(len);
    bytes
}

/// Bytes a tensor of `numel` elements of `dtype` takes.
pub(crate) fn tensor_bytes(t: &Tensor<1>) -> u64 {
    (t.dims()[0] * t.dtype().size()) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_keep_every_bit() {
        let device = Device::flex();
        let v = vec![1.5f32, -0.0, f32::MIN_POSITIVE, 3.0e38];
        assert_eq!(to_f32(from_f32(v.clone(), &device)), v);
        let b: Vec<Bf16> = v.iter().map(|&x| Bf16::from_f32(x)).collect();
        let t = from_bf16(&b, &device);
        assert_eq!(t.dtype(), DType::BF16);
        assert_eq!(to_bf16(t), b);
        let bytes: Vec<u8> = (0..11).collect();
        assert_eq!(
            bytes_from_device(bytes_to_device(&bytes, &device), 11),
            bytes
        );
    }
}
