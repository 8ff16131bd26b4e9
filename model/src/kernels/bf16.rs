//! bf16 storage and the bf16 matrix product.
//!
//! A bf16 tensor enters a kernel as f32 (every bf16 value is exactly an f32) and leaves it
//! rounded to the nearest bf16, ties to even. Inside, the kernels compute in f32 as they do
//! for f32 tensors, except the linear layers' products: [`product`] rounds its operands to
//! bf16 and accumulates in f32. On a CPU with AVX512_BF16 it runs on `vdpbf16ps`, which
//! multiplies pairs of bf16 values and adds them into f32 lanes: twice the multiply-adds per
//! instruction of an f32 FMA. Elsewhere the rounded operands go through the f32 product.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::bits::{bits_of, round_into, widen_into};
use super::product::{In, Out, product as f32_product};
use super::simd::multiversion;

/// A vector of `len` elements, each written by `fill`.
pub(crate) fn filled<T>(len: usize, fill: impl FnOnce(&mut [MaybeUninit<T>])) -> Vec<T> {
    let mut out = Vec::with_capacity(len);
    fill(&mut out.spare_capacity_mut()[..len]);
    // SAFETY: every caller's `fill` writes all `len` elements.
    unsafe { out.set_len(len) };
    out
}

/// Elements per parallel piece of [`round_to_bf16`] and [`widen`]: below two pieces they run
/// on the calling thread.
const PIECE: usize = 1 << 15;

/// `f(src piece, out piece)` over matching pieces of `src` and `out`, in parallel where
/// `src` holds two pieces or more.
fn in_pieces<A: Sync, B: Send>(
    src: &[A],
    out: &mut [MaybeUninit<B>],
    f: impl Fn(&[A], &mut [MaybeUninit<B>]) + Sync,
) {
    if src.len() < 2 * PIECE {
        f(src, out)
    } else {
        src.par_chunks(PIECE)
            .zip(out.par_chunks_mut(PIECE))
            .for_each(|(src, out)| f(src, out));
    }
}

/// `x` rounded to bf16, as bits.
#[cfg(test)]
pub(crate) fn round(x: &[f32]) -> Vec<u16> {
    filled(x.len(), |out| in_pieces(x, out, round_into))
}

/// `x` rounded to bf16.
pub(crate) fn round_to_bf16(x: &[f32]) -> Vec<burn::tensor::bf16> {
    filled(x.len(), |out: &mut [MaybeUninit<burn::tensor::bf16>]| {
        // SAFETY: `bf16` is a transparent wrapper of its `u16` bits.
        let out = unsafe { &mut *(out as *mut [MaybeUninit<_>] as *mut [MaybeUninit<u16>]) };
        in_pieces(x, out, round_into)
    })
}

/// bf16 bits widened to f32.
pub(crate) fn widen(bits: &[u16]) -> Vec<f32> {
    filled(bits.len(), |out| in_pieces(bits, out, widen_into))
}

/// Whether bf16 products run on the CPU's bf16 dot-product instructions: AVX512_BF16 is
/// there and `EMBER_BF16_DOT` is not `0` (which measures the path other CPUs take).
pub fn has_bf16_dot() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static CPU: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let cpu = *CPU.get_or_init(|| {
            std::env::var("EMBER_BF16_DOT").as_deref() != Ok("0") && ember_cpu::cpu().avx512_bf16
        });
        super::simd::level_cap() >= 2 && cpu
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether bf16 products run on AMX tiles (`amx`): this process may use them
/// ([`ember_cpu::amx`]), and neither `EMBER_AMX=0` (the `vdpbf16ps` path on the same CPU)
/// nor `EMBER_BF16_DOT=0` (no bf16 instructions at all) is set.
pub fn has_amx() -> bool {
    amx_here().is_ok() && super::simd::level_cap() >= 3
}

/// [`has_amx`] but for the tests' level cap, or why not.
fn amx_here() -> Result<(), &'static str> {
    static AMX: std::sync::OnceLock<Result<(), &'static str>> = std::sync::OnceLock::new();
    *AMX.get_or_init(|| {
        if std::env::var("EMBER_BF16_DOT").as_deref() == Ok("0") {
            Err("EMBER_BF16_DOT=0 is set")
        } else if std::env::var("EMBER_AMX").as_deref() == Ok("0") {
            Err("EMBER_AMX=0 is set")
        } else if cfg!(target_arch = "x86_64") {
            ember_cpu::amx()
        } else {
            Err("AMX is an x86-64 extension")
        }
    })
}

/// The least speed-up of bf16 dot products over f32 FMA, in multiply-adds per second, for
/// which computing in bf16 pays ([`bf16_pays`]): the bf16 path rounds its operands and
/// widens its outputs, so instructions that are only as fast as f32's lose.
pub const BF16_DOT_PAYS_FROM: f64 = 1.5;

/// How this process computes bf16 products, for a run's first lines.
#[derive(Debug, Clone, PartialEq)]
pub enum Bf16Products {
    /// On AMX tiles (`tdpbf16ps`), f32 sums.
    Amx,
    /// On `vdpbf16ps`, measured at this many times the multiply-adds of f32 FMA (`None`:
    /// not measured, `EMBER_BF16_DOT=1`).
    Dot(Option<f64>),
    /// In f32: the reason bf16 arithmetic would not pay here.
    F32(String),
}

impl std::fmt::Display for Bf16Products {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Bf16Products::Amx => write!(
                f,
                "bf16 products on the CPU's AMX tiles (tdpbf16ps), with f32 sums"
            ),
            Bf16Products::Dot(speedup) => {
                write!(
                    f,
                    "bf16 products on the CPU's bf16 dot-product instructions (AVX512_BF16"
                )?;
                if let Some(s) = speedup {
                    write!(
                        f,
                        ", measured here at {s:.2}x the multiply-adds of its f32 FMA"
                    )?;
                }
                write!(f, "), with f32 sums")
            }
            Bf16Products::F32(why) => f.write_str(why),
        }
    }
}

/// How bf16 products run on this CPU: on AMX tiles where [`has_amx`]; else on `vdpbf16ps`
/// where [`has_bf16_dot`] and those reach at least [`BF16_DOT_PAYS_FROM`] times the
/// multiply-adds of the CPU's f32 FMA ([`ember_cpu::bf16_dot_speedup`], measured;
/// `EMBER_BF16_DOT=1` skips the measurement); else in f32, which is then faster.
pub fn bf16_products() -> Bf16Products {
    let amx = amx_here();
    if amx.is_ok() && has_amx() {
        return Bf16Products::Amx;
    }
    if std::env::var("EMBER_BF16_DOT").as_deref() == Ok("0") {
        return Bf16Products::F32("EMBER_BF16_DOT=0 is set".into());
    }
    if has_bf16_dot() && std::env::var("EMBER_BF16_DOT").as_deref() == Ok("1") {
        return Bf16Products::Dot(None);
    }
    let no_amx = match amx {
        Err(why) if ember_cpu::cpu().amx_bf16 => format!("AMX is not used ({why})"),
        _ => "this CPU has no AMX tiles".to_string(),
    };
    match ember_cpu::bf16_dot_speedup() {
        Some(s) if has_bf16_dot() && s >= BF16_DOT_PAYS_FROM => Bf16Products::Dot(Some(s)),
        Some(s) => Bf16Products::F32(format!(
            "{no_amx}, and its bf16 dot products do {s:.2}x the multiply-adds of its f32 FMA \
             (measured), under the {BF16_DOT_PAYS_FROM:.1}x from which they pay"
        )),
        None => Bf16Products::F32(format!(
            "{no_amx} and no bf16 dot-product instructions (AVX512_BF16)"
        )),
    }
}

/// Whether forward and backward should compute in bf16 over bf16 parameters on this CPU
/// ([`bf16_products`] is not f32). Where they should not, bf16 parameters compute in f32,
/// which is faster.
pub fn bf16_pays() -> bool {
    !matches!(bf16_products(), Bf16Products::F32(_))
}

/// A matrix operand of [`product`]: its first element, as f32 values or as bf16 bits.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Src {
    F32(*const f32),
    Bf16(*const u16),
}

