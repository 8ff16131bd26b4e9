//! The collectives a plan implies, on device tensors: which path, group, dtype and
//! quantization each state's movement uses. Data leaves the device only as the staging bytes
//! of an MPI call (`staging`); quantization runs where the data lives (`kernels`). Everything
//! that moves goes through `ember-comm`; this file only chooses and stages.
//!
//! Gathers and reductions are [`Flow`]s: one stage per group they move data over, so the
//! communication threads (`worker`) can run consecutive jobs' stages on different links at
//! once. The quantized reduction (qgZ) follows the reference qgZ on host buffers
//! (`comm/tests/reference/qgz.rs`) step for step, with its arithmetic on device tensors;
//! `tests/qgz_reference.rs` checks the two agree bit for bit.

use std::sync::Arc;

use burn::tensor::{DType, Device, Tensor};
use ember_comm::collective::Reduce;
use ember_comm::hier::all_gather_path;
use ember_comm::path::Path;
use ember_comm::path::{from_hop_order, from_hop_order_into, in_hop_order};
use ember_comm::quant::{BlockSize, QuantFormat, Quantized};
use ember_comm::{Bf16, ShardLayout};
use ember_comm::{Comm, Group, Scope};

use crate::config::{Compute, GradQuant, Span};
use crate::error::ShardError;
use crate::plan::schedule::Source;
use crate::plan::{Levels, Plan, levels_of};
use crate::transport::kernels;
use crate::transport::staging;
use crate::transport::staging::Staged;

/// The communicator scope of a group of levels.
pub(crate) fn scope(comm: &Comm, levels: Levels) -> Scope {
    comm.topology().canonical(Scope::Span {
        lo: levels.lo,
        hi: levels.hi,
    })
}

/// The optimizer group's path: the gradient hops (parameter gathers run it outermost first).
fn path_of(plan: &Plan) -> Result<Path, ShardError> {
    let mut bounds = vec![0];
    bounds.extend(plan.config.grad_hops().iter().map(|s| s.0));
    Ok(Path::new(&plan.topology, &bounds)?)
}

/// Host memory a step keeps for MPI to read, shared by the jobs that read it: values in the
/// compute dtype, or int8 wire forms.
#[derive(Debug, Clone)]
pub(crate) enum HostForm {
    F32(Arc<Vec<f32>>),
    Bf16(Arc<Vec<Bf16>>),
    Bytes(Arc<Vec<u8>>),
}

impl HostForm {
    /// Bytes held.
    fn bytes(&self) -> u64 {
        match self {
            HostForm::F32(v) => 4 * v.len() as u64,
            HostForm::Bf16(v) => 2 * v.len() as u64,
            HostForm::Bytes(v) => v.len() as u64,
        }
    }

    /// Host values read from a device tensor in its dtype (a crossing), as values of their
    /// own: a step keeps them (`HostShards`), and values left where the runtime's read put
    /// them would keep the tensor's device buffer too.
    fn values_of(t: Tensor<1>) -> Result<Self, ShardError> {
        Ok(match t.dtype() {
            DType::BF16 => HostForm::Bf16(Arc::new(staging::to_bf16(t)?)),
            _ => HostForm::F32(Arc::new(staging::to_f32(t)?)),
        })
    }

    /// Its all-gather over the group of `levels`, read where it is. Values land in memory
    /// staged for `device` where `last` says the gather is the one whose result goes up
    /// (no host copy between MPI's buffer and the device's); otherwise in a vector.
    fn all_gather(
        &self,
        c: &Comm,
        levels: Levels,
        last: Option<&Device>,
    ) -> Result<Carry, ShardError> {
        let g = c.try_group(scope(c, levels))?;
        Ok(match self {
            HostForm::F32(v) => all_gather_to(&g, v, last, Carry::F32)?,
            HostForm::Bf16(v) => all_gather_to(&g, v, last, Carry::Bf16)?,
            HostForm::Bytes(v) => Carry::Bytes(g.all_gather(&v[..])?),
        })
    }

    /// A copy as a job's carry.
    fn to_carry(&self) -> Carry {
        match self {
            HostForm::F32(v) => Carry::F32(v.to_vec()),
            HostForm::Bf16(v) => Carry::Bf16(v.to_vec()),
            HostForm::Bytes(v) => Carry::Bytes(v.to_vec()),
        }
    }
}

/// A rank's secondary copy of one unit (hpZ).
#[derive(Debug, Clone)]
pub(crate) enum Secondary {
    /// This rank's slice of the unit on the device, where a group of one rank uses it as it
    /// is (boxed: the other variant is two words).
    Device(Box<Tensor<1>>),
    /// In host memory, where the all-gather that rebuilds the unit, its only use, reads it:
    /// this rank's slice of the values, or the int8 blocks of the primary shards the slice
    /// covers, exactly as the primary gather delivered them (so keeping them is lossless).
    /// Neither crosses to the device and back, nor takes its memory.
    Host(HostForm),
}

