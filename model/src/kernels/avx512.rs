//! The f32 matrix product on CPUs with AVX-512, written for the shapes a transformer's step
//! multiplies (BENCHMARKS.md, "The f32 product").
//!
//! The output is computed in tiles of [`MR`] rows by [`NR`] columns, kept in 24 registers
//! while the inner dimension runs: each step loads four 16-lane vectors of `rhs` and
//! broadcasts one element of `lhs` per row. `rhs` is packed, a block of [`kc`] x [`NC`] at a
//! time (512 KiB, or 768 KiB where a core's L2 is 2 MiB or more: held in L2), into panels
//! laid out in the order the tiles read them, which on such a CPU ask for a panel's lines
//! [`PANEL_AHEAD`] steps before they read them; a transposed `rhs` is packed through 16 x 16
//! register transposes. `lhs` is read where it lies when its rows are contiguous, and packed
//! once per block of the inner dimension into panels of [`MR`] rows where neither stride is 1;
//! a transposed `lhs` is packed so where more than one tile column reads it on a CPU with
//! 2 MiB of L2 or more (read in place, its steps lie a row stride apart, often a multiple of
//! 4 KiB, and land on a few of L1's sets), and read in place elsewhere, which was faster on
//! Zen 5 ([`packs_transposed`]). Every output element is one f32 fused multiply-add chain
//! over the inner dimension in order, a block of [`kc`] at a time, so the result does not
//! depend on how the caller splits the output between threads or whether `lhs` is packed.

use std::arch::x86_64::*;
use std::cell::RefCell;

/// Output rows per tile: one broadcast of `lhs` each per step.
pub(super) const MR: usize = 6;
/// 16-lane vectors per tile row.
const V: usize = 4;
/// Output columns per tile.
pub(super) const NR: usize = 16 * V;
/// Steps of the inner dimension per block (the most; blocks are split evenly) where a core's
/// L2 is under 2 MiB (Zen 4 and Zen 5: 1 MiB).
const KC: usize = 512;
/// The same where a core's L2 is 2 MiB or more (Sapphire and Emerald Rapids): an inner
/// dimension of 768 (gpt2's width) in one block, not two of 384, and 3,072 in four, not six.
/// On an Emerald Rapids core, 1.5-6% faster than [`KC`] on such products of gpt2's step, in
/// three runs of each shape (BENCHMARKS.md); 1,024 was no better and slower on weight
/// gradients with 1,024 rows.
const KC_LARGE_L2: usize = 768;

/// Steps of the inner dimension a tile asks for its panel's lines ahead of reading them,
/// where a core's L2 is 2 MiB or more: a step reads four lines of the panel, which sits in
/// L2, and the core's own prefetchers fetch them too late. On an Emerald Rapids core, gpt2's
/// products (T 256, B 4) took 2.7-3.6% less time at 12 steps than without (medians of pairs),
/// and its f32 training step 1.2-3.4% less (BENCHMARKS.md, "The panel's lines asked for
/// ahead"); 6 and 8 were slower than 12, 16 and 24 no faster. Unmeasured on CPUs with less
/// L2 (Zen 4 and Zen 5), which run the tiles as before.
const PANEL_AHEAD: usize = 12;

/// The most steps of the inner dimension per block on this CPU: [`KC_LARGE_L2`] where a
/// core's L2 is 2 MiB or more, else [`KC`].
pub(super) fn kc() -> usize {
    static KC_HERE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *KC_HERE.get_or_init(|| block_for(ember_cpu::cpu().l2_bytes))
}

/// Whether a core's L2 is 2 MiB or more, which the blocks and prefetches are chosen by.
fn large_l2(l2: Option<usize>) -> bool {
    l2.is_some_and(|bytes| bytes >= 2 << 20)
}

/// [`kc`] for a core's L2 of `l2` bytes.
fn block_for(l2: Option<usize>) -> usize {
    if large_l2(l2) { KC_LARGE_L2 } else { KC }
}

/// How many steps ahead a tile prefetches its panel on this CPU: [`PANEL_AHEAD`] where a
/// core's L2 is 2 MiB or more, else none.
pub(super) fn panel_ahead() -> usize {
    static AHEAD: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *AHEAD.get_or_init(|| ahead_for(ember_cpu::cpu().l2_bytes))
}

