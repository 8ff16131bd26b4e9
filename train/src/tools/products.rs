//! `ember bench matmul`: the matrix products of one training step of a preset, each timed on
//! the device through the op a GPU step runs it with: Burn's `linear` on the `[B, T, k]`
//! activations for a layer's forward and its input's gradient (as Burn's autodiff computes it:
//! `linear` of the output's gradient by the transposed weight), and the matmul of the
//! flattened activations for the weight's gradient, with the operands laid out as the step
//! lays them out; autotuned on a CubeCL device. Each with its FLOP/s and how many times a step
//! runs it. The GPU check sets each beside `torch.mm` of the same `m x k x n` on the same
//! card. On flex the step's linear layers run ember's own products (`ember_model::kernels`),
//! not Burn's ops timed here.

use std::time::Instant;

use burn::tensor::{DType, Device, Distribution, Tensor};
use serde::Serialize;

use crate::error::{CliResult, usage};
use crate::run::config::{DeviceKind, Dtype};
use crate::run::device::device;

/// How a product's operand is laid out in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    /// Row-major as the product reads it.
    RowMajor,
    /// The transposed view of a row-major tensor (a weight used transposed, the activations
    /// of a weight's gradient).
    Transposed,
}

/// One product of the step: `[m, k] x [k, n]`.
#[derive(Debug, Clone, Serialize)]
pub struct Product {
    /// The layer and the pass: `c_fc forward`, `c_fc input gradient`, `c_fc weight gradient`.
    pub name: String,
    /// Rows of the output.
    pub m: usize,
    /// The summed dimension.
    pub k: usize,
    /// Columns of the output.
    pub n: usize,
    /// Sequences the `m` rows come in: the left operand is `[batch, m / batch, k]` and the op
    /// Burn's `linear` (a forward or an input's gradient), or 1 for a plain matmul of `[m, k]`
    /// (a weight's gradient).
    pub batch: usize,
    /// The left operand's layout.
    pub lhs: Layout,
    /// The right operand's layout.
    pub rhs: Layout,
    /// Times a training step runs this product.
    pub per_step: usize,
}

/// A product timed.
#[derive(Debug, Clone, Serialize)]
pub struct ProductBench {
    /// The product.
    #[serde(flatten)]
    pub product: Product,
    /// `--device`.
    pub device: String,
    /// `--dtype`.
    pub dtype: String,
    /// Median milliseconds per product over the timed rounds.
    pub ms: f64,
    /// `2 m n k` over the median time, in TFLOP/s.
    pub tflops: f64,
    /// Milliseconds of the first product of this shape: compiling and autotuning it, where
    /// the kernel cache did not hold them.
    pub first_ms: f64,
}

/// The products of one training step of a GPT of width `d`, `layers` blocks and `vocab`
/// tokens over `batch` sequences of `block` tokens: each linear layer's forward `x W` (the
/// head's `x E^T`, its weight the embedding), and backward's `dy W^T` (the input's gradient)
/// and `x^T dy` (the weight's). Attention's own products run inside its kernel and are not
/// here.
pub fn step_products(
    d: usize,
    layers: usize,
    vocab: usize,
    batch: usize,
    block: usize,
) -> Vec<Product> {
    use Layout::{RowMajor, Transposed};
    let tokens = batch * block;
    let linear = |name: &str, d_in: usize, d_out: usize, per_step: usize, tied: bool| {
        // A block's weight is `[d_in, d_out]`; the head's is the embedding `[vocab, d]`, used
        // transposed.
        let (weight, weight_transposed) = if tied {
            (Transposed, RowMajor)
        } else {
            (RowMajor, Transposed)
        };
        let p = |pass: &str, m, k, n, batch, lhs, rhs| Product {
            name: format!("{name} {pass}"),
            m,
            k,
            n,
            batch,
            lhs,
            rhs,
            per_step,
        };
        vec![
            p("forward", tokens, d_in, d_out, batch, RowMajor, weight),
            p(
                "input gradient",
                tokens,
                d_out,
                d_in,
                batch,
                RowMajor,
                weight_transposed,
            ),
            p(
                "weight gradient",
                d_in,
                tokens,
                d_out,
                1,
                Transposed,
                RowMajor,
            ),
        ]
    };
    [
        linear("c_attn", d, 3 * d, layers, false),
        linear("attn c_proj", d, d, layers, false),
        linear("c_fc", d, 4 * d, layers, false),
        linear("mlp c_proj", 4 * d, d, layers, false),
        linear("lm_head", d, vocab, 1, true),
    ]
    .concat()
}

