//! `ember generate`, `ember eval`, `ember prepare` and `ember export`: the commands that read
//! a checkpoint or data in one process, with no training and no MPI.

use std::path::PathBuf;

use clap::Args;

use ember_train::error::{CliError, CliResult, usage};
use ember_train::files::checkpoint;
use ember_train::log0;
use ember_train::run::data;
use ember_train::tools::{eval, generate};
use ember_train::units::parse_size;

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// Checkpoint directory, or an out dir (its latest checkpoint)
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Text to continue
    #[arg(long, default_value = "\n")]
    pub prompt: String,
    /// Tokens to generate
    #[arg(long, default_value_t = 200)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f64,
    /// Sample among the K most likely tokens; 0 = all
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Seed of the sampler
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

#[derive(Debug, Args)]
pub struct EvalArgs {
    /// Checkpoint directory, or an out dir (its latest checkpoint)
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// A text file to score instead of the run's validation split
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Windows scored per forward pass
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
}

#[derive(Debug, Args)]
pub struct PrepareArgs {
    /// Text file to tokenize
    #[arg(long)]
    pub input: PathBuf,
    /// Vocabulary of the byte-level BPE to train (ignored with --tokenizer)
    #[arg(long, default_value_t = 512)]
    pub vocab_size: usize,
    /// Use this Hugging Face tokenizer.json instead of training one
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Output directory (tokenizer.json, train.bin, val.bin)
    #[arg(long)]
    pub out: PathBuf,
    /// Share of the tokens, at the end of the text, held out for validation
    #[arg(long, default_value_t = 0.1)]
    pub val_fraction: f64,
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// Checkpoint directory, or an out dir (its latest checkpoint)
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Directory to write model.safetensors, config.json and tokenizer.json into
    #[arg(long)]
    pub out: PathBuf,
    /// Weight dtype in the files: f32 or bf16 (the master weights rounded to nearest even)
    #[arg(long, value_enum, default_value = "f32", hide_possible_values = true)]
    pub dtype: ember_train::run::config::Dtype,
    /// Largest file; past it the weights are split into model-0000k-of-0000N.safetensors
    /// with model.safetensors.index.json (e.g. 5GB, 500MB, 2GiB)
    #[arg(long, default_value = "5GB")]
    pub max_shard_size: String,
}

pub fn generate_cmd(args: GenerateArgs) -> CliResult<()> {
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
    )?;
    println!("{}{}", args.prompt, r.tokenizer.decode(&ids)?);
    Ok(())
}

pub fn eval_cmd(args: EvalArgs) -> CliResult<()> {
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
    let (total, count) = eval::score(&r.model, &ids, block, args.batch_size, &dev)
        .map_err(|e| CliError::Runtime(e.into()))?;
    println!(
        "{}",
        serde_json::json!({"loss": total / count as f64, "tokens": count})
    );
    Ok(())
}

pub fn prepare(args: PrepareArgs) -> CliResult<()> {
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

pub fn export_cmd(args: ExportArgs) -> CliResult<()> {
    if !args.checkpoint.exists() {
        return Err(usage(format!(
            "--checkpoint {}: no such directory",
            args.checkpoint.display()
        )));
    }
    let max = parse_size(&args.max_shard_size).ok_or_else(|| {
        usage(format!(
            "--max-shard-size {}: write a positive size such as 5GB, 500MB or 2GiB",
            args.max_shard_size
        ))
    })?;
    let dir = checkpoint::locate(&args.checkpoint)?;
    let files = ember_train::files::export::export(&dir, &args.out, args.dtype, max)?;
    for f in files {
        println!("{}", f.display());
    }
    Ok(())
}
