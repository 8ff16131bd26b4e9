//! `ember plan`: the per-rank memory, per-step traffic and an estimated step time of a sharded
//! GPT run, computed from the partition plan alone (nothing runs, nothing is allocated, so it
//! answers for `neox-20b` on a laptop). The byte and memory figures are the ones a real run
//! measures (tests compare them with `metrics.jsonl`).

use std::path::Path;

use ember_comm::Topology;
use ember_model::GptConfig;
use ember_sharding::plan::TrafficTable;
use ember_sharding::plan::policy::{self, Candidates};
use ember_sharding::plan::profile::Profile;
use ember_sharding::{Compute, Memory, Plan, Preset, ShardConfig, StagedBytes};
use serde::Serialize;

use crate::error::{CliResult, usage};
use crate::run::config::{DeviceKind, TrainConfig};
use crate::run::stages::{gpt_activations, gpt_flops, gpt_units};

/// One row of the traffic table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TrafficRow {
    /// Levels the group spans (`gcd`, `gcd+gpu`, `node`, ...).
    pub group: String,
    /// Collective.
    pub op: String,
    /// Bytes one rank sends per step.
    pub sent: u64,
    /// Bytes one rank receives per step.
    pub received: u64,
}

/// Step-time estimate from a profile: the engine's step replayed on its links and compute
/// rate (`ember_sharding::simulate`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Estimate {
    /// Profile name.
    pub profile: String,
    /// Model FLOPs one rank computes per step, with the unit-boundary recompute.
    pub flops_per_rank: f64,
    /// The predicted step, seconds.
    pub step_s: f64,
    /// Of which the training thread waits on communication (as runs report it).
    pub comm_wait_s: f64,
    /// Of which it computes (visits and the optimizer step).
    pub compute_s: f64,
    /// Bytes per step over all links of each level, both directions, by level name.
    pub link_bytes: Vec<(String, f64)>,
    /// What ran when in the replayed step (visits, and the stages of gathers and reductions).
    pub timeline: Vec<ember_sharding::Interval>,
}

/// Everything `ember plan` prints.
#[derive(Debug, Clone, Serialize)]
pub struct PlanReport {
    /// Model preset name.
    pub model: String,
    /// Parameters (Hugging Face count, head tied).
    pub params: u64,
    /// Topology `NODESxGPUSxGCDS`.
    pub topology: String,
    /// Ranks.
    pub world_size: usize,
    /// The sharding configuration.
    pub shard: ShardConfig,
    /// The dtype forward and backward compute in ([`module_dtype`]).
    pub module_dtype: Compute,
    /// The `--dtype` asked for, where the run trains in another (bf16 at one rank on a CPU
    /// without bf16 dot-product instructions trains all in f32 where that fits, as `ember
    /// train` does).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub asked_dtype: Option<Compute>,
    /// Global batch and micro-batching.
    pub batch_size: usize,
    /// Micro-batches per step.
    pub grad_accum: usize,
    /// Tokens per sequence.
    pub block_size: usize,
    /// Model-state bytes per rank.
    pub memory: Memory,
    /// Their sum.
    pub memory_total: u64,
    /// Bytes per group and op per step.
    pub traffic: Vec<TrafficRow>,
    /// Bytes per step between device and host memory, each way, on a device with memory of
    /// its own (what MPI reads and writes crosses; nothing does on a CPU).
    pub staging: StagedBytes,
    /// Estimated step time.
    pub estimate: Estimate,
}

/// Reads `--profile`: `frontier`, or a TOML/JSON file with the fields of [`Profile`].
pub fn load_profile(spec: &str) -> CliResult<Profile> {
    if spec == "frontier" {
        return Ok(Profile::frontier());
    }
    let path = Path::new(spec);
    let text = std::fs::read_to_string(path).map_err(|e| {
        usage(format!(
            "--profile {spec}: {e}; give `frontier` or a TOML file with name, level_gbps, \
             peak_tflops and mfu"
        ))
    })?;
    let parsed: Result<Profile, String> = if spec.ends_with(".json") {
        serde_json::from_str(&text).map_err(|e| e.to_string())
    } else {
        toml::from_str(&text).map_err(|e| e.to_string())
    };
    parsed.map_err(|e| usage(format!("--profile {spec}: {e}")))
}

/// The plan of a GPT run: its units, with the activations one rank's micro-batch (of
/// `batch_size / (ranks x grad_accum)` sequences of `block_size` tokens) keeps, its modules
/// computing in [`module_dtype`].
pub fn gpt_plan(
    model: &GptConfig,
    topology: &Topology,
    shard: ShardConfig,
    batch_size: usize,
    grad_accum: usize,
    block_size: usize,
    device: DeviceKind,
) -> Result<Plan, ember_sharding::ShardError> {
    let module = module_dtype(shard.compute, device);
    let run = GptRun {
        model,
        topology,
        batch_size,
        grad_accum,
        block_size,
        device,
    };
    run.plan(shard, module)
}

