//! Every host implementation this CPU runs (portable, AVX2, AVX-512F) against the scalar
//! reference bit for bit, on the shared cases plus inputs built to sit on and next to the
//! tie points of the reciprocal fast path, and scales across the whole f32 range.

use super::*;
use crate::quant::reference;

/// The implementations this CPU can run.
fn isas() -> Vec<Isa> {
    #[allow(unused_mut)]
    let mut out = vec![Isa::Portable];
    #[cfg(target_arch = "x86_64")]
    {
        if ember_cpu::vector() >= ember_cpu::Vector::Avx2 {
            out.push(Isa::Avx2);
        }
        if Isa::best() == Isa::Avx512 {
            out.push(Isa::Avx512);
        }
    }
    out
}

fn quantize(isa: Isa, x: &[f32], format: QuantFormat, block: BlockSize) -> Quantized {
    let mut data = vec![0xa5u8; format.data_bytes(x.len())];
    let mut scales = vec![-1.0f32; x.len().div_ceil(block.get())];
    quantize_into_on(isa, x, format, block, &mut data, &mut scales);
    Quantized {
        format,
        block,
        len: x.len(),
        data,
        scales,
    }
}

fn dequantize(isa: Isa, q: &Quantized) -> Vec<f32> {
    let mut out = vec![1.0f32; q.len];
    dequantize_on(isa, q, &mut out, Write::Set);
    out
}

fn dequantize_sum(isa: Isa, parts: &[Quantized]) -> Vec<f32> {
    let mut out = vec![1.0f32; parts.first().map_or(0, |p| p.len)];
    dequantize_sum_on(isa, parts, &mut out);
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// xorshift64 (no dependency).
fn next(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// Deterministic pseudo-random f32s spanning many magnitudes.
pub(crate) fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            let r = next(&mut s);
            let mant = (r >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let exp = ((r >> 8) % 16) as i32 - 8;
            mant * 2f32.powi(exp)
        })
        .collect()
}

fn cases() -> Vec<(String, Vec<f32>)> {
    let mut special = values(80, 3);
    special[..16].fill(0.0); // an all-zero block (blocks of 16 below)
    special[20] = f32::INFINITY;
    special[40] = f32::NEG_INFINITY;
    special[70] = f32::NAN;
    special[33] = -0.0;
    // Blocks of 8 whose scale is exactly 1 (amax 127 for int8, 7 for int4): exact ties.
    let ties = vec![
        127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 7.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 6.5,
    ];
    vec![
        ("random 1000 (not a block multiple)".into(), values(1000, 1)),
        ("random 4096".into(), values(4096, 2)),
        ("random 1037 (odd)".into(), values(1037, 5)),
        ("random 20003 (ragged last block)".into(), values(20003, 6)),
        ("zeros, ±inf, NaN, -0".into(), special),
        ("halves".into(), ties),
        (
            "tiny and subnormal".into(),
            vec![1e-40, -3e-42, 1e-45, 0.0, 2e-38, 5e-39, 7e-45, 1e-44, 1e-39],
        ),
        ("odd length 7".into(), values(7, 4)),
        ("empty".into(), vec![]),
    ]
}

/// Asserts every implementation equals the reference on `x`: quantized bytes and scales,
/// dequantized values and sums of 3 and 6 parts (more than one group of 4), all bit for bit.
fn check(what: &str, x: &[f32], format: QuantFormat, block: BlockSize) {
    let want = reference::quantize(x, format, block);
    let other = reference::quantize(&values(x.len(), 9), format, block);
    let six = vec![
        want.clone(),
        other.clone(),
        want.clone(),
        other.clone(),
        want.clone(),
        other.clone(),
    ];
    let parts = vec![want.clone(), other, want.clone()];
    for isa in isas() {
        let got = quantize(isa, x, format, block);
        assert!(
            got.bit_eq(&want),
            "{what} {format:?} {block:?} {isa:?}\n{got:?}\n{want:?}"
        );
        assert_eq!(
            bits(&dequantize(isa, &want)),
            bits(&reference::dequantize(&want)),
            "{what} {format:?} {block:?} {isa:?}: dequantize"
        );
        assert_eq!(
            bits(&dequantize_sum(isa, &parts)),
            bits(&reference::dequantize_sum(&parts)),
            "{what} {format:?} {block:?} {isa:?}: sum"
        );
        assert_eq!(
            bits(&dequantize_sum(isa, &six)),
            bits(&reference::dequantize_sum(&six)),
            "{what} {format:?} {block:?} {isa:?}: sum of 6"
        );
    }
}

