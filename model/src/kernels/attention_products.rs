//! Causal attention on CubeCL devices through the device's matrix products: the scores of a
//! group of heads as one batched product (cubek's matmul, on tensor cores where the device has
//! them), the causal softmax as one kernel, and the output as a second product. Backward
//! recomputes the scores from the saved log-sum-exp, as the flash kernels do, and takes the
//! five products of attention's gradient the same way.
//!
//! The flash kernels (`flash.rs`) multiply on a unit's own arithmetic: on an H100 they ran at
//! 6.3 TFLOP/s, where the same card's matmul ran at 141 (`BENCHMARKS.md`). Here the `T x T`
//! scores of a group of heads exist for the length of one call, in f32: the group is as many
//! (sequence, head) pairs as fit [`CubeAttention::Products`]'s byte cap for one score tensor.
//! The backward holds two, the scores and their gradient; in f32 the probabilities and the
//! scores' gradient are written over them, in bf16 and f16 beside them in the tensor's dtype
//! (which the products read). Nothing of it outlives the call: the autodiff graph keeps what the
//! flash kernels keep (the projection, the output and one log-sum-exp per query), and the
//! forward's outputs are those of [`super::flash::FlashOps::flash_forward`] exactly, so either
//! path's backward takes either path's forward.
//!
//! Precision is FlashAttention-2's: every product sums in f32; the scores and their gradient
//! are f32; the probabilities and the scores' gradient are rounded to the tensor's dtype for
//! the products that read them (a no-op in f32), and each result once to the tensor's dtype.
//!
//! A sequence's queries are split in two halves ([`halves`]): the first half's queries see
//! only the first half's keys, so its scores are `T/2 x T/2` and the second half's
//! `T/2 x T`, three quarters of the `T x T` square; the rest of the masked upper triangle is
//! multiplied (and the softmax writes its zeros). The halves' products take views of the
//! group's Q, K and V, and one kernel merges both halves' results.

use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::matmul::{MatmulStrategy, matmul};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

use super::cube::{Ahead, ROW_UNITS, cube_max, cube_sum, elem_type, grid_row, row_cubes};

/// How causal attention runs on CubeCL devices ([`set_cube_attention`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CubeAttention {
    /// ember's flash kernels (`flash.rs`): no `T x T` tensor at any time, every product on
    /// the units' own arithmetic.
    Flash,
    /// The scores and every product through the device's matmul, a group of heads at a time;
    /// one group's f32 `T x T` scores take at most `max_scores_bytes` (and the device's
    /// largest allocation). A sequence whose one head exceeds it takes the flash kernels.
    Products {
        /// The byte cap of one group's f32 scores.
        max_scores_bytes: u64,
    },
}

impl CubeAttention {
    /// Products, with one group's scores up to 512 MiB: gpt2's 8 x 1024 tokens (96 heads of
    /// 4 MiB) in one group.
    pub const PRODUCTS: CubeAttention = CubeAttention::Products {
        max_scores_bytes: 512 << 20,
    };

    /// The attention `EMBER_ATTENTION` names: `products` (the default) or `flash`; `None`
    /// when it is unset. An error names any other value.
    pub fn from_env() -> Result<Option<CubeAttention>, String> {
        match std::env::var("EMBER_ATTENTION") {
            Err(std::env::VarError::NotPresent) => Ok(None),
            Ok(v) if v == "products" => Ok(Some(Self::PRODUCTS)),
            Ok(v) if v == "flash" => Ok(Some(Self::Flash)),
            Ok(v) => Err(format!(
                "EMBER_ATTENTION is {v:?}: set it to `products` (attention through the \
                 device's matrix products, the default) or `flash` (ember's flash kernels), \
                 or unset it"
            )),
            Err(e) => Err(format!("EMBER_ATTENTION: {e}")),
        }
    }
}

/// How [`cube_attention`] answers, as [`scores_cap`] codes it; `u64::MAX` while unset (read
/// from the environment at first use).
static ATTENTION: AtomicU64 = AtomicU64::new(u64::MAX);

