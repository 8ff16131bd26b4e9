//! ember's CubeCL kernels on wgpu (Mesa's lavapipe where there is no GPU) against the ops
//! composed of Burn's in f64 on flex:
//!
//! - flash attention: the output and the gradient of the packed projection, in f32 and half
//!   precision, at sequence lengths that are not multiples of the kernels' block and at head
//!   sizes on both sides of 64; and the memory an autodiff graph keeps after the forward, which
//!   for the composed op includes every head's `T x T` probabilities;
//! - softmax cross-entropy: the loss and the logits' gradient at vocabularies below and above
//!   one cube's units, and the memory kept after the forward (the composed op keeps the
//!   `[N, V]` log-probabilities);
//! - LayerNorm: the output and the gradients of the input, weight and bias, at widths below and
//!   above one cube's units;
//! - the MLP's expansion with its bias and GELU: the output and the gradients of the input,
//!   weight and bias, and the memory kept after the forward (the composed op keeps four
//!   tensors of the output's size);
//! - the kernels as `kernels::ahead` defines them for compiling where a device is not
//!   (`ember selftest --ptx`): the ones a step launches.
#![cfg(feature = "wgpu")]

mod common;

use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::{DType, Device, DeviceKind, Int, Tensor, TensorData};
use common::{leaf, rel_err, to_f64, values};
use ember_model::kernels::{
    CubeAttention, causal_attention, composed_causal_attention, composed_linear_gelu,
    composed_softmax_cross_entropy, layer_norm, linear_gelu, set_cube_attention,
    softmax_cross_entropy, uses_cube_kernels,
};

fn wgpu() -> Device {
    Device::wgpu(DeviceKind::DefaultDevice)
}

/// One test on the device at a time: the memory tests read the device's whole pool, which
/// another test's tensors would change.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn device_lock() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// Bytes of `device`'s memory that `loss`'s autodiff graph holds between its forward and its
/// backward, beside the input `x` (which exists before the count starts); the backward then
/// gives `x` a gradient.
fn bytes_kept_by_forward<const D: usize>(
    device: &Device,
    x: Tensor<D>,
    loss: impl FnOnce(Tensor<D>) -> Tensor<1>,
) -> u64 {
    let in_use = || {
        device.sync().unwrap();
        device
            .memory_pool_usage()
            .expect("wgpu reports its memory")
            .bytes_in_use
    };
    let before = in_use();
    let loss = loss(x.clone());
    let after = in_use();
    let grads = loss.backward();
    assert!(x.grad(&grads).is_some());
    after.saturating_sub(before)
}

/// Output and projection gradient of `sum(attention(qkv) * w)`.
fn run(
    qkv: &[f64],
    w: &[f64],
    [b, t, d3]: [usize; 3],
    heads: usize,
    device: Device,
    dtype: DType,
    flash: bool,
) -> (Vec<f64>, Vec<f64>) {
    let x = leaf(qkv, [b, t, d3], device.clone(), dtype);
    assert_eq!(uses_cube_kernels(&x), flash);
    let y = if flash {
        causal_attention(x.clone(), heads)
    } else {
        composed_causal_attention(x.clone(), heads)
    };
    assert_eq!(y.dims(), [b, t, d3 / 3]);
    assert_eq!(y.dtype(), dtype);
    let weights = leaf(w, [b, t, d3 / 3], device, dtype).detach();
    let grads = (y.clone() * weights).sum().backward();
    let g = to_f64(x.grad(&grads).expect("the projection gets a gradient"));
    (to_f64(y.detach()), g)
}

/// Each element's value in `dtype` (so the f64 reference sees what the tensors hold).
fn rounded(v: &[f64], dtype: DType) -> Vec<f64> {
    v.iter()
        .map(|&x| match dtype {
            DType::BF16 => burn::tensor::bf16::from_f64(x).to_f64(),
            DType::F16 => burn::tensor::f16::from_f64(x).to_f64(),
            _ => x,
        })
        .collect()
}

