//! The sharded model at run time: one rank's partitions of parameters, gradients and optimizer
//! state, all tensors on the run's device, and the training step, which executes the plan's
//! schedule (`schedule.rs`) event by event.
//!
//! # Construction
//!
//! The caller hands over the module's skeleton, whose parameters may be lazy (Burn's
//! `Param::uninitialized`) and are never read, and a [`ParamSource`]. Each rank asks the
//! source only for the elements of its own optimizer shard, so no rank ever holds a parameter
//! range it does not own; the skeleton's parameters are replaced by empty tensors.
//!
//! # One optimizer step
//!
//! For each micro-batch, the units run in [`Plan::visits`] order. A forward visit gathers the
//! unit's parameters (and those of the units it `uses`), runs its forward without autodiff,
//! keeps its input and releases the parameters. A backward visit gathers them again, rebuilds
//! the input as an autodiff leaf, recomputes the forward with autodiff and backpropagates the
//! gradient received from the visit after it (`sum(output * upstream)`), which yields the
//! unit's parameter gradients and the gradient of its input for the visit before. Once a
//! unit's gradient is complete (after the lowest stage that reads it) it goes to the reducer.
//!
//! A unit's computation must be a pure function of its parameters, its input and the batch:
//! a backward visit recomputes the forward, so randomness such as dropout must be keyed by the
//! batch (the GPT keys its masks by step and sample), never drawn from a device RNG.
//!
//! With replicated parameters (`ddp`, `zero1`, `zero2`) nothing is released, so each
//! micro-batch instead runs every unit in one autodiff graph and one backward, without
//! recompute; gradients are reduced after each backward (zero2) or once after the last
//! micro-batch (ddp, zero1).
//!
//! This is activation checkpointing at unit boundaries: only one activation per unit boundary
//! is kept per micro-batch, and every stage but the last computes its forward twice, so a step
//! costs about 8N FLOPs per token instead of 6N (4/3 of the arithmetic). Burn's autodiff builds
//! a graph over the tensors the module holds when the loss is computed; keeping all units'
//! graphs alive until one backward would keep every gathered parameter alive too, which is
//! exactly what ZeRO-3 must avoid, hence one graph per unit.
//!
//! Gathers and reductions run on two communication threads (`worker.rs`), each in schedule
//! order on its own lane of communicators; the step's closing collectives (gradient norm, loss, the parameter all-gather of `zero1` /
//! `zero2`) run on the caller once it has finished.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use burn::tensor::{DType, Device, Tensor};
use ember_comm::{Comm, Counters};

use crate::checkpoint::Checkpoint;
use crate::config::{Compute, ShardConfig, Span};
use crate::error::ShardError;
use crate::memory::{self, Resident};
use crate::optim::{AdamW, FlatState, Optimizer, matrix_ranges};
use crate::params::{grads_of, load, param_shapes};
use crate::plan::{Plan, Visit};
use crate::route::{self, Residuals};
use crate::schedule::{Event, Source};
use crate::source::ParamSource;
use crate::stage::{Flow, Staged, assign};
use crate::staging;
use crate::worker::{GATHER_LANE, Job, REDUCE_LANE, Shared, Worker, add_to};

/// The hyper-parameters of one [`ShardedModel::train_step`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepHyper {
    /// Learning rate of this step.
    pub lr: f64,
    /// Global gradient-norm clipping threshold (0 = off).
    pub grad_clip: f64,
    /// AdamW settings.
    pub adam: AdamW,
}

/// Reads elements of an optimizer state (`exp_avg`, ...) of a parameter from a checkpoint.
type MomentReader<'a> =
    dyn FnMut(&str, &str, std::ops::Range<usize>) -> Result<Vec<f32>, ShardError> + 'a;

/// Reads an element range of one parameter.
type SliceReader<'a> =
    dyn FnMut(&crate::plan::ParamSlot, std::ops::Range<usize>) -> Result<Vec<f32>, ShardError> + 'a;

/// One parameter range of this rank's optimizer shard (what it writes to a checkpoint).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OwnedPiece {
    /// The parameter's path.
    pub name: String,
    /// First element of the range, in the flattened parameter.
    pub offset: usize,
    /// Elements in the range.
    pub len: usize,
    /// Elements of the whole parameter.
    pub global_numel: usize,
    unit: usize,
    /// The range within the unit's optimizer shard.
    local: std::ops::Range<usize>,
}

/// What a step did, as this rank saw it.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// Mean loss over the global batch (the same on every rank).
    pub loss: f64,
    /// Global gradient norm before clipping (the same on every rank).
    pub grad_norm: f64,
    /// Seconds the training thread spent blocked on communication.
    pub comm_wait_s: f64,
    /// Seconds the whole step took.
    pub step_s: f64,
    /// Bytes handed to MPI during the step, per group and op.
    pub traffic: Counters,
    /// This process's resident memory as the OS reports it at the end of the step (its peak
    /// covers the whole run so far).
    pub resident: Resident,
    /// Bytes in use on the device's own memory at the end of the step, where the backend
    /// reports them (CubeCL devices); `None` where the device's memory is host memory.
    pub device_bytes: Option<u64>,
    /// Bytes of the secondary copies held during the step.
    pub secondary_bytes: u64,
    /// What ran when on this rank, seconds into the step: the training thread's visits and
    /// every stage of a gather or reduction (the plan's replay names them alike).
    pub timeline: Vec<crate::simulate::Span>,
}

