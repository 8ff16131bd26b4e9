//! AdamW over flat f32 tensors keyed by parameter name, the learning-rate schedule, and
//! global-norm clipping. Written here rather than taken from `burn-optim` because GPT-2
//! training decays only 2-D weights, the state must be saved by name (Burn keys it by the
//! random `ParamId`), and a ZeRO partition holds flat shards, not whole parameters.

use std::f64::consts::PI;

use burn::tensor::Tensor;

/// AdamW hyper-parameters (Loshchilov & Hutter; PyTorch's `torch.optim.AdamW` update order).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// Exponential decay of the first moment.
    pub beta1: f64,
    /// Exponential decay of the second moment.
    pub beta2: f64,
    /// Added to the denominator (PyTorch's default).
    pub eps: f64,
    /// Decoupled weight decay for parameters with `decay = true`.
    pub weight_decay: f64,
}

/// One parameter's optimizer state: the f32 master copy and its two moments, all `[numel]`.
#[derive(Debug, Clone)]
pub struct ParamState {
    /// Parameter path (checkpoint key).
    pub name: String,
    /// Logical shape of the parameter.
    pub shape: Vec<usize>,
    /// Whether weight decay applies (2-D weights: matrices and embeddings).
    pub decay: bool,
    /// f32 master weights.
    pub master: Tensor<1>,
    /// First moment (`exp_avg` in PyTorch).
    pub exp_avg: Tensor<1>,
    /// Second moment (`exp_avg_sq`).
    pub exp_avg_sq: Tensor<1>,
}

/// AdamW over named flat parameters.
#[derive(Debug, Clone)]
pub struct AdamW {
    /// Hyper-parameters.
    pub config: AdamWConfig,
    /// Number of updates applied so far (bias correction uses `step + 1` for the next one).
    pub step: u64,
    /// State per parameter, in the model's visit order.
    pub params: Vec<ParamState>,
}

impl AdamW {
    /// Fresh state for `(name, shape, master)` triples: zero moments, step 0.
    pub fn new(config: AdamWConfig, params: Vec<(String, Vec<usize>, Tensor<1>)>) -> Self {
        let params = params
            .into_iter()
            .map(|(name, shape, master)| ParamState {
                decay: shape.len() >= 2,
                exp_avg: master.zeros_like(),
                exp_avg_sq: master.zeros_like(),
                name,
                shape,
                master,
            })
            .collect();
        Self {
            config,
            step: 0,
            params,
        }
    }

    /// Applies one update with learning rate `lr`; `grads[i]` belongs to `params[i]`.
    pub fn update(&mut self, lr: f64, grads: Vec<Tensor<1>>) {
        assert_eq!(grads.len(), self.params.len(), "one gradient per parameter");
        self.step += 1;
        let c = self.config;
        let t = self.step as i32;
        let bias1 = 1.0 - c.beta1.powi(t);
        let bias2 = 1.0 - c.beta2.powi(t);
        // PyTorch: denom = sqrt(v) / sqrt(bias2) + eps; p -= lr / bias1 * m / denom.
        let step_size = lr / bias1;
        let sqrt_bias2 = bias2.sqrt();
        for (p, g) in self.params.iter_mut().zip(grads) {
            if p.decay && c.weight_decay > 0.0 {
                p.master = p.master.clone() * (1.0 - lr * c.weight_decay);
            }
            p.exp_avg = p.exp_avg.clone() * c.beta1 + g.clone() * (1.0 - c.beta1);
            p.exp_avg_sq = p.exp_avg_sq.clone() * c.beta2 + (g.clone() * g) * (1.0 - c.beta2);
            let denom = p.exp_avg_sq.clone().sqrt() / sqrt_bias2 + c.eps;
            p.master = p.master.clone() - (p.exp_avg.clone() / denom) * step_size;
        }
    }
}

/// Learning-rate schedule: linear warmup, cosine decay to `min_lr`, then flat (nanoGPT's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    /// Peak rate, reached at the end of warmup.
    pub lr: f64,
    /// Floor after the decay.
    pub min_lr: f64,
    /// Warmup steps.
    pub warmup_iters: u64,
    /// Step where the cosine reaches `min_lr`.
    pub lr_decay_iters: u64,
}