/// [`panel_ahead`] for a core's L2 of `l2` bytes.
fn ahead_for(l2: Option<usize>) -> usize {
    if large_l2(l2) { PANEL_AHEAD } else { 0 }
}

/// Columns of `rhs` per packed block (the most; blocks are split evenly).
const NC: usize = 256;

/// A cache line of f32, so that packed panels are aligned for whole-vector loads.
#[repr(align(64))]
#[derive(Clone, Copy)]
struct Line(#[allow(dead_code, reason = "only read through pointers")] [f32; 16]);

thread_local! {
    /// Each thread's packed block of `rhs`, and of `lhs` when it needs packing.
    static PACKED: RefCell<[Vec<Line>; 2]> = const { RefCell::new([Vec::new(), Vec::new()]) };
}

/// `buf` grown to hold `floats` f32, as a pointer to its first.
fn room(buf: &mut Vec<Line>, floats: usize) -> *mut f32 {
    let lines = floats.div_ceil(16);
    if buf.len() < lines {
        buf.resize(lines, Line([0.0; 16]));
    }
    buf.as_mut_ptr().cast()
}

/// How a tile reads `lhs`: along rows (unit column stride, rows `stride` apart) or along
/// columns (unit row stride, steps `stride` apart).
#[derive(Clone, Copy)]
enum Lhs {
    Rows(isize),
    Columns(isize),
}

/// Whether products run here: the CPU has AVX-512 and `EMBER_F32_PRODUCT` is not `gemm`
/// (which measures the product of other CPUs).
pub(super) fn available() -> bool {
    static HERE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let here = *HERE.get_or_init(|| {
        ember_cpu::vector() == ember_cpu::Vector::Avx512
            && std::env::var("EMBER_F32_PRODUCT").as_deref() != Ok("gemm")
    });
    super::simd::level_cap() >= 2 && here
}

/// Whether [`product`] packs an `lhs` of strides `[ars, acs]` for `n` output columns: where
/// neither of its strides is 1, and where it is transposed (contiguous columns, a weight
/// gradient's input) on CPUs that [`packs_transposed`], if its panels are read for more than
/// one tile column (for one, each of its elements is read once either way).
pub(super) fn packs_lhs([ars, acs]: [isize; 2], n: usize) -> bool {
    acs != 1 && (ars != 1 || (n > NR && packs_transposed()))
}

/// Whether a transposed `lhs` is packed on this CPU: where a core's L2 is 2 MiB or more.
/// Read in place, a transposed `lhs`'s steps lie a row stride apart, often a multiple of
/// 4 KiB; packed, a tile reads them from one stretch. On an Emerald Rapids core packing paid
/// (BENCHMARKS.md, "f32 products on Intel: the transposed left operand packed"); on a Zen 5
/// core (1 MiB of L2) reading in place was faster: gpt2's weight gradients (T 256, B 4) took
/// 6-30% less time each, its 147 products in all 5.4% less (6 pairs; BENCHMARKS.md,
/// "Zen 5 against c88c7b8").
pub(super) fn packs_transposed() -> bool {
    #[cfg(test)]
    if let Some(packs) = PACK_TRANSPOSED.with(|p| p.get()) {
        return packs;
    }
    static HERE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HERE.get_or_init(|| packs_transposed_for(ember_cpu::cpu().l2_bytes))
}

/// [`packs_transposed`] for a core's L2 of `l2` bytes.
fn packs_transposed_for(l2: Option<usize>) -> bool {
    large_l2(l2)
}

#[cfg(test)]
thread_local! {
    /// The calling thread's choice for [`packs_transposed`] in this crate's unit tests, which
    /// run both ways on one CPU; `None`, the CPU's.
    pub(super) static PACK_TRANSPOSED: std::cell::Cell<Option<bool>> =
        const { std::cell::Cell::new(None) };
}

/// `dst = beta * lhs rhs`, or `dst += beta * lhs rhs` when `accumulate`, or, where `bias`
/// is not null and `accumulate` is not set, `dst = bias + beta * lhs rhs` (`bias` a row of
/// `n` values added to every row), on the calling thread: operands as in
/// [`super::product::product`]. The bias is added where `accumulate` adds `dst`, so the bits
/// are those of `dst` filled with copies of it and `accumulate`.
///
/// # Safety
/// [`available`]; every addressed element is in bounds, and no other thread writes `dst`'s
/// elements; a bias holds `n` values.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn product(
    [m, n, k]: [usize; 3],
    (c, ldc): (*mut f32, isize),
    (a, [ars, acs]): (*const f32, [isize; 2]),
    (b, [brs, bcs]): (*const f32, [isize; 2]),
    beta: f32,
    accumulate: bool,
    bias: *const f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    let bias = if accumulate { std::ptr::null() } else { bias };
    if k == 0 {
        if !bias.is_null() {
            for i in 0..m {
                // SAFETY: row i's n elements and the bias's n are in bounds, as the caller
                // guarantees.
                unsafe {
                    std::ptr::copy_nonoverlapping(bias, c.offset(i as isize * ldc), n);
                }
            }
            return;
        }
        if !accumulate {
            for i in 0..m {
                // SAFETY: row i's n elements are in bounds, as the caller guarantees.
                unsafe { std::slice::from_raw_parts_mut(c.offset(i as isize * ldc), n) }.fill(0.0);
            }
        }
        return;
    }
    PACKED.with(|packed| {
        let [rhs_buf, lhs_buf] = &mut *packed.borrow_mut();
        let kc = k.div_ceil(k.div_ceil(kc()));
        let nc = n.div_ceil(n.div_ceil(NC)).next_multiple_of(NR);
        let bp = room(rhs_buf, kc * nc);
        let pack_lhs = packs_lhs([ars, acs], n);
        let ahead = panel_ahead() > 0;
        let ap = if pack_lhs {
            room(lhs_buf, m.next_multiple_of(MR) * kc)
        } else {
            std::ptr::null_mut()
        };
        for p0 in (0..k).step_by(kc) {
            let depth = kc.min(k - p0);
            // SAFETY (this block): the operands' elements addressed are those of rows
            // below m, columns below n and steps below k, in bounds as the caller guarantees;
            // the packed buffers hold the blocks packed into them.
            unsafe {
                if pack_lhs {
                    pack_columns(a.offset(p0 as isize * acs), [m, depth], [ars, acs], ap);
                }
                let onto = if accumulate || p0 > 0 {
                    Onto::Dst
                } else if !bias.is_null() {
                    Onto::Bias(bias)
                } else {
                    Onto::Zero
                };
                // This block of `lhs`, how tiles read it, and the distance between its rows.
                let (block, lhs, row) = if acs == 1 {
                    (a.add(p0), Lhs::Rows(ars), ars)
                } else if !pack_lhs {
                    (a.offset(p0 as isize * acs), Lhs::Columns(acs), 1)
                } else {
                    (ap.cast_const(), Lhs::Columns(MR as isize), depth as isize)
                };
                for j0 in (0..n).step_by(nc) {
                    let width = nc.min(n - j0);
                    let from = b.offset(p0 as isize * brs + j0 as isize * bcs);
                    pack_rhs(from, [depth, width], [brs, bcs], bp);
                    for i0 in (0..m).step_by(MR) {
                        let rows = MR.min(m - i0);
                        let at = block.offset(i0 as isize * row);
                        for jr in (0..width).step_by(NR) {
                            let out = (c.offset(i0 as isize * ldc + (j0 + jr) as isize), ldc);
                            let shape = [rows, NR.min(width - jr), depth];
                            let onto = onto.at_column(j0 + jr);
                            let panel = bp.add(jr * depth);
                            tile(shape, (at, lhs), panel, out, beta, onto, ahead);
                        }
                    }
                }
            }
        }
    })
}

