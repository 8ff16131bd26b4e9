//! The host kernels on AVX-512 (F and BW), 16 lanes: per group of blocks, the max of `|x|` bit
//! patterns, then the reciprocal fast path of `host` (see its module doc for why it is exact)
//! while the data is still in L1, with the IEEE division redone for any 16 lanes near a tie;
//! 8 chunks of 16 packed together with byte packs. Dequantize: widen, convert, multiply (int8)
//! or look `nibble * scale` up in a 16-entry table (int4); sums add all parts in a register.
//! It deliberately holds no numerics of its own (constants and proof live in `host`) and no
//! masked memory accesses: partial chunks go through 16-lane stack buffers.

use std::arch::x86_64::*;

use super::{
    EXPONENT_BITS, FINE_BIAS, FINE_MAGIC, NEAR_TIE, ROUND_MAGIC, ROUND_MAGIC_BITS, Write,
    recip_safe, scale_from_bits,
};
use crate::quant::{BlockSize, QuantFormat, Quantized};

const SET: u8 = Write::Set as u8;
const FROM_ZERO: u8 = Write::FromZero as u8;
const ADD: u8 = Write::Add as u8;

#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn load_f32(x: &[f32; 16]) -> __m512 {
    // SAFETY: `x` is 16 readable f32s; `loadu` needs no alignment.
    unsafe { _mm512_loadu_ps(x.as_ptr()) }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn store_f32(out: &mut [f32; 16], v: __m512) {
    // SAFETY: `out` is 16 writable f32s; `storeu` needs no alignment.
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), v) }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn load_16_bytes(b: &[u8; 16]) -> __m128i {
    // SAFETY: `b` is 16 readable bytes; `loadu` needs no alignment.
    unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn load_8_bytes(b: &[u8; 8]) -> __m128i {
    // SAFETY: `b` is 8 readable bytes; `loadl_epi64` reads exactly 8, unaligned.
    unsafe { _mm_loadl_epi64(b.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn store_16_bytes(out: &mut [u8; 16], v: __m128i) {
    // SAFETY: `out` is 16 writable bytes; `storeu` needs no alignment.
    unsafe { _mm_storeu_si128(out.as_mut_ptr().cast(), v) }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn store_8_bytes(out: &mut [u8; 8], v: __m128i) {
    // SAFETY: `out` is 8 writable bytes; `storel_epi64` writes exactly 8, unaligned.
    unsafe { _mm_storel_epi64(out.as_mut_ptr().cast(), v) }
}

/// The largest `bits & 0x7fff_ffff` of `x` (unsigned compare: NaN and inf sort above every
/// finite value, as in the reference). Four accumulators hide the `max` latency.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn absmax_bits(x: &[f32]) -> u32 {
    let abs = _mm512_set1_epi32(0x7fff_ffff);
    let lanes =
        |c: &[f32]| _mm512_and_si512(_mm512_castps_si512(load_f32(c.try_into().unwrap())), abs);
    let mut m = [_mm512_setzero_si512(); 4];
    let mut c64 = x.chunks_exact(64);
    for c in &mut c64 {
        for (i, m) in m.iter_mut().enumerate() {
            *m = _mm512_max_epu32(*m, lanes(&c[16 * i..16 * (i + 1)]));
        }
    }
    let mut c16 = c64.remainder().chunks_exact(16);
    for c in &mut c16 {
        m[0] = _mm512_max_epu32(m[0], lanes(c));
    }
    let tail = c16
        .remainder()
        .iter()
        .fold(0u32, |t, v| t.max(v.to_bits() & 0x7fff_ffff));
    let m = _mm512_max_epu32(_mm512_max_epu32(m[0], m[1]), _mm512_max_epu32(m[2], m[3]));
    _mm512_reduce_max_epu32(m).max(tail)
}

/// The lanes of `v` whose exponent field is zero: subnormals and zeros.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn tiny(v: __m512) -> __mmask16 {
    _mm512_testn_epi32_mask(
        _mm512_castps_si512(v),
        _mm512_set1_epi32(EXPONENT_BITS as i32),
    )
}

/// `v` with its subnormal lanes +0: what the reference quantizes them as.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn zero_subnormals(v: __m512) -> __m512 {
    _mm512_maskz_mov_ps(!tiny(v), v)
}

/// `v` with its subnormal lanes made zeros of their sign (`reference::flush`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn flush(v: __m512) -> __m512 {
    let bits = _mm512_castps_si512(v);
    let sign = _mm512_set1_epi32(0x8000_0000u32 as i32);
    _mm512_castsi512_ps(_mm512_mask_and_epi32(bits, tiny(v), bits, sign))
}

/// One block's constants, broadcast.
struct Quantizer {
    scale: __m512,
    recip: __m512,
    qmax: __m512i,
}

impl Quantizer {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn new(scale: f32, qmax: f32) -> Self {
        Self {
            scale: _mm512_set1_ps(scale),
            recip: _mm512_set1_ps(1.0 / scale),
            qmax: _mm512_set1_epi32(qmax as i32),
        }
    }

    /// The reciprocal path (`host` module doc): each lane's integer, valid outside the
    /// returned mask of lanes near a tie.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn fast(&self, v: __m512) -> (__m512i, __mmask16) {
        // A subnormal lane needs no zeroing here (`host` module doc): it rounds to 0.
        let a = _mm512_add_ps(_mm512_mul_ps(v, self.recip), _mm512_set1_ps(FINE_MAGIC));
        let g = _mm512_add_epi32(_mm512_castps_si512(a), _mm512_set1_epi32(FINE_BIAS));
        let near = _mm512_testn_epi32_mask(g, _mm512_set1_epi32(NEAR_TIE));
        // Arithmetic shift: the packs need the integer's sign.
        (_mm512_srai_epi32::<12>(g), near)
    }

    /// The reference's integers, by IEEE division, rounding and clamping.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn exact(&self, v: __m512) -> __m512i {
        let v = zero_subnormals(v);
        let a = _mm512_add_ps(_mm512_div_ps(v, self.scale), _mm512_set1_ps(ROUND_MAGIC));
        let k = _mm512_sub_epi32(_mm512_castps_si512(a), _mm512_set1_epi32(ROUND_MAGIC_BITS));
        let neg = _mm512_sub_epi32(_mm512_setzero_si512(), self.qmax);
        _mm512_max_epi32(_mm512_min_epi32(k, self.qmax), neg)
    }

    /// `fast`, or `exact` if any lane is near a tie.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn ints<const FAST: bool>(&self, v: __m512) -> __m512i {
        if FAST {
            let (k, near) = self.fast(v);
            if near == 0 {
                return k;
            }
        }
        self.exact(v)
    }
}