impl Secondary {
    /// Bytes held.
    pub(crate) fn bytes(&self) -> u64 {
        match self {
            Secondary::Device(t) => staging::tensor_bytes(t),
            Secondary::Host(f) => f.bytes(),
        }
    }
}

/// This step's host form of each unit's primary shard (its values, or its int8 wire form),
/// read from the device by the unit's first gather of the step and read by MPI in place by
/// the later ones: the shard does not change before the update.
#[derive(Debug, Default)]
pub(crate) struct HostShards(std::sync::Mutex<Vec<Option<HostForm>>>);

impl HostShards {
    pub(crate) fn new(units: usize) -> Self {
        Self(std::sync::Mutex::new(vec![None; units]))
    }

    /// Unit `u`'s, made by `read` at its first use this step. Where the device's memory is
    /// host memory (flex) nothing crosses and nothing is kept: every use reads it anew, so a
    /// step holds no second copy of the shards.
    fn get_or(
        &self,
        u: usize,
        device: &Device,
        read: impl FnOnce() -> Result<HostForm, ShardError>,
    ) -> Result<HostForm, ShardError> {
        if !staging::has_own_memory(device) {
            return read();
        }
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(form) = &all[u] {
            return Ok(form.clone());
        }
        let form = read()?;
        all[u] = Some(form.clone());
        Ok(form)
    }
}

/// A copy of `t` that shares no buffer with it (a slice of a gathered unit must not keep the
/// whole unit alive): on flex its values read out, elsewhere a product by one written on the
/// device (the same bits: `x * 1` is exact), not a round trip through host memory. On a
/// CubeCL device the product runs at once, while the unit `t` is a view of is alive: run
/// later, after the unit's last handle had gone, it could be written in place into the unit's
/// buffer.
fn detached(t: Tensor<1>) -> Tensor<1> {
    let device = t.device();
    if device == Device::flex() {
        let dtype = t.dtype();
        return Tensor::from_data(t.into_data(), (&device, dtype));
    }
    let copy = t.clone() * 1.0;
    #[cfg(feature = "cubecl")]
    let _ = crate::transport::cube::primitive(&copy);
    drop(t);
    copy
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
            &all_gather_path(comm, &staging::read_bf16(shard)?, path)?,
            device,
        ),
        _ => staging::from_f32(
            all_gather_path(comm, &staging::read_f32(shard)?, path)?,
            device,
        ),
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
    match plan.config.compute.dtype() {
        DType::F32 => full,
        d => full.cast(d),
    }
}

/// What a job hands from one stage to the next.
pub(crate) enum Carry {
    /// Nothing yet (the first stage starts from the job's own inputs).
    Empty,
    /// A device tensor (boxed: the host variants are three words).
    Tensor(Box<Tensor<1>>),
    /// Host f32 values.
    F32(Vec<f32>),
    /// Host bf16 values.
    Bf16(Vec<Bf16>),
    /// Host bytes (int8 wire forms).
    Bytes(Vec<u8>),
    /// Host values (f32 or bf16) in memory staged for the device they go up to.
    Staged(Staged),
}

/// One stage of a job: a collective on one group, run by that group's thread.
pub(crate) type StageFn<'e> =
    Box<dyn FnOnce(&Comm, Carry) -> Result<Carry, ShardError> + Send + 'e>;
/// A job's last step, after its last collective: local work and delivering the result.
pub(crate) type FinishFn<'e> = Box<dyn FnOnce(Carry) -> Result<(), ShardError> + Send + 'e>;

/// A gather or a reduction as a chain of collectives, one per group, so that consecutive jobs
/// overlap on different links (a unit's inner hop while the next unit's outer hop runs).
pub(crate) struct Flow<'e> {
    /// Each stage's group and work, in order.
    pub stages: Vec<(Levels, StageFn<'e>)>,
    /// What follows the last stage (or everything, when nothing moves).
    pub finish: FinishFn<'e>,
}

impl<'e> Flow<'e> {
    /// Runs every stage and the finish on the calling thread, over `comm`'s groups.
    pub(crate) fn run_here(self, comm: &Comm) -> Result<(), ShardError> {
        let mut carry = Carry::Empty;
        for (_, stage) in self.stages {
            carry = stage(comm, carry)?;
        }
        (self.finish)(carry)
    }
}

/// The secondary copies of a step, unit by unit, with a signal for when one is cut: a later
/// gather from a copy may reach its group's thread before the thread of the gather that cuts
/// it has finished.
#[derive(Debug, Default)]
pub(crate) struct Secondaries {
    slots: std::sync::Mutex<Vec<Option<Secondary>>>,
    cut: std::sync::Condvar,
}

