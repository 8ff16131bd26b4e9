//! Loops compiled once per vector instruction set and picked at run time, and the
//! vectorisable math they use.
//!
//! The binary targets baseline x86-64, so a plain loop gets SSE2 at best. [`multiversion`]
//! compiles a loop body three times (AVX-512, AVX2 + FMA, baseline) and calls the best one
//! the CPU has. Every helper here is `#[inline(always)]` so that it is compiled inside the
//! caller's instruction set, and none uses `mul_add` or reassociation: each version performs
//! the same IEEE operations in the same order, so results do not depend on the CPU.

/// Defines `fn $name(..)` whose body is compiled for AVX-512, for AVX2 + FMA and for the
/// baseline, and runs the best version the CPU supports.
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) {
            #[inline(always)]
            fn body($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,bmi2")]
                unsafe fn v4($($arg: $ty),*) {
                    body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma,bmi2")]
                unsafe fn v3($($arg: $ty),*) {
                    body($($arg),*)
                }
                let level = $crate::kernels::simd::level_cap();
                let vector = ember_cpu::vector();
                if level >= 2 && vector == ember_cpu::Vector::Avx512 {
                    // SAFETY: the CPU has the features `v4` is compiled for.
                    return unsafe { v4($($arg),*) };
                }
                if level >= 1 && vector >= ember_cpu::Vector::Avx2 {
                    // SAFETY: the CPU has the features `v3` is compiled for.
                    return unsafe { v3($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}
pub(crate) use multiversion;

/// The widest version a kernel may pick: 3 (AMX tiles, for bf16 products), 2 (AVX-512), 1
/// (AVX2), 0 (baseline). Always 3 outside this crate's unit tests, which lower it to run
/// every version on one CPU.
#[inline(always)]
pub(crate) fn level_cap() -> u8 {
    #[cfg(test)]
    {
        LEVEL_CAP.with(|c| c.get())
    }
    #[cfg(not(test))]
    {
        3
    }
}

#[cfg(test)]
thread_local! {
    pub(crate) static LEVEL_CAP: std::cell::Cell<u8> = const { std::cell::Cell::new(3) };
}

/// Partial sums kept side by side, so a reduction vectorises without reassociating.
pub(crate) const LANES: usize = 16;

/// `e^x` for f32 within about 1 ulp (Cephes' `expf`: round-to-nearest range reduction by
/// ln 2 and a degree-6 polynomial), branch-free so loops over it vectorise. Inputs are
/// clamped to [-87.3, 88.7]: `e^-87.3` is 1.2e-38, not 0, which is below every use here
/// (a softmax denominator is at least 1). NaN stays NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.3, 88.7);
    let shifted = x * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    // `shifted` is ROUND + n with |n| <= 128, where the f32 spacing is 1: its low bits are n
    // in two's complement, read without a float-to-int cast (Rust's saturating `as i32`
    // does not vectorise). A NaN `x` makes `e` NaN, whatever these bits are.
    let n_bits = shifted.to_bits().wrapping_sub(ROUND.to_bits());
    e * f32::from_bits(n_bits.wrapping_add(127) << 23)
}

/// The sum of `xs`, in [`LANES`] interleaved partial sums added in a fixed order.
#[inline(always)]
pub(crate) fn sum(xs: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            acc[l] += c[l];
        }
    }
    for (l, r) in rest.iter().enumerate() {
        acc[l] += r;
    }
    fold(acc)
}

/// `sum(a[i] * b[i])`, in [`LANES`] interleaved partial sums.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let whole = n / LANES * LANES;
    for (ca, cb) in a[..whole]
        .chunks_exact(LANES)
        .zip(b[..whole].chunks_exact(LANES))
    {
        for l in 0..LANES {
            acc[l] += ca[l] * cb[l];
        }
    }
    for (l, (x, y)) in a[whole..].iter().zip(&b[whole..]).enumerate() {
        acc[l] += x * y;
    }
    fold(acc)
}

/// `sum(a[i] * b[i] * c[i])`, in [`LANES`] interleaved partial sums.
#[inline(always)]
pub(crate) fn dot3(a: &[f32], b: &[f32], c: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let n = a.len().min(b.len()).min(c.len());
    let (a, b, c) = (&a[..n], &b[..n], &c[..n]);
    let whole = n / LANES * LANES;
    for ((ca, cb), cc) in a[..whole]
        .chunks_exact(LANES)
        .zip(b[..whole].chunks_exact(LANES))
        .zip(c[..whole].chunks_exact(LANES))
    {
        for l in 0..LANES {
            acc[l] += ca[l] * cb[l] * cc[l];
        }
    }
    for (l, ((x, y), z)) in a[whole..]
        .iter()
        .zip(&b[whole..])
        .zip(&c[whole..])
        .enumerate()
    {
        acc[l] += x * y * z;
    }
    fold(acc)
}

/// The largest element of `xs` (`-inf` when empty), in [`LANES`] partial maxima.
#[inline(always)]
pub(crate) fn max(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            acc[l] = if c[l] > acc[l] { c[l] } else { acc[l] };
        }
    }
    for (l, r) in rest.iter().enumerate() {
        acc[l] = if *r > acc[l] { *r } else { acc[l] };
    }
    acc.into_iter()
        .fold(f32::NEG_INFINITY, |m, x| if x > m { x } else { m })
}

/// Adds the partial sums pairwise, in the same order on every CPU.
#[inline(always)]
fn fold(mut acc: [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    acc[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_the_libm_exp() {
        let mut worst = 0.0f64;
        for i in -87_000..=88_000 {
            let x = i as f32 * 1e-3 + 1.3e-4;
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(
            worst < 2.0 * f32::EPSILON as f64,
            "worst relative error {worst}"
        );
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(-1000.0) < 1.3e-38);
    }

    #[test]
    fn reductions_match_a_plain_loop() {
        let xs: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
        let ys: Vec<f32> = (0..37).map(|i| (i as f32 * 0.11).cos()).collect();
        let plain_sum: f64 = xs.iter().map(|&x| x as f64).sum();
        let plain_dot: f64 = xs.iter().zip(&ys).map(|(&x, &y)| x as f64 * y as f64).sum();
        assert!((sum(&xs) as f64 - plain_sum).abs() < 1e-5);
        assert!((dot(&xs, &ys) as f64 - plain_dot).abs() < 1e-5);
        let want = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(max(&xs), want);
        assert_eq!(max(&[]), f32::NEG_INFINITY);
    }
}