/// A GPT run as the planner sees it: the model, the ranks, the batch and the device.
#[derive(Debug, Clone, Copy)]
pub struct GptRun<'a> {
    /// The model.
    pub model: &'a GptConfig,
    /// The ranks.
    pub topology: &'a Topology,
    /// Sequences per step, over all ranks.
    pub batch_size: usize,
    /// Micro-batches per step.
    pub grad_accum: usize,
    /// Tokens per sequence.
    pub block_size: usize,
    /// The device every rank computes on.
    pub device: DeviceKind,
}

impl<'a> GptRun<'a> {
    /// The run `c` describes, over `topology`.
    pub fn of(c: &'a TrainConfig, topology: &'a Topology) -> Self {
        Self {
            model: &c.model,
            topology,
            batch_size: c.batch_size,
            grad_accum: c.grad_accum,
            block_size: c.block_size,
            device: c.device,
        }
    }

    /// The plan of `shard` with its modules computing in `module`, with the activations and
    /// FLOPs of one rank's micro-batch (of `batch_size / (ranks x grad_accum)` sequences) in
    /// that dtype: those of the fused CPU kernels on `flex`, of Burn's composed ops
    /// elsewhere.
    pub fn plan(
        &self,
        shard: ShardConfig,
        module: Compute,
    ) -> Result<Plan, ember_sharding::ShardError> {
        let plan =
            Plan::new(gpt_units(self.model), shard, self.topology.clone())?.computing_in(module)?;
        let per_rank = self.batch_size / (self.topology.world_size() * self.grad_accum).max(1);
        let elem = plan.module_dtype.bytes();
        let fused = self.device == DeviceKind::Flex;
        plan.with_activations(gpt_activations(
            self.model,
            per_rank,
            self.block_size,
            elem,
            fused,
        ))?
        .with_flops(gpt_flops(self.model, per_rank, self.block_size))
    }
}

/// The dtype a GPT's modules compute in on `device` when its parameters are `compute`: f32
/// over bf16 parameters on a CPU (`flex`) where bf16 arithmetic does not pay (no AMX tiles,
/// and no bf16 dot-product instructions or ones measured no faster than its f32 FMA:
/// [`ember_model::kernels::bf16_pays`]; [`Plan::computing_in`]); else `compute`.
pub fn module_dtype(compute: Compute, device: DeviceKind) -> Compute {
    if compute == Compute::Bf16 && device == DeviceKind::Flex && !ember_model::kernels::bf16_pays()
    {
        Compute::F32
    } else {
        compute
    }
}

/// The report for `model` sharded per `shard` over `topology`.
/// The run's batch, accumulation, preset name and device come from `config`.
pub fn report(
    model: &GptConfig,
    config: &crate::run::config::TrainConfig,
    topology: &Topology,
    shard: ShardConfig,
    profile: &Profile,
) -> CliResult<PlanReport> {
    let (preset, batch_size, grad_accum) =
        (config.preset.as_str(), config.batch_size, config.grad_accum);
    let world = topology.world_size();
    if batch_size == 0 || grad_accum == 0 || !batch_size.is_multiple_of(world * grad_accum) {
        return Err(usage(format!(
            "--batch-size {batch_size} does not split into {world} ranks x --grad-accum \
             {grad_accum}: the global batch must be a multiple of {}",
            world * grad_accum
        )));
    }
    profile
        .validate(topology.depth())
        .map_err(|e| usage(format!("--profile: {e}")))?;
    let asked = shard.compute;
    let mut candidates = PlanCandidates(GptRun {
        model,
        topology,
        batch_size,
        grad_accum,
        block_size: model.block_size,
        device: config.device,
    });
    let fast = module_dtype(asked, config.device);
    let (plan, _) = policy::choose(&mut candidates, shard, fast, false)
        .map_err(|e| usage(format!("--shard: {e}")))?;
    let memory = plan.memory(grad_accum);
    let table: TrafficTable = plan.traffic(grad_accum);
    let traffic = table
        .iter()
        .filter(|(_, t)| t.sent > 0 || t.received > 0)
        .map(|((g, op), t)| TrafficRow {
            group: g.name(topology),
            op: op.name().to_string(),
            sent: t.sent,
            received: t.received,
        })
        .collect();
    let estimate = estimate(&plan, grad_accum, profile);
    Ok(PlanReport {
        model: preset.to_string(),
        params: model.num_params(),
        topology: topology.to_string(),
        world_size: world,
        shard: plan.config.clone(),
        module_dtype: plan.module_dtype,
        asked_dtype: (plan.config.compute != asked).then_some(asked),
        batch_size,
        grad_accum,
        block_size: model.block_size,
        memory_total: memory.total(),
        memory,
        traffic,
        staging: plan.staging(grad_accum),
        estimate,
    })
}

