//! `ember train`: resolve the run (`RunSetup`), start MPI (one process is a world of one),
//! build the GPT partitioned as the flags say, and hand it to the one training loop; then
//! plot the losses.

use std::path::PathBuf;

use clap::Args;

use ember_train::error::CliResult;
use ember_train::files::{metrics, plot};
use ember_train::log0;
use ember_train::run::config::TrainOverrides;
use ember_train::run::gpt_run::GptRun;
use ember_train::run::host_memory::rss_peaks;
use ember_train::run::run_loop::{self, Output};
use ember_train::run::setup::{Purpose, RunArgs, RunSetup, set_aside_later};
use ember_train::run::shard_args::ShardArgs;

#[derive(Debug, Args)]
pub struct TrainArgs {
    /// A TOML file of settings (snake_case keys, e.g. `n_layer = 6`); flags override it
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Continue from a checkpoint directory, or the latest checkpoint of an out dir
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Start even when the plan says the run needs more memory than this machine has
    /// available
    #[arg(long)]
    pub no_memory_check: bool,
    /// Start from the weights of a Hugging Face GPT-2 directory (config.json,
    /// model.safetensors or its index, tokenizer.json), e.g. one `ember export` wrote
    #[arg(long, conflicts_with = "resume")]
    pub init_from: Option<PathBuf>,
    #[command(flatten)]
    pub settings: TrainOverrides,
    #[command(flatten)]
    pub shard: ShardArgs,
}

pub fn run(args: TrainArgs) -> CliResult<()> {
    let comm = args.shard.start()?;
    let rank = comm.rank();
    let run_args = RunArgs {
        config: args.config,
        resume: args.resume,
        init_from: args.init_from,
        settings: args.settings,
        purpose: Purpose::Train,
    };
    let mut setup = RunSetup::resolve(&comm, &run_args)?;
    let shard = args.shard.resolve(comm.topology(), setup.config.dtype)?;
    let plan = setup.plan(&comm, shard, args.shard.recompute.is_none())?;
    let background_saves = setup.check_memory(&comm, &plan, args.no_memory_check)?;
    let c = setup.config.clone();
    log0!(
        rank,
        "model {} with {:.2}M parameters; {} train / {} val tokens; batch {} x {} tokens",
        c.preset,
        c.model.num_params() as f64 / 1e6,
        setup.data.train.len(),
        setup.data.val.len(),
        c.batch_size,
        c.block_size
    );
    let resumed = setup.resume.clone();
    let mut run = GptRun::start(&comm, &mut setup, plan)?;
    run.write_in_background(background_saves);
    if let Some(r) = &resumed {
        set_aside_later(&comm, r, &c.out_dir)?;
    }
    let (first, tokens) = run.start;
    ember_train::run::launch::RankRecords::ready(first);
    run_loop::run(&mut run, &c, first, tokens, Output::Run)?;
    let peaks = rss_peaks(&comm)?;
    log0!(
        rank,
        "peak resident memory per rank: {} (plan {:.3} GB per rank)",
        peaks
            .iter()
            .map(|b| format!("{:.3} GB", *b as f64 / 1e9))
            .collect::<Vec<_>>()
            .join(", "),
        run.plan_bytes() as f64 / 1e9
    );
    if rank != 0 {
        return Ok(());
    }
    let metrics_path = c.out_dir.join("metrics.jsonl");
    let png = c.out_dir.join("loss.png");
    plot::plot_losses(&metrics::read_metrics(&metrics_path)?, &png, "ember: loss")?;
    log0!(
        rank,
        "wrote {} and {}",
        metrics_path.display(),
        png.display()
    );
    Ok(())
}