/// Sets how causal attention runs on CubeCL devices for the calls made from now on, in the
/// whole process (as PyTorch's `torch.backends.cuda.enable_flash_sdp`); a call's backward runs
/// as its forward did. Both ways compute the same function and keep the same tensors for
/// backward.
pub fn set_cube_attention(attention: CubeAttention) {
    ATTENTION.store(scores_cap(attention).min(u64::MAX - 1), Ordering::Relaxed);
}

/// How causal attention runs on CubeCL devices: as [`set_cube_attention`] last set it, else
/// as `EMBER_ATTENTION` names it, else [`CubeAttention::PRODUCTS`]. An `EMBER_ATTENTION` that
/// names neither (which the `ember` binary refuses at its start) leaves the default.
pub fn cube_attention() -> CubeAttention {
    if ATTENTION.load(Ordering::Relaxed) == u64::MAX {
        let chosen = CubeAttention::from_env().ok().flatten();
        set_cube_attention(chosen.unwrap_or(CubeAttention::PRODUCTS));
    }
    match ATTENTION.load(Ordering::Relaxed) {
        0 => CubeAttention::Flash,
        max_scores_bytes => CubeAttention::Products { max_scores_bytes },
    }
}

/// The `scores_cap` argument of [`super::flash::FlashOps`] for `attention`: 0 for the flash
/// kernels, else the products' byte cap for one group's scores.
pub(crate) fn scores_cap(attention: CubeAttention) -> u64 {
    match attention {
        CubeAttention::Flash => 0,
        CubeAttention::Products { max_scores_bytes } => max_scores_bytes.max(1),
    }
}

/// (sequence, head) pairs per group of the products' path for `tasks` pairs of `t` queries
/// under `scores_cap` ([`scores_cap`]) on a device whose largest allocation is `max_alloc`
/// bytes, or `None` for the flash kernels: where the cap is 0, or one pair's f32 scores exceed
/// it or the largest allocation.
pub(crate) fn group_for(tasks: usize, t: usize, scores_cap: u64, max_alloc: u64) -> Option<usize> {
    if scores_cap == 0 {
        return None;
    }
    let cap = scores_cap.min(max_alloc);
    let one = (t * t * 4) as u64;
    (one <= cap).then(|| ((cap / one) as usize).clamp(1, tasks.max(1)))
}

/// The largest allocation of `t`'s device, in bytes.
pub(crate) fn max_alloc(t: &CubeTensor) -> u64 {
    t.client.properties().memory.max_page_size
}

/// Units per cube of the element-wise kernels.
const UNITS: u32 = 256;

/// The split of a sequence of `t` queries into blocks, each `(first query, queries)`: two
/// halves (the first's a multiple of 16 queries) from 32 queries on, else one block. A
/// block's queries see the keys up to its last query.
pub(crate) fn halves(t: usize) -> Vec<(usize, usize)> {
    if t < 32 {
        return vec![(0, t)];
    }
    let h = t / 2 / 16 * 16;
    vec![(0, h), (h, t - h)]
}

/// Where element `e` of the `[G, T, hd]` heads of the pairs from `first` on lies in a packed
/// `[B, T, parts d]` tensor, in its first `d` columns (pair `b H + h` is head `h` of sequence
/// `b`).
#[cube]
fn packed_index(
    e: usize,
    first: usize,
    seq: usize,
    #[comptime] hd: usize,
    #[comptime] heads: usize,
    #[comptime] parts: usize,
) -> usize {
    let c = e % hd;
    let i = (e / hd) % seq;
    let task = first + e / (hd * seq);
    ((task / heads) * seq + i) * parts * hd * heads + (task % heads) * hd + c
}

/// Q, K and V of the `len / (T hd)` (sequence, head) pairs from `first` on, from the packed
/// `[B, T, 3d]` projection into three `[G, T, hd]` tensors, one unit per element.
#[cube(launch, create_dummy_kernel)]
fn split_qkv_kernel<E: Float>(
    qkv: &Tensor<E>,
    q: &mut Tensor<E>,
    k: &mut Tensor<E>,
    v: &mut Tensor<E>,
    first: usize,
    len: usize,
    seq: usize,
    #[comptime] hd: usize,
    #[comptime] heads: usize,
    #[define(E)] _dtype: ElemType,
) {
    let e = ABSOLUTE_POS;
    if e < len {
        let d = hd * heads;
        let at = packed_index(e, first, seq, hd, heads, 3usize);
        q[e] = qkv[at];
        k[e] = qkv[at + d];
        v[e] = qkv[at + 2 * d];
    }
}

