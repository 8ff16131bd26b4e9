//! Blockwise symmetric quantization (ZeRO++): the format, the kernel interface every runtime
//! implements, and the wire layout the quantized collectives send. The arithmetic lives in
//! `reference` (the specification), `host` (fast plain Rust, bit-identical) and `cube` (CubeCL).
//!
//! # Numerics (identical on every runtime)
//!
//! For each block of `B` consecutive elements (the last one may be shorter), with
//! `QMAX = 127` (int8) or `7` (int4) and `amax` the largest `|x|` of the block:
//!
//! - `scale = amax / QMAX` rounded up to 16 significant bits, `q = clamp(round_half_even(x /
//!   scale), -QMAX, QMAX)`, `x' = q * scale`. So `|x - x'| <= scale / 2` (up to one f32
//!   rounding of `x / scale`), and `scale` is at most `2^-15` (relative) above `amax / QMAX`.
//! - A block of zeros or subnormals, or whose scale falls below the normal range (`amax <
//!   QMAX * 2^-126`), has `scale = 0` and `q = 0`; a subnormal `x` quantizes to 0.
//! - A block holding any `±inf` or `NaN` has `scale = NaN` and `q = 0`, so the **whole block
//!   dequantizes to NaN**: a non-finite gradient poisons its block visibly instead of being
//!   silently clipped, and loss-NaN detection upstream still fires.
//! - A sum of dequantized parts adds them in part order from `0.0`, and each partial sum below
//!   `2^-126` in magnitude becomes a zero of its sign.
//! - `amax` is taken on the bit patterns (`bits & 0x7fff_ffff`, which orders non-negative
//!   floats like their values) so no runtime's NaN-unaware `max` can hide a NaN.
//!
//! Why the 16 bits and the flushes: devices differ where IEEE 754 leaves room. NVRTC contracts
//! `acc + q * scale` into one FMA, which skips the product's rounding; with 16-bit scales and
//! `|q| <= 127` the product is exact, so fused and separate give the same sum. A device that
//! flushes subnormals (FTZ) reads and writes them as zero; here no operation ever meets one
//! that the numerics did not already make zero. `reference::Device` runs the reference both
//! ways, and the tests hold each to the IEEE result bit for bit.
//!
//! # Packing
//!
//! int8: one two's-complement byte per element. int4: two per byte, element `2k` in the low
//! nibble and `2k + 1` in the high one. The kernels store the same bytes as little-endian u32
//! words (WGSL has no 8-bit storage).

pub mod host;
pub mod reference;
pub mod selfcheck;

#[cfg(feature = "cubecl")]
pub mod cube;

use serde::{Deserialize, Serialize};

use crate::error::CommError;

/// Integer width of a quantized value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum QuantFormat {
    /// Symmetric int8 in [-127, 127] (qwZ weights).
    Int8,
    /// Symmetric int4 in [-7, 7], two per byte (qgZ gradients).
    Int4,
}

impl QuantFormat {
    /// Largest quantized magnitude.
    pub fn qmax(self) -> f32 {
        match self {
            QuantFormat::Int8 => 127.0,
            QuantFormat::Int4 => 7.0,
        }
    }

    /// Bytes holding `len` quantized values.
    pub fn data_bytes(self, len: usize) -> usize {
        match self {
            QuantFormat::Int8 => len,
            QuantFormat::Int4 => len.div_ceil(2),
        }
    }
}

/// Elements per scale, validated: a positive multiple of 8, so blocks fill whole u32 words in
/// the kernels and int4 blocks whole bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockSize(usize);

impl BlockSize {
    /// DeepSpeed uses blocks of a few thousand elements; 2048 keeps the scale overhead at 0.2%
    /// for int8 while bounding the error by each block's own max.
    pub const DEFAULT: BlockSize = BlockSize(2048);

    /// Validates `block`.
    pub fn new(block: usize) -> Result<Self, CommError> {
        if block == 0 || !block.is_multiple_of(8) {
            return Err(CommError::Unsupported(format!(
                "quantization block of {block} elements: use a positive multiple of 8 \
                 (e.g. 2048)"
            )));
        }
        Ok(Self(block))
    }

    /// The number of elements.
    pub fn get(self) -> usize {
        self.0
    }
}

