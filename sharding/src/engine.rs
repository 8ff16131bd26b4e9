//! The sharded model at run time: one rank's partitions of parameters, gradients and optimizer
//! state, and the training step that gathers, computes, releases and reduces unit by unit.
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
//! Dropout masks are replayed: with `StepHyper::dropout_seed` the device RNG is re-seeded from
//! (seed, micro-batch, unit) before a unit's forward and before its recompute.
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
//! # Communication thread
//!
//! The gathers and gradient reductions of a step run on one scoped worker thread, in the
//! order the main thread requests them, like a dedicated communication stream (the two scalar
//! all-reduces and the post-update parameter gather run on the caller after it is joined): parameter gathers are requested
//! `prefetch` visits ahead so they overlap the current visit's compute, gradient reductions as
//! soon as a unit's gradient is ready so they overlap the backward of the units before it.
//! Every rank requests the same collectives in the same order, so MPI matches them. The
//! worker also owns the secondary copies (hpZ), which live from a unit's first gather of the
//! step to the end of the step.

use std::collections::{HashMap, HashSet};
use std::sync::mpsc;
use std::time::Instant;

use burn::tensor::{DType, Device, Tensor, TensorData};
use ember_comm::quantized::Residuals;
use ember_comm::{Comm, Counters};

use crate::buf::Buf;
use crate::config::{Compute, ShardConfig, Span};
use crate::error::ShardError;
use crate::optim::{AdamConfig, ShardState, decay_ranges};
use crate::params::{grads_of, load, param_shapes, param_values};
use crate::plan::{Memory, Plan};
use crate::route;
use crate::stage::{Flow, Staged, assign};

/// Reads `[master, exp_avg, exp_avg_sq]` of elements `range` of parameter `name` from a
/// checkpoint (see [`ShardedModel::load_state`]).
pub type StateReader<'a> =
    dyn FnMut(&str, std::ops::Range<usize>) -> Result<[Vec<f32>; 3], String> + 'a;

/// A parameter's path, shape and values (flattened, f32).
pub type NamedValues = (String, Vec<usize>, Vec<f32>);

/// The hyper-parameters of one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepHyper {
    /// Learning rate of this step.
    pub lr: f64,
    /// Global gradient-norm clipping threshold (0 = off).
    pub grad_clip: f64,
    /// AdamW settings.
    pub adam: AdamConfig,
    /// Seed of this rank's dropout masks for this step, for models with dropout; `None` runs
    /// the inference-only forward visits without autodiff (dropout off there, and nothing
    /// to replay). With a seed, the device RNG is seeded from (seed, micro-batch, unit)
    /// before a unit's forward and again before its recompute, so backward sees the masks
    /// the forward drew.
    pub dropout_seed: Option<u64>,
}

/// The RNG seed of unit `stage` of micro-batch `micro` in a step seeded `base`.
fn unit_seed(base: u64, micro: usize, stage: usize) -> u64 {
    let mut z = base ^ ((micro as u64) << 32) ^ stage as u64;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// What a step did, as this rank saw it.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// Mean loss over the global batch (the same on every rank).
    pub loss: f64,
    /// Global gradient norm before clipping (the same on every rank).
    pub grad_norm: f64,
    /// Seconds the main thread spent blocked on communication.
    pub comm_wait_s: f64,
    /// Seconds the whole step took.
    pub step_s: f64,
    /// Bytes moved per group and op during the step.
    pub traffic: Counters,
    /// Model-state bytes held during the step (peaks for the transient parts).
    pub memory: Memory,
}

/// Requests to the communication thread.
enum Job {
    /// Gather unit `unit` whole (from the secondary copy if it exists, else the primary).
    Gather(usize),
    /// Reduce unit `unit`'s full gradient to this rank's optimizer shard.
    Reduce(usize, Vec<f32>),
}