/// Elements `2j` and `2j + 1` (one 64-bit lane) into byte `j`: `2j`'s nibble low, `2j + 1`'s
/// high. Returns 8 bytes in the low half.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn pack_nibbles(k: __m512i) -> __m128i {
    // Bits 32..35 (element 2j + 1's nibble) move to bits 4..7; the bitwise select
    // `0x0f ? k : hi` (truth table 0xca) keeps element 2j's nibble below them.
    let hi = _mm512_srli_epi64::<28>(k);
    let b = _mm512_ternarylogic_epi64::<0xca>(_mm512_set1_epi64(0x0f), k, hi);
    _mm512_cvtepi64_epi8(b)
}

/// Stores 16 integers as int8 (16 bytes) or int4 (8 bytes).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn store_ints<const INT4: bool>(out: &mut [u8], k: __m512i) {
    if INT4 {
        store_8_bytes(out.try_into().unwrap(), pack_nibbles(k));
    } else {
        store_16_bytes(out.try_into().unwrap(), _mm512_cvtepi32_epi8(k));
    }
}

/// 64 int8s (4 vectors of 16 `i32` in `[-127, 127]`) as 64 bytes in element order: two
/// saturating packs (exact here) interleave the vectors per 128-bit lane, so lane `L` holds
/// 4-byte chunk `L` of vectors 0..4; one dword permutation (a 4x4 transpose) restores order.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn pack_i8(k: &[__m512i; 4]) -> __m512i {
    let a = _mm512_packs_epi32(k[0], k[1]);
    let b = _mm512_packs_epi32(k[2], k[3]);
    let bytes = _mm512_packs_epi16(a, b);
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_epi32(order, bytes)
}

