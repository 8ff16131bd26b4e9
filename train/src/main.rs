//! The `ember` command line: `train`, `generate`, `eval`, `prepare`, `plan`, `reshard`,
//! `export` and `bench {train,comm,shard}`. Each command parses its flags (clap), then runs;
//! errors print one line and exit 2 (usage) or 1 (runtime), as `error.rs` classifies them.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use ember_train::config::{TrainConfig, TrainOverrides};
use ember_train::error::{CliError, CliResult, usage};
use ember_train::sharded::{self, ShardArgs};
use ember_train::{bench, checkpoint, data, device, eval, generate, log0, planning, plot, trainer};

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
}

#[derive(Debug, Args)]
struct ExportArgs {
    /// Checkpoint directory, or an out dir (its latest checkpoint)
    #[arg(long)]
    checkpoint: PathBuf,
    /// Directory to write model.safetensors, config.json and tokenizer.json into
    #[arg(long)]
    out: PathBuf,
    /// Weight dtype in the files
    #[arg(long, value_enum, default_value = "f32")]
    dtype: ember_train::config::Dtype,
    /// Largest file; past it the weights are split into model-0000k-of-0000N.safetensors
    /// with model.safetensors.index.json (e.g. 5GB, 500MB, 2GiB)
    #[arg(long, default_value = "5GB")]
    max_shard_size: String,
}

#[derive(Debug, Args)]
struct ReshardArgs {
    /// Checkpoint directory, or an out dir (its latest checkpoint)
    #[arg(long)]
    checkpoint: PathBuf,
    /// Out dir to write `step-NNNNNN/` into
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    shard: ShardArgs,
}

#[derive(Debug, Args)]
struct PlanArgs {
    /// One JSON object instead of tables
    #[arg(long)]
    json: bool,
    /// Link bandwidths and compute rate: `frontier`, or a TOML/JSON file with name,
    /// level_gbps (innermost first), peak_tflops and mfu
    #[arg(long, default_value = "frontier")]
    profile: String,
    #[command(flatten)]
    settings: TrainOverrides,
    #[command(flatten)]
    shard: ShardArgs,
}

#[derive(Debug, Args)]
struct TrainArgs {
    /// A TOML file of settings (snake_case keys, e.g. `n_layer = 6`); flags override it
    #[arg(long)]
    config: Option<PathBuf>,
    /// Continue from a checkpoint directory, or the latest checkpoint of an out dir
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Start even when the plan says the run needs more memory than this machine has
    /// available
    #[arg(long)]
    no_memory_check: bool,
    /// Start from the weights of a Hugging Face GPT-2 directory (config.json,
    /// model.safetensors or its index, tokenizer.json), e.g. one `ember export` wrote
    #[arg(long, conflicts_with = "resume")]
    init_from: Option<PathBuf>,
    #[command(flatten)]
    settings: TrainOverrides,
    #[command(flatten)]
    shard: ShardArgs,
}

#[derive(Debug, Args)]
struct GenerateArgs {
    /// Checkpoint directory, or an out dir (its latest checkpoint)
    #[arg(long)]
    checkpoint: PathBuf,
    /// Text to continue
    #[arg(long, default_value = "\n")]
    prompt: String,
    /// Tokens to generate
    #[arg(long, default_value_t = 200)]
    max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    /// Sample among the K most likely tokens; 0 = all
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Seed of the sampler
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Debug, Args)]
struct EvalArgs {
    /// Checkpoint directory, or an out dir (its latest checkpoint)
    #[arg(long)]
    checkpoint: PathBuf,
    /// A text file to score instead of the run's validation split
    #[arg(long)]
    data: Option<PathBuf>,
    /// Windows scored per forward pass
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
}