#[test]
fn every_implementation_is_bit_identical_to_the_reference() {
    // 8, 24: not whole chunks of 16; 48: 85 blocks per segment; 8192: one block, 2 segments.
    for block in [8, 16, 24, 48, 64, 2048, 8192] {
        let block = BlockSize::new(block).unwrap();
        for format in [QuantFormat::Int8, QuantFormat::Int4] {
            for (name, x) in cases() {
                check(&name, &x, format, block);
            }
        }
    }
}

/// Blocks whose elements sit exactly on, and a few ulps either side of, every half-integer
/// multiple of the block's scale, at block maxima from subnormal to near `f32::MAX` (scales
/// on both sides of `recip_safe`'s bounds): the reciprocal path must hand every one of them to
/// the division.
#[test]
fn ties_and_their_neighbours_match_at_every_scale() {
    let mut s = 0x1234_5678_9abc_def1u64;
    // 64: 4 chunks of 16 per block; 256: the 8-chunk packing path; 8192: segments of a block.
    for block in [64, 256, 8192] {
        for format in [QuantFormat::Int8, QuantFormat::Int4] {
            let qmax = format.qmax();
            let mut x = Vec::new();
            for e in (-149..=127)
                .step_by(3)
                .chain([-101, -100, -99, 99, 100, 101])
            {
                // One block: its max first, then points near (k + 1/2) * scale.
                let mant = 1.0 + (next(&mut s) >> 41) as f32 / (1u64 << 23) as f32;
                let amax = mant * 2f32.powi(e);
                let amax = if amax.is_finite() { amax } else { f32::MAX };
                let scale = reference::block_scale(&[amax], format);
                x.push(if e % 2 == 0 { amax } else { -amax });
                for _ in 1..block {
                    let r = next(&mut s);
                    let k = (r % (2 * qmax as u64 + 1)) as f32 - qmax;
                    // Every other block all near ties, the rest one lane in 64 (so single
                    // lanes must trigger the fallback on their own).
                    let all = e % 2 == 0;
                    let off = if all || (r >> 20).is_multiple_of(64) {
                        0.5
                    } else {
                        0.25
                    };
                    let tie = (k + off) * scale;
                    let nudge = (r >> 32) % 7;
                    let t = f32::from_bits((tie.to_bits() as i64 + nudge as i64 - 3) as u32);
                    x.push(if t.abs() <= amax {
                        t
                    } else {
                        tie.min(amax).max(-amax)
                    });
                }
            }
            let block = BlockSize::new(block).unwrap();
            check("ties at every scale", &x, format, block);
        }
    }
}

/// Random blocks whose magnitudes span the whole f32 range, subnormals included.
#[test]
fn random_values_at_every_magnitude_match() {
    let mut s = 0x0bad_5eed_u64;
    let x: Vec<f32> = (0..64 * 400)
        .map(|i| {
            let r = next(&mut s);
            // One exponent range per block of 64, values spread below it.
            let top = ((i / 64) as u64 * 7919 % 254) as u32 + 1;
            let exp = top.saturating_sub((r % 24) as u32);
            let v = f32::from_bits((exp << 23) | ((r >> 40) as u32 & 0x7f_ffff));
            if r & (1 << 63) != 0 { -v } else { v }
        })
        .collect();
    for format in [QuantFormat::Int8, QuantFormat::Int4] {
        check("every magnitude", &x, format, BlockSize::new(64).unwrap());
    }
}

