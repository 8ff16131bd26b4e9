//! Causal attention on CubeCL devices (wgpu, CUDA, ROCm) as one kernel forward and two
//! backward, FlashAttention's way: queries and keys in blocks, the softmax kept online, each
//! query's log-sum-exp saved for backward, and no `T x T` tensor anywhere.
//!
//! - Forward: a cube per (query block, head, sequence), a unit per query. Each block of keys
//!   and values is staged in shared memory once for the whole cube; every unit folds it into
//!   its running maximum, sum and output row. Blocks past the diagonal are never read.
//! - Backward, first kernel: a unit per query computes `D = rowsum(dO * O)` (kept for the
//!   second kernel) and `dQ`, sweeping the key blocks up to its own.
//! - Backward, second kernel: two units per key, each holding half of the key's columns of
//!   `k`, `v`, `dK` and `dV`, sweep the query blocks from their own on. Each unit puts its half
//!   of every query's score and `dO . v` in shared memory, and both units add the two halves;
//!   one unit holding all four rows needed more registers than a CUDA thread has, and spilled
//!   in its inner loop (88 local-memory loads and stores per query, `scripts/cuda-kernels`).
//!
//! The loops over a block's queries or keys run at run time (bounded by the cube's size),
//! while those over a head's `hd` columns are unrolled with each unit's rows in registers
//! (unrolled both ways, a unit needed more registers than a CUDA thread has). The staged
//! blocks are read four columns per load (a vector of four f32, the same for every unit of
//! the cube): one shared-memory load per four multiply-adds instead of one per multiply-add,
//! which bounded the kernels. The forward takes four keys at a time, four independent sums
//! instead of one chain of `hd` dependent multiply-adds per score, and keeps its scores
//! against the staged block in shared memory. On the H100 (`BENCHMARKS.md`) the first
//! version, one column and one score at a time, ran at 6.3 TFLOP/s; `scripts/cuda-kernels`
//! gives each kernel's registers, spills and local-memory accesses.
//!
//! The kernels read the packed `[B, T, 3d]` projection in place (q, k and v of head `h` at
//! columns `h hd`, `d + h hd`, `2d + h hd`) and write `[B, T, d]` and `[B, T, 3d]` directly:
//! no split, transpose or concatenation around them. Tensors of any float dtype are read
//! widened to f32, every sum runs in f32, and results are rounded once to the tensor's dtype.
//!
//! Plugged into Burn as the backend extension [`FlashOps`] for CubeCL's backend, its fusion
//! wrapper (the op is opaque to fusion and runs where it is queued) and autodiff (the backward
//! pass above).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::fusion::custom::TensorSpec;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend, TensorMetadata, backend_extension};
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::attention_products as products;
use super::cube::{Ahead, elem_type};

/// Causal attention of a packed projection, forward and backward, on CubeCL devices.
#[backend_extension(Cube, Fusion, Autodiff)]
pub trait FlashOps: Backend {
    /// Causal self-attention of a packed `[B, T, 3d]` projection into `[B, T, d]`, with
    /// `1 / sqrt(d / n_head)` scaling; differentiable where the backend is. `scores_cap` is
    /// how the call runs (`scores_cap`): 0 on the flash kernels, else through the device's
    /// products with a group's f32 scores up to that many bytes.
    #[fusion(default)]
    fn flash_attention(
        qkv: FloatTensor<Self>,
        n_head: usize,
        scores_cap: u64,
    ) -> FloatTensor<Self> {
        Self::flash_forward(qkv, n_head, scores_cap).0
    }

