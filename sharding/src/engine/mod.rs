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
//! Construction and the model's state live here; the step is `step.rs` (`backward`,
//! `apply`), what a rank holds of the shards (checkpoint ranges, the gathered module) is
//! `shards.rs`.
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
//! Gathers and reductions run on communication threads (`transport/worker.rs`): one per group
//! a unit's data crosses, on each of two lanes of communicators (gathers and reductions), each
//! running its stages in schedule order; the step's closing collectives (gradient norm, loss,
//! the parameter all-gather of `zero1` / `zero2`) run on the caller once it has finished.

mod shards;
mod step;

use std::collections::HashMap;

use burn::tensor::{DType, Device, Tensor};
use ember_comm::{Comm, Counters};

use crate::checkpoint::Checkpoint;
use crate::config::ShardConfig;
use crate::error::ShardError;
use crate::optim::{AdamW, FlatState, matrix_ranges};
use crate::params::{load, param_shapes};
use crate::plan::Plan;
use crate::source::ParamSource;
use crate::stage::{Staged, assign};
use crate::transport::memory::Resident;
use crate::transport::route::{self, Residuals, agree};
use crate::transport::staging;

pub(crate) use shards::OwnedPiece;
pub use step::{Gradients, rounding_tolerance};

/// The hyper-parameters of one [`ShardedModel::train_step`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepHyper<O = AdamW> {
    /// Learning rate of this step.
    pub lr: f64,
    /// Global gradient-norm clipping threshold (0 = off).
    pub grad_clip: f64,
    /// The optimizer and its settings.
    pub optimizer: O,
}

/// Reads elements of an optimizer state (`exp_avg`, ...) of a parameter from a checkpoint.
type MomentReader<'a> =
    dyn FnMut(&str, &str, std::ops::Range<usize>) -> Result<Vec<f32>, ShardError> + 'a;

/// Reads an element range of one parameter.
type SliceReader<'a> =
    dyn FnMut(&crate::plan::ParamSlot, std::ops::Range<usize>) -> Result<Vec<f32>, ShardError> + 'a;

/// How a step's loss, and the loss its gradients are of, is formed from the losses the
/// micro-batches give on every rank (the loss piece's value, with the auxiliary losses added).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StepLoss {
    /// Each micro-batch's loss is a mean over its own rows or tokens, and the step's loss is
    /// the mean of those over the micro-batches and the ranks (DDP's and FSDP's averaging).
    /// That is the mean over the global batch only when every micro-batch weighs the same: a
    /// loss averaged over each micro-batch's own valid tokens (sequences with padding) changes
    /// with the world size and the number of micro-batches.
    #[default]
    Mean,
    /// Each micro-batch's loss is its share of the step's: its sum over its own tokens (or
    /// rows) divided by the count of tokens in the whole global batch, which every rank can
    /// count (every rank holds the global batch it passes to
    /// [`ShardedModel::share`]). The step's loss is the sum of the shares over the
    /// micro-batches and the ranks, so it is the mean over the global batch's tokens at any
    /// world size and any number of micro-batches, as one process computing the whole batch
    /// finds it. Auxiliary losses are summed the same way: give each its share.
    Sum,
}