#[derive(Debug, Args)]
struct PrepareArgs {
    /// Text file to tokenize
    #[arg(long)]
    input: PathBuf,
    /// Vocabulary of the byte-level BPE to train (ignored with --tokenizer)
    #[arg(long, default_value_t = 512)]
    vocab_size: usize,
    /// Use this Hugging Face tokenizer.json instead of training one
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Output directory (tokenizer.json, train.bin, val.bin)
    #[arg(long)]
    out: PathBuf,
    /// Share of the tokens, at the end of the text, held out for validation
    #[arg(long, default_value_t = 0.1)]
    val_fraction: f64,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Training tokens/s and MFU per preset on one process
    Train(BenchTrainArgs),
    /// Collectives through ember against the raw MPI call, per op, level and size, and the
    /// quantization kernels against memcpy (run under mpirun; rank 0 prints)
    Comm(BenchCommArgs),
    /// Sharded training step time per preset against ddp, bytes per level and memory beside
    /// `ember plan`'s predictions (run under mpirun; rank 0 prints)
    Shard(BenchShardArgs),
}

#[derive(Debug, Args)]
struct BenchShardArgs {
    /// Sharding presets to measure, comma-separated (put ddp first for the ratio)
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "ddp,zero1,zero2,zero3,zeropp,hier3"
    )]
    shards: Vec<String>,
    /// Timed steps per preset
    #[arg(long, default_value_t = 8)]
    steps: u64,
    /// Untimed warm-up steps per preset
    #[arg(long, default_value_t = 2)]
    warmup: u64,
    /// One JSON object per line instead of a table
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    settings: TrainOverrides,
    #[command(flatten)]
    shard: ShardArgs,
}

#[derive(Debug, Args)]
struct BenchCommArgs {
    /// Rank layout NODESxGPUSxGCDS [default: detected]
    #[arg(long)]
    topology: Option<String>,
    /// Payload sizes, comma-separated, with K, M or G suffixes [default: 4K to 256M by x4]
    #[arg(long, value_delimiter = ',')]
    sizes: Option<Vec<String>>,
    /// Bytes moved per size and side, bounding the iterations [default: the library's]
    #[arg(long)]
    bytes_per_size: Option<String>,
    /// Skip the quantize / dequantize kernel timings
    #[arg(long)]
    no_kernels: bool,
    /// Skip the collectives (kernels only)
    #[arg(long)]
    no_collectives: bool,
    /// One JSON object per line (op, level, bytes, ember_gbps, mpi_gbps, ratio, ...)
    #[arg(long)]
    json: bool,
    /// Abort when a collective waits longer than this many seconds
    #[arg(long, default_value_t = 300.0)]
    comm_timeout: f64,
}

#[derive(Debug, Args)]
struct BenchTrainArgs {
    /// Presets to measure, comma-separated
    #[arg(long, value_delimiter = ',', default_value = "tiny,small-cpu")]
    presets: Vec<String>,
    /// Timed steps per preset
    #[arg(long, default_value_t = 20)]
    steps: u64,
    /// Untimed warm-up steps per preset
    #[arg(long, default_value_t = 3)]
    warmup: u64,
    /// One JSON object per line instead of a table
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    settings: TrainOverrides,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(args) => train(args),
        Command::Generate(args) => generate_cmd(args),
        Command::Eval(args) => eval_cmd(args),
        Command::Prepare(args) => prepare(args),
        Command::Plan(args) => plan_cmd(args),
        Command::Reshard(args) => reshard_cmd(args),
        Command::Export(args) => export_cmd(args),
        Command::Bench(BenchCommand::Train(args)) => bench_train(args),
        Command::Bench(BenchCommand::Comm(args)) => bench_comm(args),
        Command::Bench(BenchCommand::Shard(args)) => bench_shard(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code() as u8)
        }
    }
}

