//! `ember bench train`: training throughput (tokens/s) and MFU of presets on the chosen
//! backend, measured on the embedded corpus after warm-up steps; `ember bench shard`: step
//! time, bytes per group and memory of sharding presets under mpirun beside `ember plan`'s
//! predictions. Not tests: numbers go to BENCHMARKS.md with the commands that produced them.

use std::collections::BTreeMap;

use anyhow::Result;
use ember_comm::Comm;
use ember_sharding::Memory;
use serde::Serialize;

use crate::error::CliResult;
use crate::run::config::{TrainConfig, TrainOverrides};
use crate::run::device::peak_flops;
use crate::run::gpt_run::{GptRun, traffic_by_name};
use crate::run::host_memory::rss_peaks;
use crate::run::run_loop::{self, Output, Stepped};
use crate::run::setup::{Purpose, RunArgs, RunSetup};
use crate::run::shard_args::ShardArgs;
use crate::tools::planning::estimate;
use crate::tools::sharing::{self, Sharing};
use ember_sharding::plan::profile::Profile;

/// One benchmark result.
#[derive(Debug, Clone, Serialize)]
pub struct TrainBench {
    /// Preset measured.
    pub preset: String,
    /// Backend.
    pub device: String,
    /// Parameters.
    pub params: u64,
    /// Sequences per step.
    pub batch_size: usize,
    /// Tokens per sequence.
    pub block_size: usize,
    /// CPU threads available to the backend.
    pub threads: usize,
    /// Timed steps.
    pub steps: u64,
    /// Median step time, ms.
    pub step_ms_median: f64,
    /// Tokens per second at the median step.
    pub tokens_per_s: f64,
    /// Achieved model FLOP/s (6N + 12LdT per token), in GFLOP/s.
    pub gflops: f64,
    /// `--dtype`.
    pub dtype: String,
    /// The dtype forward and backward computed in: `--dtype`'s, or f32 over bf16 parameters
    /// on a CPU without bf16 dot-product instructions.
    pub arithmetic: String,
    /// Peak FLOP/s used for MFU, in GFLOP/s.
    pub peak_gflops: Option<f64>,
    /// Model FLOPs utilisation.
    pub mfu: Option<f64>,
    /// The first step, ms: on a GPU, the step that compiles and autotunes what the cache
    /// (`kernel_cache`) did not hold.
    pub first_step_ms: f64,
    /// What the kernel cache held when the process started its device (CubeCL devices).
    pub kernel_cache: Option<crate::run::kernel_cache::Warmth>,
    /// Bytes the device's memory pools held from the driver after the last step, in use or
    /// kept for reuse (CubeCL devices).
    pub device_reserved_bytes: Option<u64>,
    /// How much of the CPUs went to other processes and to the hypervisor while the preset
    /// was set up and stepped (Linux).
    pub elsewhere: Option<Sharing>,
    /// The model's shape.
    #[serde(skip)]
    pub model: ember_model::GptConfig,
}

/// Times `steps` training steps of each preset after `warmup` untimed ones, through the same
/// setup, model and loop as `ember train` in one process.
pub fn bench_train(
    comm: &Comm,
    presets: &[String],
    base: &TrainOverrides,
    steps: u64,
    warmup: u64,
) -> CliResult<Vec<TrainBench>> {
    let mut out = Vec::new();
    for preset in presets {
        let settings = TrainOverrides {
            preset: Some(preset.clone()),
            ..Default::default()
        }
        .overridden_by(base);
        let before = sharing::sample();
        let mut setup = bench_setup(comm, settings, steps + warmup)?;
        let shard = ShardArgs::default().resolve(comm.topology(), setup.config.dtype)?;
        let config = setup.config.clone();
        let plan = setup.plan(comm, shard, true)?;
        let arithmetic = plan.module_dtype;
        let device = setup.device.clone();
        let mut run = GptRun::start(comm, &mut setup, plan)?;
        let (stepped, _) = run_loop::run(&mut run, &config, 0, 0, Output::Quiet)?;
        let mut bench = summarise(&config, arithmetic, step_times(&stepped, warmup))?;
        bench.first_step_ms = stepped.first().map_or(f64::NAN, |s| s.step_s * 1e3);
        bench.device_reserved_bytes =
            ember_sharding::plumbing::memory::device_bytes_reserved(&device);
        bench.elsewhere = sharing::since(before);
        out.push(bench);
    }
    Ok(out)
}

