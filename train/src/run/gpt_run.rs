//! The GPT as the training loop's [`Trainee`]: partitioned by `ember-sharding` over the job's
//! ranks (one process is a world of one under `ddp`), each rank drawing its share of the
//! global batch, so the same flags give the same global batch and loss sequence at any world
//! size. Also what building, saving and resharding it take.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use burn::tensor::Device;
use ember_comm::Comm;
use ember_data::{Batch, BatchPlan, STREAM_TRAIN, STREAM_VAL, Sampler};
use ember_sharding::{
    AdamW, Checkpoint, DecayOn, Layout, PendingSave, Plan, SaveOptions, ShardConfig, ShardError,
    ShardedModel, StepHyper, StepReport,
};

use crate::error::InitFromMismatch;
use crate::files::checkpoint::RunRecord;
use crate::files::export::HfDir;
use crate::files::metrics::{StepMetrics, StepSplit};
use crate::log0;
use crate::run::config::TrainConfig;
use crate::run::host_memory::{gather_u64, rss_peaks, set_allocator_for_training};
use crate::run::run_loop::{Saved, Stepped, Trainee};
use crate::run::schedule::LrSchedule;
use crate::run::setup::{Resumed, RunSetup, batch_plan};
use crate::run::stages::{GptStages, SeededGpt};

/// How every random draw of a run is derived, recorded in its checkpoints.
pub const RNG_SCHEME: &str = "weights: splitmix64/Box-Muller keyed by (seed, parameter path); \
     batches: ember_data::window_start(seed, stream, step, global sample) split by BatchPlan \
     over ranks and micro-batches; dropout: masks hashed from (splitmix64(seed ^ \
     splitmix64(step)), global sample, site, element)";

/// A GPT training on this job's ranks.
pub struct GptRun<'c, 'd> {
    sharded: ShardedModel<'c, GptStages, 3>,
    config: TrainConfig,
    setup: &'d RunSetup,
    batches: BatchPlan,
    plan_bytes: u64,
    /// The plan's crossings per step, on a device with memory of its own.
    plan_staging: Option<ember_sharding::StagedBytes>,
    last: Option<StepReport>,
    /// Whether checkpoints are written in the background (`--async-save`, as settled by the
    /// memory check).
    background_saves: bool,
    /// The checkpoint being written in the background, if any.
    pending: Option<PendingSave>,
    /// The first step this run trains and the tokens behind it.
    pub start: (u64, u64),
}

impl std::fmt::Debug for GptRun<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GptRun")
            .field("sharded", &self.sharded)
            .field("start", &self.start)
            .finish_non_exhaustive()
    }
}

impl<'c, 'd> GptRun<'c, 'd> {
    /// Builds the run `setup` resolved, partitioned per `shard` over `comm`: from its
    /// checkpoint, its Hugging Face directory, or the seed.
    pub fn start(comm: &'c Comm, setup: &'d mut RunSetup, plan: Plan) -> Result<Self> {
        let rank = comm.rank();
        let world = comm.topology().world_size();
        let c = setup.config.clone();
        set_allocator_for_training(world, c.device.is_cubecl());
        let memory = plan.memory(c.grad_accum);
        let checkpoint = match &setup.resume {
            Some(r) => Some(Checkpoint::open(comm, &r.dir)?),
            None => None,
        };
        let sharded = build(
            comm,
            &c,
            plan,
            setup.device.clone(),
            checkpoint.as_ref(),
            setup.init.as_mut(),
        )?;
        let start = match (&checkpoint, &setup.resume) {
            (Some(k), Some(r)) => {
                let m = k.manifest();
                log0!(
                    rank,
                    "resumed {} (step {}, saved by a job of {} rank{}{}) into {} over {}{}",
                    k.dir().display(),
                    m.step,
                    m.world_size,
                    if m.world_size == 1 { "" } else { "s" },
                    m.shard
                        .as_ref()
                        .map_or(String::new(), |s| format!(" with {}", s.preset)),
                    sharded.plan().config.preset,
                    comm.topology(),
                    match (
                        sharded.plan().config.error_feedback(),
                        sharded.restored_residuals()
                    ) {
                        (true, true) => "; error-feedback residuals restored",
                        (true, false) => {
                            "; error-feedback residuals start at zero (another layout)"
                        }
                        (false, _) => "",
                    }
                );
                (m.step, r.record.data.tokens_seen)
            }
            _ => (0, 0),
        };
        if world > 1 {
            use crate::run::config::DeviceKind;
            let gpu = match c.device {
                DeviceKind::Flex | DeviceKind::Ndarray => None,
                DeviceKind::Wgpu => Some(ember_comm::GpuMemory::Wgpu),
                DeviceKind::Cuda(_) => Some(ember_comm::GpuMemory::Cuda),
                DeviceKind::Rocm(_) => Some(ember_comm::GpuMemory::Rocm),
            };
            log0!(
                rank,
                "collectives through {}: {}",
                comm.library_version(),
                comm.device_memory().crossing(gpu)
            );
            log0!(
                rank,
                "sharding {} over {} ({world} ranks): per rank {:.2} MB params, {:.2} MB \
                 secondary, {:.2} MB grads, {:.2} MB optimizer, {:.2} MB working set at its peak \
                 (gathered units, gradients in flight, activations): {:.2} MB in all",
                sharded.plan().config.preset,
                comm.topology(),
                memory.params as f64 / 1e6,
                memory.secondary as f64 / 1e6,
                memory.grads as f64 / 1e6,
                memory.optimizer as f64 / 1e6,
                memory.working_peak as f64 / 1e6,
                memory.total() as f64 / 1e6
            );
        }
        let plan_staging = c
            .device
            .is_cubecl()
            .then(|| sharded.plan().staging(c.grad_accum));
        Ok(Self {
            batches: batch_plan(&c, world, rank)?,
            config: c,
            setup,
            sharded,
            plan_bytes: memory.total(),
            plan_staging,
            last: None,
            background_saves: false,
            pending: None,
            start,
        })
    }