/// The ways attention runs on a CubeCL device: the flash kernels, the products with every pair
/// in one group, and the products one (sequence, head) pair per group.
fn paths(t: usize) -> [CubeAttention; 3] {
    [
        CubeAttention::Flash,
        CubeAttention::PRODUCTS,
        CubeAttention::Products {
            max_scores_bytes: (t * t * 4) as u64,
        },
    ]
}

/// [`check_on`] every one of [`paths`].
fn check(b: usize, t: usize, heads: usize, hd: usize, dtype: DType, tol: f64) {
    check_on(&paths(t), b, t, heads, hd, dtype, tol);
}

/// [`check_on`] the flash kernels alone, for shapes whose edges (head sizes) are theirs: the
/// products' inner dimension is the device's matmul's, and a shape new to the products costs
/// that matmul's autotune and its kernels' compiles, 14-76 s a shape on lavapipe with nothing
/// cached (Sapphire Rapids, 2 cores).
fn check_flash(b: usize, t: usize, heads: usize, hd: usize, dtype: DType, tol: f64) {
    check_on(&[CubeAttention::Flash], b, t, heads, hd, dtype, tol);
}

/// Attention on each of `paths` against the composed op in f64 on flex.
fn check_on(
    paths: &[CubeAttention],
    b: usize,
    t: usize,
    heads: usize,
    hd: usize,
    dtype: DType,
    tol: f64,
) {
    let d3 = 3 * heads * hd;
    let qkv = values(b * t * d3, 7 + t as u64, 1.5);
    let w = values(b * t * d3 / 3, 11, 1.0);
    let qkv = rounded(&qkv, dtype);
    let w = rounded(&w, dtype);
    let (want_y, want_g) = run(
        &qkv,
        &w,
        [b, t, d3],
        heads,
        Device::flex(),
        DType::F64,
        false,
    );
    for &path in paths {
        set_cube_attention(path);
        let (y, g) = run(&qkv, &w, [b, t, d3], heads, wgpu(), dtype, true);
        let (ey, eg) = (rel_err(&y, &want_y), rel_err(&g, &want_g));
        eprintln!(
            "{path:?}: B {b} T {t} H {heads} hd {hd} {dtype:?}: output {ey:.2e}, gradient {eg:.2e}"
        );
        assert!(
            ey < tol,
            "{path:?} {dtype:?} T {t} hd {hd}: output differs by {ey:e}"
        );
        assert!(
            eg < tol,
            "{path:?} {dtype:?} T {t} hd {hd}: gradient differs by {eg:e}"
        );
    }
    set_cube_attention(CubeAttention::PRODUCTS);
}

/// f32: within 1e-5 of the f64 reference (relative to the largest element), which is a few
/// f32 roundings of sums over up to `T` keys.
#[test]
fn flash_attention_matches_the_composed_op_in_f32() {
    let _device = device_lock();
    check(2, 70, 3, 16, DType::F32, 1e-5);
    check_flash(1, 50, 2, 32, DType::F32, 1e-5);
    check_flash(1, 129, 2, 64, DType::F32, 1e-5);
    check_flash(1, 40, 1, 80, DType::F32, 1e-5);
    // Longer than a row kernel's units: the softmax strides over the row.
    check(1, 300, 2, 32, DType::F32, 1e-5);
    // Under 32 queries: the products take the sequence as one block, not two halves.
    check(2, 20, 2, 16, DType::F32, 1e-5);
    // A head of 6 columns: the flash kernels take heads of a multiple of 8, so the composed op
    // runs.
    check(1, 33, 2, 6, DType::F32, 1e-5);
}

/// bf16 and f16, where the device has them: the inputs are values of the dtype for both, and
/// the kernels round each result once to it, so within two roundings of the dtype (2^-7 for
/// bf16, 2^-10 for f16) of the f64 reference.
#[test]
fn flash_attention_matches_the_composed_op_in_half_precision() {
    let _device = device_lock();
    let mut ran = 0;
    for (dtype, tol) in [(DType::BF16, 2f64.powi(-7)), (DType::F16, 2f64.powi(-10))] {
        if !wgpu().supports_dtype(dtype) {
            eprintln!("this wgpu device has no {dtype:?}: not checked here");
            continue;
        }
        check(2, 70, 3, 16, dtype, tol);
        check_flash(1, 129, 2, 64, dtype, tol);
        ran += 1;
    }
    eprintln!("{ran} half-precision dtypes checked");
}