fn train(args: TrainArgs) -> CliResult<()> {
    let file = match &args.config {
        Some(path) => TrainOverrides::from_toml_file(path)?,
        None => TrainOverrides::default(),
    };
    let settings = file.overridden_by(&args.settings);
    let comm = match &args.shard.shard {
        Some(_) => Some(args.shard.init_comm()?),
        None => {
            args.shard.check_unused()?;
            refuse_unsharded_mpi_job()?;
            None
        }
    };
    let rank = comm.as_ref().map_or(0, |c| c.rank());
    let mut init: Option<ember_train::export::HfDir> = None;
    let (mut config, loaded) = match &args.resume {
        Some(path) => {
            if !path.exists() {
                return Err(usage(format!(
                    "--resume {}: no such file or directory",
                    path.display()
                )));
            }
            let dir = checkpoint::locate(path)?;
            // A sharded job reads only its ranges later; one process reads it whole now.
            // Only the manifest now: the state is read after the memory check (whole by one
            // process, range by range by a sharded job).
            let manifest = checkpoint::read_manifest(&dir)?;
            let run = checkpoint::RunRecord::of(&manifest, &dir)?;
            let loaded = Resume::At(dir.clone(), manifest.step, Box::new(run));
            let (step, run) = loaded.position();
            let mut config = run.train.clone();
            // A checkpoint continues where it lives (it may have been moved since), unless
            // --out-dir says otherwise.
            if let Some(parent) = dir.parent() {
                config.out_dir = parent.to_path_buf();
            }
            config.apply(&settings, false)?;
            if config.max_iters <= step {
                return Err(usage(format!(
                    "--max-iters {} is not past the checkpoint's step {}: nothing to train; \
                     raise --max-iters",
                    config.max_iters, step
                )));
            }
            log0!(rank, "resuming from {} (step {step})", dir.display());
            (config, Some(loaded))
        }
        None => {
            let mut settings = settings.clone();
            if let Some(dir) = &args.init_from {
                if !dir.exists() {
                    return Err(usage(format!(
                        "--init-from {}: no such directory",
                        dir.display()
                    )));
                }
                let hf = ember_train::export::HfDir::open(dir)
                    .map_err(|e| usage(format!("--init-from: {e:#}")))?;
                let shape = [
                    ("--n-layer", settings.n_layer, hf.config.n_layer),
                    ("--n-head", settings.n_head, hf.config.n_head),
                    ("--n-embd", settings.n_embd, hf.config.n_embd),
                ];
                if let Some((flag, Some(v), actual)) =
                    shape.iter().find(|(_, g, a)| g.is_some_and(|g| g != *a))
                {
                    return Err(usage(format!(
                        "{flag} {v} contradicts --init-from {} ({actual}); drop the flag",
                        dir.display()
                    )));
                }
                if settings.tokenizer.is_none() {
                    settings.tokenizer = Some(hf.tokenizer.clone().ok_or_else(|| {
                        usage(format!(
                            "--init-from {} has no tokenizer.json; pass --tokenizer",
                            dir.display()
                        ))
                    })?);
                }
                init = Some(hf);
            }
            let mut config = TrainConfig::resolve(&settings)?;
            if let Some(hf) = &init {
                let dropout = config.model.dropout;
                config.model = hf.config.clone();
                config.model.dropout = dropout;
                config.block_size = settings.block_size.unwrap_or(hf.config.block_size);
                config.preset = format!(
                    "init-from {}",
                    args.init_from
                        .as_ref()
                        .map_or(String::new(), |d| d.display().to_string())
                );
                config
                    .validate()
                    .map_err(|e| usage(format!("--init-from: {e}")))?;
            }
            if checkpoint::locate(&config.out_dir).is_ok() {
                return Err(usage(format!(
                    "--out-dir {} already holds checkpoints of a run; continue it with --resume \
                     {0}, or pick another --out-dir",
                    config.out_dir.display()
                )));
            }
            (config, None)
        }
    };
    let dev = device::device(config.device)?;
    if config.dtype == ember_train::config::Dtype::Bf16
        && !dev.supports_dtype(burn::tensor::DType::BF16)
    {
        return Err(usage(format!(
            "--dtype bf16 is not supported by --device {:?}; use --dtype f32",
            config.device
        )));
    }
    let prepared = match &comm {
        Some(c) => sharded::load_data(c, &config)?,
        None => data::load(&config)?,
    };
    let vocab = prepared.tokenizer.vocab_size();
    if loaded.is_some() && vocab != config.model.vocab_size {
        return Err(CliError::Runtime(anyhow::anyhow!(
            "the data's tokenizer has {vocab} tokens but the checkpoint's model has {}; resume \
             with the same --data and --tokenizer",
            config.model.vocab_size
        )));
    }
    config.model.vocab_size = vocab;
    ember_data::Sampler::new(&prepared.train, config.block_size, config.seed, 0)
        .map_err(|e| usage(format!("--block-size {}: {e}", config.block_size)))?;
    if config.eval_interval > 0 {
        ember_data::Sampler::new(&prepared.val, config.block_size, config.seed, 1).map_err(
            |e| {
                usage(format!(
                    "--block-size {} on the validation split: {e}; or pass --eval-interval 0",
                    config.block_size
                ))
            },
        )?;
    }
    log0!(
        rank,
        "model {} with {:.2}M parameters; {} train / {} val tokens; batch {} x {} tokens",
        config.preset,
        config.model.num_params() as f64 / 1e6,
        prepared.train.len(),
        prepared.val.len(),
        config.batch_size,
        config.block_size
    );
    let out_dir = config.out_dir.clone();
    if let Some(comm) = &comm {
        let shard = args.shard.resolve(comm.topology(), config.dtype)?;
        // A global batch that does not split over the ranks is a usage error (exit 2).
        sharded::batch_plan(&config, comm.topology().world_size(), rank)
            .map_err(|e| usage(e.to_string()))?;
        let plan = sharded::run_plan(&config, comm.topology(), shard.clone())?;
        let checked = planning::check_memory(
            &plan.memory(config.grad_accum),
            comm.ranks_on_this_node(),
            args.no_memory_check,
            planning::fitting_presets(&config, comm.topology()),
        );
        sharded::all_ok(comm, checked).map_err(|e| usage(format!("{e:#}")))?;
        let from = loaded.as_ref().map(Resume::dir);
        sharded::run(comm, &config, shard, dev, &prepared, from, init.as_mut())?;
        if rank != 0 {
            return Ok(());
        }
    } else {
        let one = ember_comm::Topology::parse("1").expect("a world of one");
        let whole = ember_sharding::ShardConfig::preset("ddp", one.depth())?;
        let plan = sharded::run_plan(&config, &one, whole)?;
        planning::check_memory(
            &plan.memory(config.grad_accum),
            1,
            args.no_memory_check,
            |_| Vec::new(),
        )
        .map_err(|e| usage(format!("{e:#}")))?;
        let loaded = match &loaded {
            Some(r) => Some(checkpoint::load(r.dir())?),
            None => None,
        };
        let mut t = trainer::Trainer::new(config, dev, prepared, loaded)?;
        if let Some(hf) = &init {
            t.load_weights(hf)?;
        }
        t.run()?;
    }
    let metrics = ember_train::metrics::read_metrics(&out_dir.join("metrics.jsonl"))?;
    let png = out_dir.join("loss.png");
    plot::plot_losses(&metrics, &png, "ember: loss")?;
    log0!(
        rank,
        "wrote {} and {}",
        out_dir.join("metrics.jsonl").display(),
        png.display()
    );
    Ok(())
}

