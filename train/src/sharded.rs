//! `ember train --shard PRESET` under `mpirun`: the GPT partitioned by `ember-sharding` over
//! the ranks' topology. Each data-parallel rank draws its share of the global batch, so the
//! same flags give the same global batch and loss sequence at any world size. Rank 0 logs and
//! writes `metrics.jsonl` (with bytes per level and the communication wait share) and
//! `loss.png`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow};
use burn::tensor::Device;
use clap::Args;
use ember_comm::{Comm, CommConfig, PanicPolicy, Topology, TopologySource};
use ember_data::{BatchPlan, PreparedData, STREAM_TRAIN, STREAM_VAL, Sampler};
use ember_sharding::plan::Levels;
use ember_sharding::{
    AdamConfig, Compute, GradQuant, ShardConfig, ShardedModel, Span, StepHyper, WeightQuant,
};

use crate::config::{Dtype, TrainConfig};
use crate::device::peak_flops;
use crate::error::{CliResult, usage};
use crate::log0;
use crate::metrics::{MetricsWriter, StepMetrics, progress_bar};
use crate::optim::LrSchedule;
use crate::stages::{GptStages, TokenBatch};

/// Flags of sharded training (all need `--shard`).
#[derive(Debug, Clone, Default, Args)]
pub struct ShardArgs {
    /// Shard over the MPI ranks with this preset: ddp, zero1, zero2, zero3, zeropp, hier3
    /// (run under mpirun; one process without it is a world of one)
    #[arg(long, value_name = "PRESET")]
    pub shard: Option<String>,
    /// Rank layout NODESxGPUSxGCDS, e.g. 2x2x2 for 8 ranks [default: detected: nodes from
    /// shared memory, GCDs per GPU from EMBER_GCDS_PER_GPU or 1]
    #[arg(long)]
    pub topology: Option<String>,
    /// Secondary parameter copy for backward and later micro-batches: none, gcd (a whole
    /// copy per rank), gpu (split over the GCDs of a GPU), node (split over the node)
    #[arg(long)]
    pub secondary: Option<String>,
    /// Weight quantization of parameter gathers: off, int8
    #[arg(long)]
    pub quantize_weights: Option<String>,
    /// Gradient quantization of the reduce-scatter: off, int4, int8
    #[arg(long)]
    pub quantize_grads: Option<String>,
    /// Units gathered ahead of the one computing [default: 1]
    #[arg(long)]
    pub prefetch: Option<usize>,
    /// Keep each rank's gradient quantization error and add it back next step (LoCo-style)
    #[arg(long)]
    pub error_feedback: bool,
    /// Elements per quantization block [default: 2048]
    #[arg(long)]
    pub quant_block: Option<usize>,
    /// Abort the job when a collective waits longer than this many seconds
    #[arg(long, default_value_t = 300.0)]
    pub comm_timeout: f64,
}

impl ShardArgs {
    /// Refuses sharding flags given without `--shard`.
    pub fn check_unused(&self) -> CliResult<()> {
        let given = [
            ("--topology", self.topology.is_some()),
            ("--secondary", self.secondary.is_some()),
            ("--quantize-weights", self.quantize_weights.is_some()),
            ("--quantize-grads", self.quantize_grads.is_some()),
            ("--prefetch", self.prefetch.is_some()),
            ("--error-feedback", self.error_feedback),
            ("--quant-block", self.quant_block.is_some()),
        ];
        if let Some((flag, _)) = given.iter().find(|g| g.1) {
            return Err(usage(format!(
                "{flag} applies to sharded training: add --shard PRESET (e.g. --shard zero3)"
            )));
        }
        Ok(())
    }

    /// Starts MPI with the requested topology and timeout.
    pub fn init_comm(&self) -> CliResult<Comm> {
        if !(self.comm_timeout > 0.0 && self.comm_timeout.is_finite()) {
            return Err(usage(format!(
                "--comm-timeout {} must be a positive number of seconds",
                self.comm_timeout
            )));
        }
        let topology = match &self.topology {
            Some(spec) => TopologySource::Explicit(
                Topology::parse(spec).map_err(|e| usage(format!("--topology {spec}: {e}")))?,
            ),
            None => TopologySource::Detect { gcds_per_gpu: None },
        };
        Comm::init(CommConfig {
            topology,
            timeout: Duration::from_secs_f64(self.comm_timeout),
            panic_policy: PanicPolicy::AbortJob,
        })
        .map_err(|e| match &self.topology {
            Some(spec) => usage(format!("--topology {spec}: {e}")),
            None => usage(e.to_string()),
        })
    }

