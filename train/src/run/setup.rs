//! Everything a training run resolves before its first step, the same way for `ember train`,
//! `ember bench` and `ember reshard`: layered settings (preset, `--config` file, flags), a
//! checkpoint to resume (its configuration is the base), a Hugging Face directory to start
//! from, the out-dir policy, the device, the data and the vocabulary, and the pre-flight
//! memory check. Every rank resolves the same inputs alike; what can differ between ranks
//! (reading files) is agreed, so a failure on one ends all of them together.

use std::path::{Path, PathBuf};

use anyhow::anyhow;
use burn::tensor::Device;
use ember_comm::Comm;
use ember_data::{DataError, PreparedData, STREAM_TRAIN, STREAM_VAL};
use ember_sharding::plan::policy::{self, Candidates, Decision};
use ember_sharding::{Compute, Plan, Recompute, ShardConfig, Span};

use crate::error::{CliError, CliResult, InitFromMismatch, usage};
use crate::files::checkpoint::{self, RunRecord};
use crate::files::export::HfDir;
use crate::log0;
use crate::run::config::{AsyncSave, DeviceKind, Dtype, TrainConfig, TrainOverrides};
use crate::run::{data, device};
use crate::tools::planning;
use crate::tools::planning::GptRun;
use ember_model::kernels;

/// A checkpoint a run continues.
#[derive(Debug, Clone)]
pub struct Resumed {
    /// Its directory.
    pub dir: PathBuf,
    /// Steps it had trained.
    pub step: u64,
    /// ember's record in it.
    pub record: RunRecord,
}

/// Where a run's settings come from: its flags, an optional `--config` file, and optionally a
/// checkpoint to resume or a Hugging Face directory to start from.
#[derive(Debug, Clone, Default)]
pub struct RunArgs {
    /// `--config FILE.toml`.
    pub config: Option<PathBuf>,
    /// `--resume PATH`.
    pub resume: Option<PathBuf>,
    /// `--init-from DIR`.
    pub init_from: Option<PathBuf>,
    /// The flags.
    pub settings: TrainOverrides,
    /// What the run is resolved for.
    pub purpose: Purpose,
}

/// What a run is resolved for: the out-dir policy and the checks on a checkpoint differ.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Purpose {
    /// `ember train`: a fresh run's out dir holds no other run; a resumed one has steps left.
    #[default]
    Train,
    /// `ember bench`: nothing is written, so any out dir will do.
    Benchmark,
    /// `ember reshard`: the checkpoint (`--checkpoint`) is written again under the out dir
    /// (`--out`), which holds no other run.
    Reshard,
}

/// What a rank reads before the run is agreed: configuration, checkpoint, Hugging Face
/// directory.
pub type Settled = (TrainConfig, Option<Resumed>, Option<HfDir>);

/// A run resolved and ready to build.
#[derive(Debug)]
pub struct RunSetup {
    /// The resolved configuration (the vocabulary is the tokenizer's).
    pub config: TrainConfig,
    /// The checkpoint it continues.
    pub resume: Option<Resumed>,
    /// The Hugging Face directory it starts from.
    pub init: Option<HfDir>,
    /// The prepared tokens and tokenizer.
    pub data: PreparedData,
    /// The compute device.
    pub device: Device,
    /// Where each setting came from, for messages.
    pub origins: Origins,
}

/// Where a run's settings came from, so that a message naming a flag the user did not pass
/// says where its value was set instead: the `--config` file, the checkpoint a run resumes,
/// or the Hugging Face directory it starts from.
#[derive(Debug, Clone, Default)]
pub struct Origins {
    /// Every setting's TOML name, and whether a flag gave it.
    flags: Vec<(String, bool)>,
    /// The `--config` file and the settings it gives.
    file: Option<(PathBuf, Vec<String>)>,
    /// The checkpoint resumed, whose settings are the base.
    checkpoint: Option<PathBuf>,
    /// The `--init-from` directory, whose `config.json` gives the model's shape.
    init: Option<PathBuf>,
}

