//! The learning-rate schedule: linear warmup, then a cosine decay to a floor (nanoGPT's).
//! AdamW itself is `ember_sharding::FlatState`, the one optimizer every run uses.

use std::f64::consts::PI;

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