/// One step's gradients, reduced over the ranks and averaged over micro-batches: this rank's
/// shard of each unit (the elements of its optimizer shard), from [`ShardedModel::backward`].
/// Read them, clip or scale them, then hand them to [`ShardedModel::apply`].
#[derive(Debug)]
pub struct Gradients {
    /// Each unit's gradient shard, `[shard]` f32.
    units: Vec<Tensor<1>>,
    /// The parameter ranges the shards hold.
    pieces: Vec<OwnedPiece>,
    loss: f64,
    /// The global norm as the gradients stand now.
    norm: f64,
    /// The global norm as the backward left it.
    norm_before: f64,
    start: Instant,
    comm_wait_s: f64,
    secondary_bytes: u64,
    timeline: Vec<crate::simulate::Span>,
}

impl Gradients {
    /// Mean loss over the global batch (the same on every rank).
    pub fn loss(&self) -> f64 {
        self.loss
    }

    /// The global L2 norm of the gradients over every parameter (the same on every rank).
    pub fn norm(&self) -> f64 {
        self.norm
    }

    /// Multiplies every gradient by `factor`.
    pub fn scale(&mut self, factor: f64) {
        self.units = std::mem::take(&mut self.units)
            .into_iter()
            .map(|g| g * factor)
            .collect();
        self.norm *= factor.abs();
    }

    /// Scales the gradients to global norm `max_norm` where their norm exceeds it (PyTorch's
    /// `clip_grad_norm_`, factor `max_norm / (norm + 1e-6)`); 0 leaves them as they are.
    /// Returns the norm before clipping.
    pub fn clip_norm(&mut self, max_norm: f64) -> f64 {
        let norm = self.norm;
        if max_norm > 0.0 && norm > max_norm {
            self.scale(max_norm / (norm + 1e-6));
        }
        norm
    }

    /// This rank's gradient ranges: `(parameter path, first element in the flattened
    /// parameter, values)`. Each element of a parameter is held by the ranks of one optimizer
    /// shard; a rank holds none of a parameter outside its shard.
    pub fn pieces(&self) -> impl Iterator<Item = (&str, usize, Tensor<1>)> + '_ {
        self.pieces.iter().map(|p| {
            let values = self.units[p.unit].clone().slice(p.local.clone());
            (p.name.as_str(), p.offset, values)
        })
    }
}

/// One rank's optimizer state for one unit: the element range of the unit's padded flat
/// buffer it owns, and AdamW's state of those elements.
#[derive(Debug, Clone)]
struct UnitShard {
    /// Element range of the unit's padded flat buffer.
    range: std::ops::Range<usize>,
    /// Master weights and moments, on the run's device.
    state: FlatState,
}

/// One rank's share of a model partitioned by a [`ShardConfig`].
pub struct ShardedModel<'c, S: Staged<D>, const D: usize> {
    comm: &'c Comm,
    stages: S,
    plan: Plan,
    shapes: HashMap<String, Vec<usize>>,
    /// Every parameter's element count by path (the gradients a backward reads).
    numels: HashMap<String, usize>,
    skeleton: S::Module,
    device: Device,
    autodiff: Device,
    /// Each unit's primary partition in the compute dtype (the master itself when
    /// [`Plan::primary_is_master`]).
    primary: Vec<Tensor<1>>,
    optimizer: Vec<UnitShard>,
    /// The names of the optimizer state each shard holds (empty until the first update of a
    /// model that did not resume).
    state_names: Vec<String>,
    adam_step: u64,
    residuals: Vec<Residuals>,
    restored_residuals: bool,
}

impl<S: Staged<D>, const D: usize> std::fmt::Debug for ShardedModel<'_, S, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedModel")
            .field("config", &self.plan.config)
            .field("units", &self.plan.units.len())
            .field("rank", &self.comm.rank())
            .finish_non_exhaustive()
    }
}

/// A stage's forward with autodiff: the module holding its gathered parameters, its input as
/// an autodiff leaf (none for the first stage) and its output.
struct Graph<M, const D: usize> {
    module: M,
    input: Option<Tensor<D>>,
    out: Flow<D>,
}

/// The state of one step on the training thread.
struct StepState<M, const D: usize> {
    /// Reduced gradient shards, per unit (summed over micro-batches).
    grads: Vec<Option<Tensor<1>>>,
    /// Whole unit gradients being assembled, until handed to the reducer.
    work: Vec<Option<Tensor<1>>>,
    /// Each stage's saved input, from its forward visit to its backward.
    inputs: Vec<Option<Tensor<D>>>,
    /// The gradient of the last backward visit's input.
    upstream: Option<Tensor<D>>,
    /// Each stage's forward graph, kept for its backward without recompute.
    graphs: Vec<Option<Graph<M, D>>>,
    /// Each micro-batch's mean loss.
    micro_losses: Vec<f64>,
    /// Parameters that received a gradient.
    reached: HashSet<String>,
}

impl<'c, S: Staged<D>, const D: usize> ShardedModel<'c, S, D> {
    /// Partitions `module` per `config` over `comm`'s topology, computing on `device`. The
    /// module is only a skeleton: its parameters' values are never read (lazy ones stay
    /// uninitialised). Each rank reads the elements of its own optimizer shard from `source`;
    /// optimizer moments start at zero. Every rank must call it; a source error on any rank
    /// fails every rank.
    pub fn new(
        comm: &'c Comm,
        stages: S,
        module: S::Module,
        config: ShardConfig,
        device: Device,
        source: &mut dyn ParamSource,
    ) -> Result<Self, ShardError> {
        Self::build(comm, stages, module, config, device, source, None)
    }

