//! The one matrix product the kernels use: `gemm` (the crate flex multiplies with), with
//! every operand given by its row and column strides, so transposed and strided views (a
//! head inside the packed q/k/v projection) are read in place.

/// Products smaller than this many multiply-adds run on one thread.
const PARALLEL_MACS: usize = 1 << 21;

/// `dst = beta * lhs rhs`, or `dst += beta * lhs rhs` when `accumulate`: an `m x k` times
/// `k x n` product. `dst` has unit column stride and row stride `dst.1`; `lhs` and `rhs` are
/// (pointer, [row stride, column stride]). With `parallel`, a large product uses rayon's
/// threads; a caller already inside a parallel task passes `false`.
///
/// # Safety
/// Every addressed element is in bounds; no other thread reads or writes `dst`'s elements.
pub(crate) unsafe fn product(
    [m, n, k]: [usize; 3],
    dst: (*mut f32, isize),
    lhs: (*const f32, [isize; 2]),
    rhs: (*const f32, [isize; 2]),
    beta: f32,
    accumulate: bool,
    parallel: bool,
) {
    let parallelism = if parallel && m * n * k >= PARALLEL_MACS {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    let (dst, dst_rs) = dst;
    let (lhs, [lhs_rs, lhs_cs]) = lhs;
    let (rhs, [rhs_rs, rhs_cs]) = rhs;
    // SAFETY: as the caller guarantees.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs,
            accumulate,
            lhs,
            lhs_cs,
            lhs_rs,
            rhs,
            rhs_cs,
            rhs_rs,
            1.0,
            beta,
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// How a product rounds its operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Precision {
    /// f32 operands.
    F32,
    /// Operands rounded to bf16, products summed in f32 ([`super::bf16::product`]).
    Bf16,
}

/// [`product`] with f32 operands, or [`super::bf16::product`] of them, as `how` says.
///
/// # Safety
/// As for [`product`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn product_in(
    how: Precision,
    mnk: [usize; 3],
    dst: (*mut f32, isize),
    lhs: (*const f32, [isize; 2]),
    rhs: (*const f32, [isize; 2]),
    beta: f32,
    accumulate: bool,
    parallel: bool,
) {
    use super::bf16::{Src, product as bf16_product};
    // SAFETY: as the caller guarantees.
    unsafe {
        match how {
            Precision::F32 => product(mnk, dst, lhs, rhs, beta, accumulate, parallel),
            Precision::Bf16 => bf16_product(
                mnk,
                dst,
                (Src::F32(lhs.0), lhs.1),
                (Src::F32(rhs.0), rhs.1),
                beta,
                accumulate,
                parallel,
            ),
        }
    }
}