/// The checkpoint a run continues: read whole (one process) or opened later range by range
/// (a sharded job).
enum Resume {
    At(PathBuf, u64, Box<checkpoint::RunRecord>),
}

impl Resume {
    /// The checkpoint's step and ember's record in it.
    fn position(&self) -> (u64, &checkpoint::RunRecord) {
        match self {
            Resume::At(_, step, run) => (*step, run),
        }
    }

    /// The checkpoint directory.
    fn dir(&self) -> &std::path::Path {
        match self {
            Resume::At(dir, ..) => dir,
        }
    }
}

/// Several ranks started by a launcher without `--shard` would each train alone and write the
/// same out dir: refuse, saying what to add.
fn refuse_unsharded_mpi_job() -> CliResult<()> {
    for var in ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"] {
        if let Ok(v) = std::env::var(var)
            && v.trim().parse::<usize>().is_ok_and(|n| n > 1)
        {
            return Err(usage(format!(
                "started as one of {} ranks ({var}) without --shard: add --shard PRESET \
                 (e.g. --shard ddp) or run one process",
                v.trim()
            )));
        }
    }
    Ok(())
}

fn generate_cmd(args: GenerateArgs) -> CliResult<()> {
    if !args.checkpoint.exists() {
        return Err(usage(format!(
            "--checkpoint {}: no such directory",
            args.checkpoint.display()
        )));
    }
    if args.temperature.is_nan() || args.temperature < 0.0 {
        return Err(usage(format!(
            "--temperature {} must be 0 (greedy) or positive",
            args.temperature
        )));
    }
    let dev = burn::tensor::Device::flex();
    let r = generate::restore(&args.checkpoint, &dev)?;
    let prompt = generate::encode_prompt(&r.tokenizer, &args.prompt)?;
    if prompt.len() >= r.model.block_size() {
        log0!(
            0,
            "the prompt is longer than the context; its start is cropped"
        );
    }
    let ids = generate::generate(
        &r.model,
        &prompt,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.seed,
        &dev,
    );
    println!("{}{}", args.prompt, r.tokenizer.decode(&ids)?);
    Ok(())
}

