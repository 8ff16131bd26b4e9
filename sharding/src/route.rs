//! The collectives a plan implies, on device tensors: which path, group, dtype and
//! quantization each state's movement uses. Data leaves the device only as the staging bytes
//! of an MPI call (`staging`); quantization runs where the data lives (`kernels`). Everything
//! that moves goes through `ember-comm`; this file only chooses and stages.
//!
//! The quantized reduction (qgZ) is `ember_comm::quantized::reduce_scatter_quantized_path`
//! with its arithmetic on device tensors; a test checks the two agree bit for bit.

use burn::tensor::{DType, Device, Int, Tensor};
use ember_comm::collective::Reduce;
use ember_comm::hier::{all_gather_path, reduce_scatter_path};
use ember_comm::path::Path;
use ember_comm::quant::{BlockSize, QuantFormat, Quantized};
use ember_comm::{Comm, Group, Scope};

use crate::config::{Compute, GradQuant, Span, WeightQuant};
use crate::error::ShardError;
use crate::kernels;
use crate::plan::{Levels, Plan};
use crate::staging;

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

/// Whether `path`'s group is this rank alone, so its collectives would only copy.
fn alone(plan: &Plan, path: &Path) -> bool {
    Levels {
        lo: 0,
        hi: path.hi(),
    }
    .size(&plan.topology)
        == 1
}

fn dtype(plan: &Plan) -> DType {
    match plan.config.compute {
        Compute::F32 => DType::F32,
        Compute::Bf16 => DType::BF16,
    }
}

/// A rank's secondary copy of one unit (hpZ).
#[derive(Debug, Clone)]
pub(crate) enum Secondary {
    /// This rank's slice of the unit, in the compute dtype.
    Plain(Tensor<1>),
    /// The int8 blocks of the primary shards the slice covers, exactly as the primary gather
    /// delivered them (so keeping them is lossless), held as i32 words.
    Int8 {
        /// The wire bytes, as words.
        words: Tensor<1, Int>,
        /// Their length in bytes.
        bytes: usize,
    },
}

impl Secondary {
    /// Bytes held.
    pub(crate) fn bytes(&self) -> u64 {
        match self {
            Secondary::Plain(t) => staging::tensor_bytes(t),
            Secondary::Int8 { bytes, .. } => *bytes as u64,
        }
    }
}

/// A copy of `t` that shares no buffer with it (a slice of a gathered unit must not keep the
/// whole unit alive).
fn detached(t: Tensor<1>) -> Tensor<1> {
    let dtype = t.dtype();
    let device = t.device();
    Tensor::from_data(t.into_data(), (&device, dtype))
}

/// An unquantized all-gather over `path` in the tensor's dtype (f32 or bf16).
fn gather_plain_path(
    comm: &Comm,
    shard: Tensor<1>,
    path: &Path,
    device: &Device,
) -> Result<Tensor<1>, ShardError> {
    Ok(match shard.dtype() {
        DType::BF16 => staging::from_bf16(
            &all_gather_path(comm, &staging::to_bf16(shard), path)?,
            device,
        ),
        _ => staging::from_f32(
            all_gather_path(comm, &staging::to_f32(shard), path)?,
            device,
        ),
    })
}

/// An unquantized all-gather over one group in the tensor's dtype (f32 or bf16).
fn gather_plain_group(
    group: &Group,
    shard: Tensor<1>,
    device: &Device,
) -> Result<Tensor<1>, ShardError> {
    Ok(match shard.dtype() {
        DType::BF16 => staging::from_bf16(&group.all_gather(&staging::to_bf16(shard))?, device),
        _ => staging::from_f32(group.all_gather(&staging::to_f32(shard))?, device),
    })
}

