//! Optimizers over flat f32 tensors on the run's device: each holds, per buffer (a whole
//! parameter, or a rank's shard of a unit), the master weights and its own per-element state,
//! with weight decay on sub-ranges. A shard updates exactly as the same elements of an
//! unsharded model do, since every update is elementwise.
//!
//! [`AdamW`], [`Adam`] and [`Sgd`] ship; any other elementwise optimizer implements
//! [`Optimizer`].

#[cfg(feature = "cubecl")]
pub(crate) mod cube;

use std::ops::Range;

use burn::tensor::{Device, Tensor};
use rayon::prelude::*;

use crate::transport::staging;
use serde::{Deserialize, Serialize};

/// An elementwise optimizer of flat buffers: what [`ShardedModel::apply`] runs on each of the
/// rank's optimizer shards.
///
/// [`ShardedModel::apply`]: crate::ShardedModel::apply
pub trait Optimizer {
    /// The names of its per-element state buffers, in the order of [`FlatState::slots`]
    /// (checkpoints store each as `<name>/<parameter path>`). AdamW: `exp_avg`, `exp_avg_sq`.
    fn state_names(&self) -> &'static [&'static str];

    /// Applies update number `step` (1-based: 1 on the first step) at learning rate `lr` to
    /// `state`, whose slots start at zero, given the buffer's gradient `grad` (`[n]`, f32).
    fn update(&self, step: u64, lr: f64, state: &mut FlatState, grad: Tensor<1>);

    /// [`update`](Self::update) with the gradient `grad` multiplied by each of `factors` in
    /// turn, each in f32 (the step's clipping). The default multiplies first; an optimizer
    /// that makes one pass over the buffers can fold the factors into it, giving the same
    /// bits without writing the scaled gradient.
    fn update_scaled(
        &self,
        step: u64,
        lr: f64,
        state: &mut FlatState,
        grad: Tensor<1>,
        factors: &[f64],
    ) {
        self.update(
            step,
            lr,
            state,
            crate::transport::host::scale_by(grad, factors),
        )
    }
}

/// Which parameters weight decay applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecayOn {
    /// Parameters of two or more dimensions (weights and embeddings), not biases or norms:
    /// GPT-2's and nanoGPT's convention.
    #[default]
    Matrices,
    /// Every parameter, as Burn's and PyTorch's optimizers do by default.
    All,
}

/// AdamW: Adam with decoupled weight decay. The arithmetic is PyTorch's `torch.optim.AdamW`,
/// one operation at a time in one fixed order.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamW {
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay, `p *= 1 - lr * weight_decay` before the step.
    pub weight_decay: f64,
    /// Which parameters it decays.
    #[serde(default)]
    pub decay_on: DecayOn,
}

/// Adam, with weight decay as an L2 penalty added to the gradient (`torch.optim.Adam`,
/// Burn's `AdamConfig` with a `WeightDecayConfig`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Adam {
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// L2 penalty: `g += weight_decay * p`.
    pub weight_decay: f64,
    /// Which parameters it penalises.
    #[serde(default)]
    pub decay_on: DecayOn,
}

/// Stochastic gradient descent with momentum (`torch.optim.SGD`, Burn's `SgdConfig` with a
/// `MomentumConfig`): the first step's velocity is the gradient itself.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Sgd {
    /// Velocity decay (0: plain SGD).
    pub momentum: f64,
    /// Share of the gradient held back from the velocity after the first step.
    pub dampening: f64,
    /// Nesterov's look-ahead.
    pub nesterov: bool,
    /// L2 penalty: `g += weight_decay * p`.
    pub weight_decay: f64,
    /// Which parameters it penalises.
    #[serde(default)]
    pub decay_on: DecayOn,
}

impl Default for AdamW {
    /// `torch.optim.AdamW`'s defaults: betas 0.9 and 0.999, eps 1e-8, weight decay 0.01 on
    /// every parameter.
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            decay_on: DecayOn::All,
        }
    }
}