/// The run `settings` describe, for `max_iters` steps with nothing evaluated or saved.
fn bench_setup(comm: &Comm, settings: TrainOverrides, max_iters: u64) -> CliResult<RunSetup> {
    let settings = settings.overridden_by(&TrainOverrides {
        max_iters: Some(max_iters),
        eval_interval: Some(0),
        save_interval: Some(0),
        ..Default::default()
    });
    RunSetup::resolve(
        comm,
        &RunArgs {
            settings,
            purpose: Purpose::Benchmark,
            ..Default::default()
        },
    )
}

/// The step times after the first `warmup`, sorted.
fn step_times(stepped: &[Stepped], warmup: u64) -> Vec<f64> {
    let mut times: Vec<f64> = stepped[warmup as usize..]
        .iter()
        .map(|s| s.step_s)
        .collect();
    times.sort_by(f64::total_cmp);
    times
}

fn summarise(
    config: &TrainConfig,
    arithmetic: ember_sharding::Compute,
    times: Vec<f64>,
) -> Result<TrainBench> {
    let median = times[times.len() / 2];
    let tokens = config.tokens_per_step() as f64;
    let tokens_per_s = tokens / median;
    let flops = config.model.train_flops_per_token(config.block_size) * tokens_per_s;
    let peak = peak_flops(config.device, config.peak_tflops, arithmetic);
    Ok(TrainBench {
        preset: config.preset.clone(),
        device: config.device.to_string(),
        params: config.model.num_params(),
        batch_size: config.batch_size,
        block_size: config.block_size,
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        steps: times.len() as u64,
        step_ms_median: median * 1e3,
        tokens_per_s,
        gflops: flops / 1e9,
        dtype: ember_sharding::Compute::from(config.dtype).to_string(),
        arithmetic: arithmetic.to_string(),
        peak_gflops: peak.map(|p| p / 1e9),
        mfu: peak.map(|p| flops / p),
        first_step_ms: f64::NAN,
        kernel_cache: kernel_cache(config.device),
        device_reserved_bytes: None,
        elsewhere: None,
        model: config.model.clone(),
    })
}

/// What the kernel cache held at the start, on a CubeCL device.
fn kernel_cache(
    device: crate::run::config::DeviceKind,
) -> Option<crate::run::kernel_cache::Warmth> {
    #[cfg(any(feature = "wgpu", feature = "cuda", feature = "rocm"))]
    if device.is_cubecl() {
        return crate::run::kernel_cache::configure(device).ok().cloned();
    }
    let _ = device;
    None
}

/// One preset of `ember bench shard`, as rank 0 measured it.
#[derive(Debug, Clone, Serialize)]
pub struct ShardBench {
    /// Sharding preset.
    pub shard: String,
    /// Model preset.
    pub model: String,
    /// Topology.
    pub topology: String,
    /// Ranks.
    pub ranks: usize,
    /// Global batch (sequences per step) and tokens per sequence.
    pub batch_size: usize,
    /// Tokens per sequence.
    pub block_size: usize,
    /// Timed steps.
    pub steps: u64,
    /// What units with partitioned parameters keep for backward (`unit` or `none`).
    pub recompute: String,
    /// Median step time, ms (the slowest rank's: every step ends in a collective).
    pub step_ms_median: f64,
    /// The fastest and slowest timed step, ms.
    pub step_ms_range: (f64, f64),
    /// `ember plan`'s step time on the profile given (`--profile`, or the emulated cluster's),
    /// ms.
    pub step_ms_predicted: Option<f64>,
    /// `ember plan`'s share of the step spent waiting on communication.
    pub comm_wait_predicted: Option<f64>,
    /// Bytes per step over all links of each level (both directions), measured from the
    /// emulated cluster's interface counters (GPU links and node uplinks), when run on one.
    pub link_bytes_measured: Option<BTreeMap<String, f64>>,
    /// The same, predicted by `ember plan` (payload only: no TCP/IP headers).
    pub link_bytes_predicted: Option<BTreeMap<String, f64>>,
    /// What ran when in rank 0's last timed step.
    pub timeline: Vec<ember_sharding::Interval>,
    /// The same in `ember plan`'s replay of the step.
    pub timeline_predicted: Vec<ember_sharding::Interval>,
    /// Median step time over the `ddp` preset's, when `ddp` was measured first.
    pub vs_ddp: Option<f64>,
    /// Job-wide training tokens per second at the median step.
    pub tokens_per_s: f64,
    /// Median share of the step rank 0 waited on communication.
    pub comm_wait_frac: f64,
    /// Bytes rank 0 sent per step per `group/op`, measured.
    pub bytes_sent: BTreeMap<String, u64>,
    /// The same, predicted by `ember plan`.
    pub bytes_predicted: BTreeMap<String, u64>,
    /// Measured bytes sent over groups that span the outermost level.
    pub outermost_bytes: u64,
    /// Peak resident memory of every rank during this preset's steps, bytes, from the OS.
    pub rss_peak_bytes: Vec<u64>,
    /// The plan's prediction of one rank's peak, bytes.
    pub plan_bytes: u64,
    /// The plan's prediction, by state.
    pub plan_memory: Memory,
    /// Rank 0's crossings between device and host memory in its last timed step: seconds and
    /// bytes each way.
    pub staging: ember_sharding::Staging,
    /// The plan's prediction of one rank's crossings in a step, on a device with memory of its
    /// own.
    pub plan_staging: ember_sharding::StagedBytes,
}

