//! Byte accounting: what each collective handed to MPI, per scope and per op, and the
//! formulas of the algorithms behind them. Pure data; it deliberately never inspects MPI's
//! traffic (the kernel's interface counters are the measurement of what crossed a wire).
//!
//! # What the numbers mean
//!
//! The bandwidth-bound collectives are ember's own over point-to-point messages (see
//! `collective`), so each is charged the bytes of the messages it sent and received. For a
//! payload of `n` bytes over a group of `g` ranks those are:
//!
//! | op | payload `n` | sent per rank | received per rank | algorithm |
//! |---|---|---|---|---|
//! | all-gather | output bytes | `n (g-1) / g` | same | ring |
//! | reduce-scatter | input bytes | `n (g-1) / g` | same | ring |
//! | all-reduce | buffer bytes | `2 n (g-1) / g` | same | ring (reduce-scatter + all-gather) |
//! | all-to-all | input bytes | `n (g-1) / g` | same | pairwise exchange |
//! | broadcast | buffer bytes | root `n (g-1)`, others 0 | root 0, others `n` | linear |
//!
//! Broadcasts run MPI's own algorithm, whose wire we cannot see, and all-reduces under 64 KiB
//! are latency-bound; both are charged by [`formula`], the same table. Quantized collectives are charged for the
//! quantized bytes they hand to MPI (data plus scales). A group of one is charged nothing.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::topology::Scope;

/// The collective operations we account for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Op {
    /// Every rank contributes a shard; every rank receives all shards.
    AllGather,
    /// Every rank contributes a full buffer; rank `i` receives the reduced shard `i`.
    ReduceScatter,
    /// Every rank receives the reduction of all buffers.
    AllReduce,
    /// The root's buffer is copied to every rank.
    Broadcast,
    /// Rank `i`'s block `j` goes to rank `j`'s block `i`.
    AllToAll,
}

impl Op {
    /// Lower-case name used in benchmarks and timeout messages.
    pub fn name(self) -> &'static str {
        match self {
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllReduce => "all_reduce",
            Op::Broadcast => "broadcast",
            Op::AllToAll => "all_to_all",
        }
    }
}

/// Whether this rank is the source of a broadcast (the only op where ranks differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The broadcast root.
    Root,
    /// Any rank of a symmetric op, or a broadcast receiver.
    Member,
}

/// Bytes sent and received.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Traffic {
    /// Bytes this rank sent.
    pub sent: u64,
    /// Bytes this rank received.
    pub received: u64,
}

impl std::ops::AddAssign for Traffic {
    fn add_assign(&mut self, rhs: Self) {
        self.sent += rhs.sent;
        self.received += rhs.received;
    }
}

/// The bytes one rank is charged for `op` on a payload of `bytes` over `group` ranks (the
/// table in the module doc). For the symmetric ops `bytes` divides by `group`.
pub fn formula(op: Op, bytes: u64, group: usize, role: Role) -> Traffic {
    let g = group as u64;
    let share = bytes / g * (g - 1);
    match op {
        Op::AllGather | Op::ReduceScatter | Op::AllToAll => Traffic {
            sent: share,
            received: share,
        },
        Op::AllReduce => Traffic {
            sent: 2 * share,
            received: 2 * share,
        },
        Op::Broadcast => match role {
            Role::Root => Traffic {
                sent: bytes * (g - 1),
                received: 0,
            },
            Role::Member => Traffic {
                sent: 0,
                received: if g > 1 { bytes } else { 0 },
            },
        },
    }
}

/// Accumulated traffic per (canonical scope, op) since the last reset, and the time this
/// rank's messages to and from other GPUs took.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    by_key: BTreeMap<(Scope, Op), Traffic>,
    off_gpu: OffGpu,
}

/// Messages between this rank and ranks on other GPUs or nodes: their bytes (sent and
/// received) and the wall time of the exchanges that carried them, measured. A rank behind a
/// slow link moves them slowest (see [`OffGpu::mbytes_per_s`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffGpu {
    /// Bytes sent to and received from ranks on other GPUs.
    pub bytes: u64,
    /// Nanoseconds the exchanges carrying them took.
    pub nanos: u64,
}

impl OffGpu {
    /// Megabytes per second through this rank's links, or `None` before any moved.
    pub fn mbytes_per_s(&self) -> Option<f64> {
        (self.nanos > 0).then(|| self.bytes as f64 / self.nanos as f64 * 1e3)
    }
}

impl Counters {
    /// Adds `traffic` to the entry for `(scope, op)`.
    pub fn add(&mut self, scope: Scope, op: Op, traffic: Traffic) {
        *self.by_key.entry((scope, op)).or_default() += traffic;
    }

    /// Traffic charged to `(scope, op)` (zero if none). Charges are keyed by the canonical
    /// scope (`Topology::canonical`, what `Group::scope` returns): pass that form.
    pub fn get(&self, scope: Scope, op: Op) -> Traffic {
        self.by_key.get(&(scope, op)).copied().unwrap_or_default()
    }

    /// Traffic over `scope`, all ops together.
    pub fn scope_total(&self, scope: Scope) -> Traffic {
        let mut t = Traffic::default();
        self.by_key
            .iter()
            .filter(|((s, _), _)| *s == scope)
            .for_each(|(_, v)| t += *v);
        t
    }

    /// Records an exchange with ranks on other GPUs.
    pub fn add_off_gpu(&mut self, bytes: u64, nanos: u64) {
        self.off_gpu.bytes += bytes;
        self.off_gpu.nanos += nanos;
    }

    /// This rank's exchanges with other GPUs since the last reset.
    pub fn off_gpu(&self) -> OffGpu {
        self.off_gpu
    }

    /// Every non-empty entry, ordered by scope then op.
    pub fn entries(&self) -> impl Iterator<Item = (Scope, Op, Traffic)> + '_ {
        self.by_key.iter().map(|(&(s, o), &t)| (s, o, t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_formulas() {
        let t = formula(Op::AllGather, 800, 8, Role::Member);
        assert_eq!((t.sent, t.received), (700, 700));
        assert_eq!(formula(Op::AllReduce, 800, 4, Role::Member).sent, 1200);
        assert_eq!(
            formula(Op::AllToAll, 800, 1, Role::Member),
            Traffic::default()
        );
        assert_eq!(formula(Op::Broadcast, 10, 4, Role::Root).sent, 30);
        assert_eq!(formula(Op::Broadcast, 10, 4, Role::Member).received, 10);
        assert_eq!(formula(Op::Broadcast, 10, 1, Role::Member).received, 0);
    }

    #[test]
    fn counters_accumulate_per_key() {
        let mut c = Counters::default();
        let t = Traffic {
            sent: 3,
            received: 4,
        };
        c.add(Scope::World, Op::AllGather, t);
        c.add(Scope::World, Op::AllGather, t);
        c.add(Scope::Across(1), Op::AllToAll, t);
        assert_eq!(c.get(Scope::World, Op::AllGather).sent, 6);
        assert_eq!(c.scope_total(Scope::Across(1)).received, 4);
        assert_eq!(c.entries().count(), 2);
    }
}