/// What the autodiff graph keeps between forward and backward at `T = 1024`, one head of 64:
/// the flash op (either path) its input, output and one log-sum-exp per query (under 1 MB
/// here); the composed op also each head's `T x T` probabilities (4 MiB in f32). The products'
/// path holds its scores only during the call.
#[test]
fn flash_attention_keeps_no_t_by_t_tensor_for_backward() {
    let _device = device_lock();
    let (t, hd) = (1024, 64);
    let device = wgpu();
    let qkv = values(t * 3 * hd, 5, 1.0);
    let kept = |flash: bool| {
        let x = leaf(&qkv, [1, t, 3 * hd], device.clone(), DType::F32);
        bytes_kept_by_forward(&device, x, |x| {
            if flash {
                causal_attention(x, 1).sum()
            } else {
                composed_causal_attention(x, 1).sum()
            }
        })
    };
    let scores = (t * t * 4) as u64;
    let composed = kept(false);
    for path in [CubeAttention::Flash, CubeAttention::PRODUCTS] {
        set_cube_attention(path);
        let flash = kept(true);
        eprintln!(
            "kept after the forward: {path:?} {flash} B, composed {composed} B, T x T {scores} B"
        );
        assert!(flash < scores / 4, "{path:?} keeps {flash} B");
    }
    assert!(
        composed >= scores,
        "the composed op keeps {composed} B: the check would not see T x T"
    );
}

/// Loss and logits' gradient of the mean cross-entropy of `[n, v]` logits.
fn cross_entropy(
    logits: &[f64],
    targets: &[i64],
    [n, v]: [usize; 2],
    device: Device,
    dtype: DType,
    cube: bool,
) -> (f64, Vec<f64>) {
    let x = leaf(logits, [n, v], device.clone(), dtype);
    let t = Tensor::<1, Int>::from_data(TensorData::new(targets.to_vec(), [n]), &device.autodiff());
    assert_eq!(uses_cube_kernels(&x), cube);
    let loss = if cube {
        softmax_cross_entropy(x.clone(), t)
    } else {
        composed_softmax_cross_entropy(x.clone(), t)
    };
    assert_eq!((loss.dims(), loss.dtype()), ([1], dtype));
    let grads = loss.clone().backward();
    let g = to_f64(x.grad(&grads).expect("the logits get a gradient"));
    (to_f64(loss.detach())[0], g)
}

fn check_cross_entropy(n: usize, v: usize, dtype: DType, tol: f64) {
    let logits = rounded(&values(n * v, 3 + v as u64, 4.0), dtype);
    let targets: Vec<i64> = (0..n).map(|i| ((i * 7919 + 13) % v) as i64).collect();
    let (loss, g) = cross_entropy(&logits, &targets, [n, v], wgpu(), dtype, true);
    let (want, want_g) =
        cross_entropy(&logits, &targets, [n, v], Device::flex(), DType::F64, false);
    let (el, eg) = ((loss - want).abs() / want.abs(), rel_err(&g, &want_g));
    eprintln!("N {n} V {v} {dtype:?}: loss {el:.2e}, gradient {eg:.2e}");
    assert!(el < tol, "{dtype:?} N {n} V {v}: loss differs by {el:e}");
    assert!(
        eg < tol,
        "{dtype:?} N {n} V {v}: gradient differs by {eg:e}"
    );
}

/// f32 within 1e-5 of the f64 reference (the loss relative to itself, the gradient to its
/// largest element); f16, where the device has it, within 2^-10.
#[test]
fn cross_entropy_matches_the_composed_op() {
    let _device = device_lock();
    check_cross_entropy(37, 300, DType::F32, 1e-5);
    check_cross_entropy(5, 50, DType::F32, 1e-5);
    // The mean over 600,001 rows: Burn's own mean on lavapipe is wrong past 524,288.
    check_cross_entropy(600_001, 3, DType::F32, 1e-5);
    if wgpu().supports_dtype(DType::F16) {
        check_cross_entropy(37, 300, DType::F16, 2f64.powi(-10));
    }
}

