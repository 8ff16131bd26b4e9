//! `ember train --shard PRESET` under `mpirun`: the GPT partitioned by `ember-sharding` over
//! the ranks' topology. Each data-parallel rank draws its share of the global batch, so the
//! same flags give the same global batch and loss sequence at any world size. Rank 0 logs and
//! writes `metrics.jsonl` (with bytes per level and the communication wait share) and
//! `loss.png`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, ensure};
use burn::tensor::Device;
use clap::Args;
use ember_comm::{Comm, CommConfig, PanicPolicy, Topology, TopologySource};
use ember_data::{Batch, BatchPlan, PreparedData, STREAM_TRAIN, STREAM_VAL, Sampler};
use ember_sharding::plan::Levels;
use ember_sharding::{
    AdamConfig, Checkpoint, Compute, GradQuant, Plan, SaveOptions, ShardConfig, ShardedModel, Span,
    StepHyper, WeightQuant,
};

use crate::checkpoint::RunRecord;
use crate::config::{Dtype, TrainConfig};
use crate::device::peak_flops;
use crate::error::{CliResult, usage};
use crate::export::HfDir;
use crate::log0;
use crate::metrics::{MetricsWriter, StepMetrics, progress_bar};
use crate::optim::LrSchedule;
use crate::planning::gpt_plan;
use crate::stages::{GptStages, SeededGpt};
use ember_model::init::splitmix64;

/// Flags of sharded training. `train` refuses them without `--shard`; `bench shard` takes
/// them with `--shards`, and `--comm-timeout` also applies to `bench comm`.
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
    /// Elements per quantization block [default: 256]
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

/// The derivation of random state recorded in sharded checkpoints.
pub const SHARDED_RNG_SCHEME: &str = "weights: splitmix64/Box-Muller keyed by (seed, parameter path); \
     batches: ember_data::window_start(seed, stream, step, global sample) split by BatchPlan over \
     ranks; dropout: the device RNG is seeded before every unit's forward and recompute with \
     unit_seed(splitmix64(seed ^ splitmix64(step)) ^ splitmix64(rank + 1), micro-batch, unit)";

/// The hyper-parameters of optimizer step `step` on `rank`: the scheduled learning rate,
/// clipping, AdamW, and (with dropout) this rank's mask seed, a function of (seed, step,
/// rank) so a resumed run draws the same masks.
pub fn step_hyper(c: &TrainConfig, step: u64, rank: usize) -> StepHyper {
    let schedule = LrSchedule {
        lr: c.lr,
        min_lr: c.min_lr,
        warmup_iters: c.warmup_iters,
        lr_decay_iters: c.lr_decay_iters,
    };
    StepHyper {
        lr: schedule.at(step),
        grad_clip: c.grad_clip,
        adam: AdamConfig {
            beta1: c.beta1,
            beta2: c.beta2,
            eps: 1e-8,
            weight_decay: c.weight_decay,
        },
        dropout_seed: (c.model.dropout > 0.0)
            .then(|| splitmix64(c.seed ^ splitmix64(step)) ^ splitmix64(rank as u64 + 1)),
    }
}

/// The prepared data of `c` on every rank: rank 0 prepares (and caches) the tokens while
/// the others wait, then they read the cache.
pub fn load_data(comm: &Comm, c: &TrainConfig) -> CliResult<PreparedData> {
    if comm.rank() == 0 {
        let prepared = crate::data::load(c);
        comm.barrier();
        prepared
    } else {
        comm.barrier();
        crate::data::load(c)
    }
}

/// This rank's micro-batches of optimizer step `step`.
pub fn micro_batches(sampler: &Sampler<'_>, plan: &BatchPlan, step: u64) -> Vec<Batch> {
    (0..plan.grad_accum())
        .map(|m| sampler.batch(step, plan.samples(m)))
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

/// Every rank learns whether every rank's `result` is `Ok`; a failure on any rank fails all of
/// them within one collective, each naming the failing rank and its error.
pub fn all_ok<T>(comm: &Comm, result: Result<T>) -> Result<T> {
    let mine = result.as_ref().err().map(|e| format!("{e:#}"));
    match comm.agree(mine.as_deref()) {
        Ok(()) => result,
        Err(f) if f.rank == comm.rank() => result,
        Err(f) => Err(anyhow!("rank {} failed: {}", f.rank, f.message)),
    }
}

/// The sharded GPT of `c` over `comm`, its weights from `resume` (a verified checkpoint,
/// moments included), `init` (a Hugging Face directory) or the seed. Only the skeleton of the
/// model is built (its parameters stay lazy); each rank reads or draws only its own ranges.
pub fn build<'c>(
    comm: &'c Comm,
    c: &TrainConfig,
    shard: ShardConfig,
    device: Device,
    resume: Option<&Checkpoint>,
    init: Option<&mut HfDir>,
) -> Result<ShardedModel<'c, GptStages, 3>> {
    let skeleton = c.model.init_with_seed(c.seed, &device);
    let stages = GptStages {
        n_layer: c.model.n_layer,
    };
    Ok(match (resume, init) {
        (Some(checkpoint), _) => {
            ShardedModel::resume(comm, stages, skeleton, shard, device, checkpoint)?
        }
        (None, Some(hf)) => ShardedModel::new(comm, stages, skeleton, shard, device, hf)?,
        (None, None) => {
            let mut source = SeededGpt {
                config: &c.model,
                seed: c.seed,
            };
            ShardedModel::new(comm, stages, skeleton, shard, device, &mut source)?
        }
    })
}

