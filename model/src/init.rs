//! Deterministic parameter initialisation keyed by parameter path.
//!
//! Burn initialises lazily and its `ParamId`s are random, so seeding a device does not make
//! two processes agree. Here every tensor's values are a pure function of (seed, path), drawn
//! on the host: any rank, any world size and any run get the same initial model bit for bit.
//! Not a general RNG: no state is shared between tensors.

use std::ops::Range;

use burn::module::{Param, ParamId};
use burn::tensor::{Device, Shape, Tensor, TensorData};

/// How one parameter tensor starts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// All zeros (biases, LayerNorm shifts).
    Zeros,
    /// All ones (LayerNorm scales).
    Ones,
    /// Normal with mean 0 and this standard deviation.
    Normal(f64),
}

/// splitmix64 (Steele, Lea, Flood 2014): a fast, well-mixed 64-bit hash, used as a counter-based
/// generator so a tensor's values never depend on which tensors were drawn before it.
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a of the path, mixed with the seed: the stream key of one parameter.
fn stream_key(seed: u64, path: &str) -> u64 {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for b in path.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01B3);
    }
    splitmix64(h ^ splitmix64(seed))
}

/// The values of a parameter of `numel` elements, as f32, row-major.
pub fn init_values(init: Init, seed: u64, path: &str, numel: usize) -> Vec<f32> {
    init_range(init, seed, path, 0..numel)
}

/// Elements `range` of [`init_values`], drawn without the elements before them: element `i`
/// is a pure function of (seed, path, i), so a rank draws exactly the range it owns.
pub fn init_range(init: Init, seed: u64, path: &str, range: Range<usize>) -> Vec<f32> {
    match init {
        Init::Zeros => vec![0.0; range.len()],
        Init::Ones => vec![1.0; range.len()],
        Init::Normal(std) => {
            let key = stream_key(seed, path);
            // Box-Muller on pairs of uniforms in (0, 1]; f64 so the tails are accurate.
            let uniform = |i: u64| {
                ((splitmix64(key ^ splitmix64(i)) >> 11) as f64 + 1.0) / (1u64 << 53) as f64
            };
            range
                .map(|i| {
                    let pair = (i / 2) as u64;
                    let r = (-2.0 * uniform(2 * pair).ln()).sqrt();
                    let theta = std::f64::consts::TAU * uniform(2 * pair + 1);
                    let z = if i % 2 == 0 {
                        r * theta.cos()
                    } else {
                        r * theta.sin()
                    };
                    (z * std) as f32
                })
                .collect()
        }
    }
}

/// Parameter `path` of `shape` on `device`, trainable and lazy: its values are drawn the first
/// time something reads it (Burn's `Param::uninitialized`), so a model that is only a skeleton
/// for a partitioner never allocates them.
pub fn param<const D: usize>(
    init: Init,
    seed: u64,
    path: &str,
    shape: [usize; D],
    device: &Device,
) -> Param<Tensor<D>> {
    let path = path.to_string();
    Param::uninitialized(
        ParamId::new(),
        move |device, require_grad| {
            let values = init_values(init, seed, &path, shape.iter().product());
            let t = Tensor::from_data(TensorData::new(values, shape), device);
            if require_grad { t.require_grad() } else { t }
        },
        device.clone(),
        true,
        Shape::new(shape),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_has_requested_moments() {
        let v = init_values(Init::Normal(0.02), 7, "h.0.attn.c_attn.weight", 200_000);
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        assert!(mean.abs() < 2e-4, "mean {mean}");
        assert!((var.sqrt() - 0.02).abs() < 2e-4, "std {}", var.sqrt());
    }

    #[test]
    fn values_depend_on_seed_and_path_only() {
        let a = init_values(Init::Normal(1.0), 1, "wte.weight", 16);
        assert_eq!(a, init_values(Init::Normal(1.0), 1, "wte.weight", 16));
        assert_ne!(a, init_values(Init::Normal(1.0), 2, "wte.weight", 16));
        assert_ne!(a, init_values(Init::Normal(1.0), 1, "wpe.weight", 16));
        // A prefix of a longer draw is the shorter draw: shapes do not shift the stream.
        assert_eq!(
            &init_values(Init::Normal(1.0), 1, "wte.weight", 32)[..16],
            &a[..]
        );
        // Any range alone is that range of the whole draw.
        assert_eq!(
            init_range(Init::Normal(1.0), 1, "wte.weight", 5..13),
            a[5..13]
        );
    }
}
