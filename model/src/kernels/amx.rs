//! The bf16 matrix product on AMX tiles (Intel Xeons from Sapphire Rapids on).
//!
//! A tile register holds 16 rows of 64 bytes; `tdpbf16ps C, A, B` adds to the 16 x 16 f32
//! tile `C` the products of `A` (16 rows of 16 bf16 pairs) and `B` (16 rows of pairs, each
//! row 16 columns' pairs), each pair multiplied and summed into f32 as `vdpbf16ps` does. The
//! eight registers hold a 32 x 32 block of the output (four `C` tiles), two tiles of `lhs`
//! and two of `rhs`: each step of 32 along the inner dimension loads four tiles and runs
//! four products.
//!
//! The operands come packed by [`super::bf16`]: `lhs` as its tiles, padded to [`ROWS`] rows
//! and [`PAIRS`] pairs (16 rows of 16 pairs, 1 KiB each, a band of 16 rows' tiles one after
//! another along the inner dimension, so that a tile load reads one stretch of memory, which
//! the CPU's prefetchers follow); `rhs`'s transpose in panels of 16 columns (one tile row per
//! pair, 64 bytes), padded to [`COLS`] columns and [`PAIRS`] pairs. The padding is zeros, so
//! every tile is full and only
//! the output's edges are cut: an edge tile, or one scaled by `beta`, goes through a 1 KiB
//! buffer. A long inner dimension runs in blocks of [`KC`] pairs, the sums waiting between
//! blocks in a buffer of the task's output, and the kernel asks for `lhs`'s tiles a few
//! steps ahead of their loads. Each output element is one f32 sum over the inner dimension in
//! order, so the result depends neither on how the output is split between threads nor on
//! the blocks.
//!
//! Instructions are written with `asm!`: the tile registers are no operand class of Rust's,
//! and no other code of the process touches them. Each task loads the tile configuration
//! first and releases the tiles at its end, so a thread holds no tile state between tasks.

use std::arch::asm;
use std::arch::x86_64::*;

use rayon::prelude::*;

use super::product::{In, Out};

/// Where a product's sums go: f32 elements at a row stride, or bf16 bits at a row stride.
/// A bf16 output's elements are those an f32 output would hold, rounded to the nearest bf16
/// (ties to even) as [`super::bits::bits_of`] rounds, an f32 output that held copies of
/// `init` (a row of `n` values, a linear layer's bias) in every row where it is given, and
/// zeros elsewhere.
#[derive(Clone, Copy)]
pub(super) enum Dst {
    F32(Out, isize),
    Bf16 {
        out: Out<u16>,
        rs: isize,
        init: Option<In<f32>>,
    },
}

/// Rows `lhs` is padded to: two tiles of the output block.
pub(super) const ROWS: usize = 32;
/// Columns `rhs` is padded to: two tiles of the output block.
pub(super) const COLS: usize = 32;
/// Pairs (of the inner dimension) both are padded to: one tile's row of pairs.
pub(super) const PAIRS: usize = 16;
/// Output rows per parallel task.
const TASK_ROWS: usize = 128;
/// Output columns per parallel task: 128 columns of `rhs`, at an inner dimension of 3,072,
/// are 768 KiB of packed pairs, held in a Sapphire Rapids core's 2 MiB of L2 with the task's
/// rows of `lhs`.
const TASK_COLS: usize = 128;
/// Pairs of the inner dimension per block where it is long (more than two blocks): a task's
/// rows of `lhs` and columns of `rhs` over one block are 256 KiB each, so they stay in L2
/// while the task's output tiles run over them, and the sums wait between blocks in a
/// buffer of the task's output (64 KiB).
const KC: usize = 512;
/// How many steps of [`PAIRS`] ahead of its tile loads the kernel asks for `lhs`'s tiles: 4
/// measured best of 2, 3, 4, 6 and 8 when `lhs` was packed as rows of pairs; with tiles,
/// asking for none was slower and 2 or 8 no faster (BENCHMARKS).
const A_AHEAD: usize = 4;