/// The elements [`pack`] reads: f32 values (rounded on the way) or bf16 bits.
trait Element: Copy + Send + Sync {
    fn bits(self) -> u16;
    /// `out[i]` = the pair of `src[2i]` (low half) and `src[2i + 1]` (high half).
    fn pair_adjacent(src: &[Self], out: &mut [u32]);
    /// One panel of an operand whose columns are contiguous: `out[q * W + i]` = the pair of
    /// `src[2q cs + i]` and `src[(2q + 1) cs + i]` for `i < rows` (zero past column `k` and
    /// past row `rows`), where `W = out.len() / k.div_ceil(2)`.
    fn pair_columns(src: &[Self], cs: usize, k: usize, rows: usize, out: &mut [u32]);
    /// Pairs of `lo[i]` (low half) and `hi[i]` (high half, zero without `hi`) dealt out in
    /// 16 lanes per panel: lane `i % 16` of panel `i / 16` at `out + i / 16 * panel + i % 16`,
    /// the last panel's lanes past `lo.len()` zero.
    ///
    /// # Safety
    /// Those `lo.len().div_ceil(16)` runs of 16 lanes are writable.
    unsafe fn deal_pairs(lo: &[Self], hi: Option<&[Self]>, out: *mut u32, panel: usize);
    /// Rows `i0..i0 + 32` (fewer at the end) of an operand whose element (i, c) is
    /// `all[i + c cs]`, `k` columns, packed as rows of pairs `stride` apart from `out`, pairs
    /// past `k` zero; or, with `tiles` ([`Pad::tiles`]: `i0` and `stride` multiples of 16),
    /// as the tiles of their bands of 16 rows, rows past the operand's zero.
    ///
    /// # Safety
    /// [`rows16_here`]; those rows of `stride` pairs (their bands, in tiles) are writable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn deal_rows(all: &[Self], dims: [usize; 3], i0: usize, out: (*mut u32, bool));
    /// One band of 16 rows (fewer at the end: `rows`) of an operand whose element (i, c) is
    /// `p[i rs + c]`, `k` columns, packed as its tiles ([`Pad::tiles`]) of `stride` pairs
    /// from `out`, pairs past `k` zero; the band's rows past `rows` are left as they are.
    ///
    /// # Safety
    /// [`rows16_here`]; those elements are readable, and the band's `16 stride` pairs from
    /// `out` are writable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn deal_tiles(p: *const Self, dims: [usize; 4], out: *mut u32);
}

/// Whether [`rows16::deal_rows`] may run here: AVX-512 (F, BW and VL) and the crate's tests
/// not holding kernels to a lower level.
#[cfg(target_arch = "x86_64")]
fn rows16_here() -> bool {
    super::simd::level_cap() >= 2 && ember_cpu::vector() == ember_cpu::Vector::Avx512
}

/// [`Element::deal_rows`] through AVX-512 registers: 16 pairs of 16 rows at a time, each pair's
/// rows loaded as one vector and the 16 x 16 block transposed in registers, so that every
/// row of the block leaves as one store.
#[cfg(target_arch = "x86_64")]
mod rows16 {
    use std::arch::x86_64::*;

    use super::super::avx512::transpose;

    /// Elements that load as 16 lanes of bf16 bits.
    pub(super) trait Lanes: Copy {
        /// The bf16 bits of the `mask`ed elements of the 16 from `p`, in the low halves of
        /// 32-bit lanes (zero elsewhere).
        ///
        /// # Safety
        /// The CPU has AVX-512 F, BW and VL; the masked elements are readable.
        unsafe fn lanes(p: *const Self, mask: __mmask16) -> __m512i;
    }

    impl Lanes for f32 {
        /// [`super::bits_of`] of every lane: ties to even, NaN to `0x7fc0`.
        #[inline(always)]
        unsafe fn lanes(p: *const f32, mask: __mmask16) -> __m512i {
            // SAFETY: as the caller guarantees.
            unsafe {
                let x = _mm512_maskz_loadu_ps(mask, p);
                let b = _mm512_castps_si512(x);
                let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
                let up = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff));
                let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, up));
                let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
                _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0))
            }
        }
    }

    impl Lanes for u16 {
        #[inline(always)]
        unsafe fn lanes(p: *const u16, mask: __mmask16) -> __m512i {
            // SAFETY: as the caller guarantees.
            unsafe { _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p.cast())) }
        }
    }

    /// The first `n` (at most 16) lanes.
    fn first(n: usize) -> __mmask16 {
        (((1u32 << n) - 1) & 0xffff) as __mmask16
    }

    /// [`super::Element::deal_rows`].
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and VL; as for [`super::Element::deal_rows`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn deal_rows<E: Lanes>(
        all: &[E],
        [cs, k, stride]: [usize; 3],
        i0: usize,
        (out, tiles): (*mut u32, bool),
    ) {
        assert!(!tiles || (i0.is_multiple_of(16) && stride.is_multiple_of(16)));
        let rows = (all.len() - (k - 1) * cs - i0).min(32);
        let pairs = k.div_ceil(2);
        let p = all.as_ptr();
        for q0 in (0..stride).step_by(16) {
            let store = first((stride - q0).min(16));
            for h in 0..rows.div_ceil(16) {
                let r0 = i0 + 16 * h;
                let n = (rows - 16 * h).min(16);
                let mask = first(n);
                let mut v = [_mm512_setzero_ps(); 16];
                for (qq, v) in v.iter_mut().enumerate().take(pairs.saturating_sub(q0)) {
                    let q = q0 + qq;
                    // SAFETY: rows r0..r0 + n of columns 2q and 2q + 1 (below k) are in
                    // `all`.
                    let lo = unsafe { E::lanes(p.add(2 * q * cs + r0), mask) };
                    let hi = if 2 * q + 1 < k {
                        // SAFETY: as above.
                        unsafe { E::lanes(p.add((2 * q + 1) * cs + r0), mask) }
                    } else {
                        _mm512_setzero_si512()
                    };
                    *v = _mm512_castsi512_ps(_mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi)));
                }
                // Lanes past the operand's rows were loaded as zeros, so in tiles a band's
                // rows past them are written as the padding.
                for (r, t) in transpose(v)
                    .iter()
                    .take(if tiles { 16 } else { n })
                    .enumerate()
                {
                    let at = if tiles {
                        r0 * stride + q0 * 16 + r * 16
                    } else {
                        (r0 + r) * stride + q0
                    };
                    // SAFETY: pairs q0.. (as many as `store` holds) of row r0 + r (in tiles,
                    // line r of tile q0 / 16 of the band, perhaps a padding row) are
                    // writable, as the caller guarantees.
                    unsafe {
                        _mm512_mask_storeu_epi32(out.add(at).cast(), store, _mm512_castps_si512(*t))
                    };
                }
            }
        }
    }

    /// [`super::Element::deal_tiles`]: each line of a tile (a row's 32 elements) rounded
    /// or taken as bits in two vectors and stored whole, tile after tile.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and VL; as for [`super::Element::deal_tiles`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn deal_tiles<E: Lanes>(
        p: *const E,
        [rs, k, rows, stride]: [usize; 4],
        out: *mut u32,
    ) {
        assert!(rows <= 16 && stride.is_multiple_of(16));
        for q in (0..stride).step_by(16) {
            let c = 2 * q;
            let n = k.saturating_sub(c).min(32);
            let (lo, hi) = (first(n.min(16)), first(n.saturating_sub(16)));
            for r in 0..rows {
                let at = p.wrapping_add(r * rs + c);
                // SAFETY: the masked elements, columns c.. below k of row r, are readable;
                // line r of tile q / 16 is in the band, as the caller guarantees.
                unsafe {
                    let lo = _mm512_cvtepi32_epi16(E::lanes(at, lo));
                    let hi = _mm512_cvtepi32_epi16(E::lanes(at.wrapping_add(16), hi));
                    let line = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                    _mm512_storeu_si512(out.add(q * 16 + r * 16).cast(), line);
                }
            }
        }
    }
}