fn eval_cmd(args: EvalArgs) -> CliResult<()> {
    if !args.checkpoint.exists() {
        return Err(usage(format!(
            "--checkpoint {}: no such directory",
            args.checkpoint.display()
        )));
    }
    if args.batch_size == 0 {
        return Err(usage("--batch-size must be positive"));
    }
    let dev = burn::tensor::Device::flex();
    let r = generate::restore(&args.checkpoint, &dev)?;
    let block = r.loaded.run.train.block_size;
    let ids: Vec<u32> = match &args.data {
        Some(path) => r.tokenizer.encode(&data::read_text("--data", path)?)?,
        None => {
            let config = &r.loaded.run.train;
            let prepared = data::load(config)?;
            if prepared.tokenizer.sha256() != r.loaded.run.tokenizer_sha256 {
                return Err(CliError::Runtime(anyhow::anyhow!(
                    "the run's data now tokenizes differently from when {} was saved; pass \
                     --data FILE to score a text with the checkpoint's own tokenizer",
                    r.loaded.dir.display()
                )));
            }
            (0..prepared.val.len())
                .map(|i| prepared.val.get(i))
                .collect()
        }
    };
    if ids.len() < 2 {
        return Err(usage("the text has fewer than 2 tokens: nothing to score"));
    }
    let (total, count) = eval::score(&r.model, &ids, block, args.batch_size, &dev);
    println!(
        "{}",
        serde_json::json!({"loss": total / count as f64, "tokens": count})
    );
    Ok(())
}

fn prepare(args: PrepareArgs) -> CliResult<()> {
    if !(args.val_fraction > 0.0 && args.val_fraction < 1.0) {
        return Err(usage(format!(
            "--val-fraction {} must be between 0 and 1",
            args.val_fraction
        )));
    }
    let text = data::read_text("--input", &args.input)?;
    let tokenizer = match data::tokenizer_spec(args.tokenizer.as_deref(), args.vocab_size)? {
        ember_data::TokenizerSpec::File(p) => ember_data::Tokenizer::from_file(&p),
        ember_data::TokenizerSpec::Train { vocab_size } => {
            if vocab_size < 257 {
                return Err(usage(format!(
                    "--vocab-size {vocab_size} is too small for a byte-level BPE; use 257 or more"
                )));
            }
            ember_data::Tokenizer::train_byte_level_bpe(&text, vocab_size)
        }
    }
    .map_err(anyhow::Error::new)?;
    let name = args.input.display().to_string();
    let p = ember_data::prepare(&text, &tokenizer, &args.out, args.val_fraction, &name)
        .map_err(anyhow::Error::new)?;
    println!(
        "{}",
        serde_json::json!({
            "out": args.out, "vocab_size": tokenizer.vocab_size(),
            "train_tokens": p.train.len(), "val_tokens": p.val.len(),
        })
    );
    Ok(())
}

