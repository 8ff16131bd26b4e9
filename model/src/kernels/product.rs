//! The one f32 matrix product the kernels use, with every operand given by its row and
//! column strides, so transposed and strided views (a head inside the packed q/k/v
//! projection) are read in place: [`avx512`](super::avx512)'s on CPUs with AVX-512, `gemm`'s
//! (the crate flex multiplies with) elsewhere.

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::avx512;

/// Products smaller than this many multiply-adds run on one thread.
const PARALLEL_MACS: usize = 1 << 21;
/// Output columns per piece when a product is split by columns: a multiple of the widest
/// `gemm` micro-kernel's 16 lanes and of [`avx512::NR`].
const SPLIT_COLUMNS: usize = 64;
#[cfg(target_arch = "x86_64")]
const _: () = assert!(SPLIT_COLUMNS.is_multiple_of(avx512::NR));

/// `dst = beta * lhs rhs`, or `dst += beta * lhs rhs` when `accumulate`: an `m x k` times
/// `k x n` product. `dst` has unit column stride and row stride `dst.1`; `lhs` and `rhs` are
/// (pointer, [row stride, column stride]). With `parallel`, a large product uses rayon's
/// threads; a caller already inside a parallel task passes `false`. Each output element's
/// sum does not depend on the number of threads.
///
/// # Safety
/// Every addressed element is in bounds; no other thread reads or writes `dst`'s elements.
pub(crate) unsafe fn product(
    mnk: [usize; 3],
    dst: (*mut f32, isize),
    lhs: (*const f32, [isize; 2]),
    rhs: (*const f32, [isize; 2]),
    beta: f32,
    accumulate: bool,
    parallel: bool,
) {
    let onto = if accumulate { Onto::Dst } else { Onto::Zero };
    // SAFETY: as the caller guarantees.
    unsafe { product_onto(mnk, dst, lhs, rhs, beta, onto, parallel) }
}

/// Whether [`product_with_bias`] runs here: on CPUs with AVX-512, whose product adds a bias
/// as it stores its first sums.
pub(crate) fn folds_bias() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx512::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `dst = bias + lhs rhs`, `bias` (`n` values) added to every row: what [`product`] with
/// `dst` first filled with copies of `bias` and `accumulate` gives, bit for bit, without the
/// pass that fills `dst` (the first block of the inner dimension adds the bias where it would
/// read `dst`).
///
/// # Safety
/// As for [`product`]; [`folds_bias`]; `bias` holds `n` values.
pub(crate) unsafe fn product_with_bias(
    mnk: [usize; 3],
    dst: (*mut f32, isize),
    lhs: (*const f32, [isize; 2]),
    rhs: (*const f32, [isize; 2]),
    bias: *const f32,
    parallel: bool,
) {
    assert!(
        folds_bias(),
        "a bias folded into a product on a CPU without AVX-512"
    );
    // SAFETY: as the caller guarantees.
    unsafe { product_onto(mnk, dst, lhs, rhs, 1.0, Onto::Bias(bias), parallel) }
}

/// What a product's sums are added to: nothing, the output's values, or a row of `n` values
/// (the last on CPUs with AVX-512 only).
#[derive(Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
enum Onto {
    Zero,
    Dst,
    Bias(*const f32),
}

