//! The quantization kernels for host buffers: the numerics of `reference`, bit for bit, in one
//! sweep per block (the block's max, then quantize and pack while it is still in L1), on
//! AVX-512 F+BW (`avx512`, hand-written) or else plain Rust compiled for AVX2 and for baseline
//! SSE2 (multiversioned), picked at run time; `_into` forms write caller buffers. It
//! deliberately adds no threads: callers own the cores.
//!
//! # Division by a reciprocal, exactly
//!
//! The reference computes `round_half_even(x / scale)`; a vector division costs ~10x a
//! multiplication, so the fast path multiplies by `r = fl(1 / scale)` instead and falls back
//! to the division for the lanes where that could change the integer. Why it is exact, for a
//! normal scale in `[2^-100, 2^100]` (see `recip_safe`), with `u = 2^-24`, `q* = x / scale`
//! (exact), `Q = fl(q*)` (what the reference rounds) and `|q*| <= QMAX / (1 - u) < 128`
//! (`scale >= fl(amax / QMAX)`, rounded up to 16 bits, and `|x| <= amax`):
//!
//! 1. `y = fl(x * r)`: `fl(1 / scale)` and the product each add one relative error `<= u`, so
//!    `|y - q*| <= (2u + u^2) |q*|` and `|y - Q| <= (3u + u^2) |q*| + 2^-149 < 2^-14`.
//! 2. `a = fl(y + 3 * 2^10)` lies in `[2^11, 2^12)`, where the f32 grid is `2^-12`: it rounds `y`
//!    to `z = F / 2^12` with `|z - y| <= 2^-13`, and `F = bits(a) - bits(3 * 2^10)` is that
//!    fixed-point value as an integer (`FINE_MAGIC`). So `|z - Q| < 2^-13 + 2^-14 < 2^-12`.
//! 3. `G = F + 2^11 + 1`. If `G mod 2^12` is neither 0 nor 1, `z` is at least one grid step
//!    above the half-integer below it and two below the one above it, so `Q` (closer than a
//!    step) lies strictly between the same half-integers and `round_half_even(Q)` is the
//!    integer between them: `G >> 12`. Otherwise the lanes are recomputed with the division
//!    (about 1 element in 2000 on continuous data; every exact tie, as it must).
//! 4. `|y| < QMAX + 2^-14`, so `G >> 12` needs no clamp (and `Q` none either).
//!
//! Tiny or huge scales (whose reciprocal may be inexact or overflow) take the division for the
//! whole block. A subnormal `x` quantizes to 0 as the reference says: the division path zeroes
//! it first, and the reciprocal path needs nothing, since `|x| < 2^-126` and `scale >= 2^-100`
//! make `|y| < 2^-25`, which step 2 rounds to 0.
//! Dequantization is one multiply (plus, for sums, adds in part order from `0.0`, each partial
//! sum flushed as the reference flushes it), the same operations as the reference, so the
//! same bits; int4 looks the product up in a 16-entry table of `nibble * scale`, computed by
//! the same multiply.

#[cfg(target_arch = "x86_64")]
mod avx512;

use super::reference::{self, Ieee, flush};
use super::{BlockSize, QuantFormat, QuantKernels, Quantized};

/// The host runtime: data in ordinary `Vec`s (or caller slices with the `_into` forms).
#[derive(Debug, Clone, Copy, Default)]
pub struct HostKernels;

/// `1.5 * 2^23`: adding it to an f32 of magnitude below `2^22` rounds it to an integer in the
/// current rounding mode (nearest, ties to even; Rust never changes it) and leaves that integer
/// `k` in the low mantissa bits: `bits(y + M) == bits(M) + k`. No libm call (`round_ties_even`
/// needs one on baseline x86-64) and no float-to-int conversion. Every quotient here is below
/// ~128 in magnitude (`|x| <= amax` and `scale >= fl(amax / QMAX)`).
const ROUND_MAGIC: f32 = 12_582_912.0;
/// The bits of [`ROUND_MAGIC`].
const ROUND_MAGIC_BITS: i32 = 0x4b40_0000;
/// `3 * 2^10`: `y + FINE_MAGIC` rounds `|y| < 2^10` to the grid `2^-12` (module doc, step 2).
const FINE_MAGIC: f32 = 3072.0;
/// Added to `bits(y + FINE_MAGIC)` to get `G = F + 2^11 + 1` (module doc, step 3).
const FINE_BIAS: i32 = 0x801 - 0x4540_0000;
/// `G & NEAR_TIE == 0`: `G mod 2^12` is 0 or 1, so `y` may round differently from `Q`.
const NEAR_TIE: i32 = 0xffe;