/// The tile configuration (palette 1): eight tiles of 16 rows of 64 bytes.
#[repr(C, align(64))]
struct Config {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

static CONFIG: Config = Config {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    bytes_per_row: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

/// The product of packed operands ([`super::bf16::product`] packs them):
/// `dst = beta * lhs rhs`, or `dst += beta * lhs rhs` when `accumulate`, on rayon's threads
/// when `parallel` and the product is large.
///
/// # Safety
/// [`super::bf16::has_amx`]; `a` holds `m.next_multiple_of(ROWS)` rows of `pairs` pairs as
/// tiles (`Pad::tiles` of [`super::bf16`]), and
/// `b` `n.next_multiple_of(COLS)` columns of them, `pairs` being `k.div_ceil(2)` padded to
/// [`PAIRS`]; `dst` addresses `m` rows of `n` elements at its row stride, written by no
/// other thread, and a bf16 output's `init` holds `n` values.
pub(super) unsafe fn product(
    [m, n, k]: [usize; 3],
    a: &[u32],
    b: &[u32],
    dst: Dst,
    beta: f32,
    accumulate: bool,
    parallel: bool,
) {
    let pairs = k.div_ceil(2).next_multiple_of(PAIRS);
    let kc = if pairs > 2 * KC { KC } else { pairs };
    // SAFETY: as the caller guarantees.
    unsafe { product_in_blocks([m, n, k], kc, a, b, dst, beta, accumulate, parallel) }
}

/// [`product`] over blocks of `kc` pairs of the inner dimension (a multiple of [`PAIRS`]):
/// every sum is the same f32 sum in the same order, whatever `kc` is.
///
/// # Safety
/// As for [`product`].
#[allow(clippy::too_many_arguments)]
unsafe fn product_in_blocks(
    [m, n, k]: [usize; 3],
    kc: usize,
    a: &[u32],
    b: &[u32],
    dst: Dst,
    beta: f32,
    accumulate: bool,
    parallel: bool,
) {
    let pairs = k.div_ceil(2).next_multiple_of(PAIRS);
    assert!(a.len() >= m.next_multiple_of(ROWS) * pairs);
    assert!(b.len() >= n.next_multiple_of(COLS) * pairs);
    assert!(kc > 0 && kc.is_multiple_of(PAIRS));
    let (row_tasks, col_tasks) = (m.div_ceil(TASK_ROWS), n.div_ceil(TASK_COLS));
    let task = |t: usize| {
        // Tasks sharing a block of `rhs` run one after another.
        let (r0, c0) = (t % row_tasks * TASK_ROWS, t / row_tasks * TASK_COLS);
        let rows = r0..(r0 + TASK_ROWS).min(m);
        let cols = c0..(c0 + TASK_COLS).min(n);
        let mut sums = if kc < pairs {
            vec![0.0f32; TASK_ROWS * TASK_COLS]
        } else {
            Vec::new()
        };
        // A bf16 output's task writes its f32 output to `staged` (holding `init`'s values
        // first where given), rounded into the bits once the sums are done.
        let width = cols.len();
        let mut staged = Vec::new();
        let out = match dst {
            Dst::F32(out, rs) => (out, rs, [0, 0]),
            Dst::Bf16 { init, .. } => {
                staged = match init {
                    // SAFETY: `init` holds n values, as the caller guarantees.
                    Some(init) => unsafe {
                        std::slice::from_raw_parts(init.get().add(c0), width).repeat(rows.len())
                    },
                    None => vec![0.0f32; rows.len() * width],
                };
                (Out(staged.as_mut_ptr()), width as isize, [r0, c0])
            }
        };
        for k0 in (0..pairs).step_by(kc) {
            let ks = k0..(k0 + kc).min(pairs);
            // SAFETY: this task's rows and columns of the output are its own, and `sums`
            // holds them; the rest as the caller guarantees.
            unsafe {
                block(
                    (rows.clone(), cols.clone()),
                    [m, n],
                    (pairs, ks),
                    a,
                    b,
                    out,
                    (beta, accumulate),
                    sums.as_mut_ptr(),
                )
            };
        }
        if let Dst::Bf16 { out, rs, .. } = dst {
            for (i, row) in rows.clone().zip(staged.chunks_exact(width)) {
                // SAFETY: row i's columns `cols` of the output are this task's own (perhaps
                // not yet initialised, so taken as such).
                let to = unsafe {
                    let at = out.get().offset(i as isize * rs).add(c0);
                    std::slice::from_raw_parts_mut(at.cast::<std::mem::MaybeUninit<u16>>(), width)
                };
                super::bits::round_into(row, to);
            }
        }
    };
    let tasks = row_tasks * col_tasks;
    if parallel && m * n * k >= 1 << 20 && tasks > 1 {
        (0..tasks).into_par_iter().for_each(task);
    } else {
        (0..tasks).for_each(task);
    }
}

/// Rows `rows` and columns `cols` of the output (whose first element is the one at `out`'s
/// `[r_out, c_out]`, rows `rs` apart), 32 x 32 at a time, over the pairs `ks` of
/// the inner dimension's `pairs`, the tiles configured for the call and released after it.
/// Sums start from the output (or zero) where `ks` starts at 0, and from `sums` elsewhere;
/// they go to the output where `ks` ends at `pairs`, and to `sums` elsewhere. `sums` holds
/// [`TASK_ROWS`] rows of [`TASK_COLS`] sums from the first of `rows` and `cols`.
///
/// # Safety
/// As for [`product`], for these rows and columns; `sums` is writable as said where `ks` is
/// not all of `pairs`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn block(
    (rows, cols): (std::ops::Range<usize>, std::ops::Range<usize>),
    [m, n]: [usize; 2],
    (pairs, ks): (usize, std::ops::Range<usize>),
    a: &[u32],
    b: &[u32],
    (out, rs, [r_out, c_out]): (Out, isize, [usize; 2]),
    (beta, accumulate): (f32, bool),
    sums: *mut f32,
) {
    // Element (i, j) of the output, its first element being (r_out, c_out).
    let at_out = |i: usize, j: usize| {
        out.0
            .wrapping_offset((i - r_out) as isize * rs + (j - c_out) as isize)
    };
    let (first, last) = (ks.start == 0, ks.end == pairs);
    let (r_base, c_base) = (rows.start, cols.start);
    let at_sums = |i: usize, j: usize| sums.wrapping_add((i - r_base) * TASK_COLS + j - c_base);
    let sums_stride = (TASK_COLS * 4) as isize;
    // SAFETY: the process may use the tiles; CONFIG is a valid palette-1 configuration.
    unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly)) };
    for c in cols.step_by(COLS) {
        // Panels of 16 columns: `pairs` rows of 64 bytes each.
        let b0 = b[c * pairs..].as_ptr();
        let b1 = b[(c + 16) * pairs..].as_ptr();
        for r in rows.clone().step_by(ROWS) {
            // Bands of 16 rows: their tiles one after another.
            let a0 = a[r * pairs..].as_ptr();
            let a1 = a[(r + 16) * pairs..].as_ptr();
            // The four output tiles: rows r and r + 16, columns c and c + 16.
            let tiles = [[r, c], [r, c + 16], [r + 16, c], [r + 16, c + 16]];
            // A whole tile of `dst` unscaled is read and written in place; the others
            // through `edge`.
            let direct = tiles.map(|[i, j]| beta == 1.0 && i + 16 <= m && j + 16 <= n);
            for (t, (&[i, j], &direct)) in tiles.iter().zip(&direct).enumerate() {
                if !first {
                    // SAFETY: the tile's 16 rows of 16 sums are in `sums`, as the caller
                    // guarantees.
                    unsafe { load_c(t, at_sums(i, j), sums_stride) }
                } else if direct && accumulate {
                    // SAFETY: 16 rows of 16 elements from (i, j) are in the output.
                    unsafe {
                        let p = at_out(i, j);
                        load_c(t, p, rs * 4)
                    }
                } else {
                    zero_c(t);
                }
            }
            for q in ks.clone().step_by(PAIRS) {
                // Ask for `lhs`'s tiles `A_AHEAD` steps ahead of their loads (past the end
                // of `a` too; a prefetch never faults).
                for line in 0..16 {
                    let ahead = (q + A_AHEAD * PAIRS + line) * 16;
                    _mm_prefetch::<_MM_HINT_T0>(a0.wrapping_add(ahead).cast());
                    _mm_prefetch::<_MM_HINT_T0>(a1.wrapping_add(ahead).cast());
                }
                // SAFETY: the tiles of pairs q.. of both bands of `a` (rows padded to 32,
                // pairs to 16) and of both panels of `b` are in bounds; the tiles are
                // configured.
                unsafe {
                    asm!(
                        "tileloadd tmm4, [{a0} + {sa}*1]",
                        "tileloadd tmm5, [{a1} + {sa}*1]",
                        "tileloadd tmm6, [{b0} + {sb}*1]",
                        "tileloadd tmm7, [{b1} + {sb}*1]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        "tdpbf16ps tmm2, tmm5, tmm6",
                        "tdpbf16ps tmm3, tmm5, tmm7",
                        a0 = in(reg) a0.add(q * 16),
                        a1 = in(reg) a1.add(q * 16),
                        b0 = in(reg) b0.add(q * 16),
                        b1 = in(reg) b1.add(q * 16),
                        sa = in(reg) 64usize,
                        sb = in(reg) 64usize,
                        options(nostack, readonly),
                    )
                };
            }
            for (t, (&[i, j], &direct)) in tiles.iter().zip(&direct).enumerate() {
                if !last {
                    // SAFETY: as for the loads from `sums`.
                    unsafe { store_c(t, at_sums(i, j), sums_stride) };
                    continue;
                }
                if i >= m || j >= n {
                    continue;
                }
                // SAFETY: as for the loads; `edge` writes only the rows and columns in the
                // output.
                unsafe {
                    let p = at_out(i, j);
                    if direct {
                        store_c(t, p, rs * 4);
                    } else {
                        edge(
                            t,
                            p,
                            rs,
                            [(m - i).min(16), (n - j).min(16)],
                            beta,
                            accumulate,
                        );
                    }
                }
            }
        }
    }
    // SAFETY: releases this thread's tile state.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// Output tile `t` (0..4) loaded from 16 rows `stride` bytes apart at `p`.