    /// Writes checkpoints other than the last in the background from now on (`on`), or
    /// before the next step.
    pub fn write_in_background(&mut self, on: bool) {
        self.background_saves = on;
    }

    /// The partitioned model.
    pub fn sharded(&self) -> &ShardedModel<'c, GptStages, 3> {
        &self.sharded
    }

    /// The plan's per-rank total.
    pub fn plan_bytes(&self) -> u64 {
        self.plan_bytes
    }

    /// The report of the last step trained, traffic included.
    pub fn last_report(&self) -> Option<&StepReport> {
        self.last.as_ref()
    }
}

impl Trainee for GptRun<'_, '_> {
    fn step(&mut self, step: u64) -> Result<Stepped> {
        let c = &self.config;
        let sampler = Sampler::new(&self.setup.data.train, c.block_size, c.seed, STREAM_TRAIN)?;
        let batches: Vec<Batch> = (0..self.batches.grad_accum())
            .map(|m| sampler.batch(step, self.batches.samples(m)))
            .collect();
        let hyper = step_hyper(c, step);
        let report = self.sharded.train_step(&batches, &hyper)?;
        let stepped = Stepped {
            loss: report.loss,
            grad_norm: report.grad_norm,
            lr: hyper.lr,
            step_s: report.step_s,
            comm_wait_s: report.comm_wait_s,
        };
        self.last = Some(report);
        Ok(stepped)
    }

    fn val_loss(&mut self) -> Result<f64> {
        let c = &self.config;
        let comm = self.sharded.comm();
        let (rank, world) = (comm.rank(), comm.topology().world_size());
        let sampler = Sampler::new(&self.setup.data.val, c.block_size, c.seed, STREAM_VAL)?;
        // The eval micro-batch is split over the ranks when it divides, else every rank
        // scores all of it: the same number at any world size.
        let mb = c.micro_batch();
        let (lo, hi) = if mb.is_multiple_of(world) {
            let share = mb / world;
            (rank * share, (rank + 1) * share)
        } else {
            (0, mb)
        };
        let mut total = 0.0;
        for i in 0..c.eval_iters {
            total += self
                .sharded
                .eval_loss(&sampler.batch(i, lo as u64..hi as u64))?;
        }
        let local = total / c.eval_iters as f64;
        let sum = ember_sharding::plumbing::engine::all_ranks_sum(comm, local as f32)?;
        comm.take_counters();
        Ok(sum as f64 / world as f64)
    }