/// What a tile's sums are added to as they are stored: nothing, the output's values, or a
/// row of values (the bias), the same for each of the tile's rows.
#[derive(Clone, Copy)]
enum Onto {
    Zero,
    Dst,
    Bias(*const f32),
}

impl Onto {
    /// The same for the tile whose first column is `j`.
    fn at_column(self, j: usize) -> Onto {
        match self {
            Onto::Bias(b) => Onto::Bias(b.wrapping_add(j)),
            onto => onto,
        }
    }
}

/// Lane masks of a tile row's vectors for its first `cols` columns.
fn masks(cols: usize) -> [u16; V] {
    std::array::from_fn(|h| match cols.saturating_sub(16 * h) {
        0 => 0,
        c if c >= 16 => u16::MAX,
        c => (1u16 << c) - 1,
    })
}

/// How many lines (16 steps each) ahead of its loads [`pack_rhs`] asks for a transposed
/// `rhs`'s columns.
const PACK_AHEAD: usize = 3;

/// Packs `depth x width` of `rhs` into panels of [`NR`] columns, each `depth` rows of `NR`
/// (columns past `width` are zero): column `j` of step `s` goes to
/// `out[(j / NR * depth + s) * NR + j % NR]`.
///
/// # Safety
/// The CPU has AVX-512 F; the elements addressed are in bounds; `out` holds
/// `width.next_multiple_of(NR) * depth` f32, 64-byte aligned.
#[target_feature(enable = "avx512f")]
unsafe fn pack_rhs(b: *const f32, [depth, width]: [usize; 2], [rs, cs]: [isize; 2], out: *mut f32) {
    for j0 in (0..width).step_by(NR) {
        let cols = NR.min(width - j0);
        // SAFETY (this panel): reads as the caller guarantees; the panel's writes are within
        // `out`, at vector-aligned offsets.
        unsafe {
            let panel = out.add(j0 * depth);
            if cs == 1 {
                let masks = masks(cols);
                for s in 0..depth {
                    let row = b.offset(s as isize * rs + j0 as isize);
                    for (h, &mask) in masks.iter().enumerate() {
                        let v = _mm512_maskz_loadu_ps(mask, row.add(16 * h));
                        _mm512_store_ps(panel.add(s * NR + 16 * h), v);
                    }
                }
            } else if rs == 1 {
                // Each column is contiguous along the inner dimension: 16 columns by 16
                // steps at a time, transposed in registers. The 16 columns are read from
                // first step to last before the next 16 (16 streams, not 64), each a few
                // lines ahead of its loads.
                for h in 0..V {
                    if 16 * h >= cols {
                        for s in 0..depth {
                            _mm512_store_ps(panel.add(s * NR + 16 * h), _mm512_setzero_ps());
                        }
                        continue;
                    }
                    for s0 in (0..depth).step_by(16) {
                        let steps = 16.min(depth - s0);
                        let step_mask = masks(steps)[0];
                        let ahead = s0 + 16 * PACK_AHEAD < depth;
                        let mut r = [_mm512_setzero_ps(); 16];
                        for (jj, r) in r.iter_mut().enumerate() {
                            let j = 16 * h + jj;
                            if j < cols {
                                let col = b.offset((j0 + j) as isize * cs + s0 as isize);
                                if ahead {
                                    _mm_prefetch::<_MM_HINT_T0>(col.add(16 * PACK_AHEAD).cast());
                                }
                                *r = _mm512_maskz_loadu_ps(step_mask, col);
                            }
                        }
                        for (s, v) in transpose(r).iter().enumerate().take(steps) {
                            _mm512_store_ps(panel.add((s0 + s) * NR + 16 * h), *v);
                        }
                    }
                }
            } else {
                for s in 0..depth {
                    for j in 0..NR {
                        *panel.add(s * NR + j) = if j < cols {
                            *b.offset(s as isize * rs + (j0 + j) as isize * cs)
                        } else {
                            0.0
                        };
                    }
                }
            }
        }
    }
}