    /// [`ShardedModel::new`], with the optimizer states `kinds` read by
    /// `moments(kind, name, range)`. Each unit's shard becomes tensors as soon as it is read,
    /// so the host holds one unit's staging at a time.
    fn build(
        comm: &'c Comm,
        stages: S,
        module: S::Module,
        config: ShardConfig,
        device: Device,
        source: &mut dyn ParamSource,
        mut moments: Option<(&[String], &mut MomentReader<'_>)>,
    ) -> Result<Self, ShardError> {
        let shapes_in_order = param_shapes(&module);
        let units = assign(&shapes_in_order, &stages.units(&module))?;
        let plan = Plan::new(units, config, comm.topology().clone())?;
        route::check_same_everywhere(comm, &plan, source.fingerprint())?;
        let rank = comm.rank();
        let optimizer = (|| -> Result<Vec<UnitShard>, ShardError> {
            let mut out = Vec::with_capacity(plan.units.len());
            for (u, unit) in plan.units.iter().enumerate() {
                let range = plan.shard_range(u, plan.config.optimizer, rank);
                // Elements of `range` from per-parameter reads; padding stays zero.
                let shard = |read: &mut SliceReader<'_>| -> Result<Tensor<1>, ShardError> {
                    let mut values = vec![0.0f32; range.len()];
                    for (p, local) in pieces(unit, &range) {
                        let start = local.start + range.start - p.offset;
                        let got = read(p, start..start + local.len())?;
                        if got.len() != local.len() {
                            return Err(ShardError::Source(format!(
                                "{}: {} values read for elements [{start}, {})",
                                p.name,
                                got.len(),
                                start + local.len()
                            )));
                        }
                        values[local].copy_from_slice(&got);
                    }
                    Ok(staging::from_f32(values, &device))
                };
                let master = shard(&mut |p, r| source.read(&p.name, &p.shape, r))?;
                let slots: Vec<(usize, usize, bool)> = unit
                    .params
                    .iter()
                    .map(|p| (p.offset, p.numel, p.decay))
                    .collect();
                let matrices = matrix_ranges(&range, &slots);
                let state = match moments.as_mut() {
                    None => FlatState::new(master, 0, matrices),
                    Some((kinds, read)) => FlatState {
                        master,
                        slots: kinds
                            .iter()
                            .map(|kind| shard(&mut |p, r| read(kind, &p.name, r)))
                            .collect::<Result<_, _>>()?,
                        matrices,
                    },
                };
                out.push(UnitShard { range, state });
            }
            Ok(out)
        })();
        let optimizer = agree(comm, optimizer)?;
        let shapes: HashMap<String, Vec<usize>> = shapes_in_order.iter().cloned().collect();
        let skeleton = load(module, &mut HashMap::new(), &shapes, &device, false);
        let autodiff = device.clone().autodiff();
        let mut model = Self {
            comm,
            stages,
            numels: shapes_in_order
                .iter()
                .map(|(n, s)| (n.clone(), s.iter().product()))
                .collect(),
            shapes,
            residuals: vec![Residuals::default(); plan.units.len()],
            plan,
            skeleton,
            device,
            autodiff,
            primary: Vec::new(),
            optimizer,
            state_names: moments.map_or_else(Vec::new, |(kinds, _)| kinds.to_vec()),
            adam_step: 0,
            restored_residuals: false,
        };
        model.refresh_primary()?;
        Ok(model)
    }