/// The fast path for one element (module doc): `G`, whose `>> 12` is the integer unless
/// `G & NEAR_TIE == 0`.
#[inline(always)]
fn fast_g(x: f32, r: f32) -> i32 {
    ((x * r + FINE_MAGIC).to_bits() as i32).wrapping_add(FINE_BIAS)
}

/// Whether multiplying by `fl(1 / scale)` is exact enough (module doc): a normal scale whose
/// reciprocal is normal too, with room to spare: `2^-100 <= scale <= 2^100`.
#[inline(always)]
fn recip_safe(scale: f32) -> bool {
    const LO: f32 = f32::from_bits((127 - 100) << 23);
    const HI: f32 = f32::from_bits((127 + 100) << 23);
    (LO..=HI).contains(&scale)
}

/// The scale of a block from its largest `|x|` bit pattern (`reference::block_scale`).
#[inline(always)]
fn scale_from_bits(amax_bits: u32, format: QuantFormat) -> f32 {
    reference::scale_from_amax_bits::<Ieee>(amax_bits, format)
}

/// The exponent field of an f32: zero for subnormals and zeros.
const EXPONENT_BITS: u32 = 0x7f80_0000;

/// `x`, or +0 where `x` is subnormal: what the reference quantizes it as.
#[inline(always)]
fn zero_subnormal(x: f32) -> f32 {
    if x.to_bits() & EXPONENT_BITS == 0 {
        0.0
    } else {
        x
    }
}

/// The reference's `round_half_even(x / scale).clamp(-qmax, qmax)` for a finite non-zero scale
/// (0 for a subnormal `x`).
#[inline(always)]
fn quantize_exact(x: f32, scale: f32, qmax: i32) -> i32 {
    let x = zero_subnormal(x);
    let k = (x / scale + ROUND_MAGIC).to_bits() as i32 - ROUND_MAGIC_BITS;
    k.clamp(-qmax, qmax)
}

/// Which implementation runs; the best one this CPU supports unless a test picks another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Isa {
    /// Plain Rust for baseline x86-64 (SSE2) or any other architecture.
    Portable,
    /// The same Rust compiled with AVX2 enabled.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// Hand-written AVX-512 (F and BW: every AVX-512 server CPU since Skylake-SP).
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    /// The widest implementation this CPU runs (as `ember_cpu` probed it once).
    fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            match ember_cpu::vector() {
                ember_cpu::Vector::Avx512 => return Isa::Avx512,
                ember_cpu::Vector::Avx2 => return Isa::Avx2,
                ember_cpu::Vector::Baseline => {}
            }
        }
        Isa::Portable
    }
}

/// How a dequantized value lands in the output (the reference's `dequantize` writes the
/// product; `dequantize_sum` folds from `0.0`, which differs for `-0.0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Write {
    /// `out = q * scale`.
    Set,
    /// `out = 0.0 + q * scale`: the first part of a sum.
    FromZero,
    /// `out += q * scale`.
    Add,
}

impl HostKernels {
    /// Quantizes into caller buffers (`data` of `format.data_bytes(x.len())` bytes, `scales`
    /// of one per block), without allocating.
    pub fn quantize_into(
        &self,
        x: &[f32],
        format: QuantFormat,
        block: BlockSize,
        data: &mut [u8],
        scales: &mut [f32],
    ) {
        quantize_into_on(Isa::best(), x, format, block, data, scales);
    }

    /// Writes the dequantized `q` into `out` (`q.len` elements), without allocating.
    pub fn dequantize_into(&self, q: &Quantized, out: &mut [f32]) {
        dequantize_on(Isa::best(), q, out, Write::Set);
    }

    /// Writes the element-wise sum of the dequantized `parts` into `out`, added in part order
    /// from `0.0` like [`QuantKernels::dequantize_sum`]; no parts gives zeros.
    pub fn dequantize_sum_into(&self, parts: &[Quantized], out: &mut [f32]) {
        dequantize_sum_on(Isa::best(), parts, out);
    }

