//! Which bytes of a collective cross which link, and how long the collective takes on a
//! profile's links. Pure functions of the topology and the collective algorithms of
//! `ember-comm` (ring all-gather and reduce-scatter, pairwise all-to-all, ring all-reduce,
//! recursive doubling for small all-reduces); nothing here moves data.
//!
//! # Links
//!
//! Level `l` of the topology has one link per instance of the level below it: every rank has
//! its own level-0 link (the die-to-die fabric, shared memory on one machine); every GPU has
//! one level-1 link, shared by its GCDs; every node one level-2 uplink, shared by its GPUs.
//! A message between ranks whose outermost differing level is `l > 0` leaves through the
//! sender's links of levels 1 to `l` and enters through the receiver's; one between GCDs of a
//! GPU crosses their level-0 links. Links are full duplex: each direction has the full rate.
//!
//! # Time
//!
//! Every group of a collective's kind runs it at once (every rank does the same step), so a
//! step of the algorithm loads every link with the messages of all groups that cross it. A
//! step takes the largest message latency of its edges plus the time of its busiest link; the
//! collective is the sum of its steps. A link direction that carries the messages of several
//! rank pairs in one step (several flows) runs at the profile's flow efficiency of its level.

use std::collections::HashMap;

use ember_comm::collective::RING_ALL_REDUCE_BYTES;
use ember_comm::{Op, Topology};
use serde::Serialize;

use crate::plan::profile::Profile;
use crate::plan::{Collective, Levels};

/// What a collective costs: its time alone on the links, and its bytes per link level.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Cost {
    /// Seconds of message latency (steps that wait on the slowest edge).
    pub latency_s: f64,
    /// Seconds of transfer at full link rates.
    pub transfer_s: f64,
    /// Per level: seconds the busiest link of the level is busy (its bytes over its rate).
    pub busy_s: Vec<f64>,
    /// Per level: bytes over all its links, both directions, summed over the job's ranks.
    pub link_bytes: Vec<f64>,
    /// Per level: bytes one rank sends (on average) to ranks it differs from at most there.
    pub sent_bytes: Vec<f64>,
    /// Per level: the most flows (messages of different rank pairs) one direction of one of
    /// its links carries in a step.
    pub flows: Vec<usize>,
}

/// Per step of an algorithm on a group: messages as (sender index, receiver index, blocks).
struct Steps {
    /// Steps, each a list of edges with the number of payload blocks they carry.
    steps: Vec<Vec<(usize, usize)>>,
    /// Block size as a fraction of the payload.
    block: f64,
}

/// The links of a topology with a profile's rates and latencies, and a cache of every
/// (group, op) evaluated.
#[derive(Debug)]
pub struct Network {
    topology: Topology,
    /// Bytes/s per direction of one link of each level.
    rate: Vec<f64>,
    /// Seconds of latency of a message whose outermost differing level is each level.
    latency: Vec<f64>,
    /// Per level: the fraction of `rate` a link direction carries with several flows.
    shared: Vec<f64>,
    cache: HashMap<(Levels, Op, bool), Unit>,
}

/// A (group, op)'s cost per byte of payload: time and bytes scale with it.
#[derive(Debug, Clone)]
struct Unit {
    latency_s: f64,
    transfer_s_per_byte: f64,
    busy_s_per_byte: Vec<f64>,
    link_bytes_per_byte: Vec<f64>,
    sent_per_byte: Vec<f64>,
    flows: Vec<usize>,
}

impl Network {
    /// The links of `topology` as `profile` describes them.
    pub fn new(topology: &Topology, profile: &Profile) -> Self {
        let depth = topology.depth();
        Self {
            topology: topology.clone(),
            rate: (0..depth).map(|l| profile.link_rate(l, topology)).collect(),
            latency: (0..depth).map(|l| profile.latency(l)).collect(),
            shared: (0..depth).map(|l| profile.flow_efficiency(l, 2)).collect(),
            cache: HashMap::new(),
        }
    }

    /// The topology.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The cost of `c`, run by every group of its kind at once.
    pub fn cost(&mut self, c: &Collective) -> Cost {
        let small = c.op == Op::AllReduce && c.bytes < RING_ALL_REDUCE_BYTES;
        let key = (c.group, c.op, small);
        if !self.cache.contains_key(&key) {
            let unit = self.unit(c.group, c.op, small);
            self.cache.insert(key, unit);
        }
        let u = &self.cache[&key];
        let b = c.bytes as f64;
        Cost {
            latency_s: u.latency_s,
            transfer_s: u.transfer_s_per_byte * b,
            busy_s: u.busy_s_per_byte.iter().map(|x| x * b).collect(),
            link_bytes: u.link_bytes_per_byte.iter().map(|x| x * b).collect(),
            sent_bytes: u.sent_per_byte.iter().map(|x| x * b).collect(),
            flows: u.flows.clone(),
        }
    }