impl Secondaries {
    pub(crate) fn new(units: usize) -> Self {
        Self {
            slots: std::sync::Mutex::new(vec![None; units]),
            cut: std::sync::Condvar::new(),
        }
    }

    fn put(&self, u: usize, copy: Secondary) {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())[u] = Some(copy);
        self.cut.notify_all();
    }

    /// Unit `u`'s copy, waiting until it is cut.
    fn get(&self, u: usize) -> Secondary {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(c) = &slots[u] {
                return c.clone();
            }
            slots = self.cut.wait(slots).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Bytes of every copy cut so far.
    pub(crate) fn bytes(&self) -> u64 {
        self.slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .flatten()
            .map(Secondary::bytes)
            .sum()
    }
}

/// The groups, outermost first, that a gather from the primary partition moves data over.
fn gather_hops(plan: &Plan) -> Vec<Levels> {
    let mut hops: Vec<Levels> = plan
        .hops()
        .into_iter()
        .filter(|h| h.size(&plan.topology) > 1)
        .collect();
    hops.reverse();
    hops
}

/// An all-gather of whatever host buffer `carry` holds over `group`.
fn all_gather_carry(comm: &Comm, group: Levels, carry: Carry) -> Result<Carry, ShardError> {
    let g = comm.try_group(scope(comm, group))?;
    Ok(match carry {
        Carry::F32(v) => Carry::F32(g.all_gather(&v)?),
        Carry::Bf16(v) => Carry::Bf16(g.all_gather(&v)?),
        Carry::Bytes(v) => Carry::Bytes(g.all_gather(&v)?),
        Carry::Empty | Carry::Tensor(_) | Carry::Staged(_) => {
            unreachable!("stages carry host buffers")
        }
    })
}

/// A gathered host buffer in the G index order of `path` (`chunk` elements per rank; the
/// gather concatenated in hop order when more than one hop moved data), reordered into memory
/// staged for `device`.
fn in_g_order(
    plan: &Plan,
    path: &Path,
    carry: Carry,
    chunk: usize,
    hops: usize,
    device: &Device,
) -> Carry {
    fn reorder<T: staging::Crossing>(
        plan: &Plan,
        path: &Path,
        v: &[T],
        chunk: usize,
        device: &Device,
    ) -> Carry {
        let mut out = Staged::new::<T>(v.len(), device);
        from_hop_order_into(&plan.topology, path, v, chunk, out.values_mut());
        Carry::Staged(out)
    }
    match carry {
        Carry::F32(v) if hops > 1 => reorder(plan, path, &v, chunk, device),
        Carry::Bf16(v) if hops > 1 => reorder(plan, path, &v, chunk, device),
        other => other,
    }
}

/// Gathered values on the device.
fn upload(carry: Carry, device: &Device) -> Tensor<1> {
    match carry {
        Carry::F32(v) => staging::from_f32(v, device),
        Carry::Bf16(v) => staging::from_bf16(&v, device),
        Carry::Staged(s) => s.upload(),
        Carry::Tensor(t) => *t,
        Carry::Empty | Carry::Bytes(_) => unreachable!("a plain gather carries values"),
    }
}

/// This rank's secondary copy of unit `u` at `span` as host values, cut from the gathered
/// `values` (in G index order), where its group all-gathers it (a group of one rank uses it
/// on the device); `None` otherwise.
fn cut_host_values(
    plan: &Plan,
    u: usize,
    span: Span,
    rank: usize,
    values: &Carry,
) -> Option<Secondary> {
    if plan.group(span).size(&plan.topology) == 1 {
        return None;
    }
    let range = plan.shard_range(u, span, rank);
    Some(Secondary::Host(match values {
        Carry::F32(v) => HostForm::F32(Arc::new(v[range].to_vec())),
        Carry::Bf16(v) => HostForm::Bf16(Arc::new(v[range].to_vec())),
        Carry::Staged(s) if s.dtype() == DType::BF16 => {
            HostForm::Bf16(Arc::new(s.values()[range].to_vec()))
        }
        Carry::Staged(s) => HostForm::F32(Arc::new(s.values()[range].to_vec())),
        _ => return None,
    }))
}

/// This rank's secondary copy of unit `u` at `span`, cut from the gathered unit: the int8 blocks
/// of the primary shards it covers, exactly as they arrived (`wires`, in G index order), or
/// its slice of the unit on the device.
fn cut_secondary(
    plan: &Plan,
    u: usize,
    span: Span,
    rank: usize,
    full: &Tensor<1>,
    wires: Option<Vec<u8>>,
) -> Secondary {
    let range = plan.shard_range(u, span, rank);
    match wires {
        Some(wires) => {
            // The secondary slice covers primary shards [i k, (i + 1) k) of the gather.
            let per = wires.len() / plan.params_group_size();
            let primary_len = plan.shard_len(u, plan.config.params());
            let k = plan.shard_len(u, span) / primary_len;
            let first = range.start / primary_len;
            let mine = &wires[first * per..(first + k) * per];
            Secondary::Host(HostForm::Bytes(Arc::new(mine.to_vec())))
        }
        None => Secondary::Device(Box::new(detached(full.clone().slice(range)))),
    }
}