/// What the autodiff graph keeps between forward and backward for 512 rows of 2048 logits: the
/// CubeCL op one f32 per row (its input aside); the composed op also the `[N, V]`
/// log-probabilities (4 MiB in f32).
#[test]
fn cross_entropy_keeps_no_row_of_probabilities_for_backward() {
    let _device = device_lock();
    let (n, v) = (512, 2048);
    let device = wgpu();
    let targets: Vec<i64> = (0..n).map(|i| (i * 31 % v) as i64).collect();
    let kept = |cube: bool| {
        let x = leaf(&values(n * v, 9, 2.0), [n, v], device.clone(), DType::F32);
        let t = Tensor::<1, Int>::from_data(TensorData::new(targets.clone(), [n]), &device);
        bytes_kept_by_forward(&device, x, |x| {
            if cube {
                softmax_cross_entropy(x, t)
            } else {
                composed_softmax_cross_entropy(x, t)
            }
        })
    };
    let rows = (n * v * 4) as u64;
    let cube = kept(true);
    let composed = kept(false);
    eprintln!("kept after the forward: CubeCL {cube} B, composed {composed} B, N x V {rows} B");
    assert!(cube < rows / 4, "the CubeCL op keeps {cube} B");
    assert!(
        composed >= rows,
        "the composed op keeps {composed} B: the check would not see N x V"
    );
}

/// Output and the input's, weight's and bias's gradients of `sum(layer_norm(x) * w)`.
fn run_layer_norm(
    vals: &[Vec<f64>; 4],
    [rows, d]: [usize; 2],
    device: Device,
    dtype: DType,
) -> Vec<Vec<f64>> {
    let x = leaf(&vals[0], [rows, d], device.clone(), dtype);
    let weight = leaf(&vals[1], [d], device.clone(), dtype);
    let bias = leaf(&vals[2], [d], device.clone(), dtype);
    assert_eq!(uses_cube_kernels(&x), device != Device::flex());
    let y = layer_norm(x.clone(), weight.clone(), bias.clone(), 1e-5);
    let w = leaf(&vals[3], [rows, d], device, dtype).detach();
    let grads = (y.clone() * w).sum().backward();
    let some = "every input gets a gradient";
    vec![
        to_f64(y.detach()),
        to_f64(x.grad(&grads).expect(some)),
        to_f64(weight.grad(&grads).expect(some)),
        to_f64(bias.grad(&grads).expect(some)),
    ]
}

fn check_layer_norm(rows: usize, d: usize, dtype: DType, tol: f64) {
    let vals = [
        rounded(&values(rows * d, 21 + d as u64, 3.0), dtype),
        rounded(
            &values(d, 22, 1.0)
                .iter()
                .map(|v| 1.0 + v)
                .collect::<Vec<_>>(),
            dtype,
        ),
        rounded(&values(d, 23, 0.5), dtype),
        rounded(&values(rows * d, 24, 1.0), dtype),
    ];
    let got = run_layer_norm(&vals, [rows, d], wgpu(), dtype);
    let want = run_layer_norm(&vals, [rows, d], Device::flex(), DType::F64);
    within(
        &format!("LayerNorm {rows} x {d} {dtype:?}"),
        &got,
        &want,
        tol,
    );
}

/// Each of an op's output and its input's, weight's and bias's gradients (`got`) within `tol`
/// of the reference's (`want`), relative to the reference's largest element.
fn within(op: &str, got: &[Vec<f64>], want: &[Vec<f64>], tol: f64) {
    let names = [
        "output",
        "input gradient",
        "weight gradient",
        "bias gradient",
    ];
    for (what, (g, w)) in names.iter().zip(got.iter().zip(want)) {
        let e = rel_err(g, w);
        eprintln!("{op}: {what} {e:.2e}");
        assert!(e < tol, "{op}: {what} differs by {e:e}");
    }
}

