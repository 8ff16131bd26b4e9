//! Every quantization runtime present in this build (host always; the CubeCL kernels on wgpu
//! with `--features wgpu`) against the scalar reference, bit for bit: quantized bytes and
//! scales exactly, dequantized values exactly (any NaN matching any NaN: payloads are not
//! specified). Covers lengths that aren't a multiple of the block, all-zero blocks, ±inf, NaN,
//! -0, exact ties and subnormals.

use ember_comm::quant::host::HostKernels;
use ember_comm::quant::{BlockSize, QuantFormat, QuantKernels, reference};

fn runtimes() -> Vec<Box<dyn QuantKernels>> {
    #[allow(unused_mut)]
    let mut out: Vec<Box<dyn QuantKernels>> = vec![Box::new(HostKernels)];
    #[cfg(feature = "wgpu")]
    out.push(Box::new(
        ember_comm::quant::cube::CubeKernels::wgpu()
            .expect("the wgpu feature is on, so a device must exist"),
    ));
    out
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let mant = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let exp = ((s >> 8) % 24) as i32 - 12;
            mant * 2f32.powi(exp)
        })
        .collect()
}

fn cases() -> Vec<(&'static str, Vec<f32>)> {
    let mut special = values(100, 3);
    special[..16].fill(0.0);
    special[20] = f32::INFINITY;
    special[40] = f32::NEG_INFINITY;
    special[70] = f32::NAN;
    special[33] = -0.0;
    special[90] = -f32::NAN;
    vec![
        ("random 1000", values(1000, 1)),
        ("random 4096", values(4096, 2)),
        ("zeros, ±inf, NaN, -0", special),
        (
            "exact ties",
            vec![
                127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 7.0, 0.5, 1.5, 2.5, -0.5, -1.5,
                -2.5, 6.5,
            ],
        ),
        (
            "subnormals",
            vec![1e-40, -3e-42, 1e-45, 0.0, 2e-38, 5e-39, 7e-45, 1e-44, 1e-39],
        ),
        ("length 7", values(7, 4)),
        ("length 1", vec![-3.25]),
        ("all zero", vec![0.0; 64]),
        ("empty", vec![]),
    ]
}

fn same(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
}

#[test]
fn every_runtime_is_bit_identical_to_the_scalar_reference() {
    for rt in runtimes() {
        for block in [8, 16, 2048] {
            let block = BlockSize::new(block).unwrap();
            for format in [QuantFormat::Int8, QuantFormat::Int4] {
                for (name, x) in cases() {
                    let what = format!("{} {name} {format:?} block {}", rt.name(), block.get());
                    let want = reference::quantize(&x, format, block);
                    let got = rt.quantize(&x, format, block);
                    assert!(got.bit_eq(&want), "{what}: quantize\n{got:?}\n{want:?}");
                    assert!(
                        same(&rt.dequantize(&want), &reference::dequantize(&want)),
                        "{what}: dequantize"
                    );
                    let other = reference::quantize(&values(x.len(), 11), format, block);
                    let parts = vec![want.clone(), other, want];
                    assert!(
                        same(
                            &rt.dequantize_sum(&parts),
                            &reference::dequantize_sum(&parts)
                        ),
                        "{what}: dequantize_sum"
                    );
                }
            }
        }
    }
}

#[test]
fn large_buffers_span_many_cubes() {
    // More than 65535 cubes of 256 units: the kernels' 2-D dispatch must cover every element.
    let n = 65_535 * 256 + 40;
    let x = values(n, 5);
    let block = BlockSize::new(64).unwrap();
    for rt in runtimes() {
        for format in [QuantFormat::Int8, QuantFormat::Int4] {
            let want = reference::quantize(&x, format, block);
            assert!(
                rt.quantize(&x, format, block).bit_eq(&want),
                "{} {format:?}",
                rt.name()
            );
            assert!(
                same(&rt.dequantize(&want), &reference::dequantize(&want)),
                "{}",
                rt.name()
            );
        }
    }
}
