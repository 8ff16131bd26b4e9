//! The `ember` command line: `train`, `generate`, `eval`, `prepare`, `plan`, `reshard`,
//! `export` and `bench {train,comm,shard}`. Each command parses its flags (clap) and runs
//! (`cli/`); errors print one line and exit 2 (usage) or 1 (runtime), as `error.rs`
//! classifies them.

mod cli;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use cli::bench::{self, BenchCommand};
use cli::cluster::ClusterCommand;
use cli::inspect::{EvalArgs, ExportArgs, GenerateArgs, PrepareArgs};
use cli::layout::{PlanArgs, ReshardArgs};
use cli::train::TrainArgs;

/// Train GPT models in Rust, single-process or sharded (see README.md).
#[derive(Debug, Parser)]
#[command(name = "ember", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Train a GPT (nanoGPT-style flags; --config FILE.toml, which flags override)
    Train(TrainArgs),
    /// Sample text from a checkpoint
    Generate(GenerateArgs),
    /// Print {"loss", "tokens"}: mean cross-entropy per token of a checkpoint
    Eval(EvalArgs),
    /// Train a byte-level BPE tokenizer on a text file and write its tokens
    Prepare(PrepareArgs),
    /// Per-rank memory, per-step traffic and estimated step time of a sharded run, without
    /// running it
    Plan(PlanArgs),
    /// Write a checkpoint again for another world size, topology or preset (run under mpirun
    /// with the new layout; values are unchanged)
    Reshard(ReshardArgs),
    /// Write a checkpoint in the Hugging Face GPT-2 layout (offline, no MPI needed)
    Export(ExportArgs),
    /// Benchmarks (training throughput, collectives)
    #[command(subcommand)]
    Bench(BenchCommand),
    /// An emulated cluster on this machine: network namespaces with shaped links (root)
    #[command(subcommand)]
    Cluster(ClusterCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(args) => cli::train::run(args),
        Command::Generate(args) => cli::inspect::generate_cmd(args),
        Command::Eval(args) => cli::inspect::eval_cmd(args),
        Command::Prepare(args) => cli::inspect::prepare(args),
        Command::Plan(args) => cli::layout::plan_cmd(args),
        Command::Reshard(args) => cli::layout::reshard_cmd(args),
        Command::Export(args) => cli::inspect::export_cmd(args),
        Command::Bench(BenchCommand::Train(args)) => bench::bench_train(args),
        Command::Bench(BenchCommand::Comm(args)) => bench::bench_comm(args),
        Command::Bench(BenchCommand::Shard(args)) => bench::bench_shard(args),
        Command::Cluster(command) => cli::cluster::run(command),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code() as u8)
        }
    }
}