/// [`product`], its sums added onto `onto`.
///
/// # Safety
/// As for [`product`]; with [`Onto::Bias`], the CPU has AVX-512 and the bias holds `n` values.
unsafe fn product_onto(
    [m, n, k]: [usize; 3],
    dst: (*mut f32, isize),
    lhs: (*const f32, [isize; 2]),
    rhs: (*const f32, [isize; 2]),
    beta: f32,
    onto: Onto,
    parallel: bool,
) {
    let large = parallel && m * n * k >= PARALLEL_MACS;
    let accumulate = matches!(onto, Onto::Dst);
    #[cfg(target_arch = "x86_64")]
    if avx512::available() {
        let bias = match onto {
            Onto::Bias(b) => In(b),
            _ => In(std::ptr::null()),
        };
        let threads = rayon::current_num_threads();
        let (out, out_rs) = (Out(dst.0), dst.1);
        let (a, b) = ((In(lhs.0), lhs.1), (In(rhs.0), rhs.1));
        // Rows r0.. and columns c0.. of the output, `[rows, cols]` of them, on this thread.
        let block = |[r0, c0]: [usize; 2], [rows, cols]: [usize; 2]| {
            let ((lhs, ls), (rhs, rs)) = (a, b);
            // The bias of these columns.
            let bias = match bias.get() {
                b if b.is_null() => b,
                b => b.wrapping_add(c0),
            };
            // SAFETY: as the caller guarantees, for this block of `dst` and the rows of `lhs`
            // and columns of `rhs` it reads; the CPU has AVX-512.
            unsafe {
                avx512::product(
                    [rows, cols, k],
                    (out.get().offset(r0 as isize * out_rs + c0 as isize), out_rs),
                    (lhs.get().offset(r0 as isize * ls[0]), ls),
                    (rhs.get().offset(c0 as isize * rs[1]), rs),
                    beta,
                    accumulate,
                    bias,
                )
            }
        };
        // A packed `lhs` is packed by each thread that reads it, so a thread taking columns
        // packs all of it: where it is the larger operand, threads take rows.
        let packs_lhs =
            m > n && m >= threads * avx512::MR && avx512::packs_lhs(lhs.1, n.div_ceil(threads));
        if !large || threads == 1 {
            block([0, 0], [m, n]);
        } else if n >= threads * SPLIT_COLUMNS && !packs_lhs {
            // By columns: each thread packs only its columns of `rhs`, and reads `lhs` where
            // it lies (or packs all of it where it is the smaller operand).
            in_pieces(n, threads, SPLIT_COLUMNS, |[c0, cols]| {
                block([0, c0], [m, cols])
            });
        } else {
            in_pieces(m, threads, avx512::MR, |[r0, rows]| {
                block([r0, 0], [rows, n])
            });
        }
        return;
    }
    debug_assert!(!matches!(onto, Onto::Bias(_)), "a bias onto gemm's product");
    // SAFETY: as the caller guarantees.
    unsafe { with_gemm([m, n, k], dst, lhs, rhs, beta, accumulate, large) }
}

/// [`product`] through `gemm`, on its threads when `large`.
///
/// # Safety
/// As for [`product`].
unsafe fn with_gemm(
    [m, n, k]: [usize; 3],
    dst: (*mut f32, isize),
    lhs: (*const f32, [isize; 2]),
    rhs: (*const f32, [isize; 2]),
    beta: f32,
    accumulate: bool,
    large: bool,
) {
    let threads = rayon::current_num_threads();
    let (out, out_rs) = (Out(dst.0), dst.1);
    let (a, b) = ((In(lhs.0), lhs.1), (In(rhs.0), rhs.1));
    // Columns `c0..c0 + width` of the product, on `gemm`'s threads or on this one.
    let columns = |[c0, width]: [usize; 2], parallelism| {
        let ((lhs, [lhs_rs, lhs_cs]), (rhs, [rhs_rs, rhs_cs])) = (a, b);
        // SAFETY: as the caller guarantees, for these columns of `dst` and `rhs`.
        unsafe {
            gemm::gemm(
                m,
                width,
                k,
                out.get().add(c0),
                1,
                out_rs,
                accumulate,
                lhs.get(),
                lhs_cs,
                lhs_rs,
                rhs.get().offset(c0 as isize * rhs_cs),
                rhs_cs,
                rhs_rs,
                1.0,
                beta,
                false,
                false,
                false,
                parallelism,
            )
        }
    };
    if large && rhs.1[1] != 1 && threads > 1 && n >= 2 * SPLIT_COLUMNS {
        // A right operand whose rows are strided (a transposed weight) makes `gemm` repack
        // all of it on the calling thread before its threads start, while they wait
        // (BENCHMARKS.md, "Transposed right operands"). Each thread instead takes its own
        // columns of the output and packs only its columns of `rhs`. Every element is the
        // same sum in the same order, so the bits do not change.
        in_pieces(n, threads, SPLIT_COLUMNS, |piece| {
            columns(piece, gemm::Parallelism::None)
        });
    } else if large {
        columns([0, n], gemm::Parallelism::Rayon(0))
    } else {
        columns([0, n], gemm::Parallelism::None)
    }
}