/// A `rows x cols` operand in `dtype` as `layout` says: row-major, or the transposed view of
/// a row-major `[cols, rows]` tensor (cast before the view is taken, so the view is of the
/// dtype's own tensor).
fn operand(rows: usize, cols: usize, layout: Layout, device: &Device, dtype: DType) -> Tensor<2> {
    let dist = Distribution::Uniform(-1.0, 1.0);
    let made = |shape: [usize; 2]| {
        let t = Tensor::<2>::random(shape, dist, (device, DType::F32));
        if dtype == DType::F32 {
            t
        } else {
            t.cast(dtype)
        }
    };
    match layout {
        Layout::RowMajor => made([rows, cols]),
        Layout::Transposed => made([cols, rows]).transpose(),
    }
}

/// Runs `p` once on its operands: Burn's `linear` of the `[batch, m / batch, k]` activations,
/// or a matmul.
fn run_product(p: &Product, lhs: &Tensor<2>, rhs: &Tensor<2>) -> Tensor<3> {
    if p.batch > 1 {
        let x = lhs.clone().reshape([p.batch, p.m / p.batch, p.k]);
        burn::tensor::module::linear(x, rhs.clone(), None)
    } else {
        lhs.clone().matmul(rhs.clone()).unsqueeze()
    }
}

/// Times each of `products` on `kind` in `dtype`: `rounds` rounds of `per_round` products
/// back to back between two syncs, after one untimed product (which compiles and autotunes).
pub fn bench_products(
    kind: DeviceKind,
    dtype: Dtype,
    products: &[Product],
    rounds: usize,
    per_round: usize,
) -> CliResult<Vec<ProductBench>> {
    if rounds == 0 || per_round == 0 {
        return Err(usage("--rounds and --per-round must be at least 1"));
    }
    let dev = device(kind)?;
    let burn_dtype = match dtype {
        Dtype::F32 => DType::F32,
        Dtype::Bf16 => DType::BF16,
    };
    if !dev.supports_dtype(burn_dtype) {
        return Err(usage(format!(
            "--dtype bf16 is not supported by --device {kind}; use --dtype f32"
        )));
    }
    let sync = |what: &str| {
        dev.sync()
            .map_err(|e| crate::error::CliError::Runtime(anyhow::anyhow!("{what}: {e:?}")))
    };
    let mut out = Vec::new();
    for p in products {
        let lhs = operand(p.m, p.k, p.lhs, &dev, burn_dtype);
        let rhs = operand(p.k, p.n, p.rhs, &dev, burn_dtype);
        sync("making the operands")?;
        let start = Instant::now();
        drop(run_product(p, &lhs, &rhs));
        sync(&p.name)?;
        let first_ms = start.elapsed().as_secs_f64() * 1e3;
        let mut times = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let start = Instant::now();
            for _ in 0..per_round {
                drop(run_product(p, &lhs, &rhs));
            }
            sync(&p.name)?;
            times.push(start.elapsed().as_secs_f64() / per_round as f64);
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        out.push(ProductBench {
            product: p.clone(),
            device: kind.to_string(),
            dtype: format!("{dtype:?}").to_lowercase(),
            ms: median * 1e3,
            tflops: 2.0 * (p.m * p.n * p.k) as f64 / median / 1e12,
            first_ms,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_has_three_products_per_linear_layer_and_their_flops_are_six_n_per_token() {
        let (d, layers, vocab, batch, block) = (64, 3, 500, 4, 32);
        let tokens = batch * block;
        let products = step_products(d, layers, vocab, batch, block);
        assert_eq!(products.len(), 15);
        let flops: usize = products
            .iter()
            .map(|p| 2 * p.m * p.n * p.k * p.per_step)
            .sum();
        // Weights of the linear layers (12 d^2 per block, the head's V d), times 6 per token.
        let weights = layers * 12 * d * d + vocab * d;
        assert_eq!(flops, 6 * weights * tokens);
    }
}