/// Unit `u` whole (compute dtype) as a [`Flow`]: from the secondary copy (`source`
/// `Secondary`), or from the primary partition over the gradient path's hops, outermost
/// first, int8 if configured, cutting this rank's secondary copy out of the result when
/// `source` says this gather starts it. `deliver` gets the unit.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gather_flow<'e>(
    plan: &'e Plan,
    rank: usize,
    u: usize,
    source: Source,
    primary: &'e Tensor<1>,
    secondaries: &'e Secondaries,
    shards: &'e HostShards,
    device: &'e Device,
    deliver: impl FnOnce(Result<Tensor<1>, ShardError>) + Send + 'e,
) -> Result<Flow<'e>, ShardError> {
    let path = path_of(plan)?;
    if source == Source::Secondary {
        let span = plan
            .secondary()
            .expect("the schedule gathers from a secondary copy only when one is configured");
        let group = plan.group(span);
        let moves = group.size(&plan.topology) > 1;
        let shard_len = plan.shard_len(u, plan.config.params());
        let take = move |comm: Option<&Comm>| -> Result<Carry, ShardError> {
            let copy = secondaries.get(u);
            Ok(match (copy, comm) {
                (Secondary::Device(t), None) => Carry::Tensor(t),
                (Secondary::Device(t), Some(c)) => {
                    HostForm::values_of(*t)?.all_gather(c, group, Some(device))?
                }
                (Secondary::Host(f), None) => f.to_carry(),
                (Secondary::Host(f), Some(c)) => f.all_gather(c, group, Some(device))?,
            })
        };
        let finish = move |carry: Carry| {
            let full = match carry {
                Carry::Bytes(wires) => dequantize_wires(plan, &wires, shard_len, device),
                other => upload(other, device),
            };
            deliver(check_len(plan, u, full.dims()[0]).map(|()| full));
            Ok(())
        };
        return Ok(if moves {
            Flow {
                stages: vec![(group, Box::new(move |c, _| take(Some(c))))],
                finish: Box::new(finish),
            }
        } else {
            Flow {
                stages: Vec::new(),
                finish: Box::new(move |_| finish(take(None)?)),
            }
        });
    }
    let hops = gather_hops(plan);
    let live = hops.len();
    let keep = (source == Source::PrimaryToSecondary)
        .then_some(plan.secondary())
        .flatten();
    let quantized = plan.quantizes_weights();
    let shard_len = plan.shard_len(u, plan.config.params());
    // The first stage starts from the shard's host form this step: its values, or its int8
    // wire form, read from the device by the unit's first gather of the step.
    let read = move || -> Result<HostForm, ShardError> {
        if !quantized {
            return HostForm::values_of(primary.clone());
        }
        let x = match primary.dtype() {
            DType::F32 => primary.clone(),
            _ => primary.clone().cast(DType::F32),
        };
        let q = kernels::quantize(x, QuantFormat::Int8, plan.block())?;
        let mut wire = Vec::with_capacity(Quantized::wire_bytes(q.format, q.block, q.len));
        q.write_wire(&mut wire);
        Ok(HostForm::Bytes(Arc::new(wire)))
    };
    let finish = move |carry: Carry| -> Result<(), ShardError> {
        let carry = match carry {
            Carry::Empty if quantized => shards.get_or(u, device, read)?.to_carry(),
            Carry::Empty => Carry::Tensor(Box::new(primary.clone())),
            other => other,
        };
        // A secondary copy the group all-gathers is cut from the host values before they go
        // up.
        let mut copy = None;
        let (full, wires) = match carry {
            Carry::Bytes(gathered) => {
                let per = gathered.len() / plan.params_group_size();
                let gathered = if live > 1 {
                    from_hop_order(&plan.topology, &path, &gathered, per)
                } else {
                    gathered
                };
                let full = dequantize_wires(plan, &gathered, shard_len, device);
                (full, Some(gathered))
            }
            other => {
                let ordered = in_g_order(plan, &path, other, shard_len, live, device);
                copy = keep.and_then(|span| cut_host_values(plan, u, span, rank, &ordered));
                (upload(ordered, device), None)
            }
        };
        if let Err(e) = check_len(plan, u, full.dims()[0]) {
            deliver(Err(e));
            return Ok(());
        }
        if let Some(span) = keep {
            let copy = copy.unwrap_or_else(|| cut_secondary(plan, u, span, rank, &full, wires));
            secondaries.put(u, copy);
        }
        deliver(Ok(full));
        Ok(())
    };
    let mut stages: Vec<(Levels, StageFn<'e>)> = Vec::with_capacity(live);
    for (i, &hop) in hops.iter().enumerate() {
        stages.push((
            hop,
            Box::new(move |c: &Comm, carry: Carry| {
                if i == 0 {
                    // A one-hop gather's result goes up as it lands; several hops' is
                    // reordered into staged memory at the end (`in_g_order`).
                    let last = (live == 1).then_some(device);
                    shards.get_or(u, device, read)?.all_gather(c, hop, last)
                } else {
                    all_gather_carry(c, hop, carry)
                }
            }),
        ));
    }
    Ok(Flow {
        stages,
        finish: Box::new(finish),
    })
}
/// Error-feedback residuals of one unit's quantized reduction, one per hop, on the device.
#[derive(Debug, Clone, Default)]
pub struct Residuals {
    /// Hop `k`'s residual (`None` before the first step and for hops that move nothing).
    pub per_hop: Vec<Option<Tensor<1>>>,
}