/// The 16 x 16 transpose of `r`: lane `i` of output `j` is lane `j` of input `i`.
#[inline(always)]
pub(super) fn transpose(r: [__m512; 16]) -> [__m512; 16] {
    // SAFETY: register shuffles only; every caller runs with AVX-512 F.
    unsafe {
        let mut t = [_mm512_setzero_ps(); 16];
        // Pairs of rows interleaved by lane, then by pairs of lanes...
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        let mut u = [_mm512_setzero_ps(); 16];
        for q in 0..4 {
            let (x, y) = (4 * q, 4 * q + 2);
            u[x] = _mm512_shuffle_ps::<0x44>(t[x], t[y]);
            u[x + 1] = _mm512_shuffle_ps::<0xEE>(t[x], t[y]);
            u[x + 2] = _mm512_shuffle_ps::<0x44>(t[x + 1], t[y + 1]);
            u[x + 3] = _mm512_shuffle_ps::<0xEE>(t[x + 1], t[y + 1]);
        }
        // ... then by 128-bit quarters, twice.
        for o in [0, 8] {
            for i in 0..4 {
                t[o + i] = _mm512_shuffle_f32x4::<0x88>(u[o + i], u[o + 4 + i]);
                t[o + 4 + i] = _mm512_shuffle_f32x4::<0xDD>(u[o + i], u[o + 4 + i]);
            }
        }
        for i in 0..8 {
            u[i] = _mm512_shuffle_f32x4::<0x88>(t[i], t[8 + i]);
            u[8 + i] = _mm512_shuffle_f32x4::<0xDD>(t[i], t[8 + i]);
        }
        u
    }
}

