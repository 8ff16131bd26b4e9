//! A machine profile for estimating step time from a plan: the bandwidth one rank gets on each
//! level's links and a sustained compute rate. Frontier's (the link speeds of the OLCF user
//! guide) is built in; others are read from a file by the CLI.

use serde::{Deserialize, Serialize};

use crate::plan::{Levels, TrafficTable};

/// Link bandwidth per level and compute rate of one rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// Name printed with estimates.
    pub name: String,
    /// GB/s one rank can send over each level's links, innermost first, by level name.
    pub level_gbps: Vec<(String, f64)>,
    /// Peak dense TFLOP/s of one rank in the compute dtype.
    pub peak_tflops: f64,
    /// Fraction of peak the model's kernels sustain (an assumption, stated with estimates).
    pub mfu: f64,
}

impl Profile {
    /// Frontier, per GCD: 200 GB/s between the two GCDs of an MI250X, 50 GB/s to another
    /// MI250X of the node (the low end of 50-100), 12.5 GB/s off the node (four 25 GB/s NICs
    /// shared by eight GCDs); 191.5 TFLOP/s fp16 peak; MFU 0.5 assumed (Megatron-LM reports 52%
    /// of peak at scale).
    pub fn frontier() -> Self {
        Self {
            name: "frontier".into(),
            level_gbps: vec![
                ("gcd".into(), 200.0),
                ("gpu".into(), 50.0),
                ("node".into(), 12.5),
            ],
            peak_tflops: 191.5,
            mfu: 0.5,
        }
    }

    /// Bandwidth of a group's slowest link: that of the outermost level it varies.
    pub fn gbps(&self, group: Levels) -> Option<f64> {
        self.level_gbps.get(group.hi.checked_sub(1)?).map(|l| l.1)
    }

    /// Seconds to move `traffic` with each group's bytes sent at its slowest link's rate,
    /// one collective after another.
    pub fn comm_seconds(&self, traffic: &TrafficTable) -> f64 {
        traffic
            .iter()
            .map(|((g, _), t)| {
                self.gbps(*g)
                    .map_or(f64::INFINITY, |bw| t.sent as f64 / (bw * 1e9))
            })
            .sum()
    }

    /// Seconds to compute `flops` at the sustained rate.
    pub fn compute_seconds(&self, flops: f64) -> f64 {
        flops / (self.peak_tflops * 1e12 * self.mfu)
    }

    /// Checks the profile names a positive bandwidth for every level of a `depth`-level
    /// topology and a positive compute rate.
    pub fn validate(&self, depth: usize) -> Result<(), String> {
        if self.level_gbps.len() < depth {
            return Err(format!(
                "profile `{}` gives bandwidths for {} levels; the topology has {depth}",
                self.name,
                self.level_gbps.len()
            ));
        }
        if let Some((name, bw)) = self.level_gbps.iter().find(|l| l.1.is_nan() || l.1 <= 0.0) {
            return Err(format!(
                "profile `{}`: level `{name}` bandwidth {bw} GB/s must be positive",
                self.name
            ));
        }
        let positive = |x: f64| x > 0.0 && x.is_finite();
        if !positive(self.peak_tflops) || !positive(self.mfu) || self.mfu > 1.0 {
            return Err(format!(
                "profile `{}`: peak_tflops must be positive and mfu in (0, 1]",
                self.name
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember_comm::counters::{Op, Traffic};

    #[test]
    fn groups_pay_their_outermost_link() {
        let p = Profile::frontier();
        assert_eq!(p.gbps(Levels { lo: 0, hi: 1 }), Some(200.0));
        assert_eq!(p.gbps(Levels { lo: 0, hi: 3 }), Some(12.5));
        let mut t = TrafficTable::new();
        t.insert(
            (Levels { lo: 2, hi: 3 }, Op::AllGather),
            Traffic {
                sent: 12_500_000_000,
                received: 0,
            },
        );
        assert!((p.comm_seconds(&t) - 1.0).abs() < 1e-12);
        assert!((p.compute_seconds(95.75e12) - 1.0).abs() < 1e-12);
        assert!(p.validate(3).is_ok() && p.validate(4).is_err());
    }
}
