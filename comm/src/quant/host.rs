//! The quantization kernels in plain Rust for host buffers: the same numerics as `reference`,
//! arranged per block so the compiler vectorises the loops. Tests prove it bit-identical to
//! the reference (and so to the CubeCL kernels); it deliberately adds no threads or SIMD
//! intrinsics.

use super::{BlockSize, NON_FINITE_BITS, POISON_SCALE, QuantFormat, QuantKernels, Quantized};

/// The host runtime: data in ordinary `Vec`s.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostKernels;

/// `1.5 * 2^23`: adding and subtracting it rounds an f32 of magnitude below `2^22` to an
/// integer in the current rounding mode (nearest, ties to even) without a libm call, which
/// `round_ties_even` needs on baseline x86-64. Our quotients are at most ~254 in magnitude
/// (`|x| <= amax` and `scale >= amax / 254` even for subnormal scales).
const ROUND_MAGIC: f32 = 12_582_912.0;

fn scale_of(block: &[f32], qmax: f32) -> f32 {
    let amax_bits = block
        .iter()
        .fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff));
    if amax_bits >= NON_FINITE_BITS {
        POISON_SCALE
    } else {
        f32::from_bits(amax_bits) / qmax
    }
}

/// The bits of `ROUND_MAGIC`: after `y + ROUND_MAGIC` the integer `k` nearest `y` sits in the
/// low mantissa bits, so `bits(y + M) - bits(M) == k` and no float-to-int conversion is needed.
const ROUND_MAGIC_BITS: i32 = 0x4b40_0000;

#[inline(always)]
fn quantize_one(x: f32, scale: f32, qmax: i32) -> i32 {
    // Divide (not multiply by a reciprocal) to match the kernels and the reference bit for bit.
    let k = (x / scale + ROUND_MAGIC).to_bits() as i32 - ROUND_MAGIC_BITS;
    k.clamp(-qmax, qmax)
}

/// Quantizes one block into int8 bytes; fixed-width inner loops so the compiler vectorises.
#[inline(always)]
fn quantize_block_i8(chunk: &[f32], scale: f32, out: &mut [u8]) {
    let whole = chunk.len() / 8 * 8;
    let (x_head, x_tail) = chunk.split_at(whole);
    let (o_head, o_tail) = out.split_at_mut(whole);
    for (o, x) in o_head.chunks_exact_mut(8).zip(x_head.chunks_exact(8)) {
        for j in 0..8 {
            o[j] = quantize_one(x[j], scale, 127) as u8;
        }
    }
    for (o, &x) in o_tail.iter_mut().zip(x_tail) {
        *o = quantize_one(x, scale, 127) as u8;
    }
}

/// Quantizes one block into packed int4 bytes (element 2k low nibble, 2k + 1 high).
#[inline(always)]
fn quantize_block_i4(chunk: &[f32], scale: f32, out: &mut [u8]) {
    let whole = chunk.len() / 8 * 8;
    let (x_head, x_tail) = chunk.split_at(whole);
    let (o_head, o_tail) = out.split_at_mut(whole / 2);
    for (o, x) in o_head.chunks_exact_mut(4).zip(x_head.chunks_exact(8)) {
        for j in 0..4 {
            let lo = quantize_one(x[2 * j], scale, 7) as u8 & 0xf;
            let hi = quantize_one(x[2 * j + 1], scale, 7) as u8 & 0xf;
            o[j] = lo | (hi << 4);
        }
    }
    for (k, o) in o_tail.iter_mut().enumerate() {
        let lo = quantize_one(x_tail[2 * k], scale, 7) as u8 & 0xf;
        let hi = x_tail
            .get(2 * k + 1)
            .map_or(0, |&v| quantize_one(v, scale, 7) as u8 & 0xf);
        *o = lo | (hi << 4);
    }
}

#[inline(always)]
fn quantize_block_portable(format: QuantFormat, chunk: &[f32], scale: f32, out: &mut [u8]) {
    match format {
        QuantFormat::Int8 => quantize_block_i8(chunk, scale, out),
        QuantFormat::Int4 => quantize_block_i4(chunk, scale, out),
    }
}

/// The same loops compiled for AVX2: 8-wide division instead of SSE2's 4. IEEE division and
/// no FMA contraction (Rust never contracts), so the results are the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn quantize_block_avx2(format: QuantFormat, chunk: &[f32], scale: f32, out: &mut [u8]) {
    quantize_block_portable(format, chunk, scale, out)
}

/// Quantizes one finite, non-zero-scale block, on the widest vector unit this CPU has.
fn quantize_block(format: QuantFormat, chunk: &[f32], scale: f32, out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { quantize_block_avx2(format, chunk, scale, out) };
    }
    quantize_block_portable(format, chunk, scale, out)
}