/// Times `steps` sharded training steps (after `warmup`) of each sharding preset in `shards`
/// on the model `base` describes; every rank must call it.
#[allow(clippy::too_many_arguments)]
pub fn bench_shard(
    comm: &Comm,
    shard_flags: &ShardArgs,
    shards: &[String],
    base: &TrainOverrides,
    steps: u64,
    warmup: u64,
    profile: Option<&Profile>,
) -> CliResult<Vec<ShardBench>> {
    let topology = comm.topology().clone();
    let world = topology.world_size();
    let mut setup = bench_setup(comm, base.clone(), steps + warmup)?;
    let config = setup.config.clone();
    let warm = TrainConfig {
        max_iters: warmup,
        ..config.clone()
    };
    // On an emulated cluster, rank 0 reads its links' counters around the timed steps.
    let cluster = match std::env::var(crate::cluster::CLUSTER_ENV) {
        Ok(path) if comm.rank() == 0 => {
            Some(crate::cluster::Cluster::load(std::path::Path::new(&path))?)
        }
        _ => None,
    };
    let mut out: Vec<ShardBench> = Vec::new();
    for shard in shards {
        let flags = ShardArgs {
            shard: Some(shard.clone()),
            ..shard_flags.clone()
        };
        let shard_config = flags.resolve(&topology, config.dtype)?;
        let plan = setup.plan(comm, shard_config, shard_flags.recompute.is_none())?;
        let recompute = plan.config.recompute_done();
        let plan_memory = plan.memory(config.grad_accum);
        let predicted = profile.map(|p| estimate(&plan, config.grad_accum, p));
        // Each preset's peak is its own: the previous preset's memory is freed by now.
        ember_sharding::plumbing::memory::reset_peak();
        let mut run = GptRun::start(comm, &mut setup, plan)?;
        let (mut stepped, _) = run_loop::run(&mut run, &warm, 0, 0, Output::Quiet)?;
        comm.barrier();
        let before = cluster.as_ref().map(|c| c.link_bytes()).transpose()?;
        let tokens = warmup * config.tokens_per_step() as u64;
        let (timed, _) = run_loop::run(&mut run, &config, warmup, tokens, Output::Quiet)?;
        comm.barrier();
        let after = cluster.as_ref().map(|c| c.link_bytes()).transpose()?;
        stepped.extend(timed);
        let link_bytes_measured = before.zip(after).map(|(b, a)| {
            let d = b.delta(&a);
            let per_step = |x: u64| x as f64 / steps as f64;
            BTreeMap::from([
                (topology.levels()[1].name.clone(), per_step(d.gpu_total())),
                (
                    topology.levels()[2].name.clone(),
                    per_step(d.uplink_total()),
                ),
            ])
        });
        let times = step_times(&stepped, warmup);
        let mut waits: Vec<f64> = stepped[warmup as usize..]
            .iter()
            .map(|s| s.comm_wait_s / s.step_s.max(1e-9))
            .collect();
        waits.sort_by(f64::total_cmp);
        let last = run.last_report().expect("at least one step");
        let median = times[times.len() / 2];
        let step_ms = median * 1e3;
        let traffic = run.sharded().plan().traffic(config.grad_accum);
        let depth = topology.depth();
        let bytes_predicted = traffic
            .iter()
            .filter(|(_, t)| t.sent > 0)
            .map(|((g, op), t)| (format!("{}/{}", g.name(&topology), op.name()), t.sent))
            .collect();
        let outermost_bytes = last
            .traffic
            .entries()
            .filter(|(scope, _, _)| ember_sharding::plan::levels_of(*scope, depth).hi == depth)
            .map(|(_, _, t)| t.sent)
            .sum();
        let vs_ddp = out
            .iter()
            .find(|r| r.shard == "ddp")
            .map(|d| step_ms / d.step_ms_median);
        let bytes_sent = traffic_by_name(comm, &last.traffic);
        let timeline = last.timeline.clone();
        let staging = last.staging;
        let plan_staging = run.sharded().plan().staging(config.grad_accum);
        drop(run);
        out.push(ShardBench {
            shard: shard.clone(),
            model: config.preset.clone(),
            topology: topology.to_string(),
            ranks: world,
            batch_size: config.batch_size,
            block_size: config.block_size,
            steps,
            recompute: recompute.to_string(),
            step_ms_median: step_ms,
            step_ms_range: (times[0] * 1e3, times[times.len() - 1] * 1e3),
            step_ms_predicted: predicted.as_ref().map(|e| e.step_s * 1e3),
            comm_wait_predicted: predicted
                .as_ref()
                .map(|e| e.comm_wait_s / e.step_s.max(1e-12)),
            link_bytes_predicted: predicted.as_ref().map(|e| {
                e.link_bytes
                    .iter()
                    .skip(1)
                    .map(|(n, b)| (n.clone(), *b))
                    .collect()
            }),
            link_bytes_measured,
            timeline,
            timeline_predicted: predicted
                .as_ref()
                .map_or(Vec::new(), |e| e.timeline.clone()),
            vs_ddp,
            tokens_per_s: config.tokens_per_step() as f64 / median,
            comm_wait_frac: waits[waits.len() / 2],
            bytes_sent,
            bytes_predicted,
            outermost_bytes,
            rss_peak_bytes: rss_peaks(comm)?,
            plan_bytes: plan_memory.total(),
            plan_memory,
            staging,
            plan_staging,
        });
    }
    Ok(out)
}