impl Origins {
    /// The origins of `args`' settings (a `--config` file that cannot be read gives none:
    /// reading it again reports why).
    pub fn of(args: &RunArgs) -> Self {
        let file = args.config.as_ref().and_then(|path| {
            let given = TrainOverrides::from_toml_file(path).ok()?.given();
            let names = given.into_iter().filter(|(_, g)| *g).map(|(n, _)| n);
            Some((path.clone(), names.collect()))
        });
        Self {
            flags: args.settings.given(),
            file,
            checkpoint: args.resume.clone(),
            init: args.init_from.clone(),
        }
    }

    /// Where the value behind `--flag` came from, when a flag did not give it and another
    /// source did: the text after "is" or "are" in a message.
    fn of_flag(&self, flag: &str) -> Option<String> {
        let name = flag.replace('-', "_");
        let (_, by_flag) = self.flags.iter().find(|(n, _)| *n == name)?;
        if *by_flag {
            return None;
        }
        if let Some((path, names)) = &self.file
            && names.contains(&name)
        {
            return Some(format!("set in {}", path.display()));
        }
        if let Some(dir) = &self.checkpoint {
            return Some(format!("the checkpoint's, in {}", dir.display()));
        }
        const SHAPE: [&str; 4] = ["n_layer", "n_head", "n_embd", "block_size"];
        match &self.init {
            Some(dir) if SHAPE.contains(&name.as_str()) => {
                Some(format!("from {}", dir.join("config.json").display()))
            }
            _ => None,
        }
    }

    /// `e`, its message followed by where each flag it names got its value, for the flags
    /// the command line did not give.
    pub fn explain(&self, e: CliError) -> CliError {
        let said = |message: &str| -> Option<String> {
            let refused = refused_part(message);
            let mut named: Vec<&str> = Vec::new();
            for (i, _) in refused.match_indices("--") {
                let flag = refused[i + 2..]
                    .split(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'))
                    .next()
                    .unwrap_or_default();
                if !flag.is_empty() && !named.contains(&flag) {
                    named.push(flag);
                }
            }
            // The flags of each origin, in the order the message names them.
            let mut origins: Vec<(String, Vec<String>)> = Vec::new();
            for flag in named {
                let Some(origin) = self.of_flag(flag) else {
                    continue;
                };
                let flag = format!("--{flag}");
                match origins.iter_mut().find(|(o, _)| *o == origin) {
                    Some((_, flags)) => flags.push(flag),
                    None => origins.push((origin, vec![flag])),
                }
            }
            let notes: Vec<String> = origins
                .into_iter()
                .map(|(origin, flags)| {
                    let verb = if flags.len() == 1 { "is" } else { "are" };
                    format!("{} {verb} {origin}", flags.join(" and "))
                })
                .collect();
            (!notes.is_empty()).then(|| format!("{message} ({})", notes.join("; ")))
        };
        match e {
            CliError::Usage(message) => match said(&message) {
                Some(m) => CliError::Usage(m),
                None => CliError::Usage(message),
            },
            // A mismatched `--init-from` directory keeps its kind (and exit code).
            CliError::Runtime(error) if error.downcast_ref::<InitFromMismatch>().is_some() => {
                CliError::Runtime(error)
            }
            CliError::Runtime(error) => match said(&format!("{error:#}")) {
                Some(m) => CliError::Runtime(anyhow!(m)),
                None => CliError::Runtime(error),
            },
        }
    }
}

/// The checkpoint at `path` (a checkpoint directory or a directory of them), with its step
/// and ember's record; `flag` names the flag for messages.
pub fn locate_resume(flag: &str, path: &Path) -> CliResult<Resumed> {
    if !path.exists() {
        return Err(usage(format!(
            "{flag} {}: no such file or directory",
            path.display()
        )));
    }
    let dir = checkpoint::locate(path)?;
    let manifest = checkpoint::read_manifest(&dir)?;
    let record = RunRecord::of(&manifest, &dir)?;
    Ok(Resumed {
        dir,
        step: manifest.step,
        record,
    })
}

impl RunSetup {
    /// Resolves `args` on every rank of `comm`.
    pub fn resolve(comm: &Comm, args: &RunArgs) -> CliResult<Self> {
        let origins = Origins::of(args);
        Self::resolve_from(comm, args, origins.clone()).map_err(|e| origins.explain(e))
    }

