//! `ember plan` and `ember reshard`: a partition's memory and traffic without running it, and
//! a checkpoint written again for another layout.

use std::path::PathBuf;

use clap::Args;

use ember_train::error::{CliResult, usage};
use ember_train::log0;
use ember_train::run::config::{TrainConfig, TrainOverrides};
use ember_train::run::gpt_run;
use ember_train::run::setup::{Purpose, RunArgs, RunSetup};
use ember_train::run::shard_args::ShardArgs;

#[derive(Debug, Args)]
pub struct PlanArgs {
    /// One JSON object instead of tables
    #[arg(long)]
    pub json: bool,
    /// Link bandwidths and compute rate: `frontier`, or a TOML/JSON file with name,
    /// level_gbps (innermost first), peak_tflops and mfu, and optionally link_gbps,
    /// latency_us, flow_efficiency, rank_tflops and [cpu] (`ember cluster up` writes one)
    #[arg(long, default_value = "frontier")]
    pub profile: String,
    /// Also print the replayed step: when each visit and each collective stage ran
    #[arg(long)]
    pub timeline: bool,
    #[command(flatten)]
    pub settings: TrainOverrides,
    #[command(flatten)]
    pub shard: ShardArgs,
}

#[derive(Debug, Args)]
pub struct ReshardArgs {
    /// Checkpoint directory, or an out dir (its latest checkpoint)
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Out dir to write `step-NNNNNN/` into
    #[arg(long)]
    pub out: PathBuf,
    #[command(flatten)]
    pub shard: ShardArgs,
}

pub fn plan_cmd(args: PlanArgs) -> CliResult<()> {
    let Some(spec) = &args.shard.topology else {
        return Err(usage(
            "ember plan needs --topology NODESxGPUSxGCDS (e.g. 2x4x2)",
        ));
    };
    if args.shard.shard.is_none() {
        return Err(usage(
            "ember plan needs --shard PRESET (e.g. --shard hier3)",
        ));
    }
    let topology =
        ember_comm::Topology::parse(spec).map_err(|e| usage(format!("--topology {spec}: {e}")))?;
    let config = TrainConfig::resolve(&args.settings)?;
    let mut model = config.model.clone();
    if let Some(v) = args.settings.vocab_size {
        model.vocab_size = v;
    }
    let shard = args.shard.resolve(&topology, config.dtype)?;
    let profile = ember_train::tools::planning::load_profile(&args.profile)?;
    let report = ember_train::tools::planning::report(&model, &config, &topology, shard, &profile)?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&report).map_err(anyhow::Error::new)?
        );
    } else {
        print!(
            "{}",
            ember_train::tools::planning::render(&report, &profile)
        );
        if args.timeline {
            print!(
                "\n{}",
                ember_train::tools::planning::render_timeline(&report.estimate)
            );
        }
    }
    Ok(())
}

pub fn reshard_cmd(args: ReshardArgs) -> CliResult<()> {
    if args.shard.shard.is_none() {
        return Err(usage(
            "ember reshard needs --shard PRESET (and --topology) for the new layout",
        ));
    }
    let comm = args.shard.init_comm()?;
    let run = RunArgs {
        resume: Some(args.checkpoint),
        settings: TrainOverrides {
            out_dir: Some(args.out),
            ..Default::default()
        },
        purpose: Purpose::Reshard,
        ..Default::default()
    };
    let (config, resumed, _) = RunSetup::layered(&comm, &run)?;
    let resumed = resumed.expect("a reshard continues a checkpoint");
    let shard = args.shard.resolve(comm.topology(), config.dtype)?;
    let out = gpt_run::reshard(&comm, &resumed, &config, shard)?;
    log0!(
        comm.rank(),
        "wrote {} for {} ranks ({})",
        out.display(),
        comm.topology().world_size(),
        comm.topology()
    );
    Ok(())
}