/// The PyTorch eager reference of the training step (`torch_gpt.py`), shipped inside the
/// binary so `--against-torch` works from any directory.
const TORCH_SCRIPT: &str = include_str!("torch_gpt.py");

/// One preset of `ember bench train --against-torch`: ember and PyTorch alternated in one
/// sitting.
#[derive(Debug, Clone, Serialize)]
pub struct PairedBench {
    /// Preset measured.
    pub preset: String,
    /// Parameters of ember's model and of PyTorch's.
    pub params: (u64, u64),
    /// Threads each used.
    pub threads: usize,
    /// Compute dtype: ember's `--dtype`, and PyTorch's forward under bf16 autocast for bf16.
    pub dtype: String,
    /// The dtype ember's forward and backward computed in ([`TrainBench::arithmetic`]).
    pub ember_arithmetic: String,
    /// Each round's median step time, ms, ember's.
    pub ember_ms: Vec<f64>,
    /// The same, PyTorch's.
    pub torch_ms: Vec<f64>,
    /// Median over rounds, ms.
    pub ember_median_ms: f64,
    /// Median over rounds, ms.
    pub torch_median_ms: f64,
    /// ember's tokens/s over PyTorch's (PyTorch's median step time over ember's).
    pub ratio: f64,
    /// PyTorch's version.
    pub torch: String,
    /// Where both ran: PyTorch's `--device` (`cpu`, `cuda:0`) and the card PyTorch named.
    pub device: String,
    /// The card's name as PyTorch gives it (`cpu` on the CPU).
    pub device_name: String,
    /// Tokens per step (batch x block).
    pub tokens_per_step: usize,
    /// ember's MFU at its median step, where the peak is known (`--peak-tflops` on a GPU).
    pub ember_mfu: Option<f64>,
    /// The largest device memory PyTorch's allocator held over the timed steps, bytes (GPU).
    pub torch_peak_device_bytes: Option<u64>,
    /// With `--torch-compile`: each round's median step time of the model under
    /// `torch.compile`, ms, its median, ember's tokens/s over it, and its peak memory.
    pub torch_compile_ms: Vec<f64>,
    /// Median over rounds, ms.
    pub torch_compile_median_ms: Option<f64>,
    /// ember's tokens/s over `torch.compile`'s.
    pub ratio_compile: Option<f64>,
    /// Peak device memory under `torch.compile`, bytes (GPU).
    pub torch_compile_peak_device_bytes: Option<u64>,
    /// The most of the CPUs that went to other processes or the hypervisor in one of
    /// ember's rounds (Linux).
    pub ember_elsewhere: Option<Sharing>,
    /// The same over PyTorch's rounds (eager and compiled).
    pub torch_elsewhere: Option<Sharing>,
}