    /// The steps of `op` on a group of `g` members.
    fn steps(op: Op, g: usize, small: bool) -> Steps {
        let ring = |n: usize| -> Vec<Vec<(usize, usize)>> {
            (0..n)
                .map(|_| (0..g).map(|i| (i, (i + 1) % g)).collect())
                .collect()
        };
        match op {
            Op::AllGather | Op::ReduceScatter => Steps {
                steps: ring(g - 1),
                block: 1.0 / g as f64,
            },
            Op::AllToAll => Steps {
                steps: (1..g)
                    .map(|k| (0..g).map(|i| (i, (i + k) % g)).collect())
                    .collect(),
                block: 1.0 / g as f64,
            },
            Op::AllReduce if small && g.is_power_of_two() => {
                // Recursive doubling: partners at distance 1, 2, 4, ... exchange everything.
                let mut steps = Vec::new();
                let mut d = 1;
                while d < g {
                    steps.push((0..g).map(|i| (i, i ^ d)).collect());
                    d *= 2;
                }
                Steps { steps, block: 1.0 }
            }
            // Every buffer gathered around the ring, then summed.
            Op::AllReduce if small => Steps {
                steps: ring(g - 1),
                block: 1.0,
            },
            Op::AllReduce => Steps {
                steps: ring(2 * (g - 1)),
                block: 1.0 / g as f64,
            },
            Op::Broadcast => Steps {
                steps: vec![(1..g).map(|i| (0, i)).collect()],
                block: 1.0,
            },
        }
    }

    /// Evaluates a (group, op) per byte of payload, over every group of its kind at once.
    fn unit(&self, group: Levels, op: Op, small: bool) -> Unit {
        let t = &self.topology;
        let depth = t.depth();
        let g = group.size(t);
        let mut out = Unit {
            latency_s: 0.0,
            transfer_s_per_byte: 0.0,
            busy_s_per_byte: vec![0.0; depth],
            link_bytes_per_byte: vec![0.0; depth],
            sent_per_byte: vec![0.0; depth],
            flows: vec![0; depth],
        };
        if g <= 1 {
            return out;
        }
        let steps = Self::steps(op, g, small);
        // Every group of this kind: the ranks of one group differ only in levels lo..hi; the
        // groups are indexed by the other coordinates.
        let members = |first: usize| -> Vec<usize> {
            let scope = ember_comm::Scope::Span {
                lo: group.lo,
                hi: group.hi,
            };
            t.members(scope, first)
        };
        let mut groups = Vec::new();
        let mut seen = vec![false; t.world_size()];
        for r in 0..t.world_size() {
            if !seen[r] {
                let m = members(r);
                m.iter().for_each(|&x| seen[x] = true);
                groups.push(m);
            }
        }
        for edges in &steps.steps {
            // Bytes per unit of payload and flows on each (level, instance, direction) this
            // step.
            let mut load: HashMap<(usize, usize, bool), (f64, usize)> = HashMap::new();
            let mut latency = 0.0f64;
            for m in &groups {
                for &(i, j) in edges {
                    let (a, b) = (m[i], m[j]);
                    let top = outermost_difference(t, a, b);
                    latency = latency.max(self.latency[top]);
                    out.sent_per_byte[top] += steps.block / t.world_size() as f64;
                    let levels: Vec<usize> = if top == 0 {
                        vec![0]
                    } else {
                        (1..=top).collect()
                    };
                    for l in levels {
                        let s = t.stride(l);
                        for key in [(l, a / s, true), (l, b / s, false)] {
                            let e = load.entry(key).or_default();
                            e.0 += steps.block;
                            e.1 += 1;
                        }
                    }
                }
            }
            let mut step_busy = vec![0.0f64; depth];
            for (&(l, _, _), &(bytes, flows)) in &load {
                let rate = if flows > 1 {
                    self.rate[l] * self.shared[l]
                } else {
                    self.rate[l]
                };
                step_busy[l] = step_busy[l].max(bytes / rate);
                out.flows[l] = out.flows[l].max(flows);
                // A message is counted on its way out of one link and into another.
                out.link_bytes_per_byte[l] += bytes;
            }
            out.latency_s += latency;
            out.transfer_s_per_byte += step_busy.iter().copied().fold(0.0, f64::max);
            for (acc, b) in out.busy_s_per_byte.iter_mut().zip(step_busy) {
                *acc += b;
            }
        }
        out
    }
}

