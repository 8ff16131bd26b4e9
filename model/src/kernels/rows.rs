//! Row-wise kernels on f32 slices: GELU (tanh form), LayerNorm and softmax cross-entropy,
//! each forward and backward in one pass over memory instead of a chain of element-wise
//! tensor ops; GELU also on bf16 bits. Work is split in fixed-size pieces, so results do not
//! depend on the number of threads.

use std::cell::RefCell;
use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::bf16::filled;
use super::bits::{bits_of, round_into, round_to, value_of, widen_to};
use super::simd::{LANES, dot, dot3, exp, max, multiversion, sum};

/// Elements per parallel piece of an element-wise kernel.
const PIECE: usize = 1 << 14;
/// Rows per parallel piece of a row kernel.
const ROWS: usize = 16;

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_A: f32 = 0.044715;

/// GELU of one value (tanh form).
#[inline(always)]
fn gelu_of(x: f32) -> f32 {
    let u2 = (x + x * x * x * GELU_A) * (2.0 * SQRT_2_OVER_PI);
    x * (1.0 / (1.0 + exp(-u2)))
}

/// The gradient of [`gelu_of`] at `x` times `dy`.
#[inline(always)]
fn gelu_grad_of(x: f32, dy: f32) -> f32 {
    let x2 = x * x;
    let u2 = (x + x2 * x * GELU_A) * (2.0 * SQRT_2_OVER_PI);
    let s = 1.0 / (1.0 + exp(-u2));
    let du2 = (1.0 + x2 * (3.0 * GELU_A)) * (2.0 * SQRT_2_OVER_PI);
    dy * (s + x * s * (1.0 - s) * du2)
}

multiversion! {
    fn gelu_piece(x: &[f32], y: &mut [MaybeUninit<f32>]) {
        for (y, &x) in y.iter_mut().zip(x) {
            y.write(gelu_of(x));
        }
    }
}

multiversion! {
    fn gelu_piece_bf16(x: &[u16], y: &mut [MaybeUninit<u16>]) {
        for (y, &x) in y.iter_mut().zip(x) {
            y.write(bits_of(gelu_of(value_of(x))));
        }
    }
}

multiversion! {
    fn gelu_backward_piece(x: &[f32], dy: &[f32], dx: &mut [MaybeUninit<f32>]) {
        for ((dx, &x), &dy) in dx.iter_mut().zip(x).zip(dy) {
            dx.write(gelu_grad_of(x, dy));
        }
    }
}

multiversion! {
    fn gelu_backward_piece_bf16(x: &[u16], dy: &[u16], dx: &mut [MaybeUninit<u16>]) {
        for ((dx, &x), &dy) in dx.iter_mut().zip(x).zip(dy) {
            dx.write(bits_of(gelu_grad_of(value_of(x), value_of(dy))));
        }
    }
}

/// GELU with the tanh approximation, `x sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))`.
pub(crate) fn gelu(x: &[f32]) -> Vec<f32> {
    filled(x.len(), |y| {
        y.par_chunks_mut(PIECE)
            .zip(x.par_chunks(PIECE))
            .for_each(|(y, x)| gelu_piece(x, y))
    })
}

/// [`gelu`] of bf16 bits, rounded to bf16 bits: in one pass, the bits of widening, [`gelu`]
/// and rounding.
pub(crate) fn gelu_bf16(x: &[u16]) -> Vec<u16> {
    filled(x.len(), |y| {
        y.par_chunks_mut(PIECE)
            .zip(x.par_chunks(PIECE))
            .for_each(|(y, x)| gelu_piece_bf16(x, y))
    })
}

/// The gradient of [`gelu`] at `x` times `dy`.
pub(crate) fn gelu_backward(x: &[f32], dy: &[f32]) -> Vec<f32> {
    filled(x.len(), |dx| {
        dx.par_chunks_mut(PIECE)
            .zip(x.par_chunks(PIECE).zip(dy.par_chunks(PIECE)))
            .for_each(|(dx, (x, dy))| gelu_backward_piece(x, dy, dx))
    })
}

/// [`gelu_backward`] of bf16 bits, rounded to bf16 bits, in one pass.
pub(crate) fn gelu_backward_bf16(x: &[u16], dy: &[u16]) -> Vec<u16> {
    filled(x.len(), |dx| {
        dx.par_chunks_mut(PIECE)
            .zip(x.par_chunks(PIECE).zip(dy.par_chunks(PIECE)))
            .for_each(|(dx, (x, dy))| gelu_backward_piece_bf16(x, dy, dx))
    })
}