/// f32 within 1e-5 of the f64 reference, relative to each result's largest element; f16,
/// where the device has it, within 2^-9 (its gradients sum over every row in f32 and round
/// once, but the inputs' rounding reaches them through the normalisation).
#[test]
fn layer_norm_matches_the_composed_op() {
    let _device = device_lock();
    check_layer_norm(15, 300, DType::F32, 1e-5);
    check_layer_norm(4, 48, DType::F32, 1e-5);
    // Rows over several of the weight gradient's chunks of 64, the last one short, with
    // features in one cube of 64 and in several.
    check_layer_norm(200, 40, DType::F32, 1e-5);
    check_layer_norm(200, 300, DType::F32, 1e-5);
    if wgpu().supports_dtype(DType::F16) {
        check_layer_norm(15, 300, DType::F16, 2f64.powi(-9));
    }
}

/// Output and the input's, weight's and bias's gradients of `sum(linear_gelu(x) * w)`, through
/// ember's op (`cube`) or the composed one.
fn run_linear_gelu(
    vals: &[Vec<f64>; 4],
    [b, t, d_in, d_out]: [usize; 4],
    device: Device,
    dtype: DType,
    cube: bool,
) -> Vec<Vec<f64>> {
    let x = leaf(&vals[0], [b, t, d_in], device.clone(), dtype);
    let weight = leaf(&vals[1], [d_in, d_out], device.clone(), dtype);
    let bias = leaf(&vals[2], [d_out], device.clone(), dtype);
    let layer = Linear {
        weight: Param::from_tensor(weight.clone()),
        bias: Some(Param::from_tensor(bias.clone())),
    };
    let y = if cube {
        assert!(uses_cube_kernels(&x));
        linear_gelu(x.clone(), &layer)
    } else {
        composed_linear_gelu(x.clone(), &layer)
    };
    let w = leaf(&vals[3], [b, t, d_out], device, dtype).detach();
    let grads = (y.clone() * w).sum().backward();
    let some = "every input gets a gradient";
    vec![
        to_f64(y.detach()),
        to_f64(x.grad(&grads).expect(some)),
        to_f64(weight.grad(&grads).expect(some)),
        to_f64(bias.grad(&grads).expect(some)),
    ]
}

fn check_linear_gelu(dims: [usize; 4], dtype: DType, tol: f64) {
    let [b, t, d_in, d_out] = dims;
    let vals = [
        rounded(&values(b * t * d_in, 31 + d_out as u64, 2.0), dtype),
        rounded(&values(d_in * d_out, 32, 0.5), dtype),
        rounded(&values(d_out, 33, 1.0), dtype),
        rounded(&values(b * t * d_out, 34, 1.0), dtype),
    ];
    let got = run_linear_gelu(&vals, dims, wgpu(), dtype, true);
    let want = run_linear_gelu(&vals, dims, Device::flex(), DType::F64, false);
    within(
        &format!("linear + GELU {dims:?} {dtype:?}"),
        &got,
        &want,
        tol,
    );
}

/// f32 within 1e-5 of the f64 reference, relative to each result's largest element (measured
/// at most 5.7e-7); f16, where the device has it, within 2^-9 (measured at most 6.3e-4: the
/// product before the bias is Burn's, rounded to f16 once, and the weight's and bias's
/// gradients are sums over the rows).
#[test]
fn linear_gelu_matches_the_composed_op() {
    let _device = device_lock();
    check_linear_gelu([2, 7, 24, 96], DType::F32, 1e-5);
    check_linear_gelu([1, 33, 64, 40], DType::F32, 1e-5);
    // The bias's gradient, a sum over 65,537 rows: Burn's `sum_dim` on lavapipe is wrong
    // along 65,536 or more.
    check_linear_gelu([1, 65_537, 4, 8], DType::F32, 1e-5);
    if wgpu().supports_dtype(DType::F16) {
        check_linear_gelu([2, 7, 24, 96], DType::F16, 2f64.powi(-9));
    }
}

