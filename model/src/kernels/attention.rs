//! Causal multi-head self-attention on the packed `[B, T, 3d]` q/k/v projection, forward and
//! backward, without materialising the heads.
//!
//! Each (sequence, head) is one task: the scores of its `T` queries live in one `T x T`
//! buffer, the softmax runs in place, and the output is written straight into the `[B, T, d]`
//! layout the output projection reads (on bf16 bits, through the task's own f32 buffer of the
//! head, widened from and rounded into the tensors). Only the saved log-sum-exp of each query's row goes
//! from forward to backward, which recomputes the probabilities (as flash attention does).
//! Query rows go in blocks of [`BLOCK`], and every product of a block (scores, output and
//! their gradients) multiplies only the keys it can see, or, for a block of keys, only the
//! queries that see it, so causal masking skips the upper triangle instead of computing and
//! discarding it.

use rayon::prelude::*;

use super::bf16::{Precision, product_in};
use super::bits::{round_to, widen_to};
use super::product::Out;
use super::simd::{dot, exp, max, multiversion, sum};

/// Query rows per block of the causal score computation.
const BLOCK: usize = 64;

/// Shapes of one attention call: batch, sequence, heads, head width.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub hd: usize,
}

impl Dims {
    fn d(&self) -> usize {
        self.h * self.hd
    }

    fn scale(&self) -> f32 {
        1.0 / (self.hd as f32).sqrt()
    }

    /// Offset of head `head` of sequence `seq`'s query block in the packed projection.
    fn qkv_base(&self, task: usize) -> usize {
        let (seq, head) = (task / self.h, task % self.h);
        seq * self.t * 3 * self.d() + head * self.hd
    }

    /// Offset of head `head` of sequence `seq` in a `[B, T, d]` tensor.
    fn out_base(&self, task: usize) -> usize {
        let (seq, head) = (task / self.h, task % self.h);
        seq * self.t * self.d() + head * self.hd
    }
}

multiversion! {
    /// Softmax of `row[..=i]` in place, zeros after it; returns the row's log-sum-exp.
    fn softmax_row(row: &mut [f32], i: usize, lse: &mut f32) {
        let (seen, unseen) = row.split_at_mut(i + 1);
        let m = max(seen);
        for x in seen.iter_mut() {
            *x = exp(*x - m);
        }
        let s = sum(seen);
        let inv = 1.0 / s;
        for x in seen.iter_mut() {
            *x *= inv;
        }
        unseen.fill(0.0);
        *lse = m + s.ln();
    }
}

multiversion! {
    /// Probabilities `exp(s - lse)` of `row[..=i]` in place, zeros after it.
    fn probabilities_row(row: &mut [f32], i: usize, lse: f32) {
        let (seen, unseen) = row.split_at_mut(i + 1);
        for x in seen.iter_mut() {
            *x = exp(*x - lse);
        }
        unseen.fill(0.0);
    }
}

multiversion! {
    /// `dp = p * (dp - delta)` over the row: the gradient of the scores.
    fn score_gradient_row(p: &[f32], dp: &mut [f32], delta: f32) {
        for (dp, &p) in dp.iter_mut().zip(p) {
            *dp = p * (*dp - delta);
        }
    }
}

/// Scaled scores `Q K^T / sqrt(hd)` of every query block against the keys it sees, into
/// `s` (`T x T`, row-major); entries right of a block's last key are left as they were.
///
/// # Safety
/// `head`'s q and k address `T` rows and `hd` columns each.
unsafe fn causal_scores(how: Precision, dims: Dims, head: Head, s: &mut [f32]) {
    let (t, rs) = (dims.t, head.stride);
    let (q, k) = (head.q, head.k);
    for r0 in (0..t).step_by(BLOCK) {
        let r1 = (r0 + BLOCK).min(t);
        // SAFETY: rows r0..r1 of q, rows 0..r1 of k, and s[r0 * t..r1 * t] are in bounds.
        unsafe {
            product_in(
                how,
                [r1 - r0, r1, dims.hd],
                (s[r0 * t..].as_mut_ptr(), t as isize),
                (q.offset(r0 as isize * rs), [rs, 1]),
                (k, [1, rs]),
                dims.scale(),
                false,
                false,
            );
        }
    }
}

/// One (sequence, head) of a head's queries, keys and values: `T` rows each at `q`, `k`,
/// `v`, a row stride apart, `hd` columns.
#[derive(Clone, Copy)]
struct Head {
    q: *const f32,
    k: *const f32,
    v: *const f32,
    stride: isize,
}