/// 128 int4s (8 vectors in `[-7, 7]`) as 64 bytes in element order. The int8 packs keep
/// elements `2j, 2j + 1` adjacent, so `maddubs` of their nibbles with `(1, 16)` makes each
/// byte pair one 16-bit `lo | hi << 4` (at most 255: exact); `packus` narrows those to bytes,
/// leaving lane `L` with 2-byte chunk `L` of vectors 0..8; one word permutation restores order.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn pack_i4(k: &[__m512i; 8]) -> __m512i {
    let nib = _mm512_set1_epi8(0x0f);
    let weights = _mm512_set1_epi16(0x1001); // bytes (1, 16)
    let pairs = |k: &[__m512i]| {
        let a = _mm512_packs_epi32(k[0], k[1]);
        let b = _mm512_packs_epi32(k[2], k[3]);
        let bytes = _mm512_and_si512(_mm512_packs_epi16(a, b), nib);
        _mm512_maddubs_epi16(bytes, weights)
    };
    let bytes = _mm512_packus_epi16(pairs(&k[..4]), pairs(&k[4..]));
    let order = _mm512_set_epi16(
        31, 23, 15, 7, 30, 22, 14, 6, 29, 21, 13, 5, 28, 20, 12, 4, 27, 19, 11, 3, 26, 18, 10, 2,
        25, 17, 9, 1, 24, 16, 8, 0,
    );
    _mm512_permutexvar_epi16(order, bytes)
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn store_64_bytes(out: &mut [u8], v: __m512i) {
    let out: &mut [u8; 64] = out.try_into().unwrap();
    // SAFETY: `out` is 64 writable bytes; `storeu` needs no alignment.
    unsafe { _mm512_storeu_si512(out.as_mut_ptr().cast(), v) }
}

/// Chunks of 16 quantized together, so their integers are packed with few shuffles.
const WIDE: usize = 8;

/// Elements per segment, the unit of the fast path: its blocks' scales are taken first (small
/// blocks then overlap their chains of max, reduction and two divisions instead of waiting on
/// each, and 16 KiB of input stays in L1 for the second read); each chunk of 16's lanes near a
/// tie are only recorded, and the chunks with any are redone after the segment. That keeps the
/// fallback's branch out of the hot loop (a mispredict costs about as much as the work on 4
/// chunks, and data with many exact ties, like the benchmark's, flags 1 chunk in 30).
const SEG: usize = 4096;

/// Chunks of 16 per segment.
const SEG_CHUNKS: usize = SEG / 16;

/// Quantizes a block by chunks of 16, falling back to the division chunk by chunk (`FAST`)
/// or dividing throughout: blocks whose length is not a multiple of 16 or whose scale is not
/// [`recip_safe`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn quantize_block<const INT4: bool, const FAST: bool>(q: &Quantizer, x: &[f32], out: &mut [u8]) {
    let per = if INT4 { 8 } else { 16 };
    let mut xs = x.chunks_exact(16);
    let mut os = out.chunks_exact_mut(per);
    for (c, o) in (&mut xs).zip(&mut os) {
        store_ints::<INT4>(o, q.ints::<FAST>(load_f32(c.try_into().unwrap())));
    }
    quantize_tail::<INT4, FAST>(q, xs.remainder(), os.into_remainder());
}

/// The last `x.len() < 16` elements of a buffer, through a zero-padded chunk (zeros quantize
/// to 0, so a trailing int4 half byte is 0 as specified).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn quantize_tail<const INT4: bool, const FAST: bool>(q: &Quantizer, x: &[f32], out: &mut [u8]) {
    if x.is_empty() {
        return;
    }
    let mut c = [0.0f32; 16];
    c[..x.len()].copy_from_slice(x);
    let mut bytes = [0u8; 16];
    let per = if INT4 { 8 } else { 16 };
    store_ints::<INT4>(&mut bytes[..per], q.ints::<FAST>(load_f32(&c)));
    out.copy_from_slice(&bytes[..out.len()]);
}