/// [`Element::deal_pairs`] with `bits` giving an element's bf16 bits.
///
/// # Safety
/// As for [`Element::deal_pairs`].
#[inline(always)]
unsafe fn deal_pairs<E: Copy>(
    lo: &[E],
    hi: Option<&[E]>,
    out: *mut u32,
    panel: usize,
    bits: impl Fn(E) -> u16,
) {
    let whole = lo.len() / 16 * 16;
    for (p, lo16) in lo[..whole].chunks_exact(16).enumerate() {
        let mut lanes = [0u32; 16];
        match hi {
            Some(hi) => {
                let hi16 = &hi[p * 16..][..16];
                for ((l, &a), &b) in lanes.iter_mut().zip(lo16).zip(hi16) {
                    *l = bits(a) as u32 | (bits(b) as u32) << 16;
                }
            }
            None => {
                for (l, &a) in lanes.iter_mut().zip(lo16) {
                    *l = bits(a) as u32;
                }
            }
        }
        // SAFETY: panel p's 16 lanes are writable, as the caller guarantees.
        unsafe {
            out.add(p * panel)
                .cast::<[u32; 16]>()
                .write_unaligned(lanes)
        };
    }
    if whole < lo.len() {
        let mut lanes = [0u32; 16];
        for (i, l) in (whole..lo.len()).zip(&mut lanes) {
            let h = hi.map_or(0, |hi| bits(hi[i]));
            *l = bits(lo[i]) as u32 | (h as u32) << 16;
        }
        // SAFETY: as above, for the last panel.
        unsafe {
            out.add(whole / 16 * panel)
                .cast::<[u32; 16]>()
                .write_unaligned(lanes)
        };
    }
}

multiversion! {
    /// [`deal_pairs`] of f32 values.
    fn deal_pairs_f32(lo: &[f32], hi: Option<&[f32]>, out: Out32, panel: usize) {
        // SAFETY: as the caller of `Element::deal_pairs` guarantees.
        unsafe { deal_pairs(lo, hi, out.0, panel, bits_of) }
    }
}

multiversion! {
    /// [`deal_pairs`] of bf16 bits.
    fn deal_pairs_bits(lo: &[u16], hi: Option<&[u16]>, out: Out32, panel: usize) {
        // SAFETY: as the caller of `Element::deal_pairs` guarantees.
        unsafe { deal_pairs(lo, hi, out.0, panel, |b| b) }
    }
}

/// A pointer to packed pairs, for [`multiversion`]'s safe signatures.
#[derive(Clone, Copy)]
struct Out32(*mut u32);

multiversion! {
    fn pair_adjacent_f32(src: &[f32], out: &mut [u32]) {
        for (o, x) in out.iter_mut().zip(src.chunks_exact(2)) {
            *o = bits_of(x[0]) as u32 | (bits_of(x[1]) as u32) << 16;
        }
    }
}

multiversion! {
    fn pair_adjacent_bits(src: &[u16], out: &mut [u32]) {
        for (o, x) in out.iter_mut().zip(src.chunks_exact(2)) {
            *o = x[0] as u32 | (x[1] as u32) << 16;
        }
    }
}

/// [`Element::pair_columns`] with `bits` giving an element's bf16 bits.
#[inline(always)]
fn pair_columns<E: Copy>(
    src: &[E],
    cs: usize,
    k: usize,
    rows: usize,
    out: &mut [u32],
    bits: impl Fn(E) -> u16,
) {
    let pairs = k.div_ceil(2);
    let width = out.len() / pairs;
    for (q, lanes) in out.chunks_exact_mut(width).enumerate() {
        let lo = &src[2 * q * cs..][..rows];
        if 2 * q + 1 < k {
            let hi = &src[(2 * q + 1) * cs..][..rows];
            for ((o, &a), &b) in lanes.iter_mut().zip(lo).zip(hi) {
                *o = bits(a) as u32 | (bits(b) as u32) << 16;
            }
        } else {
            for (o, &a) in lanes.iter_mut().zip(lo) {
                *o = bits(a) as u32;
            }
        }
        lanes[rows..].fill(0);
    }
}

multiversion! {
    fn pair_columns_f32(src: &[f32], cs: usize, k: usize, rows: usize, out: &mut [u32]) {
        pair_columns(src, cs, k, rows, out, bits_of)
    }
}

multiversion! {
    fn pair_columns_bits(src: &[u16], cs: usize, k: usize, rows: usize, out: &mut [u32]) {
        pair_columns(src, cs, k, rows, out, |b| b)
    }
}

