//! AdamW on flat f32 tensors on the run's device: the master weights and both moments of one
//! buffer (a whole parameter, or a rank's shard of a unit), with weight decay on sub-ranges.
//! The arithmetic is PyTorch's `torch.optim.AdamW`, one tensor op at a time in one fixed
//! order, so a shard updates exactly as the same elements of an unsharded model do.

use std::ops::Range;

use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

/// AdamW hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamConfig {
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay, applied on the buffer's decay ranges only (GPT-2 training
    /// decays matrices and embeddings, not biases and norms).
    pub weight_decay: f64,
}

/// One flat buffer's optimizer state, all `[n]` f32 tensors on one device.
#[derive(Debug, Clone)]
pub struct FlatState {
    /// f32 master weights.
    pub master: Tensor<1>,
    /// First moment (`exp_avg` in PyTorch).
    pub exp_avg: Tensor<1>,
    /// Second moment (`exp_avg_sq`).
    pub exp_avg_sq: Tensor<1>,
    /// Element ranges where weight decay applies, ascending and disjoint.
    pub decay: Vec<Range<usize>>,
}

impl FlatState {
    /// Fresh state: `master` as given, zero moments.
    pub fn new(master: Tensor<1>, decay: Vec<Range<usize>>) -> Self {
        Self {
            exp_avg: master.zeros_like(),
            exp_avg_sq: master.zeros_like(),
            master,
            decay,
        }
    }

    /// Elements held.
    pub fn len(&self) -> usize {
        self.master.dims()[0]
    }

    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Applies update number `step` (1-based) with rate `lr` to gradient `grad` (`[n]`, f32).
    pub fn update(&mut self, c: &AdamConfig, step: u64, lr: f64, grad: Tensor<1>) {
        assert_eq!(grad.dims(), self.master.dims(), "one gradient per element");
        let t = step as i32;
        let bias1 = 1.0 - c.beta1.powi(t);
        let bias2 = 1.0 - c.beta2.powi(t);
        // PyTorch: denom = sqrt(v) / sqrt(bias2) + eps; p -= lr / bias1 * m / denom.
        let step_size = lr / bias1;
        let sqrt_bias2 = bias2.sqrt();
        if c.weight_decay > 0.0 {
            let factor = 1.0 - lr * c.weight_decay;
            let n = self.len();
            match self.decay.as_slice() {
                [] => {}
                [whole] if *whole == (0..n) => self.master = self.master.clone() * factor,
                ranges => {
                    for r in ranges {
                        let part = self.master.clone().slice(r.clone()) * factor;
                        self.master = self.master.clone().slice_assign(r.clone(), part);
                    }
                }
            }
        }
        let m = self.exp_avg.clone() * c.beta1 + grad.clone() * (1.0 - c.beta1);
        let v = self.exp_avg_sq.clone() * c.beta2 + (grad.clone() * grad) * (1.0 - c.beta2);
        let denom = v.clone().sqrt() / sqrt_bias2 + c.eps;
        self.master = self.master.clone() - (m.clone() / denom) * step_size;
        self.exp_avg = m;
        self.exp_avg_sq = v;
    }
}

/// The decay sub-ranges of `range` given each parameter's `(offset, numel, decay)`, relative
/// to `range.start`.
pub(crate) fn decay_ranges(
    range: &Range<usize>,
    params: &[(usize, usize, bool)],
) -> Vec<Range<usize>> {
    params
        .iter()
        .filter(|p| p.2)
        .filter_map(|&(offset, numel, _)| {
            let lo = offset.max(range.start);
            let hi = (offset + numel).min(range.end);
            (lo < hi).then(|| lo - range.start..hi - range.start)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

    fn t(v: &[f32]) -> Tensor<1> {
        Tensor::from_data(TensorData::new(v.to_vec(), [v.len()]), &Device::flex())
    }

    fn v(t: &Tensor<1>) -> Vec<f32> {
        t.to_data().try_to_vec::<f32>().unwrap()
    }

    #[test]
    fn decay_ranges_clip_parameters_to_the_shard() {
        let params = [(0, 10, true), (10, 3, false), (13, 7, true)];
        assert_eq!(decay_ranges(&(5..15), &params), vec![0..5, 8..10]);
        assert!(decay_ranges(&(10..13), &params).is_empty());
        assert_eq!(decay_ranges(&(18..24), &params), vec![0..2]);
    }

    #[test]
    fn adamw_matches_a_hand_computed_step_and_decays_only_its_ranges() {
        let c = AdamConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let (lr, g) = (0.01f64, [0.3f64, -0.1, 0.3]);
        let decay = std::iter::once(0..2).collect();
        let mut s = FlatState::new(t(&[1.0, -2.0, 0.5]), decay);
        s.update(&c, 1, lr, t(&[0.3, -0.1, 0.3]));
        // Step 1: m = 0.1 g, v = 0.05 g^2, so m_hat = g, v_hat = g^2: a step of lr * sign(g).
        let expect = |p: f64, gi: f64, decay: bool| {
            let p = if decay { p * (1.0 - lr * 0.1) } else { p };
            let vv = (0.05 * gi * gi).sqrt() / 0.05f64.sqrt() + 1e-8;
            (p - lr * gi / vv) as f32
        };
        let got = v(&s.master);
        for (i, (p, decay)) in [(1.0, true), (-2.0, true), (0.5, false)].iter().enumerate() {
            assert!(
                (got[i] - expect(*p, g[i], *decay)).abs() < 1e-6,
                "{i}: {got:?}"
            );
        }
    }
}