/// The plan of `c`'s run with its activation estimate (what `ember plan` prints).
pub fn run_plan(c: &TrainConfig, topology: &Topology, shard: ShardConfig) -> Result<Plan> {
    gpt_plan(
        &c.model,
        topology,
        shard,
        c.batch_size,
        c.grad_accum,
        c.block_size,
    )
    .map_err(|e| anyhow!("{e}"))
}

/// Peak resident memory of every rank (rank 0 first), gathered to all.
pub fn rss_peaks(comm: &Comm) -> Result<Vec<u64>> {
    gather_u64(comm, ember_sharding::memory::resident().peak)
}

/// Every rank's `mine` (rank 0 first), gathered to all.
fn gather_u64(comm: &Comm, mine: u64) -> Result<Vec<u64>> {
    let all = comm.world().all_gather(&mine.to_le_bytes())?;
    Ok(all
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect())
}

/// Makes freed buffers of 1 MiB and more go back to the OS at once (glibc: a fixed
/// `M_MMAP_THRESHOLD`, which also stops glibc from raising the threshold as large blocks are
/// freed). A sharded step allocates and frees whole units of many megabytes; with glibc's
/// sliding threshold they land in the heap, and its holes kept each rank of gpt2-large at
/// 8 ranks 0.3 GB (17%) above its plan (measured: 2.14 GB against 1.76 GB with the fixed
/// threshold, plan 1.84 GB).
pub fn return_large_frees_to_the_os() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only sets an allocator parameter; no allocation is in flight.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}

/// Trains `config` sharded per `shard` over `comm` until `max_iters`.
pub fn run(
    comm: &Comm,
    config: &TrainConfig,
    shard: ShardConfig,
    device: Device,
    data: &PreparedData,
    resume: Option<&Path>,
    init: Option<&mut HfDir>,
) -> Result<Vec<StepMetrics>> {
    let rank = comm.rank();
    let world = comm.topology().world_size();
    let c = config;
    let batch_plan = batch_plan(c, world, rank)?;
    return_large_frees_to_the_os();
    let plan_bytes = run_plan(c, comm.topology(), shard.clone())?.memory(c.grad_accum);
    let checkpoint = match resume {
        Some(dir) => {
            let (checkpoint, run) = open_verified(comm, dir)?;
            ensure!(
                run.tokenizer_sha256 == data.tokenizer.sha256(),
                "{} was trained with another tokenizer than this data's; resume with the same \
                 --data and --tokenizer",
                dir.display()
            );
            Some((checkpoint, run))
        }
        None => None,
    };
    let mut sharded = build(
        comm,
        c,
        shard,
        device,
        checkpoint.as_ref().map(|(k, _)| k),
        init,
    )?;
    let (first_step, mut tokens_seen) = match &checkpoint {
        Some((checkpoint, run)) => {
            let m = checkpoint.manifest();
            log0!(
                rank,
                "resumed {} (step {}, saved by a job of {} ranks{}) into {} over {}{}",
                checkpoint.dir().display(),
                m.step,
                m.world_size,
                m.shard
                    .as_ref()
                    .map_or(String::new(), |s| format!(" with {}", s.preset)),
                sharded.plan().config.preset,
                comm.topology(),
                match (
                    sharded.plan().config.error_feedback,
                    sharded.restored_residuals()
                ) {
                    (true, true) => "; error-feedback residuals restored",
                    (true, false) => "; error-feedback residuals start at zero (another layout)",
                    (false, _) => "",
                }
            );
            (m.step, run.data.tokens_seen)
        }
        None => (0, 0),
    };
    drop(checkpoint);
    let memory = plan_bytes;
    log0!(
        rank,
        "sharding {} over {} ({} ranks): per rank {:.2} MB params, {:.2} MB secondary, {:.2} MB \
         grads, {:.2} MB optimizer, {:.2} MB working set at its peak (gathered units, gradients \
         in flight, activations): {:.2} MB in all",
        sharded.plan().config.preset,
        comm.topology(),
        world,
        memory.params as f64 / 1e6,
        memory.secondary as f64 / 1e6,
        memory.grads as f64 / 1e6,
        memory.optimizer as f64 / 1e6,
        memory.working_peak as f64 / 1e6,
        memory.total() as f64 / 1e6
    );
    let sampler = Sampler::new(&data.train, c.block_size, c.seed, STREAM_TRAIN)?;
    let mut writer = if rank == 0 {
        Some(MetricsWriter::open(
            &c.out_dir,
            (first_step > 0).then_some(first_step),
        )?)
    } else {
        None
    };
    let peak = peak_flops(c.device, c.peak_tflops);
    let flops_per_token = c.model.train_flops_per_token(c.block_size);
    let bar = progress_bar(c.max_iters, first_step, rank);
    let start = Instant::now();
    let mut window = (0.0f64, 0u64);
    let mut logged = Vec::new();
    for step in first_step..c.max_iters {
        let batches = micro_batches(&sampler, &batch_plan, step);
        let hyper = step_hyper(c, step, rank);
        let lr = hyper.lr;
        let report = sharded.train_step(&batches, &hyper)?;
        window.0 += report.step_s;
        window.1 += c.tokens_per_step() as u64;
        tokens_seen += c.tokens_per_step() as u64;
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
                rss_peak_bytes: Some(rss_peaks(comm)?),
                device_bytes: match report.device_bytes {
                    Some(b) => Some(gather_u64(comm, b)?),
                    None => None,
                },
                plan_bytes: Some(plan_bytes.total()),
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
        if (c.save_interval > 0 && done.is_multiple_of(c.save_interval)) || last {
            let tokenizer = (data.dir.join("tokenizer.json"), data.tokenizer.sha256());
            let dir = save(&sharded, c, done, tokens_seen, &tokenizer)?;
            bar.suspend(|| log0!(rank, "saved {}", dir.display()));
        }
    }
    bar.finish_and_clear();
    let peaks = rss_peaks(comm)?;
    log0!(
        rank,
        "peak resident memory per rank: {} (plan {:.3} GB per rank)",
        peaks
            .iter()
            .map(|b| format!("{:.3} GB", *b as f64 / 1e9))
            .collect::<Vec<_>>()
            .join(", "),
        plan_bytes.total() as f64 / 1e9
    );
    Ok(logged)
}