/// Unit `u`'s gradient (whole, this rank's, f32) reduced to this rank's optimizer shard,
/// averaged over the world, as a [`Flow`]: an all-reduce over the world when optimizer state
/// is replicated; else a reduce-scatter over the gradient path's hops, innermost first (qgZ's
/// int4 / int8 all-to-all per hop when gradients are quantized, with the residuals of
/// `residuals[u]`), then an all-reduce across the levels the optimizer state is replicated
/// over. Unquantized reductions move the compute dtype: bf16 when computing in bf16 (each hop
/// adds in f32 and rounds to bf16), as DeepSpeed and FSDP reduce by default. `deliver` gets
/// the shard, in f32.
#[allow(clippy::too_many_arguments)]
pub(crate) fn reduce_flow<'e>(
    plan: &'e Plan,
    u: usize,
    grad: Tensor<1>,
    inner_only: bool,
    residuals: &'e std::sync::Mutex<Vec<Residuals>>,
    accumulated: &'e Accumulated,
    device: &'e Device,
    deliver: impl FnOnce(Result<Tensor<1>, ShardError>) + Send + 'e,
) -> Result<Flow<'e>, ShardError> {
    let cfg = &plan.config;
    let depth = plan.topology.depth();
    let world = Levels { lo: 0, hi: depth };
    let world_size = plan.topology.world_size();
    let bf16 = cfg.compute == Compute::Bf16;
    let mut stages: Vec<(Levels, StageFn<'e>)> = Vec::new();
    if cfg.optimizer() == Span(0) {
        if world_size == 1 {
            return Ok(Flow {
                stages,
                finish: Box::new(move |_| {
                    deliver(Ok(grad));
                    Ok(())
                }),
            });
        }
        stages.push((
            world,
            Box::new(move |c: &Comm, _| all_reduce_carry(c, world, grad, bf16, device)),
        ));
        return Ok(Flow {
            stages,
            finish: Box::new(move |carry| {
                deliver(Ok(host_to_f32(carry, device) / world_size as f32));
                Ok(())
            }),
        });
    }
    let path = path_of(plan)?;
    let topology = &plan.topology;
    let p = topology.group_size(path.group(topology));
    let path_hops = path.hops(topology);
    let live: Vec<(usize, Levels)> = path_hops
        .iter()
        .enumerate()
        .map(|(k, &h)| (k, levels_of(h, depth)))
        .filter(|(_, h)| h.size(topology) > 1)
        .collect();
    let format = match cfg.quantize_grads() {
        GradQuant::Off => None,
        GradQuant::Int8 => Some(QuantFormat::Int8),
        GradQuant::Int4 => Some(QuantFormat::Int4),
    };
    let n = grad.dims()[0];
    let block = plan.block();
    if format.is_some() && !n.is_multiple_of(p * block.get()) {
        return Err(ShardError::Units(format!(
            "a quantized reduction of {n} elements over {p} ranks needs a multiple of {} \
             (whole blocks per rank)",
            p * block.get()
        )));
    }
    let feedback = cfg.error_feedback();
    let hop_count = path_hops.len();
    // Gradients accumulating inside the path: the first live hop beyond the accumulation span
    // starts from this micro-batch's partial sum plus the earlier ones'.
    let beyond = plan
        .accumulated_hops()
        .and_then(|i| live.iter().position(|&(k, _)| k >= i));
    let live = match beyond {
        Some(b) if inner_only => &live[..b],
        _ => &live[..],
    };
    // The whole gradient in hop order, so each hop hands member m its part m.
    let path_for_order = path.clone();
    let hop_ordered = move |grad: Tensor<1>| -> Tensor<1> {
        let chunk = n / p;
        let mut at_position = vec![0; p];
        for r in 0..p {
            at_position[path_for_order.chunk_position(topology, r)] = r;
        }
        if at_position.iter().enumerate().all(|(i, &r)| i == r) {
            grad
        } else {
            Tensor::cat(
                at_position
                    .iter()
                    .map(|&r| grad.clone().slice(r * chunk..(r + 1) * chunk))
                    .collect(),
                0,
            )
        }
    };
    let across = Levels {
        lo: cfg.optimizer().0,
        hi: depth,
    };
    let g_across = across.size(topology);
    let mut grad = Some(grad);
    for (i, &(k, hop)) in live.iter().enumerate() {
        let first = (i == 0).then(|| grad.take().expect("one first stage"));
        let hop_ordered = hop_ordered.clone();
        let path = path.clone();
        // The path's last hop, whose shard goes up to the device as it is (nothing across,
        // nothing kept for a later micro-batch), reduces into memory staged for the device.
        let last = i + 1 == live.len() && g_across == 1 && !(inner_only && beyond.is_some());
        let stage: StageFn<'e> = match format {
            None => Box::new(move |c: &Comm, carry: Carry| {
                let layout = ShardLayout::new(n, p, 1);
                let g = c.try_group(scope(c, hop))?;
                let to = last.then_some(device);
                match (first, carry) {
                    (Some(t), _) if bf16 => {
                        let values = staging::read_bf16(t)?;
                        let buf = in_hop_order(topology, &path, &values, layout);
                        reduce_scatter_to(&g, &buf, to, Carry::Bf16)
                    }
                    (Some(t), _) => {
                        let values = staging::read_f32(t)?;
                        let buf = in_hop_order(topology, &path, &values, layout);
                        reduce_scatter_to(&g, &buf, to, Carry::F32)
                    }
                    (None, Carry::F32(v)) => reduce_scatter_to(&g, &v, to, Carry::F32),
                    (None, Carry::Bf16(v)) => reduce_scatter_to(&g, &v, to, Carry::Bf16),
                    _ => unreachable!("an unquantized reduce-scatter carries values"),
                }
            }),
            Some(format) => Box::new(move |c: &Comm, carry: Carry| {
                let mut buf = match (first, carry) {
                    (Some(g), _) => hop_ordered(g),
                    (None, Carry::Tensor(t)) => *t,
                    _ => unreachable!("qgZ carries a device tensor"),
                };
                let group = c.try_group(scope(c, hop))?;
                if feedback {
                    let mut all = residuals.lock().unwrap_or_else(|e| e.into_inner());
                    let r = &mut all[u].per_hop;
                    r.resize(hop_count, None);
                    if let Some(e) = &r[k] {
                        if e.dims() != buf.dims() {
                            return Err(ShardError::Units(format!(
                                "error-feedback residual of {} elements for a buffer of {}",
                                e.dims()[0],
                                buf.dims()[0]
                            )));
                        }
                        buf = buf + e.clone();
                    }
                }
                let q = if feedback {
                    let (q, back) = kernels::quantize_and_back(buf.clone(), format, block, device)?;
                    residuals.lock().unwrap_or_else(|e| e.into_inner())[u].per_hop[k] =
                        Some(buf - back);
                    q
                } else {
                    kernels::quantize(buf.clone(), format, block)?
                };
                Ok(Carry::Tensor(Box::new(exchange(
                    &group, &q, block, device,
                )?)))
            }),
        };
        let stage: StageFn<'e> = if beyond == Some(i) {
            Box::new(move |c: &Comm, carry: Carry| stage(c, add_accumulated(carry, accumulated, u)))
        } else {
            stage
        };
        stages.push((hop, stage));
    }
    if inner_only && beyond.is_some() {
        // An earlier micro-batch: its partial sum joins the step's, for the last one to carry
        // over the remaining hops.
        drop(deliver);
        return Ok(Flow {
            stages,
            finish: Box::new(move |carry| {
                let mut all = accumulated.lock().unwrap_or_else(|e| e.into_inner());
                all[u].add(carry);
                Ok(())
            }),
        });
    }
    let expect = plan.shard_len(u, cfg.optimizer());
    let name = plan.units[u].name.clone();
    // After the path: this rank's shard, averaged over the path's group.
    let shard_of = move |carry: Carry, first: Option<Tensor<1>>| -> Tensor<1> {
        match (carry, first) {
            // A group of one owns the whole unit, and its mean over one rank is itself.
            (_, Some(g)) => g,
            (c @ (Carry::F32(_) | Carry::Bf16(_) | Carry::Staged(_)), None) => {
                host_to_f32(c, device) / p as f32
            }
            (Carry::Tensor(t), None) => *t / p as f32,
            _ => unreachable!("the path's last stage carries the shard"),
        }
    };
    // The reduced shard's length, wherever it is.
    let check = move |len: usize| -> Result<(), ShardError> {
        if len != expect {
            return Err(ShardError::Units(format!(
                "unit `{name}`: reduced shard of {len} elements, expected {expect}"
            )));
        }
        Ok(())
    };
    let leftover = grad;
    if g_across > 1 {
        stages.push((
            across,
            Box::new(move |c: &Comm, carry: Carry| match (carry, leftover) {
                // Host values from the path: their mean over the path's group is taken where
                // they are, and they go on to the all-reduce without a round trip through the
                // device; the sum lands in memory staged for the device.
                (Carry::F32(v), None) => {
                    check(v.len())?;
                    let g = c.try_group(scope(c, across))?;
                    let v: Vec<f32> = v.into_iter().map(|x| x / p as f32).collect();
                    all_reduce_to(&g, &v, device)
                }
                (Carry::Bf16(v), None) => {
                    check(v.len())?;
                    let g = c.try_group(scope(c, across))?;
                    let v: Vec<Bf16> = v
                        .into_iter()
                        .map(|x| Bf16::from_f32(x.to_f32() / p as f32))
                        .collect();
                    all_reduce_to(&g, &v, device)
                }
                (carry, first) => {
                    let shard = shard_of(carry, first);
                    check(shard.dims()[0])?;
                    all_reduce_carry(c, across, shard, bf16, device)
                }
            }),
        ));
        return Ok(Flow {
            stages,
            finish: Box::new(move |carry| {
                deliver(Ok(host_to_f32(carry, device) / g_across as f32));
                Ok(())
            }),
        });
    }
    Ok(Flow {
        stages,
        finish: Box::new(move |carry| {
            let shard = shard_of(carry, leftover);
            deliver(check(shard.dims()[0]).map(|()| shard));
            Ok(())
        }),
    })
}

