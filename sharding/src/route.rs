//! The collectives a plan implies, on host buffers: which path, group, dtype and quantization
//! each state's movement uses. Everything goes through `ember-comm`; this file only chooses.

use std::collections::HashMap;

use ember_comm::collective::Reduce;
use ember_comm::hier::{all_gather_path, reduce_scatter_path};
use ember_comm::path::Path;
use ember_comm::quant::{BlockSize, QuantFormat, host::HostKernels};
use ember_comm::quantized::{
    ErrorFeedback, Residuals, all_gather_int8_path, reduce_scatter_quantized_path,
};
use ember_comm::{Bf16, Comm, Scope};

use crate::buf::Buf;
use crate::config::{GradQuant, Span, WeightQuant};
use crate::error::ShardError;
use crate::plan::{Levels, Plan};

/// The communicator scope of a group of levels.
pub(crate) fn scope(comm: &Comm, levels: Levels) -> Scope {
    comm.topology().canonical(Scope::Span {
        lo: levels.lo,
        hi: levels.hi,
    })
}

/// The optimizer group's path: the gradient hops (parameter gathers run it outermost first).
fn path(comm: &Comm, plan: &Plan) -> Result<Path, ShardError> {
    let mut bounds = vec![0];
    bounds.extend(plan.config.grad_hops.iter().map(|s| s.0));
    Ok(Path::new(comm.topology(), &bounds)?)
}

fn block(plan: &Plan) -> BlockSize {
    BlockSize::new(plan.config.quant_block).expect("validated: a positive multiple of 8")
}

/// Unit `u` whole, gathered from its primary partition `shard` (quantized per the config).
pub(crate) fn gather_primary(
    comm: &Comm,
    plan: &Plan,
    u: usize,
    shard: &Buf,
) -> Result<Vec<f32>, ShardError> {
    let path = path(comm, plan)?;
    let full = match (plan.config.quantize_weights, shard) {
        (WeightQuant::Off, Buf::F32(v)) => all_gather_path(comm, v, &path)?,
        (WeightQuant::Off, Buf::Bf16(v)) => all_gather_path(comm, v, &path)?
            .into_iter()
            .map(Bf16::to_f32)
            .collect(),
        (WeightQuant::Int8, s) => {
            all_gather_int8_path(comm, &HostKernels, &s.to_f32(), block(plan), &path)?
        }
    };
    check_len(plan, u, full.len())?;
    Ok(full)
}

/// Unit `u` whole for a step's visit: from the secondary copy when it exists; otherwise from
/// the primary, slicing this rank's secondary copy out of the result when one is configured.
pub(crate) fn gather(
    comm: &Comm,
    plan: &Plan,
    u: usize,
    primary: &Buf,
    secondary: &mut Option<Buf>,
) -> Result<Vec<f32>, ShardError> {
    let Some(span) = plan.config.secondary else {
        return gather_primary(comm, plan, u, primary);
    };
    if let Some(copy) = secondary.as_ref() {
        if span == Span(0) {
            return Ok(copy.to_f32());
        }
        let group = comm.group(scope(comm, plan.group(span)));
        let full: Vec<f32> = match copy {
            Buf::F32(v) => group.all_gather(v)?,
            Buf::Bf16(v) => group.all_gather(v)?.into_iter().map(Bf16::to_f32).collect(),
        };
        check_len(plan, u, full.len())?;
        return Ok(full);
    }
    let full = gather_primary(comm, plan, u, primary)?;
    let range = plan.shard_range(u, span, comm.rank());
    *secondary = Some(Buf::from_f32(&full[range], plan.config.compute));
    Ok(full)
}