/// The seed the partitioner gives the device's generator right before a unit's forward runs:
/// unit `unit` of micro-batch `micro_batch` of step `step` (counting from 0, as
/// [`ShardedModel::step`] does) of a model seeded `seed`.
///
/// `micro_batch` counts the global batch's micro-batches: a rank `r` passing `A` micro-batches
/// to [`ShardedModel::backward`] runs micro-batches `r * A .. (r + 1) * A`, so `N` ranks of `A`
/// micro-batches draw what one process of `N * A` micro-batches of the same rows draws
/// ([`ShardedModel::micro_batches`] cuts them). Backward's recompute of a unit seeds the
/// generator again with the same value, so it draws what the unit's forward drew: dropout
/// from the device's generator (Burn's `Dropout`, `Tensor::random`) is replayed exactly, as
/// PyTorch's activation checkpointing replays its saved generator state. A model trained in
/// plain Burn draws the same masks by seeding its device with this value before each unit's
/// part of its forward.
pub fn draw_seed(seed: u64, step: u64, micro_batch: u64, unit: usize) -> u64 {
    let mix = |z: u64| {
        let z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    mix(mix(mix(mix(seed) ^ step) ^ micro_batch) ^ unit as u64)
}

/// What a step did, as this rank saw it.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// The step's loss over the global batch (the same on every rank): per [`StepLoss`], the
    /// mean of the micro-batches' losses over the micro-batches and the ranks, or their sum.
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
    /// Bytes the device's memory pools hold from the driver after the step, in use or kept
    /// for reuse (CubeCL devices); `None` elsewhere.
    pub device_reserved_bytes: Option<u64>,
    /// Bytes of the secondary copies held during the step.
    pub secondary_bytes: u64,
    /// The step's crossings between device and host memory: the bytes collectives send and
    /// receive, staged for MPI, and the quantized bytes the device kernels produce and take.
    pub staging: crate::Staging,
    /// What ran when on this rank, seconds into the step: the training thread's visits and
    /// every stage of a gather or reduction (the plan's replay names them alike).
    pub timeline: Vec<crate::plan::simulate::Interval>,
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
    updates: u64,
    residuals: Vec<Residuals>,
    restored_residuals: bool,
    /// Whether a step has compared each recomputed unit's output with its forward's (the
    /// first backward of this model does, see [`step`]'s `check_recompute`).
    recompute_checked: bool,
    /// The application's record a save keeps when its options carry none
    /// ([`Shard::record`](crate::Shard::record)).
    record: serde_json::Map<String, serde_json::Value>,
    /// The seed of the device's generator before each unit's forward ([`draw_seed`]).
    seed: u64,
    /// How the step's loss is formed from its micro-batches'.
    step_loss: StepLoss,
    /// The device stream of each communication thread, the same every step.
    comm_streams: crate::transport::worker::CommStreams,
}

/// What a [`ShardedModel`] is laid out by: a configuration, which it plans from the module's
/// units, or a plan made beforehand (with the activation and FLOP estimates a launcher checks
/// memory and predicts time with), which it checks against the module's units and keeps, so a
/// run plans once.
#[derive(Debug, Clone)]
pub enum Layout {
    /// Plan the module's units per this configuration.
    Config(ShardConfig),
    /// Use this plan of the module's units.
    Plan(Box<Plan>),
}

impl From<ShardConfig> for Layout {
    fn from(config: ShardConfig) -> Self {
        Layout::Config(config)
    }
}

impl From<Plan> for Layout {
    fn from(plan: Plan) -> Self {
        Layout::Plan(Box::new(plan))
    }
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

impl<'c, S: Staged<D>, const D: usize> ShardedModel<'c, S, D> {
    /// Partitions `module` per `layout` (a [`ShardConfig`] or a [`Plan`]) over `comm`'s topology, computing on `device`. The
    /// module is only a skeleton: its parameters' values are never read (lazy ones stay
    /// uninitialised). Each rank reads the elements of its own optimizer shard from `source`;
    /// optimizer moments start at zero. Every rank must call it; a source error on any rank
    /// fails every rank.
    pub fn new(
        comm: &'c Comm,
        stages: S,
        module: S::Module,
        layout: impl Into<Layout>,
        device: Device,
        source: &mut dyn ParamSource,
    ) -> Result<Self, ShardError> {
        Self::build(comm, stages, module, layout.into(), device, source, None)
    }