/// The whole unit from wire forms of int8 shards of `shard_len` elements laid end to end.
fn dequantize_wires(plan: &Plan, wires: &[u8], shard_len: usize, device: &Device) -> Tensor<1> {
    let block = plan.block();
    let wire_len = Quantized::wire_bytes(QuantFormat::Int8, block, shard_len);
    let parts: Vec<Quantized> = wires
        .chunks_exact(wire_len)
        .map(|w| Quantized::read_wire(QuantFormat::Int8, block, shard_len, w))
        .collect();
    let full = kernels::dequantize_concat(&parts, device);
    match dtype(plan) {
        DType::F32 => full,
        d => full.cast(d),
    }
}

/// Unit `u` whole (compute dtype), gathered from its primary partition `shard`, with the
/// gathered int8 wire bytes when weights are quantized (the secondary copy is cut from them).
pub(crate) fn gather_primary(
    comm: &Comm,
    plan: &Plan,
    u: usize,
    shard: &Tensor<1>,
    device: &Device,
) -> Result<(Tensor<1>, Option<Vec<u8>>), ShardError> {
    let path = path(comm, plan)?;
    let (full, wires) = match plan.config.quantize_weights {
        // A group of one owns the whole unit: nothing to gather, nothing to copy.
        WeightQuant::Off if alone(plan, &path) => (shard.clone(), None),
        WeightQuant::Off => (gather_plain_path(comm, shard.clone(), &path, device)?, None),
        WeightQuant::Int8 => {
            let x = match shard.dtype() {
                DType::F32 => shard.clone(),
                _ => shard.clone().cast(DType::F32),
            };
            let q = kernels::quantize(x, QuantFormat::Int8, plan.block());
            let mut wire = Vec::with_capacity(Quantized::wire_bytes(q.format, q.block, q.len));
            q.write_wire(&mut wire);
            let gathered = all_gather_path(comm, &wire, &path)?;
            let full = dequantize_wires(plan, &gathered, q.len, device);
            (full, Some(gathered))
        }
    };
    check_len(plan, u, full.dims()[0])?;
    Ok((full, wires))
}

/// Unit `u` whole for a step's visit: from the secondary copy when it exists; otherwise from
/// the primary, cutting this rank's secondary copy out of the result when one is configured
/// and `keep` says this gather starts it.
pub(crate) fn gather(
    comm: &Comm,
    plan: &Plan,
    u: usize,
    primary: &Tensor<1>,
    secondary: &mut Option<Secondary>,
    device: &Device,
) -> Result<Tensor<1>, ShardError> {
    let Some(span) = plan.config.secondary else {
        return Ok(gather_primary(comm, plan, u, primary, device)?.0);
    };
    let group_size = span.group_size(comm.topology());
    if let Some(copy) = secondary.as_ref() {
        let full = match copy {
            Secondary::Plain(t) if group_size == 1 => t.clone(),
            Secondary::Plain(t) => {
                let group = comm.group(scope(comm, plan.group(span)));
                gather_plain_group(&group, t.clone(), device)?
            }
            Secondary::Int8 { words, bytes } => {
                let mine = staging::bytes_from_device(words.clone(), *bytes);
                let wires = if group_size == 1 {
                    mine
                } else {
                    comm.group(scope(comm, plan.group(span)))
                        .all_gather(&mine)?
                };
                dequantize_wires(plan, &wires, plan.shard_len(u, plan.config.params), device)
            }
        };
        check_len(plan, u, full.dims()[0])?;
        return Ok(full);
    }
    let (full, wires) = gather_primary(comm, plan, u, primary, device)?;
    let range = plan.shard_range(u, span, comm.rank());
    *secondary = Some(match wires {
        None => Secondary::Plain(detached(full.clone().slice(range))),
        Some(wires) => {
            // The secondary slice covers primary shards [i k, (i + 1) k) of the gather.
            let per = wires.len() / plan.params_group_size();
            let k = plan.shard_len(u, span) / plan.shard_len(u, plan.config.params);
            let first = range.start / plan.shard_len(u, plan.config.params);
            let mine = &wires[first * per..(first + k) * per];
            Secondary::Int8 {
                words: staging::bytes_to_device(mine, device),
                bytes: mine.len(),
            }
        }
    });
    Ok(full)
}