/// Quantizes one segment: whole blocks of `b` elements (a multiple of 16; the buffer's last
/// block may be shorter) with their `scales`, or part of one block longer than [`SEG`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn quantize_segment<const INT4: bool>(
    x: &[f32],
    out: &mut [u8],
    scales: &[f32],
    b: usize,
    qmax: f32,
) {
    let per = if INT4 { 8 } else { 16 };
    // Chunk i of the segment starts at element 16 i: blocks are whole chunks.
    let mut near = [0u16; SEG_CHUNKS];
    let blocks = x.chunks(b).zip(out.chunks_mut(per * b / 16));
    for (((xb, ob), &s), nb) in blocks.zip(scales).zip(near.chunks_mut(b / 16)) {
        if s.is_nan() || s == 0.0 {
            ob.fill(0);
            continue;
        }
        let q = Quantizer::new(s, qmax);
        if !recip_safe(s) {
            quantize_block::<INT4, false>(&q, xb, ob);
            continue;
        }
        let whole = xb.len() / 16;
        let (xb, x_tail) = xb.split_at(16 * whole);
        let (ob, o_tail) = ob.split_at_mut(per * whole);
        let mut xs = xb.chunks_exact(16 * WIDE);
        let mut os = ob.chunks_exact_mut(per * WIDE);
        let mut ns = nb[..whole].chunks_exact_mut(WIDE);
        for ((xw, ow), nw) in (&mut xs).zip(&mut os).zip(&mut ns) {
            let mut k = [_mm512_setzero_si512(); WIDE];
            for ((c, k), n) in xw.chunks_exact(16).zip(&mut k).zip(nw) {
                (*k, *n) = q.fast(load_f32(c.try_into().unwrap()));
            }
            if INT4 {
                store_64_bytes(ow, pack_i4(&k));
            } else {
                let (lo, hi) = k.split_at(4);
                store_64_bytes(&mut ow[..64], pack_i8(lo.try_into().unwrap()));
                store_64_bytes(&mut ow[64..], pack_i8(hi.try_into().unwrap()));
            }
        }
        let rest = xs.remainder().chunks_exact(16);
        let o_rest = os.into_remainder().chunks_exact_mut(per);
        for ((c, o), n) in rest.zip(o_rest).zip(ns.into_remainder()) {
            let (k, m) = q.fast(load_f32(c.try_into().unwrap()));
            store_ints::<INT4>(o, k);
            *n = m;
        }
        quantize_tail::<INT4, true>(&q, x_tail, o_tail);
    }
    for (w, mut flags) in nonzero(&near).into_iter().enumerate() {
        while flags != 0 {
            let i = 64 * w + flags.trailing_zeros() as usize;
            flags &= flags - 1;
            let q = Quantizer::new(scales[16 * i / b], qmax);
            let k = q.exact(load_f32(x[16 * i..16 * (i + 1)].try_into().unwrap()));
            store_ints::<INT4>(&mut out[per * i..per * (i + 1)], k);
        }
    }
}

/// Bit `i % 64` of word `i / 64` set for each non-zero `near[i]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn nonzero(near: &[u16; SEG_CHUNKS]) -> [u64; SEG_CHUNKS / 64] {
    let mut words = [0u64; SEG_CHUNKS / 64];
    for (j, c) in near.chunks_exact(32).enumerate() {
        let c: &[u16; 32] = c.try_into().unwrap();
        // SAFETY: `c` is 32 readable u16s (64 bytes); `loadu` needs no alignment.
        let v = unsafe { _mm512_loadu_si512(c.as_ptr().cast()) };
        words[j / 2] |= u64::from(_mm512_test_epi16_mask(v, v)) << (32 * (j % 2));
    }
    words
}