    /// [`ShardedModel::new`], with the optimizer states `kinds` read by
    /// `moments(kind, name, range)`. Each unit's shard becomes tensors as soon as it is read,
    /// so the host holds one unit's staging at a time.
    fn build(
        comm: &'c Comm,
        stages: S,
        module: S::Module,
        layout: Layout,
        device: Device,
        source: &mut dyn ParamSource,
        mut moments: Option<(&[String], &mut MomentReader<'_>)>,
    ) -> Result<Self, ShardError> {
        let shapes_in_order = param_shapes(&module);
        let units = assign(&shapes_in_order, &stages.units(&module))?;
        let plan = match layout {
            Layout::Config(config) => Plan::new(units, config, comm.topology().clone())?,
            Layout::Plan(plan) => plan.checked_against(&units, comm.topology())?,
        };
        route::check_same_everywhere(comm, &plan, source.fingerprint())?;
        let rank = comm.rank();
        let optimizer = (|| -> Result<Vec<UnitShard>, ShardError> {
            let mut out = Vec::with_capacity(plan.units.len());
            for (u, unit) in plan.units.iter().enumerate() {
                let range = plan.shard_range(u, plan.config.optimizer(), rank);
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
            updates: 0,
            restored_residuals: false,
            comm_streams: Default::default(),
            recompute_checked: false,
            record: serde_json::Map::new(),
            seed: source.fingerprint(),
            step_loss: StepLoss::Mean,
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
        self.updates
    }

    /// The seed of the device's generator before each unit's forward ([`draw_seed`]): the
    /// parameter source's ([`ParamSource::fingerprint`]; an [`InitSource`](crate::InitSource)'s
    /// seed) for a new model, the saved model's for a resumed one.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// How the step's loss is formed from its micro-batches' ([`StepLoss::Mean`] unless set).
    pub fn step_loss(&self) -> StepLoss {
        self.step_loss
    }

    /// The same model, forming each step's loss from its micro-batches' per `step_loss`.
    pub fn with_step_loss(mut self, step_loss: StepLoss) -> Self {
        self.step_loss = step_loss;
        self
    }

    /// The same model, keeping `record` in every save whose options carry none.
    pub(crate) fn with_record(
        mut self,
        record: serde_json::Map<String, serde_json::Value>,
    ) -> Self {
        self.record = record;
        self
    }

    /// `options`, with the build's record when they carry none.
    fn with_own_record<'o>(
        &self,
        options: &'o crate::SaveOptions,
    ) -> std::borrow::Cow<'o, crate::SaveOptions> {
        if options.app.is_empty() && !self.record.is_empty() {
            std::borrow::Cow::Owned(crate::SaveOptions {
                app: self.record.clone(),
                ..options.clone()
            })
        } else {
            std::borrow::Cow::Borrowed(options)
        }
    }

    /// Saves a checkpoint of this model at [`step`](Self::step) into `dir/step-NNNNNN`
    /// ([`checkpoint::save`](crate::checkpoint::save)), with `options`' record of the
    /// caller's own (or the one the build was given, [`Shard::record`](crate::Shard::record));
    /// returns its directory. Every rank must call it.
    pub fn save(
        &self,
        dir: &std::path::Path,
        options: &crate::SaveOptions,
    ) -> Result<std::path::PathBuf, ShardError> {
        crate::checkpoint::save(self, dir, self.updates, &self.with_own_record(options))
    }

    /// [`save`](Self::save), written in the background
    /// ([`checkpoint::save_async`](crate::checkpoint::save_async)): returns once this rank's
    /// state is copied to host memory. Every rank must call it, and later
    /// [`PendingSave::wait`](crate::PendingSave::wait) together.
    pub fn save_async(
        &self,
        dir: &std::path::Path,
        options: &crate::SaveOptions,
    ) -> Result<crate::PendingSave, ShardError> {
        crate::checkpoint::save_async(self, dir, self.updates, &self.with_own_record(options))
    }

    /// The names of the optimizer state this model holds besides its master weights, in the
    /// order of [`FlatState::slots`] (empty before the first update of a fresh model).
    pub fn state_names(&self) -> &[String] {
        &self.state_names
    }

    /// Whether [`ShardedModel::resume`] restored error-feedback residuals (they are kept only
    /// when the checkpoint was written by the same layout; elsewhere they start at zero).
    pub fn restored_residuals(&self) -> bool {
        self.restored_residuals
    }

    /// A model partitioned per `layout` (a [`ShardConfig`] or a [`Plan`]) over `comm`'s
    /// topology, resumed from `checkpoint` (of
    /// any partition): each rank reads only its own ranges of the master weights and
    /// moments, and, when the checkpoint was written by the same layout, its error-feedback
    /// residuals. Refuses a checkpoint of another model, naming the first tensor that differs.
    /// Every rank must call it.
    pub fn resume(
        comm: &'c Comm,
        stages: S,
        module: S::Module,
        layout: impl Into<Layout>,
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
            layout.into(),
            device,
            &mut source,
            Some((&kinds, &mut |kind, name, range| {
                index.read(kind, name, range)
            })),
        )?;
        model.updates = index.updates;
        if let Some(seed) = manifest.generator_seed {
            model.seed = seed;
        }
        if model.plan.config.error_feedback() {
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

    /// The dtype parameters are held, gathered and reduced in.
    fn dtype(&self) -> DType {
        self.plan.config.compute.dtype()
    }

    /// The dtype modules compute in ([`Plan::computing_in`]).
    fn module_dtype(&self) -> DType {
        self.plan.module_dtype.dtype()
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
        let own = crate::transport::host::cast(master, dtype);
        if cfg.params() == cfg.optimizer() {
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

/// The sum of `x` over every rank (for metrics such as a validation loss).
pub fn all_ranks_sum(comm: &Comm, x: f32) -> Result<f32, ShardError> {
    let depth = comm.topology().depth();
    route::sum_over(comm, crate::plan::Levels { lo: 0, hi: depth }, x)
}