/// Error-feedback residuals of one unit's quantized reduction, one per hop, on the device.
#[derive(Debug, Clone, Default)]
pub struct Residuals {
    /// Hop `k`'s residual (`None` before the first step and for hops that move nothing).
    pub per_hop: Vec<Option<Tensor<1>>>,
}

/// Unit `u`'s gradient (whole, this rank's, f32) reduced to this rank's optimizer shard,
/// averaged over the world.
pub(crate) fn reduce(
    comm: &Comm,
    plan: &Plan,
    u: usize,
    grad: Tensor<1>,
    residuals: &mut Residuals,
    device: &Device,
) -> Result<Tensor<1>, ShardError> {
    let cfg = &plan.config;
    let world = plan.topology.world_size();
    if cfg.optimizer == Span(0) {
        if world == 1 {
            return Ok(grad);
        }
        let sum = comm
            .world()
            .all_reduce(&staging::to_f32(grad), Reduce::Sum)?;
        return Ok(staging::from_f32(sum, device) / world as f32);
    }
    let path = path(comm, plan)?;
    let shard = match cfg.quantize_grads {
        // A group of one owns the whole unit, and its mean over one rank is itself.
        GradQuant::Off if alone(plan, &path) => grad,
        GradQuant::Off => staging::from_f32(
            reduce_scatter_path(comm, &staging::to_f32(grad), &path, Reduce::Mean)?,
            device,
        ),
        GradQuant::Int8 => reduce_scatter_quantized(
            comm,
            grad,
            QuantFormat::Int8,
            plan.block(),
            &path,
            cfg.error_feedback.then_some(residuals),
            device,
        )?,
        GradQuant::Int4 => reduce_scatter_quantized(
            comm,
            grad,
            QuantFormat::Int4,
            plan.block(),
            &path,
            cfg.error_feedback.then_some(residuals),
            device,
        )?,
    };
    let expect = plan.shard_len(u, cfg.optimizer);
    if shard.dims()[0] != expect {
        return Err(ShardError::Units(format!(
            "unit `{}`: reduced shard of {} elements, expected {expect}",
            plan.units[u].name,
            shard.dims()[0]
        )));
    }
    let across = Levels {
        lo: cfg.optimizer.0,
        hi: plan.topology.depth(),
    };
    let g = across.size(&plan.topology);
    if g == 1 {
        return Ok(shard);
    }
    let sum = comm
        .group(scope(comm, across))
        .all_reduce(&staging::to_f32(shard), Reduce::Sum)?;
    Ok(staging::from_f32(sum, device) / g as f32)
}