/// The causal softmax of each row of the f32 scores `[G, Q, K]` of a block of `Q` queries
/// from query `q0` on against keys `0..K` (scaled by `scale`) into the probabilities `p` in
/// the tensor's dtype, zeros right of the diagonal, and each row's log-sum-exp into `lse`
/// (`[B H, seq]`, the pairs from `first` on). A cube per row. `in_place` (f32 tensors) writes
/// the probabilities over the scores instead, and leaves `p` alone.
#[cube(launch, create_dummy_kernel)]
fn causal_softmax_kernel<E: Float>(
    s: &mut Tensor<f32>,
    p: &mut Tensor<E>,
    lse: &mut Tensor<f32>,
    first: usize,
    rows: usize,
    queries: usize,
    q0: usize,
    keys: usize,
    seq: usize,
    scale: f32,
    units_now: usize,
    #[comptime] units: usize,
    #[comptime] in_place: bool,
    #[define(E)] _dtype: ElemType,
) {
    let r = grid_row();
    let u = UNIT_POS_X as usize;
    let mut shared = Shared::<[f32]>::new_slice(units);
    let live = r < rows;
    let base = r * keys;
    let i = q0 + r % queries;
    // The row's query sees keys 0..=i.
    let seen = i + 1;

    let mut m = f32::new(-1.0e30);
    if live {
        let mut j = u;
        while j < seen {
            m = max(m, s[base + j] * scale);
            j += units;
        }
    }
    let top = cube_max(m, &mut shared, units_now);
    let mut sum = f32::new(0.0);
    if live {
        let mut j = u;
        while j < seen {
            sum += f32::exp(s[base + j] * scale - top);
            j += units;
        }
    }
    let l = top + f32::ln(cube_sum(sum, &mut shared, units_now));
    if live {
        let mut j = u;
        while j < keys {
            let x = seen_exp(s[base + j] * scale - l, j < seen);
            if in_place {
                s[base + j] = x;
            } else {
                p[base + j] = E::cast_from(x);
            }
            j += units;
        }
        if u == 0 {
            lse[(first + r / queries) * seq + i] = l;
        }
    }
}

/// `exp(x)` for a key the query sees, else 0.
#[cube]
fn seen_exp(x: f32, seen: bool) -> f32 {
    let mut v = f32::new(0.0);
    if seen {
        v = f32::exp(x);
    }
    v
}

/// The heads' outputs into their columns of the `[B, T, d]` output, one unit per element of
/// the group's `[G, T, hd]`: queries below `split` from the first block's `o0`
/// (`[G, split, hd]`), the rest from the second's `o1` (`[G, T - split, hd]`).
#[cube(launch, create_dummy_kernel)]
fn merge_heads_kernel<E: Float>(
    o0: &Tensor<E>,
    o1: &Tensor<E>,
    out: &mut Tensor<E>,
    first: usize,
    len: usize,
    seq: usize,
    split: usize,
    #[comptime] hd: usize,
    #[comptime] heads: usize,
    #[define(E)] _dtype: ElemType,
) {
    let e = ABSOLUTE_POS;
    if e < len {
        let c = e % hd;
        let i = (e / hd) % seq;
        let pair = e / (hd * seq);
        let at = packed_index(e, first, seq, hd, heads, 1usize);
        if i < split {
            out[at] = o0[(pair * split + i) * hd + c];
        } else {
            out[at] = o1[(pair * (seq - split) + i - split) * hd + c];
        }
    }
}