/// Opens a checkpoint on every rank and verifies it (each rank a share of the checksums), with
/// ember's record in it. Any rank's failure fails every rank, naming the rank and the file:
/// nothing is loaded.
pub fn open_verified(comm: &Comm, dir: &Path) -> Result<(Checkpoint, RunRecord)> {
    let checkpoint = Checkpoint::open(comm, dir)?;
    let run = RunRecord::of(checkpoint.manifest(), checkpoint.dir())?;
    Ok((checkpoint, run))
}

/// Writes a checkpoint of step `step`: every writing rank its own shard file (no rank
/// gathers the model), rank 0 the tokenizer and the manifest. Every rank must call it; a
/// failure on any rank fails every rank and leaves earlier checkpoints untouched.
pub fn save(
    sharded: &ShardedModel<'_, GptStages, 3>,
    c: &TrainConfig,
    step: u64,
    tokens_seen: u64,
    tokenizer: &(PathBuf, String),
) -> Result<PathBuf> {
    let options = SaveOptions {
        app: RunRecord::new(
            c,
            step,
            tokens_seen,
            SHARDED_RNG_SCHEME,
            tokenizer.1.clone(),
        )
        .app(),
        files: vec![tokenizer.0.clone()],
        keep_last: c.keep_last as usize,
    };
    ember_sharding::checkpoint::save(sharded, &c.out_dir, step, &options).with_context(|| {
        format!(
            "the checkpoint of step {step} was not completed; earlier checkpoints are untouched"
        )
    })
}

/// `ember reshard`: loads a checkpoint into this job's partition and writes it again under
/// `out`, unchanged in value: the same step, weights, moments and data position. Every rank
/// must call it; each reads only its own ranges.
pub fn reshard(comm: &Comm, dir: &Path, out: &Path, shard: ShardConfig) -> Result<PathBuf> {
    let (checkpoint, run) = open_verified(comm, dir)?;
    let mut c = run.train.clone();
    c.out_dir = out.to_path_buf();
    let tokenizer = (
        checkpoint.dir().join("tokenizer.json"),
        run.tokenizer_sha256.clone(),
    );
    let sharded = build(comm, &c, shard, Device::flex(), Some(&checkpoint), None)?;
    save(
        &sharded,
        &c,
        checkpoint.manifest().step,
        run.data.tokens_seen,
        &tokenizer,
    )
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
        total += sharded.eval_loss(&sampler.batch(i, lo as u64..hi as u64))?;
    }
    let local = total / c.eval_iters as f64;
    let comm = sharded.comm();
    let sum = ember_sharding::engine::all_ranks_sum(comm, local as f32)?;
    comm.take_counters();
    Ok(sum as f64 / world as f64)
}