/// qgZ on device tensors: the hierarchical quantized all-to-all reduce-scatter over `path`'s
/// group `G` of `P` ranks, averaged over `P`, with optional error feedback. `grad`'s length is
/// a multiple of `P` blocks (the plan pads every unit so). Returns this rank's chunk: the
/// layout of a flat mean reduce-scatter on `G`.
pub(crate) fn reduce_scatter_quantized(
    comm: &Comm,
    grad: Tensor<1>,
    format: QuantFormat,
    block: BlockSize,
    path: &Path,
    mut residuals: Option<&mut Residuals>,
    device: &Device,
) -> Result<Tensor<1>, ShardError> {
    let topology = comm.topology();
    path.check(topology)?;
    let p = topology.group_size(path.group(topology));
    let n = grad.dims()[0];
    if !n.is_multiple_of(p * block.get()) {
        return Err(ShardError::Units(format!(
            "a quantized reduction of {n} elements over {p} ranks needs a multiple of {} \
             (whole blocks per rank)",
            p * block.get()
        )));
    }
    if n == 0 {
        return Ok(grad);
    }
    // Hop order: chunk r of the natural order goes to position chunk_position(r).
    let chunk = n / p;
    let mut at_position = vec![0; p];
    for r in 0..p {
        at_position[path.chunk_position(topology, r)] = r;
    }
    let mut buf = if at_position.iter().enumerate().all(|(i, &r)| i == r) {
        grad
    } else {
        Tensor::cat(
            at_position
                .iter()
                .map(|&r| grad.clone().slice(r * chunk..(r + 1) * chunk))
                .collect(),
            0,
        )
    };
    let hops = path.hops(topology);
    if let Some(r) = residuals.as_deref_mut() {
        r.per_hop.resize(hops.len(), None);
    }
    for (hop, scope) in hops.into_iter().enumerate() {
        let group = comm.try_group(scope)?;
        if group.size() == 1 {
            continue;
        }
        if let Some(r) = residuals.as_deref_mut()
            && let Some(e) = &r.per_hop[hop]
        {
            if e.dims() != buf.dims() {
                return Err(ShardError::Units(format!(
                    "error-feedback residual of {} elements for a buffer of {}",
                    e.dims()[0],
                    buf.dims()[0]
                )));
            }
            buf = buf + e.clone();
        }
        let q = kernels::quantize(buf.clone(), format, block);
        if let Some(r) = residuals.as_deref_mut() {
            let back = kernels::dequantize_sum(std::slice::from_ref(&q), device);
            r.per_hop[hop] = Some(buf - back);
        }
        buf = exchange(&group, &q, block, device)?;
    }
    Ok(buf / p as f32)
}

/// One qgZ hop: all-to-all the group's parts of `q`, dequantize and sum what arrives.
fn exchange(
    group: &Group,
    q: &Quantized,
    block: BlockSize,
    device: &Device,
) -> Result<Tensor<1>, ShardError> {
    let d = group.size();
    let part = q.len / d;
    let mut wire = Vec::with_capacity(d * Quantized::wire_bytes(q.format, block, part));
    for j in 0..d {
        q.part(j * part, part).write_wire(&mut wire);
    }
    let received = group.all_to_all(&wire)?;
    let parts: Vec<Quantized> = received
        .chunks_exact(wire.len() / d)
        .map(|w| Quantized::read_wire(q.format, block, part, w))
        .collect();
    Ok(kernels::dequantize_sum(&parts, device))
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

/// Replicated parameters rebuilt from this rank's updated shard (compute dtype): an
/// all-gather over the optimizer group.
pub(crate) fn all_gather_params(
    comm: &Comm,
    plan: &Plan,
    shard: Tensor<1>,
    device: &Device,
) -> Result<Tensor<1>, ShardError> {
    gather_plain_path(comm, shard, &path(comm, plan)?, device)
}

/// Refuses to start when ranks hold other units, other shapes or another initial source
/// (`fingerprint`): they would build different models.
pub(crate) fn check_same_everywhere(
    comm: &Comm,
    plan: &Plan,
    fingerprint: u64,
) -> Result<(), ShardError> {
    let mut h = Fnv::default();
    for unit in &plan.units {
        h.bytes(unit.name.as_bytes());
        for p in &unit.params {
            h.bytes(p.name.as_bytes());
            p.shape
                .iter()
                .for_each(|&d| h.bytes(&(d as u64).to_le_bytes()));
        }
    }
    h.bytes(&fingerprint.to_le_bytes());
    if comm.topology().world_size() == 1 {
        return Ok(());
    }
    let all = comm.world().all_gather(&h.0.to_le_bytes())?;
    if let Some(r) = all.chunks_exact(8).position(|c| c != &all[..8]) {
        return Err(ShardError::Units(format!(
            "rank {r} holds other units, shapes or initial weights than rank 0: every rank \
             must describe the same model and read it from the same source (the same seed or \
             checkpoint)"
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