/// The output's gradient `dout` (`[B, T, d]`) of the group's heads into `[G, T, hd]`, and
/// each query's `D = rowsum(dO * O)` in f32, one unit per query.
#[cube(launch, create_dummy_kernel)]
fn output_gradient_kernel<E: Float>(
    out: &Tensor<E>,
    dout: &Tensor<E>,
    d_o: &mut Tensor<E>,
    delta: &mut Tensor<f32>,
    first: usize,
    rows: usize,
    seq: usize,
    #[comptime] hd: usize,
    #[comptime] heads: usize,
    #[define(E)] _dtype: ElemType,
) {
    let r = ABSOLUTE_POS;
    if r < rows {
        let at = packed_index(r * hd, first, seq, hd, heads, 1usize);
        let mut sum = f32::new(0.0);
        #[unroll]
        for c in 0..hd {
            let g = dout[at + c];
            d_o[r * hd + c] = g;
            sum += f32::cast_from(g) * f32::cast_from(out[at + c]);
        }
        delta[r] = sum;
    }
}

/// From the f32 scores `s` and their product with the values `dp` (`[G, Q, K]`, a block of
/// `Q` queries from query `q0` on against keys `0..K`), the probabilities
/// `p = exp(scale s - lse)` and the unscaled scores' gradient `ds = scale p (dp - D)`, both
/// in the tensor's dtype, zeros right of the diagonal (whose scores and `dp` it does not read);
/// `lse` and `D` (`delta`) are `[B H, seq]` and `[G, seq]`. One unit per element. `in_place`
/// (f32 tensors) writes them over `s` and `dp` instead, and leaves `p` and `ds` alone.
#[cube(launch, create_dummy_kernel)]
fn score_gradient_kernel<E: Float>(
    s: &mut Tensor<f32>,
    dp: &mut Tensor<f32>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    p: &mut Tensor<E>,
    ds: &mut Tensor<E>,
    first: usize,
    len: usize,
    queries: usize,
    q0: usize,
    keys: usize,
    seq: usize,
    scale: f32,
    #[comptime] in_place: bool,
    #[define(E)] _dtype: ElemType,
) {
    let e = ABSOLUTE_POS;
    if e < len {
        let r = e / keys;
        let pair = r / queries;
        let i = q0 + r % queries;
        let mut pv = f32::new(0.0);
        let mut g = f32::new(0.0);
        if e % keys <= i {
            pv = f32::exp(s[e] * scale - lse[(first + pair) * seq + i]);
            g = scale * pv * (dp[e] - delta[pair * seq + i]);
        }
        if in_place {
            s[e] = pv;
            dp[e] = g;
        } else {
            p[e] = E::cast_from(pv);
            ds[e] = E::cast_from(g);
        }
    }
}

/// The gradients of Q, K and V into their columns of the `[B, T, 3d]` gradient of the
/// projection, one unit per element of the group's `[G, T, hd]`. Q's: queries below `split`
/// from the first block's `dq0` (`[G, split, hd]`), the rest from the second's `dq1`
/// (`[G, T - split, hd]`). K's and V's, in f32: the sum over the blocks, `dk1` and `dv1`
/// (`[G, T, hd]`, the block that sees every key) plus, for keys below `seen`, `dk0` and `dv0`
/// (`[G, seen, hd]`); rounded once to the tensor's dtype.
#[cube(launch, create_dummy_kernel)]
fn merge_gradients_kernel<E: Float>(
    dq0: &Tensor<E>,
    dq1: &Tensor<E>,
    dk0: &Tensor<f32>,
    dk1: &Tensor<f32>,
    dv0: &Tensor<f32>,
    dv1: &Tensor<f32>,
    dqkv: &mut Tensor<E>,
    first: usize,
    len: usize,
    seq: usize,
    split: usize,
    seen: usize,
    #[comptime] hd: usize,
    #[comptime] heads: usize,
    #[define(E)] _dtype: ElemType,
) {
    let e = ABSOLUTE_POS;
    if e < len {
        let d = hd * heads;
        let c = e % hd;
        let i = (e / hd) % seq;
        let pair = e / (hd * seq);
        let at = packed_index(e, first, seq, hd, heads, 3usize);
        if i < split {
            dqkv[at] = dq0[(pair * split + i) * hd + c];
        } else {
            dqkv[at] = dq1[(pair * (seq - split) + i - split) * hd + c];
        }
        let mut dk = dk1[e];
        let mut dv = dv1[e];
        if i < seen {
            let early = (pair * seen + i) * hd + c;
            dk += dk0[early];
            dv += dv0[early];
        }
        dqkv[at + d] = E::cast_from(dk);
        dqkv[at + 2 * d] = E::cast_from(dv);
    }
}