impl Head {
    /// The head of `task` in the packed projection at `qkv`.
    fn packed(qkv: *const f32, dims: Dims, task: usize) -> Head {
        let (q, d) = (qkv.wrapping_add(dims.qkv_base(task)), dims.d());
        Head {
            q,
            k: q.wrapping_add(d),
            v: q.wrapping_add(2 * d),
            stride: 3 * d as isize,
        }
    }

    /// A head whose `T` rows of q, k and v lie side by side at `buf` (`[T, 3hd]`; a pointer
    /// from a mutable borrow where the head is written, as gradients are).
    fn side_by_side(buf: *const f32, dims: Dims) -> Head {
        let (q, hd) = (buf, dims.hd);
        Head {
            q,
            k: q.wrapping_add(hd),
            v: q.wrapping_add(2 * hd),
            stride: 3 * hd as isize,
        }
    }
}

/// The head of `task` in the packed bf16 projection `qkv`, widened into `buf` (`[T, 3hd]`).
fn widen_head(qkv: &[u16], dims: Dims, task: usize, buf: &mut [f32]) {
    let (d, hd) = (dims.d(), dims.hd);
    let base = dims.qkv_base(task);
    for (i, row) in buf.chunks_exact_mut(3 * hd).enumerate() {
        for (part, out) in row.chunks_exact_mut(hd).enumerate() {
            let at = base + i * 3 * d + part * d;
            widen_to(&qkv[at..at + hd], out);
        }
    }
}

/// The attention output of one head into `o` (`T` rows `o_stride` apart, `hd` columns) and
/// each query's log-sum-exp into `lse`, with `s` (`T x T`) for the scores.
///
/// # Safety
/// `head` addresses its `T` rows, `o` its `T` rows, written by this caller only.
unsafe fn forward_head(
    how: Precision,
    dims: Dims,
    head: Head,
    (o, o_stride): (*mut f32, usize),
    s: &mut [f32],
    lse: &mut [f32],
) {
    let t = dims.t;
    // SAFETY: as the caller guarantees.
    unsafe { causal_scores(how, dims, head, s) };
    for (i, (row, lse)) in s.chunks_exact_mut(t).zip(lse.iter_mut()).enumerate() {
        softmax_row(row, i, lse);
    }
    // O = P V, per query block against the values it sees.
    for r0 in (0..t).step_by(BLOCK) {
        let r1 = (r0 + BLOCK).min(t);
        // SAFETY: rows r0..r1 of the output and rows 0..r1 of v are in bounds.
        unsafe {
            product_in(
                how,
                [r1 - r0, dims.hd, r1],
                (o.add(r0 * o_stride), o_stride as isize),
                (s[r0 * t..].as_ptr(), [t as isize, 1]),
                (head.v, [head.stride, 1]),
                1.0,
                false,
                false,
            );
        }
    }
}

/// Causal attention of the packed projection `qkv` (`[B, T, 3d]`, heads side by side in each
/// of q, k, v). Returns the output in `[B, T, d]` and each query's log-sum-exp (`[B, H, T]`).
/// With [`Precision::Bf16`] both products round their operands (the probabilities too) to
/// bf16; the softmax is f32.
pub(crate) fn forward(qkv: &[f32], dims: Dims, how: Precision) -> (Vec<f32>, Vec<f32>) {
    let Dims { b, t, h, .. } = dims;
    let d = dims.d();
    let mut out = super::zeros(b * t * d);
    let mut lse = vec![0.0f32; b * h * t];
    let out_ptr = Out(out.as_mut_ptr());
    // One score buffer per piece of rayon's split, reused by its tasks.
    let scratch = || vec![0.0f32; t * t];
    lse.par_chunks_mut(t)
        .enumerate()
        .for_each_init(scratch, |s, (task, lse)| {
            let head = Head::packed(qkv.as_ptr(), dims, task);
            let o = out_ptr.get().wrapping_add(dims.out_base(task));
            // SAFETY: the head lies within qkv (its length is B T 3d); its output block is
            // T rows of stride d, hd columns, and no other task writes it.
            unsafe { forward_head(how, dims, head, (o, d), s, lse) };
        });
    (out, lse)
}