/// Panels of `lhs` packed together from a column-contiguous `lhs`: their rows of each step
/// are one run of `PANELS * MR` elements (24 cache lines when `MR` is 6), and the panels'
/// partly written lines (as many) stay in L1 until they are whole.
const PANELS: usize = 64;
/// How many steps ahead of its loads [`pack_columns`] asks for a column-contiguous `lhs`'s
/// lines.
const LHS_AHEAD: usize = 2;

/// Packs `rows x depth` of `lhs` (strides `[rs, cs]`) into panels of [`MR`] rows, each
/// `depth` steps of `MR` elements: element `(i, s)` goes to `out[(i / MR * depth + s) * MR +
/// i % MR]`.
///
/// # Safety
/// The CPU has AVX-512 F; the elements addressed are in bounds; `out` holds
/// `rows.next_multiple_of(MR) * depth` f32.
#[target_feature(enable = "avx512f")]
unsafe fn pack_columns(
    a: *const f32,
    [rows, depth]: [usize; 2],
    [rs, cs]: [isize; 2],
    out: *mut f32,
) {
    if rs == 1 {
        // Each step's rows are contiguous (a transposed `lhs`, as a weight's gradient reads
        // its input): [`PANELS`] panels at a time, so that a step's run of rows is read
        // whole, a few steps ahead, and written to that many panels.
        let run = PANELS * MR;
        for g0 in (0..rows).step_by(run) {
            let width = run.min(rows - g0);
            for s in 0..depth {
                // SAFETY: the elements read are rows g0..g0 + width of step s, and those
                // prefetched of step s + LHS_AHEAD where it exists, in bounds as the caller
                // guarantees; the writes are within their panels.
                unsafe {
                    let from = a.offset(s as isize * cs).add(g0);
                    if s + LHS_AHEAD < depth {
                        let ahead = from.offset(LHS_AHEAD as isize * cs);
                        for line in (0..width).step_by(16).chain([width - 1]) {
                            _mm_prefetch::<_MM_HINT_T0>(ahead.add(line).cast());
                        }
                    }
                    for p in (0..width).step_by(MR) {
                        let mask = (1u16 << MR.min(width - p)) - 1;
                        let v = _mm512_maskz_loadu_ps(mask, from.add(p));
                        _mm512_mask_storeu_ps(out.add((g0 + p) * depth + s * MR), mask, v);
                    }
                }
            }
        }
        return;
    }
    for i0 in (0..rows).step_by(MR) {
        for s in 0..depth {
            for i in i0..(i0 + MR).min(rows) {
                // SAFETY: as the caller guarantees.
                unsafe {
                    *out.add((i0 * depth) + s * MR + i - i0) =
                        *a.offset(i as isize * rs + s as isize * cs)
                };
            }
        }
    }
}