    /// [`RunSetup::resolve`], its messages not yet explained by `origins`.
    fn resolve_from(comm: &Comm, args: &RunArgs, origins: Origins) -> CliResult<Self> {
        let rank = comm.rank();
        let (mut config, resume, init) = Self::layered(comm, args)?;
        let device = device::device(config.device)?;
        #[cfg(any(feature = "wgpu", feature = "cuda", feature = "rocm"))]
        if config.device.is_cubecl() {
            static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
            if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
                log0!(
                    rank,
                    "{}",
                    crate::run::kernel_cache::configure(config.device)?.line()
                );
                log0!(rank, "{}", cube_kernels_line()?);
                #[cfg(feature = "cuda")]
                if matches!(config.device, DeviceKind::Cuda(_)) {
                    log0!(rank, "{}", cuda_compiler_line()?);
                }
                if config.dtype == Dtype::F32 && kernels::runs_tf32(&device) {
                    log0!(
                        rank,
                        "f32 products: this device runs TF32 on tensor cores, and Burn's \
                         autotune may take f32 operands as TF32 where that is faster (PyTorch's \
                         matmul precision \"high\"; Burn has no switch for IEEE f32): `ember \
                         bench matmul --dtype f32` measures the bits each product keeps"
                    );
                }
            }
        }
        if config.dtype == Dtype::Bf16 && !device.supports_dtype(burn::tensor::DType::BF16) {
            return Err(usage(format!(
                "--dtype bf16 is not supported by --device {:?}; use --dtype f32",
                config.device
            )));
        }
        let data = load_data(comm, &config)?;
        let vocab = data.tokenizer.vocab_size();
        if resume.is_some() && vocab != config.model.vocab_size {
            return Err(CliError::Runtime(anyhow!(
                "the data's tokenizer has {vocab} tokens but the checkpoint's model has {}; \
                 resume with the same --data and --tokenizer",
                config.model.vocab_size
            )));
        }
        if let Some(r) = &resume
            && r.record.tokenizer_sha256 != data.tokenizer.sha256()
        {
            return Err(CliError::Runtime(anyhow!(
                "{} was trained with another tokenizer than this data's; resume with the same \
                 --data and --tokenizer",
                r.dir.display()
            )));
        }
        config.model.vocab_size = match args.purpose {
            // A benchmark may ask for more tokens than its data's tokenizer learned (GPT-2's
            // 50304 on the embedded corpus): the extra rows of the embedding are never looked
            // up, but the head computes every logit, as the full-size model does.
            Purpose::Benchmark => vocab.max(config.vocab_size),
            _ => vocab,
        };
        ember_data::Sampler::new(&data.train, config.block_size, config.seed, STREAM_TRAIN)?;
        if config.eval_interval > 0 {
            ember_data::Sampler::new(&data.val, config.block_size, config.seed, STREAM_VAL)
                .map_err(|e| match e {
                    DataError::Setting { value, reason, .. } => usage(format!(
                        "--block-size {value} on the validation split: {reason}; or pass \
                         --eval-interval 0"
                    )),
                    e => e.into(),
                })?;
        }
        // A global batch that does not split over the ranks is a usage error (exit 2).
        batch_plan(&config, comm.topology().world_size(), rank)
            .map_err(|e| usage(e.to_string()))?;
        Ok(Self {
            config,
            resume,
            init,
            data,
            device,
            origins,
        })
    }

    /// The configuration layered from preset, `--config` file and flags (or from the
    /// checkpoint a run continues), the checkpoint and the Hugging Face directory `args` name,
    /// with the out-dir policy of `args.purpose` applied, on every rank: reading the config
    /// file, the manifest and the directory can fail on one rank alone (a node's view of a
    /// shared file system), so the ranks agree before going on.
    pub fn layered(comm: &Comm, args: &RunArgs) -> CliResult<Settled> {
        agreed(comm, Self::settle(comm.rank(), args))
    }