impl Element for f32 {
    fn bits(self) -> u16 {
        bits_of(self)
    }
    fn pair_adjacent(src: &[Self], out: &mut [u32]) {
        pair_adjacent_f32(src, out)
    }
    fn pair_columns(src: &[Self], cs: usize, k: usize, rows: usize, out: &mut [u32]) {
        pair_columns_f32(src, cs, k, rows, out)
    }
    unsafe fn deal_pairs(lo: &[Self], hi: Option<&[Self]>, out: *mut u32, panel: usize) {
        deal_pairs_f32(lo, hi, Out32(out), panel)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn deal_rows(all: &[Self], dims: [usize; 3], i0: usize, out: (*mut u32, bool)) {
        // SAFETY: as the caller guarantees.
        unsafe { rows16::deal_rows(all, dims, i0, out) }
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn deal_tiles(p: *const Self, dims: [usize; 4], out: *mut u32) {
        // SAFETY: as the caller guarantees.
        unsafe { rows16::deal_tiles(p, dims, out) }
    }
}

impl Element for u16 {
    fn bits(self) -> u16 {
        self
    }
    fn pair_adjacent(src: &[Self], out: &mut [u32]) {
        pair_adjacent_bits(src, out)
    }
    fn pair_columns(src: &[Self], cs: usize, k: usize, rows: usize, out: &mut [u32]) {
        pair_columns_bits(src, cs, k, rows, out)
    }
    unsafe fn deal_pairs(lo: &[Self], hi: Option<&[Self]>, out: *mut u32, panel: usize) {
        deal_pairs_bits(lo, hi, Out32(out), panel)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn deal_rows(all: &[Self], dims: [usize; 3], i0: usize, out: (*mut u32, bool)) {
        // SAFETY: as the caller guarantees.
        unsafe { rows16::deal_rows(all, dims, i0, out) }
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn deal_tiles(p: *const Self, dims: [usize; 4], out: *mut u32) {
        // SAFETY: as the caller guarantees.
        unsafe { rows16::deal_tiles(p, dims, out) }
    }
}

/// 64 bytes of packed pairs: one row of an AMX tile, one cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Line([u32; 16]);

/// Packed operands, aligned to cache lines and kept between products to spare the
/// allocation: `len` pairs of `buffer`'s first lines.
#[derive(Default)]
pub(crate) struct Packed(Vec<Line>);

impl Packed {
    /// The first `len` pairs, grown to fit (new lines zeroed once, then reused).
    pub(crate) fn take(&mut self, len: usize) -> &mut [u32] {
        let lines = len.div_ceil(16);
        if self.0.len() < lines {
            self.0.resize(lines, Line([0; 16]));
        }
        // SAFETY: `Line` is 16 `u32` with no padding; `lines` lines hold at least `len`.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast::<u32>(), len) }
    }
}

thread_local! {
    /// The packed operands of this thread's last product.
    static PACKED: std::cell::Cell<(Packed, Packed)> = std::cell::Cell::new(Default::default());
}

/// Runs `f` on this thread's buffers for a product's two packed operands.
pub(crate) fn with_packed<R>(f: impl FnOnce(&mut Packed, &mut Packed) -> R) -> R {
    let (mut a, mut b) = PACKED.take();
    let r = f(&mut a, &mut b);
    PACKED.set((a, b));
    r
}

/// [`product`] on AMX tiles into bf16 bits: `dst = round(init + lhs rhs)` with `init` a row
/// of `n` values added to every row (a linear layer's bias), or `dst = round(lhs rhs)`,
/// each element the bits [`product`] into an f32 output holding copies of `init` (with
/// `accumulate`), or into any output (without), then [`bits_of`], would give. Returns
/// `false`, writing nothing, where bf16 products do not run on AMX tiles or `k` is 0.
///
/// # Safety
/// As for [`product`], `dst` addressing `m` rows of `n` bf16 at its row stride; `init` holds
/// `n` values.
pub(crate) unsafe fn product_bits(
    [m, n, k]: [usize; 3],
    (dst, rs): (*mut u16, isize),
    init: Option<&[f32]>,
    lhs: (Src, [isize; 2]),
    rhs: (Src, [isize; 2]),
    parallel: bool,
) -> bool {
    assert!(init.is_none_or(|init| init.len() >= n));
    #[cfg(target_arch = "x86_64")]
    if has_amx() && k > 0 {
        if m == 0 || n == 0 {
            return true;
        }
        use super::amx::{COLS, Dst, PAIRS, ROWS as AMX_ROWS};
        let rhs_t = (rhs.0, [rhs.1[1], rhs.1[0]]);
        with_packed(|a, b| {
            let a = pack_src::<1>([m, k], lhs, Pad::tiles(AMX_ROWS, PAIRS), a, parallel);
            let b = pack_src::<16>([n, k], rhs_t, Pad::new(COLS, PAIRS), b, parallel);
            let dst = Dst::Bf16 {
                out: Out(dst),
                rs,
                init: init.map(|init| In(init.as_ptr())),
            };
            // SAFETY: as the caller guarantees; the process may use the tiles.
            unsafe { super::amx::product([m, n, k], a, b, dst, 1.0, init.is_some(), parallel) }
        });
        return true;
    }
    let _ = ([m, n, k], dst, rs, lhs, rhs, parallel);
    false
}

/// Whether [`product_bits`] runs here (bf16 products on AMX tiles).
pub(crate) fn products_round_in_place() -> bool {
    cfg!(target_arch = "x86_64") && has_amx()
}

/// `dst = beta * lhs rhs`, or `dst += beta * lhs rhs` when `accumulate`, on the CPU's bf16
/// instructions where it has them: `lhs` and `rhs` rounded to bf16 and the products summed
/// in f32, on AMX tiles ([`super::amx`]) where [`has_amx`], else on `vdpbf16ps` where
/// [`has_bf16_dot`]. Elsewhere it is the f32 product of the operands as given (bf16 bits
/// widened). Arguments as in [`super::product::product`], except that the operands may be
/// bf16 bits and their strides must not be negative.
///
/// # Safety
/// As for [`super::product::product`].
pub(crate) unsafe fn product(
    [m, n, k]: [usize; 3],
    dst: (*mut f32, isize),
    lhs: (Src, [isize; 2]),
    rhs: (Src, [isize; 2]),
    beta: f32,
    accumulate: bool,
    parallel: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    // Column i of rhs is row i of its transpose.
    let rhs_t = (rhs.0, [rhs.1[1], rhs.1[0]]);
    #[cfg(target_arch = "x86_64")]
    if has_amx() && k > 0 {
        use super::amx::{COLS, PAIRS, ROWS as AMX_ROWS};
        with_packed(|a, b| {
            // Rows of lhs in tiles of 16 rows of 16 pairs; columns of rhs in panels of 16 (a
            // tile's 16 lanes of pairs).
            let a = pack_src::<1>([m, k], lhs, Pad::tiles(AMX_ROWS, PAIRS), a, parallel);
            let b = pack_src::<16>([n, k], rhs_t, Pad::new(COLS, PAIRS), b, parallel);
            // SAFETY: as the caller guarantees; the process may use the tiles.
            unsafe {
                super::amx::product(
                    [m, n, k],
                    a,
                    b,
                    super::amx::Dst::F32(Out(dst.0), dst.1),
                    beta,
                    accumulate,
                    parallel,
                )
            }
        });
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_bf16_dot() && k > 0 {
        with_packed(|a, b| {
            let a = pack_src::<MR>([m, k], lhs, Pad::new(MR, 1), a, parallel);
            let b = pack_src::<NR>([n, k], rhs_t, Pad::new(NR, 1), b, parallel);
            // SAFETY: as the caller guarantees; the CPU has AVX512_BF16.
            unsafe {
                dot::product(
                    [m, n, k],
                    a,
                    b,
                    (Out(dst.0), dst.1),
                    beta,
                    accumulate,
                    parallel,
                )
            }
        });
        return;
    }
    let _ = rhs_t;
    // Without bf16 instructions: the f32 product, bf16 operands widened in place of their
    // elements (strides kept).
    let widened = |(p, [rs, cs]): (Src, [isize; 2]), [r, c]: [usize; 2]| match p {
        Src::F32(p) => (None, p),
        Src::Bf16(p) => {
            let len = ((r.max(1) - 1) as isize * rs + (c.max(1) - 1) as isize * cs + 1) as usize;
            // SAFETY: the caller guarantees the operand's last element, at `len - 1` with
            // non-negative strides, is in bounds.
            let v = widen(unsafe { std::slice::from_raw_parts(p, len) });
            let at = v.as_ptr();
            (Some(v), at)
        }
    };
    let (_a, a) = widened(lhs, [m, k]);
    let (_b, b) = widened(rhs, [k, n]);
    // SAFETY: `a` and `b` address the operands' elements at their strides; `dst` as the
    // caller guarantees.
    unsafe {
        f32_product(
            [m, n, k],
            dst,
            (a, lhs.1),
            (b, rhs.1),
            beta,
            accumulate,
            parallel,
        )
    }
}

/// Rows of the output one micro-kernel call computes.
const MR: usize = 8;
/// Columns of the output one micro-kernel call computes (two vectors of 16 lanes).
const NR: usize = 32;
/// Pairs of the inner dimension per cache block.
const KC: usize = 256;
/// Rows per parallel task.
const ROWS: usize = 64;
const _: () = assert!(NR.is_multiple_of(MR));
// [`pack`]'s blocks of `NR` rows are whole bands of AMX tiles.
const _: () = assert!(NR.is_multiple_of(16));

/// How far [`pack`] pads an operand with zeros: its rows to a multiple of `rows`, its pairs
/// (of the inner dimension) to a multiple of `pairs`; and whether its rows of pairs are laid
/// out as AMX tiles.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pad {
    rows: usize,
    pairs: usize,
    tiles: bool,
}

impl Pad {
    pub(crate) const fn new(rows: usize, pairs: usize) -> Self {
        Pad {
            rows,
            pairs,
            tiles: false,
        }
    }

    /// Rows of pairs laid out as the tiles [`super::amx::product`] loads: each band of 16
    /// rows as its tiles of 16 pairs (1 KiB), one after another along the inner dimension.
    /// Both multiples are multiples of 16.
    pub(crate) const fn tiles(rows: usize, pairs: usize) -> Self {
        assert!(rows.is_multiple_of(16) && pairs.is_multiple_of(16));
        Pad {
            rows,
            pairs,
            tiles: true,
        }
    }

    /// `[rows, pairs]` of a packed `rows x k` operand.
    pub(crate) fn dims(self, [rows, k]: [usize; 2]) -> [usize; 2] {
        [
            rows.next_multiple_of(self.rows),
            k.div_ceil(2).next_multiple_of(self.pairs),
        ]
    }
}

/// [`pack`] of either kind of operand into `out`'s buffer, grown to fit; the packed operand.
fn pack_src<const WIDTH: usize>(
    dims: [usize; 2],
    (p, strides): (Src, [isize; 2]),
    pad: Pad,
    out: &mut Packed,
    parallel: bool,
) -> &[u32] {
    let [rows, pairs] = pad.dims(dims);
    let out = out.take(rows * pairs);
    match p {
        Src::F32(p) => pack::<WIDTH, f32>(dims, (p, strides), pad, out, parallel),
        Src::Bf16(p) => pack::<WIDTH, u16>(dims, (p, strides), pad, out, parallel),
    }
    out
}

/// Packs a `rows x k` operand (pointer and [row stride, column stride]) in bf16 pairs along
/// `k`, in panels of `WIDTH` rows: with `[padded, stride] = pad.dims([rows, k])`, the pair of
/// columns `2q` and `2q + 1` of row `i` goes to `out[(i / WIDTH * stride + q) * WIDTH + i %
/// WIDTH]`, or, in [`Pad::tiles`] (`WIDTH` 1), to `out[i / 16 * 16 stride + q / 16 * 256 + i
/// % 16 * 16 + q % 16]`. Every element of `out` (`padded * stride`) is written, padding with
/// zeros. With `parallel`, pieces go to rayon's threads.
fn pack<const WIDTH: usize, E: Element>(
    [rows, k]: [usize; 2],
    (p, [rs, cs]): (*const E, [isize; 2]),
    pad: Pad,
    out: &mut [u32],
    parallel: bool,
) {
    let pairs = k.div_ceil(2);
    let [padded, stride] = pad.dims([rows, k]);
    assert!(pad.rows.is_multiple_of(WIDTH) && NR.is_multiple_of(WIDTH));
    assert!(out.len() == padded * stride);
    assert!(!pad.tiles || WIDTH == 1);
    if out.is_empty() {
        return;
    }
    let tiles = pad.tiles;
    let at = |i: usize, q: usize| {
        if tiles {
            i / 16 * 16 * stride + q / 16 * 256 + i % 16 * 16 + q % 16
        } else {
            (i / WIDTH * stride + q) * WIDTH + i % WIDTH
        }
    };
    // Panels (bands of tiles) past the operand's rows are all padding, as are the rows of
    // the last band past them.
    let filled = rows.next_multiple_of(if tiles { 16 } else { WIDTH }) * stride;
    let (out, past) = out.split_at_mut(filled);
    past.fill(0);
    if tiles {
        for i in rows..rows.next_multiple_of(16) {
            for q in (0..stride).step_by(16) {
                out[at(i, q)..][..16].fill(0);
            }
        }
    }
    let (src, dst) = (In(p), Out(out.as_mut_ptr()));
    // SAFETY (every read below): rows below `rows` and columns below `k` are in bounds, as the
    // caller guarantees.
    let line = |from: isize, len: usize| unsafe {
        std::slice::from_raw_parts(src.get().offset(from), len)
    };
    #[cfg(target_arch = "x86_64")]
    if rs == 1 && cs != 1 && WIDTH == 1 && rows16_here() {
        // A transposed operand packed into rows of pairs (or their tiles): 32 of its rows
        // (columns of the operand as stored, 64 bytes of bf16 each) by 16 pairs at a time,
        // transposed in registers, so that every cache line of the operand is read once.
        let cs = cs as usize;
        // SAFETY: as in the branch below.
        let all = unsafe { std::slice::from_raw_parts(p, (k - 1) * cs + rows) };
        let dst = Out(out.as_mut_ptr());
        let task = |b: usize| {
            // SAFETY: the CPU has AVX-512; rows 32 b.. of `out` (bands 2 b and 2 b + 1 in
            // tiles) are this task's only.
            unsafe { E::deal_rows(all, [cs, k, stride], 32 * b, (dst.get(), tiles)) };
        };
        if parallel && rows * k >= 1 << 15 {
            (0..rows.div_ceil(32)).into_par_iter().for_each(task);
        } else {
            (0..rows.div_ceil(32)).for_each(task);
        }
        return;
    }
    if rs == 1 && cs != 1 && WIDTH == 16 {
        // Each column's rows are contiguous, and panels are as narrow as half a cache line of
        // them: read two columns at a time along their whole length and deal their pairs out
        // to every panel, so that the operand is read once, in order, pairs in parallel.
        let cs = cs as usize;
        // SAFETY: element (i, c) is at `i + c cs` for i < rows and c < k, in bounds as the
        // caller guarantees (strides are not negative); the operand is only read.
        let all = unsafe { std::slice::from_raw_parts(p, (k - 1) * cs + rows) };
        let dst = Out(out.as_mut_ptr());
        let deal = |q: usize| {
            let lo = &all[2 * q * cs..][..rows];
            let hi = (2 * q + 1 < k).then(|| &all[(2 * q + 1) * cs..][..rows]);
            // SAFETY: pair q of every panel's lanes, `at(i, q)` for i < rows.next_multiple_of
            // (16), is in `out` and written by this call only.
            unsafe { E::deal_pairs(lo, hi, dst.get().add(q * 16), stride * 16) };
        };
        if parallel && rows * k >= 1 << 15 {
            (0..pairs).into_par_iter().with_min_len(16).for_each(deal);
        } else {
            (0..pairs).for_each(deal);
        }
        if stride > pairs {
            for panel in out.chunks_mut(16 * stride) {
                panel[16 * pairs..].fill(0);
            }
        }
        return;
    }
    if rs == 1 && cs != 1 && !tiles {
        // Each column's rows are contiguous: every panel is written in one pass from the
        // stretches of its rows in each pair of columns, panels in parallel.
        let cs = cs as usize;
        // SAFETY: element (i, c) is at `i + c cs` for i < rows and c < k, in bounds as the
        // caller guarantees (strides are not negative); the operand is only read.
        let all = unsafe { std::slice::from_raw_parts(p, (k - 1) * cs + rows) };
        let panel = |(c, out): (usize, &mut [u32])| {
            let r0 = c * WIDTH;
            let (out, tail) = out.split_at_mut(WIDTH * pairs);
            E::pair_columns(&all[r0..], cs, k, (rows - r0).min(WIDTH), out);
            tail.fill(0);
        };
        if parallel {
            out.par_chunks_mut(WIDTH * stride)
                .enumerate()
                .for_each(panel);
        } else {
            out.chunks_mut(WIDTH * stride).enumerate().for_each(panel);
        }
        return;
    }
    let block = |b: usize| {
        let (i0, i1) = (b * NR, (b * NR + NR).min(rows));
        let dst = dst.get();
        // SAFETY (every write below): `at(i, q)` for i < rows.next_multiple_of(WIDTH) and q <
        // stride is below `out.len()`, and only this block writes its rows' elements.
        let put = |i: usize, q: usize, v: u32| unsafe { *dst.add(at(i, q)) = v };
        #[cfg(target_arch = "x86_64")]
        if cs == 1 && tiles && rows16_here() {
            // Each row's columns are contiguous: a tile line (32 elements) at a time, tile
            // after tile, so that `out` is written in order.
            for b0 in (i0..i1).step_by(16) {
                let dims = [rs as usize, k, (i1 - b0).min(16), stride];
                // SAFETY: the CPU has AVX-512; rows b0.. below `rows` are in bounds;
                // their band, at `at(b0, 0)`, is this block's only.
                unsafe {
                    E::deal_tiles(src.get().offset(b0 as isize * rs), dims, dst.add(at(b0, 0)))
                };
            }
            return;
        }
        // Tiles from rows without AVX-512 (only where tests hold kernels to a lower level)
        // go element by element below.
        if cs == 1 && !tiles {
            // Each row's columns are contiguous: pair neighbours, a panel's rows at a time,
            // and interleave them.
            PAIRED_ROWS.with_borrow_mut(|tmp| {
                let tmp = tmp.take(if WIDTH == 1 { 0 } else { WIDTH * pairs });
                for p0 in (i0..i1).step_by(WIDTH) {
                    let p1 = (p0 + WIDTH).min(i1);
                    // SAFETY: the panel of rows p0.. is `WIDTH * stride` elements from
                    // `at(p0, 0)`, in bounds and written by this block only.
                    let panel = unsafe {
                        std::slice::from_raw_parts_mut(dst.add(at(p0, 0)), WIDTH * stride)
                    };
                    let (panel, tail) = panel.split_at_mut(WIDTH * pairs);
                    tail.fill(0);
                    let rows_out = if WIDTH == 1 {
                        &mut *panel
                    } else {
                        &mut tmp[..]
                    };
                    for (i, out) in (p0..p1).zip(rows_out.chunks_exact_mut(pairs)) {
                        let row = line(i as isize * rs, k);
                        E::pair_adjacent(row, out);
                        if k % 2 == 1 {
                            out[pairs - 1] = row[k - 1].bits() as u32;
                        }
                    }
                    if WIDTH > 1 {
                        tmp[(p1 - p0) * pairs..].fill(0);
                        lanes_of::<WIDTH>(tmp, pairs, panel);
                    }
                }
            });
            return;
        }
        let value = |i: usize, c: usize| line(i as isize * rs + c as isize * cs, 1)[0];
        for i in i0..i1 {
            for q in 0..pairs {
                let hi = if 2 * q + 1 < k {
                    value(i, 2 * q + 1).bits() as u32
                } else {
                    0
                };
                put(i, q, value(i, 2 * q).bits() as u32 | hi << 16);
            }
            for q in pairs..stride {
                put(i, q, 0);
            }
        }
        // The rows that pad the last panel.
        for i in i1..i1.next_multiple_of(WIDTH) {
            for q in 0..stride {
                put(i, q, 0);
            }
        }
    };
    if parallel {
        (0..rows.div_ceil(NR)).into_par_iter().for_each(block);
    } else {
        (0..rows.div_ceil(NR)).for_each(block);
    }
}

thread_local! {
    /// [`pack`]'s rows of pairs of one panel before they are turned into its lanes, kept
    /// between products: allocated per block of rows, they met on the allocator's one lock
    /// from both threads in attention's per-head products, and the threads queued there.
    static PAIRED_ROWS: std::cell::RefCell<Packed> = std::cell::RefCell::new(Packed::default());
}

/// A panel's rows of pairs turned into its lanes per pair: `panel[q * W + i] = rows[i *
/// pairs + q]` for `i < W` and `q < pairs`. Blocks of 8 x 8 go through AVX2's shuffles
/// where the CPU has them.
fn lanes_of<const W: usize>(rows: &[u32], pairs: usize, panel: &mut [u32]) {
    assert!(rows.len() >= W * pairs && panel.len() >= W * pairs);
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if W.is_multiple_of(8) && ember_cpu::vector() >= ember_cpu::Vector::Avx2 {
        done = pairs / 8 * 8;
        // SAFETY: the CPU has AVX2; the blocks of pairs below `done` are in bounds of both
        // (asserted).
        unsafe { transpose::blocks::<W>(rows, pairs, panel, done) };
    }
    for q in done..pairs {
        for i in 0..W {
            panel[q * W + i] = rows[i * pairs + q];
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod transpose {
    use std::arch::x86_64::*;

    /// [`super::lanes_of`] for the pairs below `end`, a multiple of 8, in blocks of 8 x 8.
    ///
    /// # Safety
    /// The CPU has AVX2; `W` is a multiple of 8; `rows` holds `W * pairs` elements and
    /// `panel` `W * end`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn blocks<const W: usize>(
        rows: &[u32],
        pairs: usize,
        panel: &mut [u32],
        end: usize,
    ) {
        let (src, dst) = (rows.as_ptr(), panel.as_mut_ptr());
        for q0 in (0..end).step_by(8) {
            for i0 in (0..W).step_by(8) {
                let mut r = [_mm256_setzero_si256(); 8];
                for (i, r) in r.iter_mut().enumerate() {
                    // SAFETY: row i0 + i's pairs q0..q0 + 8 are in bounds, as the caller
                    // guarantees.
                    *r = unsafe { _mm256_loadu_si256(src.add((i0 + i) * pairs + q0).cast()) };
                }
                // Pairs of rows interleaved, then pairs of pairs, then the 128-bit halves:
                // out[j] holds pair q0 + j of rows i0..i0 + 8.
                let t = [
                    _mm256_unpacklo_epi32(r[0], r[1]),
                    _mm256_unpackhi_epi32(r[0], r[1]),
                    _mm256_unpacklo_epi32(r[2], r[3]),
                    _mm256_unpackhi_epi32(r[2], r[3]),
                    _mm256_unpacklo_epi32(r[4], r[5]),
                    _mm256_unpackhi_epi32(r[4], r[5]),
                    _mm256_unpacklo_epi32(r[6], r[7]),
                    _mm256_unpackhi_epi32(r[6], r[7]),
                ];
                let u = [
                    _mm256_unpacklo_epi64(t[0], t[2]),
                    _mm256_unpackhi_epi64(t[0], t[2]),
                    _mm256_unpacklo_epi64(t[1], t[3]),
                    _mm256_unpackhi_epi64(t[1], t[3]),
                    _mm256_unpacklo_epi64(t[4], t[6]),
                    _mm256_unpackhi_epi64(t[4], t[6]),
                    _mm256_unpacklo_epi64(t[5], t[7]),
                    _mm256_unpackhi_epi64(t[5], t[7]),
                ];
                let out = [
                    _mm256_permute2x128_si256::<0x20>(u[0], u[4]),
                    _mm256_permute2x128_si256::<0x20>(u[1], u[5]),
                    _mm256_permute2x128_si256::<0x20>(u[2], u[6]),
                    _mm256_permute2x128_si256::<0x20>(u[3], u[7]),
                    _mm256_permute2x128_si256::<0x31>(u[0], u[4]),
                    _mm256_permute2x128_si256::<0x31>(u[1], u[5]),
                    _mm256_permute2x128_si256::<0x31>(u[2], u[6]),
                    _mm256_permute2x128_si256::<0x31>(u[3], u[7]),
                ];
                for (j, o) in out.iter().enumerate() {
                    // SAFETY: lanes i0..i0 + 8 of pair q0 + j are in bounds, as the caller
                    // guarantees.
                    unsafe { _mm256_storeu_si256(dst.add((q0 + j) * W + i0).cast(), *o) };
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod dot {
    use std::arch::x86_64::*;

    use rayon::prelude::*;

    use super::{KC, MR, NR, Out, ROWS};

    /// The product of packed operands: `a` from [`super::rows_of`], `b` from
    /// [`super::panels_of`].
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and BF16; `dst` addresses `m` rows of `n` elements at row
    /// stride `dst.1`, written by no other thread.
    pub(super) unsafe fn product(
        [m, n, k]: [usize; 3],
        a: &[u32],
        b: &[u32],
        (out, rs): (Out, isize),
        beta: f32,
        accumulate: bool,
        parallel: bool,
    ) {
        let pairs = k.div_ceil(2);
        let task = |r0: usize| {
            let r1 = (r0 + ROWS).min(m);
            // SAFETY: rows r0..r1 are this task's; the rest as the caller guarantees.
            unsafe { rows(r0, r1, [n, pairs], a, b, (out, rs), beta, accumulate) };
        };
        if parallel && m * n * k >= 1 << 20 && m > ROWS {
            (0..m.div_ceil(ROWS))
                .into_par_iter()
                .for_each(|t| task(t * ROWS));
        } else {
            (0..m.div_ceil(ROWS)).for_each(|t| task(t * ROWS));
        }
    }

    /// Rows `r0..r1` of the output, block by block of the inner dimension.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn rows(
        r0: usize,
        r1: usize,
        [n, pairs]: [usize; 2],
        a: &[u32],
        b: &[u32],
        (out, rs): (Out, isize),
        beta: f32,
        accumulate: bool,
    ) {
        for q0 in (0..pairs).step_by(KC) {
            let q1 = (q0 + KC).min(pairs);
            let add = accumulate || q0 > 0;
            for j in 0..n.div_ceil(NR) {
                let panel = &b[j * pairs * NR..][..pairs * NR];
                let cols = (n - j * NR).min(NR);
                for r in (r0..r1).step_by(MR) {
                    let tile = &a[r * pairs..][..MR * pairs]; // r is a multiple of MR
                    let acc = tile_product(tile, panel, pairs, q0, q1);
                    // SAFETY: rows r..min(r + MR, r1) and columns j NR..j NR + cols are in
                    // the output.
                    unsafe {
                        let dst = out.0.offset(r as isize * rs + (j * NR) as isize);
                        store(acc, dst, rs, (r1 - r).min(MR), cols, beta, add);
                    }
                }
            }
        }
    }

    /// `MR x NR` sums over pairs `q0..q1` of `tile`'s rows times `panel`'s columns.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    fn tile_product(
        tile: &[u32],
        panel: &[u32],
        pairs: usize,
        q0: usize,
        q1: usize,
    ) -> [[__m512; 2]; MR] {
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        assert!(tile.len() >= MR * pairs && panel.len() >= pairs * NR && q1 <= pairs);
        for q in q0..q1 {
            // SAFETY: q < pairs, so the panel's 32 lanes at q are in bounds (asserted).
            let (b0, b1) = unsafe {
                let p = panel.as_ptr().add(q * NR) as *const __m512i;
                (
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p)),
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p.add(1))),
                )
            };
            for (i, acc) in acc.iter_mut().enumerate() {
                // SAFETY: i < MR and q < pairs (asserted).
                let pair = unsafe { *tile.get_unchecked(q * MR + i) };
                // SAFETY: both are 512 bits of plain data.
                let a = unsafe {
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair as i32))
                };
                acc[0] = _mm512_dpbf16_ps(acc[0], a, b0);
                acc[1] = _mm512_dpbf16_ps(acc[1], a, b1);
            }
        }
        acc
    }

    /// Writes `beta * acc` (added to what is there when `add`) to the first `rows` rows and
    /// `cols` columns at `dst`.
    ///
    /// # Safety
    /// Those elements are in bounds.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn store(
        acc: [[__m512; 2]; MR],
        dst: *mut f32,
        rs: isize,
        rows: usize,
        cols: usize,
        beta: f32,
        add: bool,
    ) {
        let beta = _mm512_set1_ps(beta);
        let masks = [lanes(cols.min(16)), lanes(cols.saturating_sub(16))];
        for (i, acc) in acc.iter().enumerate().take(rows) {
            for (h, &mask) in masks.iter().enumerate() {
                if mask == 0 {
                    continue;
                }
                // SAFETY: the masked lanes are in bounds, as the caller guarantees.
                unsafe {
                    let p = dst.offset(i as isize * rs + 16 * h as isize);
                    let mut v = _mm512_mul_ps(acc[h], beta);
                    if add {
                        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, p));
                    }
                    _mm512_mask_storeu_ps(p, mask, v);
                }
            }
        }
    }