/// One tile: `[rows, cols, depth]` of the output at `out` from `lhs` read as `Lhs` says
/// and a packed panel of `rhs`, scaled by `beta`, added to what `onto` says; the panel's
/// lines prefetched [`PANEL_AHEAD`] steps ahead where `ahead`.
///
/// # Safety
/// The CPU has AVX-512 F; `rows <= MR`, `cols <= NR`; the elements addressed are in bounds.
#[target_feature(enable = "avx512f")]
unsafe fn tile(
    [rows, cols, depth]: [usize; 3],
    (a, lhs): (*const f32, Lhs),
    panel: *const f32,
    out: (*mut f32, isize),
    beta: f32,
    onto: Onto,
    ahead: bool,
) {
    let vectors = cols.div_ceil(16);
    let masks = masks(cols);
    macro_rules! dispatch {
        ($k:tt; $($r:literal)*) => {
            match (rows, vectors, lhs) {
                $(
                    ($r, 1, Lhs::Rows(s)) => micro::<$r, 1, true, $k>(depth, a, s, panel, out, beta, onto, masks),
                    ($r, 2, Lhs::Rows(s)) => micro::<$r, 2, true, $k>(depth, a, s, panel, out, beta, onto, masks),
                    ($r, 3, Lhs::Rows(s)) => micro::<$r, 3, true, $k>(depth, a, s, panel, out, beta, onto, masks),
                    ($r, 4, Lhs::Rows(s)) => micro::<$r, 4, true, $k>(depth, a, s, panel, out, beta, onto, masks),
                    ($r, 1, Lhs::Columns(s)) => micro::<$r, 1, false, $k>(depth, a, s, panel, out, beta, onto, masks),
                    ($r, 2, Lhs::Columns(s)) => micro::<$r, 2, false, $k>(depth, a, s, panel, out, beta, onto, masks),
                    ($r, 3, Lhs::Columns(s)) => micro::<$r, 3, false, $k>(depth, a, s, panel, out, beta, onto, masks),
                    ($r, 4, Lhs::Columns(s)) => micro::<$r, 4, false, $k>(depth, a, s, panel, out, beta, onto, masks),
                )*
                _ => unreachable!("a tile is at most {MR} x {NR}"),
            }
        };
    }
    // SAFETY: as the caller guarantees.
    unsafe {
        if ahead {
            dispatch!(PANEL_AHEAD; 1 2 3 4 5 6)
        } else {
            dispatch!(0; 1 2 3 4 5 6)
        }
    }
}

