//! Dropout whose masks are a pure function of (seed, the sequence's index in the global
//! batch, the dropout site, the element): however a batch is split over micro-batches or
//! ranks, and however often a layer is recomputed, every sequence gets the masks one process
//! computing the whole batch would give it. Masks are drawn on the host with a counter-based
//! hash, so they are also the same on every backend. Not a general RNG: nothing is stateful.

use burn::tensor::{Tensor, TensorData};

/// What a training forward's dropout masks are keyed by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DropoutKey {
    /// The step's seed (a function of the run's seed and the step).
    pub seed: u64,
    /// The global index of each row of the batch, in row order.
    pub samples: Vec<u64>,
}

/// splitmix64's finaliser: a well-mixed 64-bit hash of `z`.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `x` with each element dropped with probability `p` and the rest scaled by `1 / (1 - p)`,
/// the masks keyed by `key` and `site` (which layer). Identity when `p` is 0 or `key` is
/// `None` (evaluation).
///
/// # Shapes
/// - x: `[B, T, C]`, `B` = `key.samples.len()`
/// - output: `[B, T, C]`
pub fn dropout(x: Tensor<3>, p: f64, key: Option<&DropoutKey>, site: u64) -> Tensor<3> {
    let Some(key) = key.filter(|_| p > 0.0) else {
        return x;
    };
    let [b, t, c] = x.dims();
    assert_eq!(key.samples.len(), b, "one dropout key per row of the batch");
    let scale = (1.0 / (1.0 - p)) as f32;
    // Keep an element when its 53-bit uniform is at least p.
    let threshold = (p * (1u64 << 53) as f64) as u64;
    let per_row = t * c;
    let mut mask = Vec::with_capacity(b * per_row);
    for &sample in &key.samples {
        let row = mix(mix(key.seed ^ mix(sample)) ^ mix(site.wrapping_add(0x5EED)));
        mask.extend((0..per_row as u64).map(|i| {
            if mix(row ^ i) >> 11 >= threshold {
                scale
            } else {
                0.0
            }
        }));
    }
    let device = x.device();
    let mask = Tensor::<3>::from_data(TensorData::new(mask, [b, t, c]), &device);
    let mask = if x.dtype() == mask.dtype() {
        mask
    } else {
        mask.cast(x.dtype())
    };
    x * mask
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    fn ones(b: usize) -> Tensor<3> {
        Tensor::ones([b, 4, 64], &Device::flex())
    }

    fn values(t: Tensor<3>) -> Vec<f32> {
        t.into_data().try_to_vec::<f32>().unwrap()
    }

    #[test]
    fn a_row_gets_the_same_mask_in_any_batch_and_split() {
        let whole = DropoutKey {
            seed: 9,
            samples: vec![10, 11, 12, 13],
        };
        let all = values(dropout(ones(4), 0.25, Some(&whole), 3));
        let half = DropoutKey {
            seed: 9,
            samples: vec![12, 13],
        };
        let part = values(dropout(ones(2), 0.25, Some(&half), 3));
        assert_eq!(&all[2 * 256..], &part[..]);
        // Another site or seed draws other masks; the drop rate is about p.
        let other = values(dropout(ones(4), 0.25, Some(&whole), 4));
        assert_ne!(all, other);
        let dropped = all.iter().filter(|&&v| v == 0.0).count() as f64 / all.len() as f64;
        assert!((dropped - 0.25).abs() < 0.05, "{dropped}");
        assert!(all.iter().all(|&v| v == 0.0 || v == 1.0 / 0.75));
        // No key (evaluation) or p = 0: identity.
        assert_eq!(values(dropout(ones(4), 0.25, None, 3)), vec![1.0; 1024]);
        assert_eq!(
            values(dropout(ones(4), 0.0, Some(&whole), 3)),
            vec![1.0; 1024]
        );
    }
}