/// The sum over `g` of every member's `send`, scattered (this rank's part): into memory staged
/// for `to` where given (the shard goes up as it lands), else a vector (`host`).
fn reduce_scatter_to<T: ember_comm::Element + staging::Crossing>(
    g: &Group<'_>,
    send: &[T],
    to: Option<&Device>,
    host: fn(Vec<T>) -> Carry,
) -> Result<Carry, ShardError> {
    match to {
        Some(device) if send.len().is_multiple_of(g.size()) => {
            land(send.len() / g.size(), device, |out| {
                g.reduce_scatter_into(send, out, Reduce::Sum)
            })
        }
        _ => Ok(host(g.reduce_scatter(send, Reduce::Sum)?)),
    }
}

/// Every member's `shard` over `g`, in group order: into memory staged for `to` where given
/// (the unit goes up as it lands), else a vector (`host`).
fn all_gather_to<T: ember_comm::Element + staging::Crossing>(
    g: &Group<'_>,
    shard: &[T],
    to: Option<&Device>,
    host: fn(Vec<T>) -> Carry,
) -> Result<Carry, ShardError> {
    match to {
        Some(device) => land(shard.len() * g.size(), device, |out| {
            g.all_gather_into(shard, out)
        }),
        None => Ok(host(g.all_gather(shard)?)),
    }
}

