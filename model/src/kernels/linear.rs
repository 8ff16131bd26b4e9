//! `y = x W + b` and its gradients, with the bias folded into the product: the output starts
//! as copies of `b` and the multiply accumulates onto it, so the forward pass writes its
//! output once, and the bias gradient is one pass over `dy`.

use rayon::prelude::*;

use super::product::product;
use super::simd::multiversion;

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
pub(crate) fn forward(x: &[f32], w: &[f32], b: &[f32]) -> Vec<f32> {
    let d_out = b.len();
    let d_in = w.len() / d_out;
    let rows = x.len() / d_in;
    let mut y: Vec<f32> = Vec::with_capacity(rows * d_out);
    for _ in 0..rows {
        y.extend_from_slice(b);
    }
    // SAFETY: x is rows x d_in, w is d_in x d_out, y is rows x d_out, all row-major.
    unsafe {
        product(
            [rows, d_out, d_in],
            (y.as_mut_ptr(), d_out as isize),
            (x.as_ptr(), [d_in as isize, 1]),
            (w.as_ptr(), [d_out as isize, 1]),
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
pub(crate) fn backward(x: &[f32], w: &[f32], dy: &[f32], d_out: usize) -> [Vec<f32>; 3] {
    let d_in = w.len() / d_out;
    let rows = x.len() / d_in;
    // SAFETY (both products): operands as in `forward`; each output is written whole.
    // dx = dy W^T.
    let dx = written_by(rows * d_in, |dx| unsafe {
        product(
            [rows, d_in, d_out],
            (dx, d_in as isize),
            (dy.as_ptr(), [d_out as isize, 1]),
            (w.as_ptr(), [1, d_out as isize]),
            1.0,
            false,
            true,
        )
    });
    // dW = x^T dy.
    let dw = written_by(d_in * d_out, |dw| unsafe {
        product(
            [d_in, d_out, rows],
            (dw, d_out as isize),
            (x.as_ptr(), [1, d_in as isize]),
            (dy.as_ptr(), [d_out as isize, 1]),
            1.0,
            false,
            true,
        )
    });
    // db = the column sums of dy, one partial per piece of rows, added in piece order.
    let partials: Vec<Vec<f32>> = dy
        .par_chunks(ROWS * d_out)
        .map(|piece| {
            let mut acc = vec![0.0; d_out];
            add_rows(&mut acc, piece);
            acc
        })
        .collect();
    let mut db = vec![0.0; d_out];
    for p in partials {
        add_rows(&mut db, &p);
    }
    [dx, dw, db]
}
