//! The bytes one step stages between a device's memory and host memory, where MPI reads and
//! writes them, predicted from the schedule: the fold over [`Plan::schedule`] that mirrors
//! what the transport crosses for each event (`transport::route`). On a device with memory of
//! its own (a GPU, wgpu) a run's measured crossings ([`Staging`](crate::Staging)) equal it;
//! on flex nothing crosses.
//!
//! Per event, with `c` the compute dtype's bytes:
//! - a gather from the primary partition writes the gathered unit (the wire forms of every
//!   shard, for the device to dequantize); the unit's first gather of the step reads this
//!   rank's shard (its int8 wire form when weights are quantized), which the later ones take
//!   from host memory. A secondary copy is cut from the gathered host buffer and kept there,
//!   unless its group is one rank of plain values (then it is a slice on the device);
//! - a gather from the secondary copy writes what its group gathered (nothing for a group of
//!   one rank of plain values);
//! - a reduction reads the gradient once and writes the shard once, unquantized; quantized,
//!   every hop reads its wire form and writes what arrives (an error-feedback residual is
//!   dequantized where the kernels wrote the blocks). An all-reduce across replicated
//!   optimizer state takes the shard where the hops left it (read from the device after
//!   quantized hops). Accumulating inside the path crosses nothing more: the micro-batches'
//!   partial sums stay where the hops leave them;
//! - after the update, replicated parameters are rebuilt from the master shards: a read of
//!   the shard and a write of the unit.

use serde::{Deserialize, Serialize};

use crate::config::{GradQuant, Span};
use crate::plan::schedule::{Event, Source};
use crate::plan::{Levels, Plan};
use ember_comm::quant::{QuantFormat, Quantized};

/// Bytes one rank moves between its device's memory and host memory in one optimizer step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagedBytes {
    /// Read back from the device.
    pub to_host: u64,
    /// Written to the device.
    pub to_device: u64,
}

impl StagedBytes {
    /// Both ways together.
    pub fn total(&self) -> u64 {
        self.to_host + self.to_device
    }

    fn read(&mut self, bytes: usize) {
        self.to_host += bytes as u64;
    }

    fn write(&mut self, bytes: usize) {
        self.to_device += bytes as u64;
    }
}

impl Plan {
    /// What one rank stages in a step of `grad_accum` micro-batches on a device with memory of
    /// its own (see the module's notes).
    pub fn staging(&self, grad_accum: usize) -> StagedBytes {
        let mut s = StagedBytes::default();
        // Units whose primary shard's host form was read this step.
        let mut read = vec![false; self.units.len()];
        for event in self.schedule(grad_accum) {
            match event {
                Event::Gather { unit, source } => {
                    self.stage_gather(unit, source, &mut read[unit], &mut s)
                }
                Event::Reduce { unit, inner_only } => self.stage_reduce(unit, inner_only, &mut s),
                Event::Visit(_) | Event::Whole { .. } => {}
            }
        }
        let cfg = &self.config;
        if cfg.params() == Span(0) && cfg.optimizer() != Span(0) {
            let c = cfg.compute.bytes();
            let gathered = self.gathered_ranks();
            for u in 0..self.units.len() {
                let shard = self.shard_len(u, cfg.optimizer());
                s.read(shard * c);
                s.write(shard * gathered * c);
            }
        }
        s
    }

    fn stage_gather(&self, u: usize, source: Source, read: &mut bool, s: &mut StagedBytes) {
        let c = self.config.compute.bytes();
        let primary = self.shard_len(u, self.config.params());
        if primary == 0 {
            return;
        }
        let wire = Quantized::wire_bytes(QuantFormat::Int8, self.block(), primary);
        if let (Source::Secondary, Some(span)) = (source, self.secondary()) {
            let g = self.group(span).size(&self.topology);
            let len = self.shard_len(u, span);
            if self.quantizes_weights() {
                s.write(len / primary * wire * g);
            } else if g > 1 {
                s.write(len * g * c);
            }
            return;
        }
        let g = self.gathered_ranks();
        // The shard's host form crosses at the unit's first gather of the step.
        let first = !std::mem::replace(read, true);
        if self.quantizes_weights() {
            if first {
                s.read(wire);
            }
            s.write(wire * g);
        } else if self.live_hops().next().is_some() {
            if first {
                s.read(primary * c);
            }
            s.write(primary * g * c);
        }
    }

