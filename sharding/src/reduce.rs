//! Whole-tensor reductions in stages no longer than [`SPAN`] elements.
//!
//! Burn's reductions on wgpu (Burn 0.22 over Mesa's lavapipe) lose elements along a long
//! axis: a whole-tensor `sum`, `mean` or `max` of more than 524,288 elements returns the same
//! value whatever follows its first few hundred thousand, and `sum_dim` along an axis of
//! 65,536 or more is wrong too (the tests below, run in CI on lavapipe). A gradient norm over
//! units of 789,760 parameters counted 25-35% of their squares. Reduced in stages, rows of [`SPAN`]
//! elements first, then the rows' results, no axis Burn reduces is longer than [`SPAN`].

use burn::tensor::Tensor;

/// The longest axis a stage reduces.
pub const SPAN: usize = 4096;

/// What a stage computes.
#[derive(Clone, Copy)]
enum Op {
    Sum,
    Max,
}

/// The sum of every element of `t`, as a tensor of one element.
pub fn sum(t: Tensor<1>) -> Tensor<1> {
    staged(t, Op::Sum)
}

/// The largest element of `t`, as a tensor of one element.
pub fn max(t: Tensor<1>) -> Tensor<1> {
    staged(t, Op::Max)
}

fn staged(mut t: Tensor<1>, op: Op) -> Tensor<1> {
    let whole = |t: Tensor<1>| match op {
        Op::Sum => t.sum(),
        Op::Max => t.max(),
    };
    loop {
        let n = t.dims()[0];
        if n <= SPAN {
            return whole(t);
        }
        // Whole rows of SPAN reduced along the rows, the rest (under SPAN) whole.
        let rows = n / SPAN;
        let body = t.clone().slice(0..rows * SPAN).reshape([rows, SPAN]);
        let body = match op {
            Op::Sum => body.sum_dim(1),
            Op::Max => body.max_dim(1),
        }
        .reshape([rows]);
        t = if rows * SPAN < n {
            Tensor::cat(vec![body, whole(t.slice(rows * SPAN..n))], 0)
        } else {
            body
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

    fn read(t: Tensor<1>) -> f64 {
        t.into_data().convert::<f64>().try_to_vec::<f64>().unwrap()[0]
    }

    /// Lengths around every stage's edges: under, at and past one span, whole spans and a
    /// rest, past the lengths Burn's own reductions fail at on lavapipe, and two stages (64
    /// MiB of f32: wgpu binds at most 128 MiB of a buffer by default).
    const LENGTHS: [usize; 7] = [
        1,
        SPAN,
        SPAN + 1,
        3 * SPAN,
        65_537,
        600_001,
        // Two stages of rows, each with a rest.
        SPAN * SPAN + 5 * SPAN + 3,
    ];

    fn values(n: usize) -> Vec<f32> {
        // Growing along the tensor, so that the largest and much of the sum lie at its end.
        (0..n)
            .map(|i| ((i as f32) * 0.37).sin() * (1.0 + 3.0 * i as f32 / n as f32))
            .collect()
    }

    fn check(device: &Device) {
        for n in LENGTHS {
            let v = values(n);
            let t = || Tensor::<1>::from_data(TensorData::new(v.clone(), [n]), device);
            let want_sum: f64 = v.iter().map(|&x| x as f64).sum();
            let want_abs: f64 = v.iter().map(|&x| x.abs() as f64).sum();
            let want_max = v.iter().fold(f32::MIN, |a, &b| a.max(b)) as f64;
            let got_sum = read(sum(t()));
            // f32 sums of at most SPAN terms a stage: within a few units in the last place of
            // the sum of magnitudes per stage.
            let tol = want_abs * 1e-5;
            assert!(
                (got_sum - want_sum).abs() <= tol,
                "{n}: sum {got_sum} against {want_sum}"
            );
            assert_eq!(read(max(t())), want_max, "{n}: max");
        }
    }

    #[test]
    fn staged_reductions_see_every_element_on_the_host() {
        check(&Device::flex());
    }

    #[cfg(feature = "wgpu")]
    #[test]
    fn staged_reductions_see_every_element_on_wgpu() {
        check(&Device::wgpu(burn::tensor::DeviceKind::DefaultDevice));
    }
}