    /// The output `[B, T, d]` and each query's log-sum-exp of its scaled scores, `[B, H, T]`
    /// in f32.
    #[fusion(meta = forward_meta)]
    fn flash_forward(
        qkv: FloatTensor<Self>,
        n_head: usize,
        scores_cap: u64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// The gradient of the packed projection, `[B, T, 3d]`, from the forward's output and
    /// log-sum-exp and the output's gradient.
    #[fusion(dtype = qkv, shape = qkv)]
    fn flash_backward(
        qkv: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        n_head: usize,
        scores_cap: u64,
    ) -> FloatTensor<Self>;
}

/// The forward's outputs, described before it runs.
fn forward_meta(qkv: &TensorSpec, n_head: &usize, _: &u64) -> (TensorSpec, TensorSpec) {
    let (b, t, d) = split_dims(&qkv.shape, *n_head);
    (
        TensorSpec::new(Shape::new([b, t, d]), qkv.dtype),
        TensorSpec::new(Shape::new([b, *n_head, t]), DType::F32),
    )
}

/// `(B, T, d)` of a packed `[B, T, 3d]` projection split into `n_head` heads.
fn split_dims(shape: &Shape, n_head: usize) -> (usize, usize, usize) {
    let [b, t, d3] = shape.dims::<3>();
    assert!(
        d3 % 3 == 0 && (d3 / 3) % n_head == 0 && (d3 / 3 / n_head).is_multiple_of(8),
        "flash attention takes a [B, T, 3d] projection whose d splits into {n_head} heads of \
         a multiple of 8 columns, not [{b}, {t}, {d3}]"
    );
    (b, t, d3 / 3)
}

/// Queries (and keys) per block, one unit each: the most, up to 64, whose blocks fit 32 KiB
/// of shared memory (what lavapipe and Metal allow): two `block x hd` blocks of f32 in every
/// kernel, and the forward's `block x (block + 1)` scores (more than the backward's two
/// statistics per query). Always a multiple of 4: the kernels take keys (or queries) four or
/// two at a time.
fn block_for(hd: usize) -> usize {
    [64, 32, 16, 8]
        .into_iter()
        .find(|b| (2 * b * hd + b * (b + 1)) * 4 <= 32 * 1024)
        .unwrap_or(4)
}

/// Keys (and queries) per block of the `dK`/`dV` kernel, two units per key: the most, up to
/// 64, whose query and output-gradient blocks and the `2 x block x block` partial scores and
/// products fit 32 KiB.
fn dkdv_block_for(hd: usize) -> usize {
    [64, 32, 16, 8]
        .into_iter()
        .find(|b| (2 * b * hd + 4 * b * b) * 4 <= 32 * 1024)
        .unwrap_or(4)
}

/// Four f32 lanes: the staged blocks are read four columns per load, each load broadcast to
/// every unit of the cube.
type V4 = Vector<f32, Const<4>>;

/// Columns `at..at + hd` of the packed projection, widened to f32 and multiplied by `scale`,
/// as `hd / 4` vectors from `slot` of `to`.
#[cube]
fn stage_row<E: Float>(
    qkv: &Tensor<E>,
    to: &mut Shared<[V4]>,
    slot: usize,
    at: usize,
    scale: f32,
    #[comptime] hd: usize,
) {
    #[unroll]
    for c4 in 0..hd / 4 {
        let mut x = V4::empty();
        #[unroll]
        for k in 0..4 {
            x.insert(k, f32::cast_from(qkv[at + c4 * 4 + k]) * scale);
        }
        to[slot + c4] = x;
    }
}

/// `score` where `live`, else a score no real one reaches: masked keys take it, so `exp` of it
/// against any real maximum is 0 (a finite value: WGSL forbids infinite constants).
#[cube]
fn masked(score: f32, live: bool) -> f32 {
    let mut x = f32::new(-1.0e30);
    if live {
        x = score;
    }
    x
}

/// `a . row`: the `hd` columns of `a` (registers) against the staged row of `hd / 4` vectors
/// at `at`, summed in column order.
#[cube]
fn dot_row(a: &Array<f32>, rows: &Shared<[V4]>, at: usize, #[comptime] hd: usize) -> f32 {
    let mut sum = f32::new(0.0);
    #[unroll]
    for c4 in 0..hd / 4 {
        let x = rows[at + c4];
        #[unroll]
        for k in 0..4 {
            sum += a[c4 * 4 + k] * x.extract(k);
        }
    }
    sum
}

/// `acc += w * row` over the `hd` columns of the staged row at `at`.
#[cube]
fn add_row(acc: &mut Array<f32>, w: f32, rows: &Shared<[V4]>, at: usize, #[comptime] hd: usize) {
    #[unroll]
    for c4 in 0..hd / 4 {
        let x = rows[at + c4];
        #[unroll]
        for k in 0..4 {
            acc[c4 * 4 + k] += w * x.extract(k);
        }
    }
}

#[cube(launch, create_dummy_kernel)]
fn flash_forward_kernel<E: Float>(
    qkv: &Tensor<E>,
    out: &mut Tensor<E>,
    lse: &mut Tensor<f32>,
    seq: usize,
    scale: f32,
    #[comptime] hd: usize,
    #[comptime] heads: usize,
    #[comptime] block: usize,
    #[define(E)] _dtype: ElemType,
) {
    let d = hd * heads;
    let row = 3 * d;
    let hd4 = comptime!(hd / 4);
    let qb = CUBE_POS_X as usize;
    let h = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let u = UNIT_POS_X as usize;
    let i = qb * block + u;
    let valid = i < seq;
    let base = b * seq * row;

    let mut q = Array::<f32>::new(hd);
    let mut acc = Array::<f32>::new(hd);
    #[unroll]
    for c in 0..hd {
        q[c] = 0.0;
        acc[c] = 0.0;
    }
    if valid {
        #[unroll]
        for c in 0..hd {
            q[c] = f32::cast_from(qkv[base + i * row + h * hd + c]) * scale;
        }
    }
    let mut ks = Shared::<[V4]>::new_slice(block * hd4);
    let mut vs = Shared::<[V4]>::new_slice(block * hd4);
    // Each unit's scores against the staged block, in shared memory (a row of `block + 1` per
    // unit: rows apart by an odd number of words fall in different banks) so that the loops
    // over the block run at run time, not unrolled with the scores in registers.
    let mut s = Shared::<[f32]>::new_slice(block * (block + 1));
    let srow = u * (block + 1);
    let mut m = f32::new(-1.0e30);
    let mut l = f32::new(0.0);

    for kb in 0..qb + 1 {
        let j = kb * block + u;
        if j < seq {
            let at = base + j * row + h * hd;
            stage_row::<E>(qkv, &mut ks, u * hd4, at + d, 1.0, hd);
            stage_row::<E>(qkv, &mut vs, u * hd4, at + 2 * d, 1.0, hd);
        }
        sync_cube();
        if valid {
            let mut top = m;
            // Four keys at a time: four independent sums, where one sum's chain of `hd`
            // dependent multiply-adds would leave the unit waiting on each. A key past the
            // query (or the sequence) is masked; its staged row may be stale.
            for g in 0..CUBE_DIM_X as usize / 4 {
                let jj = g * 4;
                let (mut d0, mut d1, mut d2, mut d3) =
                    (f32::new(0.0), f32::new(0.0), f32::new(0.0), f32::new(0.0));
                #[unroll]
                for c4 in 0..hd4 {
                    let (k0, k1) = (ks[jj * hd4 + c4], ks[(jj + 1) * hd4 + c4]);
                    let (k2, k3) = (ks[(jj + 2) * hd4 + c4], ks[(jj + 3) * hd4 + c4]);
                    #[unroll]
                    for k in 0..4 {
                        let qc = q[c4 * 4 + k];
                        d0 += qc * k0.extract(k);
                        d1 += qc * k1.extract(k);
                        d2 += qc * k2.extract(k);
                        d3 += qc * k3.extract(k);
                    }
                }
                let first = kb * block + jj;
                let x0 = masked(d0, first <= i);
                let x1 = masked(d1, first < i);
                let x2 = masked(d2, first + 2 <= i);
                let x3 = masked(d3, first + 3 <= i);
                s[srow + jj] = x0;
                s[srow + jj + 1] = x1;
                s[srow + jj + 2] = x2;
                s[srow + jj + 3] = x3;
                top = max(max(top, max(x0, x1)), max(x2, x3));
            }
            let fade = f32::exp(m - top);
            l *= fade;
            #[unroll]
            for c in 0..hd {
                acc[c] *= fade;
            }
            for jj in 0..CUBE_DIM_X as usize {
                if kb * block + jj <= i {
                    let p = f32::exp(s[srow + jj] - top);
                    l += p;
                    add_row(&mut acc, p, &vs, jj * hd4, hd);
                }
            }
            m = top;
        }
        sync_cube();
    }
    if valid {
        let inv = f32::new(1.0) / l;
        #[unroll]
        for c in 0..hd {
            out[b * seq * d + i * d + h * hd + c] = E::cast_from(acc[c] * inv);
        }
        lse[(b * heads + h) * seq + i] = m + f32::ln(l);
    }
}

#[cube(launch, create_dummy_kernel)]
fn flash_backward_dq_kernel<E: Float>(
    qkv: &Tensor<E>,
    out: &Tensor<E>,
    dout: &Tensor<E>,
    lse: &Tensor<f32>,
    delta: &mut Tensor<f32>,
    dqkv: &mut Tensor<E>,
    seq: usize,
    scale: f32,
    #[comptime] hd: usize,
    #[comptime] heads: usize,
    #[comptime] block: usize,
    #[define(E)] _dtype: ElemType,
) {
    let d = hd * heads;
    let row = 3 * d;
    let hd4 = comptime!(hd / 4);
    let qb = CUBE_POS_X as usize;
    let h = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let u = UNIT_POS_X as usize;
    let i = qb * block + u;
    let valid = i < seq;
    let base = b * seq * row;
    let obase = b * seq * d + i * d + h * hd;

    let mut q = Array::<f32>::new(hd);
    let mut g = Array::<f32>::new(hd);
    let mut dq = Array::<f32>::new(hd);
    let mut dd = f32::new(0.0);
    let mut li = f32::new(0.0);
    #[unroll]
    for c in 0..hd {
        q[c] = 0.0;
        g[c] = 0.0;
        dq[c] = 0.0;
    }
    if valid {
        #[unroll]
        for c in 0..hd {
            q[c] = f32::cast_from(qkv[base + i * row + h * hd + c]) * scale;
            g[c] = f32::cast_from(dout[obase + c]);
            dd += g[c] * f32::cast_from(out[obase + c]);
        }
        li = lse[(b * heads + h) * seq + i];
        delta[(b * heads + h) * seq + i] = dd;
    }
    let mut ks = Shared::<[V4]>::new_slice(block * hd4);
    let mut vs = Shared::<[V4]>::new_slice(block * hd4);

    for kb in 0..qb + 1 {
        let j = kb * block + u;
        if j < seq {
            let at = base + j * row + h * hd;
            stage_row::<E>(qkv, &mut ks, u * hd4, at + d, 1.0, hd);
            stage_row::<E>(qkv, &mut vs, u * hd4, at + 2 * d, 1.0, hd);
        }
        sync_cube();
        if valid {
            for jj in 0..CUBE_DIM_X as usize {
                if kb * block + jj <= i {
                    let sc = dot_row(&q, &ks, jj * hd4, hd);
                    let dp = dot_row(&g, &vs, jj * hd4, hd);
                    let ds = f32::exp(sc - li) * (dp - dd);
                    add_row(&mut dq, ds, &ks, jj * hd4, hd);
                }
            }
        }
        sync_cube();
    }
    if valid {
        #[unroll]
        for c in 0..hd {
            dqkv[base + i * row + h * hd + c] = E::cast_from(dq[c] * scale);
        }
    }
}

#[cube(launch, create_dummy_kernel)]
fn flash_backward_dkdv_kernel<E: Float>(
    qkv: &Tensor<E>,
    dout: &Tensor<E>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dqkv: &mut Tensor<E>,
    seq: usize,
    scale: f32,
    #[comptime] hd: usize,
    #[comptime] heads: usize,
    #[comptime] block: usize,
    #[define(E)] _dtype: ElemType,
) {
    let d = hd * heads;
    let row = 3 * d;
    let hd4 = comptime!(hd / 4);
    // Each key is two units', each unit's half of its columns: `half` of them from `lo`.
    let half = comptime!(hd / 2);
    let half4 = comptime!(hd / 8);
    let kb = CUBE_POS_X as usize;
    let h = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let u = UNIT_POS_X as usize % block;
    let side = UNIT_POS_X as usize / block;
    let lo = side * half;
    let j = kb * block + u;
    let valid = j < seq;
    let base = b * seq * row;
    let stats = (b * heads + h) * seq;

    let mut k = Array::<f32>::new(half);
    let mut v = Array::<f32>::new(half);
    let mut dk = Array::<f32>::new(half);
    let mut dv = Array::<f32>::new(half);
    #[unroll]
    for c in 0..half {
        k[c] = 0.0;
        v[c] = 0.0;
        dk[c] = 0.0;
        dv[c] = 0.0;
    }
    if valid {
        #[unroll]
        for c in 0..half {
            k[c] = f32::cast_from(qkv[base + j * row + d + h * hd + lo + c]);
            v[c] = f32::cast_from(qkv[base + j * row + 2 * d + h * hd + lo + c]);
        }
    }
    let mut qs = Shared::<[V4]>::new_slice(block * hd4);
    let mut gs = Shared::<[V4]>::new_slice(block * hd4);
    // Each unit's part of every (query, key) score and `dO . v` of the block: `[side][query]
    // [key]`, so that a warp's units write and read consecutive words.
    let mut scores = Shared::<[f32]>::new_slice(2 * block * block);
    let mut dots = Shared::<[f32]>::new_slice(2 * block * block);
    let blocks = seq.div_ceil(block);
    let mine = side * block * block + u;
    let theirs = (1 - side) * block * block + u;

    for qb in kb..blocks {
        // Each unit stages its half of one query's row and of its output gradient's.
        let i = qb * block + u;
        if i < seq {
            let slot = u * hd4 + side * half4;
            stage_row::<E>(
                qkv,
                &mut qs,
                slot,
                base + i * row + h * hd + lo,
                scale,
                half,
            );
            stage_row::<E>(
                dout,
                &mut gs,
                slot,
                b * seq * d + i * d + h * hd + lo,
                1.0,
                half,
            );
        }
        sync_cube();
        // Both parts of every query's score and `dO . v` against this unit's key, two queries
        // at a time (four independent sums). Rows past the sequence are stale and never used.
        let at = side * half4;
        for pair in 0..CUBE_DIM_X as usize / 4 {
            let ii = pair * 2;
            let (mut s0, mut s1) = (f32::new(0.0), f32::new(0.0));
            let (mut p0, mut p1) = (f32::new(0.0), f32::new(0.0));
            #[unroll]
            for c4 in 0..half4 {
                let (q0, q1) = (qs[ii * hd4 + at + c4], qs[(ii + 1) * hd4 + at + c4]);
                let (g0, g1) = (gs[ii * hd4 + at + c4], gs[(ii + 1) * hd4 + at + c4]);
                #[unroll]
                for e in 0..4 {
                    let (kc, vc) = (k[c4 * 4 + e], v[c4 * 4 + e]);
                    s0 += q0.extract(e) * kc;
                    s1 += q1.extract(e) * kc;
                    p0 += g0.extract(e) * vc;
                    p1 += g1.extract(e) * vc;
                }
            }
            scores[mine + ii * block] = s0;
            scores[mine + (ii + 1) * block] = s1;
            dots[mine + ii * block] = p0;
            dots[mine + (ii + 1) * block] = p1;
        }
        sync_cube();
        if valid {
            for ii in 0..CUBE_DIM_X as usize / 2 {
                let i = qb * block + ii;
                if i >= j && i < seq {
                    // Both units of the key add the same two halves (in either order, the
                    // same bits).
                    let (a, z) = (mine + ii * block, theirs + ii * block);
                    let sc = scores[a] + scores[z];
                    let dp = dots[a] + dots[z];
                    let p = f32::exp(sc - lse[stats + i]);
                    let ds = p * (dp - delta[stats + i]);
                    add_row(&mut dv, p, &gs, ii * hd4 + at, half);
                    add_row(&mut dk, ds, &qs, ii * hd4 + at, half);
                }
            }
        }
        sync_cube();
    }
    if valid {
        #[unroll]
        for c in 0..half {
            dqkv[base + j * row + d + h * hd + lo + c] = E::cast_from(dk[c]);
            dqkv[base + j * row + 2 * d + h * hd + lo + c] = E::cast_from(dv[c]);
        }
    }
}

/// One cube per block of `block` queries (or keys), per head and per sequence.
fn grid(b: usize, t: usize, heads: usize, block: usize) -> CubeCount {
    CubeCount::Static(t.div_ceil(block) as u32, heads as u32, b as u32)
}

/// The launch geometry of a packed projection: `(B, T, d, hd, block, cubes)`.
fn geometry(qkv: &CubeTensor, n_head: usize) -> (usize, usize, usize, usize, usize, CubeCount) {
    let (b, t, d) = split_dims(&qkv.shape(), n_head);
    let hd = d / n_head;
    let block = block_for(hd);
    (b, t, d, hd, block, grid(b, t, n_head, block))
}

impl FlashOps for CubeBackend {
    fn flash_forward(qkv: CubeTensor, n_head: usize, scores_cap: u64) -> (CubeTensor, CubeTensor) {
        let qkv = into_contiguous(qkv);
        let (b, t, d, hd, block, cubes) = geometry(&qkv, n_head);
        if let Some(group) =
            products::group_for(b * n_head, t, scores_cap, products::max_alloc(&qkv))
        {
            return products::forward(qkv, n_head, group);
        }
        let (client, device, dtype) = (qkv.client.clone(), qkv.device.clone(), qkv.dtype);
        let out = empty_device_contiguous_dtype(
            client.clone(),
            device.clone(),
            Shape::new([b, t, d]),
            dtype,
        );
        let lse = empty_device_contiguous_dtype(
            client.clone(),
            device,
            Shape::new([b, n_head, t]),
            DType::F32,
        );
        flash_forward_kernel::launch(
            &client,
            cubes,
            CubeDim::new_1d(block as u32),
            qkv.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            t,
            (hd as f32).sqrt().recip(),
            hd,
            n_head,
            block,
            elem_type(dtype),
        );
        (out, lse)
    }

