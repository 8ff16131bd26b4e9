//! The training step: `backward` runs the plan's schedule (gathers, forward and backward
//! visits, reductions) and closes the gradients; `apply` runs an optimizer on the master
//! shards and rebuilds the primary partition. `eval_loss` is the forward alone.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use burn::tensor::{DType, Device, Tensor};

use super::{OwnedPiece, ShardedModel, StepHyper, StepLoss, StepReport, draw_seed};
use crate::config::Span;
use crate::error::ShardError;
use crate::optim::Optimizer;
use crate::params::{ReadLog, grads_of, load_logged};
use crate::plan::Visit;
use crate::plan::schedule::{Event, Source};
use crate::side::{Entry, Side};
use crate::stage::{Flow, Staged};
use crate::transport::host::{add_to, scalar};
use crate::transport::memory;
use crate::transport::route;
use crate::transport::worker::{GATHER_LANE, Job, REDUCE_LANE, Shared, Worker};

/// One step's gradients, reduced over the ranks and averaged over micro-batches: this rank's
/// shard of each unit (the elements of its optimizer shard), from [`ShardedModel::backward`].
/// Read them, clip or scale them, then hand them to [`ShardedModel::apply`].
#[derive(Debug)]
pub struct Gradients {
    /// Each unit's gradient shard, `[shard]` f32, before `factors`.
    units: Vec<Tensor<1>>,
    /// Factors the gradients are multiplied by, in turn, when read or applied (the
    /// optimizer's pass folds them in rather than writing scaled copies).
    factors: Vec<f64>,
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
    timeline: Vec<crate::plan::simulate::Interval>,
}

impl Gradients {
    /// The step's loss over the global batch (the same on every rank): per
    /// [`StepLoss`](crate::StepLoss), the mean of the micro-batches' losses over the
    /// micro-batches and the ranks, or their sum.
    pub fn loss(&self) -> f64 {
        self.loss
    }

    /// The global L2 norm of the gradients over every parameter (the same on every rank).
    pub fn norm(&self) -> f64 {
        self.norm
    }

    /// Multiplies every gradient by `factor` (in f32, as `g * factor as f32`).
    pub fn scale(&mut self, factor: f64) {
        self.factors.push(factor);
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
            let values = crate::transport::host::scale_by(
                self.units[p.unit].clone().slice(p.local.clone()),
                &self.factors,
            );
            (p.name.as_str(), p.offset, values)
        })
    }
}

/// A stage's forward with autodiff: the module holding its gathered parameters, its input as
/// an autodiff leaf (none for the first stage), its output, the side tensors it was given (as
/// autodiff leaves) and those it put (in its graph).
struct Graph<M, const D: usize> {
    module: M,
    input: Option<Tensor<D>>,
    out: Flow<D>,
    given: Vec<Entry>,
    put: Vec<Entry>,
}

/// What a unit's forward visit gave, held against its recompute on the first step.
struct Outputs<const D: usize> {
    hidden: Tensor<D>,
    aux: Option<Tensor<1>>,
    put: Vec<Entry>,
}

/// The state of one step on the training thread.
struct StepState<M, const D: usize> {
    /// Micro-batches this rank runs in the step.
    accum: usize,
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
    /// The side tensors the forward visits of the running micro-batch put, each with the
    /// stage that put it, until that stage's backward visit.
    sides: Vec<(usize, Entry)>,
    /// The gradients of side tensors, summed over the backward visits of the stages that read
    /// them, until the backward visit of the stage that put them.
    side_grads: HashMap<String, Option<Tensor<1>>>,
    /// Each micro-batch's loss.
    micro_losses: Vec<f64>,
    /// On the first step only: each unit's outputs from its forward visit of micro-batch 0,
    /// held against those its backward visit recomputes.
    forward_outputs: Option<Vec<Option<Outputs<D>>>>,
    /// Parameters that received a gradient.
    reached: HashSet<String>,
}

impl<M, const D: usize> StepState<M, D> {
    /// The side tensors stage `stage` is given (those earlier stages put), through `f`.
    fn given(&self, stage: usize, f: impl Fn(Tensor<1>) -> Tensor<1>) -> Vec<Entry> {
        self.sides
            .iter()
            .filter(|(by, _)| *by < stage)
            .map(|(_, e)| e.clone().map(&f))
            .collect()
    }
}

