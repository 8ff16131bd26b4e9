//! What the model's kernel tests share: deterministic inputs, trainable leaves on a device,
//! and the comparison against a reference.

#![allow(dead_code)]

use burn::tensor::{DType, Device, Tensor, TensorCreationOptions, TensorData};

/// Deterministic values in [-scale, scale).
pub fn values(n: usize, seed: u64, scale: f64) -> Vec<f64> {
    let mut z = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            z ^= z << 13;
            z ^= z >> 7;
            z ^= z << 17;
            ((z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// A trainable leaf of `shape` in `dtype` on `device` with autodiff.
pub fn leaf<const D: usize>(
    v: &[f64],
    shape: [usize; D],
    device: Device,
    dtype: DType,
) -> Tensor<D> {
    let options = TensorCreationOptions::new(device.autodiff()).with_dtype(dtype);
    Tensor::<D>::from_data(TensorData::new(v.to_vec(), shape), options).require_grad()
}

pub fn to_f64<const D: usize>(t: Tensor<D>) -> Vec<f64> {
    t.into_data().convert::<f64>().try_to_vec::<f64>().unwrap()
}

/// Largest `|a - b|` relative to the largest `|b|`.
pub fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-30);
    a.iter()
        .zip(b)
        .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()))
        / scale
}
