//! The fused `flex` kernels against Burn's composed ops: each fused op in f32 (forward and
//! every input's gradient) agrees with the same op composed from Burn's ops in f64, which
//! the model's finite-difference test checks.

mod common;

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use common::{leaf, rel_err, to_f64, values};
use ember_model::kernels::{
    causal_attention, gelu_tanh, layer_norm, linear, softmax_cross_entropy, uses_fused_kernels,
};

/// Runs `op` on f32 leaves (the fused path) and on f64 leaves (Burn's composed ops), takes
/// the gradient of `sum(op(inputs) * w)`, and checks output and gradients within `tol`.
fn check<const D: usize, const E: usize>(
    name: &str,
    inputs: &[(Vec<f64>, [usize; D])],
    out_shape: [usize; E],
    op: impl Fn(&[Tensor<D>]) -> Tensor<E>,
    tol: f64,
) {
    let w = values(out_shape.iter().product(), 99, 1.0);
    let run = |dtype: DType| {
        let leaves: Vec<Tensor<D>> = inputs
            .iter()
            .map(|(v, s)| leaf(v, *s, Device::flex(), dtype))
            .collect();
        assert_eq!(uses_fused_kernels(&leaves[0]), dtype == DType::F32);
        let out = op(&leaves);
        assert_eq!(out.dims(), out_shape, "{name}: output shape");
        assert_eq!(out.dtype(), dtype, "{name}: output dtype");
        let weights = leaf(&w, out_shape, Device::flex(), dtype).detach();
        let grads = (out.clone() * weights).sum().backward();
        let grads: Vec<Vec<f64>> = leaves
            .iter()
            .map(|l| to_f64(l.grad(&grads).expect("every input gets a gradient")))
            .collect();
        (to_f64(out.detach()), grads)
    };
    let (fused_out, fused_grads) = run(DType::F32);
    let (want_out, want_grads) = run(DType::F64);
    let err = rel_err(&fused_out, &want_out);
    assert!(err < tol, "{name}: output differs by {err:e}");
    for (i, (g, want)) in fused_grads.iter().zip(&want_grads).enumerate() {
        let err = rel_err(g, want);
        assert!(
            err < tol,
            "{name}: gradient of input {i} differs by {err:e}"
        );
    }
}

#[test]
fn fused_gelu_matches_the_composed_op() {
    let x = values(3 * 5 * 37, 1, 6.0);
    check(
        "gelu",
        &[(x, [3, 5, 37])],
        [3, 5, 37],
        |t| gelu_tanh(t[0].clone()),
        2e-6,
    );
}

#[test]
fn fused_layer_norm_matches_the_composed_op() {
    let d = 67;
    let x: Vec<f64> = values(4 * 9 * d, 2, 3.0).iter().map(|v| v + 0.5).collect();
    let w = values(d, 3, 1.0);
    let b = values(d, 4, 1.0);
    check(
        "layer_norm",
        &[(x, [4, 9, d]), (w, [1, 1, d]), (b, [1, 1, d])],
        [4, 9, d],
        |t| {
            let w = t[1].clone().reshape([d]);
            let b = t[2].clone().reshape([d]);
            layer_norm(t[0].clone(), w, b, 1e-5)
        },
        2e-6,
    );
}

#[test]
fn fused_causal_attention_matches_the_composed_op() {
    // T = 150 spans three query blocks, the last one partial; hd = 24.
    for (b, t, h, hd) in [(2, 150, 3, 24), (1, 7, 2, 8)] {
        let d = h * hd;
        let qkv = values(b * t * 3 * d, 5, 2.0);
        check(
            "attention",
            &[(qkv, [b, t, 3 * d])],
            [b, t, d],
            |x| causal_attention(x[0].clone(), h),
            2e-6,
        );
    }
}

#[test]
fn fused_cross_entropy_matches_the_composed_op() {
    let (n, v) = (37, 131);
    let logits = values(n * v, 6, 8.0);
    let targets: Vec<i64> = (0..n as i64).map(|i| (i * 53 + 7) % v as i64).collect();
    check(
        "cross_entropy",
        &[(logits, [n, v])],
        [1],
        |x| {
            let targets = Tensor::<1, Int>::from_data(
                TensorData::new(targets.clone(), [n]),
                &Device::flex().autodiff(),
            );
            softmax_cross_entropy(x[0].clone(), targets)
        },
        2e-6,
    );
}

#[test]
fn fused_kernels_also_run_without_autodiff() {
    let device = Device::flex();
    let x = Tensor::<3>::from_data(
        TensorData::new(values(2 * 4 * 12, 7, 1.0), [2, 4, 12]),
        &device,
    );
    assert!(uses_fused_kernels(&x));
    let y = causal_attention(x.clone(), 2);
    let want = causal_attention(x.clone().cast(DType::F64), 2);
    assert!(rel_err(&to_f64(y), &to_f64(want)) < 2e-6);
    let g = gelu_tanh(x.clone());
    assert!(rel_err(&to_f64(g), &to_f64(gelu_tanh(x.cast(DType::F64)))) < 2e-6);
}

#[test]
fn fused_linear_matches_the_composed_op() {
    use burn::module::{Param, ParamId};
    use burn::nn::Linear;
    // 150 rows x 70 -> 33, and one row (a vector input).
    for rows in [150, 1] {
        let (d_in, d_out) = (70, 33);
        let x = values(rows * d_in, 8, 2.0);
        let w = values(d_in * d_out, 9, 0.5);
        let b = values(d_out, 10, 0.5);
        check(
            "linear",
            &[
                (x, [1, rows, d_in]),
                (w, [1, d_in, d_out]),
                (b, [1, 1, d_out]),
            ],
            [1, rows, d_out],
            |t| {
                let layer = Linear {
                    weight: Param::initialized(ParamId::new(), t[1].clone().reshape([d_in, d_out])),
                    bias: Some(Param::initialized(
                        ParamId::new(),
                        t[2].clone().reshape([d_out]),
                    )),
                };
                linear(t[0].clone(), &layer)
            },
            2e-6,
        );
    }
}