    /// [`RunSetup::layered`] as this rank reads it.
    fn settle(rank: usize, args: &RunArgs) -> CliResult<Settled> {
        let file = match &args.config {
            Some(path) => TrainOverrides::from_toml_file(path)?,
            None => TrainOverrides::default(),
        };
        let settings = file.overridden_by(&args.settings);
        let mut init = None;
        let (config, resume) = match &args.resume {
            Some(path) => {
                let flag = match args.purpose {
                    Purpose::Reshard => "--checkpoint",
                    Purpose::Train | Purpose::Benchmark => "--resume",
                };
                let resumed = locate_resume(flag, path)?;
                let mut config = resumed.record.train.clone();
                // A checkpoint continues where it lives (it may have been moved since), unless
                // --out-dir says otherwise.
                if let Some(parent) = resumed.dir.parent() {
                    config.out_dir = parent.to_path_buf();
                }
                config.apply(&settings, false)?;
                if args.purpose == Purpose::Reshard {
                    fresh_out_dir("--out", &config.out_dir)?;
                } else {
                    if args.purpose == Purpose::Train && rank == 0 {
                        // Renamed once the run is built; a name already taken is refused now.
                        later_ones(&resumed, &config.out_dir, false)?;
                    }
                    if config.max_iters <= resumed.step {
                        return Err(usage(format!(
                            "--max-iters {} is not past the checkpoint's step {}: nothing to \
                             train; raise --max-iters",
                            config.max_iters, resumed.step
                        )));
                    }
                    log0!(
                        rank,
                        "resuming from {} (step {})",
                        resumed.dir.display(),
                        resumed.step
                    );
                }
                (config, Some(resumed))
            }
            None => {
                let mut settings = settings.clone();
                if let Some(dir) = &args.init_from {
                    let hf = open_init(dir, &mut settings)?;
                    init = Some(hf);
                }
                let mut config = TrainConfig::resolve(&settings)?;
                if let Some(hf) = &init {
                    let dropout = config.model.dropout;
                    config.model = hf.config.clone();
                    config.model.dropout = dropout;
                    config.block_size = settings.block_size.unwrap_or(hf.config.block_size);
                    config.preset = format!("init-from {}", hf.dir.display());
                    config
                        .validate()
                        .map_err(|e| usage(format!("--init-from: {e}")))?;
                }
                if args.purpose == Purpose::Train {
                    fresh_out_dir("--out-dir", &config.out_dir)?;
                }
                (config, None)
            }
        };
        Ok((config, resume, init))
    }

    /// The run's plan, made once: per `shard`, except that when `choose` (no `--recompute`
    /// given) units with partitioned parameters keep their graphs for backward (`none`: no
    /// second gather, no recompute) when the plan then fits the memory available on every
    /// rank's machine, and only their inputs (`unit`) otherwise. bf16 parameters compute in
    /// f32 when any rank's CPU has no bf16 products that pay
    /// ([`planning::module_dtype`]; every rank then does), where that fits after the
    /// recompute choice, and in bf16 otherwise; a run of one rank then trains all in f32
    /// where that fits.
    pub fn plan(&self, comm: &Comm, shard: ShardConfig, choose: bool) -> CliResult<Plan> {
        self.plan_of(comm, shard, choose)
            .map_err(|e| self.origins.explain(e))
    }

