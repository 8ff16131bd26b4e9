//! Host buffers in the compute dtype: what the primary and secondary parameter partitions hold
//! and what parameter gathers move. bf16 is carried as `ember_comm::Bf16` bits.

use ember_comm::Bf16;

use crate::config::Compute;

/// A flat host buffer of parameters in the compute dtype.
#[derive(Debug, Clone, PartialEq)]
pub enum Buf {
    /// f32 values.
    F32(Vec<f32>),
    /// bf16 values (rounded to nearest even from f32).
    Bf16(Vec<Bf16>),
}

impl Buf {
    /// `values` rounded to `compute`.
    pub fn from_f32(values: &[f32], compute: Compute) -> Self {
        match compute {
            Compute::F32 => Buf::F32(values.to_vec()),
            Compute::Bf16 => Buf::Bf16(values.iter().map(|&x| Bf16::from_f32(x)).collect()),
        }
    }

    /// The values widened to f32 (exact).
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            Buf::F32(v) => v.clone(),
            Buf::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Buf::F32(v) => v.len(),
            Buf::Bf16(v) => v.len(),
        }
    }

    /// True when it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        match self {
            Buf::F32(v) => 4 * v.len() as u64,
            Buf::Bf16(v) => 2 * v.len() as u64,
        }
    }

    /// A copy of elements `range`.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Self {
        match self {
            Buf::F32(v) => Buf::F32(v[range].to_vec()),
            Buf::Bf16(v) => Buf::Bf16(v[range].to_vec()),
        }
    }
}