    /// The partition plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The communicator.
    pub fn comm(&self) -> &'c Comm {
        self.comm
    }

    /// The device the state lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Optimizer updates applied so far (from the checkpoint's count after a resume): the
    /// number of the step to run next, counting from 0.
    pub fn step(&self) -> u64 {
        self.adam_step
    }

    /// Saves a checkpoint of this model at [`step`](Self::step) into `dir/step-NNNNNN`
    /// ([`checkpoint::save`](crate::checkpoint::save)), with `options`' record of the
    /// caller's own; returns its directory. Every rank must call it.
    pub fn save(
        &self,
        dir: &std::path::Path,
        options: &crate::SaveOptions,
    ) -> Result<std::path::PathBuf, ShardError> {
        crate::checkpoint::save(self, dir, self.adam_step, options)
    }

    /// Whether this rank writes its optimizer shard to a checkpoint: the first of the ranks
    /// holding the same shard (all ranks when the optimizer state spans the world; rank 0
    /// alone when it is replicated).
    pub(crate) fn is_writer(&self) -> bool {
        let o = self.plan.config.optimizer.0;
        self.plan.topology.coords(self.comm.rank())[o..]
            .iter()
            .all(|&c| c == 0)
    }

    /// The parameter ranges this rank's optimizer shard holds, unit by unit (padding is
    /// never part of one; a rank whose shard is all padding holds none): what it writes to a
    /// checkpoint.
    pub(crate) fn owned_pieces(&self) -> Vec<OwnedPiece> {
        let mut out = Vec::new();
        for (u, (unit, shard)) in self.plan.units.iter().zip(&self.optimizer).enumerate() {
            for (p, local) in pieces(unit, &shard.range) {
                out.push(OwnedPiece {
                    name: p.name.clone(),
                    offset: local.start + shard.range.start - p.offset,
                    len: local.len(),
                    global_numel: p.numel,
                    unit: u,
                    local,
                });
            }
        }
        out
    }

    /// The names of the optimizer state this model holds besides its master weights, in the
    /// order of [`FlatState::slots`] (empty before the first update of a fresh model).
    pub fn state_names(&self) -> &[String] {
        &self.state_names
    }

    /// The master weights, then each optimizer state, of one owned range, copied to the host.
    pub(crate) fn read_piece(&self, piece: &OwnedPiece) -> Vec<Vec<f32>> {
        let s = &self.optimizer[piece.unit].state;
        let part = |t: &Tensor<1>| staging::to_f32(t.clone().slice(piece.local.clone()));
        std::iter::once(&s.master)
            .chain(&s.slots)
            .map(part)
            .collect()
    }

    /// This rank's error-feedback residuals as `(unit, hop, values)`; empty without error
    /// feedback or before the first step.
    pub(crate) fn residual_tensors(&self) -> Vec<(usize, usize, Tensor<1>)> {
        self.residuals
            .iter()
            .enumerate()
            .flat_map(|(u, r)| {
                r.per_hop
                    .iter()
                    .enumerate()
                    .filter_map(move |(h, t)| t.clone().map(|t| (u, h, t)))
            })
            .collect()
    }

    /// The layout this rank's residuals belong to (JSON): they are only meaningful to the
    /// same rank of the same topology, gradient path, format and unit sizes.
    pub(crate) fn residual_layout(&self) -> String {
        let cfg = &self.plan.config;
        serde_json::json!({
            "rank": self.comm.rank(),
            "topology": self.plan.topology.to_string(),
            "grad_hops": cfg.grad_hops,
            "quantize_grads": cfg.quantize_grads,
            "quant_block": cfg.quant_block,
            "padded": self.plan.units.iter().map(|u| u.padded).collect::<Vec<_>>(),
        })
        .to_string()
    }

    /// Whether [`ShardedModel::resume`] restored error-feedback residuals (they are kept only
    /// when the checkpoint was written by the same layout; elsewhere they start at zero).
    pub fn restored_residuals(&self) -> bool {
        self.restored_residuals
    }

    /// A model partitioned per `config` over `comm`'s topology, resumed from `checkpoint` (of
    /// any partition): each rank reads only its own ranges of the master weights and
    /// moments, and, when the checkpoint was written by the same layout, its error-feedback
    /// residuals. Refuses a checkpoint of another model, naming the first tensor that differs.
    /// Every rank must call it.
    pub fn resume(
        comm: &'c Comm,
        stages: S,
        module: S::Module,
        config: ShardConfig,
        device: Device,
        checkpoint: &Checkpoint,
    ) -> Result<Self, ShardError> {
        let manifest = checkpoint.manifest();
        let found: HashMap<&str, &Vec<usize>> = manifest
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), &t.shape))
            .collect();
        let expected = param_shapes(&module);
        for (name, shape) in &expected {
            match found.get(name.as_str()) {
                Some(s) if *s == shape => {}
                Some(s) => {
                    return Err(ShardError::Source(format!(
                        "{}: tensor {name} has shape {s:?}, this model's is {shape:?}: the \
                         checkpoint is of another model configuration",
                        checkpoint.dir().display()
                    )));
                }
                None => {
                    return Err(ShardError::Source(format!(
                        "{} has no tensor {name}: the checkpoint is of another model \
                         configuration",
                        checkpoint.dir().display()
                    )));
                }
            }
        }
        if found.len() != expected.len() {
            return Err(ShardError::Source(format!(
                "{} holds {} tensors, this model has {}: the checkpoint is of another model \
                 configuration",
                checkpoint.dir().display(),
                found.len(),
                expected.len()
            )));
        }
        let mut source = checkpoint;
        let index = checkpoint.index();
        let kinds = index.state_kinds();
        let mut model = Self::build(
            comm,
            stages,
            module,
            config,
            device,
            &mut source,
            Some((&kinds, &mut |kind, name, range| {
                index.read(kind, name, range)
            })),
        )?;
        model.adam_step = index.adam_step;
        if model.plan.config.error_feedback {
            let stored = agree(comm, index.residuals(comm.rank()))?;
            if let Some((layout, values)) = stored
                && layout == model.residual_layout()
            {
                for ((u, h), v) in values {
                    let r = &mut model.residuals[u].per_hop;
                    if r.len() <= h {
                        r.resize(h + 1, None);
                    }
                    r[h] = Some(staging::from_f32(v, &model.device));
                }
                model.restored_residuals = true;
            }
        }
        Ok(model)
    }

    fn dtype(&self) -> DType {
        match self.plan.config.compute {
            Compute::F32 => DType::F32,
            Compute::Bf16 => DType::BF16,
        }
    }

    /// The skeleton with the parameters of `units` set from their gathered flat buffers
    /// (views into them: nothing is copied), on the autodiff device when `autodiff`.
    fn module_with(
        &self,
        units: &[usize],
        full: Vec<Tensor<1>>,
        autodiff: bool,
        require_grad: bool,
    ) -> S::Module {
        let mut values = HashMap::new();
        for (&u, flat) in units.iter().zip(full) {
            let flat = if autodiff { flat.autodiff() } else { flat };
            for p in &self.plan.units[u].params {
                values.insert(
                    p.name.clone(),
                    flat.clone().slice(p.offset..p.offset + p.numel),
                );
            }
        }
        let device = if autodiff {
            &self.autodiff
        } else {
            &self.device
        };
        load(
            self.skeleton.clone(),
            &mut values,
            &self.shapes,
            device,
            require_grad,
        )
    }

    /// Unit `u`'s gradient as one flat f32 buffer of its padded length, from the gradients `g`
    /// holds for its parameters (zeros for parameters this computation did not reach: a unit
    /// read by another stage gets no gradient for what that stage does not use).
    fn unit_grad(
        &self,
        u: usize,
        g: &mut HashMap<String, Tensor<1>>,
        reached: &mut HashSet<String>,
    ) -> Tensor<1> {
        let unit = &self.plan.units[u];
        let mut parts = Vec::with_capacity(unit.params.len() + 1);
        for p in &unit.params {
            match g.remove(&p.name) {
                Some(t) => {
                    reached.insert(p.name.clone());
                    parts.push(if t.dtype() == DType::F32 {
                        t
                    } else {
                        t.cast(DType::F32)
                    });
                }
                None => parts.push(Tensor::zeros([p.numel], &self.device)),
            }
        }
        if unit.padded > unit.numel {
            parts.push(Tensor::zeros([unit.padded - unit.numel], &self.device));
        }
        Tensor::cat(parts, 0)
    }

    /// Unit `u` whole, gathered from its primary partition on the calling thread.
    fn gather_here(&self, u: usize) -> Result<Tensor<1>, ShardError> {
        let no_copies = route::Secondaries::new(self.plan.units.len());
        let (tx, rx) = std::sync::mpsc::channel();
        route::gather_flow(
            &self.plan,
            self.comm.rank(),
            u,
            Source::Primary,
            &self.primary[u],
            &no_copies,
            &self.device,
            move |r| {
                let _ = tx.send(r);
            },
        )?
        .run_here(self.comm)?;
        rx.recv()
            .unwrap_or_else(|_| unreachable!("a flow run here delivers"))
    }

    /// Mean loss of `batch` on this rank (forward only; every rank must call it together when
    /// parameters are partitioned, since it gathers them).
    pub fn eval_loss(&self, batch: &S::Batch) -> Result<f64, ShardError> {
        let k = self.plan.units.len();
        let mut input: Option<Tensor<D>> = None;
        for stage in 0..k {
            let needs = self.plan.units[stage].needs.clone();
            let full = if self.plan.config.params == Span(0) {
                needs.iter().map(|&u| self.primary[u].clone()).collect()
            } else {
                needs
                    .iter()
                    .map(|&u| self.gather_here(u))
                    .collect::<Result<_, _>>()?
            };
            let module = self.module_with(&needs, full, false, false);
            match self
                .stages
                .forward(&module, stage, input.take(), batch, &self.device)
            {
                Flow::Hidden(h) if stage + 1 < k => input = Some(h),
                Flow::Loss(l) if stage + 1 == k => return Ok(scalar(l)),
                _ => return Err(flow_error(stage, k)),
            }
        }
        unreachable!("the last stage returned")
    }

    /// The whole trained module, on every rank: each unit's f32 master weights (the optimizer's
    /// copy, never quantized) all-gathered over the ranks that split them and loaded into a
    /// copy of the module's skeleton, ready for inference or export with the model's own
    /// `forward`. Every rank must call it together; each then holds the full parameters once
    /// more, on the run's device.
    pub fn gather(&self) -> Result<S::Module, ShardError> {
        Ok(self
            .gather_onto(None)?
            .expect("every rank keeps the module"))
    }

    /// The whole trained module on rank `root` alone (`None` on the others), for saving or
    /// serving from one rank: unit by unit, the f32 masters are all-gathered and only `root`
    /// keeps them, so no other rank holds more than one unit whole at a time (PyTorch's full
    /// state dict with `rank0_only`). Every rank must call it together.
    pub fn gather_to(&self, root: usize) -> Result<Option<S::Module>, ShardError> {
        let world = self.plan.topology.world_size();
        if root >= world {
            return Err(ShardError::setting(
                "root",
                root,
                format!("the job has {world} ranks: pass a rank below {world}"),
            ));
        }
        self.gather_onto(Some(root))
    }

    /// The module gathered onto every rank (`root` `None`) or onto `root` alone.
    fn gather_onto(&self, root: Option<usize>) -> Result<Option<S::Module>, ShardError> {
        let keep = root.is_none_or(|r| r == self.comm.rank());
        let span = self.plan.config.optimizer;
        let group = if span.0 == 0 {
            None
        } else {
            let scope = route::scope(self.comm, self.plan.group(span));
            Some(self.comm.try_group(scope)?)
        };
        let mut values = HashMap::new();
        for (unit, shard) in self.plan.units.iter().zip(&self.optimizer) {
            let mine = staging::to_f32(shard.state.master.clone());
            // Group index `i` holds elements `i * shard ..` of the padded unit (`Plan::shard_range`).
            let whole = match &group {
                Some(g) if g.size() > 1 => g.all_gather(&mine)?,
                _ => mine,
            };
            if !keep {
                continue;
            }
            for p in &unit.params {
                let flat = whole[p.offset..p.offset + p.numel].to_vec();
                values.insert(p.name.clone(), staging::from_f32(flat, &self.device));
            }
        }
        Ok(keep.then(|| {
            load(
                self.skeleton.clone(),
                &mut values,
                &self.shapes,
                &self.device,
                false,
            )
        }))
    }

    /// One AdamW step over `micro_batches` (this rank's share of the global batch, one per
    /// gradient-accumulation micro-step; every rank passes the same number), with the
    /// gradients clipped to `hyper.grad_clip`: [`backward`](Self::backward), then
    /// [`apply`](Self::apply).
    pub fn train_step(
        &mut self,
        micro_batches: &[S::Batch],
        hyper: &StepHyper,
    ) -> Result<StepReport, ShardError> {
        let mut grads = self.backward(micro_batches)?;
        grads.clip_norm(hyper.grad_clip);
        self.apply(grads, &hyper.adam, hyper.lr)
    }

    /// The gradients of `micro_batches` (this rank's share of the global batch, one per
    /// gradient-accumulation micro-step; every rank passes the same number): every unit's
    /// gradient reduced over the ranks and averaged over micro-batches, this rank holding the
    /// elements of its optimizer shard, with the step's loss and global norm. Every rank must
    /// call it together. Nothing is updated until [`apply`](Self::apply).
    pub fn backward(&mut self, micro_batches: &[S::Batch]) -> Result<Gradients, ShardError> {
        let start = Instant::now();
        self.comm.take_counters();
        let accum = micro_batches.len();
        if accum == 0 {
            return Err(ShardError::setting(
                "micro_batches",
                0,
                "a step needs at least one micro-batch: pass this rank's share of the global \
                 batch",
            ));
        }
        let schedule = self.plan.schedule(accum);
        let k = self.plan.units.len();
        let mut state = StepState {
            grads: vec![None; k],
            work: vec![None; k],
            inputs: vec![None; k],
            upstream: None,
            graphs: (0..k).map(|_| None).collect(),
            micro_losses: vec![0.0; accum],
            reached: HashSet::new(),
        };
        let (gather_comm, reduce_comm) =
            (self.comm.lane(GATHER_LANE)?, self.comm.lane(REDUCE_LANE)?);
        let shared = Shared::new(k, std::mem::take(&mut self.residuals), start);
        let comm_wait = std::thread::scope(|scope| {
            let mut worker = Worker::new(
                scope,
                &gather_comm,
                &reduce_comm,
                &self.plan,
                &self.primary,
                &shared,
                &self.device,
            );
            let result =
                self.run_schedule(&schedule, micro_batches, &mut state, &mut worker, &shared);
            let finished = worker.finish(&mut state.grads);
            result.and(finished)
        });
        let secondary_bytes = shared.secondaries.bytes();
        let timeline = std::mem::take(&mut *shared.spans.lock().unwrap_or_else(|e| e.into_inner()));
        self.residuals = shared
            .residuals
            .into_inner()
            .unwrap_or_else(|e| e.into_inner());
        let comm_wait = comm_wait?;
        if let Some(p) = self
            .plan
            .units
            .iter()
            .flat_map(|u| u.params.iter())
            .find(|p| !state.reached.contains(&p.name))
        {
            return Err(ShardError::Model(format!(
                "no gradient reached parameter `{}`: does a unit's forward use it?",
                p.name
            )));
        }
        let (units, loss, norm, closing_s) = self.close_gradients(state)?;
        Ok(Gradients {
            units,
            pieces: self.owned_pieces(),
            loss,
            norm,
            norm_before: norm,
            start,
            comm_wait_s: comm_wait + closing_s,
            secondary_bytes,
            timeline,
        })
    }

    /// Updates the parameters with `optimizer` at learning rate `lr` from `grads` (this
    /// model's [`backward`](Self::backward), as the caller left them): each rank updates its
    /// optimizer shard, then the parameters the units gather are rebuilt from it. Every rank
    /// must call it together, with the same optimizer. The optimizer's state starts at zero
    /// on the first update, or is the checkpoint's after [`resume`](Self::resume); a model
    /// holding another optimizer's state refuses it.
    pub fn apply(
        &mut self,
        grads: Gradients,
        optimizer: &dyn Optimizer,
        lr: f64,
    ) -> Result<StepReport, ShardError> {
        let names = optimizer.state_names();
        if grads.units.len() != self.optimizer.len() {
            return Err(ShardError::Model(format!(
                "gradients of {} units for a model of {}: pass the gradients this model's \
                 backward returned",
                grads.units.len(),
                self.optimizer.len()
            )));
        }
        if self.state_names.is_empty() && self.adam_step == 0 {
            for shard in &mut self.optimizer {
                shard.state.slots = names
                    .iter()
                    .map(|_| shard.state.master.zeros_like())
                    .collect();
            }
            self.state_names = names.iter().map(|n| n.to_string()).collect();
        }
        if self.state_names != names {
            return Err(ShardError::setting(
                "optimizer",
                format!("{names:?}"),
                format!(
                    "this model holds optimizer state {:?} (from its checkpoint or its earlier \
                     steps): continue with the optimizer that keeps it",
                    self.state_names
                ),
            ));
        }
        let cfg = &self.plan.config;
        let mut closing_s = 0.0;
        self.adam_step += 1;
        for (u, g) in grads.units.into_iter().enumerate() {
            // The primary may be the master itself: let go of it first, so the update owns
            // the buffer (on host memory it then updates in place).
            self.primary[u] = Tensor::empty([0], &self.device);
            optimizer.update(self.adam_step, lr, &mut self.optimizer[u].state, g);
            // At once, unit by unit: a primary that shares the old master would otherwise
            // keep every old master alive until the last unit is updated.
            let gather = Instant::now();
            self.primary[u] = self.primary_of(u)?;
            if cfg.params != cfg.optimizer {
                closing_s += gather.elapsed().as_secs_f64();
            }
        }
        Ok(StepReport {
            loss: grads.loss,
            grad_norm: grads.norm_before,
            comm_wait_s: grads.comm_wait_s + closing_s,
            step_s: grads.start.elapsed().as_secs_f64(),
            traffic: self.comm.take_counters(),
            resident: memory::resident(),
            device_bytes: memory::device_bytes_in_use(&self.device),
            secondary_bytes: grads.secondary_bytes,
            timeline: grads.timeline,
        })
    }

    /// Executes the step's schedule on the training thread, handing gathers and reductions to
    /// the communication threads as they come.
    fn run_schedule(
        &self,
        schedule: &[Event],
        micro_batches: &[S::Batch],
        state: &mut StepState<S::Module, D>,
        worker: &mut Worker<'_, '_>,
        shared: &Shared,
    ) -> Result<(), ShardError> {
        for &event in schedule {
            match event {
                Event::Gather { unit, source } => worker.send(Job::Gather { unit, source })?,
                Event::Visit(v) => {
                    let needs = &self.plan.units[v.stage].needs;
                    let mut full = Vec::with_capacity(needs.len());
                    // A backward visit through a kept graph has no gathers: the graph holds
                    // the parameters.
                    if !(v.backward && self.plan.keeps_graph(v.stage)) {
                        for _ in needs {
                            full.push(worker.next_gathered(&mut state.grads)?);
                        }
                    }
                    let t = Instant::now();
                    if v.backward {
                        self.backward_visit(v, full, &micro_batches[v.micro], state)?;
                    } else {
                        self.forward_visit(v, full, &micro_batches[v.micro], state)?;
                    }
                    let dir = if v.backward { 'b' } else { 'f' };
                    shared.record(format!("visit {dir}{}", v.stage), t);
                }
                Event::Whole { micro } => {
                    let t = Instant::now();
                    self.whole_micro_batch(micro, &micro_batches[micro], state)?;
                    shared.record(format!("whole {micro}"), t);
                }
                Event::Reduce { unit } => {
                    let grad = state.work[unit]
                        .take()
                        .expect("the schedule reduces a unit after its backward");
                    worker.send(Job::Reduce {
                        unit,
                        grad: Box::new(grad),
                    })?;
                }
            }
        }
        Ok(())
    }

    /// A forward visit: the stage without autodiff, keeping its output as the next stage's
    /// input.
    fn forward_visit(
        &self,
        v: Visit,
        full: Vec<Tensor<1>>,
        batch: &S::Batch,
        state: &mut StepState<S::Module, D>,
    ) -> Result<(), ShardError> {
        let k = self.plan.units.len();
        let needs = &self.plan.units[v.stage].needs;
        if self.plan.keeps_graph(v.stage) {
            // With autodiff, kept until the backward visit (the parameters with it).
            let graph = self.autodiff_forward(v, full, batch, state);
            let Flow::Hidden(h) = &graph.out else {
                return Err(flow_error(v.stage, k));
            };
            state.inputs[v.stage + 1] = Some(h.clone().without_autodiff());
            state.graphs[v.stage] = Some(graph);
            return Ok(());
        }
        let module = self.module_with(needs, full, false, false);
        let input = state.inputs[v.stage].clone();
        match self
            .stages
            .forward(&module, v.stage, input, batch, &self.device)
        {
            Flow::Hidden(h) => {
                state.inputs[v.stage + 1] = Some(h);
                Ok(())
            }
            Flow::Loss(_) => Err(flow_error(v.stage, k)),
        }
    }

    /// The stage's forward with autodiff from its saved input, on the gathered `full` units.
    fn autodiff_forward(
        &self,
        v: Visit,
        full: Vec<Tensor<1>>,
        batch: &S::Batch,
        state: &mut StepState<S::Module, D>,
    ) -> Graph<S::Module, D> {
        let module = self.module_with(&self.plan.units[v.stage].needs, full, true, true);
        let input = state.inputs[v.stage]
            .take()
            .map(|x| x.autodiff().require_grad());
        let out = self
            .stages
            .forward(&module, v.stage, input.clone(), batch, &self.autodiff);
        Graph { module, input, out }
    }

    /// A backward visit: the stage's graph (kept by its forward visit, or recomputed with
    /// autodiff from its saved input), backpropagated from the loss (last stage) or from the
    /// upstream gradient.
    fn backward_visit(
        &self,
        v: Visit,
        full: Vec<Tensor<1>>,
        batch: &S::Batch,
        state: &mut StepState<S::Module, D>,
    ) -> Result<(), ShardError> {
        let k = self.plan.units.len();
        let needs = &self.plan.units[v.stage].needs;
        let Graph { module, input, out } = match state.graphs[v.stage].take() {
            Some(kept) => kept,
            None => self.autodiff_forward(v, full, batch, state),
        };
        let grads_ad = match (out, v.stage + 1 == k) {
            (Flow::Loss(l), true) => {
                state.micro_losses[v.micro] = scalar(l.clone().without_autodiff());
                l.backward()
            }
            (Flow::Hidden(h), false) => {
                let up = state
                    .upstream
                    .take()
                    .ok_or_else(|| unused_input(v.stage + 1, k))?;
                (h * up.autodiff()).sum().backward()
            }
            _ => return Err(flow_error(v.stage, k)),
        };
        let mut g = grads_of(&module, &grads_ad, &self.numels);
        state.upstream = match input {
            Some(x) => Some(x.grad(&grads_ad).ok_or_else(|| unused_input(v.stage, k))?),
            None => None,
        };
        drop(grads_ad);
        drop(module);
        for &u in needs {
            let grad = self.unit_grad(u, &mut g, &mut state.reached);
            add_to(&mut state.work[u], grad);
        }
        Ok(())
    }

    /// One micro-batch through every unit in one autodiff graph (replicated parameters).
    fn whole_micro_batch(
        &self,
        micro: usize,
        batch: &S::Batch,
        state: &mut StepState<S::Module, D>,
    ) -> Result<(), ShardError> {
        let k = self.plan.units.len();
        let all: Vec<usize> = (0..k).collect();
        let module = self.module_with(&all, self.primary.clone(), true, true);
        let mut x: Option<Tensor<D>> = None;
        let mut loss = None;
        for stage in 0..k {
            match self
                .stages
                .forward(&module, stage, x.take(), batch, &self.autodiff)
            {
                Flow::Hidden(h) if stage + 1 < k => x = Some(h),
                Flow::Loss(l) if stage + 1 == k => loss = Some(l),
                _ => return Err(flow_error(stage, k)),
            }
        }
        let loss = loss.expect("the last stage returned the loss");
        state.micro_losses[micro] = scalar(loss.clone().without_autodiff());
        let grads_ad = loss.backward();
        let mut g = grads_of(&module, &grads_ad, &self.numels);
        drop(grads_ad);
        drop(module);
        for u in 0..k {
            let grad = self.unit_grad(u, &mut g, &mut state.reached);
            add_to(&mut state.work[u], grad);
        }
        Ok(())
    }

    /// The gradients' end on every rank: averaged over micro-batches, the global norm over
    /// the optimizer group, the step's mean loss over the world. Returns the gradient shards,
    /// the loss, the norm and the seconds its collectives took.
    fn close_gradients(
        &mut self,
        state: StepState<S::Module, D>,
    ) -> Result<(Vec<Tensor<1>>, f64, f64, f64), ShardError> {
        let accum = state.micro_losses.len();
        let inv = 1.0 / accum as f64;
        let grads: Vec<Tensor<1>> = state
            .grads
            .into_iter()
            .map(|g| g.expect("every unit's gradient was reduced"))
            .map(|g| if accum > 1 { g * inv } else { g })
            .collect();
        let sq: f64 = grads
            .iter()
            .map(|g| scalar((g.clone() * g.clone()).sum()))
            .sum();
        let cfg = &self.plan.config;
        let closing = Instant::now();
        let sq = route::sum_over(self.comm, self.plan.group(cfg.optimizer), sq as f32)? as f64;
        let local_loss = state.micro_losses.iter().sum::<f64>() * inv;
        let world = self.plan.group(Span(self.plan.topology.depth()));
        let loss = route::sum_over(self.comm, world, local_loss as f32)? as f64
            / self.plan.topology.world_size() as f64;
        let closing_s = closing.elapsed().as_secs_f64();
        let norm = sq.sqrt();
        if !loss.is_finite() || !norm.is_finite() {
            return Err(ShardError::Diverged { loss, norm });
        }
        Ok((grads, loss, norm, closing_s))
    }

    /// Builds the primary parameter partition from the f32 masters.
    fn refresh_primary(&mut self) -> Result<(), ShardError> {
        self.primary = (0..self.optimizer.len())
            .map(|u| self.primary_of(u))
            .collect::<Result<_, _>>()?;
        Ok(())
    }

    /// Unit `u`'s primary partition from its f32 master: the master itself, its cast to the
    /// compute dtype, or (replicated parameters) the all-gather of that cast.
    fn primary_of(&self, u: usize) -> Result<Tensor<1>, ShardError> {
        let dtype = self.dtype();
        let cfg = &self.plan.config;
        let master = self.optimizer[u].state.master.clone();
        let own = if dtype == DType::F32 {
            master
        } else {
            master.cast(dtype)
        };
        if cfg.params == cfg.optimizer {
            Ok(own)
        } else {
            route::all_gather_params(self.comm, &self.plan, own, &self.device)
        }
    }
}