/// The shapes of one call: sequences, their length, heads and the head width.
#[derive(Clone, Copy)]
struct Dims {
    t: usize,
    heads: usize,
    hd: usize,
}

/// A new contiguous tensor of `shape` in `dtype` on `like`'s device.
fn empty(like: &CubeTensor, shape: [usize; 3], dtype: DType) -> CubeTensor {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::new(shape),
        dtype,
    )
}

/// Whether the probabilities and the scores' gradient of `dtype` are written over the f32
/// scores they come from (f32), rather than into tensors of their own (the products read them
/// in `dtype`).
fn in_place(dtype: DType) -> bool {
    dtype == DType::F32
}

/// The tensor of `dtype` the kernels write probabilities (or the scores' gradient) into, beside
/// the f32 scores `s`: one of `s`'s shape, or, where they are written over `s`, a placeholder
/// of one element that the kernel leaves alone.
fn scores_like(s: &CubeTensor, dtype: DType) -> CubeTensor {
    let shape = if in_place(dtype) {
        [1, 1, 1]
    } else {
        s.meta.shape().dims::<3>()
    };
    empty(s, shape, dtype)
}

/// `lhs rhs` (batched) into `out`, a fresh contiguous tensor: the products sum in f32
/// whatever `out`'s dtype.
fn product(lhs: CubeTensor, rhs: CubeTensor, out: CubeTensor) -> CubeTensor {
    let dtype = out.dtype;
    matmul(lhs, rhs, Some(out), MatmulStrategy::default(), dtype)
        .expect("the device's matmul takes attention's products")
}

/// Rows `from..from + n` of each pair of a `[G, T, hd]` tensor: a view where the device's
/// alignment allows its offsets, else a copy.
fn rows(t: &CubeTensor, from: usize, n: usize) -> CubeTensor {
    let [g, _, hd] = t.meta.shape().dims::<3>();
    burn_cubecl::kernel::slice(t.clone(), &[0..g, from..from + n, 0..hd])
}

/// `t` with its last two dimensions swapped (a view).
fn transposed(mut t: CubeTensor) -> CubeTensor {
    t.meta.swap(1, 2);
    t
}

/// Launch geometry of `len` elements, one unit each.
fn elementwise(client: &cubecl::client::Client, len: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new_1d(UNITS);
    (calculate_cube_count_elemwise(client, len, dim), dim)
}

/// Q, K and V of `g` pairs from `first` on.
fn split(qkv: &CubeTensor, first: usize, g: usize, dims: Dims) -> [CubeTensor; 3] {
    let Dims { t, heads, hd } = dims;
    let [q, k, v] = [(); 3].map(|_| empty(qkv, [g, t, hd], qkv.dtype));
    let len = g * t * hd;
    let (cubes, dim) = elementwise(&qkv.client, len);
    split_qkv_kernel::launch(
        &qkv.client,
        cubes,
        dim,
        qkv.clone().into_tensor_arg(),
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        first,
        len,
        t,
        hd,
        heads,
        elem_type(qkv.dtype),
    );
    [q, k, v]
}