/// A quantized buffer: packed values plus one f32 scale per block.
#[derive(Debug, Clone, PartialEq)]
pub struct Quantized {
    /// int8 or int4.
    pub format: QuantFormat,
    /// Elements per scale.
    pub block: BlockSize,
    /// Number of logical elements.
    pub len: usize,
    /// Packed values, `format.data_bytes(len)` bytes.
    pub data: Vec<u8>,
    /// One scale per block, `len.div_ceil(block)` values.
    pub scales: Vec<f32>,
}

impl Quantized {
    /// Bytes on the wire: packed data followed by the scales' little-endian bytes.
    pub fn wire_bytes(format: QuantFormat, block: BlockSize, len: usize) -> usize {
        format.data_bytes(len) + 4 * len.div_ceil(block.get())
    }

    /// Appends the wire form (data, then scales) to `out`.
    pub fn write_wire(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.data);
        for s in &self.scales {
            out.extend_from_slice(&s.to_le_bytes());
        }
    }

    /// Reads a wire form written by [`Quantized::write_wire`].
    pub fn read_wire(format: QuantFormat, block: BlockSize, len: usize, wire: &[u8]) -> Self {
        let d = format.data_bytes(len);
        assert_eq!(
            wire.len(),
            Self::wire_bytes(format, block, len),
            "wire length"
        );
        let scales = wire[d..]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Self {
            format,
            block,
            len,
            data: wire[..d].to_vec(),
            scales,
        }
    }

    /// The elements `[start, start + len)` as their own quantized buffer; `start` must be a
    /// multiple of the block (quantizing a block-aligned slice gives exactly this).
    pub fn part(&self, start: usize, len: usize) -> Self {
        let b = self.block.get();
        assert_eq!(start % b, 0, "parts start on a block boundary");
        assert!(start + len <= self.len, "part inside the buffer");
        let d0 = self.format.data_bytes(start);
        Self {
            format: self.format,
            block: self.block,
            len,
            data: self.data[d0..d0 + self.format.data_bytes(len)].to_vec(),
            scales: self.scales[start / b..(start + len).div_ceil(b)].to_vec(),
        }
    }

    /// Bit-exact equality (NaN scales compare by bits).
    pub fn bit_eq(&self, other: &Self) -> bool {
        self.format == other.format
            && self.block == other.block
            && self.len == other.len
            && self.data == other.data
            && self.scales.len() == other.scales.len()
            && self
                .scales
                .iter()
                .zip(&other.scales)
                .all(|(a, b)| a.to_bits() == b.to_bits())
    }
}

/// The quantization kernels, implemented once per runtime the data can live on.
pub trait QuantKernels {
    /// Name for benchmarks and test messages (`host`, `wgpu`).
    fn name(&self) -> String;
    /// Quantizes `x` blockwise.
    fn quantize(&self, x: &[f32], format: QuantFormat, block: BlockSize) -> Quantized;
    /// `x'` for every element of `q`.
    fn dequantize(&self, q: &Quantized) -> Vec<f32>;
    /// Element-wise sum of the dequantized `parts` (same format, block and length), added in
    /// part order starting from `0.0`, so every runtime rounds identically.
    fn dequantize_sum(&self, parts: &[Quantized]) -> Vec<f32>;
}

/// Bits that mark a non-finite f32 once the sign is masked off.
pub(crate) const NON_FINITE_BITS: u32 = 0x7f80_0000;
/// The smallest normal f32's bits: a magnitude below it is subnormal (or zero).
pub(crate) const MIN_NORMAL_BITS: u32 = 0x0080_0000;
/// The scale of a block holding a non-finite value: a quiet NaN.
pub(crate) const POISON_SCALE: f32 = f32::NAN;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_size_refuses_non_multiples_of_eight() {
        assert!(BlockSize::new(0).is_err());
        assert!(BlockSize::new(12).is_err());
        assert_eq!(BlockSize::new(64).unwrap().get(), 64);
    }

    #[test]
    fn wire_round_trips() {
        let q = Quantized {
            format: QuantFormat::Int4,
            block: BlockSize::new(8).unwrap(),
            len: 16,
            data: (0..8).collect(),
            scales: vec![0.5, f32::NAN],
        };
        let mut wire = Vec::new();
        q.write_wire(&mut wire);
        assert_eq!(wire.len(), Quantized::wire_bytes(q.format, q.block, q.len));
        assert!(Quantized::read_wire(q.format, q.block, q.len, &wire).bit_eq(&q));
    }
}