    fn save(&mut self, steps: u64, tokens_seen: u64, last: bool) -> Result<Saved> {
        let start = Instant::now();
        let comm = self.sharded.comm();
        // One checkpoint in flight at a time: an earlier one is finished first.
        let waited = match self.pending.take() {
            Some(p) => {
                let dir = p.dir().to_path_buf();
                let step = p.step();
                p.wait(comm).with_context(|| {
                    format!(
                        "the checkpoint of step {step}, written in the background, was not \
                         completed; earlier checkpoints are untouched"
                    )
                })?;
                Some((dir, start.elapsed().as_secs_f64()))
            }
            None => None,
        };
        let options = save_options(
            &self.config,
            steps,
            tokens_seen,
            &self.setup.data.dir.join("tokenizer.json"),
            self.setup.data.tokenizer.sha256(),
        );
        let start = Instant::now();
        if self.background_saves && !last {
            let pending = self
                .sharded
                .save_async(&self.config.out_dir, &options)
                .with_context(|| format!("starting the checkpoint of step {steps}"))?;
            let saved = Saved {
                dir: pending.dir().to_path_buf(),
                blocked_s: start.elapsed().as_secs_f64(),
                staged_bytes: pending.staged_bytes(),
                waited: waited.filter(|(_, s)| *s > 0.01),
            };
            self.pending = Some(pending);
            return Ok(saved);
        }
        let dir = save(&self.sharded, &self.config.out_dir, &options)?;
        Ok(Saved {
            dir,
            blocked_s: start.elapsed().as_secs_f64(),
            staged_bytes: 0,
            waited: waited.filter(|(_, s)| *s > 0.01),
        })
    }

    fn observe(&mut self, m: &mut StepMetrics) -> Result<()> {
        let comm = self.sharded.comm();
        let world = comm.topology().world_size();
        if let Some(r) = &self.last
            && world > 1
        {
            m.comm_bytes = Some(traffic_by_name(comm, &r.traffic));
            m.comm_wait_frac = Some(r.comm_wait_s / r.step_s.max(1e-9));
            m.plan_bytes = Some(self.plan_bytes);
            m.staging_s = Some(r.staging.seconds());
            m.staging_frac = Some(r.staging.seconds() / r.step_s.max(1e-9));
            m.staging_bytes = Some(r.staging.to_host_bytes + r.staging.to_device_bytes);
            m.plan_staging = self.plan_staging;
            let off = r.traffic.off_gpu();
            let split = StepSplit::new(r.step_s, r.comm_wait_s, &r.staging);
            let words = 2 + StepSplit::WORDS;
            let mut mine = Vec::with_capacity(8 * words);
            mine.extend_from_slice(&off.bytes.to_le_bytes());
            mine.extend_from_slice(&off.nanos.to_le_bytes());
            for w in split.to_words() {
                mine.extend_from_slice(&w);
            }
            let all = comm.world().all_gather(&mine)?;
            let mut ranks = Vec::with_capacity(world);
            let mut splits = Vec::with_capacity(world);
            for c in all.chunks_exact(8 * words) {
                let w: Vec<[u8; 8]> = c
                    .chunks_exact(8)
                    .map(|w| w.try_into().expect("8 bytes"))
                    .collect();
                let s = StepSplit::from_words(w[2..].try_into().expect("the split's words"));
                ranks.push((s.step_s, u64::from_le_bytes(w[0]), u64::from_le_bytes(w[1])));
                splits.push(s);
            }
            m.stragglers = crate::files::metrics::Stragglers::new(&ranks);
            m.step_split = Some(splits);
        }
        m.rss_peak_bytes = Some(rss_peaks(comm)?);
        if let Some(b) = self.last.as_ref().and_then(|r| r.device_bytes) {
            m.device_bytes = Some(gather_u64(comm, b)?);
        }
        if let Some(b) = self.last.as_ref().and_then(|r| r.device_reserved_bytes) {
            m.device_reserved_bytes = Some(gather_u64(comm, b)?);
        }
        Ok(())
    }

    fn rank(&self) -> usize {
        self.sharded.comm().rank()
    }

    fn ranks(&self) -> usize {
        self.sharded.comm().topology().world_size()
    }

    fn arithmetic(&self) -> ember_sharding::Compute {
        self.sharded.plan().module_dtype
    }
}