/// `f([start, len])` for `0..len` cut into one piece per thread, each a multiple of
/// `multiple` long (the last one shorter), on rayon's threads.
fn in_pieces(len: usize, threads: usize, multiple: usize, f: impl Fn([usize; 2]) + Sync) {
    let piece = len.div_ceil(threads).next_multiple_of(multiple);
    (0..len.div_ceil(piece)).into_par_iter().for_each(|p| {
        let start = p * piece;
        f([start, piece.min(len - start)])
    });
}

/// An operand's pointer, read by parallel tasks.
#[derive(Clone, Copy)]
pub(super) struct In<E>(pub(super) *const E);
impl<E> In<E> {
    /// The pointer (a method, so that closures capture the `Sync` wrapper, not the field).
    pub(super) fn get(self) -> *const E {
        self.0
    }
}
// SAFETY: the operands are only read while the product runs.
unsafe impl<E> Send for In<E> {}
// SAFETY: as above.
unsafe impl<E> Sync for In<E> {}

/// An output's pointer (to f32 values by default, or to bf16 bits or packed pairs), shared by
/// tasks that write disjoint elements.
#[derive(Clone, Copy)]
pub(super) struct Out<E = f32>(pub(super) *mut E);
impl<E> Out<E> {
    /// The pointer (a method, so that closures capture the `Sync` wrapper, not the field).
    pub(super) fn get(self) -> *mut E {
        self.0
    }
}
// SAFETY: every task writes its own elements of the output.
unsafe impl<E> Send for Out<E> {}
// SAFETY: as above.
unsafe impl<E> Sync for Out<E> {}

#[cfg(test)]
mod tests {
    use super::{folds_bias, product, product_with_bias};
    use crate::kernels::avx512::PACK_TRANSPOSED;
    use crate::kernels::simd::LEVEL_CAP;
    use crate::kernels::tests::values;