/// The tile of `R` rows and `W` vectors: `lhs` row `i`, step `s` at `a + i * stride + s` when
/// `ROWS`, else at `a + i + s * stride`; at each step the panel's vectors of step
/// `s + AHEAD` are prefetched, where `AHEAD` is not 0.
///
/// # Safety
/// As for [`tile`], with `W` vectors covering the tile's columns.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn micro<const R: usize, const W: usize, const ROWS: bool, const AHEAD: usize>(
    depth: usize,
    a: *const f32,
    stride: isize,
    panel: *const f32,
    (c, ldc): (*mut f32, isize),
    beta: f32,
    onto: Onto,
    masks: [u16; V],
) {
    // Asks for the lines of the panel's step `s + AHEAD`.
    let ask = |s: usize| {
        if AHEAD > 0 {
            for h in 0..W {
                let line = panel.wrapping_add((s + AHEAD) * NR + 16 * h);
                // SAFETY: a prefetch reads nothing and cannot fault, whatever line it names
                // (past the panel's end too); every x86-64 CPU has SSE.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(line.cast()) };
            }
        }
    };
    // SAFETY: reads of the operands and the tile's output as the caller guarantees; the
    // panel's vectors are 64-byte aligned.
    unsafe {
        // Ask for the output's lines now, so that they are in L1 when the sums are done.
        for i in 0..R {
            for h in 0..W {
                _mm_prefetch::<_MM_HINT_T0>(c.offset(i as isize * ldc).add(16 * h).cast());
            }
        }
        let mut acc = [[_mm512_setzero_ps(); W]; R];
        if ROWS {
            let row: [*const f32; R] = std::array::from_fn(|i| a.offset(i as isize * stride));
            for s in 0..depth {
                ask(s);
                let b: [__m512; W] =
                    std::array::from_fn(|h| _mm512_load_ps(panel.add(s * NR + 16 * h)));
                for (acc, row) in acc.iter_mut().zip(&row) {
                    let x = _mm512_set1_ps(*row.add(s));
                    for (acc, &b) in acc.iter_mut().zip(&b) {
                        *acc = _mm512_fmadd_ps(x, b, *acc);
                    }
                }
            }
        } else {
            let mut at = a;
            for s in 0..depth {
                ask(s);
                let b: [__m512; W] =
                    std::array::from_fn(|h| _mm512_load_ps(panel.add(s * NR + 16 * h)));
                for (i, acc) in acc.iter_mut().enumerate() {
                    let x = _mm512_set1_ps(*at.add(i));
                    for (acc, &b) in acc.iter_mut().zip(&b) {
                        *acc = _mm512_fmadd_ps(x, b, *acc);
                    }
                }
                at = at.offset(stride);
            }
        }
        let beta = _mm512_set1_ps(beta);
        let bias: [__m512; W] = std::array::from_fn(|h| match onto {
            Onto::Bias(b) => _mm512_maskz_loadu_ps(masks[h], b.add(16 * h)),
            _ => _mm512_setzero_ps(),
        });
        for (i, acc) in acc.iter().enumerate() {
            let row = c.offset(i as isize * ldc);
            for (h, &acc) in acc.iter().enumerate() {
                let to = row.add(16 * h);
                let v = match onto {
                    Onto::Dst => _mm512_fmadd_ps(acc, beta, _mm512_maskz_loadu_ps(masks[h], to)),
                    Onto::Bias(_) => _mm512_fmadd_ps(acc, beta, bias[h]),
                    Onto::Zero => _mm512_mul_ps(acc, beta),
                };
                _mm512_mask_storeu_ps(to, masks[h], v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{
        KC, KC_LARGE_L2, MR, NC, NR, PACK_TRANSPOSED, PANEL_AHEAD, PANELS, ahead_for, available,
        block_for, kc, packs_transposed, packs_transposed_for, panel_ahead, product,
    };
    use crate::kernels::tests::values;

    /// How an operand of `rows x cols` is stored: row-major, column-major, or with neither
    /// stride 1 (every other element of a row-major buffer twice as wide).
    #[derive(Debug, Clone, Copy)]
    enum Layout {
        Rows,
        Columns,
        Strided,
    }

    impl Layout {
        /// [row stride, column stride] and the buffer's length.
        fn strides(self, [rows, cols]: [usize; 2]) -> ([isize; 2], usize) {
            match self {
                Layout::Rows => ([cols as isize, 1], rows * cols),
                Layout::Columns => ([1, rows as isize], rows * cols),
                Layout::Strided => ([2 * cols as isize, 2], 2 * rows * cols),
            }
        }
    }

    #[test]
    fn the_block_the_prefetch_and_the_packing_follow_the_l2() {
        // 1 MiB (Zen 4, Zen 5) and 1.25 MiB (Ice Lake) keep 512 steps, no prefetch and a
        // transposed lhs in place; 2 MiB (Sapphire and Emerald Rapids) and more take 768,
        // prefetch and pack it; an unknown L2 is taken as small.
        for (l2, want, ahead, packs) in [
            (Some(1 << 20), KC, 0, false),
            (Some(1280 << 10), KC, 0, false),
            (Some(2 << 20), KC_LARGE_L2, PANEL_AHEAD, true),
            (Some(4 << 20), KC_LARGE_L2, PANEL_AHEAD, true),
            (None, KC, 0, false),
        ] {
            assert_eq!(block_for(l2), want, "L2 of {l2:?} bytes");
            assert_eq!(ahead_for(l2), ahead, "L2 of {l2:?} bytes");
            assert_eq!(packs_transposed_for(l2), packs, "L2 of {l2:?} bytes");
        }
        assert_eq!(kc(), block_for(ember_cpu::cpu().l2_bytes));
        assert_eq!(panel_ahead(), ahead_for(ember_cpu::cpu().l2_bytes));
        assert_eq!(
            packs_transposed(),
            packs_transposed_for(ember_cpu::cpu().l2_bytes)
        );
    }

    #[test]
    fn every_tile_shape_block_and_operand_layout_gives_the_f64_product() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX-512, so the product is gemm's");
            return;
        }
        use Layout::*;
        // Rows around a tile's MR and past the panels packed together, columns around a
        // vector, a tile's NR and a block's NC, steps around a block's kc(); 0 steps writes
        // zeros (or keeps the output).
        let (ms, ns, ks) = (
            [1, MR + 1, 2 * MR + 1, PANELS * MR + MR + 1],
            [1, 17, NR, NR + 1, NC + 44],
            [0, 3, 17, kc() + 88],
        );
        let mut shapes = vec![];
        for m in ms {
            for n in ns {
                shapes.extend(ks.map(|k| (m, n, k)));
            }
        }
        for (m, n, k) in shapes {
            for (lhs_layout, rhs_layout) in [
                (Rows, Rows),
                (Columns, Columns),
                (Strided, Strided),
                (Rows, Columns),
                (Columns, Rows),
            ] {
                let (ls, l_len) = lhs_layout.strides([m, k]);
                let (rs, r_len) = rhs_layout.strides([k, n]);
                let (lhs, rhs) = (values(l_len, 21, 1.0), values(r_len, 22, 1.0));
                // The output rows are 3 wider than n: the 3 must keep their values.
                let ldc = n + 3;
                let before = values(m * ldc, 23, 1.0);
                for accumulate in [false, true] {
                    // A transposed `lhs` read in place and packed: the same bits.
                    let [out, packed] = [false, true].map(|packs| {
                        let mut out = before.clone();
                        PACK_TRANSPOSED.with(|p| p.set(Some(packs)));
                        // SAFETY: the CPU has AVX-512; each operand spans its elements at its
                        // strides, and `out` m rows of ldc.
                        unsafe {
                            product(
                                [m, n, k],
                                (out.as_mut_ptr(), ldc as isize),
                                (lhs.as_ptr(), ls),
                                (rhs.as_ptr(), rs),
                                0.5,
                                accumulate,
                                std::ptr::null(),
                            )
                        };
                        PACK_TRANSPOSED.with(|p| p.set(None));
                        out
                    });
                    let at = |v: &[f32], [rs, cs]: [isize; 2], i: usize, j: usize| {
                        f64::from(v[(i as isize * rs + j as isize * cs) as usize])
                    };
                    let case = format!("{m}x{n}x{k} {lhs_layout:?} {rhs_layout:?} {accumulate}");
                    for (i, (a, b)) in out.iter().zip(&packed).enumerate() {
                        assert_eq!(a.to_bits(), b.to_bits(), "{case}: element {i} packed");
                    }
                    for i in 0..m {
                        for j in 0..ldc {
                            let (got, was) = (out[i * ldc + j], before[i * ldc + j]);
                            if j >= n {
                                assert_eq!(
                                    got.to_bits(),
                                    was.to_bits(),
                                    "{case}: ({i}, {j}) written"
                                );
                                continue;
                            }
                            let terms = (0..k).map(|s| at(&lhs, ls, i, s) * at(&rhs, rs, s, j));
                            let (dot, size) =
                                terms.fold((0.0, 0.0), |(d, a), t| (d + t, a + t.abs()));
                            let kept = if accumulate { f64::from(was) } else { 0.0 };
                            let want = 0.5 * dot + kept;
                            // Each FMA rounds once and each block's sum rounds once more
                            // as it is scaled (by 0.5, exactly) and added to the output: a
                            // term passes through at most k + 2 roundings, each within a
                            // unit of roundoff of the terms' absolute sum.
                            let unit = f64::from(f32::EPSILON) / 2.0;
                            let bound = (k + 2) as f64 * unit * (0.5 * size + kept.abs());
                            assert!(
                                (f64::from(got) - want).abs()
                                    <= bound + f64::from(f32::MIN_POSITIVE),
                                "{case}: ({i}, {j}) is {got}, not {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