/// `len` values that `fill` writes straight into memory staged for `device`, carried up to it.
fn land<T: staging::Crossing>(
    len: usize,
    device: &Device,
    fill: impl FnOnce(&mut [T]) -> Result<(), ember_comm::CommError>,
) -> Result<Carry, ShardError> {
    let mut out = Staged::new::<T>(len, device);
    fill(out.values_mut())?;
    Ok(Carry::Staged(out))
}

/// Each unit's gradient accumulated inside the gradient path over a step's earlier
/// micro-batches (f32, in the hop order of the span it accumulates at).
pub(crate) type Accumulated = std::sync::Mutex<Vec<Partial>>;

/// One unit's partial sum at the accumulation span, in f32, kept where the hops leave the
/// micro-batches' sums: on the device after quantized hops, in host memory after unquantized
/// ones (no crossing either way).
#[derive(Debug, Clone, Default)]
pub(crate) enum Partial {
    /// Nothing accumulated yet.
    #[default]
    None,
    /// On the device (boxed: the other variants are three words).
    Device(Box<Tensor<1>>),
    /// In host memory.
    Host(Vec<f32>),
}

impl Partial {
    /// Adds a micro-batch's sum (`carry`, as a hop left it) into this one.
    fn add(&mut self, carry: Carry) {
        *self = match (std::mem::take(self), carry) {
            (Partial::None, Carry::Tensor(t)) => Partial::Device(t),
            (Partial::Device(a), Carry::Tensor(t)) => Partial::Device(Box::new(*a + *t)),
            (Partial::None, c) => Partial::Host(host_f32(c)),
            (Partial::Host(mut a), c) => {
                let c = host_f32(c);
                assert_eq!(a.len(), c.len(), "partial sums of one unit");
                for (a, x) in a.iter_mut().zip(c) {
                    *a += x;
                }
                Partial::Host(a)
            }
            (Partial::Device(_), _) => unreachable!("a unit's hops leave its sums in one place"),
        };
    }
}