    /// Ranks whose shards a gather over every hop of the gradient path puts together.
    fn gathered_ranks(&self) -> usize {
        self.hops().iter().map(|h| h.size(&self.topology)).product()
    }

    /// The gradient path's hops that move data, with their places among all hops.
    fn live_hops(&self) -> impl Iterator<Item = (usize, Levels)> + '_ {
        self.hops()
            .into_iter()
            .enumerate()
            .filter(|(_, h)| h.size(&self.topology) > 1)
    }

    fn stage_reduce(&self, u: usize, inner_only: bool, s: &mut StagedBytes) {
        let cfg = &self.config;
        let c = cfg.compute.bytes();
        let mut len = self.units[u].padded;
        if cfg.optimizer() == Span(0) {
            if self.topology.world_size() > 1 {
                s.read(len * c);
                s.write(len * c);
            }
            return;
        }
        let live: Vec<(usize, Levels)> = self.live_hops().collect();
        let beyond = self
            .accumulated_hops()
            .and_then(|i| live.iter().position(|&(k, _)| k >= i));
        let live = match beyond {
            Some(b) if inner_only => &live[..b],
            _ => &live[..],
        };
        let format = match cfg.quantize_grads() {
            GradQuant::Off => None,
            GradQuant::Int8 => Some(QuantFormat::Int8),
            GradQuant::Int4 => Some(QuantFormat::Int4),
        };
        // Whether the hops leave the shard in host memory (unquantized hops) or on the device.
        let on_host = format.is_none() && !live.is_empty();
        for (i, &(_, hop)) in live.iter().enumerate() {
            let g = hop.size(&self.topology);
            match format {
                None if i == 0 => s.read(len * c),
                None => {}
                Some(f) => {
                    let block = self.block();
                    s.read(Quantized::wire_bytes(f, block, len));
                    s.write(g * Quantized::wire_bytes(f, block, len / g));
                }
            }
            len /= g;
        }
        // An earlier micro-batch's partial sum stays where the hops left it.
        if inner_only && beyond.is_some() {
            return;
        }
        let across = Levels {
            lo: cfg.optimizer().0,
            hi: self.topology.depth(),
        };
        // A shard the hops left on the host is averaged there and all-reduced as it is; one on
        // the device crosses for the all-reduce.
        if across.size(&self.topology) > 1 && !on_host {
            s.read(len * c);
        }
        if on_host || across.size(&self.topology) > 1 {
            s.write(len * c);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Preset;
    use crate::plan::UnitSpec;
    use ember_comm::Topology;

    fn plan(preset: &str) -> Plan {
        let units = vec![
            UnitSpec {
                name: "embed".into(),
                params: vec![("wte".into(), vec![64, 8])],
                uses: vec![],
            },
            UnitSpec {
                name: "head".into(),
                params: vec![("ln.w".into(), vec![8])],
                uses: vec![0],
            },
        ];
        let t = Topology::parse("2x2x2").unwrap();
        Plan::new(units, preset.parse::<Preset>().unwrap().config(3), t).unwrap()
    }

    /// Elements of every unit's padded buffer.
    fn psi(p: &Plan) -> u64 {
        p.units.iter().map(|u| u.padded as u64).sum()
    }

    #[test]
    fn replicated_states_read_and_write_each_gradient_once() {
        let p = plan("ddp");
        let psi = psi(&p);
        assert_eq!(
            p.staging(1),
            StagedBytes {
                to_host: 4 * psi,
                to_device: 4 * psi
            }
        );
        // Accumulating over micro-batches is local: still one all-reduce per unit.
        assert_eq!(p.staging(3), p.staging(1));
    }

    #[test]
    fn replicated_parameters_come_back_whole_after_the_update() {
        // The gradient read whole and its shard written back; then the updated master shard
        // read and the unit written whole.
        let p = plan("zero2");
        let psi = psi(&p);
        let shard = psi / 8;
        assert_eq!(
            p.staging(1),
            StagedBytes {
                to_host: 4 * psi + 4 * shard,
                to_device: 4 * shard + 4 * psi
            }
        );
    }
}
