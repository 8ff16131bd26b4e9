//! AdamW on one rank's f32 shard of a unit: the master weights and both moments of the
//! elements it owns. The arithmetic is PyTorch's `torch.optim.AdamW` in the order ember's
//! single-process optimizer applies it, one f32 operation at a time, so a shard updates
//! exactly as the same elements of an unsharded model would.

use std::ops::Range;

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
    /// Decoupled weight decay, applied to tensors of two or more dimensions only.
    pub weight_decay: f64,
}

/// One rank's optimizer state for one unit.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardState {
    /// Element range of the unit's padded flat buffer this rank owns.
    pub range: Range<usize>,
    /// f32 master weights of those elements.
    pub master: Vec<f32>,
    /// First moment.
    pub exp_avg: Vec<f32>,
    /// Second moment.
    pub exp_avg_sq: Vec<f32>,
    /// Sub-ranges (relative to `range`) where weight decay applies.
    pub decay: Vec<Range<usize>>,
}

impl ShardState {
    /// Fresh state: `master` as given, zero moments.
    pub fn new(range: Range<usize>, master: Vec<f32>, decay: Vec<Range<usize>>) -> Self {
        let n = master.len();
        Self {
            range,
            master,
            exp_avg: vec![0.0; n],
            exp_avg_sq: vec![0.0; n],
            decay,
        }
    }

    /// Bytes held (master and two moments).
    pub fn bytes(&self) -> u64 {
        4 * (self.master.len() + self.exp_avg.len() + self.exp_avg_sq.len()) as u64
    }

    /// Applies update number `step` (1-based) with rate `lr` to gradient `grad`.
    pub fn update(&mut self, c: &AdamConfig, step: u64, lr: f64, grad: &[f32]) {
        assert_eq!(
            grad.len(),
            self.master.len(),
            "one gradient per owned element"
        );
        let t = step as i32;
        let bias1 = 1.0 - c.beta1.powi(t);
        let bias2 = 1.0 - c.beta2.powi(t);
        let step_size = (lr / bias1) as f32;
        let sqrt_bias2 = bias2.sqrt() as f32;
        let decay_factor = (1.0 - lr * c.weight_decay) as f32;
        if c.weight_decay > 0.0 {
            for r in &self.decay {
                self.master[r.clone()]
                    .iter_mut()
                    .for_each(|p| *p *= decay_factor);
            }
        }
        let (b1, b1c) = (c.beta1 as f32, (1.0 - c.beta1) as f32);
        let (b2, b2c) = (c.beta2 as f32, (1.0 - c.beta2) as f32);
        let eps = c.eps as f32;
        let state = self
            .master
            .iter_mut()
            .zip(self.exp_avg.iter_mut())
            .zip(self.exp_avg_sq.iter_mut());
        for (((p, m), v), &g) in state.zip(grad) {
            *m = *m * b1 + g * b1c;
            *v = *v * b2 + (g * g) * b2c;
            let denom = v.sqrt() / sqrt_bias2 + eps;
            *p -= (*m / denom) * step_size;
        }
    }
}

/// The decay sub-ranges of `range` given each parameter's `(offset, numel, decay)`.
pub fn decay_ranges(range: &Range<usize>, params: &[(usize, usize, bool)]) -> Vec<Range<usize>> {
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

    #[test]
    fn decay_ranges_clip_parameters_to_the_shard() {
        let params = [(0, 10, true), (10, 3, false), (13, 7, true)];
        assert_eq!(decay_ranges(&(5..15), &params), vec![0..5, 8..10]);
        assert!(decay_ranges(&(10..13), &params).is_empty());
        assert_eq!(decay_ranges(&(18..24), &params), vec![0..2]);
    }

    #[test]
    fn first_step_moves_each_weight_by_lr_against_the_gradient_sign() {
        let c = AdamConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        let mut s = ShardState::new(0..3, vec![1.0, 1.0, 1.0], vec![]);
        s.update(&c, 1, 0.01, &[0.5, -2.0, 0.0]);
        assert!((s.master[0] - 0.99).abs() < 1e-6);
        assert!((s.master[1] - 1.01).abs() < 1e-6);
        assert_eq!(s.master[2], 1.0);
    }
}