/// Host values as f32 (bf16 widened exactly).
fn host_f32(carry: Carry) -> Vec<f32> {
    match carry {
        Carry::F32(v) => v,
        Carry::Bf16(v) => v.into_iter().map(Bf16::to_f32).collect(),
        _ => unreachable!("host values"),
    }
}

/// `carry` (a partial sum at the accumulation span) plus unit `u`'s accumulated gradient,
/// taken, in the carry's own form, where both are; unchanged when nothing accumulated (one
/// micro-batch).
fn add_accumulated(carry: Carry, accumulated: &Accumulated, u: usize) -> Carry {
    let acc = std::mem::take(&mut accumulated.lock().unwrap_or_else(|e| e.into_inner())[u]);
    match (carry, acc) {
        (carry, Partial::None) => carry,
        (Carry::Tensor(t), Partial::Device(acc)) => Carry::Tensor(Box::new(*t + *acc)),
        (Carry::F32(mut v), Partial::Host(acc)) => {
            assert_eq!(v.len(), acc.len(), "partial sums of one unit");
            for (x, a) in v.iter_mut().zip(acc) {
                *x += a;
            }
            Carry::F32(v)
        }
        // In f32, rounded back to bf16 (ties to even), as the device would.
        (Carry::Bf16(mut v), Partial::Host(acc)) => {
            assert_eq!(v.len(), acc.len(), "partial sums of one unit");
            for (x, a) in v.iter_mut().zip(acc) {
                *x = Bf16::from_f32(x.to_f32() + a);
            }
            Carry::Bf16(v)
        }
        _ => unreachable!("a unit's hops leave its sums in one place"),
    }
}

/// The sum of `t` over the group of `levels`, in bf16 when `bf16`, else in f32.
fn all_reduce_carry(
    c: &Comm,
    levels: Levels,
    t: Tensor<1>,
    bf16: bool,
    device: &Device,
) -> Result<Carry, ShardError> {
    let g = c.try_group(scope(c, levels))?;
    if bf16 {
        all_reduce_to(&g, &staging::read_bf16(t)?, device)
    } else {
        all_reduce_to(&g, &staging::read_f32(t)?, device)
    }
}

/// The sum over `g` of every member's `send`, into memory staged for `device`: the sum goes up
/// as it lands.
fn all_reduce_to<T: ember_comm::Element + staging::Crossing>(
    g: &Group<'_>,
    send: &[T],
    device: &Device,
) -> Result<Carry, ShardError> {
    land(send.len(), device, |out| {
        g.all_reduce_into(send, out, Reduce::Sum)
    })
}

/// Host values reduced in f32 or bf16, as an f32 tensor on `device`.
fn host_to_f32(carry: Carry, device: &Device) -> Tensor<1> {
    match carry {
        Carry::F32(v) => staging::from_f32(v, device),
        Carry::Bf16(v) => staging::from_bf16(&v, device).cast(DType::F32),
        Carry::Staged(s) => crate::transport::host::cast(s.upload(), DType::F32),
        _ => unreachable!("a reduction carries host values"),
    }
}

/// One qgZ hop: all-to-all the group's parts of `q`, dequantize and sum what arrives.
fn exchange(
    group: &Group,
    q: &Quantized,
    block: BlockSize,
    device: &Device,
) -> Result<Tensor<1>, ShardError> {
    let parts = ember_comm::quantized::all_to_all_parts(group, q, block)?;
    Ok(kernels::dequantize_sum(&parts, device))
}

/// Every rank learns whether every rank's `result` is `Ok`; a failure on any rank fails all
/// of them, each naming the first failing rank and its message.
pub(crate) fn agree<T>(comm: &Comm, result: Result<T, ShardError>) -> Result<T, ShardError> {
    comm.agreed(result, |failure| ShardError::OtherRank {
        rank: failure.rank,
        message: failure.message,
    })
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
    gather_plain_path(comm, shard, &path_of(plan)?, device)
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

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;

    /// A detached slice of a large tensor on wgpu lets the large tensor's memory go.
    #[test]
    fn a_detached_slice_keeps_nothing_of_the_unit() {
        let device = Device::wgpu(burn::tensor::DeviceKind::DefaultDevice);
        let in_use = || {
            device.sync().unwrap();
            crate::transport::memory::device_bytes_in_use(&device).unwrap()
        };
        let n = 4 << 20;
        let unit = staging::from_f32((0..n).map(|i| i as f32).collect(), &device);
        let before = in_use();
        let slice = detached(unit.clone().slice(1000..2000));
        drop(unit);
        let after = in_use();
        assert!(
            after + (n as u64 * 4) / 2 < before,
            "{before} B in use with the unit, {after} B after it went"
        );
        let want: Vec<f32> = (1000..2000).map(|i| i as f32).collect();
        assert_eq!(staging::to_f32(slice).unwrap(), want);
    }
}