    /// [`RunSetup::plan`], its messages not yet explained: the planner's policy
    /// ([`policy::choose`]) over this run's candidates, its decisions said on rank 0.
    fn plan_of(&self, comm: &Comm, shard: ShardConfig, choose: bool) -> CliResult<Plan> {
        let compute = shard.compute;
        let local = planning::module_dtype(compute, self.config.device);
        // Every rank takes part, so that all of them plan alike.
        let fast = if compute != Compute::F32
            && comm
                .agree((local != compute).then_some("no bf16 products that pay"))
                .is_err()
        {
            Compute::F32
        } else {
            compute
        };
        let mut candidates = RunCandidates { setup: self, comm };
        let (plan, decisions) = policy::choose(&mut candidates, shard, fast, choose)?;
        for decision in decisions {
            self.say(comm.rank(), decision);
        }
        if self.config.device == DeviceKind::Flex && (fast == Compute::F32 || local == Compute::F32)
        {
            // Said once a process, as `say_once` is.
            static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
            if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
                log0!(comm.rank(), "{}", kernels::f32_products());
            }
        }
        Ok(plan)
    }

    /// Says `decision` on rank 0.
    fn say(&self, rank: usize, decision: Decision) {
        let gb = |bytes: u64| bytes as f64 / 1e9;
        match decision {
            Decision::Recompute {
                keep,
                bytes,
                widened,
            } => log0!(
                rank,
                "recompute {}: keeping every unit's activations and parameters for backward \
                 needs {:.2} GB per rank{}{}",
                if keep { "none" } else { "unit" },
                gb(bytes),
                if widened { " (computing in f32)" } else { "" },
                if keep {
                    ", which fits"
                } else {
                    ", more than this machine has: each unit is recomputed in backward"
                }
            ),
            Decision::Bf16 if self.config.device == DeviceKind::Flex => say_once(
                rank,
                format_args!(
                    "--dtype bf16: forward and backward compute in bf16, {}",
                    kernels::bf16_products()
                ),
            ),
            Decision::Bf16 => {}
            Decision::AllF32 { bytes } => say_once(
                rank,
                format_args!(
                    "{}, and one rank sends nothing, so bf16 parameters would only add a \
                     copy and casts: the run trains in f32, as with --dtype f32 ({:.2} GB per \
                     rank, which fits)",
                    why_not_bf16(),
                    gb(bytes)
                ),
            ),
            Decision::F32OverBf16 { bytes } => say_once(
                rank,
                format_args!(
                    "{}: forward and backward compute in f32 over bf16 parameters, which \
                     are still held, gathered and reduced in bf16 ({:.2} GB per rank, which \
                     fits)",
                    why_not_bf16(),
                    gb(bytes)
                ),
            ),
            Decision::Bf16ForMemory { wide, narrow } => say_once(
                rank,
                format_args!(
                    "{}; computing in f32 over bf16 parameters would need {:.2} GB per \
                     rank, more than this machine has, so the run computes in bf16 ({:.2} GB \
                     per rank) and its steps are slower than with --dtype f32",
                    why_not_bf16(),
                    gb(wide),
                    gb(narrow)
                ),
            ),
        }
    }

    /// Refuses, on every rank, a run whose plan times the ranks on this machine exceeds the
    /// memory available (unless `skip`), naming both and the presets that would fit.
    ///
    /// Also settles `--async-save auto`: checkpoints are written in the background where the
    /// plan with their host copy fits on every rank's machine. Returns whether they are.
    pub fn check_memory(&self, comm: &Comm, plan: &Plan, skip: bool) -> CliResult<bool> {
        self.check_memory_of(comm, plan, skip)
            .map_err(|e| self.origins.explain(e))
    }

    /// [`RunSetup::check_memory`], its message not yet explained.
    fn check_memory_of(&self, comm: &Comm, plan: &Plan, skip: bool) -> CliResult<bool> {
        let shard = &plan.config;
        let memory = plan.memory(self.config.grad_accum);
        let staged = memory.with_background_saves();
        let ranks = comm.ranks_on_this_node();
        let background = match self.config.async_save {
            AsyncSave::Off => false,
            AsyncSave::On => true,
            AsyncSave::Auto => {
                let fits = planning::check_memory(&staged, ranks, skip, |_| Vec::new())
                    .map_err(CliError::Runtime);
                let fits = agreed(comm, fits).is_ok();
                if !fits {
                    log0!(
                        comm.rank(),
                        "checkpoints are written before the next step: their host copy ({:.2} \
                         GB per rank) would not fit beside the run (--async-save on to insist)",
                        staged.checkpoint_staging as f64 / 1e9
                    );
                }
                fits
            }
        };
        let checked = planning::check_memory(
            if background { &staged } else { &memory },
            ranks,
            skip,
            planning::fitting_presets(&self.config, comm.topology()),
        );
        let keeping = shard.params() != Span(0) && shard.recompute == Recompute::None;
        agreed(
            comm,
            checked.map_err(CliError::Runtime).map(|()| background),
        )
        .map_err(|e| {
            let hint = if keeping {
                " (--recompute none keeps every unit's activations and parameters for \
                 backward; --recompute unit keeps one unit's at a time)"
            } else {
                ""
            };
            usage(format!("{e}{hint}"))
        })
    }
}

/// A run's candidate plans for the planner's policy: this run's GPT estimates, and whether a
/// plan fits the memory available on every rank's machine (agreed among the ranks).
struct RunCandidates<'a> {
    setup: &'a RunSetup,
    comm: &'a Comm,
}