/// The candidate plans of `ember plan` for the planner's policy, as `ember train` makes them
/// (the same estimates). Whether one fits is known only for a run of one rank, on this
/// machine; a plan of several ranks is for machines elsewhere, and is taken as fitting.
struct PlanCandidates<'a>(GptRun<'a>);

impl Candidates for PlanCandidates<'_> {
    type Error = ember_sharding::ShardError;

    fn plan(&self, shard: ShardConfig, module: Compute) -> Result<Plan, Self::Error> {
        self.0.plan(shard, module)
    }

    fn fits(&mut self, plan: &Plan) -> (bool, u64) {
        let memory = plan.memory(self.0.grad_accum);
        let fits = self.0.topology.world_size() > 1
            || check_memory(&memory, 1, false, |_| Vec::new()).is_ok();
        (fits, memory.total())
    }
}

/// The step of `plan` (with its FLOPs) replayed on `profile`'s machine.
pub fn estimate(plan: &Plan, grad_accum: usize, profile: &Profile) -> Estimate {
    let timeline = ember_sharding::plan::simulate::simulate(plan, grad_accum, profile);
    let schedule = plan.schedule(grad_accum);
    let flops = schedule.iter().map(|e| match *e {
        ember_sharding::plan::schedule::Event::Visit(v) if !v.backward => plan.flops[v.stage],
        ember_sharding::plan::schedule::Event::Visit(v) if plan.keeps_graph(v.stage) => {
            2.0 * plan.flops[v.stage]
        }
        ember_sharding::plan::schedule::Event::Visit(v) => 3.0 * plan.flops[v.stage],
        ember_sharding::plan::schedule::Event::Whole { .. } => 3.0 * plan.flops.iter().sum::<f64>(),
        _ => 0.0,
    });
    Estimate {
        profile: profile.name.clone(),
        flops_per_rank: flops.sum(),
        step_s: timeline.step_s,
        comm_wait_s: timeline.comm_wait_s,
        compute_s: timeline.compute_s,
        link_bytes: plan
            .topology
            .levels()
            .iter()
            .map(|l| l.name.clone())
            .zip(timeline.link_bytes)
            .collect(),
        timeline: timeline.spans,
    }
}

/// The replayed step's timeline as a table: what ran, from when to when (milliseconds).
pub fn render_timeline(e: &Estimate) -> String {
    let mut spans = e.timeline.clone();
    spans.sort_by(|a, b| a.start.total_cmp(&b.start));
    let mut out = format!(
        "{:<28} {:>10} {:>10} {:>10}\n",
        "what", "start ms", "end ms", "ms"
    );
    for s in spans {
        out += &format!(
            "{:<28} {:>10.1} {:>10.1} {:>10.1}\n",
            s.what,
            s.start * 1e3,
            s.end * 1e3,
            (s.end - s.start) * 1e3
        );
    }
    out
}