/// Unit `u`'s gradient (whole, this rank's) reduced to this rank's optimizer shard, averaged
/// over the world.
pub(crate) fn reduce(
    comm: &Comm,
    plan: &Plan,
    u: usize,
    grad: Vec<f32>,
    residuals: &mut Residuals,
) -> Result<Vec<f32>, ShardError> {
    let cfg = &plan.config;
    let depth = plan.topology.depth();
    let world = plan.topology.world_size();
    if cfg.optimizer == Span(0) {
        let mut sum = if world > 1 {
            comm.world().all_reduce(&grad, Reduce::Sum)?
        } else {
            grad
        };
        let inv = world as f32;
        sum.iter_mut().for_each(|x| *x /= inv);
        return Ok(sum);
    }
    let path = path(comm, plan)?;
    let format = match cfg.quantize_grads {
        GradQuant::Off => None,
        GradQuant::Int8 => Some(QuantFormat::Int8),
        GradQuant::Int4 => Some(QuantFormat::Int4),
    };
    let mut shard = match format {
        None => reduce_scatter_path(comm, &grad, &path, Reduce::Mean)?,
        Some(format) => {
            let feedback = if cfg.error_feedback {
                ErrorFeedback::On(residuals)
            } else {
                ErrorFeedback::Off
            };
            reduce_scatter_quantized_path(
                comm,
                &HostKernels,
                &grad,
                format,
                block(plan),
                &path,
                feedback,
            )?
        }
    };
    let expect = plan.shard_len(u, cfg.optimizer);
    if shard.len() != expect {
        return Err(ShardError::Units(format!(
            "unit `{}`: reduced shard of {} elements, expected {expect}",
            plan.units[u].name,
            shard.len()
        )));
    }
    let across = Levels {
        lo: cfg.optimizer.0,
        hi: depth,
    };
    let g = across.size(&plan.topology);
    if g > 1 {
        shard = comm
            .group(scope(comm, across))
            .all_reduce(&shard, Reduce::Sum)?;
        let inv = g as f32;
        shard.iter_mut().for_each(|x| *x /= inv);
    }
    Ok(shard)
}

/// The sum of `x` over the ranks of `levels` (no communication for a group of one).
pub(crate) fn sum_over(comm: &Comm, levels: Levels, x: f32) -> Result<f32, ShardError> {
    if levels.size(comm.topology()) == 1 {
        return Ok(x);
    }
    Ok(comm
        .group(scope(comm, levels))
        .all_reduce(&[x], Reduce::Sum)?[0])
}

/// Replicated parameters rebuilt from this rank's updated shard: an all-gather over the
/// optimizer group in the compute dtype.
pub(crate) fn all_gather_params(comm: &Comm, plan: &Plan, shard: &Buf) -> Result<Buf, ShardError> {
    let path = path(comm, plan)?;
    Ok(match shard {
        Buf::F32(v) => Buf::F32(all_gather_path(comm, v, &path)?),
        Buf::Bf16(v) => Buf::Bf16(all_gather_path(comm, v, &path)?),
    })
}

/// The f32 masters of a unit, whole, from every rank's shard.
pub(crate) fn all_gather_masters(
    comm: &Comm,
    plan: &Plan,
    master: &[f32],
) -> Result<Vec<f32>, ShardError> {
    if plan.config.optimizer == Span(0) {
        return Ok(master.to_vec());
    }
    Ok(all_gather_path(comm, master, &path(comm, plan)?)?)
}

/// Refuses to start when ranks hold different units or different initial weights (Burn's
/// parameter initialisation is per process: a model must be built from a seed keyed by path).
pub(crate) fn check_same_everywhere(
    comm: &Comm,
    plan: &Plan,
    values: &HashMap<String, Vec<f32>>,
) -> Result<(), ShardError> {
    let mut h = Fnv::default();
    for unit in &plan.units {
        h.bytes(unit.name.as_bytes());
        for p in &unit.params {
            h.bytes(p.name.as_bytes());
            p.shape
                .iter()
                .for_each(|&d| h.bytes(&(d as u64).to_le_bytes()));
            for x in &values[&p.name] {
                h.bytes(&x.to_bits().to_le_bytes());
            }
        }
    }
    let mine = h.0.to_le_bytes();
    if comm.topology().world_size() == 1 {
        return Ok(());
    }
    let all = comm.world().all_gather(&mine)?;
    if let Some(r) = all.chunks_exact(8).position(|c| c != &all[..8]) {
        return Err(ShardError::Units(format!(
            "rank {r} holds other units or initial weights than rank 0: build the module on \
             every rank from the same seed, keyed by parameter path (Burn's own initialisation \
             differs per process)"
        )));
    }
    Ok(())
}

/// FNV-1a, 64-bit: a fingerprint to compare across ranks, not a security hash.
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn bytes(&mut self, b: &[u8]) {
        for &x in b {
            self.0 ^= x as u64;
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

fn check_len(plan: &Plan, u: usize, len: usize) -> Result<(), ShardError> {
    if len != plan.units[u].padded {
        return Err(ShardError::Units(format!(
            "unit `{}`: gathered {len} elements, expected {}",
            plan.units[u].name, plan.units[u].padded
        )));
    }
    Ok(())
}
