//! `ember bench matmul`: the matrix products of one training step of a preset, each timed on
//! the device through the op a GPU step runs it with: Burn's `linear` on the `[B, T, k]`
//! activations for a layer's forward and its input's gradient (as Burn's autodiff computes it:
//! `linear` of the output's gradient by the transposed weight), and the matmul of the
//! flattened activations for the weight's gradient, with the operands laid out as the step
//! lays them out; autotuned on a CubeCL device. Each with its FLOP/s and how many times a step
//! runs it. The GPU check sets each beside `torch.mm` of the same `m x k x n` on the same
//! card. On flex the products timed are ember's own (`ember_model::kernels::cpu_product`), which
//! the step's linear layers run, on operands laid out as the step lays them out; `ember bench
//! matmul --against-torch` sets each beside `torch.mm` of the same operands on as many threads.
//!
//! Each product's accuracy is measured too, against the same product of its operands in f64
//! ([`Accuracy`]): how many bits it keeps says which arithmetic the device ran, IEEE f32 or
//! TF32 on tensor cores (which Burn's autotune may pick for f32 operands on a card that has
//! them), whatever the dtype asked for.

use std::time::Instant;

use burn::tensor::{DType, Device, Distribution, Int, Tensor, TensorData};
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
    /// How closely the product matches the same product in f64.
    #[serde(flatten)]
    pub accuracy: Accuracy,
}

/// A product's largest error over a sample of its entries (8 rows by 64 columns, spread
/// evenly), each entry's error relative to the sum of the absolute values of the terms it
/// adds (so a sum that cancels does not inflate it), against the same product of the
/// operands as stored, computed in f64 on the host.
///
/// Over sums of 768 and of 3072 terms of operands spread around zero, IEEE f32 keeps about 23
/// bits (2^-24 a rounding, which partly cancel), even summed one term after another; f32
/// operands rounded to TF32 on tensor cores (2^-11 each) about 15 (the unit test
/// `accuracy_tells_tf32_from_f32`). A bf16 output, rounded to 2^-9 of its own size, keeps 9
/// to 15 at gpt2's sizes on flex: in bf16 the measure says little about the sums.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Accuracy {
    /// The largest relative error over the sampled entries.
    pub max_error: f64,
    /// `-log2(max_error)`, at most 53 (an exact product).
    pub bits: f64,
}

impl Accuracy {
    /// The accuracy of `out`, sampled entries of the product `a b`: `a` holds the sampled
    /// rows of the left operand (`rows x k`, row-major), `b` the sampled columns of the right
    /// (`k x cols`, row-major), `out` their entries (`rows x cols`).
    pub fn of(a: &[f32], b: &[f32], out: &[f32], k: usize) -> Self {
        let rows = a.len() / k.max(1);
        let cols = b.len() / k.max(1);
        let mut worst = 0f64;
        for r in 0..rows {
            for c in 0..cols {
                let (mut sum, mut abs) = (0f64, 0f64);
                for i in 0..k {
                    let term = f64::from(a[r * k + i]) * f64::from(b[i * cols + c]);
                    sum += term;
                    abs += term.abs();
                }
                let err = (f64::from(out[r * cols + c]) - sum).abs();
                let rel = if err == 0.0 { 0.0 } else { err / abs };
                // A NaN (or an error where every term is zero) is as wrong as it gets.
                worst = if rel.is_finite() {
                    worst.max(rel)
                } else {
                    f64::INFINITY
                };
            }
        }
        Self {
            max_error: worst,
            bits: -worst.max(f64::EPSILON / 2.0).log2(),
        }
    }
}

/// `n` indices spread evenly over `0..len` (fewer where `len` is smaller).
fn spread(len: usize, n: usize) -> Vec<i64> {
    let n = n.min(len);
    (0..n)
        .map(|i| ((2 * i + 1) * len / (2 * n)) as i64)
        .collect()
}