    /// The preset with the per-state flags applied, validated against `topology`.
    pub fn resolve(&self, topology: &Topology, dtype: Dtype) -> CliResult<ShardConfig> {
        let preset = self.shard.as_deref().unwrap_or("ddp");
        let mut c = ShardConfig::preset(preset, topology.depth())
            .map_err(|e| usage(format!("--shard: {e}")))?;
        if let Some(s) = &self.secondary {
            c.secondary = match s.as_str() {
                "none" => None,
                name => Some(
                    Span::parse(name, topology)
                        .map_err(|e| usage(format!("--secondary {name}: {e} (or none)")))?,
                ),
            };
        }
        if let Some(q) = &self.quantize_weights {
            c.quantize_weights = match q.as_str() {
                "off" => WeightQuant::Off,
                "int8" => WeightQuant::Int8,
                other => {
                    return Err(usage(format!(
                        "--quantize-weights {other}: use off or int8"
                    )));
                }
            };
        }
        if let Some(q) = &self.quantize_grads {
            c.quantize_grads = match q.as_str() {
                "off" => GradQuant::Off,
                "int4" => GradQuant::Int4,
                "int8" => GradQuant::Int8,
                other => {
                    return Err(usage(format!(
                        "--quantize-grads {other}: use off, int4 or int8"
                    )));
                }
            };
        }
        if let Some(p) = self.prefetch {
            c.prefetch = p;
        }
        if let Some(b) = self.quant_block {
            c.quant_block = b;
        }
        c.error_feedback = self.error_feedback;
        c.compute = match dtype {
            Dtype::F32 => Compute::F32,
            Dtype::Bf16 => Compute::Bf16,
        };
        c.validate(topology)
            .map_err(|e| usage(format!("--shard {preset}: {e}")))?;
        Ok(c)
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

/// Name of a plan group, as in metrics.
pub fn group_name(levels: Levels, topology: &Topology) -> String {
    levels.name(topology)
}

/// This rank's micro-batches of optimizer step `step`.
pub fn micro_batches(sampler: &Sampler<'_>, plan: &BatchPlan, step: u64) -> Vec<TokenBatch> {
    (0..plan.grad_accum())
        .map(|m| {
            let b = sampler.batch(step, plan.samples(m));
            TokenBatch {
                inputs: b.inputs,
                targets: b.targets,
                batch: b.batch,
                block: b.block,
            }
        })
        .collect()
}

/// The batch plan of this rank, refusing a global batch that does not divide.
pub fn batch_plan(c: &TrainConfig, world: usize, rank: usize) -> Result<BatchPlan> {
    BatchPlan::new(c.batch_size, c.grad_accum, world, rank).map_err(|_| {
        anyhow!(
            "--batch-size {} does not split into {} ranks x --grad-accum {}: the global batch \
             must be a multiple of {}",
            c.batch_size,
            world,
            c.grad_accum,
            world * c.grad_accum
        )
    })
}

/// Trains `config` sharded per `shard` over `comm` until `max_iters`.
pub fn run(
    comm: &Comm,
    config: &TrainConfig,
    shard: ShardConfig,
    device: Device,
    data: &PreparedData,
) -> Result<Vec<StepMetrics>> {
    let rank = comm.rank();
    let world = comm.topology().world_size();
    let c = config;
    let batch_plan = batch_plan(c, world, rank)?;
    let model = c.model.init_with_seed(c.seed, &device);
    let stages = GptStages {
        n_layer: c.model.n_layer,
    };
    let mut sharded = ShardedModel::new(comm, stages, model, shard, device)?;
    let memory = sharded.plan().memory(c.grad_accum);
    log0!(
        rank,
        "sharding {} over {} ({} ranks): per rank {:.2} MB params, {:.2} MB secondary, {:.2} MB \
         grads, {:.2} MB optimizer, {:.2} MB largest gathered",
        sharded.plan().config.preset,
        comm.topology(),
        world,
        memory.params as f64 / 1e6,
        memory.secondary as f64 / 1e6,
        memory.grads as f64 / 1e6,
        memory.optimizer as f64 / 1e6,
        memory.gathered_peak as f64 / 1e6
    );
    let schedule = LrSchedule {
        lr: c.lr,
        min_lr: c.min_lr,
        warmup_iters: c.warmup_iters,
        lr_decay_iters: c.lr_decay_iters,
    };
    let adam = AdamConfig {
        beta1: c.beta1,
        beta2: c.beta2,
        eps: 1e-8,
        weight_decay: c.weight_decay,
    };
    let sampler = Sampler::new(&data.train, c.block_size, c.seed, STREAM_TRAIN)?;
    let mut writer = if rank == 0 {
        Some(MetricsWriter::open(&c.out_dir, None)?)
    } else {
        None
    };
    let peak = peak_flops(c.device, c.peak_tflops);
    let flops_per_token = c.model.train_flops_per_token(c.block_size);
    let bar = progress_bar(c.max_iters, 0, rank);
    let start = Instant::now();
    let mut window = (0.0f64, 0u64);
    let mut logged = Vec::new();
    for step in 0..c.max_iters {
        let batches = micro_batches(&sampler, &batch_plan, step);
        let lr = schedule.at(step);
        let report = sharded.train_step(
            &batches,
            &StepHyper {
                lr,
                grad_clip: c.grad_clip,
                adam,
            },
        )?;
        window.0 += report.step_s;
        window.1 += c.tokens_per_step() as u64;
        let done = step + 1;
        let last = done == c.max_iters;
        let eval_now = c.eval_interval > 0 && (done.is_multiple_of(c.eval_interval) || last);
        let val_loss = if eval_now {
            Some(val_loss(&sharded, data, c, world, rank)?)
        } else {
            None
        };
        bar.set_position(done);
        bar.set_message(format!("loss {:.4}", report.loss));
        if done.is_multiple_of(c.log_interval) || eval_now || last {
            let tokens_per_s = window.1 as f64 / window.0.max(1e-9);
            let m = StepMetrics {
                step: done,
                loss: report.loss,
                lr,
                grad_norm: report.grad_norm,
                tokens_per_s,
                // Per-rank MFU: the job's throughput over the sum of the ranks' peaks.
                mfu: peak.map(|p| tokens_per_s * flops_per_token / (p * world as f64)),
                elapsed_s: start.elapsed().as_secs_f64(),
                val_loss,
                comm_bytes: Some(traffic_by_name(comm, &report.traffic)),
                comm_wait_frac: Some(report.comm_wait_s / report.step_s.max(1e-9)),
                model_state_bytes: Some(report.memory),
            };
            if let Some(w) = writer.as_mut() {
                w.write(&m)?;
            }
            let val = val_loss.map_or(String::new(), |v| format!(" val {v:.4}"));
            bar.suspend(|| {
                log0!(
                    rank,
                    "step {done:>6} loss {:.4}{val} lr {lr:.2e} norm {:.3} {tokens_per_s:.0} tok/s \
                     comm wait {:.0}%",
                    report.loss,
                    report.grad_norm,
                    100.0 * report.comm_wait_s / report.step_s.max(1e-9)
                )
            });
            logged.push(m);
            window = (0.0, 0);
        }
    }
    bar.finish_and_clear();
    Ok(logged)
}

/// Validation loss with the run's eval settings, the same number the single-process trainer
/// reports: the eval micro-batch is split over the ranks when it divides, else every rank
/// scores all of it.
fn val_loss(
    sharded: &ShardedModel<'_, GptStages, 3>,
    data: &PreparedData,
    c: &TrainConfig,
    world: usize,
    rank: usize,
) -> Result<f64> {
    let sampler = Sampler::new(&data.val, c.block_size, c.seed, STREAM_VAL)?;
    let mb = c.micro_batch();
    let (lo, hi) = if mb.is_multiple_of(world) {
        let share = mb / world;
        (rank * share, (rank + 1) * share)
    } else {
        (0, mb)
    };
    let mut total = 0.0;
    for i in 0..c.eval_iters {
        let b = sampler.batch(i, lo as u64..hi as u64);
        total += sharded.eval_loss(&TokenBatch {
            inputs: b.inputs,
            targets: b.targets,
            batch: b.batch,
            block: b.block,
        })?;
    }
    let local = total / c.eval_iters as f64;
    let comm = sharded.comm();
    let sum = ember_sharding::engine::all_ranks_sum(comm, local as f32)?;
    comm.take_counters();
    Ok(sum as f64 / world as f64)
}
