//! `y = x W + b` and its gradients, with the bias folded into the product: in f32 on CPUs
//! with AVX-512 the product adds `b` as it stores its first sums, elsewhere the output starts
//! as copies of `b` and the multiply accumulates onto it (the same bits), and the bias
//! gradient is one pass over `dy`.

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
    if let (Precision::F32, Matrix::F32(x), Matrix::F32(w)) = (how, x, w)
        && product::folds_bias()
    {
        // The bias added by the product's first stores: the same bits, without a pass
        // that writes the output before the product reads it.
        return written_by(rows * d_out, |y| {
            // SAFETY: x is rows x d_in, w is d_in x d_out, y is rows x d_out, all row-major;
            // b holds d_out values; the product folds a bias here.
            unsafe {
                product::product_with_bias(
                    [rows, d_out, d_in],
                    (y, d_out as isize),
                    (x.as_ptr(), [d_in as isize, 1]),
                    (w.as_ptr(), [d_out as isize, 1]),
                    b.as_ptr(),
                    true,
                )
            }
        });
    }
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
    let [dw, db] = weight_gradients(x, dy, [rows, d_in, d_out], how);
    [dx, dw, db]
}

/// [`forward`] of bf16 operands in bf16, its output as bf16 bits rounded as the products
/// finish (the bits of [`forward`] then rounding), where bf16 products round in place
/// ([`bf16::products_round_in_place`]); `None` elsewhere.
pub(crate) fn forward_bits(x: Matrix, w: Matrix, b: &[f32]) -> Option<Vec<u16>> {
    let d_out = b.len();
    let d_in = w.len() / d_out.max(1);
    if !bf16::products_round_in_place() || d_in == 0 || d_out == 0 {
        return None;
    }
    let rows = x.len() / d_in;
    Some(bits_written_by(rows * d_out, |y| {
        // SAFETY: as in `forward`; `y` is rows x d_out.
        unsafe {
            bf16::product_bits(
                [rows, d_out, d_in],
                (y, d_out as isize),
                Some(b),
                (x.src(), [d_in as isize, 1]),
                (w.src(), [d_out as isize, 1]),
                true,
            )
        }
    }))
}

/// [`backward`] in bf16 with `dx` as bf16 bits rounded as its product finishes (the bits of
/// [`backward`]'s `dx` rounded), where bf16 products round in place; `None` elsewhere.
pub(crate) fn backward_bits(
    x: Matrix,
    w: Matrix,
    dy: Matrix,
    d_out: usize,
) -> Option<(Vec<u16>, [Vec<f32>; 2])> {
    let d_in = w.len() / d_out.max(1);
    if !bf16::products_round_in_place() || d_in == 0 || d_out == 0 {
        return None;
    }
    let rows = x.len() / d_in;
    let dx = bits_written_by(rows * d_in, |dx| {
        // SAFETY: as in `backward`.
        unsafe {
            bf16::product_bits(
                [rows, d_in, d_out],
                (dx, d_in as isize),
                None,
                (dy.src(), [d_out as isize, 1]),
                (w.src(), [1, d_out as isize]),
                true,
            )
        }
    });
    let dwdb = weight_gradients(x, dy, [rows, d_in, d_out], Precision::Bf16);
    Some((dx, dwdb))
}

/// A buffer of `len` bf16 bits written entirely by `fill`, which says whether it wrote them.
fn bits_written_by(len: usize, fill: impl FnOnce(*mut u16) -> bool) -> Vec<u16> {
    let mut out = Vec::with_capacity(len);
    assert!(fill(out.as_mut_ptr()), "bf16 products round in place here");
    // SAFETY: `fill` wrote all `len` elements (the product covers the whole output).
    unsafe { out.set_len(len) };
    out
}

/// `[dW, db]` of [`forward`] given `dy`: `dW = x^T dy` and the column sums of `dy`.
fn weight_gradients(
    x: Matrix,
    dy: Matrix,
    [rows, d_in, d_out]: [usize; 3],
    how: Precision,
) -> [Vec<f32>; 2] {
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
    [dw, db]
}

#[cfg(test)]
mod tests {
    use super::{Matrix, backward, backward_bits, forward, forward_bits};
    use crate::kernels::bf16::{self, Precision};
    use crate::kernels::tests::values;

    #[test]
    fn bf16_outputs_rounded_in_place_have_the_bits_of_rounding_after() {
        if !bf16::products_round_in_place() {
            eprintln!("skipped: bf16 products do not round in place here (no AMX tiles)");
            return;
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        // Whole tiles only (their sums start from the bias), edges of tiles and tasks, and an
        // inner dimension long enough to run in blocks (sums held between them), in one task
        // and in several.
        for [rows, d_in, d_out] in [
            [256, 64, 96],
            [1, 1, 1],
            [33, 47, 129],
            [130, 200, 140],
            [70, 2100, 50],
            [200, 2100, 150],
        ] {
            let x = bf16::round(&values(rows * d_in, 31, 2.0));
            let (w16, w32) = (
                bf16::round(&values(d_in * d_out, 32, 0.5)),
                values(d_in * d_out, 33, 0.5),
            );
            let b = values(d_out, 34, 1.0);
            let dy = bf16::round(&values(rows * d_out, 35, 1.0));
            for w in [Matrix::Bf16(&w16), Matrix::F32(&w32)] {
                let case = format!(
                    "{rows} x {d_in} x {d_out}, weight {:?}",
                    matches!(w, Matrix::F32(_))
                );
                let x = Matrix::Bf16(&x);
                let want = bf16::round(&forward(x, w, &b, Precision::Bf16));
                assert_eq!(forward_bits(x, w, &b).unwrap(), want, "{case}: y");
                let [dx, dw, db] = backward(x, w, Matrix::Bf16(&dy), d_out, Precision::Bf16);
                let (dx_bits, [dw_b, db_b]) =
                    backward_bits(x, w, Matrix::Bf16(&dy), d_out).unwrap();
                assert_eq!(dx_bits, bf16::round(&dx), "{case}: dx");
                assert_eq!(
                    (bits(&dw_b), bits(&db_b)),
                    (bits(&dw), bits(&db)),
                    "{case}: dW, db"
                );
            }
        }
    }
}
