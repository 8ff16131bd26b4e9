//! `y = x W + b` and its gradients, with the bias folded into the product: the output starts
//! as copies of `b` and the multiply accumulates onto it, so the forward pass writes its
//! output once, and the bias gradient is one pass over `dy`.

use rayon::prelude::*;

use super::bf16::Precision;
use super::simd::multiversion;
use super::{bf16, product};

/// A row-major matrix's elements: f32 values, or bf16 bits.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Matrix<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl Matrix<'_> {
    fn len(&self) -> usize {
        match self {
            Matrix::F32(v) => v.len(),
            Matrix::Bf16(v) => v.len(),
        }
    }

    fn src(&self) -> bf16::Src {
        match self {
            Matrix::F32(v) => bf16::Src::F32(v.as_ptr()),
            Matrix::Bf16(v) => bf16::Src::Bf16(v.as_ptr()),
        }
    }

    /// Runs `f` on the elements as f32, widening bf16.
    fn with_f32<R>(&self, f: impl FnOnce(&[f32]) -> R) -> R {
        match self {
            Matrix::F32(v) => f(v),
            Matrix::Bf16(v) => f(&bf16::widen(v)),
        }
    }
}

/// [`product::product`] or [`bf16::product`], as `how` says, of row-major operands read
/// with the given [row stride, column stride].
///
/// # Safety
/// As for [`product::product`].
#[allow(clippy::too_many_arguments)]
unsafe fn product(
    how: Precision,
    mnk: [usize; 3],
    dst: (*mut f32, isize),
    (lhs, ls): (Matrix, [isize; 2]),
    (rhs, rs): (Matrix, [isize; 2]),
    beta: f32,
    accumulate: bool,
    parallel: bool,
) {
    // SAFETY (both arms): as the caller guarantees.
    match how {
        Precision::F32 => lhs.with_f32(|l| {
            rhs.with_f32(|r| unsafe {
                product::product(
                    mnk,
                    dst,
                    (l.as_ptr(), ls),
                    (r.as_ptr(), rs),
                    beta,
                    accumulate,
                    parallel,
                )
            })
        }),
        Precision::Bf16 => unsafe {
            bf16::product(
                mnk,
                dst,
                (lhs.src(), ls),
                (rhs.src(), rs),
                beta,
                accumulate,
                parallel,
            )
        },
    }
}

/// Rows per parallel piece of the bias gradient.
const ROWS: usize = 64;

/// An `m x n` buffer written entirely by `fill` before it is read.
fn written_by(len: usize, fill: impl FnOnce(*mut f32)) -> Vec<f32> {
    let mut out = Vec::with_capacity(len);
    fill(out.as_mut_ptr());
    // SAFETY: `fill` wrote all `len` elements (every caller's gemm covers the whole output).
    unsafe { out.set_len(len) };
    out
}

/// `x W + b` for `x` of `rows x d_in`, `w` of `d_in x d_out` (row-major), `b` of `d_out`.
pub(crate) fn forward(x: Matrix, w: Matrix, b: &[f32], how: Precision) -> Vec<f32> {
    let d_out = b.len();
    let d_in = w.len() / d_out;
    let rows = x.len() / d_in;
    // The output starts as copies of `b`, written in parallel pieces of rows.
    let mut y: Vec<f32> = Vec::with_capacity(rows * d_out);
    y.spare_capacity_mut()[..rows * d_out]
        .par_chunks_mut((ROWS * d_out).max(1))
        .for_each(|piece| {
            for row in piece.chunks_exact_mut(d_out.max(1)) {
                for (y, &b) in row.iter_mut().zip(b) {
                    y.write(b);
                }
            }
        });
    // SAFETY: every row was written above.
    unsafe { y.set_len(rows * d_out) };
    // SAFETY: x is rows x d_in, w is d_in x d_out, y is rows x d_out, all row-major.
    unsafe {
        product(
            how,
            [rows, d_out, d_in],
            (y.as_mut_ptr(), d_out as isize),
            (x, [d_in as isize, 1]),
            (w, [d_out as isize, 1]),
            1.0,
            true,
            true,
        );
    }
    y
}

multiversion! {
    fn add_rows(acc: &mut [f32], rows: &[f32]) {
        for row in rows.chunks_exact(acc.len()) {
            for (a, &x) in acc.iter_mut().zip(row) {
                *a += x;
            }
        }
    }
}

/// The gradients of [`forward`] given `dy` (`rows x d_out`): `[dx, dw, db]`.
pub(crate) fn backward(
    x: Matrix,
    w: Matrix,
    dy: Matrix,
    d_out: usize,
    how: Precision,
) -> [Vec<f32>; 3] {
    let d_in = w.len() / d_out;
    let rows = x.len() / d_in;
    // SAFETY (both products): operands as in `forward`; each output is written whole.
    // dx = dy W^T.
    let dx = written_by(rows * d_in, |dx| unsafe {
        product(
            how,
            [rows, d_in, d_out],
            (dx, d_in as isize),
            (dy, [d_out as isize, 1]),
            (w, [1, d_out as isize]),
            1.0,
            false,
            true,
        )
    });
    // dW = x^T dy.
    let dw = written_by(d_in * d_out, |dw| unsafe {
        product(
            how,
            [d_in, d_out, rows],
            (dw, d_out as isize),
            (x, [1, d_in as isize]),
            (dy, [d_out as isize, 1]),
            1.0,
            false,
            true,
        )
    });
    // db = the column sums of dy, one partial per piece of rows, added in piece order.
    let piece_sum = |piece: &[f32]| {
        let mut acc = vec![0.0; d_out];
        add_rows(&mut acc, piece);
        acc
    };
    let partials: Vec<Vec<f32>> = match dy {
        Matrix::F32(dy) => dy.par_chunks(ROWS * d_out).map(piece_sum).collect(),
        Matrix::Bf16(dy) => dy
            .par_chunks(ROWS * d_out)
            .map(|piece| piece_sum(&bf16::widen(piece)))
            .collect(),
    };
    let mut db = vec![0.0; d_out];
    for p in partials {
        add_rows(&mut db, &p);
    }
    [dx, dw, db]
}