multiversion! {
    fn layer_norm_piece(
        x: &[f32],
        w: &[f32],
        b: &[f32],
        eps: f32,
        y: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
    ) {
        let d = w.len();
        for (((x, y), mean), rstd) in x
            .chunks_exact(d)
            .zip(y.chunks_exact_mut(d))
            .zip(mean.iter_mut())
            .zip(rstd.iter_mut())
        {
            let m = sum(x) / d as f32;
            for (y, &x) in y.iter_mut().zip(x) {
                *y = x - m;
            }
            let r = 1.0 / (dot(y, y) / d as f32 + eps).sqrt();
            for ((y, &w), &b) in y.iter_mut().zip(w).zip(b) {
                *y = *y * r * w + b;
            }
            (*mean, *rstd) = (m, r);
        }
    }
}

/// LayerNorm over rows of `w.len()`: `y = (x - mean) / sqrt(var + eps) * w + b`. Returns
/// `y` and each row's mean and `1 / sqrt(var + eps)` for the backward pass.
pub(crate) fn layer_norm(x: &[f32], w: &[f32], b: &[f32], eps: f32) -> [Vec<f32>; 3] {
    let d = w.len();
    let rows = x.len() / d;
    let (mut y, mut mean, mut rstd) = (super::zeros(x.len()), vec![0.0; rows], vec![0.0; rows]);
    y.par_chunks_mut(ROWS * d)
        .zip(x.par_chunks(ROWS * d))
        .zip(mean.par_chunks_mut(ROWS).zip(rstd.par_chunks_mut(ROWS)))
        .for_each(|((y, x), (mean, rstd))| layer_norm_piece(x, w, b, eps, y, mean, rstd));
    [y, mean, rstd]
}

thread_local! {
    /// This thread's f32 buffers for one piece of rows of a bf16 row kernel, kept between
    /// pieces: allocated per piece (a few per 16 rows), both threads met on the allocator's
    /// one lock and queued there.
    static SCRATCH: RefCell<[Vec<f32>; 3]> = const { RefCell::new([Vec::new(), Vec::new(), Vec::new()]) };
}

/// `f` on this thread's [`SCRATCH`] as three f32 buffers of `len` values each: the first
/// zeroed, the other two as a previous piece left them (for [`widen_to`] to overwrite). `f`
/// runs leaf kernels only (no parallel op), so no other use of them can start inside it.
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32], &mut [f32], &mut [f32]) -> R) -> R {
    SCRATCH.with_borrow_mut(|bufs| {
        for b in bufs.iter_mut() {
            if b.len() < len {
                b.resize(len, 0.0);
            }
        }
        let [a, b, c] = bufs;
        let (a, b, c) = (&mut a[..len], &mut b[..len], &mut c[..len]);
        a.fill(0.0);
        f(a, b, c)
    })
}

/// [`layer_norm`] of bf16 bits, rounded to bf16 bits: each piece of rows widened, normalised
/// and rounded while it is in cache, with the bits of widening the whole input, [`layer_norm`]
/// and rounding.
pub(crate) fn layer_norm_bf16(
    x: &[u16],
    w: &[f32],
    b: &[f32],
    eps: f32,
) -> (Vec<u16>, [Vec<f32>; 2]) {
    let d = w.len();
    assert!(
        d > 0 && x.len().is_multiple_of(d),
        "LayerNorm of {} values over rows of {d}",
        x.len()
    );
    let rows = x.len() / d;
    let (mut mean, mut rstd) = (vec![0.0; rows], vec![0.0; rows]);
    let y = filled(x.len(), |y| {
        y.par_chunks_mut(ROWS * d)
            .zip(x.par_chunks(ROWS * d))
            .zip(mean.par_chunks_mut(ROWS).zip(rstd.par_chunks_mut(ROWS)))
            .for_each(|((y, x), (mean, rstd))| {
                with_scratch(x.len(), |piece, wide, _| {
                    widen_to(x, wide);
                    layer_norm_piece(wide, w, b, eps, piece, mean, rstd);
                    round_into(piece, y);
                })
            })
    });
    (y, [mean, rstd])
}

multiversion! {
    #[allow(clippy::too_many_arguments)]
    fn layer_norm_backward_piece(
        x: &[f32],
        w: &[f32],
        mean: &[f32],
        rstd: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        dw: &mut [f32],
        db: &mut [f32],
    ) {
        let d = w.len();
        for ((((x, dy), dx), &m), &r) in x
            .chunks_exact(d)
            .zip(dy.chunks_exact(d))
            .zip(dx.chunks_exact_mut(d))
            .zip(mean)
            .zip(rstd)
        {
            // dx holds x-hat first, then the gradient.
            for (h, &x) in dx.iter_mut().zip(x) {
                *h = (x - m) * r;
            }
            for ((&h, &dy), (dw, db)) in dx.iter().zip(dy).zip(dw.iter_mut().zip(db.iter_mut())) {
                *dw += dy * h;
                *db += dy;
            }
            // The means over the row of g = dy w and of g x-hat.
            let g_mean = dot(dy, w) / d as f32;
            let gh_mean = dot3(dy, w, dx) / d as f32;
            for ((dx, &dy), &w) in dx.iter_mut().zip(dy).zip(w) {
                *dx = r * (dy * w - g_mean - *dx * gh_mean);
            }
        }
    }
}