/// The accuracy of `out`, `p`'s product of `lhs` and `rhs` on the device: the sampled rows,
/// columns and entries read back as f32 (every bf16 value is one).
fn measure(p: &Product, lhs: &Tensor<2>, rhs: &Tensor<2>, out: Tensor<3>) -> CliResult<Accuracy> {
    let device = lhs.device();
    let (rows, cols) = (spread(p.m, 8), spread(p.n, 64));
    let index =
        |v: &[i64]| Tensor::<1, Int>::from_data(TensorData::new(v.to_vec(), [v.len()]), &device);
    let host = |t: Tensor<2>| -> CliResult<Vec<f32>> {
        t.cast(DType::F32)
            .into_data()
            .try_into_vec::<f32>()
            .map_err(|e| crate::error::CliError::Runtime(anyhow::anyhow!("{}: {e:?}", p.name)))
    };
    let a = host(lhs.clone().select(0, index(&rows)))?;
    let b = host(rhs.clone().select(1, index(&cols)))?;
    let c = host(
        out.reshape([p.m, p.n])
            .select(0, index(&rows))
            .select(1, index(&cols)),
    )?;
    Ok(Accuracy::of(&a, &b, &c, p.k))
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
    if kind == DeviceKind::Flex {
        return Ok(bench_cpu_products(dtype, products, rounds, per_round));
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
        let accuracy = measure(p, &lhs, &rhs, run_product(p, &lhs, &rhs))?;
        out.push(ProductBench {
            product: p.clone(),
            device: kind.to_string(),
            dtype: format!("{dtype:?}").to_lowercase(),
            ms: median * 1e3,
            tflops: 2.0 * (p.m * p.n * p.k) as f64 / median / 1e12,
            first_ms,
            accuracy,
        });
    }
    Ok(out)
}

/// Deterministic values in [-1, 1).
fn values(len: usize, seed: u32) -> Vec<f32> {
    let mut z = seed.wrapping_mul(2_654_435_761) | 1;
    (0..len)
        .map(|_| {
            z ^= z << 13;
            z ^= z >> 17;
            z ^= z << 5;
            z as f32 / u32::MAX as f32 * 2.0 - 1.0
        })
        .collect()
}

/// [`bench_products`] on the CPU: ember's own products (`cpu_product`), bf16 operands as bf16
/// bits, each operand stored as its layout says (a transposed one as the row-major `[k, m]`
/// or `[n, k]` it is a view of).
fn bench_cpu_products(
    dtype: Dtype,
    products: &[Product],
    rounds: usize,
    per_round: usize,
) -> Vec<ProductBench> {
    use ember_model::kernels::{CpuOperand, cpu_product};
    let mut out = Vec::new();
    for p in products {
        let (mut a, mut b) = (values(p.m * p.k, 1), values(p.k * p.n, 2));
        let bits = |v: &mut [f32]| -> Vec<u16> {
            v.iter_mut()
                .map(|x| {
                    let h = burn::tensor::bf16::from_f32(*x);
                    *x = h.to_f32();
                    h.to_bits()
                })
                .collect()
        };
        let (a16, b16) = match dtype {
            Dtype::Bf16 => (bits(&mut a), bits(&mut b)),
            Dtype::F32 => (Vec::new(), Vec::new()),
        };
        let (lhs, rhs) = match dtype {
            Dtype::Bf16 => (CpuOperand::Bf16(&a16), CpuOperand::Bf16(&b16)),
            Dtype::F32 => (CpuOperand::F32(&a), CpuOperand::F32(&b)),
        };
        let ls = match p.lhs {
            Layout::RowMajor => [p.k, 1],
            Layout::Transposed => [1, p.m],
        };
        let rs = match p.rhs {
            Layout::RowMajor => [p.n, 1],
            Layout::Transposed => [1, p.k],
        };
        let mut c = vec![0f32; p.m * p.n];
        let run = |c: &mut [f32]| cpu_product([p.m, p.n, p.k], (lhs, ls), (rhs, rs), c);
        let start = Instant::now();
        run(&mut c);
        let first_ms = start.elapsed().as_secs_f64() * 1e3;
        let mut times: Vec<f64> = (0..rounds)
            .map(|_| {
                let start = Instant::now();
                for _ in 0..per_round {
                    run(&mut c);
                }
                start.elapsed().as_secs_f64() / per_round as f64
            })
            .collect();
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        // The sampled rows of lhs, columns of rhs and entries of the output, row-major.
        let (rows, cols) = (spread(p.m, 8), spread(p.n, 64));
        let at = |v: &[f32], [s0, s1]: [usize; 2], i: usize, j: usize| v[i * s0 + j * s1];
        let sa: Vec<f32> = rows
            .iter()
            .flat_map(|&r| (0..p.k).map(move |l| (r as usize, l)))
            .map(|(r, l)| at(&a, ls, r, l))
            .collect();
        let sb: Vec<f32> = (0..p.k)
            .flat_map(|l| cols.iter().map(move |&c| (l, c as usize)))
            .map(|(l, col)| at(&b, rs, l, col))
            .collect();
        let sc: Vec<f32> = rows
            .iter()
            .flat_map(|&r| cols.iter().map(move |&col| (r as usize, col as usize)))
            .map(|(r, col)| c[r * p.n + col])
            .collect();
        out.push(ProductBench {
            product: p.clone(),
            device: DeviceKind::Flex.to_string(),
            dtype: format!("{dtype:?}").to_lowercase(),
            ms: median * 1e3,
            tflops: 2.0 * (p.m * p.n * p.k) as f64 / median / 1e12,
            first_ms,
            accuracy: Accuracy::of(&sa, &sb, &sc, p.k),
        });
    }
    out
}

