//! bf16 bits and f32 values: the conversions every bf16 kernel shares (the bf16 product's
//! packing, the row kernels, attention, and the AMX product rounding its outputs).

use std::mem::MaybeUninit;

use super::simd::multiversion;

/// The nearest bf16 to `x` (ties to even) as its bits; NaN stays NaN.
#[inline(always)]
pub(crate) fn bits_of(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    if x.is_nan() { 0x7fc0 } else { rounded }
}

/// The f32 of bf16 bits.
#[inline(always)]
pub(crate) fn value_of(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

multiversion! {
    /// `out[i] = bits_of(x[i])`.
    pub(crate) fn round_into(x: &[f32], out: &mut [MaybeUninit<u16>]) {
        for (o, &x) in out.iter_mut().zip(x) {
            o.write(bits_of(x));
        }
    }
}

multiversion! {
    /// `out[i] = value_of(bits[i])`.
    pub(crate) fn widen_into(bits: &[u16], out: &mut [MaybeUninit<f32>]) {
        for (o, &b) in out.iter_mut().zip(bits) {
            o.write(value_of(b));
        }
    }
}

/// [`widen_into`] an initialised buffer.
pub(crate) fn widen_to(bits: &[u16], out: &mut [f32]) {
    // SAFETY: `MaybeUninit<f32>` has the layout of `f32`, and only values are written
    // through it.
    widen_into(bits, unsafe {
        &mut *(out as *mut [f32] as *mut [MaybeUninit<f32>])
    })
}

/// [`round_into`] an initialised buffer.
pub(crate) fn round_to(x: &[f32], out: &mut [u16]) {
    // SAFETY: as in [`widen_to`].
    round_into(x, unsafe {
        &mut *(out as *mut [u16] as *mut [MaybeUninit<u16>])
    })
}