impl<S: Staged<D>, const D: usize> ShardedModel<'_, S, D> {
    /// One step of `hyper`'s optimizer over `micro_batches` (this rank's share of the global
    /// batch, one per gradient-accumulation micro-step; every rank passes the same number),
    /// with the gradients clipped to `hyper.grad_clip`: [`backward`](Self::backward), then
    /// [`apply`](Self::apply).
    pub fn train_step<O: Optimizer>(
        &mut self,
        micro_batches: &[S::Batch],
        hyper: &StepHyper<O>,
    ) -> Result<StepReport, ShardError> {
        let mut grads = self.backward(micro_batches)?;
        grads.clip_norm(hyper.grad_clip);
        self.apply(grads, &hyper.optimizer, hyper.lr)
    }

    /// The gradients of `micro_batches` (this rank's share of the global batch, one per
    /// gradient-accumulation micro-step; every rank passes the same number): every unit's
    /// gradient reduced over the ranks and combined over micro-batches as the step's loss is
    /// ([`StepLoss`](crate::StepLoss)), this rank holding the elements of its optimizer
    /// shard, with the step's loss and global norm. Every rank must call it together. Nothing
    /// is updated until [`apply`](Self::apply).
    ///
    /// Each unit's forward runs as a training forward (on the autodiff device, where Burn's
    /// `Dropout` is on), after the device's generator is seeded with
    /// [`draw_seed`](crate::draw_seed)`(seed, step, micro-batch, unit)`; backward's recompute
    /// of the unit seeds it alike, so it draws the same.
    pub fn backward(&mut self, micro_batches: &[S::Batch]) -> Result<Gradients, ShardError> {
        let start = Instant::now();
        self.comm.take_counters();
        crate::Staging::take();
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
            accum,
            grads: vec![None; k],
            work: vec![None; k],
            inputs: vec![None; k],
            upstream: None,
            graphs: (0..k).map(|_| None).collect(),
            sides: Vec::new(),
            side_grads: HashMap::new(),
            micro_losses: vec![0.0; accum],
            reached: HashSet::new(),
            forward_outputs: (!self.recompute_checked).then(|| (0..k).map(|_| None).collect()),
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
                &self.comm_streams,
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
        self.recompute_checked = true;
        let (units, loss, norm, closing_s) = self.close_gradients(state)?;
        Ok(Gradients {
            units,
            factors: Vec::new(),
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
        if self.state_names.is_empty() && self.updates == 0 {
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
        self.updates += 1;
        for (u, g) in grads.units.into_iter().enumerate() {
            // The primary may be the master itself: let go of it first, so the update owns
            // the buffer (on host memory it then updates in place).
            self.primary[u] = Tensor::empty([0], &self.device);
            optimizer.update_scaled(
                self.updates,
                lr,
                &mut self.optimizer[u].state,
                g,
                &grads.factors,
            );
            // At once, unit by unit: a primary that shares the old master would otherwise
            // keep every old master alive until the last unit is updated.
            let gather = Instant::now();
            self.primary[u] = self.primary_of(u)?;
            if cfg.params() != cfg.optimizer() {
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
            device_reserved_bytes: memory::device_bytes_reserved(&self.device),
            secondary_bytes: grads.secondary_bytes,
            staging: crate::Staging::take(),
            timeline: grads.timeline,
        })
    }

    /// The loss of `batch` on this rank (forward only, as evaluation runs it: on the plain
    /// device, where Burn's `Dropout` is off; every rank must call it together when parameters
    /// are partitioned, since it gathers them).
    pub fn eval_loss(&self, batch: &S::Batch) -> Result<f64, ShardError> {
        let k = self.plan.units.len();
        let mut input: Option<Tensor<D>> = None;
        let mut side = Side::default();
        for stage in 0..k {
            let needs = self.plan.units[stage].needs.clone();
            let full = if self.plan.config.params() == Span(0) {
                needs.iter().map(|&u| self.primary[u].clone()).collect()
            } else {
                needs
                    .iter()
                    .map(|&u| self.gather_here(u))
                    .collect::<Result<_, _>>()?
            };
            let (module, log) = self.module_with(&needs, full, false, false);
            self.device
                .seed(draw_seed(self.seed, self.updates, u64::MAX, stage));
            let out = self.run_unit(
                stage,
                &module,
                &log,
                input.take(),
                &mut side,
                batch,
                &self.device,
            )?;
            match out {
                Flow::Hidden(h) | Flow::Aux(h, _) if stage + 1 < k => input = Some(h),
                Flow::Loss(l) if stage + 1 == k => return scalar(l),
                _ => return Err(self.flow_error(stage)),
            }
        }
        unreachable!("the last stage returned")
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
                Event::Reduce { unit, inner_only } => {
                    let grad = state.work[unit]
                        .take()
                        .expect("the schedule reduces a unit after its backward");
                    worker.send(Job::Reduce {
                        unit,
                        grad: Box::new(grad),
                        inner_only,
                    })?;
                }
            }
        }
        Ok(())
    }

    /// Seeds the device's generator for `stage` of this rank's micro-batch `micro`
    /// ([`draw_seed`]).
    fn seed_draws(&self, micro: usize, accum: usize, stage: usize) {
        let micro = (self.comm.rank() * accum + micro) as u64;
        self.autodiff
            .seed(draw_seed(self.seed, self.updates, micro, stage));
    }

    /// A forward visit: the stage as a training forward runs it (on the autodiff device, with
    /// nothing tracked unless its graph is kept for its backward), keeping its output as the
    /// next stage's input and the side tensors it put for the stages after it.
    fn forward_visit(
        &self,
        v: Visit,
        full: Vec<Tensor<1>>,
        batch: &S::Batch,
        state: &mut StepState<S::Module, D>,
    ) -> Result<(), ShardError> {
        if self.plan.keeps_graph(v.stage) {
            // With autodiff, kept until the backward visit (the parameters with it).
            let graph = self.unit_forward(v, full, batch, state, true)?;
            let (h, aux) = match &graph.out {
                Flow::Hidden(h) => (h, None),
                Flow::Aux(h, aux) => (h, Some(aux)),
                Flow::Loss(_) => return Err(self.flow_error(v.stage)),
            };
            if let Some(aux) = aux {
                state.micro_losses[v.micro] += scalar(aux.clone().without_autodiff())?;
            }
            state.inputs[v.stage + 1] = Some(h.clone().without_autodiff());
            let put = graph.put.iter().cloned();
            state
                .sides
                .extend(put.map(|e| (v.stage, e.map(Tensor::without_autodiff))));
            state.graphs[v.stage] = Some(graph);
            return Ok(());
        }
        let Graph { out, put, .. } = self.unit_forward(v, full, batch, state, false)?;
        let (h, aux) = out.hidden().ok_or_else(|| self.flow_error(v.stage))?;
        let h = h.without_autodiff();
        let aux = aux.map(Tensor::without_autodiff);
        let put: Vec<Entry> = put
            .into_iter()
            .map(|e| e.map(Tensor::without_autodiff))
            .collect();
        // The auxiliary loss counts in the step's loss here; backward recomputes it for its
        // gradient.
        if let Some(aux) = &aux {
            state.micro_losses[v.micro] += scalar(aux.clone())?;
        }
        if let Some(outputs) = &mut state.forward_outputs
            && v.micro == 0
        {
            outputs[v.stage] = Some(Outputs {
                hidden: h.clone(),
                aux,
                put: put.clone(),
            });
        }
        state.sides.extend(put.into_iter().map(|e| (v.stage, e)));
        state.inputs[v.stage + 1] = Some(h);
        Ok(())
    }

    /// The stage's forward on the autodiff device, on the gathered `full` units, after seeding
    /// the device's generator for it: `tracked`, from its saved input (taken) as an autodiff
    /// leaf, for a backward through it; else with nothing tracked, from a copy of the input,
    /// as a forward visit that keeps no graph.
    fn unit_forward(
        &self,
        v: Visit,
        full: Vec<Tensor<1>>,
        batch: &S::Batch,
        state: &mut StepState<S::Module, D>,
        tracked: bool,
    ) -> Result<Graph<S::Module, D>, ShardError> {
        self.seed_draws(v.micro, state.accum, v.stage);
        let needs = &self.plan.units[v.stage].needs;
        let (module, log) = self.module_with(needs, full, true, tracked);
        let leaf = |t: Tensor<1>| {
            let t = t.autodiff();
            if tracked { t.require_grad() } else { t }
        };
        let input = if tracked {
            state.inputs[v.stage]
                .take()
                .map(|x| x.autodiff().require_grad())
        } else {
            state.inputs[v.stage].clone().map(Tensor::autodiff)
        };
        let mut side = Side::given(&self.plan.units[v.stage].name, state.given(v.stage, leaf));
        let out = self.run_unit(
            v.stage,
            &module,
            &log,
            input.clone(),
            &mut side,
            batch,
            &self.autodiff,
        )?;
        let (given, put) = side.into_parts();
        Ok(Graph {
            module,
            input,
            out,
            given,
            put,
        })
    }

    /// Runs `stage` of `module` (on `device`, the one `module` lives on) on `input` and
    /// `side`, then refuses what its forward did wrong ([`check_unit`](Self::check_unit)).
    #[allow(clippy::too_many_arguments)]
    fn run_unit(
        &self,
        stage: usize,
        module: &S::Module,
        log: &ReadLog,
        input: Option<Tensor<D>>,
        side: &mut Side,
        batch: &S::Batch,
        device: &Device,
    ) -> Result<Flow<D>, ShardError> {
        side.enter(&self.plan.units[stage].name);
        let out = self
            .stages
            .forward(module, stage, input, side, batch, device);
        self.check_unit(stage, log, side.take_misuse())?;
        Ok(out)
    }

    /// A backward visit: the stage's graph (kept by its forward visit, or recomputed with
    /// autodiff from its saved input), backpropagated from the loss (last stage) or from the
    /// upstream gradient, and from the gradients of the side tensors it put.
    fn backward_visit(
        &self,
        v: Visit,
        full: Vec<Tensor<1>>,
        batch: &S::Batch,
        state: &mut StepState<S::Module, D>,
    ) -> Result<(), ShardError> {
        let k = self.plan.units.len();
        let needs = &self.plan.units[v.stage].needs;
        let graph = match state.graphs[v.stage].take() {
            Some(kept) => kept,
            None => {
                let graph = self.unit_forward(v, full, batch, state, true)?;
                let forward = state
                    .forward_outputs
                    .as_mut()
                    .filter(|_| v.micro == 0)
                    .and_then(|o| o[v.stage].take());
                if let Some(forward) = forward {
                    self.check_recompute(v.stage, forward, &graph)?;
                }
                graph
            }
        };
        let Graph {
            module,
            input,
            out,
            given,
            put,
        } = graph;
        let mut objective = match (out, v.stage + 1 == k) {
            (Flow::Loss(l), true) => {
                state.micro_losses[v.micro] += scalar(l.clone().without_autodiff())?;
                l
            }
            (Flow::Hidden(h), false) => {
                let up = state
                    .upstream
                    .take()
                    .ok_or_else(|| self.unused_input(v.stage + 1))?;
                (h * up.autodiff()).sum()
            }
            (Flow::Aux(h, aux), false) => {
                let up = state
                    .upstream
                    .take()
                    .ok_or_else(|| self.unused_input(v.stage + 1))?;
                (h * up.autodiff()).sum() + aux
            }
            _ => return Err(self.flow_error(v.stage)),
        };
        // The side tensors this stage put reach the stages that read them: their summed
        // gradients flow back through this stage's graph too.
        for e in put {
            if let Some(g) = state.side_grads.remove(&e.name).flatten() {
                objective = objective + (e.value * g.autodiff()).sum();
            }
        }
        let grads_ad = objective.backward();
        let mut g = grads_of(&module, &grads_ad, &self.numels);
        state.upstream = match input {
            Some(x) => Some(
                x.grad(&grads_ad)
                    .ok_or_else(|| self.unused_input(v.stage))?,
            ),
            None => None,
        };
        for e in given {
            if let Some(grad) = e.value.grad(&grads_ad) {
                add_to(state.side_grads.entry(e.name).or_default(), grad);
            }
        }
        state.sides.retain(|(by, _)| *by != v.stage);
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
        let (module, log) = self.module_with(&all, self.primary.clone(), true, true);
        let mut x: Option<Tensor<D>> = None;
        let mut loss = None;
        let mut aux_sum: Option<Tensor<1>> = None;
        let mut side = Side::default();
        for stage in 0..k {
            self.seed_draws(micro, state.accum, stage);
            let out = self.run_unit(
                stage,
                &module,
                &log,
                x.take(),
                &mut side,
                batch,
                &self.autodiff,
            )?;
            match out {
                Flow::Hidden(h) if stage + 1 < k => x = Some(h),
                Flow::Aux(h, aux) if stage + 1 < k => {
                    x = Some(h);
                    add_to(&mut aux_sum, aux);
                }
                Flow::Loss(l) if stage + 1 == k => loss = Some(l),
                _ => return Err(self.flow_error(stage)),
            }
        }
        drop(side);
        let loss = loss.expect("the last stage returned the loss");
        // Auxiliary losses join in forward order, as the units' own sum would.
        let loss = match aux_sum {
            Some(aux) => aux + loss,
            None => loss,
        };
        state.micro_losses[micro] = scalar(loss.clone().without_autodiff())?;
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

    /// The gradients' end on every rank: combined over micro-batches and ranks as the step's
    /// loss is ([`StepLoss`]), the global norm over the optimizer group, the step's loss over
    /// the world. Returns the gradient shards, the loss, the norm and the seconds its
    /// collectives took.
    fn close_gradients(
        &mut self,
        state: StepState<S::Module, D>,
    ) -> Result<(Vec<Tensor<1>>, f64, f64, f64), ShardError> {
        let accum = state.micro_losses.len();
        let world_size = self.plan.topology.world_size();
        // The reductions average over the ranks; micro-batches' gradients are summed.
        let factor = match self.step_loss {
            StepLoss::Mean => 1.0 / accum as f64,
            StepLoss::Sum => world_size as f64,
        };
        let grads: Vec<Tensor<1>> = state
            .grads
            .into_iter()
            .map(|g| g.expect("every unit's gradient was reduced"))
            .map(|g| {
                if factor != 1.0 {
                    crate::transport::host::scale(g, factor)
                } else {
                    g
                }
            })
            .collect();
        let sq: f64 = grads
            .iter()
            .map(crate::transport::host::sum_of_squares)
            .sum::<Result<f64, ShardError>>()?;
        let cfg = &self.plan.config;
        let closing = Instant::now();
        let sq = route::sum_over(self.comm, self.plan.group(cfg.optimizer()), sq as f32)? as f64;
        let local_loss = state.micro_losses.iter().sum::<f64>();
        let world = self.plan.group(Span(self.plan.topology.depth()));
        let summed = route::sum_over(self.comm, world, local_loss as f32)? as f64;
        let loss = match self.step_loss {
            StepLoss::Mean => summed / (world_size * accum) as f64,
            StepLoss::Sum => summed,
        };
        let closing_s = closing.elapsed().as_secs_f64();
        let norm = sq.sqrt();
        if !loss.is_finite() || !norm.is_finite() {
            return Err(ShardError::Diverged { loss, norm });
        }
        Ok((grads, loss, norm, closing_s))
    }

    /// The skeleton with the parameters of `units` set from their gathered flat buffers
    /// (views into them: nothing is copied, unless the modules compute in f32 over bf16
    /// parameters: then each buffer is widened once), on the autodiff device when `autodiff`;
    /// and the log of the other parameters the module's user reads (`load_logged`).
    fn module_with(
        &self,
        units: &[usize],
        full: Vec<Tensor<1>>,
        autodiff: bool,
        require_grad: bool,
    ) -> (S::Module, ReadLog) {
        let mut values = HashMap::new();
        let dtype = self.module_dtype();
        for (&u, flat) in units.iter().zip(full) {
            let flat = crate::transport::host::cast(flat, dtype);
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
        let log = ReadLog::default();
        let module = load_logged(
            self.skeleton.clone(),
            &mut values,
            &self.shapes,
            device,
            require_grad,
            dtype,
            &log,
        );
        (module, log)
    }

    /// Refuses what stage `stage`'s forward just did wrong: read a parameter of a unit it does
    /// not declare (`log`), or misuse its side tensors (`misuse`).
    fn check_unit(
        &self,
        stage: usize,
        log: &ReadLog,
        misuse: Vec<String>,
    ) -> Result<(), ShardError> {
        let unit = &self.plan.units[stage].name;
        if let Some(path) = log.read().first() {
            let owner = self
                .plan
                .units
                .iter()
                .position(|u| u.params.iter().any(|p| &p.name == path));
            let owner = match owner {
                Some(o) => format!(
                    "which belongs to unit `{}` (unit {o}), not one it reads: a unit reads its \
                     own parameters and those of the units its declaration names with \
                     `using` (`UnitDecl::new(\"{unit}\", ..).using(&[{o}])`); with \
                     `Shard::blocks` or `Shard::embed`, a block reads its own block's, and the \
                     embed, then and loss pieces read the root's",
                    self.plan.units[o].name
                ),
                None => "which is not a parameter of the model".to_string(),
            };
            return Err(ShardError::Model(format!(
                "unit `{unit}` read parameter `{path}`, {owner}"
            )));
        }
        if let Some(m) = misuse.into_iter().next() {
            return Err(ShardError::Model(m));
        }
        Ok(())
    }

    /// Refuses a unit whose recomputed forward (backward's) gave other outputs than its
    /// forward visit: its gradients would not be those of the loss. Both ran on the same
    /// input, parameters, side tensors and batch, with the device's generator seeded alike, so
    /// only the arithmetic's rounding may differ (a kernel fused otherwise); a difference
    /// beyond [`rounding_tolerance`] of the output's largest magnitude is not rounding.
    fn check_recompute(
        &self,
        stage: usize,
        forward: Outputs<D>,
        again: &Graph<S::Module, D>,
    ) -> Result<(), ShardError> {
        let unit = &self.plan.units[stage].name;
        let (hidden, aux) = match &again.out {
            Flow::Hidden(h) => (h.clone(), None),
            Flow::Aux(h, aux) => (h.clone(), Some(aux.clone())),
            Flow::Loss(_) => return Ok(()),
        };
        let mut pairs: Vec<(String, Tensor<1>, Tensor<1>)> = vec![(
            "its output".into(),
            flat(forward.hidden),
            flat(hidden.without_autodiff()),
        )];
        if let (Some(a), Some(b)) = (forward.aux, aux) {
            pairs.push(("its auxiliary loss".into(), a, b.without_autodiff()));
        }
        for e in forward.put {
            if let Some(b) = again.put.iter().find(|b| b.name == e.name) {
                pairs.push((
                    format!("side tensor `{}`", e.name),
                    e.value,
                    b.value.clone().without_autodiff(),
                ));
            }
        }
        for (what, a, b) in pairs {
            if let Some(m) = impurity(&what, a, b)? {
                return Err(ShardError::Model(format!(
                    "unit `{unit}` gave other values when backward ran its forward again: \
                     {m}. Backward recomputes each unit, so a unit's forward must give the same \
                     values from the same parameters, input, side tensors and batch. The \
                     device's generator is seeded alike for both runs, so Burn's Dropout and \
                     Tensor::random draw the same; randomness from elsewhere (a generator of \
                     one's own), state kept between calls, or a layer that computes otherwise \
                     with autodiff does not: draw from the device's generator, or keep every \
                     unit's graph (a ShardConfig whose recompute is Recompute::None)"
                )));
            }
        }
        Ok(())
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
                    parts.push(t);
                }
                None => parts.push(Tensor::zeros([p.numel], &self.device)),
            }
        }
        if unit.padded > unit.numel {
            parts.push(Tensor::zeros([unit.padded - unit.numel], &self.device));
        }
        crate::transport::host::concat_f32(parts)
    }

    /// Unit `u` whole, gathered from its primary partition on the calling thread.
    fn gather_here(&self, u: usize) -> Result<Tensor<1>, ShardError> {
        let no_copies = route::Secondaries::new(self.plan.units.len());
        let shards = route::HostShards::new(self.plan.units.len());
        let (tx, rx) = std::sync::mpsc::channel();
        route::gather_flow(
            &self.plan,
            self.comm.rank(),
            u,
            Source::Primary,
            &self.primary[u],
            &no_copies,
            &shards,
            &self.device,
            move |r| {
                let _ = tx.send(r);
            },
        )?
        .run_here(self.comm)?;
        rx.recv()
            .unwrap_or_else(|_| unreachable!("a flow run here delivers"))
    }

    fn flow_error(&self, stage: usize) -> ShardError {
        ShardError::Model(format!(
            "unit `{}` returned the wrong kind of output: every unit but the last must return \
             Flow::Hidden (or Flow::Aux) and the last Flow::Loss",
            self.plan.units[stage].name
        ))
    }

    /// A unit whose output does not depend on the input it was given: no gradient can reach
    /// the units before it.
    fn unused_input(&self, stage: usize) -> ShardError {
        ShardError::Model(format!(
            "unit `{}` does not use its input: its output must be computed from the tensor the \
             unit before it returned, or no gradient reaches that unit",
            self.plan.units[stage].name
        ))
    }
}