/// The CubeCL op keeps the product before the bias for backward (beside the input and the
/// weight, which exist before the forward); the composed op keeps four tensors of the output's
/// size (measured on lavapipe), its biased output, its square and its sigmoid among them.
#[test]
fn linear_gelu_keeps_one_tensor_of_its_output_for_backward() {
    let _device = device_lock();
    let (rows, d_in, d_out) = (256, 64, 1024);
    let device = wgpu();
    let out = (rows * d_out * 4) as u64;
    let kept = |cube: bool| {
        let x = leaf(
            &values(rows * d_in, 41, 1.0),
            [1, rows, d_in],
            device.clone(),
            DType::F32,
        );
        let layer = Linear {
            weight: Param::from_tensor(leaf(
                &values(d_in * d_out, 42, 0.2),
                [d_in, d_out],
                device.clone(),
                DType::F32,
            )),
            bias: Some(Param::from_tensor(leaf(
                &values(d_out, 43, 0.2),
                [d_out],
                device.clone(),
                DType::F32,
            ))),
        };
        bytes_kept_by_forward(&device, x, |x| {
            let y = if cube {
                linear_gelu(x, &layer)
            } else {
                composed_linear_gelu(x, &layer)
            };
            y.sum().reshape([1])
        })
    };
    let cube = kept(true);
    let composed = kept(false);
    eprintln!("kept after the forward: CubeCL {cube} B, composed {composed} B, output {out} B");
    assert!(cube < 2 * out, "the CubeCL op keeps {cube} B");
    assert!(
        composed >= 3 * out,
        "the composed op keeps {composed} B: the check would not see its three tensors"
    );
}

/// ember's kernels as [`ember_model::kernels::ahead`] defines them without a device (what
/// `ember selftest --ptx` compiles for CUDA) are the ones a step launches: for every kernel,
/// the f32 definition has the id of one that the ops launch on wgpu for a block of gpt2's
/// width and heads. The id covers what the compiled code depends on (compile-time arguments,
/// cube dimensions, element types), not the batch or sequence length, so a short sequence
/// launches gpt2's kernels.
#[test]
fn kernels_defined_ahead_are_the_ones_a_step_launches() {
    let _lock = device_lock();
    let (t, d, heads, v) = (64, 768, 12, 512);
    let launched = cubecl::launched::LaunchedKernels::new();
    let x = leaf(
        &values(t * 3 * d, 41, 1.0),
        [1, t, 3 * d],
        wgpu(),
        DType::F32,
    );
    for path in [CubeAttention::Flash, CubeAttention::PRODUCTS] {
        set_cube_attention(path);
        let grads = causal_attention(x.clone(), heads).sum().backward();
        assert!(x.grad(&grads).is_some());
    }
    let targets: Vec<i64> = (0..t).map(|i| (i * 7 % v) as i64).collect();
    let logits = values(t * v, 42, 4.0);
    cross_entropy(&logits, &targets, [t, v], wgpu(), DType::F32, true);
    let norm = [t * d, d, d, t * d].map(|n| values(n, 43 + n as u64, 1.0));
    run_layer_norm(&norm, [t, d], wgpu(), DType::F32);
    let mlp = [t * d, d * 4 * d, 4 * d, t * 4 * d].map(|n| values(n, 44 + n as u64, 0.5));
    run_linear_gelu(&mlp, [1, t, d, 4 * d], wgpu(), DType::F32, true);
    wgpu().sync().unwrap();
    let launched = launched.finish();

    let client = cubecl::Device::wgpu(Default::default()).unwrap().client();
    let ahead = ember_model::kernels::ahead(
        client.properties_shared(),
        client.target_properties_shared(),
    );
    let mut kernels = std::collections::BTreeMap::new();
    for (name, kernel) in &ahead {
        let kernel_name = name.split(' ').next().unwrap();
        let hit = name.contains("F32") && launched.contains(&kernel.id().stable_hash());
        *kernels.entry(kernel_name).or_insert(false) |= hit;
    }
    let missing: Vec<_> = kernels.iter().filter(|(_, hit)| !**hit).collect();
    assert!(
        missing.is_empty(),
        "defined ahead as no launch defines them: {missing:?}"
    );
    assert_eq!(kernels.len(), 16, "{kernels:?}");
}