/// How `--against-torch` runs the reference.
#[derive(Debug, Clone)]
pub struct TorchReference {
    /// The interpreter, which must import torch.
    pub python: String,
    /// Also time the model under `torch.compile`, alternated with eager and ember.
    pub compile: bool,
}

/// Alternates `ember bench train` and the PyTorch reference, `rounds` times per preset, each
/// timing `steps` steps after `warmup`, on the same device: the CPU for flex, the same CUDA
/// GPU for `cuda`.
pub fn against_torch(
    comm: &Comm,
    torch: &TorchReference,
    presets: &[String],
    base: &TrainOverrides,
    steps: u64,
    warmup: u64,
    rounds: usize,
) -> CliResult<Vec<PairedBench>> {
    let python = torch.python.as_str();
    // A device PyTorch has no counterpart for is refused before the interpreter is tried:
    // installing torch would not make that run.
    torch_device(base)?;
    check_torch(python)?;
    let script = std::env::temp_dir().join(format!("ember-torch-gpt-{}.py", std::process::id()));
    std::fs::write(&script, TORCH_SCRIPT)
        .map_err(|e| anyhow::anyhow!("writing {}: {e}", script.display()))?;
    let result = presets
        .iter()
        .map(|preset| pair(comm, torch, &script, preset, base, steps, warmup, rounds))
        .collect();
    let _ = std::fs::remove_file(&script);
    result
}

/// The `--dtype` both sides of `--against-torch` run.
fn dtype_flag(base: &TrainOverrides) -> &'static str {
    match base.dtype {
        Some(crate::run::config::Dtype::Bf16) => "bf16",
        _ => "f32",
    }
}

/// PyTorch's `--device` for the device ember runs on; CPU backends compare with the CPU.
fn torch_device(base: &TrainOverrides) -> CliResult<String> {
    use crate::run::config::DeviceKind;
    match base.device.unwrap_or(DeviceKind::Flex) {
        DeviceKind::Flex | DeviceKind::Ndarray => Ok("cpu".into()),
        // PyTorch's ROCm builds name HIP devices `cuda` too.
        DeviceKind::Cuda(i) | DeviceKind::Rocm(i) => Ok(format!(
            "cuda:{}",
            i.unwrap_or_else(crate::run::device::local_rank)
        )),
        DeviceKind::Wgpu => Err(crate::error::usage(
            "--against-torch compares on the CPU (flex) or a CUDA or ROCm GPU; PyTorch has no \
             wgpu device",
        )),
    }
}

/// Refuses an interpreter that cannot import torch, saying how to install it.
fn check_torch(python: &str) -> CliResult<()> {
    let out = std::process::Command::new(python)
        .args(["-c", "import torch"])
        .output()
        .map_err(|e| {
            crate::error::usage(format!("--against-torch {python}: cannot run it ({e})"))
        })?;
    if !out.status.success() {
        return Err(crate::error::usage(format!(
            "--against-torch {python}: it cannot import torch; install it with `{python} -m pip \
             install torch`"
        )));
    }
    Ok(())
}

/// The PyTorch reference's runs for one preset: where and how long.
struct TorchJob<'a> {
    python: &'a str,
    script: &'a std::path::Path,
    device: &'a str,
    dtype: &'a str,
    steps: u64,
    warmup: u64,
}