impl LrSchedule {
    /// The rate for optimizer step `it` (0-based).
    pub fn at(&self, it: u64) -> f64 {
        if it < self.warmup_iters {
            return self.lr * (it + 1) as f64 / (self.warmup_iters + 1) as f64;
        }
        if it >= self.lr_decay_iters {
            return self.min_lr;
        }
        let span = (self.lr_decay_iters - self.warmup_iters).max(1) as f64;
        let ratio = (it - self.warmup_iters) as f64 / span;
        let coeff = 0.5 * (1.0 + (PI * ratio).cos());
        self.min_lr + coeff * (self.lr - self.min_lr)
    }
}

/// The squared L2 norm of all gradients together, as a device scalar `[1]`.
pub fn squared_norm(grads: &[Tensor<1>]) -> Tensor<1> {
    grads
        .iter()
        .map(|g| (g.clone() * g.clone()).sum())
        .reduce(|a, b| a + b)
        .expect("at least one gradient")
}

/// Scales `grads` so their global norm is at most `max_norm` (PyTorch's
/// `clip_grad_norm_`: factor `max_norm / (norm + 1e-6)` when above). Returns the factor.
pub fn clip_by_global_norm(grads: &mut [Tensor<1>], norm: f64, max_norm: f64) -> f64 {
    if max_norm <= 0.0 || norm <= max_norm {
        return 1.0;
    }
    let factor = max_norm / (norm + 1e-6);
    for g in grads.iter_mut() {
        *g = g.clone() * factor;
    }
    factor
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
    fn adamw_matches_a_hand_computed_step() {
        let config = AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let mut opt = AdamW::new(
            config,
            vec![
                ("w".into(), vec![1, 2], t(&[1.0, -2.0])),
                ("b".into(), vec![2], t(&[0.5, 0.5])),
            ],
        );
        let (lr, g) = (0.01f64, [0.3f64, -0.1]);
        opt.update(lr, vec![t(&[0.3, -0.1]), t(&[0.3, -0.1])]);
        // Step 1: m = 0.1 g, v = 0.05 g^2; m_hat = g, v_hat = g^2 => update = lr * sign(g).
        let expect = |p: f64, gi: f64, decay: bool| {
            let p = if decay { p * (1.0 - lr * 0.1) } else { p };
            let m = 0.1 * gi / 0.1;
            let vv = (0.05 * gi * gi).sqrt() / 0.05f64.sqrt() + 1e-8;
            (p - lr * m / vv) as f32
        };
        let w = v(&opt.params[0].master);
        let b = v(&opt.params[1].master);
        assert!((w[0] - expect(1.0, g[0], true)).abs() < 1e-6, "{w:?}");
        assert!((w[1] - expect(-2.0, g[1], true)).abs() < 1e-6, "{w:?}");
        assert!((b[0] - expect(0.5, g[0], false)).abs() < 1e-6, "{b:?}");
        assert!(opt.params[0].decay && !opt.params[1].decay);
    }

    #[test]
    fn schedule_warms_up_then_decays_to_min() {
        let s = LrSchedule {
            lr: 1.0,
            min_lr: 0.1,
            warmup_iters: 10,
            lr_decay_iters: 110,
        };
        assert!((s.at(0) - 1.0 / 11.0).abs() < 1e-12);
        assert!((s.at(10) - 1.0).abs() < 1e-12);
        assert!((s.at(60) - 0.55).abs() < 1e-12);
        assert_eq!(s.at(110), 0.1);
        assert_eq!(s.at(10_000), 0.1);
    }

    #[test]
    fn clipping_scales_to_the_max_norm() {
        let mut grads = vec![t(&[3.0]), t(&[4.0])];
        let norm = (squared_norm(&grads).into_scalar::<f32>() as f64).sqrt();
        assert!((norm - 5.0).abs() < 1e-6);
        clip_by_global_norm(&mut grads, norm, 1.0);
        let clipped = (squared_norm(&grads).into_scalar::<f32>() as f64).sqrt();
        assert!((clipped - 1.0).abs() < 1e-5, "{clipped}");
    }
}
