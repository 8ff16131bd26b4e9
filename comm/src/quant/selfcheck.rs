//! The quantization kernels of one runtime against the scalar [`reference`](mod@reference),
//! bit for bit: quantized bytes and scales exactly, dequantized values exactly (any NaN
//! matching any NaN: payloads are not specified). The cases cover lengths that aren't a
//! multiple of the block, all-zero blocks, ±inf, NaN, -0, exact ties, subnormals, scales below
//! the normal range, sums that cancel into the subnormal range and a buffer of more than 65535
//! cubes. The tests run it on every runtime of the build; `ember selftest` runs it on the
//! device a run would use, so a GPU is checked by the binary that trains on it.

use serde::Serialize;

use super::{BlockSize, QuantFormat, QuantKernels, Quantized, reference};

/// What one runtime's check found.
#[derive(Debug, Clone, Serialize)]
pub struct SelfCheck {
    /// The runtime checked ([`QuantKernels::name`]).
    pub runtime: String,
    /// Comparisons made (quantize, dequantize and dequantize-sum, per case, format and block).
    pub checks: usize,
    /// Each comparison that differed, named by case, format, block and operation.
    pub failures: Vec<String>,
}

impl SelfCheck {
    /// Whether every comparison matched.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

/// Pseudo-random values spread over 24 binades, signed.
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let mant = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let exp = ((s >> 8) % 24) as i32 - 12;
            mant * 2f32.powi(exp)
        })
        .collect()
}

/// The named inputs every runtime is checked on, at every block size.
pub fn cases() -> Vec<(&'static str, Vec<f32>)> {
    let mut special = values(100, 3);
    special[..16].fill(0.0);
    special[20] = f32::INFINITY;
    special[40] = f32::NEG_INFINITY;
    special[70] = f32::NAN;
    special[33] = -0.0;
    special[90] = -f32::NAN;
    vec![
        ("random 1000", values(1000, 1)),
        ("random 4096", values(4096, 2)),
        ("zeros, ±inf, NaN, -0", special),
        (
            "exact ties",
            vec![
                127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 7.0, 0.5, 1.5, 2.5, -0.5, -1.5,
                -2.5, 6.5,
            ],
        ),
        (
            "subnormals",
            vec![1e-40, -3e-42, 1e-45, 0.0, 2e-38, 5e-39, 7e-45, 1e-44, 1e-39],
        ),
        (
            "scales below the normal range",
            vec![
                1e-37, -5e-38, 2e-38, 1.2e-38, -1.1e-38, 3e-39, 0.0, -1e-37, 1.5e-36,
            ],
        ),
        ("length 7", values(7, 4)),
        ("length 1", vec![-3.25]),
        ("all zero", vec![0.0; 64]),
        ("empty", vec![]),
    ]
}

/// Two quantized parts whose sum cancels into the subnormal range: `127 * 2^-120` (scale
/// `2^-120`) and `-127 * s` with `s = 2^-120 (1 - 2^-15)` (16 significant bits), which add to
/// `127 * 2^-135`, about `2^-128`. A device that flushes subnormals makes that zero.
pub fn cancelling_parts(format: QuantFormat) -> Vec<Quantized> {
    let q = format.qmax();
    let s = 2f32.powi(-120);
    let a = vec![q * s; 16];
    let b = vec![-q * (s - s * 2f32.powi(-15)); 16];
    let block = BlockSize::new(8).expect("a multiple of 8");
    vec![
        reference::quantize(&a, format, block),
        reference::quantize(&b, format, block),
    ]
}

/// Equal bit for bit, any NaN matching any NaN.
pub fn same(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
}