    fn flash_backward(
        qkv: CubeTensor,
        out: CubeTensor,
        lse: CubeTensor,
        dout: CubeTensor,
        n_head: usize,
        scores_cap: u64,
    ) -> CubeTensor {
        let qkv = into_contiguous(qkv);
        let out = into_contiguous(out);
        let lse = into_contiguous(lse);
        let dout = into_contiguous(dout);
        let (b, t, d, hd, block, cubes) = geometry(&qkv, n_head);
        if let Some(group) =
            products::group_for(b * n_head, t, scores_cap, products::max_alloc(&qkv))
        {
            return products::backward(qkv, out, lse, dout, n_head, group);
        }
        let (client, device, dtype) = (qkv.client.clone(), qkv.device.clone(), qkv.dtype);
        let scale = (hd as f32).sqrt().recip();
        let delta = empty_device_contiguous_dtype(
            client.clone(),
            device.clone(),
            Shape::new([b, n_head, t]),
            DType::F32,
        );
        let dqkv =
            empty_device_contiguous_dtype(client.clone(), device, Shape::new([b, t, 3 * d]), dtype);
        flash_backward_dq_kernel::launch(
            &client,
            cubes.clone(),
            CubeDim::new_1d(block as u32),
            qkv.clone().into_tensor_arg(),
            out.into_tensor_arg(),
            dout.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            dqkv.clone().into_tensor_arg(),
            t,
            scale,
            hd,
            n_head,
            block,
            elem_type(dtype),
        );
        let block = dkdv_block_for(hd);
        flash_backward_dkdv_kernel::launch(
            &client,
            grid(b, t, n_head, block),
            CubeDim::new_1d(2 * block as u32),
            qkv.into_tensor_arg(),
            dout.into_tensor_arg(),
            lse.into_tensor_arg(),
            delta.into_tensor_arg(),
            dqkv.clone().into_tensor_arg(),
            t,
            scale,
            hd,
            n_head,
            block,
            elem_type(dtype),
        );
        dqkv
    }
}

#[derive(Debug)]
struct FlashBackward;

impl<B: FlashOps> Backward<B, 1> for FlashBackward {
    /// The projection, the output, each query's log-sum-exp, the head count and the forward's
    /// scores cap.
    type State = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>, usize, u64);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let dout = grads.consume::<B>(&ops.node);
        if let Some(parent) = parent {
            let (qkv, out, lse, n_head, cap) = ops.state;
            let dqkv = B::flash_backward(qkv, out, lse, dout, n_head, cap);
            grads.register::<B>(parent.id, dqkv);
        }
    }
}