/// The report as a human-readable table.
pub fn render(r: &PlanReport, profile: &Profile) -> String {
    let gb = |b: u64| b as f64 / 1e9;
    let mut out = String::new();
    let m = &r.memory;
    let dtype = if let Some(asked) = r.asked_dtype {
        format!(
            "{} (--dtype {asked} at one rank without bf16 products that pay, or with \
             EMBER_BF16_DOT=0, trains all in {}, as ember train does where it fits)",
            r.shard.compute, r.shard.compute
        )
    } else if r.module_dtype == r.shard.compute {
        r.shard.compute.to_string()
    } else {
        format!(
            "{} computing in {} (no bf16 products that pay on this machine, or \
             EMBER_BF16_DOT=0)",
            r.shard.compute, r.module_dtype
        )
    };
    out += &format!(
        "{} ({:.1}M parameters) on {} ({} ranks), shard {}, dtype {dtype}, batch {} x {} tokens, \
         grad accum {}, recompute {}\n",
        r.model,
        r.params as f64 / 1e6,
        r.topology,
        r.world_size,
        r.shard.preset,
        r.batch_size,
        r.block_size,
        r.grad_accum,
        r.shard.recompute_done()
    );
    out += "\nmodel-state memory per rank (GB)\n";
    for (name, v) in [
        ("parameters (primary)", m.params),
        ("secondary copy", m.secondary),
        ("gradients (f32)", m.grads),
        ("optimizer (f32 master, m, v)", m.optimizer),
        ("error-feedback residuals", m.residuals),
        ("working set at its peak", m.working_peak),
        ("  (largest gathered units)", m.gathered_peak),
        ("  (largest activations)", m.activations_peak),
        ("total", m.total()),
    ] {
        out += &format!("  {name:<30} {:>12.4}\n", gb(v));
    }
    out += "\ncommunication per rank per step\n";
    out += &format!(
        "  {:<16} {:<16} {:>14} {:>10}\n",
        "group", "op", "bytes sent", "GB"
    );
    for t in &r.traffic {
        out += &format!(
            "  {:<16} {:<16} {:>14} {:>10.4}\n",
            t.group,
            t.op,
            t.sent,
            gb(t.sent)
        );
    }
    out += &format!(
        "  staged between device and host memory on a GPU: {:.4} GB to host, {:.4} GB to \
         the device (none on a CPU)\n",
        gb(r.staging.to_host),
        gb(r.staging.to_device)
    );
    let e = &r.estimate;
    let links: Vec<String> = (0..profile.level_gbps.len())
        .map(|l| {
            let name = &profile.level_gbps[l].0;
            let t = Topology::parse(&r.topology).ok();
            let rate = t.map_or(f64::NAN, |t| profile.link_rate(l, &t) / 1e9);
            format!("{name} {rate:.4} GB/s")
        })
        .collect();
    out += &format!(
        "\nestimate ({}: links {}; {:.3} TFLOP/s per rank):\n  {:.4} s per step: compute \
         {:.4} s, waiting on communication {:.4} s ({:.0}%)\n",
        e.profile,
        links.join(", "),
        profile.compute_rate() / 1e12,
        e.step_s,
        e.compute_s,
        e.comm_wait_s,
        100.0 * e.comm_wait_s / e.step_s.max(1e-12)
    );
    out += "  bytes over each level's links per step, all ranks, both directions:";
    for (name, b) in &e.link_bytes {
        out += &format!(" {name} {:.0}", b);
    }
    out += "\n";
    out
}

/// Refuses a run whose plan does not fit this machine: the plan's per-rank total plus what
/// this process holds already, times the `ranks` on this machine, against the memory the OS
/// says is available. The error gives both
/// numbers and a way out (`fitting(budget per rank)` names sharding presets whose plan fits).
/// With `skip` (`--no-memory-check`) it only checks nothing.
pub fn check_memory(
    memory: &Memory,
    ranks: usize,
    skip: bool,
    fitting: impl FnOnce(u64) -> Vec<String>,
) -> anyhow::Result<()> {
    let Some(available) = ember_sharding::plumbing::memory::available() else {
        return Ok(());
    };
    // What this process already holds (libraries, MPI, the prepared data) comes on top of
    // the plan, on every rank.
    let held = ember_sharding::plumbing::memory::resident().current;
    let per_rank = memory.total() + held;
    let need = per_rank.saturating_mul(ranks as u64);
    if skip || need <= available {
        return Ok(());
    }
    let gb = |b: u64| b as f64 / 1e9;
    let fits = fitting((available / ranks.max(1) as u64).saturating_sub(held));
    let way_out = if fits.is_empty() {
        "run on more ranks (more machines), or shrink the model, the batch or --block-size, or \
         use --dtype bf16"
            .to_string()
    } else {
        format!("{} would fit", fits.join(", "))
    };
    Err(anyhow::anyhow!(
        "the run needs about {:.2} GB per rank (ember plan, plus what the process holds) x \
         {ranks} rank{} on this machine = \
         {:.2} GB, but {:.2} GB are available: {way_out}; or pass --no-memory-check to start \
         anyway",
        gb(per_rank),
        if ranks == 1 { "" } else { "s" },
        gb(need),
        gb(available)
    ))
}

/// The sharding presets whose plan for `config` over `topology` fits in `budget` bytes per
/// rank, as `--shard NAME (X GB per rank)`.
pub fn fitting_presets(
    config: &crate::run::config::TrainConfig,
    topology: &Topology,
) -> impl FnOnce(u64) -> Vec<String> {
    let config = config.clone();
    let topology = topology.clone();
    move |budget| {
        Preset::ALL
            .iter()
            .filter_map(|preset| {
                let mut shard = preset.config(topology.depth());
                shard.compute = config.dtype.into();
                let plan = gpt_plan(
                    &config.model,
                    &topology,
                    shard,
                    config.batch_size,
                    config.grad_accum,
                    config.block_size,
                    config.device,
                )
                .ok()?;
                let total = plan.memory(config.grad_accum).total();
                (total <= budget)
                    .then(|| format!("--shard {preset} ({:.2} GB per rank)", total as f64 / 1e9))
            })
            .collect()
    }
}