impl Default for Adam {
    /// `torch.optim.Adam`'s defaults: betas 0.9 and 0.999, eps 1e-8, no weight decay.
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decay_on: DecayOn::All,
        }
    }
}

impl Default for Sgd {
    /// `torch.optim.SGD`'s defaults: no momentum, dampening or weight decay, no Nesterov.
    fn default() -> Self {
        Self {
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
            decay_on: DecayOn::All,
        }
    }
}

/// One flat buffer's optimizer state, all `[n]` f32 tensors on one device.
#[derive(Debug, Clone)]
pub struct FlatState {
    /// f32 master weights.
    pub master: Tensor<1>,
    /// The optimizer's per-element state, one tensor per [`Optimizer::state_names`] entry.
    pub slots: Vec<Tensor<1>>,
    /// Element ranges of parameters of two or more dimensions, ascending and disjoint (where
    /// [`DecayOn::Matrices`] decays).
    pub matrices: Vec<Range<usize>>,
}

impl FlatState {
    /// Fresh state: `master` as given, `slots` zero buffers.
    pub fn new(master: Tensor<1>, slots: usize, matrices: Vec<Range<usize>>) -> Self {
        Self {
            slots: (0..slots).map(|_| master.zeros_like()).collect(),
            master,
            matrices,
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

    /// The ranges `on` selects.
    pub fn decay_ranges(&self, on: DecayOn) -> Vec<Range<usize>> {
        match on {
            DecayOn::Matrices => self.matrices.clone(),
            DecayOn::All => std::iter::once(0..self.len()).collect(),
        }
    }
}

/// `x` with `f` applied to its elements in `ranges` (`n` elements in all).
fn on_ranges(
    x: Tensor<1>,
    ranges: &[Range<usize>],
    f: impl Fn(Tensor<1>) -> Tensor<1>,
) -> Tensor<1> {
    let n = x.dims()[0];
    match ranges {
        [] => x,
        [whole] if *whole == (0..n) => f(x),
        ranges => {
            let mut x = x;
            for r in ranges {
                let part = f(x.clone().slice(r.clone()));
                x = x.slice_assign(r.clone(), part);
            }
            x
        }
    }
}

/// `grad + weight_decay * master` on `ranges`: an L2 penalty's gradient.
fn l2(
    grad: Tensor<1>,
    master: &Tensor<1>,
    weight_decay: f64,
    ranges: &[Range<usize>],
) -> Tensor<1> {
    if weight_decay == 0.0 || ranges.is_empty() {
        return grad;
    }
    let n = grad.dims()[0];
    let penalty = master.clone() * weight_decay;
    if let [whole] = ranges
        && *whole == (0..n)
    {
        return grad + penalty;
    }
    let mut only = penalty.zeros_like();
    for r in ranges {
        only = only.slice_assign(r.clone(), penalty.clone().slice(r.clone()));
    }
    grad + only
}

/// The scalars of one Adam update.
#[derive(Debug, Clone, Copy)]
struct Coefficients {
    /// Decoupled weight decay's factor, `1 - lr * weight_decay`.
    decay: f64,
    /// `lr / (1 - beta1^t)`.
    step_size: f64,
    /// `sqrt(1 - beta2^t)`.
    sqrt_bias2: f64,
}

impl Coefficients {
    fn new(beta1: f64, beta2: f64, weight_decay: f64, step: u64, lr: f64) -> Self {
        let t = step as i32;
        // PyTorch: denom = sqrt(v) / sqrt(bias2) + eps; p -= lr / bias1 * m / denom.
        Self {
            decay: 1.0 - lr * weight_decay,
            step_size: lr / (1.0 - beta1.powi(t)),
            sqrt_bias2: (1.0 - beta2.powi(t)).sqrt(),
        }
    }
}

/// Adam's moments and step on `state` (two slots) for gradient `grad`, as tensor operations.
fn adam_moments(
    beta1: f64,
    beta2: f64,
    eps: f64,
    k: &Coefficients,
    state: &mut FlatState,
    grad: Tensor<1>,
) {
    let m = state.slots[0].clone() * beta1 + grad.clone() * (1.0 - beta1);
    let v = state.slots[1].clone() * beta2 + (grad.clone() * grad) * (1.0 - beta2);
    let denom = v.clone().sqrt() / k.sqrt_bias2 + eps;
    state.master = state.master.clone() - (m.clone() / denom) * k.step_size;
    state.slots[0] = m;
    state.slots[1] = v;
}

impl Optimizer for AdamW {
    fn state_names(&self) -> &'static [&'static str] {
        &["exp_avg", "exp_avg_sq"]
    }

    fn update(&self, step: u64, lr: f64, state: &mut FlatState, grad: Tensor<1>) {
        self.update_scaled(step, lr, state, grad, &[])
    }

    fn update_scaled(
        &self,
        step: u64,
        lr: f64,
        state: &mut FlatState,
        grad: Tensor<1>,
        factors: &[f64],
    ) {
        let k = Coefficients::new(self.beta1, self.beta2, self.weight_decay, step, lr);
        if state.master.device() == Device::flex() {
            self.update_on_host(&k, state, grad, factors);
            return;
        }
        #[cfg(feature = "cubecl")]
        if crate::plumbing::kernels::cube_kernels_on() {
            let decayed = if self.weight_decay > 0.0 {
                state.decay_ranges(self.decay_on)
            } else {
                Vec::new()
            };
            let betas = [self.beta1, self.beta2, self.eps];
            if cube::adamw(&k, betas, state, &grad, factors, &decayed).is_some() {
                return;
            }
        }
        {
            self.update_with_tensor_ops(&k, state, crate::transport::host::scale_by(grad, factors));
        }
    }
}

/// Elements per parallel piece of the host update.
const PIECE: usize = 1 << 14;

impl AdamW {
    /// [`update`](Optimizer::update) as tensor operations on the buffers' device.
    fn update_with_tensor_ops(&self, k: &Coefficients, state: &mut FlatState, grad: Tensor<1>) {
        if self.weight_decay > 0.0 {
            let ranges = state.decay_ranges(self.decay_on);
            state.master = on_ranges(state.master.clone(), &ranges, |p| p * k.decay);
        }
        adam_moments(self.beta1, self.beta2, self.eps, k, state, grad);
    }