    /// Adds the dequantized `q` to `acc` element-wise (`acc[i] += q_i * scale`), each sum
    /// [`reference::flush`]ed as the reference's sums are.
    pub fn dequantize_add(&self, q: &Quantized, acc: &mut [f32]) {
        dequantize_on(Isa::best(), q, acc, Write::Add);
    }
}

fn quantize_into_on(
    isa: Isa,
    x: &[f32],
    format: QuantFormat,
    block: BlockSize,
    data: &mut [u8],
    scales: &mut [f32],
) {
    assert_eq!(data.len(), format.data_bytes(x.len()), "data length");
    assert_eq!(scales.len(), x.len().div_ceil(block.get()), "scale count");
    match isa {
        Isa::Portable => portable::quantize(x, format, block, data, scales),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` is only chosen (by `best` or a test) where the CPU has AVX2.
        Isa::Avx2 => unsafe { portable::quantize_avx2(x, format, block, data, scales) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512` is only chosen where the CPU has AVX-512F and BW.
        Isa::Avx512 => unsafe { avx512::quantize(x, format, block, data, scales) },
    }
}

/// The lengths every dequantize relies on.
fn dequantize_checks(q: &Quantized, out: &[f32]) {
    assert_eq!(out.len(), q.len, "output length");
    assert_eq!(q.data.len(), q.format.data_bytes(q.len), "data length");
    assert_eq!(q.scales.len(), q.len.div_ceil(q.block.get()), "scale count");
}