/// The gradients of [`layer_norm`] at `x` (with its saved `mean` and `rstd`) times `dy`:
/// `[dx, dw, db]`.
pub(crate) fn layer_norm_backward(
    x: &[f32],
    w: &[f32],
    mean: &[f32],
    rstd: &[f32],
    dy: &[f32],
) -> [Vec<f32>; 3] {
    let d = w.len();
    let mut dx = super::zeros(x.len());
    // One partial dw, db per piece, added in piece order.
    let partials: Vec<(Vec<f32>, Vec<f32>)> = dx
        .par_chunks_mut(ROWS * d)
        .zip(x.par_chunks(ROWS * d).zip(dy.par_chunks(ROWS * d)))
        .zip(mean.par_chunks(ROWS).zip(rstd.par_chunks(ROWS)))
        .map(|((dx, (x, dy)), (mean, rstd))| {
            let (mut dw, mut db) = (vec![0.0; d], vec![0.0; d]);
            layer_norm_backward_piece(x, w, mean, rstd, dy, dx, &mut dw, &mut db);
            (dw, db)
        })
        .collect();
    let (mut dw, mut db) = (vec![0.0; d], vec![0.0; d]);
    for (pw, pb) in partials {
        add_into(&mut dw, &pw);
        add_into(&mut db, &pb);
    }
    [dx, dw, db]
}

/// [`layer_norm_backward`] at bf16 `x` times bf16 `dy`, `dx` rounded to bf16 bits: each
/// piece of rows widened and its gradient rounded while it is in cache, with the bits of
/// widening both whole, [`layer_norm_backward`] and rounding `dx`.
pub(crate) fn layer_norm_backward_bf16(
    x: &[u16],
    w: &[f32],
    mean: &[f32],
    rstd: &[f32],
    dy: &[u16],
) -> (Vec<u16>, [Vec<f32>; 2]) {
    let d = w.len();
    assert!(
        d > 0 && x.len().is_multiple_of(d) && dy.len() == x.len(),
        "LayerNorm's gradient of {} values over rows of {d}",
        x.len()
    );
    let mut partials = Vec::new();
    let dx = filled(x.len(), |dx| {
        partials = dx
            .par_chunks_mut(ROWS * d)
            .zip(x.par_chunks(ROWS * d).zip(dy.par_chunks(ROWS * d)))
            .zip(mean.par_chunks(ROWS).zip(rstd.par_chunks(ROWS)))
            .map(|((dx, (x, dy)), (mean, rstd))| {
                let (mut dw, mut db) = (vec![0.0; d], vec![0.0; d]);
                with_scratch(x.len(), |piece, wx, wdy| {
                    widen_to(x, wx);
                    widen_to(dy, wdy);
                    layer_norm_backward_piece(wx, w, mean, rstd, wdy, piece, &mut dw, &mut db);
                    round_into(piece, dx);
                });
                (dw, db)
            })
            .collect::<Vec<_>>();
    });
    let (mut dw, mut db) = (vec![0.0; d], vec![0.0; d]);
    for (pw, pb) in partials {
        add_into(&mut dw, &pw);
        add_into(&mut db, &pb);
    }
    (dx, [dw, db])
}

multiversion! {
    fn add_into(acc: &mut [f32], x: &[f32]) {
        for (a, &x) in acc.iter_mut().zip(x) {
            *a += x;
        }
    }
}

multiversion! {
    fn cross_entropy_piece(logits: &[f32], targets: &[usize], lse: &mut [f32], loss: &mut [f64]) {
        let v = logits.len() / lse.len();
        for (((row, &t), lse), loss) in logits
            .chunks_exact(v)
            .zip(targets)
            .zip(lse.iter_mut())
            .zip(loss.iter_mut())
        {
            let m = max(row);
            let mut s = [0.0f32; LANES];
            let chunks = row.chunks_exact(LANES);
            let rest = chunks.remainder();
            for c in chunks {
                for l in 0..LANES {
                    s[l] += exp(c[l] - m);
                }
            }
            for (l, &x) in rest.iter().enumerate() {
                s[l] += exp(x - m);
            }
            *lse = m + sum(&s).ln();
            *loss = (*lse - row[t]) as f64;
        }
    }
}