/// The outermost level at which ranks `a` and `b` differ (0 when they differ only in the
/// innermost, or are the same rank).
fn outermost_difference(t: &Topology, a: usize, b: usize) -> usize {
    let (ca, cb) = (t.coords(a), t.coords(b));
    (0..t.depth()).rev().find(|&l| ca[l] != cb[l]).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile() -> Profile {
        let mut p = Profile::frontier();
        p.link_gbps = Some(vec![
            ("gcd".into(), 100.0),
            ("gpu".into(), 10.0),
            ("node".into(), 1.0),
        ]);
        p.latency_us = Some(vec![
            ("gcd".into(), 1.0),
            ("gpu".into(), 10.0),
            ("node".into(), 100.0),
        ]);
        p
    }

    #[test]
    fn a_ring_over_the_world_crosses_each_uplink_once_per_step() {
        let t = Topology::parse("2x2x2").unwrap();
        let mut n = Network::new(&t, &profile());
        let world = Levels { lo: 0, hi: 3 };
        let c = n.cost(&Collective::new(world, Op::AllGather, 8_000_000));
        // 7 steps of 1 MB blocks: one edge leaves each node per step, so each uplink carries
        // 1 MB per step and direction at 1 GB/s.
        assert!((c.busy_s[2] - 7.0 * 1e-3).abs() < 1e-9, "{c:?}");
        assert!((c.transfer_s - 7.0 * 1e-3).abs() < 1e-9);
        assert!((c.latency_s - 7.0 * 100e-6).abs() < 1e-12);
        // Two uplinks, each 7 MB in and 7 MB out.
        assert!((c.link_bytes[2] - 28e6).abs() < 1.0);
    }

    #[test]
    fn four_ranks_of_a_node_share_its_uplink_in_an_across_node_hop() {
        let t = Topology::parse("2x2x2").unwrap();
        let mut n = Network::new(&t, &profile());
        let across = Levels { lo: 2, hi: 3 };
        // Every rank sends its 1 MB half to its peer on the other node: 4 MB per uplink.
        let c = n.cost(&Collective::new(across, Op::AllGather, 2_000_000));
        assert!((c.busy_s[2] - 4e-3).abs() < 1e-9, "{c:?}");
        assert!((c.busy_s[1] - 2e6 / 10e9).abs() < 1e-9, "{c:?}");
        // The GCD pair moves nothing across any link beyond its own.
        let gcd = Levels { lo: 0, hi: 1 };
        let c = n.cost(&Collective::new(gcd, Op::AllToAll, 2_000_000));
        assert_eq!(c.busy_s[2], 0.0);
        assert_eq!(c.busy_s[1], 0.0);
        assert!(c.busy_s[0] > 0.0);
    }

    #[test]
    fn several_flows_on_a_link_run_at_the_levels_flow_efficiency() {
        let t = Topology::parse("2x2x2").unwrap();
        let mut p = profile();
        let world = Levels { lo: 0, hi: 3 };
        let pairs = Levels { lo: 1, hi: 2 };
        let alone = Network::new(&t, &p).cost(&Collective::new(pairs, Op::AllGather, 2_000_000));
        p.flow_efficiency = Some(vec![
            ("gcd".into(), 1.0),
            ("gpu".into(), 0.5),
            ("node".into(), 1.0),
        ]);
        let mut n = Network::new(&t, &p);
        // Both GCDs of a GPU send their 1 MB half to the other GPU in the same step: two flows
        // out of each GPU link, at half its rate in all.
        let c = n.cost(&Collective::new(pairs, Op::AllGather, 2_000_000));
        assert_eq!(c.flows[1], 2);
        assert!((c.busy_s[1] - 2.0 * alone.busy_s[1]).abs() < 1e-12, "{c:?}");
        assert!((c.busy_s[1] - 2e6 / 10e9 / 0.5).abs() < 1e-12, "{c:?}");
        assert_eq!(c.link_bytes, alone.link_bytes);
        // A world ring puts one flow on every link direction: the full rate.
        let ring = n.cost(&Collective::new(world, Op::AllGather, 8_000_000));
        assert_eq!(ring.flows[1], 1);
        assert!(
            (ring.busy_s[1] - 7.0 * 1e6 / 10e9).abs() < 1e-12,
            "{ring:?}"
        );
    }
}