    /// [`update`](Optimizer::update_scaled) in one pass over buffers in host memory, in
    /// place: the same f32 operations in the same order as the tensor ops (so the same bits),
    /// without their eight or more temporaries of the buffer's size per step. The gradient's
    /// `factors` and the weight decay are applied piece by piece inside the pass, while the
    /// piece is in cache.
    fn update_on_host(
        &self,
        k: &Coefficients,
        state: &mut FlatState,
        grad: Tensor<1>,
        factors: &[f64],
    ) {
        let device = state.master.device();
        // Before the master is taken out of `state`: `DecayOn::All` reads its length.
        let ranges = if self.weight_decay > 0.0 {
            state.decay_ranges(self.decay_on)
        } else {
            Vec::new()
        };
        // Host memory (this pass runs on flex only): reading it back cannot fail.
        let host = |t: Tensor<1>| staging::to_f32(t).expect("a flex tensor reads back");
        let take = |t: &mut Tensor<1>| host(std::mem::replace(t, Tensor::empty([0], &device)));
        let mut p = take(&mut state.master);
        let mut m = take(&mut state.slots[0]);
        let mut v = take(&mut state.slots[1]);
        let g = host(grad);
        let decay = k.decay as f32;
        let factors: Vec<f32> = factors.iter().map(|&f| f as f32).collect();
        let (b1, b1c) = (self.beta1 as f32, (1.0 - self.beta1) as f32);
        let (b2, b2c) = (self.beta2 as f32, (1.0 - self.beta2) as f32);
        let (sb2, eps, lr) = (k.sqrt_bias2 as f32, self.eps as f32, k.step_size as f32);
        // Each element on its own, so pieces on rayon's threads give the serial bits.
        p.par_chunks_mut(PIECE)
            .zip(m.par_chunks_mut(PIECE))
            .zip(v.par_chunks_mut(PIECE))
            .zip(g.par_chunks(PIECE))
            .enumerate()
            .for_each(|(i, (((p, m), v), g))| {
                let start = i * PIECE;
                for r in &ranges {
                    let (lo, hi) = (r.start.max(start), r.end.min(start + p.len()));
                    if lo < hi {
                        let p = &mut p[lo - start..hi - start];
                        crate::transport::host::wide(move || {
                            for x in p {
                                *x *= decay;
                            }
                        });
                    }
                }
                let c = [b1, b1c, b2, b2c, sb2, eps, lr];
                match factors[..] {
                    [] => crate::transport::host::wide(|| adamw_pass(p, m, v, g, c, |g| g)),
                    [f] => {
                        crate::transport::host::wide(|| adamw_pass(p, m, v, g, c, move |g| g * f))
                    }
                    ref all => crate::transport::host::wide(|| {
                        adamw_pass(p, m, v, g, c, |g| all.iter().fold(g, |g, &f| g * f))
                    }),
                }
            });
        state.master = staging::from_f32(p, &device);
        state.slots[0] = staging::from_f32(m, &device);
        state.slots[1] = staging::from_f32(v, &device);
    }
}

/// AdamW's step on pieces of the master `p`, the moments `m` and `v` and the gradient `g`
/// read through `scaled`, with `[beta1, 1 - beta1, beta2, 1 - beta2, sqrt(1 - beta2^t), eps,
/// lr / (1 - beta1^t)]`: PyTorch's operations in its order.
#[inline(always)]
fn adamw_pass(
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[f32],
    [b1, b1c, b2, b2c, sb2, eps, lr]: [f32; 7],
    scaled: impl Fn(f32) -> f32,
) {
    for (((p, m), v), &g) in p.iter_mut().zip(m).zip(v).zip(g) {
        let g = scaled(g);
        *m = *m * b1 + g * b1c;
        *v = *v * b2 + (g * g) * b2c;
        let denom = v.sqrt() / sb2 + eps;
        *p -= (*m / denom) * lr;
    }
}

impl Optimizer for Adam {
    fn state_names(&self) -> &'static [&'static str] {
        &["exp_avg", "exp_avg_sq"]
    }