/// The forward of a contiguous packed projection `[B, T, 3d]` in groups of `group` pairs:
/// the output `[B, T, d]` and each query's log-sum-exp `[B, H, T]` in f32.
pub(crate) fn forward(qkv: CubeTensor, heads: usize, group: usize) -> (CubeTensor, CubeTensor) {
    let [b, t, d3] = qkv.meta.shape().dims::<3>();
    let d = d3 / 3;
    let dims = Dims {
        t,
        heads,
        hd: d / heads,
    };
    let dtype = qkv.dtype;
    let client = qkv.client.clone();
    let out = empty(&qkv, [b, t, d], dtype);
    let lse = empty(&qkv, [b, heads, t], DType::F32);
    let scale = (dims.hd as f32).sqrt().recip();
    let tasks = b * heads;
    let blocks = halves(t);
    for first in (0..tasks).step_by(group) {
        let g = group.min(tasks - first);
        let [q, k, v] = split(&qkv, first, g, dims);
        let mut outs = Vec::with_capacity(blocks.len());
        for &(q0, queries) in &blocks {
            let keys = q0 + queries;
            let s = product(
                rows(&q, q0, queries),
                transposed(rows(&k, 0, keys)),
                empty(&qkv, [g, queries, keys], DType::F32),
            );
            let p = scores_like(&s, dtype);
            causal_softmax_kernel::launch(
                &client,
                row_cubes(g * queries),
                CubeDim::new_1d(ROW_UNITS as u32),
                s.clone().into_tensor_arg(),
                p.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                first,
                g * queries,
                queries,
                q0,
                keys,
                t,
                scale,
                ROW_UNITS,
                ROW_UNITS,
                in_place(dtype),
                elem_type(dtype),
            );
            let p = if in_place(dtype) { s } else { p };
            outs.push(product(
                p,
                rows(&v, 0, keys),
                empty(&qkv, [g, queries, dims.hd], dtype),
            ));
        }
        let split_at = blocks[0].1;
        let o1 = outs.last().expect("a block").clone();
        let len = g * t * dims.hd;
        let (cubes, dim) = elementwise(&client, len);
        merge_heads_kernel::launch(
            &client,
            cubes,
            dim,
            outs[0].clone().into_tensor_arg(),
            o1.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            first,
            len,
            t,
            split_at,
            dims.hd,
            heads,
            elem_type(dtype),
        );
    }
    (out, lse)
}

/// The gradient `[B, T, 3d]` of the contiguous packed projection from the forward's output
/// and log-sum-exp and the output's gradient, in groups of `group` pairs.
pub(crate) fn backward(
    qkv: CubeTensor,
    out: CubeTensor,
    lse: CubeTensor,
    dout: CubeTensor,
    heads: usize,
    group: usize,
) -> CubeTensor {
    let [b, t, d3] = qkv.meta.shape().dims::<3>();
    let d = d3 / 3;
    let dims = Dims {
        t,
        heads,
        hd: d / heads,
    };
    let hd = dims.hd;
    let dtype = qkv.dtype;
    let client = qkv.client.clone();
    let dqkv = empty(&qkv, [b, t, d3], dtype);
    let scale = (hd as f32).sqrt().recip();
    let tasks = b * heads;
    let blocks = halves(t);
    for first in (0..tasks).step_by(group) {
        let g = group.min(tasks - first);
        let [q, k, v] = split(&qkv, first, g, dims);
        let d_o = empty(&qkv, [g, t, hd], dtype);
        let delta = empty(&qkv, [g, t, 1], DType::F32);
        let (cubes, dim) = elementwise(&client, g * t);
        output_gradient_kernel::launch(
            &client,
            cubes,
            dim,
            out.clone().into_tensor_arg(),
            dout.clone().into_tensor_arg(),
            d_o.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            first,
            g * t,
            t,
            hd,
            heads,
            elem_type(dtype),
        );
        // Per block: Q's gradient for its queries, K's and V's (in f32) for the keys it sees.
        let mut grads = Vec::with_capacity(blocks.len());
        for &(q0, queries) in &blocks {
            let keys = q0 + queries;
            let (qb, kb, vb) = (rows(&q, q0, queries), rows(&k, 0, keys), rows(&v, 0, keys));
            let dob = rows(&d_o, q0, queries);
            let s = product(
                qb.clone(),
                transposed(kb.clone()),
                empty(&qkv, [g, queries, keys], DType::F32),
            );
            let dp = product(
                dob.clone(),
                transposed(vb),
                empty(&qkv, [g, queries, keys], DType::F32),
            );
            let p = scores_like(&s, dtype);
            let ds = scores_like(&s, dtype);
            let len = g * queries * keys;
            let (cubes, dim) = elementwise(&client, len);
            score_gradient_kernel::launch(
                &client,
                cubes,
                dim,
                s.clone().into_tensor_arg(),
                dp.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                delta.clone().into_tensor_arg(),
                p.clone().into_tensor_arg(),
                ds.clone().into_tensor_arg(),
                first,
                len,
                queries,
                q0,
                keys,
                t,
                scale,
                in_place(dtype),
                elem_type(dtype),
            );
            let (p, ds) = if in_place(dtype) { (s, dp) } else { (p, ds) };
            let dv = product(transposed(p), dob, empty(&qkv, [g, keys, hd], DType::F32));
            let dq = product(ds.clone(), kb, empty(&qkv, [g, queries, hd], dtype));
            let dk = product(transposed(ds), qb, empty(&qkv, [g, keys, hd], DType::F32));
            grads.push((dq, dk, dv));
        }
        // With one block, the second block's tensors are the first's, and no key is seen
        // by an earlier block.
        let split_at = blocks[0].1;
        let seen = if blocks.len() > 1 { split_at } else { 0 };
        let (dq0, dk0, dv0) = grads[0].clone();
        let (dq1, dk1, dv1) = grads.last().expect("a block").clone();
        let len = g * t * hd;
        let (cubes, dim) = elementwise(&client, len);
        merge_gradients_kernel::launch(
            &client,
            cubes,
            dim,
            dq0.into_tensor_arg(),
            dq1.into_tensor_arg(),
            dk0.into_tensor_arg(),
            dk1.into_tensor_arg(),
            dv0.into_tensor_arg(),
            dv1.into_tensor_arg(),
            dqkv.clone().into_tensor_arg(),
            first,
            len,
            t,
            split_at,
            seen,
            hd,
            heads,
            elem_type(dtype),
        );
    }
    dqkv
}