///
/// # Safety
/// The tiles are configured; the 16 rows of 64 bytes are readable.
#[inline(always)]
unsafe fn load_c(t: usize, p: *const f32, stride: isize) {
    // SAFETY: as the caller guarantees.
    unsafe {
        match t {
            0 => {
                asm!("tileloadd tmm0, [{p} + {s}*1]", p = in(reg) p, s = in(reg) stride, options(nostack, readonly))
            }
            1 => {
                asm!("tileloadd tmm1, [{p} + {s}*1]", p = in(reg) p, s = in(reg) stride, options(nostack, readonly))
            }
            2 => {
                asm!("tileloadd tmm2, [{p} + {s}*1]", p = in(reg) p, s = in(reg) stride, options(nostack, readonly))
            }
            _ => {
                asm!("tileloadd tmm3, [{p} + {s}*1]", p = in(reg) p, s = in(reg) stride, options(nostack, readonly))
            }
        }
    }
}

/// Output tile `t` (0..4) stored to 16 rows `stride` bytes apart at `p`.
///
/// # Safety
/// The tiles are configured; the 16 rows of 64 bytes are writable and no other thread's.
#[inline(always)]
unsafe fn store_c(t: usize, p: *mut f32, stride: isize) {
    // SAFETY: as the caller guarantees.
    unsafe {
        match t {
            0 => {
                asm!("tilestored [{p} + {s}*1], tmm0", p = in(reg) p, s = in(reg) stride, options(nostack))
            }
            1 => {
                asm!("tilestored [{p} + {s}*1], tmm1", p = in(reg) p, s = in(reg) stride, options(nostack))
            }
            2 => {
                asm!("tilestored [{p} + {s}*1], tmm2", p = in(reg) p, s = in(reg) stride, options(nostack))
            }
            _ => {
                asm!("tilestored [{p} + {s}*1], tmm3", p = in(reg) p, s = in(reg) stride, options(nostack))
            }
        }
    }
}