fn dequantize_on(isa: Isa, q: &Quantized, out: &mut [f32], write: Write) {
    dequantize_checks(q, out);
    match isa {
        Isa::Portable => portable::dequantize(q, out, write),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `quantize_into_on`.
        Isa::Avx2 => unsafe { portable::dequantize_avx2(q, out, write) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `quantize_into_on`.
        Isa::Avx512 => unsafe { avx512::dequantize(q, out, write) },
    }
}

fn dequantize_sum_on(isa: Isa, parts: &[Quantized], out: &mut [f32]) {
    let Some((first, rest)) = parts.split_first() else {
        out.fill(0.0);
        return;
    };
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512
        && rest
            .iter()
            .all(|p| (p.format, p.block, p.len) == (first.format, first.block, first.len))
    {
        for p in parts {
            dequantize_checks(p, out);
        }
        // SAFETY: `Isa::Avx512` is only chosen where the CPU has AVX-512F and BW.
        return unsafe { avx512::dequantize_sum(parts, out) };
    }
    // Part by part (parts of mixed formats or blocks, and the portable code).
    dequantize_on(isa, first, out, Write::FromZero);
    for p in rest {
        dequantize_on(isa, p, out, Write::Add);
    }
}

/// Plain Rust, written in fixed 16-lane chunks so the compiler vectorises it; compiled twice.
mod portable {
    use super::*;

    /// One 16-element chunk: each element's integer (its low byte / nibble is what is stored).
    #[inline(always)]
    fn chunk(x: &[f32; 16], scale: f32, recip: Option<f32>, qmax: i32) -> [i32; 16] {
        if let Some(r) = recip {
            let g = x.map(|v| fast_g(v, r));
            // `|`, not `any`: no early exit, so the test vectorises.
            let near = g.iter().fold(false, |n, &g| n | (g & NEAR_TIE == 0));
            if !near {
                return g.map(|g| g >> 12);
            }
        }
        x.map(|v| quantize_exact(v, scale, qmax))
    }

    #[inline(always)]
    fn quantize_block(format: QuantFormat, x: &[f32], scale: f32, out: &mut [u8]) {
        let recip = recip_safe(scale).then(|| 1.0 / scale);
        let qmax = format.qmax() as i32;
        let per = format.data_bytes(16);
        let mut xs = x.chunks_exact(16);
        let mut os = out.chunks_exact_mut(per);
        for (c, o) in (&mut xs).zip(&mut os) {
            pack(format, &chunk(c.try_into().unwrap(), scale, recip, qmax), o);
        }
        let rest = xs.remainder();
        if !rest.is_empty() {
            let mut c = [0.0f32; 16];
            c[..rest.len()].copy_from_slice(rest);
            let mut bytes = [0u8; 16];
            // Zero padding quantizes to 0, so a trailing int4 half byte is 0 as specified.
            pack(format, &chunk(&c, scale, recip, qmax), &mut bytes[..per]);
            let o = os.into_remainder();
            o.copy_from_slice(&bytes[..o.len()]);
        }
    }

    #[inline(always)]
    fn pack(format: QuantFormat, bits: &[i32; 16], out: &mut [u8]) {
        match format {
            QuantFormat::Int8 => {
                for (o, &b) in out.iter_mut().zip(bits) {
                    *o = b as u8;
                }
            }
            QuantFormat::Int4 => {
                for (o, p) in out.iter_mut().zip(bits.chunks_exact(2)) {
                    *o = (p[0] as u8 & 0xf) | ((p[1] as u8) << 4);
                }
            }
        }
    }

    #[inline(always)]
    pub(super) fn quantize(
        x: &[f32],
        format: QuantFormat,
        block: BlockSize,
        data: &mut [u8],
        scales: &mut [f32],
    ) {
        let b = block.get();
        // Blocks are a multiple of 8 elements, so each block's bytes start at a whole byte.
        let per_block = format.data_bytes(b);
        for ((chunk, out), s) in x.chunks(b).zip(data.chunks_mut(per_block)).zip(scales) {
            let amax = chunk
                .iter()
                .fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff));
            let scale = scale_from_bits(amax, format);
            *s = scale;
            if scale.is_nan() || scale == 0.0 {
                out.fill(0);
            } else {
                quantize_block(format, chunk, scale, out);
            }
        }
    }

    #[inline(always)]
    fn put(o: &mut f32, v: f32, write: Write) {
        match write {
            Write::Set => *o = v,
            // `v` is an exact product, zero or normal: nothing to flush.
            Write::FromZero => *o = 0.0 + v,
            Write::Add => *o = flush(*o + v),
        }
    }

    #[inline(always)]
    pub(super) fn dequantize(q: &Quantized, out: &mut [f32], write: Write) {
        let b = q.block.get();
        let per_block = q.format.data_bytes(b);
        for ((out, bytes), &scale) in out
            .chunks_mut(b)
            .zip(q.data.chunks(per_block))
            .zip(&q.scales)
        {
            match q.format {
                QuantFormat::Int8 => {
                    for (o, &v) in out.iter_mut().zip(bytes) {
                        put(o, (v as i8) as f32 * scale, write);
                    }
                }
                QuantFormat::Int4 => {
                    // Shift a nibble to the top of an i8 and back: sign extension.
                    let mut pairs = out.chunks_exact_mut(2);
                    for (o, &byte) in (&mut pairs).zip(bytes) {
                        put(&mut o[0], (((byte << 4) as i8) >> 4) as f32 * scale, write);
                        put(&mut o[1], ((byte as i8) >> 4) as f32 * scale, write);
                    }
                    if let [last] = pairs.into_remainder() {
                        let byte = bytes[bytes.len() - 1];
                        put(last, (((byte << 4) as i8) >> 4) as f32 * scale, write);
                    }
                }
            }
        }
    }

    /// [`quantize`] compiled for AVX2: IEEE division and no FMA contraction (Rust never
    /// contracts), so the same bits on 8 lanes instead of 4.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    pub(super) fn quantize_avx2(
        x: &[f32],
        format: QuantFormat,
        block: BlockSize,
        data: &mut [u8],
        scales: &mut [f32],
    ) {
        quantize(x, format, block, data, scales)
    }

    /// [`dequantize`] compiled for AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    pub(super) fn dequantize_avx2(q: &Quantized, out: &mut [f32], write: Write) {
        dequantize(q, out, write)
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
        let mut out = vec![0.0f32; q.len];
        self.dequantize_into(q, &mut out);
        out
    }

    fn dequantize_sum(&self, parts: &[Quantized]) -> Vec<f32> {
        let mut out = vec![0.0f32; parts.first().map_or(0, |p| p.len)];
        self.dequantize_sum_into(parts, &mut out);
        out
    }
}

#[cfg(test)]
mod tests;