    #[test]
    fn a_bias_folded_into_the_product_has_the_bits_of_rows_filled_with_it_and_accumulated() {
        if !folds_bias() {
            eprintln!("skipped: this CPU has no AVX-512, so linear layers fill their bias first");
            return;
        }
        // Columns around a tile's 64 and a thread's piece, inner dimensions of none, one block
        // and more than one (of at most 768 steps), rows split by columns and by rows, on one
        // thread and on two.
        for mnk @ [m, n, k] in [[7, 65, 3], [96, 300, 100], [400, 60, 100], [13, 130, 0]]
            .into_iter()
            .chain([[50, 200, 1700]])
        {
            let (lhs, rhs, bias) = (
                values(m * k, 31, 1.0),
                values(k * n, 32, 1.0),
                values(n, 33, 1.0),
            );
            for threads in [1, 2] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let (mut filled, mut folded) = (bias.repeat(m), vec![f32::NAN; m * n]);
                // SAFETY: each operand spans its rows and columns at the strides given, the
                // bias n values; the CPU folds a bias.
                pool.install(|| unsafe {
                    let operands = |dst: &mut Vec<f32>| {
                        (
                            (dst.as_mut_ptr(), n as isize),
                            (lhs.as_ptr(), [k as isize, 1]),
                            (rhs.as_ptr(), [n as isize, 1]),
                        )
                    };
                    let (dst, l, r) = operands(&mut filled);
                    product(mnk, dst, l, r, 1.0, true, true);
                    let (dst, l, r) = operands(&mut folded);
                    product_with_bias(mnk, dst, l, r, bias.as_ptr(), true);
                });
                for (i, (f, g)) in filled.iter().zip(&folded).enumerate() {
                    assert_eq!(
                        f.to_bits(),
                        g.to_bits(),
                        "{mnk:?} on {threads} threads: ({}, {}) is {g}, not {f}",
                        i / n,
                        i % n
                    );
                }
            }
        }
    }

    /// `dst (+)= 0.5 lhs rhs` on a pool of `threads`, with `lhs` stored row-major or
    /// transposed (`lhs_t`) and `rhs` stored row-major or transposed (`rhs_t`), the kernels'
    /// level capped at `level` (2: the AVX-512 product where the CPU has it; 1: `gemm`'s),
    /// the split chosen as on a CPU that packs a transposed `lhs` or not (`packs`).
    #[allow(clippy::too_many_arguments)]
    fn on_threads(
        [m, n, k]: [usize; 3],
        [lhs, rhs, dst]: [&[f32]; 3],
        [lhs_t, rhs_t]: [bool; 2],
        threads: usize,
        accumulate: bool,
        level: u8,
        packs: bool,
    ) -> Vec<f32> {
        let mut dst = dst.to_vec();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let ls = if lhs_t {
            [1, m as isize]
        } else {
            [k as isize, 1]
        };
        let rs = if rhs_t {
            [1, k as isize]
        } else {
            [n as isize, 1]
        };
        // SAFETY: every operand spans its `rows x columns` at the strides given.
        pool.install(|| unsafe {
            LEVEL_CAP.with(|c| c.set(level));
            PACK_TRANSPOSED.with(|p| p.set(Some(packs)));
            product(
                [m, n, k],
                (dst.as_mut_ptr(), n as isize),
                (lhs.as_ptr(), ls),
                (rhs.as_ptr(), rs),
                0.5,
                accumulate,
                true,
            )
        });
        dst
    }

    #[test]
    fn a_product_split_over_threads_has_the_bits_of_one_call_and_the_f64_value() {
        // 300 columns split by columns (pieces of 192 and 108 on two threads, 128, 128 and 44
        // on three); 60 columns split by rows; 200 columns by columns, or by rows where `lhs`
        // is transposed (and larger) on a CPU that packs it (`avx512::packs_transposed`).
        for mnk @ [m, n, k] in [[96, 300, 100], [400, 60, 100], [300, 200, 100]] {
            assert!(m * n * k >= super::PARALLEL_MACS);
            let (lhs, rhs, before) = (
                values(m * k, 11, 1.0),
                values(n * k, 12, 1.0),
                values(m * n, 13, 1.0),
            );
            let operands = [&lhs[..], &rhs, &before];
            let cases = [[false, false], [false, true], [true, false]]
                .into_iter()
                .flat_map(|layout| [false, true].map(|accumulate| (layout, accumulate)))
                .flat_map(|case| [2, 1].map(|level| (level, case)))
                .flat_map(|case| [false, true].map(|packs| (packs, case)));
            for (packs, (level, (layout @ [lhs_t, rhs_t], accumulate))) in cases {
                let on =
                    |threads| on_threads(mnk, operands, layout, threads, accumulate, level, packs);
                let one = on(1);
                for threads in [2, 3] {
                    let split = on(threads);
                    let same = split
                        .iter()
                        .zip(&one)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{mnk:?} {layout:?} level {level}, packs {packs}: {threads} threads, \
                         {accumulate}"
                    );
                }
                let a = |r: usize, j: usize| {
                    if lhs_t {
                        lhs[j * m + r]
                    } else {
                        lhs[r * k + j]
                    }
                };
                let b = |j: usize, c: usize| {
                    if rhs_t {
                        rhs[c * k + j]
                    } else {
                        rhs[j * n + c]
                    }
                };
                for (i, got) in one.iter().enumerate() {
                    let (r, c) = (i / n, i % n);
                    let dot: f64 = (0..k)
                        .map(|j| f64::from(a(r, j)) * f64::from(b(j, c)))
                        .sum();
                    let kept = if accumulate {
                        f64::from(before[i])
                    } else {
                        0.0
                    };
                    let want = 0.5 * dot + kept;
                    assert!(
                        (f64::from(*got) - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "{mnk:?} {layout:?} level {level}, element {i}: {got} against {want}"
                    );
                }
            }
        }
    }
}
