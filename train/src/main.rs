//! The `ember` command line: `train`, `generate`, `eval`, `prepare`, `plan`, `reshard`,
//! `export`, `bench {train,comm,shard,matmul,staging}`, `cluster`, `launch` and `selftest`. Each command parses its flags (clap) and runs
//! (`cli/`); errors print one line and exit 2 (usage) or 1 (runtime), as `error.rs`
//! classifies them.

// The flags' doc comments are clap's `--help` text, not Markdown: `cuda[:I]` and `[cpu]` there
// are what a user types, not links.
#![allow(rustdoc::broken_intra_doc_links)]

mod cli;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use cli::bench::{self, BenchCommand};
use cli::cluster::ClusterCommand;
use cli::inspect::{EvalArgs, ExportArgs, GenerateArgs, PrepareArgs};
use cli::launch::LaunchArgs;
use cli::layout::{PlanArgs, ReshardArgs};
use cli::selftest::SelftestArgs;
use cli::train::TrainArgs;
use ember_train::run::kernel_cache::KernelCache;

/// Train GPT models in Rust, single-process or sharded (see README.md).
#[derive(Debug, Parser)]
#[command(name = "ember", version, about, long_about = None)]
struct Cli {
    /// Where GPU runs keep autotune's choices and compiled kernels between runs (a folder, or
    /// `off`); default `EMBER_KERNEL_CACHE`, else `kernels` in ember's cache folder
    #[arg(long, global = true, value_name = "DIR|off")]
    kernel_cache: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Train a GPT (nanoGPT-style flags; --config FILE.toml, which flags override)
    #[command(allow_negative_numbers = true)]
    Train(TrainArgs),
    /// Sample text from a checkpoint
    #[command(allow_negative_numbers = true)]
    Generate(GenerateArgs),
    /// Print {"loss", "tokens"}: mean cross-entropy per token of a checkpoint
    Eval(EvalArgs),
    /// Train a byte-level BPE tokenizer on a text file and write its tokens
    Prepare(PrepareArgs),
    /// Per-rank memory, per-step traffic and estimated step time of a sharded run, without
    /// running it
    #[command(allow_negative_numbers = true)]
    Plan(PlanArgs),
    /// Write a checkpoint again for another world size, topology or preset (run under mpirun
    /// with the new layout; values are unchanged)
    #[command(allow_negative_numbers = true)]
    Reshard(ReshardArgs),
    /// Write a checkpoint in the Hugging Face GPT-2 layout (offline, no MPI needed)
    Export(ExportArgs),
    /// Benchmarks (training throughput, collectives, sharding, a step's products, staging)
    #[command(subcommand)]
    Bench(BenchCommand),
    /// An emulated cluster on this machine: network namespaces with shaped links (root)
    #[command(subcommand)]
    Cluster(ClusterCommand),
    /// Run `ember train` under mpirun and restart it by itself after a failure, from the
    /// newest complete checkpoint, on the hosts that still answer
    #[command(allow_negative_numbers = true)]
    Launch(LaunchArgs),
    /// Connects back to a launcher asking whether this host answers
    #[command(hide = true)]
    ProbeBack {
        /// The launcher's address
        addr: String,
        /// Its port
        port: u16,
        /// What to say
        token: String,
    },
    /// Check this binary on a device: the quantization kernels against their reference, bit
    /// for bit (run it first on a new GPU)
    Selftest(SelftestArgs),
}

#[global_allocator]
static ALLOCATOR: ember_train::run::host_memory::HostAllocator =
    ember_train::run::host_memory::HostAllocator;

fn main() -> ExitCode {
    ember_train::run::host_memory::one_arena();
    // A one-process CPU run's steps run on rayon's workers (`kernels::warm_threads`): with
    // the main thread's stack size, not a spawned thread's 2 MiB.
    let _ = rayon::ThreadPoolBuilder::new()
        .stack_size(8 << 20)
        .build_global();
    let cli = Cli::parse();
    // Under `ember launch`, every rank says when it starts and how it ends (a panic too).
    let records = ember_train::run::launch::RankRecords::get();
    if let Some(r) = records {
        r.started();
        // A collective's timeout or a panic aborts the MPI job from inside ember-comm.
        ember_comm::fault::before_abort(|code, reason| {
            if let Some(r) = ember_train::run::launch::RankRecords::get() {
                r.exited(code, Some(reason.to_string()));
            }
        });
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            r.exited(101, Some(format!("panicked: {info}")));
            default(info);
        }));
    }
    // `--kernel-cache` is checked here; `EMBER_KERNEL_CACHE` only where a GPU run reads it.
    let result = match cli.kernel_cache.as_deref() {
        Some(flag) => KernelCache::resolve(Some(flag)).map(KernelCache::choose),
        None => Ok(()),
    }
    .and_then(|()| run(cli.command));
    match result {
        Ok(()) => {
            if let Some(r) = records {
                r.exited(0, None);
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            if let Some(r) = records {
                r.exited(e.exit_code(), Some(e.to_string()));
            }
            // One write: the ranks of a job share mpirun's stderr, and a line written in
            // pieces interleaves with theirs.
            let line = format!("error: {e}\n");
            let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
            // The first rank of an MPI job to exit with an error makes mpirun end the others,
            // which may still be on their way to printing their own line (naming this rank):
            // give them a moment.
            if mpi_job_of_several() {
                std::thread::sleep(REPORT_GRACE);
            }
            ExitCode::from(e.exit_code() as u8)
        }
    }
}

/// Runs one command.
fn run(command: Command) -> ember_train::error::CliResult<()> {
    match command {
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
        Command::Bench(BenchCommand::Matmul(args)) => bench::bench_matmul(args),
        Command::Bench(BenchCommand::Staging(args)) => bench::bench_staging(args),
        Command::Cluster(command) => cli::cluster::run(command),
        Command::Selftest(args) => cli::selftest::run(args),
        Command::Launch(args) => cli::launch::run(args),
        Command::ProbeBack { addr, port, token } => {
            ember_train::run::launch::probe_back(&addr, port, &token).map_err(Into::into)
        }
    }
}

/// How long a failed rank of an MPI job waits after its report before exiting.
const REPORT_GRACE: std::time::Duration = std::time::Duration::from_millis(500);

/// Whether this process is one of several ranks started by mpirun (Open MPI or a PMI launcher).
fn mpi_job_of_several() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"].iter().any(|v| {
        std::env::var(v)
            .ok()
            .and_then(|s| s.parse::<usize>().ok())
            .is_some_and(|n| n > 1)
    })
}
