//! Element-wise passes the engine makes over every step's parameters and gradients, on
//! rayon's threads where the tensor lives on the flex device: Burn's flex backend casts,
//! scales and concatenates on the calling thread alone, and a step spends a sizeable part of
//! its time there. The loops are compiled for the CPU's widest vector instructions
//! ([`wide`]). Each function gives the bits of the Burn ops it replaces, except
//! [`sum_of_squares`], which sums in f64 without the tensor of squares; on any other device
//! each is those ops.

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

/// Runs `f` compiled for the widest vector instructions the CPU has (AVX-512, else AVX2 with
/// FMA, else the baseline), so that a loop inside it vectorises at that width. The binary
/// targets baseline x86-64, where such a loop gets SSE2 at best. Rust never fuses a multiply
/// and an add, so every version performs the same IEEE operations: the bits do not depend on
/// the CPU.
#[inline(always)]
pub(crate) fn wide<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,bmi2")]
        fn v4<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        #[target_feature(enable = "avx2,fma,bmi2")]
        fn v3<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        match ember_cpu::vector() {
            // SAFETY: the CPU has the features `v4` is compiled for.
            ember_cpu::Vector::Avx512 => return unsafe { v4(f) },
            // SAFETY: the CPU has the features `v3` is compiled for.
            ember_cpu::Vector::Avx2 => return unsafe { v3(f) },
            ember_cpu::Vector::Baseline => {}
        }
    }
    f()
}

