//! The host kernels on AVX-512F, 16 lanes: per block, the max of `|x|` bit patterns in one
//! sweep, then the reciprocal fast path of `host` (see its module doc for why it is exact) with
//! the IEEE division for any 16 lanes near a tie, while the block is still in L1. Dequantize:
//! widen, convert, multiply (int8) or look `nibble * scale` up in a 16-entry table (int4).
//! It deliberately holds no numerics of its own (constants and proof live in `host`) and uses
//! only `avx512f` instructions: partial chunks go through 16-lane stack buffers instead of
//! masked memory accesses.

use std::arch::x86_64::*;

use super::{
    FINE_BIAS, FINE_MAGIC, NEAR_TIE, ROUND_MAGIC, ROUND_MAGIC_BITS, Write, recip_safe,
    scale_from_bits,
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

/// Chunks of 16 per run of the fast path: each chunk's lanes near a tie are only recorded, and
/// the chunks with any are redone after the run. That keeps their branch out of the hot loop
/// (a mispredict costs about as much as the work on 4 chunks, and data with many exact ties,
/// like the benchmark's, flags 1 chunk in 30).
const RUN: usize = 64;

/// Chunks of 16 quantized together, so their integers are packed with few shuffles.
const WIDE: usize = 8;

/// Quantizes one finite, non-zero-scale block.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn quantize_block<const INT4: bool, const FAST: bool>(q: &Quantizer, x: &[f32], out: &mut [u8]) {
    let per = if INT4 { 8 } else { 16 };
    let whole = x.len() / 16;
    let (x, x_tail) = x.split_at(16 * whole);
    let (out, o_tail) = out.split_at_mut(per * whole);
    if FAST {
        for (xr, or) in x.chunks(16 * RUN).zip(out.chunks_mut(per * RUN)) {
            let mut near = [0u16; RUN];
            let mut xs = xr.chunks_exact(16 * WIDE);
            let mut os = or.chunks_exact_mut(per * WIDE);
            let mut ns = near[..xr.len() / 16].chunks_exact_mut(WIDE);
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
            let mut flags = near
                .iter()
                .enumerate()
                .fold(0u64, |f, (i, &m)| f | u64::from(m != 0) << i);
            while flags != 0 {
                let i = flags.trailing_zeros() as usize;
                flags &= flags - 1;
                let k = q.exact(load_f32(xr[16 * i..16 * (i + 1)].try_into().unwrap()));
                store_ints::<INT4>(&mut or[per * i..per * (i + 1)], k);
            }
        }
    } else {
        for (c, o) in x.chunks_exact(16).zip(out.chunks_exact_mut(per)) {
            store_ints::<INT4>(o, q.exact(load_f32(c.try_into().unwrap())));
        }
    }
    if !x_tail.is_empty() {
        // Zero padding quantizes to 0, so a trailing int4 half byte is 0 as specified.
        let mut c = [0.0f32; 16];
        c[..x_tail.len()].copy_from_slice(x_tail);
        let mut bytes = [0u8; 16];
        store_ints::<INT4>(&mut bytes[..per], q.ints::<FAST>(load_f32(&c)));
        o_tail.copy_from_slice(&bytes[..o_tail.len()]);
    }
}

/// Elements whose block scales are taken before any of them is quantized: small blocks then
/// overlap their scale computations (a chain of max, reduction and two divisions) instead of
/// waiting on each, and 16 KiB of input stays in L1 for the second read.
const GROUP_ELEMS: usize = 4096;

/// `host::HostKernels::quantize_into` on AVX-512F (lengths checked by the caller).
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) fn quantize(
    x: &[f32],
    format: QuantFormat,
    block: BlockSize,
    data: &mut [u8],
    scales: &mut [f32],
) {
    let b = block.get();
    let qmax = format.qmax();
    let per_block = format.data_bytes(b);
    // Blocks are a multiple of 8 elements, so each block's bytes start at a whole byte.
    let group = (GROUP_ELEMS / b).max(1);
    for ((xg, dg), sg) in x
        .chunks(group * b)
        .zip(data.chunks_mut(group * per_block))
        .zip(scales.chunks_mut(group))
    {
        for (chunk, s) in xg.chunks(b).zip(sg.iter_mut()) {
            *s = scale_from_bits(absmax_bits(chunk), qmax);
        }
        for ((chunk, out), &scale) in xg.chunks(b).zip(dg.chunks_mut(per_block)).zip(&*sg) {
            if scale.is_nan() || scale == 0.0 {
                out.fill(0);
                continue;
            }
            let q = Quantizer::new(scale, qmax);
            match (format, recip_safe(scale)) {
                (QuantFormat::Int8, true) => quantize_block::<false, true>(&q, chunk, out),
                (QuantFormat::Int8, false) => quantize_block::<false, false>(&q, chunk, out),
                (QuantFormat::Int4, true) => quantize_block::<true, true>(&q, chunk, out),
                (QuantFormat::Int4, false) => quantize_block::<true, false>(&q, chunk, out),
            }
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
        FROM_ZERO => _mm512_add_ps(_mm512_setzero_ps(), v),
        _ => _mm512_add_ps(load_f32(out), v),
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
const GROUP: usize = 4;

/// `host::HostKernels::dequantize_sum_into` on AVX-512F for non-empty `parts` of one format,
/// block and length (checked by the caller): per block, per group of [`GROUP`] parts, per 16
/// lanes `acc = ((0.0 + p0) + p1) + ...` in part order, as the reference adds.
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
    let per = if INT4 { 8 } else { 16 };
    for (k, out) in out.chunks_mut(b).enumerate() {
        let start = k * per_block;
        for (g, group) in parts.chunks(GROUP).enumerate() {
            let n = group.len();
            let mut data: [&[u8]; GROUP] = [&[]; GROUP];
            let mut scale = [_mm512_setzero_ps(); GROUP];
            let mut table = [_mm512_setzero_ps(); GROUP];
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
                let acc = add_parts::<INT4>(init(o), &data[..n], &scale, &table, i);
                store_f32(o, acc);
            }
            let o = os.into_remainder();
            if !o.is_empty() {
                // Zero-padded copies of the last bytes and outputs, as one whole chunk.
                let mut bytes = [[0u8; 16]; GROUP];
                for (t, d) in bytes.iter_mut().zip(&data[..n]) {
                    t[..d.len() - done].copy_from_slice(&d[done..]);
                }
                let tail: [&[u8]; GROUP] = [&bytes[0], &bytes[1], &bytes[2], &bytes[3]];
                let mut buf = [0.0f32; 16];
                buf[..o.len()].copy_from_slice(o);
                let acc = add_parts::<INT4>(init(&buf), &tail[..n], &scale, &table, 0);
                store_f32(&mut buf, acc);
                o.copy_from_slice(&buf[..o.len()]);
            }
        }
    }
}

/// `acc` plus chunk `i` (16 values) of each part in `data`, in order.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn add_parts<const INT4: bool>(
    mut acc: __m512,
    data: &[&[u8]],
    scale: &[__m512; GROUP],
    table: &[__m512; GROUP],
    i: usize,
) -> __m512 {
    let per = if INT4 { 8 } else { 16 };
    for (j, d) in data.iter().enumerate() {
        let v = values::<INT4>(&d[per * i..per * (i + 1)], scale[j], table[j]);
        acc = _mm512_add_ps(acc, v);
    }
    acc
}