/// [`forward`] of a bf16 projection, in bf16 bits, with the bits of widening `qkv`,
/// [`forward`] in [`Precision::Bf16`] and rounding its output: each head widened and its
/// output rounded by the task that computes it.
pub(crate) fn forward_bf16(qkv: &[u16], dims: Dims) -> (Vec<u16>, Vec<f32>) {
    let Dims { b, t, h, hd } = dims;
    let d = dims.d();
    let mut out = vec![0u16; b * t * d];
    let mut lse = vec![0.0f32; b * h * t];
    let out_ptr = Out(out.as_mut_ptr());
    let scratch = || {
        (
            vec![0.0f32; t * t],
            vec![0.0f32; t * 3 * hd],
            vec![0.0f32; t * hd],
        )
    };
    lse.par_chunks_mut(t)
        .enumerate()
        .for_each_init(scratch, |(s, buf, o), (task, lse)| {
            widen_head(qkv, dims, task, buf);
            let head = Head::side_by_side(buf.as_ptr(), dims);
            // SAFETY: the head and the output are this task's own buffers.
            unsafe { forward_head(Precision::Bf16, dims, head, (o.as_mut_ptr(), hd), s, lse) };
            let at = out_ptr.get().wrapping_add(dims.out_base(task));
            for (i, row) in o.chunks_exact(hd).enumerate() {
                // SAFETY: row i of this head's output block (hd of the d columns of row i
                // of its sequence) is in bounds, and no other task writes it.
                let to = unsafe { std::slice::from_raw_parts_mut(at.add(i * d), hd) };
                round_to(row, to);
            }
        });
    (out, lse)
}

/// The gradients of one head's q, k and v into `grad` (laid out as `head`), given its output
/// `out` and the output's gradient `dout` (`T` rows `o_stride` apart, `hd` columns) and each
/// query's saved log-sum-exp, with `p` and `dp` (`T x T`) for the probabilities and their
/// gradients.
///
/// # Safety
/// Every pointer addresses its `T` rows; `grad`'s are written by this caller only.
#[allow(clippy::too_many_arguments)]
unsafe fn backward_head(
    how: Precision,
    dims: Dims,
    head: Head,
    (out, dout, o_stride): (*const f32, *const f32, usize),
    lse: &[f32],
    grad: Head,
    p: &mut [f32],
    dp: &mut [f32],
) {
    let (t, hd) = (dims.t, dims.hd);
    let (rs3, rs, t_s) = (head.stride, o_stride as isize, t as isize);
    let (q, k, v) = (head.q, head.k, head.v);
    let (dq, dk, dv, gs) = (
        grad.q.cast_mut(),
        grad.k.cast_mut(),
        grad.v.cast_mut(),
        grad.stride,
    );
    // SAFETY: as the caller guarantees.
    unsafe {
        causal_scores(how, dims, head, p);
        for (i, row) in p.chunks_exact_mut(t).enumerate() {
            probabilities_row(row, i, lse[i]);
        }
        // dP = dO V^T, per query block against the keys it sees.
        for r0 in (0..t).step_by(BLOCK) {
            let r1 = (r0 + BLOCK).min(t);
            product_in(
                how,
                [r1 - r0, r1, hd],
                (dp[r0 * t..].as_mut_ptr(), t_s),
                (dout.add(r0 * o_stride), [rs, 1]),
                (v, [1, rs3]),
                1.0,
                false,
                false,
            );
        }
        for (i, (p_row, dp_row)) in p.chunks_exact(t).zip(dp.chunks_exact_mut(t)).enumerate() {
            let row = i * o_stride;
            let (dout_row, out_row) = (
                std::slice::from_raw_parts(dout.add(row), hd),
                std::slice::from_raw_parts(out.add(row), hd),
            );
            let delta = dot(dout_row, out_row);
            score_gradient_row(&p_row[..=i], &mut dp_row[..=i], delta);
            dp_row[i + 1..].fill(0.0);
        }
        for b0 in (0..t).step_by(BLOCK) {
            let b1 = (b0 + BLOCK).min(t);
            let (b0s, seen) = (b0 as isize, b0 * t + b0);
            // As queries, rows b0..b1 see keys 0..b1: dQ = dS K / sqrt(hd).
            product_in(
                how,
                [b1 - b0, hd, b1],
                (dq.offset(b0s * gs), gs),
                (dp[b0 * t..].as_ptr(), [t_s, 1]),
                (k, [rs3, 1]),
                dims.scale(),
                false,
                false,
            );
            // As keys, rows b0..b1 are seen by queries b0..t: dV = P^T dO and
            // dK = dS^T Q / sqrt(hd) over those queries.
            product_in(
                how,
                [b1 - b0, hd, t - b0],
                (dv.offset(b0s * gs), gs),
                (p[seen..].as_ptr(), [1, t_s]),
                (dout.add(b0 * o_stride), [rs, 1]),
                1.0,
                false,
                false,
            );
            product_in(
                how,
                [b1 - b0, hd, t - b0],
                (dk.offset(b0s * gs), gs),
                (dp[seen..].as_ptr(), [1, t_s]),
                (q.offset(b0s * rs3), [rs3, 1]),
                dims.scale(),
                false,
                false,
            );
        }
    }
}