/// Output tile `t` (0..4) set to zeros.
#[inline(always)]
fn zero_c(t: usize) {
    // SAFETY: writes only the tile register (the caller configured the tiles).
    unsafe {
        match t {
            0 => asm!("tilezero tmm0", options(nostack, nomem)),
            1 => asm!("tilezero tmm1", options(nostack, nomem)),
            2 => asm!("tilezero tmm2", options(nostack, nomem)),
            _ => asm!("tilezero tmm3", options(nostack, nomem)),
        }
    }
}

/// Output tile `t` written to the first `rows` rows and `cols` columns at `dst` (row stride
/// `rs` elements) as `beta` times the tile, added to what is there when `add`.
///
/// # Safety
/// As for [`store_c`], for those rows and columns; the CPU has AVX-512 F.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn edge(t: usize, dst: *mut f32, rs: isize, [rows, cols]: [usize; 2], beta: f32, add: bool) {
    #[repr(align(64))]
    struct Tile([f32; 256]);
    let mut tile = Tile([0.0; 256]);
    // SAFETY: `tile` holds 16 rows of 64 bytes.
    unsafe { store_c(t, tile.0.as_mut_ptr(), 64) };
    let mask = ((1u32 << cols) - 1) as __mmask16;
    let beta = _mm512_set1_ps(beta);
    for (i, row) in tile.0.chunks_exact(16).take(rows).enumerate() {
        // SAFETY: the masked lanes of row i are in the output, as the caller guarantees.
        unsafe {
            let p = dst.offset(i as isize * rs);
            let mut v = _mm512_mul_ps(_mm512_loadu_ps(row.as_ptr()), beta);
            if add {
                v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, p));
            }
            _mm512_mask_storeu_ps(p, mask, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::bf16::has_amx;
    use crate::kernels::bits::bits_of;
    use crate::kernels::tests::values;

    /// The product over blocks of the inner dimension (sums held in the task's buffer between
    /// blocks) gives the bits of the product over it whole, at edges of tiles and tasks, with
    /// `beta` and with and without `accumulate`.
    #[test]
    fn blocks_of_the_inner_dimension_give_the_same_bits() {
        if !has_amx() {
            eprintln!("skipped: AMX tiles are not used here");
            return;
        }
        for &[m, n, k] in &[
            [1usize, 1, 100],
            [33, 47, 129],
            [130, 140, 200],
            [40, 260, 1001],
        ] {
            let pairs = k.div_ceil(2).next_multiple_of(PAIRS);
            // Packed operands of any bf16 values (padding included, which the kernel
            // multiplies like the rest).
            let packed = |rows: usize, seed: u32| -> Vec<u32> {
                values(2 * rows * pairs, seed, 1.0)
                    .chunks_exact(2)
                    .map(|p| bits_of(p[0]) as u32 | (bits_of(p[1]) as u32) << 16)
                    .collect()
            };
            let a = packed(m.next_multiple_of(ROWS), 21);
            let b = packed(n.next_multiple_of(COLS), 22);
            for (beta, accumulate) in [(1.0, true), (1.0, false), (0.5, true), (-2.0, false)] {
                let prior = values(m * n, 23, 1.0);
                let run = |kc: usize, parallel: bool| {
                    let mut out = prior.clone();
                    // SAFETY: `a` and `b` are packed as `product` takes them; `out` is m x n.
                    unsafe {
                        product_in_blocks(
                            [m, n, k],
                            kc,
                            &a,
                            &b,
                            Dst::F32(Out(out.as_mut_ptr()), n as isize),
                            beta,
                            accumulate,
                            parallel,
                        )
                    };
                    out.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                };
                let whole = run(pairs, false);
                let case = format!("[{m}, {n}, {k}] beta {beta} accumulate {accumulate}");
                assert!(
                    whole.iter().zip(&prior).any(|(w, p)| *w != p.to_bits()),
                    "{case}"
                );
                for kc in [PAIRS, 2 * PAIRS, 3 * PAIRS] {
                    assert_eq!(run(kc, false), whole, "{case}, blocks of {kc} pairs");
                    assert_eq!(run(kc, true), whole, "{case}, blocks of {kc}, parallel");
                }
            }
        }
    }
}
