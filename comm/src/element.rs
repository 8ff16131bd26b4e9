//! The element types collectives carry (f32, bf16, u8, i8) and how each maps onto MPI.
//! bf16 travels as its 16 raw bits because MPI has no bf16 type; our reductions add it in f32
//! and round back. This file deliberately holds no communicator logic.

use mpi::ffi;

use crate::error::CommError;

/// A bfloat16 value carried as its raw bits (`f32` bits >> 16, rounded to nearest even).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Bf16 {
    /// Rounds an f32 to the nearest bf16 (ties to even); NaN stays a quiet NaN of the same sign.
    pub fn from_f32(x: f32) -> Self {
        let bits = x.to_bits();
        if x.is_nan() {
            return Bf16(((bits >> 16) as u16) | 0x0040);
        }
        let round = 0x7fff + ((bits >> 16) & 1);
        Bf16((bits.wrapping_add(round) >> 16) as u16)
    }

    /// The exact f32 value of this bf16.
    pub fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
}

/// Which element type a buffer holds (for benchmarks and messages).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Dtype {
    /// IEEE single precision.
    F32,
    /// bfloat16, carried as `u16` bits.
    Bf16,
    /// Unsigned byte.
    U8,
    /// Signed byte.
    I8,
}

mod sealed {
    /// Keeps [`super::Element`] closed: a wrong MPI datatype would corrupt memory.
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for super::Bf16 {}
    impl Sealed for u8 {}
    impl Sealed for i8 {}
}

/// An element a collective can carry. Implemented for `f32`, [`Bf16`], `u8` and `i8` only
/// (sealed: a wrong MPI datatype would make MPI write past the buffer).
pub trait Element:
    sealed::Sealed + Copy + Default + PartialEq + std::fmt::Debug + Send + Sync + 'static
{
    /// The runtime tag of this type.
    const DTYPE: Dtype;
    /// The MPI datatype with the same bytes.
    fn mpi_datatype() -> ffi::MPI_Datatype;
    /// Divides a summed buffer by `n` for `Reduce::Mean`; integers refuse, since their sums
    /// wrap and a mean of wrapped values means nothing.
    fn divide(buf: &mut [Self], n: usize) -> Result<(), CommError>;
    /// `acc[i] = acc[i] + x[i]`, as the element's MPI sum computes it (integers wrap; bf16
    /// adds in f32 and rounds back).
    fn add_into(acc: &mut [Self], x: &[Self]);
}

impl Element for f32 {
    const DTYPE: Dtype = Dtype::F32;
    fn mpi_datatype() -> ffi::MPI_Datatype {
        // SAFETY: reading a constant that mpi-sys initialises at link time.
        unsafe { ffi::RSMPI_FLOAT }
    }
    fn divide(buf: &mut [Self], n: usize) -> Result<(), CommError> {
        // Multiply by the reciprocal would round differently from a sequential reference; divide.
        let n = n as f32;
        buf.iter_mut().for_each(|x| *x /= n);
        Ok(())
    }
    fn add_into(acc: &mut [Self], x: &[Self]) {
        acc.iter_mut().zip(x).for_each(|(a, b)| *a += *b);
    }
}

impl Element for Bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
    fn mpi_datatype() -> ffi::MPI_Datatype {
        // SAFETY: as above.
        unsafe { ffi::RSMPI_UINT16_T }
    }
    fn divide(buf: &mut [Self], n: usize) -> Result<(), CommError> {
        let n = n as f32;
        buf.iter_mut()
            .for_each(|x| *x = Bf16::from_f32(x.to_f32() / n));
        Ok(())
    }
    fn add_into(acc: &mut [Self], x: &[Self]) {
        acc.iter_mut()
            .zip(x)
            .for_each(|(a, b)| *a = Bf16::from_f32(a.to_f32() + b.to_f32()));
    }
}

fn integer_mean_refused(ty: &str) -> CommError {
    CommError::Unsupported(format!(
        "mean of {ty} elements: integer sums wrap, so their mean is meaningless; \
         use Reduce::Sum or reduce in f32"
    ))
}

impl Element for u8 {
    const DTYPE: Dtype = Dtype::U8;
    fn mpi_datatype() -> ffi::MPI_Datatype {
        // SAFETY: as above.
        unsafe { ffi::RSMPI_UINT8_T }
    }
    fn divide(_: &mut [Self], _: usize) -> Result<(), CommError> {
        Err(integer_mean_refused("u8"))
    }
    fn add_into(acc: &mut [Self], x: &[Self]) {
        acc.iter_mut()
            .zip(x)
            .for_each(|(a, b)| *a = a.wrapping_add(*b));
    }
}

impl Element for i8 {
    const DTYPE: Dtype = Dtype::I8;
    fn mpi_datatype() -> ffi::MPI_Datatype {
        // SAFETY: as above.
        unsafe { ffi::RSMPI_INT8_T }
    }
    fn divide(_: &mut [Self], _: usize) -> Result<(), CommError> {
        Err(integer_mean_refused("i8"))
    }
    fn add_into(acc: &mut [Self], x: &[Self]) {
        acc.iter_mut()
            .zip(x)
            .for_each(|(a, b)| *a = a.wrapping_add(*b));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(Bf16::from_f32(1.0).0, 0x3f80);
        // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(Bf16::from_f32(1.0 + 1.0 / 256.0).0, 0x3f80);
        // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: rounds up to even.
        assert_eq!(Bf16::from_f32(1.0 + 3.0 / 256.0).0, 0x3f82);
        assert!(Bf16::from_f32(f32::NAN).to_f32().is_nan());
        assert_eq!(Bf16::from_f32(f32::INFINITY).to_f32(), f32::INFINITY);
        assert_eq!(Bf16::from_f32(-2.5).to_f32(), -2.5);
    }

    #[test]
    fn integer_means_are_refused_with_advice() {
        let err = u8::divide(&mut [1, 2], 2).unwrap_err().to_string();
        assert!(err.contains("Reduce::Sum"), "{err}");
    }
}