    fn update(&self, step: u64, lr: f64, state: &mut FlatState, grad: Tensor<1>) {
        let k = Coefficients::new(self.beta1, self.beta2, 0.0, step, lr);
        let ranges = state.decay_ranges(self.decay_on);
        let grad = l2(grad, &state.master, self.weight_decay, &ranges);
        adam_moments(self.beta1, self.beta2, self.eps, &k, state, grad);
    }
}

impl Optimizer for Sgd {
    fn state_names(&self) -> &'static [&'static str] {
        &["momentum_buffer"]
    }

    fn update(&self, step: u64, lr: f64, state: &mut FlatState, grad: Tensor<1>) {
        let ranges = state.decay_ranges(self.decay_on);
        let grad = l2(grad, &state.master, self.weight_decay, &ranges);
        let direction = if self.momentum == 0.0 {
            grad
        } else {
            let velocity = if step == 1 {
                grad.clone()
            } else {
                grad.clone() * (1.0 - self.dampening) + state.slots[0].clone() * self.momentum
            };
            state.slots[0] = velocity.clone();
            if self.nesterov {
                velocity * self.momentum + grad
            } else {
                velocity
            }
        };
        state.master = state.master.clone() - direction * lr;
    }
}

/// The ranges of parameters of two or more dimensions within `range`, given each parameter's
/// `(offset, numel, is_matrix)`, relative to `range.start`.
pub(crate) fn matrix_ranges(
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
    fn matrix_ranges_clip_parameters_to_the_shard() {
        let params = [(0, 10, true), (10, 3, false), (13, 7, true)];
        assert_eq!(matrix_ranges(&(5..15), &params), vec![0..5, 8..10]);
        assert!(matrix_ranges(&(10..13), &params).is_empty());
        assert_eq!(matrix_ranges(&(18..24), &params), vec![0..2]);
    }

    #[test]
    fn the_host_pass_gives_the_tensor_ops_bits() {
        let c = AdamW {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            decay_on: DecayOn::Matrices,
        };
        // Pieces of the parallel pass and decay ranges that start and end inside them.
        let n = 2 * PIECE + 1000;
        let wave = |k: f32| (0..n).map(|i| ((i as f32) * k).sin()).collect::<Vec<_>>();
        let decay = vec![0..300, 450..PIECE + 77, PIECE + 900..n];
        let mut host = FlatState::new(t(&wave(0.37)), 2, decay.clone());
        let mut ops = host.clone();
        // The gradient's factors folded into the pass: none, one, two.
        let factors: [&[f64]; 3] = [&[], &[0.3], &[0.7, 1.3]];
        for step in 1..=6u64 {
            let g = t(&wave(0.11 * step as f32));
            let k = Coefficients::new(0.9, 0.95, c.weight_decay, step, 3e-3);
            let f = factors[step as usize % 3];
            c.update_on_host(&k, &mut host, g.clone(), f);
            let scaled = f.iter().fold(g, |g, &f| g * f);
            c.update_with_tensor_ops(&k, &mut ops, scaled);
        }
        for (a, b) in [
            (&host.master, &ops.master),
            (&host.slots[0], &ops.slots[0]),
            (&host.slots[1], &ops.slots[1]),
        ] {
            let bits = |t: &Tensor<1>| v(t).iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(a), bits(b));
        }
    }

    /// The one-kernel step on a wgpu device (called directly and through `update_scaled`)
    /// against the host pass: every element of the master and moments after six steps (decay on ranges that start and end anywhere, the
    /// gradient's factors none, one or two) within 4 units in the last place of the host's
    /// value (measured: 0 on lavapipe), and a buffer that is not CubeCL's declined untouched;
    /// the kernel launched is the one `ember selftest --ptx` compiles.
    #[cfg(feature = "wgpu")]
    #[test]
    fn the_device_kernel_steps_as_the_host_pass() {
        let c = AdamW {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            decay_on: DecayOn::Matrices,
        };
        let wgpu = Device::wgpu(burn::tensor::DeviceKind::DefaultDevice);
        let n = 70_001;
        let wave = |k: f32| (0..n).map(|i| ((i as f32) * k).sin()).collect::<Vec<_>>();
        let decay = vec![0..300, 450..33_077, 69_999..n];
        let on = |v: &[f32], d: &Device| staging::from_f32(v.to_vec(), d);
        let mut host = FlatState::new(on(&wave(0.37), &Device::flex()), 2, decay.clone());
        let mut device = FlatState::new(on(&wave(0.37), &wgpu), 2, decay);
        let factors: [&[f64]; 3] = [&[], &[0.3], &[0.7, 1.3]];
        let launched = cubecl::launched::LaunchedKernels::new();
        for step in 1..=6u64 {
            let g = wave(0.11 * step as f32);
            let k = Coefficients::new(0.9, 0.95, c.weight_decay, step, 3e-3);
            let f = factors[step as usize % 3];
            c.update_on_host(&k, &mut host, on(&g, &Device::flex()), f);
            if step % 2 == 0 {
                // The optimizer's own entry point, which takes the kernel on a CubeCL device.
                c.update_scaled(step, 3e-3, &mut device, on(&g, &wgpu), f);
            } else {
                let decayed = device.decay_ranges(c.decay_on);
                let betas = [c.beta1, c.beta2, c.eps];
                cube::adamw(&k, betas, &mut device, &on(&g, &wgpu), f, &decayed)
                    .expect("a wgpu buffer takes the kernel");
            }
        }
        // The kernel as `cube::ahead` defines it without a device (what `ember selftest --ptx`
        // compiles for CUDA) is the one these steps launched.
        let launched = launched.finish();
        let client = cubecl::Device::wgpu(Default::default()).unwrap().client();
        let target = ember_comm::ahead::Target {
            device: client.properties_shared(),
            target: client.target_properties_shared(),
        };
        assert!(
            cube::ahead(&target)
                .iter()
                .any(|(_, k)| launched.contains(&k.id().stable_hash()))
        );
        let mut worst = 0u32;
        for (a, b) in [
            (&host.master, &device.master),
            (&host.slots[0], &device.slots[0]),
            (&host.slots[1], &device.slots[1]),
        ] {
            for (x, y) in staging::to_f32(a.clone())
                .unwrap()
                .iter()
                .zip(staging::to_f32(b.clone()).unwrap())
            {
                assert_eq!(
                    x.is_sign_negative(),
                    y.is_sign_negative(),
                    "{x} against {y}"
                );
                worst = worst.max(x.to_bits().abs_diff(y.to_bits()));
            }
        }
        eprintln!("the device kernel against the host pass: at most {worst} ulp");
        assert!(worst <= 4, "{worst} ulp");
        // A flex buffer is not CubeCL's: the kernel declines it and leaves it as it was.
        let before = v(&host.master);
        let k = Coefficients::new(0.9, 0.95, 0.1, 7, 3e-3);
        let g = t(&wave(0.5));
        assert!(cube::adamw(&k, [0.9, 0.95, 1e-8], &mut host, &g, &[], &[]).is_none());
        assert_eq!(v(&host.master), before);
    }

    #[test]
    fn adamw_matches_a_hand_computed_step_and_decays_only_its_ranges() {
        let c = AdamW {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            decay_on: DecayOn::Matrices,
        };
        let (lr, g) = (0.01f64, [0.3f64, -0.1, 0.3]);
        let decay = std::iter::once(0..2).collect();
        let mut s = FlatState::new(t(&[1.0, -2.0, 0.5]), 2, decay);
        c.update(1, lr, &mut s, t(&[0.3, -0.1, 0.3]));
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

    #[test]
    fn l2_penalties_reach_only_their_ranges() {
        // SGD's first step (velocity = gradient) and Adam's (a step of lr * sign(g + wd p)),
        // with the penalty on elements 0..2 alone.
        let (lr, wd) = (0.1f64, 0.5f64);
        let (p0, g) = ([1.0f32, -2.0, 0.5, 4.0], [0.3f32, 0.1, -0.2, 0.0]);
        let matrices = std::iter::once(0..2).collect::<Vec<_>>();
        let sgd = Sgd {
            momentum: 0.9,
            dampening: 0.0,
            nesterov: false,
            weight_decay: wd,
            decay_on: DecayOn::Matrices,
        };
        let mut s = FlatState::new(t(&p0), 1, matrices.clone());
        sgd.update(1, lr, &mut s, t(&g));
        let penalised = |i: usize| g[i] as f64 + if i < 2 { wd * p0[i] as f64 } else { 0.0 };
        for (i, got) in v(&s.master).into_iter().enumerate() {
            let want = p0[i] as f64 - lr * penalised(i);
            assert!((got as f64 - want).abs() < 1e-6, "sgd {i}: {got} vs {want}");
        }
        assert_eq!(v(&s.slots[0]).len(), 4);
        let adam = Adam {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: wd,
            decay_on: DecayOn::Matrices,
        };
        let mut s = FlatState::new(t(&p0), 2, matrices);
        adam.update(1, lr, &mut s, t(&g));
        for (i, got) in v(&s.master).into_iter().enumerate() {
            let gi = penalised(i);
            let want = p0[i] as f64 - lr * gi / (gi.abs() + 1e-8);
            assert!(
                (got as f64 - want).abs() < 1e-6,
                "adam {i}: {got} vs {want}"
            );
        }
    }
}