fn export_cmd(args: ExportArgs) -> CliResult<()> {
    if !args.checkpoint.exists() {
        return Err(usage(format!(
            "--checkpoint {}: no such directory",
            args.checkpoint.display()
        )));
    }
    let max = ember_train::export::parse_size(&args.max_shard_size).ok_or_else(|| {
        usage(format!(
            "--max-shard-size {}: write a positive size such as 5GB, 500MB or 2GiB",
            args.max_shard_size
        ))
    })?;
    let dir = checkpoint::locate(&args.checkpoint)?;
    let files = ember_train::export::export(&dir, &args.out, args.dtype, max)?;
    for f in files {
        println!("{}", f.display());
    }
    Ok(())
}

fn reshard_cmd(args: ReshardArgs) -> CliResult<()> {
    if args.shard.shard.is_none() {
        return Err(usage(
            "ember reshard needs --shard PRESET (and --topology) for the new layout",
        ));
    }
    if !args.checkpoint.exists() {
        return Err(usage(format!(
            "--checkpoint {}: no such directory",
            args.checkpoint.display()
        )));
    }
    let dir = checkpoint::locate(&args.checkpoint)?;
    let manifest = checkpoint::read_manifest(&dir)?;
    let run = checkpoint::RunRecord::of(&manifest, &dir)?;
    let comm = args.shard.init_comm()?;
    let shard = args.shard.resolve(comm.topology(), run.train.dtype)?;
    let out = sharded::reshard(&comm, &dir, &args.out, shard)?;
    log0!(
        comm.rank(),
        "wrote {} for {} ranks ({})",
        out.display(),
        comm.topology().world_size(),
        comm.topology()
    );
    Ok(())
}

fn plan_cmd(args: PlanArgs) -> CliResult<()> {
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
    let profile = ember_train::planning::load_profile(&args.profile)?;
    let report = ember_train::planning::report(
        &config.preset,
        &model,
        &topology,
        shard,
        config.batch_size,
        config.grad_accum,
        &profile,
    )?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&report).map_err(anyhow::Error::new)?
        );
    } else {
        print!("{}", ember_train::planning::render(&report, &profile));
    }
    Ok(())
}

/// Parses `4K`, `1M`, `256M`, `4G` or a plain byte count.
fn parse_size(flag: &str, s: &str) -> CliResult<u64> {
    let t = s.trim();
    let (num, mult) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 1 << 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.parse::<u64>()
        .ok()
        .filter(|&n| n > 0)
        .map(|n| n * mult)
        .ok_or_else(|| {
            usage(format!(
                "{flag} {s}: write a positive size such as 4K, 1M or 256M"
            ))
        })
}

