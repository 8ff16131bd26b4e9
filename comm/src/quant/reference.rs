//! The scalar reference of the quantization numerics: the module doc of `quant` written as
//! the most direct code, one element at a time. Every runtime is tested bit for bit against it;
//! it is deliberately slow and never used on a hot path.
//!
//! Its floating-point operations go through [`Arith`], so the same code also runs as a device
//! that fuses a multiply and an add into one FMA, or flushes subnormals to zero, would run it
//! ([`Device`]). The tests hold every such device to [`Ieee`]: the numerics are chosen so that
//! neither choice can change a bit.

use super::{BlockSize, MIN_NORMAL_BITS, NON_FINITE_BITS, POISON_SCALE, QuantFormat, Quantized};

/// Low mantissa bits cleared from every scale (rounding up): a scale keeps 16 significant
/// bits, so `q * scale` for `|q| <= 127` (7 bits) is exact in f32's 24.
pub const SCALE_DROPPED_BITS: u32 = 8;

/// The floating-point operations the numerics use, as a runtime carries them out.
pub trait Arith {
    /// `a / b`.
    fn div(a: f32, b: f32) -> f32;
    /// `acc + q * scale`, as the dequantizing sum writes it.
    fn mul_add(q: f32, scale: f32, acc: f32) -> f32;
    /// `q * scale`.
    fn mul(q: f32, scale: f32) -> f32;
}

/// IEEE 754 binary32 throughout, one rounding per operation, subnormals kept: the CPU.
#[derive(Debug, Clone, Copy)]
pub struct Ieee;

impl Arith for Ieee {
    fn div(a: f32, b: f32) -> f32 {
        a / b
    }
    fn mul_add(q: f32, scale: f32, acc: f32) -> f32 {
        acc + q * scale
    }
    fn mul(q: f32, scale: f32) -> f32 {
        q * scale
    }
}

/// A device's choices where IEEE leaves compilers and hardware room: `FMA` contracts a
/// multiply and the add after it into one fused operation (NVRTC does by default); `FTZ`
/// reads subnormal operands as zero and writes subnormal results as zero of their sign
/// (`.ftz` in PTX, DAZ/FTZ on x86, most shader compilers).
#[derive(Debug, Clone, Copy)]
pub struct Device<const FMA: bool, const FTZ: bool>;

impl<const FMA: bool, const FTZ: bool> Device<FMA, FTZ> {
    fn ftz(x: f32) -> f32 {
        if FTZ { flush(x) } else { x }
    }
}

impl<const FMA: bool, const FTZ: bool> Arith for Device<FMA, FTZ> {
    fn div(a: f32, b: f32) -> f32 {
        Self::ftz(Self::ftz(a) / Self::ftz(b))
    }
    fn mul_add(q: f32, scale: f32, acc: f32) -> f32 {
        let (q, scale, acc) = (Self::ftz(q), Self::ftz(scale), Self::ftz(acc));
        if FMA {
            Self::ftz(q.mul_add(scale, acc))
        } else {
            Self::ftz(acc + Self::ftz(q * scale))
        }
    }
    fn mul(q: f32, scale: f32) -> f32 {
        Self::ftz(Self::ftz(q) * Self::ftz(scale))
    }
}

/// `x`, or a zero of its sign where `x` is subnormal: every subnormal the numerics could meet
/// is read and written as zero, so a device that flushes them computes the same bits.
pub fn flush(x: f32) -> f32 {
    if x.to_bits() & 0x7fff_ffff < MIN_NORMAL_BITS {
        f32::from_bits(x.to_bits() & 0x8000_0000)
    } else {
        x
    }
}

/// The scale of a block whose largest `|x|` has the bit pattern `amax_bits` (see `quant`):
/// NaN if non-finite; 0 for zeros, subnormals or a scale below the normal range; otherwise
/// `amax / QMAX` rounded up to 16 significant bits.
pub fn scale_from_amax_bits<A: Arith>(amax_bits: u32, format: QuantFormat) -> f32 {
    if amax_bits >= NON_FINITE_BITS {
        return POISON_SCALE;
    }
    if amax_bits < MIN_NORMAL_BITS {
        return 0.0;
    }
    let bits = A::div(f32::from_bits(amax_bits), format.qmax()).to_bits();
    if bits < MIN_NORMAL_BITS {
        return 0.0;
    }
    let low = (1u32 << SCALE_DROPPED_BITS) - 1;
    f32::from_bits((bits + low) & !low)
}