impl HostKernels {
    /// Quantizes into caller buffers (`data` of `format.data_bytes(x.len())` bytes, `scales`
    /// of one per block), so a benchmark can measure the arithmetic without allocation.
    pub fn quantize_into(
        &self,
        x: &[f32],
        format: QuantFormat,
        block: BlockSize,
        data: &mut [u8],
        scales: &mut [f32],
    ) {
        let b = block.get();
        assert_eq!(data.len(), format.data_bytes(x.len()), "data length");
        assert_eq!(scales.len(), x.len().div_ceil(b), "scale count");
        for (k, chunk) in x.chunks(b).enumerate() {
            let scale = scale_of(chunk, format.qmax());
            scales[k] = scale;
            // Blocks are a multiple of 8 elements, so block k's bytes start at a whole byte.
            let out = &mut data[format.data_bytes(k * b)..format.data_bytes(k * b + chunk.len())];
            if scale.is_nan() || scale == 0.0 {
                out.fill(0);
                continue;
            }
            quantize_block(format, chunk, scale, out);
        }
    }

    /// Adds the dequantized `q` to `acc` element-wise (`acc[i] += q_i * scale`).
    pub fn dequantize_add(&self, q: &Quantized, acc: &mut [f32]) {
        let b = q.block.get();
        assert_eq!(acc.len(), q.len, "accumulator length");
        for (k, out) in acc.chunks_mut(b).enumerate() {
            let scale = q.scales[k];
            let bytes = &q.data[q.format.data_bytes(k * b)..];
            match q.format {
                QuantFormat::Int8 => {
                    for (o, &v) in out.iter_mut().zip(bytes) {
                        *o += (v as i8) as f32 * scale;
                    }
                }
                QuantFormat::Int4 => {
                    // Shift a nibble to the top of an i8 and back: sign extension.
                    let last_byte = out.len() / 2;
                    let mut pairs = out.chunks_exact_mut(2);
                    for (o, &byte) in (&mut pairs).zip(bytes) {
                        o[0] += (((byte << 4) as i8) >> 4) as f32 * scale;
                        o[1] += ((byte as i8) >> 4) as f32 * scale;
                    }
                    if let [last] = pairs.into_remainder() {
                        let byte = bytes[last_byte];
                        *last += (((byte << 4) as i8) >> 4) as f32 * scale;
                    }
                }
            }
        }
    }
}

impl QuantKernels for HostKernels {
    fn name(&self) -> String {
        "host".into()
    }

    fn quantize(&self, x: &[f32], format: QuantFormat, block: BlockSize) -> Quantized {
        let mut data = vec![0u8; format.data_bytes(x.len())];
        let mut scales = vec![0.0f32; x.len().div_ceil(block.get())];
        self.quantize_into(x, format, block, &mut data, &mut scales);
        Quantized {
            format,
            block,
            len: x.len(),
            data,
            scales,
        }
    }

    fn dequantize(&self, q: &Quantized) -> Vec<f32> {
        self.dequantize_sum(std::slice::from_ref(q))
    }

    fn dequantize_sum(&self, parts: &[Quantized]) -> Vec<f32> {
        let mut acc = vec![0.0f32; parts.first().map_or(0, |p| p.len)];
        for p in parts {
            self.dequantize_add(p, &mut acc);
        }
        acc
    }
}

#[cfg(test)]
mod tests {
    use super::super::reference;
    use super::*;

    /// Deterministic pseudo-random f32s spanning many magnitudes (xorshift; no dependency).
    pub(crate) fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let mant = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                let exp = ((s >> 8) % 16) as i32 - 8;
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
            127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 7.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5,
            6.5,
        ];
        vec![
            ("random 1000 (not a block multiple)".into(), values(1000, 1)),
            ("random 4096".into(), values(4096, 2)),
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

    #[test]
    fn host_is_bit_identical_to_the_reference() {
        for block in [8, 16, 64] {
            let block = BlockSize::new(block).unwrap();
            for format in [QuantFormat::Int8, QuantFormat::Int4] {
                for (name, x) in cases() {
                    let want = reference::quantize(&x, format, block);
                    let got = HostKernels.quantize(&x, format, block);
                    assert!(
                        got.bit_eq(&want),
                        "{name} {format:?} {block:?}\n{got:?}\n{want:?}"
                    );
                    let d_want = reference::dequantize(&want);
                    let d_got = HostKernels.dequantize(&got);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&d_got), bits(&d_want), "{name} {format:?}");
                    let parts = vec![
                        want.clone(),
                        reference::quantize(&values(x.len(), 9), format, block),
                        want,
                    ];
                    assert_eq!(
                        bits(&HostKernels.dequantize_sum(&parts)),
                        bits(&reference::dequantize_sum(&parts)),
                        "{name} {format:?} sum"
                    );
                }
            }
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
}