/// `host::HostKernels::quantize_into` on AVX-512 (lengths checked by the caller).
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) fn quantize(
    x: &[f32],
    format: QuantFormat,
    block: BlockSize,
    data: &mut [u8],
    scales: &mut [f32],
) {
    match format {
        QuantFormat::Int8 => quantize_as::<false>(x, block.get(), data, scales),
        QuantFormat::Int4 => quantize_as::<true>(x, block.get(), data, scales),
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn quantize_as<const INT4: bool>(x: &[f32], b: usize, data: &mut [u8], scales: &mut [f32]) {
    let format = if INT4 {
        QuantFormat::Int4
    } else {
        QuantFormat::Int8
    };
    let qmax = format.qmax();
    let per = if INT4 { 8 } else { 16 };
    // Blocks are a multiple of 8 elements, so each block's bytes start at a whole byte.
    let per_block = if INT4 { b / 2 } else { b };
    if !b.is_multiple_of(16) {
        // Blocks of 8 + 16 j: not whole chunks, so no segments (a rare choice of block).
        for ((xb, ob), s) in x.chunks(b).zip(data.chunks_mut(per_block)).zip(scales) {
            *s = scale_from_bits(absmax_bits(xb), format);
            let q = Quantizer::new(*s, qmax);
            if s.is_nan() || *s == 0.0 {
                ob.fill(0);
            } else if recip_safe(*s) {
                quantize_block::<INT4, true>(&q, xb, ob);
            } else {
                quantize_block::<INT4, false>(&q, xb, ob);
            }
        }
        return;
    }
    // Whole blocks up to SEG elements per group, or one block split into segments.
    let group = (SEG / b).max(1);
    for ((xg, dg), sg) in x
        .chunks(group * b)
        .zip(data.chunks_mut(group * per_block))
        .zip(scales.chunks_mut(group))
    {
        for (xb, s) in xg.chunks(b).zip(sg.iter_mut()) {
            *s = scale_from_bits(absmax_bits(xb), format);
        }
        for (xs, ds) in xg.chunks(SEG).zip(dg.chunks_mut(per * SEG_CHUNKS)) {
            quantize_segment::<INT4>(xs, ds, sg, b, qmax);
        }
    }
}

/// Puts 16 dequantized values into `out` as `W` says.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn put<const W: u8>(out: &mut [f32; 16], v: __m512) {
    let v = match W {
        SET => v,
        // `0.0 + v` is not `v` for -0.0; the compiler keeps the add.
        // `v` is an exact product, zero or normal: nothing to flush.
        FROM_ZERO => _mm512_add_ps(_mm512_setzero_ps(), v),
        _ => flush(_mm512_add_ps(load_f32(out), v)),
    };
    store_f32(out, v);
}

/// 16 dequantized values from `bytes` (16 for int8, 8 for int4) of one block.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn values<const INT4: bool>(bytes: &[u8], scale: __m512, table: __m512) -> __m512 {
    if INT4 {
        // Each byte twice, widened to 32 bits; odd lanes shifted down to their high nibble.
        // `permutexvar` reads only the low 4 bits of each index: the nibble.
        let b = load_8_bytes(bytes.try_into().unwrap());
        let twice = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
        let shift = _mm512_set1_epi64(4 << 32);
        _mm512_permutexvar_ps(_mm512_srlv_epi32(twice, shift), table)
    } else {
        let k = _mm512_cvtepi8_epi32(load_16_bytes(bytes.try_into().unwrap()));
        _mm512_mul_ps(_mm512_cvtepi32_ps(k), scale)
    }
}

/// The value of each nibble 0..16 as the reference reads it (two's complement).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn nibbles() -> __m512 {
    _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0,
    )
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn dequantize_as<const INT4: bool, const W: u8>(q: &Quantized, out: &mut [f32]) {
    let b = q.block.get();
    let per = if INT4 { 8 } else { 16 };
    for ((out, data), &s) in out
        .chunks_mut(b)
        .zip(q.data.chunks(q.format.data_bytes(b)))
        .zip(&q.scales)
    {
        let scale = _mm512_set1_ps(s);
        // `nibble * scale` by the same multiply as the reference, once per block.
        let table = _mm512_mul_ps(nibbles(), scale);
        let mut os = out.chunks_exact_mut(16);
        let mut ds = data.chunks_exact(per);
        for (o, d) in (&mut os).zip(&mut ds) {
            put::<W>(o.try_into().unwrap(), values::<INT4>(d, scale, table));
        }
        let o = os.into_remainder();
        if !o.is_empty() {
            let d = ds.remainder();
            let mut bytes = [0u8; 16];
            bytes[..d.len()].copy_from_slice(d);
            let mut buf = [0.0f32; 16];
            buf[..o.len()].copy_from_slice(o);
            put::<W>(&mut buf, values::<INT4>(&bytes[..per], scale, table));
            o.copy_from_slice(&buf[..o.len()]);
        }
    }
}

/// `q` dequantized into `out` as `write` says, on AVX-512F (lengths checked by the caller).
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) fn dequantize(q: &Quantized, out: &mut [f32], write: Write) {
    match (q.format, write) {
        (QuantFormat::Int8, Write::Set) => dequantize_as::<false, SET>(q, out),
        (QuantFormat::Int8, Write::FromZero) => dequantize_as::<false, FROM_ZERO>(q, out),
        (QuantFormat::Int8, Write::Add) => dequantize_as::<false, ADD>(q, out),
        (QuantFormat::Int4, Write::Set) => dequantize_as::<true, SET>(q, out),
        (QuantFormat::Int4, Write::FromZero) => dequantize_as::<true, FROM_ZERO>(q, out),
        (QuantFormat::Int4, Write::Add) => dequantize_as::<true, ADD>(q, out),
    }
}

/// Parts summed per sweep over a block of the output: each adds its values to the running sum
/// in a register, so the output is written once per group instead of once per part.
const SUM_GROUP: usize = 4;

