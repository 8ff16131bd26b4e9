//! Element-wise passes the engine makes over every step's parameters and gradients, on
//! rayon's threads where the tensor lives on the flex device: Burn's flex backend casts,
//! scales and concatenates on the calling thread alone, and a step spends a sizeable part of
//! its time there. Each function gives the bits of the Burn op it replaces; on any other
//! device it is that op.

use std::mem::MaybeUninit;

use burn::backend::Flex;
use burn::tensor::{DType, Tensor, TensorData, bf16};
use burn_flex::FlexTensor;
use rayon::prelude::*;

/// Elements per parallel piece.
const PIECE: usize = 1 << 15;

/// The flex tensor behind `t`, when `t` lives on the flex device.
fn flex(t: &Tensor<1>) -> Option<FlexTensor> {
    t.clone().try_into_primitive::<Flex>().ok()
}

/// A 1-D flex tensor of `values`.
fn tensor<E: burn::tensor::Element>(values: Vec<E>) -> Tensor<1> {
    let n = values.len();
    Tensor::from_primitive::<Flex>(FlexTensor::from_data(TensorData::new(values, [n])))
}

/// `f` of every element of `src`, in parallel pieces.
fn map<A: Copy + Sync, B: Send>(src: &[A], f: impl Fn(A) -> B + Sync) -> Vec<B> {
    let mut out = Vec::with_capacity(src.len());
    out.spare_capacity_mut()[..src.len()]
        .par_chunks_mut(PIECE)
        .zip(src.par_chunks(PIECE))
        .for_each(|(out, src): (&mut [MaybeUninit<B>], &[A])| {
            for (o, &x) in out.iter_mut().zip(src) {
                o.write(f(x));
            }
        });
    // SAFETY: every element below `src.len()` was written above.
    unsafe { out.set_len(src.len()) };
    out
}

/// `t` cast to `dtype`, as Burn's `cast` (f32 to bf16 rounds to nearest, ties to even).
pub(crate) fn cast(t: Tensor<1>, dtype: DType) -> Tensor<1> {
    if t.dtype() == dtype {
        return t;
    }
    if let Some(f) = flex(&t) {
        match (f.dtype(), dtype) {
            (DType::F32, DType::BF16) => {
                if let Some(s) = f.as_slice::<f32>() {
                    return tensor(map(s, bf16::from_f32));
                }
            }
            (DType::BF16, DType::F32) => {
                if let Some(s) = f.as_slice::<bf16>() {
                    return tensor(map(s, bf16::to_f32));
                }
            }
            _ => {}
        }
    }
    t.cast(dtype)
}

/// `t * factor` for an f32 tensor, as Burn's scalar multiply (the factor rounded to f32).
pub(crate) fn scale(t: Tensor<1>, factor: f64) -> Tensor<1> {
    if let Some(s) = flex(&t).as_ref().and_then(|f| f.as_slice::<f32>()) {
        let factor = factor as f32;
        return tensor(map(s, |x| x * factor));
    }
    t * factor
}

/// `t * t` for an f32 tensor, as Burn's multiply of a tensor by itself.
pub(crate) fn square(t: Tensor<1>) -> Tensor<1> {
    if let Some(s) = flex(&t).as_ref().and_then(|f| f.as_slice::<f32>()) {
        return tensor(map(s, |x| x * x));
    }
    t.clone() * t
}

/// `parts` joined end to end, as Burn's `cat` along the only dimension.
pub(crate) fn concat(parts: Vec<Tensor<1>>) -> Tensor<1> {
    let flex: Vec<FlexTensor> = parts.iter().filter_map(flex).collect();
    let slices: Option<Vec<&[f32]>> = (flex.len() == parts.len())
        .then(|| flex.iter().map(|f| f.as_slice::<f32>()).collect())
        .flatten();
    let Some(slices) = slices else {
        return Tensor::cat(parts, 0);
    };
    let len = slices.iter().map(|s| s.len()).sum();
    let mut out: Vec<f32> = Vec::with_capacity(len);
    let mut rest = &mut out.spare_capacity_mut()[..len];
    for s in slices {
        let (to, tail) = rest.split_at_mut(s.len());
        to.par_chunks_mut(PIECE).zip(s.par_chunks(PIECE)).for_each(
            |(to, s): (&mut [MaybeUninit<f32>], &[f32])| {
                for (o, &x) in to.iter_mut().zip(s) {
                    o.write(x);
                }
            },
        );
        rest = tail;
    }
    // SAFETY: the parts' lengths sum to `len`, and each wrote its own range.
    unsafe { out.set_len(len) };
    tensor(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    fn bits(t: Tensor<1>) -> Vec<u8> {
        t.into_data().as_bytes().to_vec()
    }

    /// Values across several pieces, with ties, subnormals, infinities and a NaN.
    fn values(n: usize) -> Vec<f32> {
        let mut v: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.37).sin() * 3.0).collect();
        v[..6].copy_from_slice(&[
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            f32::MIN_POSITIVE / 3.0,
            f32::INFINITY,
            -f32::INFINITY,
            -0.0,
        ]);
        v[7] = f32::NAN;
        v
    }

    #[test]
    fn each_pass_gives_the_bits_of_burns_op() {
        let device = Device::flex();
        let n = 2 * PIECE + 123;
        let x = Tensor::<1>::from_data(TensorData::new(values(n), [n]), &device);
        let half = x.clone().cast(DType::BF16);
        assert_eq!(bits(cast(x.clone(), DType::BF16)), bits(half.clone()));
        assert_eq!(
            bits(cast(half.clone(), DType::F32)),
            bits(half.cast(DType::F32))
        );
        assert_eq!(bits(scale(x.clone(), 0.3)), bits(x.clone() * 0.3));
        assert_eq!(bits(square(x.clone())), bits(x.clone() * x.clone()));
        let parts = vec![x.clone().slice(5..PIECE + 9), x.clone(), x.slice(0..3)];
        assert_eq!(bits(concat(parts.clone())), bits(Tensor::cat(parts, 0)));
    }
}
