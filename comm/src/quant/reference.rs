//! The scalar reference of the quantization numerics: the module doc of `quant` written as
//! the most direct code, one element at a time. Every runtime is tested bit for bit against it;
//! it is deliberately slow and never used on a hot path.

use super::{BlockSize, NON_FINITE_BITS, POISON_SCALE, QuantFormat, Quantized};

/// The scale of one block (see `quant`): NaN if non-finite, 0 for zeros or underflow.
pub fn block_scale(block: &[f32], format: QuantFormat) -> f32 {
    let amax_bits = block
        .iter()
        .map(|x| x.to_bits() & 0x7fff_ffff)
        .max()
        .unwrap_or(0);
    if amax_bits >= NON_FINITE_BITS {
        POISON_SCALE
    } else {
        f32::from_bits(amax_bits) / format.qmax()
    }
}

/// The integer for `x` under `scale` (0 for NaN or zero scales).
pub fn quantize_one(x: f32, scale: f32, format: QuantFormat) -> i32 {
    if scale.is_nan() || scale == 0.0 {
        return 0;
    }
    let q = (x / scale)
        .round_ties_even()
        .clamp(-format.qmax(), format.qmax());
    q as i32
}

/// Quantizes `x` element by element.
pub fn quantize(x: &[f32], format: QuantFormat, block: BlockSize) -> Quantized {
    let scales: Vec<f32> = x
        .chunks(block.get())
        .map(|b| block_scale(b, format))
        .collect();
    let q: Vec<i32> = x
        .iter()
        .enumerate()
        .map(|(i, &v)| quantize_one(v, scales[i / block.get()], format))
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
    (0..q.len)
        .map(|i| stored(q, i) as f32 * q.scales[i / q.block.get()])
        .collect()
}

/// Sum of the dequantized parts, in part order from 0.0.
pub fn dequantize_sum(parts: &[Quantized]) -> Vec<f32> {
    let len = parts.first().map_or(0, |p| p.len);
    (0..len)
        .map(|i| {
            parts.iter().fold(0.0f32, |acc, p| {
                acc + stored(p, i) as f32 * p.scales[i / p.block.get()]
            })
        })
        .collect()
}