/// Answers from the communication thread, in request order.
enum Done {
    Gathered(Vec<f32>),
    Reduced(usize, Vec<f32>),
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
    primary: Vec<Buf>,
    optimizer: Vec<ShardState>,
    adam_step: u64,
    residuals: Vec<Residuals>,
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
    /// Partitions `module` (the same initial weights on every rank: checked) per `config` over
    /// `comm`'s topology, computing on `device`. The module's parameters are copied into the
    /// partitions and the module keeps none of them.
    pub fn new(
        comm: &'c Comm,
        stages: S,
        module: S::Module,
        config: ShardConfig,
        device: Device,
    ) -> Result<Self, ShardError> {
        let shapes_in_order = param_shapes(&module);
        let units = assign(&shapes_in_order, &stages.units(&module))?;
        let plan = Plan::new(units, config, comm.topology().clone())?;
        let rank = comm.rank();
        let values = param_values(&module);
        route::check_same_everywhere(comm, &plan, &values)?;
        let cfg = plan.config.clone();
        let mut primary = Vec::with_capacity(plan.units.len());
        let mut optimizer = Vec::with_capacity(plan.units.len());
        for (u, unit) in plan.units.iter().enumerate() {
            let mut flat = Vec::with_capacity(unit.padded);
            for p in &unit.params {
                flat.extend_from_slice(&values[&p.name]);
            }
            flat.resize(unit.padded, 0.0);
            let opt_range = plan.shard_range(u, cfg.optimizer, rank);
            let slots: Vec<(usize, usize, bool)> = unit
                .params
                .iter()
                .map(|p| (p.offset, p.numel, p.decay))
                .collect();
            let decay = decay_ranges(&opt_range, &slots);
            let master = flat[opt_range.clone()].to_vec();
            primary.push(Buf::from_f32(
                &flat[plan.shard_range(u, cfg.params, rank)],
                cfg.compute,
            ));
            optimizer.push(ShardState::new(opt_range, master, decay));
        }
        let skeleton = load(module, &mut HashMap::new(), &HashMap::new(), true, false);
        let autodiff = device.clone().autodiff();
        Ok(Self {
            comm,
            stages,
            numels: shapes_in_order
                .iter()
                .map(|(n, s)| (n.clone(), s.iter().product()))
                .collect(),
            shapes: shapes_in_order.into_iter().collect(),
            residuals: vec![Residuals::default(); plan.units.len()],
            plan,
            skeleton,
            device,
            autodiff,
            primary,
            optimizer,
            adam_step: 0,
        })
    }