#[test]
fn error_is_within_half_a_scale_and_specials_poison_their_block() {
    let block = BlockSize::new(16).unwrap();
    for format in [QuantFormat::Int8, QuantFormat::Int4] {
        for (name, x) in cases() {
            let q = HostKernels.quantize(&x, format, block);
            let back = HostKernels.dequantize(&q);
            for (i, (&a, &b)) in x.iter().zip(&back).enumerate() {
                let scale = q.scales[i / 16];
                if scale.is_nan() {
                    assert!(b.is_nan(), "{name}: element {i} of a poisoned block");
                    continue;
                }
                assert!(a.is_finite());
                if scale == 0.0 {
                    // Its block's scale is below the normal range: every element is zero.
                    assert!(a.abs() < format.qmax() * f32::MIN_POSITIVE && b == 0.0);
                    continue;
                }
                // One f32 rounding in x / scale and one in q * scale: allow 2^-20 relative.
                let bound = scale / 2.0 + (a.abs() + scale) * 2f32.powi(-20);
                assert!(
                    (a - b).abs() <= bound.max(f32::MIN_POSITIVE),
                    "{name} {format:?} [{i}]: {a} -> {b}, scale {scale}"
                );
            }
        }
    }
    let ties = cases().into_iter().find(|(n, _)| n == "halves").unwrap().1;
    let q = HostKernels.quantize(&ties, QuantFormat::Int8, BlockSize::new(8).unwrap());
    let ints: Vec<i8> = q.data[..8].iter().map(|&b| b as i8).collect();
    assert_eq!(
        ints,
        vec![127, 0, 2, 2, 0, -2, -2, 126],
        "round half to even"
    );
    let q = HostKernels.quantize(&ties, QuantFormat::Int4, BlockSize::new(8).unwrap());
    let ints: Vec<i32> = (8..16).map(|i| reference::stored(&q, i)).collect();
    assert_eq!(
        ints,
        vec![7, 0, 2, 2, 0, -2, -2, 6],
        "int4 round half to even"
    );
    let mut zeros = vec![0.0f32; 32];
    zeros[17] = f32::NAN;
    let q = HostKernels.quantize(&zeros, QuantFormat::Int8, block);
    assert_eq!(q.scales[0], 0.0, "an all-zero block has scale 0");
    assert!(q.scales[1].is_nan());
    let back = HostKernels.dequantize(&q);
    assert!(back[..16].iter().all(|&v| v == 0.0));
    assert!(back[16..].iter().all(|v| v.is_nan()));
}

/// The `_into` forms equal the allocating ones, and no parts sum to zeros.
#[test]
fn into_forms_match_the_allocating_ones() {
    let x = values(5000, 7);
    let block = BlockSize::new(256).unwrap();
    for format in [QuantFormat::Int8, QuantFormat::Int4] {
        let q = HostKernels.quantize(&x, format, block);
        let mut out = vec![f32::NAN; x.len()];
        HostKernels.dequantize_into(&q, &mut out);
        assert_eq!(bits(&out), bits(&HostKernels.dequantize(&q)));
        let parts = [q.clone(), q];
        HostKernels.dequantize_sum_into(&parts, &mut out);
        assert_eq!(bits(&out), bits(&HostKernels.dequantize_sum(&parts)));
    }
    let mut out = vec![1.0f32; 3];
    HostKernels.dequantize_sum_into(&[], &mut out);
    assert_eq!(out, [0.0; 3]);
}

#[test]
fn the_reciprocal_is_used_only_between_its_bounds() {
    let (lo, hi) = (2f32.powi(-100), 2f32.powi(100));
    assert!(recip_safe(lo) && recip_safe(hi) && recip_safe(1.0));
    assert!(!recip_safe(f32::from_bits(lo.to_bits() - 1)));
    assert!(!recip_safe(f32::from_bits(hi.to_bits() + 1)));
    assert!(!recip_safe(1e-40) && !recip_safe(f32::NAN) && !recip_safe(0.0));
}

/// Sums that fall into the subnormal range, beside parts whose scales need no flush: every
/// order of tiny-scaled, cancelling and ordinary parts, against the reference.
#[test]
fn sums_below_the_normal_range_are_flushed_in_every_order() {
    for format in [QuantFormat::Int8, QuantFormat::Int4] {
        let [a, b] = &crate::quant::selfcheck::cancelling_parts(format)[..] else {
            unreachable!()
        };
        let block = a.block;
        let big = reference::quantize(&values(a.len, 21), format, block);
        let minus = reference::quantize(
            &values(a.len, 21).iter().map(|v| -v).collect::<Vec<_>>(),
            format,
            block,
        );
        let orders = [
            vec![a.clone(), b.clone()],
            vec![big.clone(), a.clone(), b.clone(), minus.clone()],
            vec![a.clone(), big.clone(), minus.clone(), b.clone()],
            vec![
                big.clone(),
                a.clone(),
                minus.clone(),
                b.clone(),
                big.clone(),
            ],
        ];
        for (i, parts) in orders.iter().enumerate() {
            let want = reference::dequantize_sum(parts);
            for isa in isas() {
                assert_eq!(
                    bits(&dequantize_sum(isa, parts)),
                    bits(&want),
                    "{format:?} order {i} {isa:?}"
                );
            }
        }
    }
}
