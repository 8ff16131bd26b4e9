//! A machine profile for estimating step time from a plan: each level's links (their rate, how
//! many ranks share one, their latency) and a sustained compute rate. Frontier's (the link
//! speeds of the OLCF user guide) is built in; others are read from a file by the CLI, and
//! `ember cluster up` writes one for the cluster it emulates, with measured rates.
//!
//! A profile with only the per-rank fields (`level_gbps`, `peak_tflops`, `mfu`) still
//! describes the links: a level's link is then taken to carry the per-rank rate times the ranks
//! under it, so that every rank gets `level_gbps` when all of them send.

use serde::{Deserialize, Serialize};

use ember_comm::Topology;

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
    /// The rate of one link of each level, GB/s per direction, by level name: a GPU's link
    /// (shared by its GCDs), a node's uplink (shared by its GPUs); the innermost level's is
    /// each rank's own. Optional; derived from `level_gbps` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_gbps: Option<Vec<(String, f64)>>,
    /// The one-way latency of a message whose ranks differ at each level, microseconds.
    /// Optional; 0 when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_us: Option<Vec<(String, f64)>>,
    /// The fraction of a link's `link_gbps` that one direction of it carries in all when
    /// messages of several rank pairs cross it at once (TCP streams sharing a queue lose more
    /// than one stream does), by level name. `link_gbps` is the rate of one such flow.
    /// Optional; 1 when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flow_efficiency: Option<Vec<(String, f64)>>,
    /// The sustained TFLOP/s one rank reaches on the model's kernels when every rank computes,
    /// measured. Optional; `peak_tflops * mfu` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank_tflops: Option<f64>,
    /// The CPU the ranks share, where communication and the engine's bookkeeping take cores
    /// from compute (many ranks on one machine's cores). Optional; without it communication
    /// costs no compute time (devices that move data by DMA).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<CpuProfile>,
}

/// What a rank's cores cost besides its model FLOPs, measured on the machine (`ember cluster
/// up` writes it). All costs are core-seconds; a rank has `cores_per_rank` cores, shared
/// equally by its threads that want them (compute and communication stages).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CpuProfile {
    /// Cores one rank gets when every rank runs (the machine's cores over its ranks).
    pub cores_per_rank: f64,
    /// Per byte a rank sends to a rank it differs from at most at each level (both ends'
    /// work: shared-memory copies, or the TCP/IP stack of emulated links), by level name.
    pub message_byte_s: Vec<(String, f64)>,
    /// Per byte of a collective's payload, for staging it between device tensors and MPI
    /// buffers (a copy each way).
    pub copy_byte_s: f64,
    /// Per element quantized to int8 from f32 and dequantized back (one round trip).
    pub quant_element_s: f64,
    /// Per parameter of the units a visit computes: building the module from the gathered
    /// buffers and its gradients back into them.
    pub visit_param_s: f64,
    /// Per optimizer-state element per step (AdamW's pass over master, moments, gradient).
    pub optimizer_element_s: f64,
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
            link_gbps: None,
            latency_us: None,
            flow_efficiency: None,
            rank_tflops: None,
            cpu: None,
        }
    }

    /// The rate of one link of level `level` (bytes/s per direction) on `topology`: the
    /// profile's `link_gbps`, else the per-rank `level_gbps` times the ranks one link serves.
    pub fn link_rate(&self, level: usize, topology: &Topology) -> f64 {
        if let Some(links) = &self.link_gbps
            && let Some((_, gbps)) = links.get(level)
        {
            return gbps * 1e9;
        }
        let per_rank = self.level_gbps.get(level).map_or(f64::INFINITY, |l| l.1);
        per_rank * 1e9 * topology.stride(level) as f64
    }

    /// The latency of a message between ranks that differ at level `level` at most, seconds.
    pub fn latency(&self, level: usize) -> f64 {
        self.latency_us
            .as_ref()
            .and_then(|l| l.get(level))
            .map_or(0.0, |l| l.1 * 1e-6)
    }

    /// The fraction of its one-flow rate a link of level `level` carries with `flows` flows in
    /// one direction at once.
    pub fn flow_efficiency(&self, level: usize, flows: usize) -> f64 {
        if flows <= 1 {
            return 1.0;
        }
        self.flow_efficiency
            .as_ref()
            .and_then(|l| l.get(level))
            .map_or(1.0, |l| l.1)
    }

    /// One rank's sustained FLOP/s on the model's kernels.
    pub fn compute_rate(&self) -> f64 {
        self.rank_tflops.unwrap_or(self.peak_tflops * self.mfu) * 1e12
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
        flops / self.compute_rate()
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
        for (field, list) in [
            ("link_gbps", &self.link_gbps),
            ("latency_us", &self.latency_us),
            ("flow_efficiency", &self.flow_efficiency),
        ] {
            if let Some(list) = list {
                if list.len() < depth {
                    return Err(format!(
                        "profile `{}` gives {field} for {} levels; the topology has {depth}",
                        self.name,
                        list.len()
                    ));
                }
                let (ok, what): (fn(f64) -> bool, _) = match field {
                    "latency_us" => (|x| x >= 0.0 && x.is_finite(), "zero or more"),
                    "flow_efficiency" => (|x| x > 0.0 && x <= 1.0, "in (0, 1]"),
                    _ => (|x| x > 0.0 && x.is_finite(), "positive"),
                };
                if let Some((name, v)) = list.iter().find(|l| !ok(l.1)) {
                    return Err(format!(
                        "profile `{}`: {field} of level `{name}` is {v}; it must be {what}",
                        self.name
                    ));
                }
            }
        }
        if let Some(v) = self.rank_tflops
            && !positive(v)
        {
            return Err(format!(
                "profile `{}`: rank_tflops is {v}; it must be positive",
                self.name
            ));
        }
        if let Some(cpu) = &self.cpu {
            let nonnegative = |x: f64| x >= 0.0 && x.is_finite();
            if !positive(cpu.cores_per_rank)
                || cpu.message_byte_s.len() < depth
                || !cpu.message_byte_s.iter().all(|l| nonnegative(l.1))
                || ![
                    cpu.copy_byte_s,
                    cpu.quant_element_s,
                    cpu.visit_param_s,
                    cpu.optimizer_element_s,
                ]
                .into_iter()
                .all(nonnegative)
            {
                return Err(format!(
                    "profile `{}`: [cpu] needs a positive cores_per_rank, message_byte_s for \
                     every level and costs of zero or more",
                    self.name
                ));
            }
        }
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