impl<B: FlashOps, C: CheckpointStrategy> FlashOps for Autodiff<B, C> {
    fn flash_attention(
        qkv: FloatTensor<Self>,
        n_head: usize,
        scores_cap: u64,
    ) -> FloatTensor<Self> {
        let input = qkv.primitive().clone();
        let prep = FlashBackward
            .prepare::<C>([qkv.node()])
            .compute_bound()
            .stateful();
        let (out, lse) = B::flash_forward(input.clone(), n_head, scores_cap);
        match prep {
            OpsKind::Tracked(prep) => {
                prep.finish((input, out.clone(), lse, n_head, scores_cap), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    /// Untracked: only [`FlashOps::flash_attention`] has a gradient.
    fn flash_forward(
        qkv: FloatTensor<Self>,
        n_head: usize,
        scores_cap: u64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (out, lse) = B::flash_forward(qkv.primitive().clone(), n_head, scores_cap);
        (Self::from_inner(out), Self::from_inner(lse))
    }

    /// Untracked, as the forward.
    fn flash_backward(
        qkv: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        n_head: usize,
        scores_cap: u64,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::flash_backward(
            qkv.primitive().clone(),
            out.primitive().clone(),
            lse.primitive().clone(),
            dout.primitive().clone(),
            n_head,
            scores_cap,
        ))
    }
}

/// The three kernels as a gpt2 step launches them ([`Ahead`]).
pub(super) fn ahead(a: &mut Ahead) {
    let (b, t, d, heads) = (Ahead::B, Ahead::T, Ahead::D, Ahead::HEADS);
    let hd = d / heads;
    let block = block_for(hd);
    let cubes = || grid(b, t, heads, block);
    let dim = CubeDim::new_1d(block as u32);
    let scale = (hd as f32).sqrt().recip();
    let packed = [b, t, 3 * d];
    let stats = [b, heads, t];
    for dtype in Ahead::DTYPES {
        let tensor = |shape: &[usize]| Ahead::tensor(shape, dtype);
        let f32s = |shape: &[usize]| Ahead::tensor(shape, DType::F32);
        a.push(
            format!("flash_forward {dtype:?} hd {hd} block {block}"),
            |device, target| {
                flash_forward_kernel::create_dummy_kernel(
                    device,
                    target,
                    cubes(),
                    dim,
                    tensor(&packed),
                    tensor(&[b, t, d]),
                    f32s(&stats),
                    t,
                    scale,
                    hd,
                    heads,
                    block,
                    elem_type(dtype),
                )
            },
        );
        a.push(
            format!("flash_backward_dq {dtype:?} hd {hd} block {block}"),
            |device, target| {
                flash_backward_dq_kernel::create_dummy_kernel(
                    device,
                    target,
                    cubes(),
                    dim,
                    tensor(&packed),
                    tensor(&[b, t, d]),
                    tensor(&[b, t, d]),
                    f32s(&stats),
                    f32s(&stats),
                    tensor(&packed),
                    t,
                    scale,
                    hd,
                    heads,
                    block,
                    elem_type(dtype),
                )
            },
        );
        let keys = dkdv_block_for(hd);
        a.push(
            format!("flash_backward_dkdv {dtype:?} hd {hd} block {keys}"),
            |device, target| {
                flash_backward_dkdv_kernel::create_dummy_kernel(
                    device,
                    target,
                    grid(b, t, heads, keys),
                    CubeDim::new_1d(2 * keys as u32),
                    tensor(&packed),
                    tensor(&[b, t, d]),
                    f32s(&stats),
                    f32s(&stats),
                    tensor(&packed),
                    t,
                    scale,
                    hd,
                    heads,
                    keys,
                    elem_type(dtype),
                )
            },
        );
    }
}