impl Candidates for RunCandidates<'_> {
    type Error = CliError;

    fn plan(&self, shard: ShardConfig, module: Compute) -> CliResult<Plan> {
        let run = GptRun::of(&self.setup.config, self.comm.topology());
        Ok(run.plan(shard, module)?)
    }

    fn fits(&mut self, plan: &Plan) -> (bool, u64) {
        let memory = plan.memory(self.setup.config.grad_accum);
        let ranks = self.comm.ranks_on_this_node();
        let fits = planning::check_memory(&memory, ranks, false, |_| Vec::new()).is_ok();
        (
            self.comm.agree((!fits).then_some("no room")).is_ok(),
            memory.total(),
        )
    }
}

/// Renames the checkpoints of `out_dir` later than `resumed` (left by the run that went on
/// from it) to `superseded-step-NNNNNN`, so that `--resume` of the directory and pruning see
/// only the new history; nothing is deleted. Rank 0 renames and says so; every rank calls it
/// and learns whether that worked. `ember train` calls it once the resumed run is built, so
/// a run refused by a later check (its data, its memory, the checkpoint's contents) leaves
/// the directory as it found it.
pub fn set_aside_later(comm: &Comm, resumed: &Resumed, out_dir: &Path) -> CliResult<()> {
    let renamed = if comm.rank() == 0 {
        later_ones(resumed, out_dir, true)
    } else {
        Ok(())
    };
    agreed(comm, renamed)
}

/// The part of a message that says what was refused, before the advice: up to the first
/// `": "` that ends a clause of several words (not a leading `--flag: `), or the first `"; "`.
fn refused_part(message: &str) -> &str {
    let clause = message.find("; ").map_or(message, |end| &message[..end]);
    let mut from = 0;
    while let Some(at) = clause[from..].find(": ") {
        let end = from + at;
        if clause[..end].split_whitespace().count() >= 3 {
            return &clause[..end];
        }
        from = end + 2;
    }
    clause
}

/// The checkpoints [`set_aside_later`] renames, checked (a new name already taken is refused)
/// and, when `rename`, renamed.
fn later_ones(resumed: &Resumed, out_dir: &Path, rename: bool) -> CliResult<()> {
    if !out_dir.is_dir() {
        return Ok(());
    }
    for (step, dir) in checkpoint::completed(out_dir)? {
        if step <= resumed.step {
            continue;
        }
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
        let to = out_dir.join(format!("superseded-{}", name.unwrap_or_default()));
        if to.exists() {
            return Err(usage(format!(
                "--resume {}: {} holds a later checkpoint, {}, and {} is taken; move one of \
                 them away, or resume into another directory with --out-dir",
                resumed.dir.display(),
                out_dir.display(),
                dir.display(),
                to.display()
            )));
        }
        if !rename {
            continue;
        }
        std::fs::rename(&dir, &to)
            .map_err(|e| anyhow!("renaming {} to {}: {e}", dir.display(), to.display()))?;
        eprintln!(
            "[ember] {} (step {step}) came after step {} in the run being resumed: renamed to {} \
             (kept, but no longer resumed from or pruned)",
            dir.display(),
            resumed.step,
            to.display()
        );
    }
    Ok(())
}

/// The out-dir policy: a run writes its checkpoints into a directory that holds no other
/// run's (`flag` names the flag for the message); a run continues with `--resume` instead.
pub fn fresh_out_dir(flag: &str, dir: &Path) -> CliResult<()> {
    if checkpoint::locate(dir).is_ok() {
        let resume = if flag == "--out-dir" {
            format!("continue it with --resume {}, or ", dir.display())
        } else {
            String::new()
        };
        return Err(usage(format!(
            "{flag} {} already holds checkpoints of a run; {resume}pick another {flag}",
            dir.display()
        )));
    }
    Ok(())
}

/// Opens `--init-from DIR`, checks the shape flags against it and takes its tokenizer unless
/// one is given.
fn open_init(dir: &Path, settings: &mut TrainOverrides) -> CliResult<HfDir> {
    if !dir.exists() {
        return Err(usage(format!(
            "--init-from {}: no such directory",
            dir.display()
        )));
    }
    let hf = HfDir::open(dir).map_err(|e| usage(format!("--init-from: {e:#}")))?;
    let shape = [
        ("--n-layer", settings.n_layer, hf.config.n_layer),
        ("--n-head", settings.n_head, hf.config.n_head),
        ("--n-embd", settings.n_embd, hf.config.n_embd),
    ];
    if let Some((flag, Some(v), actual)) = shape.iter().find(|(_, g, a)| g.is_some_and(|g| g != *a))
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
    Ok(hf)
}