/// `host::HostKernels::dequantize_sum_into` on AVX-512F for non-empty `parts` of one format,
/// block and length (checked by the caller): per block, per group of [`SUM_GROUP`] parts, per 16
/// lanes `acc = ((0.0 + p0) + p1) + ...` in part order, each partial sum flushed, as the
/// reference adds.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) fn dequantize_sum(parts: &[Quantized], out: &mut [f32]) {
    match parts[0].format {
        QuantFormat::Int8 => dequantize_sum_as::<false>(parts, out),
        QuantFormat::Int4 => dequantize_sum_as::<true>(parts, out),
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn dequantize_sum_as<const INT4: bool>(parts: &[Quantized], out: &mut [f32]) {
    let b = parts[0].block.get();
    let per_block = parts[0].format.data_bytes(b);
    for (k, out) in out.chunks_mut(b).enumerate() {
        // Scales of at least 2^-110 keep every sum a multiple of 2^-125 or coarser: zero or
        // normal. Only a block with a smaller scale can produce a subnormal to flush.
        if parts.iter().all(|p| p.scales[k] >= NO_FLUSH_SCALE) {
            dequantize_sum_block::<INT4, false>(parts, out, k, per_block);
        } else {
            dequantize_sum_block::<INT4, true>(parts, out, k, per_block);
        }
    }
}

/// The smallest scale whose products and their sums need no flush (`dequantize_sum_as`): a
/// 16-bit scale `m * 2^e` of at least `2^-110` has `e >= -125`.
const NO_FLUSH_SCALE: f32 = f32::from_bits((127 - 110) << 23);

/// Block `k` of every part summed into `out`, flushing each sum if `FLUSH`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn dequantize_sum_block<const INT4: bool, const FLUSH: bool>(
    parts: &[Quantized],
    out: &mut [f32],
    k: usize,
    per_block: usize,
) {
    let per = if INT4 { 8 } else { 16 };
    {
        let start = k * per_block;
        for (g, group) in parts.chunks(SUM_GROUP).enumerate() {
            let n = group.len();
            let mut data: [&[u8]; SUM_GROUP] = [&[]; SUM_GROUP];
            let mut scale = [_mm512_setzero_ps(); SUM_GROUP];
            let mut table = [_mm512_setzero_ps(); SUM_GROUP];
            for (j, p) in group.iter().enumerate() {
                data[j] = &p.data[start..p.data.len().min(start + per_block)];
                scale[j] = _mm512_set1_ps(p.scales[k]);
                table[j] = _mm512_mul_ps(nibbles(), scale[j]);
            }
            // The first group starts from 0.0 (so -0.0 sums to +0.0, as in the reference).
            let init = |o: &[f32; 16]| {
                if g == 0 {
                    _mm512_setzero_ps()
                } else {
                    load_f32(o)
                }
            };
            let done = per * (out.len() / 16);
            let mut os = out.chunks_exact_mut(16);
            for (i, o) in (&mut os).enumerate() {
                let o: &mut [f32; 16] = o.try_into().unwrap();
                let acc = add_parts::<INT4, FLUSH>(init(o), &data[..n], &scale, &table, i);
                store_f32(o, acc);
            }
            let o = os.into_remainder();
            if !o.is_empty() {
                // Zero-padded copies of the last bytes and outputs, as one whole chunk.
                let mut bytes = [[0u8; 16]; SUM_GROUP];
                for (t, d) in bytes.iter_mut().zip(&data[..n]) {
                    t[..d.len() - done].copy_from_slice(&d[done..]);
                }
                let tail: [&[u8]; SUM_GROUP] = std::array::from_fn(|j| &bytes[j][..]);
                let mut buf = [0.0f32; 16];
                buf[..o.len()].copy_from_slice(o);
                let acc = add_parts::<INT4, FLUSH>(init(&buf), &tail[..n], &scale, &table, 0);
                store_f32(&mut buf, acc);
                o.copy_from_slice(&buf[..o.len()]);
            }
        }
    }
}

/// `acc` plus chunk `i` (16 values) of each part in `data`, in order.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn add_parts<const INT4: bool, const FLUSH: bool>(
    mut acc: __m512,
    data: &[&[u8]],
    scale: &[__m512; SUM_GROUP],
    table: &[__m512; SUM_GROUP],
    i: usize,
) -> __m512 {
    let per = if INT4 { 8 } else { 16 };
    for (j, d) in data.iter().enumerate() {
        let v = values::<INT4>(&d[per * i..per * (i + 1)], scale[j], table[j]);
        acc = _mm512_add_ps(acc, v);
        if FLUSH {
            acc = flush(acc);
        }
    }
    acc
}
