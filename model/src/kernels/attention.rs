//! Causal multi-head self-attention on the packed `[B, T, 3d]` q/k/v projection, forward and
//! backward, without materialising the heads.
//!
//! Each (sequence, head) is one task: the scores of its `T` queries live in one `T x T`
//! buffer, the softmax runs in place, and the output is written straight into the `[B, T, d]`
//! layout the output projection reads. Only the saved log-sum-exp of each query's row goes
//! from forward to backward, which recomputes the probabilities (as flash attention does).
//! Query rows go in blocks of [`BLOCK`], and every product of a block (scores, output and
//! their gradients) multiplies only the keys it can see, or, for a block of keys, only the
//! queries that see it, so causal masking skips the upper triangle instead of computing and
//! discarding it.

use rayon::prelude::*;

use super::bf16::{Precision, product_in};
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

/// A pointer that parallel tasks write through, each to its own disjoint elements.
#[derive(Clone, Copy)]
struct Shared(*mut f32);
impl Shared {
    /// The pointer (a method, so that closures capture the `Sync` wrapper, not the field).
    fn get(self) -> *mut f32 {
        self.0
    }
}

// SAFETY: every task writes a disjoint set of elements (its own head's columns).
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

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
/// `q` and `k` address `T` rows of stride `3d` and `hd` columns each.
unsafe fn causal_scores(how: Precision, dims: Dims, q: *const f32, k: *const f32, s: &mut [f32]) {
    let (t, rs) = (dims.t, 3 * dims.d() as isize);
    for r0 in (0..t).step_by(BLOCK) {
        let r1 = (r0 + BLOCK).min(t);
        // SAFETY: rows r0..r1 of q, rows 0..r1 of k, and s[r0 * t..r1 * t] are in bounds.
        unsafe {
            product_in(
                how,
                [r1 - r0, r1, dims.hd],
                (s[r0 * t..].as_mut_ptr(), t as isize),
                (q.add(r0 * 3 * dims.d()), [rs, 1]),
                (k, [1, rs]),
                dims.scale(),
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
    let out_ptr = Shared(out.as_mut_ptr());
    // One score buffer per piece of rayon's split, reused by its tasks.
    let scratch = || vec![0.0f32; t * t];
    lse.par_chunks_mut(t)
        .enumerate()
        .for_each_init(scratch, |s, (task, lse)| {
            let q = qkv[dims.qkv_base(task)..].as_ptr();
            // SAFETY: q, k, v are this task's head within qkv (its length is B T 3d).
            unsafe { causal_scores(how, dims, q, q.add(d), s) };
            for (i, (row, lse)) in s.chunks_exact_mut(t).zip(lse.iter_mut()).enumerate() {
                softmax_row(row, i, lse);
            }
            // O = P V, per query block against the values it sees.
            let o = out_ptr.get().wrapping_add(dims.out_base(task));
            for r0 in (0..t).step_by(BLOCK) {
                let r1 = (r0 + BLOCK).min(t);
                // SAFETY: the output block of this head is T rows of stride d, hd columns,
                // and no other task writes it; rows 0..r1 of v are within qkv.
                unsafe {
                    product_in(
                        how,
                        [r1 - r0, dims.hd, r1],
                        (o.add(r0 * d), d as isize),
                        (s[r0 * t..].as_ptr(), [t as isize, 1]),
                        (q.add(2 * d), [3 * d as isize, 1]),
                        1.0,
                        false,
                        false,
                    );
                }
            }
        });
    (out, lse)
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
    let Dims { b, t, hd, .. } = dims;
    let d = dims.d();
    let mut dqkv = super::zeros(b * t * 3 * d);
    let dqkv_ptr = Shared(dqkv.as_mut_ptr());
    let (rs3, rs, t_s) = (3 * d as isize, d as isize, t as isize);
    // Probability and score-gradient buffers per piece of rayon's split.
    let scratch = || (vec![0.0f32; t * t], vec![0.0f32; t * t]);
    lse.par_chunks(t)
        .enumerate()
        .for_each_init(scratch, |(p, dp), (task, lse)| {
            let base = dims.qkv_base(task);
            let q = qkv[base..].as_ptr();
            let (k, v) = (q.wrapping_add(d), q.wrapping_add(2 * d));
            let ob = dims.out_base(task);
            let dout_h = dout[ob..].as_ptr();
            // SAFETY: all pointers address this task's head: T rows of hd columns, within
            // their buffers; the three gradient blocks are written by this task only.
            unsafe {
                causal_scores(how, dims, q, k, p);
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
                        (dout_h.add(r0 * d), [rs, 1]),
                        (v, [1, rs3]),
                        1.0,
                        false,
                        false,
                    );
                }
                for (i, (p_row, dp_row)) in
                    p.chunks_exact(t).zip(dp.chunks_exact_mut(t)).enumerate()
                {
                    let row = ob + i * d;
                    let delta = dot(&dout[row..row + hd], &out[row..row + hd]);
                    score_gradient_row(&p_row[..=i], &mut dp_row[..=i], delta);
                    dp_row[i + 1..].fill(0.0);
                }
                let dq = dqkv_ptr.get().add(base);
                for b0 in (0..t).step_by(BLOCK) {
                    let b1 = (b0 + BLOCK).min(t);
                    // As queries, rows b0..b1 see keys 0..b1: dQ = dS K / sqrt(hd).
                    product_in(
                        how,
                        [b1 - b0, hd, b1],
                        (dq.add(b0 * 3 * d), rs3),
                        (dp[b0 * t..].as_ptr(), [t_s, 1]),
                        (k, [rs3, 1]),
                        dims.scale(),
                        false,
                        false,
                    );
                    // As keys, rows b0..b1 are seen by queries b0..t: dV = P^T dO and
                    // dK = dS^T Q / sqrt(hd) over those queries.
                    let seen = b0 * t + b0;
                    product_in(
                        how,
                        [b1 - b0, hd, t - b0],
                        (dq.add(2 * d + b0 * 3 * d), rs3),
                        (p[seen..].as_ptr(), [1, t_s]),
                        (dout_h.add(b0 * d), [rs, 1]),
                        1.0,
                        false,
                        false,
                    );
                    product_in(
                        how,
                        [b1 - b0, hd, t - b0],
                        (dq.add(d + b0 * 3 * d), rs3),
                        (dp[seen..].as_ptr(), [1, t_s]),
                        (q.add(b0 * 3 * d), [rs3, 1]),
                        dims.scale(),
                        false,
                        false,
                    );
                }
            }
        });
    dqkv
}