impl TorchJob<'_> {
    /// One run on `e`'s shape, eager or under `torch.compile`: its JSON result.
    fn run(&self, e: &TrainBench, compile: bool) -> CliResult<serde_json::Value> {
        let m = &e.model;
        let mut cmd = std::process::Command::new(self.python);
        cmd.arg(self.script)
            .args(["--n-layer", &m.n_layer.to_string()])
            .args(["--n-head", &m.n_head.to_string()])
            .args(["--n-embd", &m.n_embd.to_string()])
            .args(["--block-size", &e.block_size.to_string()])
            .args(["--batch-size", &e.batch_size.to_string()])
            .args(["--vocab-size", &m.vocab_size.to_string()])
            .args([
                "--steps",
                &self.steps.to_string(),
                "--warmup",
                &self.warmup.to_string(),
            ])
            .args(["--threads", &e.threads.to_string()])
            .args(["--dtype", self.dtype, "--device", self.device]);
        if compile {
            cmd.arg("--compile");
        }
        let out = cmd
            .output()
            .map_err(|err| anyhow::anyhow!("running {}: {err}", self.python))?;
        if !out.status.success() {
            return Err(anyhow::anyhow!(
                "the PyTorch reference{} failed: {}",
                if compile { " under torch.compile" } else { "" },
                String::from_utf8_lossy(&out.stderr).trim()
            )
            .into());
        }
        serde_json::from_slice(&out.stdout)
            .map_err(|err| anyhow::anyhow!("the PyTorch reference printed no result: {err}").into())
    }
}

#[allow(clippy::too_many_arguments)]
fn pair(
    comm: &Comm,
    torch: &TorchReference,
    script: &std::path::Path,
    preset: &str,
    base: &TrainOverrides,
    steps: u64,
    warmup: u64,
    rounds: usize,
) -> CliResult<PairedBench> {
    let device = torch_device(base)?;
    let dtype = dtype_flag(base);
    let job = TorchJob {
        python: &torch.python,
        script,
        device: &device,
        dtype,
        steps,
        warmup,
    };
    let mut ember_ms = Vec::new();
    let mut torch_ms = Vec::new();
    let mut compile_ms = Vec::new();
    let mut paired = None;
    let mut compiled = None;
    let (mut ember_shares, mut torch_shares) = (Vec::new(), Vec::new());
    // `job`'s run, and how much of the CPUs went elsewhere meanwhile (sampled after the
    // interpreter is reaped, so that its time counts as the reference's own).
    let mut timed = |compile: bool, e: &TrainBench| -> CliResult<serde_json::Value> {
        let before = sharing::sample();
        let t = job.run(e, compile)?;
        torch_shares.extend(sharing::since(before));
        Ok(t)
    };
    for _ in 0..rounds {
        let e = bench_train(comm, &[preset.to_string()], base, steps, warmup)?.remove(0);
        ember_shares.extend(e.elsewhere);
        let t = timed(false, &e)?;
        let field = |t: &serde_json::Value, k: &str| t[k].as_f64().unwrap_or(f64::NAN);
        if torch.compile {
            let c = timed(true, &e)?;
            compile_ms.push(field(&c, "step_ms_median"));
            compiled = Some(c);
        }
        ember_ms.push(e.step_ms_median);
        torch_ms.push(field(&t, "step_ms_median"));
        paired = Some((e, t));
    }
    let (e, t) = paired.expect("at least one round");
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (em, tm) = (median(&ember_ms), median(&torch_ms));
    let cm = (!compile_ms.is_empty()).then(|| median(&compile_ms));
    let peak = |t: &serde_json::Value| t["peak_device_bytes"].as_u64();
    Ok(PairedBench {
        preset: preset.to_string(),
        params: (e.params, t["params"].as_u64().unwrap_or(0)),
        threads: e.threads,
        dtype: dtype.to_owned(),
        ember_arithmetic: e.arithmetic.clone(),
        ember_ms,
        torch_ms,
        ember_median_ms: em,
        torch_median_ms: tm,
        ratio: tm / em,
        torch: t["torch"].as_str().unwrap_or("").to_owned(),
        device,
        device_name: t["device"].as_str().unwrap_or("").to_owned(),
        tokens_per_step: e.batch_size * e.block_size,
        ember_mfu: e.mfu,
        torch_peak_device_bytes: peak(&t),
        torch_compile_ms: compile_ms,
        torch_compile_median_ms: cm,
        ratio_compile: cm.map(|c| c / em),
        torch_compile_peak_device_bytes: compiled.as_ref().and_then(peak),
        ember_elsewhere: sharing::worst(&ember_shares),
        torch_elsewhere: sharing::worst(&torch_shares),
    })
}