/// Checks `rt` on every case, format and block size of [`cases`] (blocks of 8, 16 and 2048),
/// on [`cancelling_parts`], and on one buffer of `65_535 * 256 + 40` elements, more cubes than one dispatch
/// dimension holds.
pub fn check(rt: &dyn QuantKernels) -> SelfCheck {
    let mut out = SelfCheck {
        runtime: rt.name(),
        checks: 0,
        failures: Vec::new(),
    };
    let mut expect = |ok: bool, what: String| {
        out.checks += 1;
        if !ok {
            out.failures.push(what);
        }
    };
    for block in [8, 16, 2048] {
        let block = BlockSize::new(block).expect("a multiple of 8");
        for format in [QuantFormat::Int8, QuantFormat::Int4] {
            for (name, x) in cases() {
                let what = format!("{name} {format:?} block {}", block.get());
                let want = reference::quantize(&x, format, block);
                let got = rt.quantize(&x, format, block);
                expect(got.bit_eq(&want), format!("{what}: quantize"));
                expect(
                    same(&rt.dequantize(&want), &reference::dequantize(&want)),
                    format!("{what}: dequantize"),
                );
                let other = reference::quantize(&values(x.len(), 11), format, block);
                let parts = vec![want.clone(), other, want];
                expect(
                    same(
                        &rt.dequantize_sum(&parts),
                        &reference::dequantize_sum(&parts),
                    ),
                    format!("{what}: dequantize_sum"),
                );
            }
        }
    }
    for format in [QuantFormat::Int8, QuantFormat::Int4] {
        let parts = cancelling_parts(format);
        expect(
            same(
                &rt.dequantize_sum(&parts),
                &reference::dequantize_sum(&parts),
            ),
            format!("sums cancelling below the normal range {format:?}: dequantize_sum"),
        );
    }
    let n = 65_535 * 256 + 40;
    let x = values(n, 5);
    let block = BlockSize::new(64).expect("a multiple of 8");
    for format in [QuantFormat::Int8, QuantFormat::Int4] {
        let what = format!("{n} elements {format:?} block 64");
        let want = reference::quantize(&x, format, block);
        expect(
            rt.quantize(&x, format, block).bit_eq(&want),
            format!("{what}: quantize"),
        );
        expect(
            same(&rt.dequantize(&want), &reference::dequantize(&want)),
            format!("{what}: dequantize"),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::reference::{Arith, Device, Ieee};

    /// A runtime that gets one case wrong: the check must name it.
    struct OffByOne;

    impl QuantKernels for OffByOne {
        fn name(&self) -> String {
            "off-by-one".into()
        }
        fn quantize(&self, x: &[f32], format: QuantFormat, block: BlockSize) -> Quantized {
            let mut q = reference::quantize(x, format, block);
            if x.len() == 7 {
                q.data[0] ^= 1;
            }
            q
        }
        fn dequantize(&self, q: &Quantized) -> Vec<f32> {
            reference::dequantize(q)
        }
        fn dequantize_sum(&self, parts: &[Quantized]) -> Vec<f32> {
            reference::dequantize_sum(parts)
        }
    }

    #[test]
    fn a_wrong_kernel_is_named_and_the_reference_passes() {
        let bad = check(&OffByOne);
        assert_eq!(bad.failures.len(), 6, "{:?}", bad.failures);
        assert!(
            bad.failures
                .iter()
                .all(|f| f.starts_with("length 7") && f.ends_with("quantize"))
        );
        let good = check(&crate::quant::host::HostKernels);
        assert!(good.passed(), "{:?}", good.failures);
        assert_eq!(good.checks, bad.checks);
        assert_eq!(good.checks, 3 * 2 * cases().len() * 3 + 2 + 4);
    }

    /// The reference run with the operations of `A`.
    struct Model<A>(std::marker::PhantomData<A>);

    impl<A: Arith> QuantKernels for Model<A> {
        fn name(&self) -> String {
            std::any::type_name::<A>().into()
        }
        fn quantize(&self, x: &[f32], format: QuantFormat, block: BlockSize) -> Quantized {
            reference::quantize_on::<A>(x, format, block)
        }
        fn dequantize(&self, q: &Quantized) -> Vec<f32> {
            reference::dequantize_on::<A>(q)
        }
        fn dequantize_sum(&self, parts: &[Quantized]) -> Vec<f32> {
            reference::dequantize_sum_on::<A>(parts)
        }
    }

    fn model<A: Arith>() -> SelfCheck {
        check(&Model::<A>(std::marker::PhantomData))
    }

    /// A device that contracts `acc + q * scale` into an FMA, flushes subnormals, or both,
    /// computes the reference's bits: the numerics leave neither choice a bit to change.
    #[test]
    fn fused_multiply_adds_and_flushed_subnormals_change_no_bit() {
        assert!(model::<Ieee>().passed());
        for check in [
            model::<Device<true, false>>(),
            model::<Device<false, true>>(),
            model::<Device<true, true>>(),
        ] {
            assert!(check.passed(), "{}: {:?}", check.runtime, check.failures);
        }
        // The cancelling sum does reach the subnormal range before its flush.
        for format in [QuantFormat::Int8, QuantFormat::Int4] {
            let [a, b] = &cancelling_parts(format)[..] else {
                unreachable!()
            };
            let sum = reference::dequantize(a)[0] + reference::dequantize(b)[0];
            assert!(sum != 0.0 && sum.abs() < f32::MIN_POSITIVE, "{sum:e}");
            assert_eq!(reference::dequantize_sum(&[a.clone(), b.clone()])[0], 0.0);
        }
    }
}