/// `x` flattened.
fn flat<const N: usize>(x: Tensor<N>) -> Tensor<1> {
    let n: usize = x.dims().iter().product();
    x.reshape([n])
}

/// The largest difference between a unit's output and its recompute that is rounding, as a
/// share of the output's largest magnitude: two units in the last place of the output's dtype,
/// and never less than 2^-14 (f32's rounding, summed in another order by a kernel fused
/// otherwise, stays below it). So 2^-14 in f32, 2^-6 in bf16, 2^-9 in f16.
pub fn rounding_tolerance(dtype: DType) -> f64 {
    let ulp = match dtype {
        DType::F64 => 2f64.powi(-52),
        DType::F16 => 2f64.powi(-10),
        DType::BF16 => 2f64.powi(-7),
        _ => 2f64.powi(-23),
    };
    (2.0 * ulp).max(2f64.powi(-14))
}

/// `None` when `again` equals `first` within rounding ([`rounding_tolerance`] of `first`'s
/// dtype), else what differs, for a message.
fn impurity(what: &str, first: Tensor<1>, again: Tensor<1>) -> Result<Option<String>, ShardError> {
    let tolerance = rounding_tolerance(first.dtype());
    let first = first.cast(DType::F32);
    let again = again.cast(DType::F32);
    let scale = scalar(crate::reduce::max(first.clone().abs()))?;
    let diff = scalar(crate::reduce::max((first - again).abs()))?;
    // A forward that is not finite says nothing about purity (training diverged).
    if !scale.is_finite() || diff <= tolerance * scale {
        return Ok(None);
    }
    Ok(Some(format!(
        "{what} differs by up to {diff:.3e} against a largest magnitude of {scale:.3e}, beyond \
         rounding ({tolerance:.1e} of it)"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    #[test]
    fn rounding_is_two_units_in_the_last_place_and_never_below_2_to_the_minus_14() {
        assert_eq!(rounding_tolerance(DType::F32), 2f64.powi(-14));
        assert_eq!(rounding_tolerance(DType::BF16), 2f64.powi(-6));
        assert_eq!(rounding_tolerance(DType::F16), 2f64.powi(-9));
        // In bf16, at a largest magnitude of 4: 1/16 is rounding, 1/8 is not.
        let device = Device::flex();
        let x = || Tensor::<1>::from_floats([1.0, -2.0, 0.5, 4.0], &device).cast(DType::BF16);
        let shifted = |by: f64| x() + by;
        assert_eq!(impurity("out", x(), x()).unwrap(), None);
        assert_eq!(impurity("out", x(), shifted(0.03)).unwrap(), None);
        let m = impurity("out", x(), shifted(0.125))
            .unwrap()
            .expect("beyond rounding");
        assert!(m.contains("out differs by up to 1.250e-1"), "{m}");
        // A recompute that is not finite is refused; a forward that is not says nothing.
        let nan = Tensor::<1>::from_floats([1.0, f32::NAN, 0.5, 4.0], &device);
        assert!(
            impurity("out", x().cast(DType::F32), nan.clone())
                .unwrap()
                .is_some()
        );
        assert_eq!(impurity("out", nan, x().cast(DType::F32)).unwrap(), None);
    }
}