/// `f` of every element of `src`, in parallel pieces. Each piece works on its own copy of
/// `f`, so what `f` captures stays in registers rather than being read again for every
/// element.
fn map<A: Copy + Sync, B: Send>(src: &[A], f: impl Fn(A) -> B + Sync + Copy) -> Vec<B> {
    let mut out = Vec::with_capacity(src.len());
    out.spare_capacity_mut()[..src.len()]
        .par_chunks_mut(PIECE)
        .zip(src.par_chunks(PIECE))
        .for_each(|(out, src): (&mut [MaybeUninit<B>], &[A])| {
            wide(move || {
                for (o, &x) in out.iter_mut().zip(src) {
                    o.write(f(x));
                }
            })
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
        return tensor(map(s, move |x| x * factor));
    }
    t * factor
}

/// `t` multiplied by each of `factors` in turn, each through [`scale`].
pub(crate) fn scale_by(t: Tensor<1>, factors: &[f64]) -> Tensor<1> {
    factors.iter().fold(t, |t, &f| scale(t, f))
}

/// The sum of the squares of an f32 tensor's elements, accumulated in f64: in one pass on
/// rayon's threads over pieces of fixed bounds whose sums are added in order, so the result
/// does not depend on the thread count. Elsewhere it is Burn's `square` and a sum in stages
/// ([`crate::reduce::sum`]), and the device's failure to compute it an error.
pub(crate) fn sum_of_squares(t: &Tensor<1>) -> Result<f64, crate::error::ShardError> {
    if let Some(s) = flex(t).as_ref().and_then(|f| f.as_slice::<f32>()) {
        const LANES: usize = 8;
        let pieces: Vec<f64> = s
            .par_chunks(PIECE)
            .map(|piece| {
                wide(move || {
                    let mut lanes = [0.0f64; LANES];
                    let mut chunks = piece.chunks_exact(LANES);
                    for c in &mut chunks {
                        for (l, &x) in lanes.iter_mut().zip(c) {
                            *l += x as f64 * x as f64;
                        }
                    }
                    let tail: f64 = chunks
                        .remainder()
                        .iter()
                        .map(|&x| x as f64 * x as f64)
                        .sum();
                    lanes.iter().sum::<f64>() + tail
                })
            })
            .collect();
        return Ok(pieces.iter().sum());
    }
    scalar(crate::reduce::sum(t.clone().square()))
}

/// `parts` joined end to end as one f32 tensor, bf16 parts widened on the way: Burn's `cast`
/// of each part to f32, then `cat` along the only dimension, in one pass.
pub(crate) fn concat_f32(parts: Vec<Tensor<1>>) -> Tensor<1> {
    /// A part's elements.
    enum Part<'a> {
        F32(&'a [f32]),
        Bf16(&'a [bf16]),
    }
    impl Part<'_> {
        fn len(&self) -> usize {
            match self {
                Part::F32(s) => s.len(),
                Part::Bf16(s) => s.len(),
            }
        }
    }
    let flex: Vec<FlexTensor> = parts.iter().filter_map(flex).collect();
    let slices: Option<Vec<Part>> = (flex.len() == parts.len())
        .then(|| {
            flex.iter()
                .map(|f| match f.dtype() {
                    DType::F32 => f.as_slice::<f32>().map(Part::F32),
                    DType::BF16 => f.as_slice::<bf16>().map(Part::Bf16),
                    _ => None,
                })
                .collect()
        })
        .flatten();
    let Some(slices) = slices else {
        let parts = parts.into_iter().map(|p| cast(p, DType::F32)).collect();
        return Tensor::cat(parts, 0);
    };
    let len = slices.iter().map(Part::len).sum();
    let mut out: Vec<f32> = Vec::with_capacity(len);
    let mut rest = &mut out.spare_capacity_mut()[..len];
    for s in slices {
        let (to, tail) = rest.split_at_mut(s.len());
        match s {
            Part::F32(s) => to.par_chunks_mut(PIECE).zip(s.par_chunks(PIECE)).for_each(
                |(to, s): (&mut [MaybeUninit<f32>], &[f32])| {
                    for (o, &x) in to.iter_mut().zip(s) {
                        o.write(x);
                    }
                },
            ),
            Part::Bf16(s) => to.par_chunks_mut(PIECE).zip(s.par_chunks(PIECE)).for_each(
                |(to, s): (&mut [MaybeUninit<f32>], &[bf16])| {
                    wide(move || {
                        for (o, &x) in to.iter_mut().zip(s) {
                            o.write(x.to_f32());
                        }
                    })
                },
            ),
        }
        rest = tail;
    }
    // SAFETY: the parts' lengths sum to `len`, and each wrote its own range.
    unsafe { out.set_len(len) };
    tensor(out)
}

/// `t`'s data on the host, or the device's failure (a runtime reports a failed launch or
/// allocation at the first read after it) as [`ShardError::Device`](crate::error::ShardError).
///
/// A CubeCL runtime reads lazily: its data holds the tensor's buffer until first accessed,
/// and only then waits for the kernels that write it and copies it (into pinned host memory,
/// on CUDA). The data is accessed here, so that the wait and the copy happen inside this call
/// (on the clock of whoever times it) and a failure met there is this call's error.
pub(crate) fn read(t: Tensor<1>) -> Result<TensorData, crate::error::ShardError> {
    let data = t
        .try_into_data()
        .map_err(|e| crate::error::ShardError::device(&e))?;
    #[cfg(feature = "cubecl")]
    data.bytes()
        .read(cubecl::bytes::Reader::new())
        .map_err(|e| crate::error::ShardError::device(&e))?;
    Ok(data)
}

/// The first element of `t` as f64 (NaN when it holds none). The device's failure to compute
/// it (out of memory, most often: a runtime reports a failed launch at the first read after
/// it) is an error.
pub(crate) fn scalar(t: Tensor<1>) -> Result<f64, crate::error::ShardError> {
    Ok(read(t)?
        .convert::<f64>()
        .try_to_vec::<f64>()
        .map(|v| v[0])
        .unwrap_or(f64::NAN))
}

/// `acc += x`, taking `x` whole when `acc` is empty.
pub(crate) fn add_to(acc: &mut Option<Tensor<1>>, x: Tensor<1>) {
    *acc = Some(match acc.take() {
        Some(a) => a + x,
        None => x,
    });
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
        let parts = vec![
            x.clone().slice(5..PIECE + 9),
            x.clone().cast(DType::BF16),
            x.clone(),
            x.clone().slice(0..3),
        ];
        let widened = parts.iter().map(|p| p.clone().cast(DType::F32)).collect();
        assert_eq!(bits(concat_f32(parts)), bits(Tensor::cat(widened, 0)));
    }

    /// The sum of squares against an f64 sum of every element, over several pieces and a
    /// tail, and the same on every call.
    #[test]
    fn sum_of_squares_is_the_f64_sum() {
        let device = Device::flex();
        let n = 3 * PIECE + 13;
        let v: Vec<f32> = values(n).into_iter().filter(|x| x.is_finite()).collect();
        let want: f64 = v.iter().map(|&x| x as f64 * x as f64).sum();
        let x = Tensor::<1>::from_data(TensorData::new(v.clone(), [v.len()]), &device);
        let got = sum_of_squares(&x).unwrap();
        assert!((got - want).abs() <= want * 1e-12, "{got} against {want}");
        assert_eq!(got.to_bits(), sum_of_squares(&x).unwrap().to_bits());
    }
}