/// `torch.mm` timed on the CPU for each product, operands laid out as ember's
/// ([`bench_cpu_products`]): reads the products as JSON on stdin, prints one JSON object per
/// product (`name`, `ms`, the median over rounds).
const TORCH_MM: &str = r#"
import json, sys, time, torch
job = json.load(sys.stdin)
torch.set_num_threads(job["threads"])
dtype = torch.bfloat16 if job["dtype"] == "bf16" else torch.float32
for p in job["products"]:
    m, k, n = p["m"], p["k"], p["n"]
    a = torch.rand(k, m).t() if p["lhs"] == "transposed" else torch.rand(m, k)
    b = torch.rand(n, k).t() if p["rhs"] == "transposed" else torch.rand(k, n)
    a, b = (a * 2 - 1).to(dtype), (b * 2 - 1).to(dtype)
    torch.mm(a, b)
    times = []
    for _ in range(job["rounds"]):
        start = time.perf_counter()
        for _ in range(job["per_round"]):
            torch.mm(a, b)
        times.append((time.perf_counter() - start) / job["per_round"])
    times.sort()
    print(json.dumps({"name": p["name"], "ms": times[len(times) // 2] * 1e3}), flush=True)
"#;

/// `bench_cpu_products`' products timed through `torch.mm` by `python` on `threads`
/// threads: the median milliseconds of each, in order.
pub fn torch_mm(
    python: &str,
    dtype: Dtype,
    products: &[Product],
    rounds: usize,
    per_round: usize,
    threads: usize,
) -> CliResult<Vec<f64>> {
    use std::io::Write;
    let job = serde_json::json!({
        "dtype": format!("{dtype:?}").to_lowercase(),
        "products": products,
        "rounds": rounds,
        "per_round": per_round,
        "threads": threads,
    });
    let mut child = std::process::Command::new(python)
        .args(["-c", TORCH_MM])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| usage(format!("--against-torch {python}: cannot run it ({e})")))?;
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(job.to_string().as_bytes())
        .map_err(|e| anyhow::anyhow!("writing to {python}: {e}"))?;
    let output = child
        .wait_with_output()
        .map_err(|e| anyhow::anyhow!("waiting for {python}: {e}"))?;
    if !output.status.success() {
        return Err(usage(format!(
            "--against-torch {python}: torch.mm failed (it must import torch; `{python} -m pip \
             install torch`): {}",
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    let ms: Vec<f64> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["ms"].as_f64())
        .collect();
    if ms.len() != products.len() {
        return Err(
            anyhow::anyhow!("{python} timed {} of {} products", ms.len(), products.len()).into(),
        );
    }
    Ok(ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The measure tells the arithmetic apart, over sums of 768 and of 3072 terms: an exact
    /// product keeps every bit, IEEE f32 sums, even one term after another, about 23, and sums
    /// of operands rounded to TF32 (10 stored mantissa bits) about 15; a NaN is no bits at all.
    #[test]
    fn accuracy_tells_tf32_from_f32() {
        let (rows, cols) = (3, 5);
        for k in [768, 3072] {
            let a: Vec<f32> = (0..rows * k)
                .map(|i| ((i * 7919) % 1000) as f32 / 997.0 - 0.4)
                .collect();
            let b: Vec<f32> = (0..k * cols)
                .map(|i| ((i * 104729) % 1000) as f32 / 991.0 - 0.6)
                .collect();
            let product = |round: &dyn Fn(f32) -> f32, acc: &dyn Fn(&[f32], &[f32]) -> f32| {
                let mut out = vec![0f32; rows * cols];
                for r in 0..rows {
                    for c in 0..cols {
                        let x: Vec<f32> = (0..k).map(|i| round(a[r * k + i])).collect();
                        let y: Vec<f32> = (0..k).map(|i| round(b[i * cols + c])).collect();
                        out[r * cols + c] = acc(&x, &y);
                    }
                }
                out
            };
            let f64_sum = |x: &[f32], y: &[f32]| {
                x.iter()
                    .zip(y)
                    .map(|(&p, &q)| f64::from(p) * f64::from(q))
                    .sum::<f64>() as f32
            };
            let f32_sum =
                |x: &[f32], y: &[f32]| x.iter().zip(y).fold(0f32, |s, (&p, &q)| p.mul_add(q, s));
            // TF32: 10 stored mantissa bits, rounded to nearest.
            let tf32 = |x: f32| f32::from_bits((x.to_bits() + 0x1000) & !0x1fff);
            let same = |x: f32| x;

            let exactish = Accuracy::of(&a, &b, &product(&same, &f64_sum), k);
            assert!(exactish.bits > 24.0, "{exactish:?}");
            let ieee = Accuracy::of(&a, &b, &product(&same, &f32_sum), k);
            assert!((20.0..=30.0).contains(&ieee.bits), "{ieee:?}");
            let rounded = Accuracy::of(&a, &b, &product(&tf32, &f32_sum), k);
            assert!((12.0..18.0).contains(&rounded.bits), "{rounded:?}");
            assert!(ieee.bits - rounded.bits > 5.0, "{ieee:?} {rounded:?}");
            let mut nan = product(&same, &f32_sum);
            nan[4] = f32::NAN;
            assert_eq!(Accuracy::of(&a, &b, &nan, k).max_error, f64::INFINITY);
            eprintln!("k {k}: f32 {:.1} bits, TF32 {:.1}", ieee.bits, rounded.bits);
        }
        // Small integers multiply and add exactly in f32.
        let ints = Accuracy::of(&[1.0, 2.0], &[3.0, 4.0], &[11.0], 2);
        assert_eq!((ints.max_error, ints.bits), (0.0, 53.0));
    }

    /// On flex the bench times ember's own products, f32 and bf16 (operands rounded to bf16,
    /// products summed in f32), over every layout of the step: each keeps at least 20 bits
    /// against the f64 product of the operands as stored (bf16 ones as rounded), which an f32
    /// sum of exact products does and any wrong layout, stride or rounding does not.
    #[test]
    fn the_bench_measures_each_products_accuracy() {
        let products = step_products(32, 1, 100, 2, 16);
        for dtype in [Dtype::F32, Dtype::Bf16] {
            for r in &bench_products(DeviceKind::Flex, dtype, &products, 1, 1).unwrap() {
                assert!(
                    r.accuracy.bits >= 20.0,
                    "{dtype:?} {}: {:?}",
                    r.product.name,
                    r.accuracy
                );
            }
        }
    }

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
