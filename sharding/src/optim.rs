//! AdamW on flat f32 tensors on the run's device: the master weights and both moments of one
//! buffer (a whole parameter, or a rank's shard of a unit), with weight decay on sub-ranges.
//! The arithmetic is PyTorch's `torch.optim.AdamW`, one tensor op at a time in one fixed
//! order, so a shard updates exactly as the same elements of an unsharded model do.

use std::ops::Range;

use burn::tensor::{Device, Tensor};

use crate::staging;
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

/// The scalars of one AdamW update.
#[derive(Debug, Clone, Copy)]
struct Coefficients {
    /// Decoupled weight decay's factor, `1 - lr * weight_decay`.
    decay: f64,
    /// `lr / (1 - beta1^t)`.
    step_size: f64,
    /// `sqrt(1 - beta2^t)`.
    sqrt_bias2: f64,
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
        let k = Coefficients {
            decay: 1.0 - lr * c.weight_decay,
            step_size: lr / bias1,
            sqrt_bias2: bias2.sqrt(),
        };
        if self.master.device() == Device::flex() {
            self.update_on_host(c, &k, grad);
        } else {
            self.update_with_tensor_ops(c, &k, grad);
        }
    }

    /// [`update`](Self::update) as tensor operations on the buffers' device.
    fn update_with_tensor_ops(&mut self, c: &AdamConfig, k: &Coefficients, grad: Tensor<1>) {
        if c.weight_decay > 0.0 {
            let n = self.len();
            match self.decay.as_slice() {
                [] => {}
                [whole] if *whole == (0..n) => self.master = self.master.clone() * k.decay,
                ranges => {
                    for r in ranges {
                        let part = self.master.clone().slice(r.clone()) * k.decay;
                        self.master = self.master.clone().slice_assign(r.clone(), part);
                    }
                }
            }
        }
        let m = self.exp_avg.clone() * c.beta1 + grad.clone() * (1.0 - c.beta1);
        let v = self.exp_avg_sq.clone() * c.beta2 + (grad.clone() * grad) * (1.0 - c.beta2);
        let denom = v.clone().sqrt() / k.sqrt_bias2 + c.eps;
        self.master = self.master.clone() - (m.clone() / denom) * k.step_size;
        self.exp_avg = m;
        self.exp_avg_sq = v;
    }

    /// [`update`](Self::update) in one pass over buffers in host memory, in place: the same
    /// f32 operations in the same order as the tensor ops (so the same bits), without their
    /// eight or more temporaries of the buffer's size per step.
    fn update_on_host(&mut self, c: &AdamConfig, k: &Coefficients, grad: Tensor<1>) {
        let device = self.master.device();
        let take =
            |t: &mut Tensor<1>| staging::to_f32(std::mem::replace(t, Tensor::empty([0], &device)));
        let mut p = take(&mut self.master);
        let mut m = take(&mut self.exp_avg);
        let mut v = take(&mut self.exp_avg_sq);
        let g = staging::to_f32(grad);
        if c.weight_decay > 0.0 {
            let factor = k.decay as f32;
            for r in &self.decay {
                p[r.clone()].iter_mut().for_each(|x| *x *= factor);
            }
        }
        let (b1, b1c) = (c.beta1 as f32, (1.0 - c.beta1) as f32);
        let (b2, b2c) = (c.beta2 as f32, (1.0 - c.beta2) as f32);
        let (sb2, eps, lr) = (k.sqrt_bias2 as f32, c.eps as f32, k.step_size as f32);
        for (((p, m), v), &g) in p.iter_mut().zip(&mut m).zip(&mut v).zip(&g) {
            *m = *m * b1 + g * b1c;
            *v = *v * b2 + (g * g) * b2c;
            let denom = v.sqrt() / sb2 + eps;
            *p -= (*m / denom) * lr;
        }
        self.master = staging::from_f32(p, &device);
        self.exp_avg = staging::from_f32(m, &device);
        self.exp_avg_sq = staging::from_f32(v, &device);
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
    fn the_host_pass_gives_the_tensor_ops_bits() {
        let c = AdamConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let n = 1000;
        let wave = |k: f32| (0..n).map(|i| ((i as f32) * k).sin()).collect::<Vec<_>>();
        let decay = vec![0..300, 450..1000];
        let mut host = FlatState::new(t(&wave(0.37)), decay.clone());
        let mut ops = host.clone();
        for step in 1..=5 {
            let g = t(&wave(0.11 * step as f32));
            let (lr, bias1, bias2) = (3e-3, 1.0 - 0.9f64.powi(step), 1.0 - 0.95f64.powi(step));
            let k = Coefficients {
                decay: 1.0 - lr * c.weight_decay,
                step_size: lr / bias1,
                sqrt_bias2: bias2.sqrt(),
            };
            host.update_on_host(&c, &k, g.clone());
            ops.update_with_tensor_ops(&c, &k, g);
        }
        for (a, b) in [
            (&host.master, &ops.master),
            (&host.exp_avg, &ops.exp_avg),
            (&host.exp_avg_sq, &ops.exp_avg_sq),
        ] {
            let bits = |t: &Tensor<1>| v(t).iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(a), bits(b));
        }
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