    /// The mask of the first `n` of 16 lanes.
    fn lanes(n: usize) -> __mmask16 {
        ((1u32 << n) - 1) as __mmask16
    }
}

/// How a product rounds its operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Precision {
    /// f32 operands.
    F32,
    /// Operands rounded to bf16, products summed in f32 ([`product`]).
    Bf16,
}

/// [`f32_product`] of f32 operands, or [`product`] of them, as `how` says.
///
/// # Safety
/// As for [`f32_product`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn product_in(
    how: Precision,
    mnk: [usize; 3],
    dst: (*mut f32, isize),
    lhs: (*const f32, [isize; 2]),
    rhs: (*const f32, [isize; 2]),
    beta: f32,
    accumulate: bool,
    parallel: bool,
) {
    // SAFETY: as the caller guarantees.
    unsafe {
        match how {
            Precision::F32 => f32_product(mnk, dst, lhs, rhs, beta, accumulate, parallel),
            Precision::Bf16 => product(
                mnk,
                dst,
                (Src::F32(lhs.0), lhs.1),
                (Src::F32(rhs.0), rhs.1),
                beta,
                accumulate,
                parallel,
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::bits::value_of;
    use crate::kernels::tests::values;

    /// A transposed operand packed in rows of pairs through AVX-512 registers gives the bits
    /// of the plain packing (`pair_columns`, one row per panel) at every edge: rows past each
    /// block of 32 and 16, pairs past each block of 16, odd `k`, and values that round in each
    /// way, ties, NaN, infinities and subnormals; packed as tiles (AMX's lhs), from it, from
    /// its rows and from strided elements, the same pairs in the tiles' order.
    #[test]
    fn transposed_rows_pack_as_the_plain_packing() {
        if !rows16_here() {
            eprintln!("skipped: this CPU has no AVX-512 (F, BW and VL)");
            return;
        }
        let specials = [
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -0.0,
            f32::from_bits(1),
            f32::from_bits(0x807f_ffff),
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
            f32::from_bits(0x7f7f_ffff),
        ];
        for &(rows, k) in &[
            (1, 1),
            (15, 2),
            (16, 31),
            (17, 32),
            (32, 33),
            (33, 65),
            (100, 300),
            (20, 1001),
            (100, 400),
        ] {
            let cs = rows + 3;
            let mut all = values((k - 1) * cs + rows, 5, 3.0);
            for (x, s) in all.iter_mut().step_by(7).zip(specials.iter().cycle()) {
                *x = *s;
            }
            let pad = Pad::new(16, 16);
            let [_, stride] = pad.dims([rows, k]);
            let strides = [1, cs as isize];
            for parallel in [false, true] {
                // `src` packed at kernel level `cap`, from f32 or from its bf16 bits.
                let pack_at = |cap: u8, pad: Pad, (src, strides): (&[f32], [isize; 2]), f32s| {
                    let [padded, stride] = pad.dims([rows, k]);
                    let mut out = vec![u32::MAX; padded * stride];
                    let bits = round(src);
                    crate::kernels::simd::LEVEL_CAP.with(|c| c.set(cap));
                    if f32s {
                        pack::<1, f32>([rows, k], (src.as_ptr(), strides), pad, &mut out, parallel);
                    } else {
                        pack::<1, u16>(
                            [rows, k],
                            (bits.as_ptr(), strides),
                            pad,
                            &mut out,
                            parallel,
                        );
                    }
                    crate::kernels::simd::LEVEL_CAP.with(|c| c.set(3));
                    out
                };
                let packed = |cap: u8, f32s: bool| pack_at(cap, pad, (&all, strides), f32s);
                let plain = packed(1, true);
                assert_eq!(
                    packed(3, true),
                    plain,
                    "f32, {rows} x {k}, parallel {parallel}"
                );
                assert_eq!(
                    packed(3, false),
                    plain,
                    "bits, {rows} x {k}, parallel {parallel}"
                );
                assert_eq!(packed(1, false), plain, "bits plainly, {rows} x {k}");
                // The same rows of pairs in tiles: from the transposed operand (in registers
                // and plainly), from its rows (each row's elements contiguous), and from
                // elements strided both ways.
                let tiles = Pad::tiles(32, 16);
                let [padded, _] = tiles.dims([rows, k]);
                let mut expected = vec![0u32; padded * stride];
                for (i, row) in plain.chunks_exact(stride).enumerate() {
                    for (q, pair) in row.iter().enumerate() {
                        expected[i / 16 * 16 * stride + q / 16 * 256 + i % 16 * 16 + q % 16] =
                            *pair;
                    }
                }
                let row_major: Vec<f32> = (0..rows * k).map(|e| all[e / k + e % k * cs]).collect();
                let wide: Vec<f32> = (0..rows * (2 * k + 1))
                    .map(|e| {
                        row_major[(e / (2 * k + 1) * k + e % (2 * k + 1) / 2).min(rows * k - 1)]
                    })
                    .collect();
                let in_tiles = |cap: u8, src: (&[f32], [isize; 2])| {
                    let out = pack_at(cap, tiles, src, true);
                    let case = format!("tiles of f32 and of bits, {rows} x {k}");
                    assert_eq!(out, pack_at(cap, tiles, src, false), "{case}");
                    out
                };
                for cap in [1, 3] {
                    let case = format!("tiles, {rows} x {k}, parallel {parallel}, level {cap}");
                    assert_eq!(
                        in_tiles(cap, (&all, strides)),
                        expected,
                        "{case}, transposed"
                    );
                    assert_eq!(
                        in_tiles(cap, (&row_major, [k as isize, 1])),
                        expected,
                        "{case}, rows"
                    );
                    let strided = [2 * k as isize + 1, 2];
                    assert_eq!(in_tiles(cap, (&wide, strided)), expected, "{case}, strided");
                }
            }
        }
    }

    #[test]
    fn rounding_is_to_nearest_even() {
        assert_eq!(bits_of(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even 1.
        assert_eq!(bits_of(1.0 + 1.0 / 256.0), 0x3f80);
        // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties go to the even one.
        assert_eq!(bits_of(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(bits_of(1.0 + 1.0 / 256.0 + 1.0 / 65536.0), 0x3f81);
        assert_eq!(bits_of(-2.5), 0xc020);
        assert!(value_of(bits_of(f32::NAN)).is_nan());
        assert_eq!(value_of(bits_of(f32::INFINITY)), f32::INFINITY);
        assert_eq!(widen(&round(&[0.1, -3.0])), [value_of(0x3dcd), -3.0]);
    }

    /// [`product`] against the f64 product for every transpose and shape edge: of the
    /// rounded operands on the bf16 instructions (AMX tiles, then `vdpbf16ps`, where the CPU
    /// has them), of the operands as given on the f32 path; within `2^-20` of the sum of the
    /// magnitudes (f32 accumulation over `k` terms of exactly represented products).
    /// Operands given as bf16 bits give the bits of their f32 values rounded.
    #[test]
    fn product_matches_f64_of_rounded_operands() {
        for cap in [3, 2, 1] {
            crate::kernels::simd::LEVEL_CAP.with(|c| c.set(cap));
            product_at_this_level();
        }
        crate::kernels::simd::LEVEL_CAP.with(|c| c.set(3));
    }

    /// `dst (+)= beta lhs rhs` by [`product`] at the kernels' level `cap`, operands row-major
    /// or transposed as `ta`, `tb` say.
    fn product_at(
        cap: u8,
        [m, n, k]: [usize; 3],
        [a, b, prior]: [&[f32]; 3],
        [ta, tb]: [bool; 2],
        beta: f32,
        accumulate: bool,
    ) -> Vec<f32> {
        crate::kernels::simd::LEVEL_CAP.with(|c| c.set(cap));
        let sa = if ta { [1, m as isize] } else { [k as isize, 1] };
        let sb = if tb { [1, k as isize] } else { [n as isize, 1] };
        let mut got = prior.to_vec();
        // SAFETY: a holds m x k and b k x n under their strides; got is m x n.
        unsafe {
            product(
                [m, n, k],
                (got.as_mut_ptr(), n as isize),
                (Src::F32(a.as_ptr()), sa),
                (Src::F32(b.as_ptr()), sb),
                beta,
                accumulate,
                true,
            );
        }
        crate::kernels::simd::LEVEL_CAP.with(|c| c.set(3));
        got
    }

    /// The AMX product over every tile edge (M, N and K not multiples of 16 or 32, K odd,
    /// more than one parallel task each way) against the f64 product of the rounded operands
    /// and against the `vdpbf16ps` product: within `2^-20` of the sum of the magnitudes of
    /// each (both sum exact products in f32, in different orders). Runs only where this
    /// process may use AMX tiles, and says why it did not elsewhere.
    #[test]
    fn amx_matches_f64_and_the_dot_product_at_every_edge() {
        if !has_amx() {
            eprintln!(
                "skipped: AMX tiles are not used here ({})",
                amx_here().err().unwrap_or("the tests' level cap")
            );
            return;
        }
        let dot = ember_cpu::cpu().avx512_bf16;
        for &[m, n, k] in &[
            [1, 1, 1],
            [16, 16, 32],
            [15, 17, 31],
            [17, 15, 33],
            [31, 33, 63],
            [33, 47, 65],
            [1, 300, 7],
            [300, 1, 9],
            [129, 257, 97],
            [260, 140, 1001],
        ] {
            for (transposes, beta, accumulate) in [
                ([false, false], 1.0, true),
                ([false, true], 1.0, false),
                ([true, false], 0.5, true),
                ([true, true], -0.25, false),
            ] {
                let (a, b) = (values(m * k, 11, 1.0), values(k * n, 12, 1.0));
                let prior = values(m * n, 13, 1.0);
                let on = |cap| {
                    product_at(
                        cap,
                        [m, n, k],
                        [&a, &b, &prior],
                        transposes,
                        beta,
                        accumulate,
                    )
                };
                let amx = on(3);
                let reference = if dot { Some(on(2)) } else { None };
                let [ta, tb] = transposes;
                let at = |v: &[f32], i: usize, l: usize, rows: usize, cols: usize, t: bool| {
                    let x = if t { v[l * rows + i] } else { v[i * cols + l] };
                    value_of(bits_of(x)) as f64
                };
                for i in 0..m {
                    for j in 0..n {
                        let (mut want, mut mag) = (0.0f64, 0.0f64);
                        for l in 0..k {
                            let p = at(&a, i, l, m, k, ta) * at(&b, l, j, k, n, tb) * beta as f64;
                            want += p;
                            mag += p.abs();
                        }
                        let prior = if accumulate {
                            prior[i * n + j] as f64
                        } else {
                            0.0
                        };
                        let tol = (mag + prior.abs() + 1.0) * 2f64.powi(-20);
                        let got = amx[i * n + j] as f64;
                        let case =
                            format!("[{m}, {n}, {k}] {transposes:?} beta {beta} at ({i}, {j})");
                        assert!(
                            (got - (prior + want)).abs() <= tol,
                            "{case}: {got} against {}",
                            prior + want
                        );
                        if let Some(dot) = &reference {
                            let d = dot[i * n + j] as f64;
                            assert!(
                                (got - d).abs() <= 2.0 * tol,
                                "{case}: {got} against vdpbf16ps's {d}"
                            );
                        }
                    }
                }
            }
        }
    }

    fn product_at_this_level() {
        for &[m, n, k] in &[
            [1, 1, 1],
            [8, 32, 2],
            [13, 45, 7],
            [70, 33, 300],
            [130, 97, 257],
            // More than one block of the inner dimension (`KC` pairs).
            [9, 40, 2 * 2 * KC + 3],
        ] {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let (a, b) = (values(m * k, 1, 1.0), values(k * n, 2, 1.0));
                let sa = if ta { [1, m as isize] } else { [k as isize, 1] };
                let sb = if tb { [1, k as isize] } else { [n as isize, 1] };
                let prior = values(m * n, 3, 1.0);
                let mut got = prior.clone();
                // SAFETY: a holds m x k and b k x n under their strides; got is m x n.
                unsafe {
                    product(
                        [m, n, k],
                        (got.as_mut_ptr(), n as isize),
                        (Src::F32(a.as_ptr()), sa),
                        (Src::F32(b.as_ptr()), sb),
                        0.5,
                        true,
                        true,
                    );
                }
                // Operands given as bf16 bits give the bits of their rounded f32 values.
                let (a16, b16) = (round(&a), round(&b));
                let (ra, rb) = (widen(&a16), widen(&b16));
                let mut from_bits = prior.clone();
                let mut from_rounded = prior.clone();
                // SAFETY: as above.
                unsafe {
                    product(
                        [m, n, k],
                        (from_bits.as_mut_ptr(), n as isize),
                        (Src::Bf16(a16.as_ptr()), sa),
                        (Src::Bf16(b16.as_ptr()), sb),
                        0.5,
                        true,
                        true,
                    );
                    product(
                        [m, n, k],
                        (from_rounded.as_mut_ptr(), n as isize),
                        (Src::F32(ra.as_ptr()), sa),
                        (Src::F32(rb.as_ptr()), sb),
                        0.5,
                        true,
                        true,
                    );
                }
                let same =
                    |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same(&from_bits, &from_rounded));
                if has_bf16_dot() {
                    assert!(same(&got, &from_bits), "rounding is the packing's");
                }
                let rounded = has_bf16_dot();
                let at = |v: &[f32], [rs, cs]: [isize; 2], i: usize, j: usize| {
                    let x = v[(i as isize * rs + j as isize * cs) as usize];
                    if rounded {
                        value_of(bits_of(x)) as f64
                    } else {
                        x as f64
                    }
                };
                for i in 0..m {
                    for j in 0..n {
                        let (mut want, mut mag) = (0.0f64, 0.0f64);
                        for l in 0..k {
                            let p = at(&a, sa, i, l) * at(&b, sb, l, j);
                            want += p;
                            mag += p.abs();
                        }
                        let want = prior[i * n + j] as f64 + 0.5 * want;
                        let err = (got[i * n + j] as f64 - want).abs();
                        assert!(
                            err <= (mag + 1.0) * 2f64.powi(-20),
                            "[{m}, {n}, {k}] {ta} {tb} at ({i}, {j}): {} against {want}",
                            got[i * n + j]
                        );
                    }
                }
            }
        }
    }
}