/// The `(parameter, local range)` pieces of `range` (a shard of `unit`'s padded buffer), the
/// local range relative to `range.start`; padding is never part of a piece.
fn pieces<'u>(
    unit: &'u crate::plan::UnitPlan,
    range: &std::ops::Range<usize>,
) -> impl Iterator<Item = (&'u crate::plan::ParamSlot, std::ops::Range<usize>)> {
    let range = range.clone();
    unit.params.iter().filter_map(move |p| {
        let lo = p.offset.max(range.start);
        let hi = (p.offset + p.numel).min(range.end);
        (lo < hi).then(|| (p, lo - range.start..hi - range.start))
    })
}

/// Every rank learns whether every rank's `result` is `Ok`; a failure on any rank fails all
/// of them, each naming the first failing rank and its message.
pub(crate) fn agree<T>(comm: &Comm, result: Result<T, ShardError>) -> Result<T, ShardError> {
    let mine = result.as_ref().err().map(|e| e.to_string());
    match comm.agree(mine.as_deref()) {
        Ok(()) => result,
        Err(failure) if failure.rank == comm.rank() => result,
        Err(failure) => Err(ShardError::OtherRank {
            rank: failure.rank,
            message: failure.message,
        }),
    }
}

/// The sum of `x` over every rank (for metrics such as a validation loss).
pub fn all_ranks_sum(comm: &Comm, x: f32) -> Result<f32, ShardError> {
    let depth = comm.topology().depth();
    route::sum_over(comm, crate::plan::Levels { lo: 0, hi: depth }, x)
}

fn scalar(t: Tensor<1>) -> f64 {
    t.into_data()
        .convert::<f64>()
        .try_to_vec::<f64>()
        .map(|v| v[0])
        .unwrap_or(f64::NAN)
}

fn flow_error(stage: usize, k: usize) -> ShardError {
    ShardError::Model(format!(
        "unit {stage} of {k} returned the wrong kind of output: every unit but the last must \
         return Flow::Hidden and the last Flow::Loss"
    ))
}

/// A unit whose output does not depend on the input it was given: no gradient can reach the
/// units before it.
fn unused_input(stage: usize, k: usize) -> ShardError {
    ShardError::Model(format!(
        "unit {stage} of {k} does not use its input: its output must be computed from the \
         tensor the unit before it returned, or no gradient reaches that unit"
    ))
}