/// The path's six kernels as a gpt2 step launches them ([`Ahead`]), the group being all of
/// the step's 96 heads, the block the second half of the queries.
pub(super) fn ahead(a: &mut Ahead) {
    let (b, t, d, heads) = (Ahead::B, Ahead::T, Ahead::D, Ahead::HEADS);
    let hd = d / heads;
    let g = b * heads;
    let dim = CubeDim::new_1d(UNITS);
    let cubes = |len: usize| row_cubes(len.div_ceil(UNITS as usize));
    let scale = (hd as f32).sqrt().recip();
    let (q0, queries) = *halves(t).last().expect("a block");
    let (heads_len, scores_len) = (g * t * hd, g * queries * t);
    for dtype in Ahead::DTYPES {
        let tensor = |shape: &[usize]| Ahead::tensor(shape, dtype);
        let f32s = |shape: &[usize]| Ahead::tensor(shape, DType::F32);
        let e = elem_type(dtype);
        a.push(format!("split_qkv {dtype:?} hd {hd}"), |device, target| {
            split_qkv_kernel::create_dummy_kernel(
                device,
                target,
                cubes(heads_len),
                dim,
                tensor(&[b, t, 3 * d]),
                tensor(&[g, t, hd]),
                tensor(&[g, t, hd]),
                tensor(&[g, t, hd]),
                0,
                heads_len,
                t,
                hd,
                heads,
                e,
            )
        });
        a.push(format!("causal_softmax {dtype:?}"), |device, target| {
            causal_softmax_kernel::create_dummy_kernel(
                device,
                target,
                row_cubes(g * queries),
                CubeDim::new_1d(ROW_UNITS as u32),
                f32s(&[g, queries, t]),
                tensor(&[g, queries, t]),
                f32s(&[b, heads, t]),
                0,
                g * queries,
                queries,
                q0,
                t,
                t,
                scale,
                ROW_UNITS,
                ROW_UNITS,
                in_place(dtype),
                e,
            )
        });
        a.push(
            format!("merge_heads {dtype:?} hd {hd}"),
            |device, target| {
                merge_heads_kernel::create_dummy_kernel(
                    device,
                    target,
                    cubes(heads_len),
                    dim,
                    tensor(&[g, q0, hd]),
                    tensor(&[g, queries, hd]),
                    tensor(&[b, t, d]),
                    0,
                    heads_len,
                    t,
                    q0,
                    hd,
                    heads,
                    e,
                )
            },
        );
        a.push(
            format!("output_gradient {dtype:?} hd {hd}"),
            |device, target| {
                output_gradient_kernel::create_dummy_kernel(
                    device,
                    target,
                    cubes(g * t),
                    dim,
                    tensor(&[b, t, d]),
                    tensor(&[b, t, d]),
                    tensor(&[g, t, hd]),
                    f32s(&[g, t, 1]),
                    0,
                    g * t,
                    t,
                    hd,
                    heads,
                    e,
                )
            },
        );
        a.push(format!("score_gradient {dtype:?}"), |device, target| {
            score_gradient_kernel::create_dummy_kernel(
                device,
                target,
                cubes(scores_len),
                dim,
                f32s(&[g, queries, t]),
                f32s(&[g, queries, t]),
                f32s(&[b, heads, t]),
                f32s(&[g, t, 1]),
                tensor(&[g, queries, t]),
                tensor(&[g, queries, t]),
                0,
                scores_len,
                queries,
                q0,
                t,
                t,
                scale,
                in_place(dtype),
                e,
            )
        });
        a.push(
            format!("merge_gradients {dtype:?} hd {hd}"),
            |device, target| {
                merge_gradients_kernel::create_dummy_kernel(
                    device,
                    target,
                    cubes(heads_len),
                    dim,
                    tensor(&[g, q0, hd]),
                    tensor(&[g, queries, hd]),
                    f32s(&[g, q0, hd]),
                    f32s(&[g, t, hd]),
                    f32s(&[g, q0, hd]),
                    f32s(&[g, t, hd]),
                    tensor(&[b, t, 3 * d]),
                    0,
                    heads_len,
                    t,
                    q0,
                    q0,
                    hd,
                    heads,
                    e,
                )
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two halves from 32 queries on, the first a multiple of 16, together every query; a
    /// quarter of the `T x T` scores left out at gpt2's 1024.
    #[test]
    fn the_causal_split_covers_every_query_once() {
        assert_eq!(halves(31), vec![(0, 31)]);
        assert_eq!(halves(32), vec![(0, 16), (16, 16)]);
        assert_eq!(halves(70), vec![(0, 32), (32, 38)]);
        assert_eq!(halves(1024), vec![(0, 512), (512, 512)]);
        for t in [1, 5, 31, 32, 33, 47, 70, 129, 300, 1024, 1025] {
            let blocks = halves(t);
            let mut next = 0;
            for &(q0, n) in &blocks {
                assert_eq!(q0, next);
                assert!(n > 0);
                next += n;
            }
            assert_eq!(next, t);
        }
        let scores: usize = halves(1024).iter().map(|&(q0, n)| n * (q0 + n)).sum();
        assert_eq!(scores * 4, 3 * 1024 * 1024);
    }

    /// gpt2's step (96 pairs of 1024 queries, 4 MiB of scores each) is one group under the
    /// default cap; a smaller cap or allocation splits it; a pair over either, or the flash
    /// setting, takes the flash kernels.
    #[test]
    fn groups_hold_as_many_pairs_as_the_cap_and_the_device_allow() {
        let cap = scores_cap(CubeAttention::PRODUCTS);
        assert_eq!(cap, 512 << 20);
        assert_eq!(group_for(96, 1024, cap, u64::MAX), Some(96));
        assert_eq!(group_for(96, 1024, cap, 128 << 20), Some(32));
        assert_eq!(group_for(96, 1024, 4 << 20, u64::MAX), Some(1));
        assert_eq!(group_for(96, 1024, (4 << 20) - 1, u64::MAX), None);
        assert_eq!(group_for(96, 1024, cap, (4 << 20) - 1), None);
        assert_eq!(group_for(1, 11_585, cap, u64::MAX), Some(1));
        assert_eq!(group_for(1, 11_586, cap, u64::MAX), None);
        assert_eq!(scores_cap(CubeAttention::Flash), 0);
        assert_eq!(group_for(96, 1024, 0, u64::MAX), None);
        // A cap of 0 bytes for the products is not the flash setting's 0.
        let tiny = CubeAttention::Products {
            max_scores_bytes: 0,
        };
        assert_eq!(scores_cap(tiny), 1);
        assert_eq!(group_for(96, 1, scores_cap(tiny), u64::MAX), None);
    }
}