/// The prepared data of `c` on every rank: rank 0 prepares (and caches) the tokens while the
/// others wait, then they read the cache. A failure on any rank fails every rank.
pub fn load_data(comm: &Comm, c: &TrainConfig) -> CliResult<PreparedData> {
    let prepared = if comm.rank() == 0 {
        let prepared = data::load(c);
        comm.barrier();
        prepared
    } else {
        comm.barrier();
        data::load(c)
    };
    agreed(comm, prepared)
}

/// `result` on every rank of `comm` once all have one: a failure on any rank fails every
/// rank, the others naming the failing rank and its error.
pub fn agreed<T>(comm: &Comm, result: CliResult<T>) -> CliResult<T> {
    comm.agreed(result, |f| {
        CliError::Runtime(anyhow!("rank {} failed: {}", f.rank, f.message))
    })
}

/// The batch plan of this rank, refusing a global batch that does not divide.
pub fn batch_plan(
    c: &TrainConfig,
    world: usize,
    rank: usize,
) -> anyhow::Result<ember_data::BatchPlan> {
    ember_data::BatchPlan::new(c.batch_size, c.grad_accum, world, rank).map_err(|_| {
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

/// Which of ember's CubeCL kernels the run takes, and how attention runs, for its first lines;
/// an error names an `EMBER_ATTENTION` that names no way.
#[cfg(any(feature = "wgpu", feature = "cuda", feature = "rocm"))]
fn cube_kernels_line() -> CliResult<String> {
    use kernels::CubeAttention;
    let attention = CubeAttention::from_env().map_err(usage)?;
    let line = if std::env::var("EMBER_CUBE_KERNELS").as_deref() == Ok("0") {
        "ember's CubeCL kernels off (EMBER_CUBE_KERNELS=0): attention, LayerNorm, GELU, \
         cross-entropy and AdamW compose Burn's ops"
            .to_string()
    } else if let CubeAttention::Products { max_scores_bytes } =
        attention.unwrap_or(CubeAttention::PRODUCTS)
    {
        format!(
            "attention: through the device's matrix products, up to {} MiB of f32 scores a \
             group of heads (EMBER_ATTENTION=flash for the flash kernels)",
            max_scores_bytes >> 20
        )
    } else {
        "attention: ember's flash kernels (EMBER_ATTENTION=flash)".to_string()
    };
    Ok(line)
}

/// Which of CubeCL's compilers turns the run's kernels into what the CUDA driver loads, for
/// the run's first lines; an error where it is NVRTC and no CUDA toolkit is found.
#[cfg(feature = "cuda")]
fn cuda_compiler_line() -> CliResult<String> {
    use cubecl::cuda::compiler::CudaBackend;
    Ok(match CudaBackend::default() {
        CudaBackend::Llvm => "CUDA kernels: lowered to PTX by LLVM's NVPTX backend, which has no \
                              TMA or asynchronous copies (a build with --features cuda-nvrtc \
                              compiles them with NVRTC)"
            .to_string(),
        CudaBackend::Cpp => {
            let root = cubecl::cuda::install::cuda_path()
                .filter(|root| root.join("include").join("cuda_runtime.h").exists())
                .ok_or_else(|| {
                    usage(
                        "--device cuda: this ember compiles its CUDA kernels with NVRTC, which \
                         needs a CUDA toolkit's headers: set CUDA_PATH to one (the folder \
                         holding include/cuda_runtime.h), or use a build without \
                         --features cuda-nvrtc",
                    )
                })?;
            format!(
                "CUDA kernels: CUDA C++ compiled by NVRTC, with the headers of {}",
                root.display()
            )
        }
    })
}

/// Why bf16 computes in f32 in this job, as rank 0 sees it.
fn why_not_bf16() -> String {
    let here = match kernels::bf16_products() {
        kernels::Bf16Products::F32(why) => why,
        _ => "a CPU of another rank has no bf16 products that pay".to_string(),
    };
    format!("--dtype bf16: {here}, so bf16 arithmetic would be slower than f32")
}

/// Says `what` on rank 0 the first time a process chooses how bf16 computes: `ember bench
/// train --rounds N` sets up the same run N times in one process.
fn say_once(rank: usize, what: std::fmt::Arguments) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        log0!(rank, "{what}");
    }
}