fn bench_comm(args: BenchCommArgs) -> CliResult<()> {
    use ember_comm::bench::{BenchConfig, KernelBench, run_comm_bench};
    let shard = ShardArgs {
        topology: args.topology.clone(),
        comm_timeout: args.comm_timeout,
        ..ShardArgs::default()
    };
    let mut sizes = Vec::new();
    for s in args.sizes.iter().flatten() {
        sizes.push(parse_size("--sizes", s)?);
    }
    let bytes_per_size = args
        .bytes_per_size
        .as_deref()
        .map(|b| parse_size("--bytes-per-size", b))
        .transpose()?;
    let comm = shard.init_comm()?;
    let mut config = BenchConfig::full(&comm);
    if !sizes.is_empty() {
        config.sizes = sizes;
    }
    if let Some(b) = bytes_per_size {
        config.bytes_per_size = b;
    }
    if args.no_kernels {
        config.kernels = KernelBench::Skip;
    }
    if args.no_collectives {
        config.scopes.clear();
    }
    let records = run_comm_bench(&comm, &config);
    if comm.rank() != 0 {
        return Ok(());
    }
    if !args.json {
        println!(
            "{:<20} {:<16} {:>12} {:>6} {:>10} {:>10} {:>7} {:>8}",
            "op", "level", "bytes", "ranks", "ember GB/s", "base GB/s", "ratio", "baseline"
        );
    }
    for r in &records {
        if args.json {
            println!("{}", serde_json::to_string(r).map_err(anyhow::Error::new)?);
        } else {
            println!(
                "{:<20} {:<16} {:>12} {:>6} {:>10.3} {:>10.3} {:>7.3} {:>8}",
                r.op, r.level, r.bytes, r.ranks, r.ember_gbps, r.mpi_gbps, r.ratio, r.baseline
            );
        }
    }
    Ok(())
}

fn bench_shard(args: BenchShardArgs) -> CliResult<()> {
    if args.steps == 0 {
        return Err(usage("--steps must be at least 1"));
    }
    if args.shard.shard.is_some() {
        return Err(usage("ember bench shard takes --shards LIST, not --shard"));
    }
    let comm = args.shard.init_comm()?;
    let results = bench::bench_shard(
        &comm,
        &args.shard,
        &args.shards,
        &args.settings,
        args.steps,
        args.warmup,
    )?;
    if comm.rank() != 0 {
        return Ok(());
    }
    for r in &results {
        if args.json {
            println!("{}", serde_json::to_string(r).map_err(anyhow::Error::new)?);
            continue;
        }
        println!(
            "{:<7} {} on {} ({} ranks), batch {} x {}: {:>9.1} ms/step{} {:>7.0} tok/s, comm \
             wait {:>3.0}%, outermost level {} B/step, peak resident memory {:.1} MB on the \
             largest rank (plan {:.1} MB)",
            r.shard,
            r.model,
            r.topology,
            r.ranks,
            r.batch_size,
            r.block_size,
            r.step_ms_median,
            r.vs_ddp
                .map_or(String::new(), |x| format!(" ({x:.2}x ddp)")),
            r.tokens_per_s,
            100.0 * r.comm_wait_frac,
            r.outermost_bytes,
            r.rss_peak_bytes.iter().copied().max().unwrap_or(0) as f64 / 1e6,
            r.plan_bytes as f64 / 1e6
        );
        for (k, v) in &r.bytes_sent {
            let p = r.bytes_predicted.get(k).copied().unwrap_or(0);
            println!("          {k:<28} {v:>12} B sent (plan {p})");
        }
    }
    Ok(())
}

fn bench_train(args: BenchTrainArgs) -> CliResult<()> {
    if args.steps == 0 {
        return Err(usage("--steps must be at least 1"));
    }
    let results = bench::bench_train(&args.presets, &args.settings, args.steps, args.warmup)?;
    for r in &results {
        if args.json {
            println!("{}", serde_json::to_string(r).map_err(anyhow::Error::new)?);
        } else {
            println!(
                "{:<10} {:>6} {:>8.2}M params  batch {} x {}  {} threads  {:>8.1} ms/step  \
                 {:>8.0} tok/s  {:>6.1} GFLOP/s  MFU {}",
                r.preset,
                r.device,
                r.params as f64 / 1e6,
                r.batch_size,
                r.block_size,
                r.threads,
                r.step_ms_median,
                r.tokens_per_s,
                r.gflops,
                r.mfu.map_or("n/a".into(), |m| format!("{:.1}%", m * 100.0)),
            );
        }
    }
    Ok(())
}
