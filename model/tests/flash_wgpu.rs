//! The CubeCL flash attention on wgpu (Mesa's lavapipe where there is no GPU) against the
//! attention composed of Burn's ops in f64 on flex: the output and the gradient of the packed
//! projection, in f32 and bf16, at sequence lengths that are not multiples of the kernels'
//! block and at head sizes on both sides of 64; and the memory an autodiff graph keeps after
//! the forward, which for the composed op includes every head's `T x T` probabilities.
#![cfg(feature = "wgpu")]

use burn::tensor::{DType, Device, DeviceKind, Tensor, TensorCreationOptions, TensorData};
use ember_model::kernels::{causal_attention, composed_causal_attention, uses_flash_kernels};

fn wgpu() -> Device {
    Device::wgpu(DeviceKind::DefaultDevice)
}

/// Deterministic values in [-scale, scale).
fn values(n: usize, seed: u64, scale: f64) -> Vec<f64> {
    let mut z = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            z ^= z << 13;
            z ^= z >> 7;
            z ^= z << 17;
            ((z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn leaf<const D: usize>(v: &[f64], shape: [usize; D], device: Device, dtype: DType) -> Tensor<D> {
    let options = TensorCreationOptions::new(device.autodiff()).with_dtype(dtype);
    Tensor::<D>::from_data(TensorData::new(v.to_vec(), shape), options).require_grad()
}

fn to_f64<const D: usize>(t: Tensor<D>) -> Vec<f64> {
    t.into_data().convert::<f64>().try_to_vec::<f64>().unwrap()
}

/// Largest `|a - b|` relative to the largest `|b|`.
fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-30);
    a.iter()
        .zip(b)
        .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()))
        / scale
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
    assert_eq!(uses_flash_kernels(&x), flash);
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

fn check(b: usize, t: usize, heads: usize, hd: usize, dtype: DType, tol: f64) {
    let d3 = 3 * heads * hd;
    let qkv = values(b * t * d3, 7 + t as u64, 1.5);
    let w = values(b * t * d3 / 3, 11, 1.0);
    let qkv = rounded(&qkv, dtype);
    let w = rounded(&w, dtype);
    let (y, g) = run(&qkv, &w, [b, t, d3], heads, wgpu(), dtype, true);
    let (want_y, want_g) = run(
        &qkv,
        &w,
        [b, t, d3],
        heads,
        Device::flex(),
        DType::F64,
        false,
    );
    let (ey, eg) = (rel_err(&y, &want_y), rel_err(&g, &want_g));
    eprintln!("B {b} T {t} H {heads} hd {hd} {dtype:?}: output {ey:.2e}, gradient {eg:.2e}");
    assert!(
        ey < tol,
        "{dtype:?} T {t} hd {hd}: output differs by {ey:e}"
    );
    assert!(
        eg < tol,
        "{dtype:?} T {t} hd {hd}: gradient differs by {eg:e}"
    );
}

/// f32: within 1e-5 of the f64 reference (relative to the largest element), which is a few
/// f32 roundings of sums over up to `T` keys.
#[test]
fn flash_attention_matches_the_composed_op_in_f32() {
    check(2, 70, 3, 16, DType::F32, 1e-5);
    check(1, 129, 2, 64, DType::F32, 1e-5);
    check(1, 40, 1, 80, DType::F32, 1e-5);
}

/// bf16 and f16, where the device has them: the inputs are values of the dtype for both, and
/// the kernels round each result once to it, so within two roundings of the dtype (2^-7 for
/// bf16, 2^-10 for f16) of the f64 reference.
#[test]
fn flash_attention_matches_the_composed_op_in_half_precision() {
    let mut ran = 0;
    for (dtype, tol) in [(DType::BF16, 2f64.powi(-7)), (DType::F16, 2f64.powi(-10))] {
        if !wgpu().supports_dtype(dtype) {
            eprintln!("this wgpu device has no {dtype:?}: not checked here");
            continue;
        }
        check(2, 70, 3, 16, dtype, tol);
        check(1, 129, 2, 64, dtype, tol);
        ran += 1;
    }
    eprintln!("{ran} half-precision dtypes checked");
}

/// What the autodiff graph keeps between forward and backward at `T = 1024`, one head of 64:
/// the flash op its input, output and one log-sum-exp per query (under 1 MB here); the
/// composed op also each head's `T x T` probabilities (4 MiB in f32).
#[test]
fn flash_attention_keeps_no_t_by_t_tensor_for_backward() {
    let (t, hd) = (1024, 64);
    let device = wgpu();
    let kept = |flash: bool| {
        let qkv = values(t * 3 * hd, 5, 1.0);
        let x = leaf(&qkv, [1, t, 3 * hd], device.clone(), DType::F32);
        device.sync().unwrap();
        let before = device
            .memory_pool_usage()
            .expect("wgpu reports its memory")
            .bytes_in_use;
        let y = if flash {
            causal_attention(x.clone(), 1)
        } else {
            composed_causal_attention(x.clone(), 1)
        };
        let loss = y.sum();
        device.sync().unwrap();
        let after = device.memory_pool_usage().unwrap().bytes_in_use;
        let grads = loss.backward();
        assert!(x.grad(&grads).is_some());
        after.saturating_sub(before)
    };
    let scores = (t * t * 4) as u64;
    let flash = kept(true);
    let composed = kept(false);
    eprintln!("kept after the forward: flash {flash} B, composed {composed} B, T x T {scores} B");
    assert!(flash < scores / 4, "flash keeps {flash} B");
    assert!(
        composed >= scores,
        "the composed op keeps {composed} B: the check would not see T x T"
    );
}