/// The scale of one block (see `quant`).
pub fn block_scale(block: &[f32], format: QuantFormat) -> f32 {
    block_scale_on::<Ieee>(block, format)
}

fn block_scale_on<A: Arith>(block: &[f32], format: QuantFormat) -> f32 {
    let amax_bits = block
        .iter()
        .map(|x| x.to_bits() & 0x7fff_ffff)
        .max()
        .unwrap_or(0);
    scale_from_amax_bits::<A>(amax_bits, format)
}

/// The integer for `x` under `scale` (0 for NaN or zero scales, and for subnormal `x`).
pub fn quantize_one(x: f32, scale: f32, format: QuantFormat) -> i32 {
    quantize_one_on::<Ieee>(x, scale, format)
}

fn quantize_one_on<A: Arith>(x: f32, scale: f32, format: QuantFormat) -> i32 {
    if scale.is_nan() || scale == 0.0 || x.to_bits() & 0x7fff_ffff < MIN_NORMAL_BITS {
        return 0;
    }
    let q = A::div(x, scale)
        .round_ties_even()
        .clamp(-format.qmax(), format.qmax());
    q as i32
}

/// Quantizes `x` element by element.
pub fn quantize(x: &[f32], format: QuantFormat, block: BlockSize) -> Quantized {
    quantize_on::<Ieee>(x, format, block)
}

/// [`quantize`] with the operations of `A`.
pub fn quantize_on<A: Arith>(x: &[f32], format: QuantFormat, block: BlockSize) -> Quantized {
    let scales: Vec<f32> = x
        .chunks(block.get())
        .map(|b| block_scale_on::<A>(b, format))
        .collect();
    let q: Vec<i32> = x
        .iter()
        .enumerate()
        .map(|(i, &v)| quantize_one_on::<A>(v, scales[i / block.get()], format))
        .collect();
    let data = match format {
        QuantFormat::Int8 => q.iter().map(|&v| v as i8 as u8).collect(),
        QuantFormat::Int4 => q
            .chunks(2)
            .map(|p| {
                let lo = (p[0] as u8) & 0xf;
                let hi = p.get(1).map_or(0, |&v| (v as u8) & 0xf);
                lo | (hi << 4)
            })
            .collect(),
    };
    Quantized {
        format,
        block,
        len: x.len(),
        data,
        scales,
    }
}

/// The integer stored for element `i`.
pub fn stored(q: &Quantized, i: usize) -> i32 {
    match q.format {
        QuantFormat::Int8 => q.data[i] as i8 as i32,
        QuantFormat::Int4 => {
            let nibble = (q.data[i / 2] >> (4 * (i % 2))) & 0xf;
            if nibble >= 8 {
                nibble as i32 - 16
            } else {
                nibble as i32
            }
        }
    }
}

/// `q * scale` per element.
pub fn dequantize(q: &Quantized) -> Vec<f32> {
    dequantize_on::<Ieee>(q)
}

/// [`dequantize`] with the operations of `A`.
pub fn dequantize_on<A: Arith>(q: &Quantized) -> Vec<f32> {
    (0..q.len)
        .map(|i| A::mul(stored(q, i) as f32, q.scales[i / q.block.get()]))
        .collect()
}

/// Sum of the dequantized parts, in part order from 0.0, each partial sum [`flush`]ed.
pub fn dequantize_sum(parts: &[Quantized]) -> Vec<f32> {
    dequantize_sum_on::<Ieee>(parts)
}

/// [`dequantize_sum`] with the operations of `A`.
pub fn dequantize_sum_on<A: Arith>(parts: &[Quantized]) -> Vec<f32> {
    let len = parts.first().map_or(0, |p| p.len);
    (0..len)
        .map(|i| {
            parts.iter().fold(0.0f32, |acc, p| {
                let scale = p.scales[i / p.block.get()];
                flush(A::mul_add(stored(p, i) as f32, scale, acc))
            })
        })
        .collect()
}