/// The sharded GPT of `c` over `comm`, its weights from `resume` (a verified checkpoint,
/// moments included), `init` (a Hugging Face directory) or the seed. Only the skeleton of the
/// model is built (its parameters stay lazy); each rank reads or draws only its own ranges.
pub fn build<'c>(
    comm: &'c Comm,
    c: &TrainConfig,
    layout: impl Into<Layout>,
    device: Device,
    resume: Option<&Checkpoint>,
    init: Option<&mut HfDir>,
) -> Result<ShardedModel<'c, GptStages, 3>> {
    let skeleton = c.model.init_with_seed(c.seed, &device)?;
    let layout = layout.into();
    let stages = GptStages {
        n_layer: c.model.n_layer,
        seed: c.seed,
    };
    Ok(match (resume, init) {
        (Some(checkpoint), _) => {
            ShardedModel::resume(comm, stages, skeleton, layout, device, checkpoint)?
        }
        (None, Some(hf)) => {
            ShardedModel::new(comm, stages, skeleton, layout, device, hf).map_err(|e| match e {
                ShardError::Source(msg) => anyhow::Error::new(InitFromMismatch(msg)),
                other => other.into(),
            })?
        }
        (None, None) => {
            let mut source = SeededGpt {
                config: &c.model,
                seed: c.seed,
            };
            ShardedModel::new(comm, stages, skeleton, layout, device, &mut source)?
        }
    })
}

/// The hyper-parameters of optimizer step `step`: the scheduled learning rate, clipping and
/// AdamW.
pub fn step_hyper(c: &TrainConfig, step: u64) -> StepHyper {
    let schedule = LrSchedule {
        lr: c.lr,
        min_lr: c.min_lr,
        warmup_iters: c.warmup_iters,
        lr_decay_iters: c.lr_decay_iters,
    };
    StepHyper {
        lr: schedule.at(step),
        grad_clip: c.grad_clip,
        optimizer: AdamW {
            beta1: c.beta1,
            beta2: c.beta2,
            eps: 1e-8,
            weight_decay: c.weight_decay,
            decay_on: DecayOn::Matrices,
        },
    }
}

/// Per-step traffic as `"group/op" -> bytes sent`, groups named by the levels they span.
pub fn traffic_by_name(comm: &Comm, traffic: &ember_comm::Counters) -> BTreeMap<String, u64> {
    let topology = comm.topology();
    traffic
        .entries()
        .filter(|(_, _, t)| t.sent > 0)
        .map(|(scope, op, t)| {
            let levels = ember_sharding::plan::levels_of(scope, topology.depth());
            (format!("{}/{}", levels.name(topology), op.name()), t.sent)
        })
        .collect()
}

/// Writes a checkpoint of the model's step ([`ShardedModel::save`]): every writing rank its
/// own shard file (no rank gathers the model), rank 0 the tokenizer and the manifest. Every
/// rank must call it; a failure on any rank fails every rank and leaves earlier checkpoints
/// untouched.
pub fn save(
    sharded: &ShardedModel<'_, GptStages, 3>,
    out_dir: &Path,
    options: &SaveOptions,
) -> Result<PathBuf> {
    let step = sharded.step();
    sharded.save(out_dir, options).with_context(|| {
        format!(
            "the checkpoint of step {step} was not completed; earlier checkpoints are untouched"
        )
    })
}

/// What ember records in a checkpoint of step `step` of run `c`, with its tokenizer (copied
/// in) and that tokenizer's checksum.
pub fn save_options(
    c: &TrainConfig,
    step: u64,
    tokens_seen: u64,
    tokenizer: &Path,
    tokenizer_sha256: String,
) -> SaveOptions {
    SaveOptions {
        app: RunRecord::new(c, step, tokens_seen, RNG_SCHEME, tokenizer_sha256).app(),
        files: vec![tokenizer.to_path_buf()],
        keep_last: c.keep_last as usize,
    }
}

/// `ember reshard`: loads `resumed` into this job's partition and writes it again under
/// `c.out_dir`, unchanged in value: the same step, weights, moments and data position. Every
/// rank must call it; each reads only its own ranges.
pub fn reshard(
    comm: &Comm,
    resumed: &Resumed,
    c: &TrainConfig,
    shard: ShardConfig,
) -> Result<PathBuf> {
    let checkpoint = Checkpoint::open(comm, &resumed.dir)?;
    let step = checkpoint.manifest().step;
    let options = save_options(
        c,
        step,
        resumed.record.data.tokens_seen,
        &checkpoint.dir().join("tokenizer.json"),
        resumed.record.tokenizer_sha256.clone(),
    );
    let sharded = build(comm, c, shard, Device::flex(), Some(&checkpoint), None)?;
    save(&sharded, &c.out_dir, &options)
}