/// The gradient of [`forward`] with respect to `qkv`, given its output `out`, the saved
/// `lse` and the output's gradient `dout` (`[B, T, d]`). With [`Precision::Bf16`] every
/// product rounds its operands to bf16, the probabilities and their gradients included.
pub(crate) fn backward(
    qkv: &[f32],
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
    dims: Dims,
    how: Precision,
) -> Vec<f32> {
    let Dims { b, t, .. } = dims;
    let d = dims.d();
    let mut dqkv = super::zeros(b * t * 3 * d);
    let dqkv_ptr = Out(dqkv.as_mut_ptr());
    // Probability and score-gradient buffers per piece of rayon's split.
    let scratch = || (vec![0.0f32; t * t], vec![0.0f32; t * t]);
    lse.par_chunks(t)
        .enumerate()
        .for_each_init(scratch, |(p, dp), (task, lse)| {
            let head = Head::packed(qkv.as_ptr(), dims, task);
            let grad = Head::packed(dqkv_ptr.get(), dims, task);
            let ob = dims.out_base(task);
            let (o, dout_h) = (out[ob..].as_ptr(), dout[ob..].as_ptr());
            // SAFETY: all pointers address this task's head: T rows of hd columns, within
            // their buffers; the three gradient blocks are written by this task only.
            unsafe { backward_head(how, dims, head, (o, dout_h, d), lse, grad, p, dp) };
        });
    dqkv
}

/// [`backward`] of a bf16 projection, output and output gradient, in bf16 bits, with the bits
/// of widening them, [`backward`] in [`Precision::Bf16`] and rounding its result: each head
/// widened and its gradients rounded by the task that computes them.
pub(crate) fn backward_bf16(
    qkv: &[u16],
    out: &[u16],
    lse: &[f32],
    dout: &[u16],
    dims: Dims,
) -> Vec<u16> {
    let Dims { b, t, hd, .. } = dims;
    let d = dims.d();
    let mut dqkv = vec![0u16; b * t * 3 * d];
    let dqkv_ptr = Out(dqkv.as_mut_ptr());
    let scratch = || {
        let square = || vec![0.0f32; t * t];
        let rows = |width: usize| vec![0.0f32; t * width];
        (square(), square(), rows(3 * hd), rows(3 * hd), rows(2 * hd))
    };
    lse.par_chunks(t)
        .enumerate()
        .for_each_init(scratch, |(p, dp, buf, grad, od), (task, lse)| {
            widen_head(qkv, dims, task, buf);
            // This head's output and its gradient side by side, rows of 2hd.
            let ob = dims.out_base(task);
            for (i, row) in od.chunks_exact_mut(2 * hd).enumerate() {
                let (o, g) = row.split_at_mut(hd);
                let at = ob + i * d;
                widen_to(&out[at..at + hd], o);
                widen_to(&dout[at..at + hd], g);
            }
            let head = Head::side_by_side(buf.as_ptr(), dims);
            let grads = Head::side_by_side(grad.as_mut_ptr(), dims);
            let (o, g) = (od.as_ptr(), od[hd..].as_ptr());
            // SAFETY: every pointer addresses this task's own buffers.
            unsafe {
                backward_head(
                    Precision::Bf16,
                    dims,
                    head,
                    (o, g, 2 * hd),
                    lse,
                    grads,
                    p,
                    dp,
                )
            };
            let base = dqkv_ptr.get().wrapping_add(dims.qkv_base(task));
            for (i, row) in grad.chunks_exact(3 * hd).enumerate() {
                for (part, from) in row.chunks_exact(hd).enumerate() {
                    // SAFETY: this head's hd columns of q, k or v in row i of its sequence
                    // are in bounds, and no other task writes them.
                    let to = unsafe {
                        std::slice::from_raw_parts_mut(base.add(i * 3 * d + part * d), hd)
                    };
                    round_to(from, to);
                }
            }
        });
    dqkv
}