    /// The partition plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The communicator.
    pub fn comm(&self) -> &'c Comm {
        self.comm
    }

    /// The optimizer state this rank owns, per unit.
    pub fn optimizer_state(&self) -> &[ShardState] {
        &self.optimizer
    }

    /// Optimizer updates applied so far.
    pub fn adam_step(&self) -> u64 {
        self.adam_step
    }

    /// Whether this rank writes its optimizer shard to a checkpoint: the first of the ranks
    /// holding the same shard (all ranks when the optimizer state spans the world; rank 0
    /// alone when it is replicated).
    pub fn is_writer(&self) -> bool {
        let o = self.plan.config.optimizer.0;
        self.plan.topology.coords(self.comm.rank())[o..]
            .iter()
            .all(|&c| c == 0)
    }

    /// This rank's share of every parameter for a checkpoint: `(name, offset, [master,
    /// exp_avg, exp_avg_sq])` for each parameter its optimizer shard overlaps, the offset
    /// counted in the parameter's flattened elements. Padding is never included; a rank whose
    /// shard is all padding contributes nothing.
    pub fn owned_pieces(&self) -> Vec<(String, usize, [Vec<f32>; 3])> {
        let mut out = Vec::new();
        for (unit, state) in self.plan.units.iter().zip(&self.optimizer) {
            for p in &unit.params {
                let lo = p.offset.max(state.range.start);
                let hi = (p.offset + p.numel).min(state.range.end);
                if lo >= hi {
                    continue;
                }
                let local = lo - state.range.start..hi - state.range.start;
                out.push((
                    p.name.clone(),
                    lo - p.offset,
                    [
                        state.master[local.clone()].to_vec(),
                        state.exp_avg[local.clone()].to_vec(),
                        state.exp_avg_sq[local].to_vec(),
                    ],
                ));
            }
        }
        out
    }

    /// Fills this rank's optimizer shards from a checkpoint of any partition: `read(name,
    /// range)` returns `[master, exp_avg, exp_avg_sq]` of elements `range` of parameter
    /// `name`. Only the ranges this rank owns are asked for. Then rebuilds the primary
    /// parameters. Every rank must call it.
    pub fn load_state(
        &mut self,
        adam_step: u64,
        read: &mut StateReader<'_>,
    ) -> Result<(), ShardError> {
        for (unit, state) in self.plan.units.iter().zip(self.optimizer.iter_mut()) {
            let n = state.range.len();
            let mut fresh = [vec![0.0f32; n], vec![0.0f32; n], vec![0.0f32; n]];
            for p in &unit.params {
                let lo = p.offset.max(state.range.start);
                let hi = (p.offset + p.numel).min(state.range.end);
                if lo >= hi {
                    continue;
                }
                let got = read(&p.name, lo - p.offset..hi - p.offset).map_err(ShardError::Model)?;
                let at = lo - state.range.start..hi - state.range.start;
                for (dst, src) in fresh.iter_mut().zip(got) {
                    if src.len() != at.len() {
                        return Err(ShardError::Model(format!(
                            "{}: {} values read for {} elements",
                            p.name,
                            src.len(),
                            at.len()
                        )));
                    }
                    dst[at.clone()].copy_from_slice(&src);
                }
            }
            let [master, m, v] = fresh;
            state.master = master;
            state.exp_avg = m;
            state.exp_avg_sq = v;
        }
        self.adam_step = adam_step;
        self.refresh_primary()
    }

    /// Replaces this rank's optimizer state (from a checkpoint) and rebuilds the primary
    /// parameter partition from the masters. Every rank must call it.
    pub fn restore(&mut self, state: Vec<ShardState>, adam_step: u64) -> Result<(), ShardError> {
        if state.len() != self.optimizer.len()
            || state
                .iter()
                .zip(&self.optimizer)
                .any(|(a, b)| a.range != b.range || a.master.len() != b.master.len())
        {
            return Err(ShardError::Units(
                "restored optimizer shards do not match this rank's partition".into(),
            ));
        }
        self.optimizer = state;
        self.adam_step = adam_step;
        self.refresh_primary()
    }

    fn dtype(&self) -> DType {
        match self.plan.config.compute {
            Compute::F32 => DType::F32,
            Compute::Bf16 => DType::BF16,
        }
    }

    /// The module with the parameters of `units` set from their gathered flat buffers.
    fn module_with(
        &self,
        units: &[usize],
        full: Vec<Vec<f32>>,
        autodiff: bool,
        require_grad: bool,
    ) -> S::Module {
        let device = if autodiff {
            &self.autodiff
        } else {
            &self.device
        };
        let dtype = self.dtype();
        let mut values = HashMap::new();
        for (&u, flat) in units.iter().zip(full) {
            for p in &self.plan.units[u].params {
                let v = flat[p.offset..p.offset + p.numel].to_vec();
                let t = Tensor::<1>::from_data(TensorData::new(v, [p.numel]), device);
                let t = if dtype == DType::F32 {
                    t
                } else {
                    t.cast(dtype)
                };
                values.insert(p.name.clone(), t);
            }
        }
        load(
            self.skeleton.clone(),
            &mut values,
            &self.shapes,
            true,
            require_grad,
        )
    }

    /// Adds the gradients `g` holds for unit `u`'s parameters into its flat buffer `buf`
    /// (allocated on first use) and records which parameters were reached. A unit read by
    /// another stage (a tied embedding) gets no gradient for the parameters that stage does
    /// not use.
    fn add_unit_grads(
        &self,
        u: usize,
        g: &mut HashMap<String, Tensor<1>>,
        buf: &mut Vec<f32>,
        reached: &mut HashSet<String>,
    ) {
        let unit = &self.plan.units[u];
        if buf.is_empty() {
            *buf = vec![0.0; unit.padded];
        }
        for p in &unit.params {
            if let Some(t) = g.remove(&p.name) {
                add_into(&mut buf[p.offset..p.offset + p.numel], &host_f32(t));
                reached.insert(p.name.clone());
            }
        }
    }

    /// The whole flat buffer of every unit in `units` for a model whose parameters are
    /// replicated (no communication).
    fn replicated(&self, units: &[usize]) -> Vec<Vec<f32>> {
        units.iter().map(|&u| self.primary[u].to_f32()).collect()
    }

    /// Mean loss of `batch` on this rank (forward only; every rank must call it together when
    /// parameters are partitioned, since it gathers them).
    pub fn eval_loss(&self, batch: &S::Batch) -> Result<f64, ShardError> {
        let k = self.plan.units.len();
        let mut input: Option<Tensor<D>> = None;
        for stage in 0..k {
            let needs = self.plan.units[stage].needs.clone();
            let full = if self.plan.config.params == Span(0) {
                self.replicated(&needs)
            } else {
                needs
                    .iter()
                    .map(|&u| route::gather_primary(self.comm, &self.plan, u, &self.primary[u]))
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

    /// One optimizer step over `micro_batches` (this rank's share of the global batch, one per
    /// gradient-accumulation micro-step; every rank passes the same number).
    pub fn train_step(
        &mut self,
        micro_batches: &[S::Batch],
        hyper: &StepHyper,
    ) -> Result<StepReport, ShardError> {
        let start = Instant::now();
        let comm = self.comm;
        comm.take_counters();
        let accum = micro_batches.len();
        assert!(accum > 0, "at least one micro-batch");
        let cfg = self.plan.config.clone();
        let partitioned = cfg.params != Span(0);
        let visits = self.plan.visits(accum);
        let c = cfg.compute.bytes() as u64;

        let mut grads: Vec<Vec<f32>> = vec![Vec::new(); self.plan.units.len()];
        let mut grad_bytes_peak = 0u64;
        let mut gathered_live = 0u64;
        let mut gathered_peak = 0u64;
        let mut comm_wait = 0.0f64;
        let mut micro_losses = vec![0.0f64; accum];
        let mut reached = HashSet::new();

        let (job_tx, job_rx) = mpsc::channel::<Job>();
        let (done_tx, done_rx) = mpsc::channel::<Result<Done, ShardError>>();
        let plan = &self.plan;
        let primary = &self.primary;
        let mut residuals = std::mem::take(&mut self.residuals);

        let (secondary_peak, residuals) = std::thread::scope(|scope| {
            let worker = scope.spawn(move || {
                let mut secondary: Vec<Option<Buf>> = vec![None; plan.units.len()];
                let mut peak = 0u64;
                for job in job_rx {
                    let out = match job {
                        Job::Gather(u) => {
                            route::gather(comm, plan, u, &primary[u], &mut secondary[u])
                                .map(Done::Gathered)
                        }
                        Job::Reduce(u, g) => route::reduce(comm, plan, u, g, &mut residuals[u])
                            .map(|s| Done::Reduced(u, s)),
                    };
                    let held: u64 = secondary.iter().flatten().map(Buf::bytes).sum();
                    peak = peak.max(held);
                    let failed = out.is_err();
                    if done_tx.send(out).is_err() || failed {
                        break;
                    }
                }
                (peak, residuals)
            });

            let result = (|| -> Result<(), ShardError> {
                // Receives answers until the gathered buffer of the next request arrives,
                // adding reduced shards to `grads` as they come.
                let next_gathered = |grads: &mut Vec<Vec<f32>>,
                                     comm_wait: &mut f64|
                 -> Result<Vec<f32>, ShardError> {
                    loop {
                        let t = Instant::now();
                        let msg = done_rx.recv().map_err(|_| worker_gone())?;
                        *comm_wait += t.elapsed().as_secs_f64();
                        match msg? {
                            Done::Gathered(v) => return Ok(v),
                            Done::Reduced(u, s) => accumulate(&mut grads[u], s),
                        }
                    }
                };
                let needs = |i: usize| &self.plan.units[visits[i].stage].needs;
                let mut issued = 0;
                let mut issue_through = |upto: usize, live: &mut u64, peak: &mut u64| {
                    while partitioned && issued <= upto.min(visits.len() - 1) {
                        for &u in needs(issued) {
                            *live += self.plan.units[u].padded as u64 * c;
                            let _ = job_tx.send(Job::Gather(u));
                        }
                        *peak = (*peak).max(*live);
                        issued += 1;
                    }
                };

                // A unit's complete gradient: reduced now (partitioned gradients) or added to
                // the step's whole-gradient buffer, reduced after the last micro-batch.
                let hand_off = |u: usize, full: Vec<f32>, grads: &mut Vec<Vec<f32>>| {
                    if cfg.shard_grads {
                        let _ = job_tx.send(Job::Reduce(u, full));
                    } else {
                        accumulate(&mut grads[u], full);
                    }
                };
                let k = self.plan.units.len();
                let mut inputs: Vec<Option<Tensor<D>>> = vec![None; k];
                let mut upstream: Option<Tensor<D>> = None;
                let mut work: Vec<Vec<f32>> = vec![Vec::new(); k];
                // Replicated parameters are never released, so nothing is gained by running
                // unit by unit: one autodiff graph per micro-batch, no recompute.
                let visits: &[crate::plan::Visit] = if partitioned { &visits } else { &[] };
                if !partitioned {
                    let all: Vec<usize> = (0..k).collect();
                    for (micro, batch) in micro_batches.iter().enumerate() {
                        let module = self.module_with(&all, self.replicated(&all), true, true);
                        let mut x: Option<Tensor<D>> = None;
                        let mut loss = None;
                        for stage in 0..k {
                            if let Some(base) = hyper.dropout_seed {
                                self.autodiff.seed(unit_seed(base, micro, stage));
                            }
                            match self.stages.forward(
                                &module,
                                stage,
                                x.take(),
                                batch,
                                &self.autodiff,
                            ) {
                                Flow::Hidden(h) if stage + 1 < k => x = Some(h),
                                Flow::Loss(l) if stage + 1 == k => loss = Some(l),
                                _ => return Err(flow_error(stage, k)),
                            }
                        }
                        let loss = loss.expect("the last stage returned the loss");
                        micro_losses[micro] = scalar(loss.clone().without_autodiff());
                        let grads_ad = loss.backward();
                        let mut g = grads_of(&module, &grads_ad, &self.numels);
                        for u in 0..k {
                            let mut full = Vec::new();
                            self.add_unit_grads(u, &mut g, &mut full, &mut reached);
                            hand_off(u, full, &mut grads);
                        }
                        grad_bytes_peak = grad_bytes_peak.max(held_bytes(&grads));
                    }
                }
                for (i, v) in visits.iter().enumerate() {
                    // This visit's gathers and those of the next `prefetch` visits are in
                    // flight (or done) while this one computes.
                    issue_through(i + cfg.prefetch, &mut gathered_live, &mut gathered_peak);
                    let units = self.plan.units[v.stage].needs.clone();
                    let full: Vec<Vec<f32>> = if partitioned {
                        let mut f = Vec::with_capacity(units.len());
                        for _ in &units {
                            f.push(next_gathered(&mut grads, &mut comm_wait)?);
                        }
                        f
                    } else {
                        self.replicated(&units)
                    };
                    let batch = &micro_batches[v.micro];
                    if let Some(base) = hyper.dropout_seed {
                        self.autodiff.seed(unit_seed(base, v.micro, v.stage));
                    }
                    if !v.backward {
                        // With dropout the forward runs on the autodiff device (dropout is
                        // off elsewhere), tracking nothing: no parameter requires a gradient.
                        let replay = hyper.dropout_seed.is_some();
                        let module = self.module_with(&units, full, replay, false);
                        let device = if replay { &self.autodiff } else { &self.device };
                        // Keep the input for the recompute; the output is the next input.
                        let input = inputs[v.stage]
                            .clone()
                            .map(|x| if replay { x.autodiff() } else { x });
                        match self.stages.forward(&module, v.stage, input, batch, device) {
                            Flow::Hidden(h) => {
                                let h = if replay { h.without_autodiff() } else { h };
                                inputs[v.stage + 1] = Some(h);
                            }
                            Flow::Loss(_) => return Err(flow_error(v.stage, k)),
                        }
                    } else {
                        let module = self.module_with(&units, full, true, true);
                        let input = inputs[v.stage].take().map(|x| x.autodiff().require_grad());
                        let out = self.stages.forward(
                            &module,
                            v.stage,
                            input.clone(),
                            batch,
                            &self.autodiff,
                        );
                        let grads_ad = match (out, v.stage + 1 == k) {
                            (Flow::Loss(l), true) => {
                                micro_losses[v.micro] = scalar(l.clone().without_autodiff());
                                l.backward()
                            }
                            (Flow::Hidden(h), false) => {
                                let up = upstream.take().expect("the later stage ran first");
                                (h * up.autodiff()).sum().backward()
                            }
                            _ => return Err(flow_error(v.stage, k)),
                        };
                        let mut g = grads_of(&module, &grads_ad, &self.numels);
                        for &u in &units {
                            self.add_unit_grads(u, &mut g, &mut work[u], &mut reached);
                        }
                        upstream = input.and_then(|x| x.grad(&grads_ad));
                        for &u in &units {
                            if self.plan.units[u].grad_ready_at != v.stage {
                                continue;
                            }
                            hand_off(u, std::mem::take(&mut work[u]), &mut grads);
                        }
                        grad_bytes_peak = grad_bytes_peak.max(held_bytes(&grads));
                    }
                    if partitioned {
                        gathered_live -= units
                            .iter()
                            .map(|&u| self.plan.units[u].padded as u64 * c)
                            .sum::<u64>();
                    }
                }
                if !cfg.shard_grads {
                    for (u, g) in grads.iter_mut().enumerate() {
                        let _ = job_tx.send(Job::Reduce(u, std::mem::take(g)));
                    }
                }
                drop(job_tx);
                loop {
                    let t = Instant::now();
                    let Ok(msg) = done_rx.recv() else { break };
                    comm_wait += t.elapsed().as_secs_f64();
                    match msg? {
                        Done::Reduced(u, s) => accumulate(&mut grads[u], s),
                        Done::Gathered(_) => unreachable!("every gather was received"),
                    }
                }
                Ok(())
            })();
            let (peak, res) = worker.join().map_err(|_| worker_gone())?;
            result.map(|()| (peak, res))
        })?;
        self.residuals = residuals;
        if let Some(p) = self
            .plan
            .units
            .iter()
            .flat_map(|u| u.params.iter())
            .find(|p| !reached.contains(&p.name))
        {
            return Err(ShardError::Model(format!(
                "no gradient reached parameter `{}`: does a unit's forward use it?",
                p.name
            )));
        }
        if cfg.shard_grads {
            grad_bytes_peak = grad_bytes_peak.max(held_bytes(&grads));
        }

        // Mean over micro-batches, then the global norm over the optimizer group.
        let inv = 1.0 / accum as f64;
        let mut sq = 0.0f64;
        for g in grads.iter_mut() {
            if accum > 1 {
                g.iter_mut().for_each(|x| *x *= inv as f32);
            }
            sq += g.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
        }
        let t = Instant::now();
        let sq = route::sum_over(comm, self.plan.group(cfg.optimizer), sq as f32)? as f64;
        let local_loss = micro_losses.iter().sum::<f64>() * inv;
        let world = self.plan.group(Span(self.plan.topology.depth()));
        let loss = route::sum_over(comm, world, local_loss as f32)? as f64
            / self.plan.topology.world_size() as f64;
        comm_wait += t.elapsed().as_secs_f64();
        let norm = sq.sqrt();
        if !loss.is_finite() || !norm.is_finite() {
            return Err(ShardError::Model(format!(
                "training diverged: loss {loss}, gradient norm {norm}; lower --lr or raise \
                 --warmup-iters"
            )));
        }
        if hyper.grad_clip > 0.0 && norm > hyper.grad_clip {
            let factor = (hyper.grad_clip / (norm + 1e-6)) as f32;
            grads
                .iter_mut()
                .for_each(|g| g.iter_mut().for_each(|x| *x *= factor));
        }
        self.adam_step += 1;
        for (state, g) in self.optimizer.iter_mut().zip(&grads) {
            state.update(&hyper.adam, self.adam_step, hyper.lr, g);
        }
        let t = Instant::now();
        self.refresh_primary()?;
        comm_wait += t.elapsed().as_secs_f64();

        let memory = Memory {
            params: self.primary.iter().map(Buf::bytes).sum(),
            secondary: secondary_peak,
            grads: grad_bytes_peak,
            optimizer: self.optimizer.iter().map(ShardState::bytes).sum(),
            gathered_peak,
        };
        Ok(StepReport {
            loss,
            grad_norm: norm,
            comm_wait_s: comm_wait,
            step_s: start.elapsed().as_secs_f64(),
            traffic: comm.take_counters(),
            memory,
        })
    }

    /// Rebuilds the primary parameter partition from the f32 masters.
    fn refresh_primary(&mut self) -> Result<(), ShardError> {
        let cfg = &self.plan.config;
        for (u, state) in self.optimizer.iter().enumerate() {
            let shard = Buf::from_f32(&state.master, cfg.compute);
            self.primary[u] = if cfg.params == cfg.optimizer {
                shard
            } else {
                route::all_gather_params(self.comm, &self.plan, &shard)?
            };
        }
        Ok(())
    }

    /// Every parameter's current value (f32 masters, gathered to every rank), by path, in
    /// unit order. Every rank must call it.
    pub fn full_parameters(&self) -> Result<Vec<NamedValues>, ShardError> {
        let mut out = Vec::new();
        for (u, state) in self.optimizer.iter().enumerate() {
            let full = route::all_gather_masters(self.comm, &self.plan, &state.master)?;
            for p in &self.plan.units[u].params {
                out.push((
                    p.name.clone(),
                    p.shape.clone(),
                    full[p.offset..p.offset + p.numel].to_vec(),
                ));
            }
        }
        Ok(out)
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
        .try_into_vec::<f64>()
        .map(|v| v[0])
        .unwrap_or(f64::NAN)
}

fn host_f32(t: Tensor<1>) -> Vec<f32> {
    let t = if t.dtype() == DType::F32 {
        t
    } else {
        t.cast(DType::F32)
    };
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("a float tensor")
}

/// Adds `x` to `acc`, taking it whole when `acc` is still empty.
fn accumulate(acc: &mut Vec<f32>, x: Vec<f32>) {
    if acc.is_empty() {
        *acc = x;
    } else {
        add_into(acc, &x);
    }
}

/// Bytes of f32 gradient buffers held.
fn held_bytes(grads: &[Vec<f32>]) -> u64 {
    grads.iter().map(|g| 4 * g.len() as u64).sum()
}

fn add_into(acc: &mut [f32], x: &[f32]) {
    acc.iter_mut().zip(x).for_each(|(a, b)| *a += b);
}

fn flow_error(stage: usize, k: usize) -> ShardError {
    ShardError::Model(format!(
        "unit {stage} of {k} returned the wrong kind of output: every unit but the last must \
         return Flow::Hidden and the last Flow::Loss"
    ))
}

fn worker_gone() -> ShardError {
    ShardError::Model("the communication thread stopped unexpectedly".into())
}