/// Mean softmax cross-entropy of rows of `logits` against `targets`, and each row's
/// log-sum-exp for the backward pass.
pub(crate) fn cross_entropy(logits: &[f32], targets: &[usize]) -> (f32, Vec<f32>) {
    let rows = targets.len();
    let v = logits.len() / rows;
    let mut lse = vec![0.0; rows];
    let mut losses = vec![0.0f64; rows];
    lse.par_chunks_mut(ROWS)
        .zip(losses.par_chunks_mut(ROWS))
        .zip(logits.par_chunks(ROWS * v).zip(targets.par_chunks(ROWS)))
        .for_each(|((lse, loss), (logits, targets))| {
            cross_entropy_piece(logits, targets, lse, loss)
        });
    ((losses.iter().sum::<f64>() / rows as f64) as f32, lse)
}

/// [`cross_entropy`] of bf16 logits, with its bits: each row widened while it is in cache.
pub(crate) fn cross_entropy_bf16(logits: &[u16], targets: &[usize]) -> (f32, Vec<f32>) {
    let rows = targets.len();
    assert!(
        rows > 0 && logits.len().is_multiple_of(rows),
        "cross-entropy of {} logits over {rows} targets",
        logits.len()
    );
    let v = logits.len() / rows;
    let mut lse = vec![0.0; rows];
    let mut losses = vec![0.0f64; rows];
    lse.par_chunks_mut(ROWS)
        .zip(losses.par_chunks_mut(ROWS))
        .zip(logits.par_chunks(ROWS * v).zip(targets.par_chunks(ROWS)))
        .for_each(|((lse, loss), (logits, targets))| {
            let mut row = vec![0.0; v];
            for (i, bits) in logits.chunks_exact(v).enumerate() {
                widen_to(bits, &mut row);
                let one = i..i + 1;
                cross_entropy_piece(
                    &row,
                    &targets[one.clone()],
                    &mut lse[one.clone()],
                    &mut loss[one],
                );
            }
        });
    ((losses.iter().sum::<f64>() / rows as f64) as f32, lse)
}

multiversion! {
    fn cross_entropy_backward_piece(
        logits: &[f32],
        targets: &[usize],
        lse: &[f32],
        scale: f32,
        dlogits: &mut [f32],
    ) {
        let v = logits.len() / lse.len();
        for (((row, &t), &lse), out) in logits
            .chunks_exact(v)
            .zip(targets)
            .zip(lse)
            .zip(dlogits.chunks_exact_mut(v))
        {
            for (o, &x) in out.iter_mut().zip(row) {
                *o = exp(x - lse) * scale;
            }
            out[t] -= scale;
        }
    }
}

/// The gradient of [`cross_entropy`] with respect to the logits, times `grad` (the loss's
/// gradient): `grad / rows * (softmax(logits) - onehot(targets))`.
pub(crate) fn cross_entropy_backward(
    logits: &[f32],
    targets: &[usize],
    lse: &[f32],
    grad: f32,
) -> Vec<f32> {
    let rows = targets.len();
    let v = logits.len() / rows;
    let scale = grad / rows as f32;
    let mut dlogits = super::zeros(logits.len());
    dlogits
        .par_chunks_mut(ROWS * v)
        .zip(logits.par_chunks(ROWS * v))
        .zip(targets.par_chunks(ROWS).zip(lse.par_chunks(ROWS)))
        .for_each(|((out, logits), (targets, lse))| {
            cross_entropy_backward_piece(logits, targets, lse, scale, out)
        });
    dlogits
}

/// [`cross_entropy_backward`] of bf16 logits, rounded to bf16 bits, with the bits of
/// widening the logits, [`cross_entropy_backward`] and rounding: a row at a time, in cache.
pub(crate) fn cross_entropy_backward_bf16(
    logits: &[u16],
    targets: &[usize],
    lse: &[f32],
    grad: f32,
) -> Vec<u16> {
    let rows = targets.len();
    assert!(
        rows > 0 && logits.len().is_multiple_of(rows),
        "cross-entropy of {} logits over {rows} targets",
        logits.len()
    );
    let v = logits.len() / rows;
    let scale = grad / rows as f32;
    let mut dlogits = vec![0u16; logits.len()];
    dlogits
        .par_chunks_mut(ROWS * v)
        .zip(logits.par_chunks(ROWS * v))
        .zip(targets.par_chunks(ROWS).zip(lse.par_chunks(ROWS)))
        .for_each(|((out, logits), (targets, lse))| {
            let (mut row, mut grad) = (vec![0.0; v], vec![0.0; v]);
            for (i, (bits, out)) in logits
                .chunks_exact(v)
                .zip(out.chunks_exact_mut(v))
                .enumerate()
            {
                widen_to(bits, &mut row);
                let one = i..i + 1;
                cross_entropy_backward_piece(
                    &row,
                    &targets[one.clone()],
                    &lse[one],
                    scale,
                    &mut grad,
                );
                round_to(&grad, out);
            }
        });
    dlogits
}
