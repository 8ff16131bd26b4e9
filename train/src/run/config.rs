//! Training configuration: one struct of optional settings shared by the command line and
//! `--config FILE.toml` (flags override the file, the file overrides the preset), and the
//! fully resolved `TrainConfig` that a run uses and a checkpoint records.
//!
//! Over 400 lines for a reason: most of it is the flags' declarations, one doc comment each,
//! which clap prints as `--help`; splitting them would split one struct.

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use ember_model::{GptConfig, PRESETS};
use serde::{Deserialize, Serialize};

use crate::error::{CliResult, usage};

/// Floating-point type of the forward and backward pass. The optimizer's master weights and
/// moments are always f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// 32-bit floats everywhere.
    F32,
    /// bfloat16 compute with f32 master weights (loss computed in f32).
    Bf16,
}

/// How checkpoints are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum AsyncSave {
    /// In the background where the plan, with the host copy counted, fits the machine's
    /// memory; blocking otherwise.
    #[default]
    Auto,
    /// Every rank copies its state to host memory at the step and a thread writes it while
    /// training goes on (the last checkpoint of a run is written before it ends).
    On,
    /// Every rank writes its state before the next step, streaming it with no copy.
    Off,
}

impl From<Dtype> for ember_sharding::Compute {
    fn from(dtype: Dtype) -> Self {
        match dtype {
            Dtype::F32 => Self::F32,
            Dtype::Bf16 => Self::Bf16,
        }
    }
}

/// Which Burn backend runs the model, and for a GPU backend which GPU: `cuda` or `rocm`
/// alone picks the rank's GPU on its node (GPU `i` for the node's `i`-th rank, as `mpirun`,
/// `srun` and `torchrun` number local ranks), `cuda:I` / `rocm:I` GPU `I`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DeviceKind {
    /// Burn's pure-Rust SIMD CPU backend: the fastest CPU backend measured (BENCHMARKS.md).
    Flex,
    /// Burn's ndarray CPU backend (deprecated upstream); build with `--features ndarray`.
    Ndarray,
    /// wgpu (Vulkan, Metal, DX12); build with `--features wgpu`.
    Wgpu,
    /// NVIDIA CUDA, GPU index (or the rank's local GPU); build with `--features cuda`.
    Cuda(Option<usize>),
    /// AMD ROCm (HIP), GPU index (or the rank's local GPU); build with `--features rocm`.
    Rocm(Option<usize>),
}

impl DeviceKind {
    /// Whether the device is one of CubeCL's (its memory the device's own).
    pub fn is_cubecl(self) -> bool {
        matches!(self, Self::Wgpu | Self::Cuda(_) | Self::Rocm(_))
    }
}

impl std::str::FromStr for DeviceKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (name, index) = match s.split_once(':') {
            Some((name, i)) => {
                let index = i.parse::<usize>().map_err(|_| {
                    format!("`{s}`: the GPU index after `:` must be a number, e.g. {name}:0")
                })?;
                (name, Some(index))
            }
            None => (s, None),
        };
        let kind = match name {
            "flex" => Self::Flex,
            "ndarray" => Self::Ndarray,
            "wgpu" => Self::Wgpu,
            "cuda" => Self::Cuda(index),
            "rocm" => Self::Rocm(index),
            _ => {
                return Err(format!(
                    "`{s}` is not a device: use flex, ndarray, wgpu, cuda[:I] or rocm[:I]"
                ));
            }
        };
        if index.is_some() && !matches!(kind, Self::Cuda(_) | Self::Rocm(_)) {
            return Err(format!("`{s}`: only cuda and rocm take a GPU index"));
        }
        Ok(kind)
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (name, index) = match *self {
            Self::Flex => ("flex", None),
            Self::Ndarray => ("ndarray", None),
            Self::Wgpu => ("wgpu", None),
            Self::Cuda(i) => ("cuda", i),
            Self::Rocm(i) => ("rocm", i),
        };
        match index {
            Some(i) => write!(f, "{name}:{i}"),
            None => f.write_str(name),
        }
    }
}

impl TryFrom<String> for DeviceKind {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<DeviceKind> for String {
    fn from(d: DeviceKind) -> String {
        d.to_string()
    }
}

/// Every training setting, each optional so sources can be layered. The same struct is
/// parsed from flags (kebab-case, `--n-layer`) and from TOML (snake_case, `n_layer`).
#[derive(Debug, Clone, Default, Args, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainOverrides {
    /// Model size preset: tiny, small-cpu, gpt2, gpt2-medium, gpt2-large, gpt2-xl,
    /// gpt3-2.7b, gpt3-6.7b, gpt3-13b, neox-20b [default: small-cpu]
    #[arg(long)]
    pub preset: Option<String>,
    /// Number of transformer blocks (overrides the preset)
    #[arg(long)]
    pub n_layer: Option<usize>,
    /// Attention heads per block (overrides the preset)
    #[arg(long)]
    pub n_head: Option<usize>,
    /// Model width (overrides the preset); must be divisible by --n-head
    #[arg(long)]
    pub n_embd: Option<usize>,
    /// Context length in tokens; from scratch it also sets the model's positions
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Vocabulary of the byte-level BPE trained on the data [default: 512]; ignored with
    /// --tokenizer
    #[arg(long)]
    pub vocab_size: Option<usize>,
    /// Sequences per optimizer step (the global batch), split into --grad-accum micro-batches
    /// [default: 8]
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Micro-batches accumulated per optimizer step [default: 1]
    #[arg(long)]
    pub grad_accum: Option<usize>,
    /// Optimizer steps to train for [default: 400]
    #[arg(long)]
    pub max_iters: Option<u64>,
    /// Peak learning rate [default: 2e-3]
    #[arg(long)]
    #[serde(alias = "learning_rate")]
    pub lr: Option<f64>,
    /// Learning rate at the end of the cosine decay [default: 2e-4]
    #[arg(long)]
    pub min_lr: Option<f64>,
    /// Steps of linear warmup [default: 50]
    #[arg(long)]
    pub warmup_iters: Option<u64>,
    /// Step at which the cosine decay reaches --min-lr [default: --max-iters]
    #[arg(long)]
    pub lr_decay_iters: Option<u64>,
    /// AdamW decoupled weight decay, applied to 2-D weights only [default: 0.1]
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// AdamW beta1 [default: 0.9]
    #[arg(long)]
    pub beta1: Option<f64>,
    /// AdamW beta2 [default: 0.95]
    #[arg(long)]
    pub beta2: Option<f64>,
    /// Clip the global gradient norm to this value; 0 disables [default: 1.0]
    #[arg(long)]
    pub grad_clip: Option<f64>,
    /// Evaluate the validation loss every N steps; 0 disables [default: 100]
    #[arg(long)]
    pub eval_interval: Option<u64>,
    /// Validation micro-batches per evaluation [default: 10]
    #[arg(long)]
    pub eval_iters: Option<u64>,
    /// Dropout probability [default: 0]
    #[arg(long)]
    pub dropout: Option<f64>,
    /// Compute dtype [default: f32]
    #[arg(long, value_enum)]
    pub dtype: Option<Dtype>,
    /// Backend: flex, ndarray, wgpu, cuda[:I] or rocm[:I] (`cuda`/`rocm` alone: the rank's
    /// GPU on its node) [default: flex]
    // clap's `--help` text, not Markdown: `cuda[:I]` is what a user types, not a link.
    #[allow(rustdoc::broken_intra_doc_links)]
    #[arg(long)]
    pub device: Option<DeviceKind>,
    /// Seed of the initial weights, the batch order and dropout [default: 1337]
    #[arg(long)]
    pub seed: Option<u64>,
    /// Text file, or a directory made by `ember prepare` [default: the embedded Tiny
    /// Shakespeare]
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// A Hugging Face tokenizer.json to use instead of training a BPE
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Where checkpoints, metrics.jsonl and loss.png go [default: out]
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    /// Save a checkpoint every N steps (and always at the end); 0 = only at the end
    /// [default: 500]
    #[arg(long)]
    pub save_interval: Option<u64>,
    /// Log (and write a metrics line) every N steps [default: 10]
    #[arg(long)]
    pub log_interval: Option<u64>,
    /// Keep only the newest K checkpoints, deleting older ones once a new one is complete;
    /// 0 keeps all [default: 0]
    #[arg(long)]
    pub keep_last: Option<u64>,
    /// Write checkpoints in the background (on), before the next step (off), or in the
    /// background where memory allows the host copy (auto) [default: auto]
    #[arg(long, value_enum)]
    pub async_save: Option<AsyncSave>,
    /// Peak FLOP/s of the device in TFLOP/s, for MFU [default: estimated for CPUs]
    #[arg(long)]
    pub peak_tflops: Option<f64>,
}

/// The resolved configuration of a run; recorded in every checkpoint manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    /// Preset the model dimensions started from.
    pub preset: String,
    /// The model; `vocab_size` is the tokenizer's once data is loaded.
    pub model: GptConfig,
    /// Context length used for training (at most `model.block_size`).
    pub block_size: usize,
    /// Vocabulary requested for a trained tokenizer.
    pub vocab_size: usize,
    /// Global batch, sequences per optimizer step.
    pub batch_size: usize,
    /// Micro-batches per optimizer step.
    pub grad_accum: usize,
    /// Total optimizer steps.
    pub max_iters: u64,
    /// Peak learning rate.
    pub lr: f64,
    /// Final learning rate.
    pub min_lr: f64,
    /// Linear warmup steps.
    pub warmup_iters: u64,
    /// End of the cosine decay.
    pub lr_decay_iters: u64,
    /// Decoupled weight decay on 2-D weights.
    pub weight_decay: f64,
    /// Adam beta1.
    pub beta1: f64,
    /// Adam beta2.
    pub beta2: f64,
    /// Global-norm clip (0 = off).
    pub grad_clip: f64,
    /// Eval period in steps (0 = off).
    pub eval_interval: u64,
    /// Micro-batches per eval.
    pub eval_iters: u64,
    /// Compute dtype.
    pub dtype: Dtype,
    /// Backend.
    pub device: DeviceKind,
    /// Run seed.
    pub seed: u64,
    /// Data source (None = embedded corpus).
    pub data: Option<PathBuf>,
    /// Tokenizer file (None = train a BPE).
    pub tokenizer: Option<PathBuf>,
    /// Output directory.
    pub out_dir: PathBuf,
    /// Checkpoint period (0 = end only).
    pub save_interval: u64,
    /// Logging period.
    pub log_interval: u64,
    /// Checkpoints kept (0 = all).
    #[serde(default)]
    pub keep_last: u64,
    /// How checkpoints are written, as asked (`auto` is settled for each run from the memory
    /// of the machines it runs on).
    #[serde(default)]
    pub async_save: AsyncSave,
    /// Peak device TFLOP/s for MFU (None = estimate).
    pub peak_tflops: Option<f64>,
}

impl TrainOverrides {
    /// Reads a TOML file of the same settings (snake_case keys).
    pub fn from_toml_file(path: &Path) -> CliResult<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| usage(format!("--config {}: cannot read it: {e}", path.display())))?;
        toml::from_str(&text).map_err(|e| {
            usage(format!(
                "--config {}: {}",
                path.display(),
                e.to_string().trim_end()
            ))
        })
    }

    /// The settings this gives, by their TOML names (`n_layer`), and whether each is given.
    pub fn given(&self) -> Vec<(String, bool)> {
        match serde_json::to_value(self) {
            Ok(serde_json::Value::Object(fields)) => fields
                .into_iter()
                .map(|(name, value)| (name, !value.is_null()))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// `self` with every setting that `over` gives replaced by `over`'s.
    pub fn overridden_by(mut self, over: &TrainOverrides) -> Self {
        macro_rules! take {
            ($($field:ident),* $(,)?) => { $( if over.$field.is_some() { self.$field = over.$field.clone(); } )* };
        }
        take!(
            preset,
            n_layer,
            n_head,
            n_embd,
            block_size,
            vocab_size,
            batch_size,
            grad_accum,
            max_iters,
            lr,
            min_lr,
            warmup_iters,
            lr_decay_iters,
            weight_decay,
            beta1,
            beta2,
            grad_clip,
            eval_interval,
            eval_iters,
            dropout,
            dtype,
            device,
            seed,
            data,
            tokenizer,
            out_dir,
            save_interval,
            log_interval,
            keep_last,
            async_save,
            peak_tflops,
        );
        self
    }
}

impl TrainConfig {
    /// A new run's configuration: defaults, then the preset, then `o`.
    pub fn resolve(o: &TrainOverrides) -> CliResult<Self> {
        let preset = o.preset.clone().unwrap_or_else(|| "small-cpu".into());
        let model = GptConfig::preset(&preset).ok_or_else(|| {
            usage(format!(
                "--preset {preset} is not a preset; choose one of: {}",
                PRESETS.join(", ")
            ))
        })?;
        // Sized so the default run (small-cpu on 2 CPU cores) ends in about 6 minutes with
        // readable text; see BENCHMARKS.md.
        let max_iters = o.max_iters.unwrap_or(400);
        let mut config = TrainConfig {
            preset,
            block_size: model.block_size,
            model,
            vocab_size: 512,
            batch_size: 8,
            grad_accum: 1,
            max_iters,
            lr: 2e-3,
            min_lr: 2e-4,
            warmup_iters: 50,
            lr_decay_iters: max_iters,
            weight_decay: 0.1,
            beta1: 0.9,
            // 0.95 rather than Adam's 0.999: the GPT-3 / nanoGPT setting, steadier for LMs.
            beta2: 0.95,
            grad_clip: 1.0,
            eval_interval: 100,
            eval_iters: 10,
            dtype: Dtype::F32,
            device: DeviceKind::Flex,
            seed: 1337,
            data: None,
            tokenizer: None,
            out_dir: PathBuf::from("out"),
            save_interval: 500,
            log_interval: 10,
            keep_last: 0,
            async_save: AsyncSave::Auto,
            peak_tflops: None,
        };
        // A fresh model takes its positions from --block-size (nanoGPT's meaning).
        if let Some(t) = o.block_size {
            config.model.block_size = t;
        }
        config.apply(o, true)?;
        Ok(config)
    }

    /// Applies the settings `o` gives. `fresh` is false when continuing a checkpoint: then
    /// the model's shape is fixed and flags that would change it are refused.
    pub fn apply(&mut self, o: &TrainOverrides, fresh: bool) -> CliResult<()> {
        if !fresh {
            let fixed = [
                ("--preset", o.preset.as_ref().map(|p| p != &self.preset)),
                ("--n-layer", o.n_layer.map(|v| v != self.model.n_layer)),
                ("--n-head", o.n_head.map(|v| v != self.model.n_head)),
                ("--n-embd", o.n_embd.map(|v| v != self.model.n_embd)),
                ("--vocab-size", o.vocab_size.map(|v| v != self.vocab_size)),
                (
                    "--tokenizer",
                    o.tokenizer
                        .as_ref()
                        .map(|v| Some(v) != self.tokenizer.as_ref()),
                ),
                (
                    "--data",
                    o.data.as_ref().map(|v| Some(v) != self.data.as_ref()),
                ),
                ("--seed", o.seed.map(|v| v != self.seed)),
            ];
            if let Some((flag, _)) = fixed.iter().find(|(_, differs)| *differs == Some(true)) {
                return Err(usage(format!(
                    "{flag} differs from the checkpoint being continued; drop the flag, or start \
                     a new run (without --resume) to change it"
                )));
            }
        }
        macro_rules! set {
            ($($field:ident => $target:expr),* $(,)?) => { $( if let Some(v) = o.$field.clone() { $target = v; } )* };
        }
        set!(
            n_layer => self.model.n_layer, n_head => self.model.n_head,
            n_embd => self.model.n_embd, dropout => self.model.dropout,
            block_size => self.block_size, vocab_size => self.vocab_size,
            batch_size => self.batch_size, grad_accum => self.grad_accum,
            max_iters => self.max_iters, lr => self.lr, min_lr => self.min_lr,
            warmup_iters => self.warmup_iters, weight_decay => self.weight_decay,
            beta1 => self.beta1, beta2 => self.beta2, grad_clip => self.grad_clip,
            eval_interval => self.eval_interval, eval_iters => self.eval_iters,
            dtype => self.dtype, device => self.device, seed => self.seed,
            out_dir => self.out_dir, save_interval => self.save_interval,
            log_interval => self.log_interval,
            keep_last => self.keep_last, async_save => self.async_save,
        );
        if o.data.is_some() {
            self.data = o.data.clone();
        }
        if o.tokenizer.is_some() {
            self.tokenizer = o.tokenizer.clone();
        }
        if o.peak_tflops.is_some() {
            self.peak_tflops = o.peak_tflops;
        }
        match o.lr_decay_iters {
            Some(v) => self.lr_decay_iters = v,
            // Decay follows a changed run length unless it was set explicitly.
            None if o.max_iters.is_some() && fresh => self.lr_decay_iters = self.max_iters,
            None => {}
        }
        self.validate()
    }

    /// Refuses inconsistent settings, naming the flag and the fix.
    pub fn validate(&self) -> CliResult<()> {
        let m = &self.model;
        let sizes = [
            ("--n-layer", m.n_layer),
            ("--n-head", m.n_head),
            ("--n-embd", m.n_embd),
            ("--vocab-size", m.vocab_size),
        ];
        if let Some((flag, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return Err(usage(format!("{flag} must be at least 1")));
        }
        if !(0.0..1.0).contains(&m.dropout) {
            return Err(usage(format!("--dropout {} must be in [0, 1)", m.dropout)));
        }
        if m.n_head > 0 && !m.n_embd.is_multiple_of(m.n_head) {
            return Err(usage(format!(
                "--n-embd {} is not divisible by --n-head {}: the head size must be a whole \
                 number; try --n-embd {}",
                m.n_embd,
                m.n_head,
                m.n_head * m.n_embd.div_ceil(m.n_head)
            )));
        }
        m.validate().map_err(|e| usage(format!("model: {e}")))?;
        if self.block_size == 0 {
            return Err(usage("--block-size must be at least 1"));
        }
        if self.block_size > m.block_size {
            return Err(usage(format!(
                "--block-size {} exceeds the model's {} positions; use --block-size {} or less",
                self.block_size, m.block_size, m.block_size
            )));
        }
        let positive = [
            ("--batch-size", self.batch_size as f64),
            ("--grad-accum", self.grad_accum as f64),
            ("--max-iters", self.max_iters as f64),
            ("--lr", self.lr),
            ("--log-interval", self.log_interval as f64),
        ];
        if let Some((flag, v)) = positive.iter().find(|(_, v)| !v.is_finite() || *v <= 0.0) {
            return Err(usage(format!(
                "{flag} must be a positive finite number, got {v}"
            )));
        }
        if !self.batch_size.is_multiple_of(self.grad_accum) {
            return Err(usage(format!(
                "--batch-size {} is not divisible by --grad-accum {}: each micro-batch must \
                 hold the same number of sequences",
                self.batch_size, self.grad_accum
            )));
        }
        if !(0.0..=self.lr).contains(&self.min_lr) {
            return Err(usage(format!(
                "--min-lr {} must be between 0 and --lr {}",
                self.min_lr, self.lr
            )));
        }
        for (flag, beta) in [("--beta1", self.beta1), ("--beta2", self.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return Err(usage(format!("{flag} {beta} must be in [0, 1)")));
            }
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(usage(format!(
                "--weight-decay must be a finite number of 0 or more, got {}",
                self.weight_decay
            )));
        }
        if !(self.grad_clip.is_finite() && self.grad_clip >= 0.0) {
            return Err(usage(format!(
                "--grad-clip must be a finite number of 0 or more (0 disables clipping), got {}",
                self.grad_clip
            )));
        }
        if self.eval_interval > 0 && self.eval_iters == 0 {
            return Err(usage(
                "--eval-iters must be at least 1 when --eval-interval is set",
            ));
        }
        if self.tokenizer.is_none() && self.vocab_size < 257 {
            return Err(usage(format!(
                "--vocab-size {} is too small for a byte-level BPE: it needs 256 byte tokens \
                 plus merges; use 257 or more",
                self.vocab_size
            )));
        }
        if self.out_dir.exists() && !self.out_dir.is_dir() {
            return Err(usage(format!(
                "--out-dir {} is a file, not a directory; give a directory (new or existing)",
                self.out_dir.display()
            )));
        }
        if let Some(p) = self.peak_tflops
            && (!p.is_finite() || p <= 0.0)
        {
            return Err(usage(format!(
                "--peak-tflops must be a positive finite number, got {p}"
            )));
        }
        Ok(())
    }

    /// Sequences per micro-batch on one process.
    pub fn micro_batch(&self) -> usize {
        self.batch_size / self.grad_accum
    }

    /// Tokens consumed per optimizer step.
    pub fn tokens_per_step(&self) -> usize {
        self.batch_size * self.block_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn overrides(toml: &str) -> TrainOverrides {
        toml::from_str(toml).unwrap()
    }

    #[test]
    fn devices_parse_with_and_without_a_gpu_index() {
        for (text, kind) in [
            ("flex", DeviceKind::Flex),
            ("wgpu", DeviceKind::Wgpu),
            ("cuda", DeviceKind::Cuda(None)),
            ("cuda:3", DeviceKind::Cuda(Some(3))),
            ("rocm", DeviceKind::Rocm(None)),
            ("rocm:0", DeviceKind::Rocm(Some(0))),
        ] {
            assert_eq!(text.parse::<DeviceKind>(), Ok(kind));
            assert_eq!(kind.to_string(), text);
        }
        assert_eq!(
            overrides("device = 'rocm:1'").device,
            Some(DeviceKind::Rocm(Some(1)))
        );
        for (bad, says) in [
            ("tpu", "is not a device"),
            ("cuda:x", "must be a number"),
            ("wgpu:1", "only cuda and rocm"),
        ] {
            let err = bad.parse::<DeviceKind>().unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn flags_override_file_override_preset() {
        let file = overrides("preset = 'tiny'\nn_layer = 3\nlr = 0.01");
        let flags = TrainOverrides {
            lr: Some(0.02),
            ..Default::default()
        };
        let c = TrainConfig::resolve(&file.overridden_by(&flags)).unwrap();
        assert_eq!(c.model.n_layer, 3);
        assert_eq!(c.model.n_embd, GptConfig::tiny().n_embd);
        assert_eq!(c.lr, 0.02);
    }

    #[test]
    fn unknown_toml_key_is_refused() {
        assert!(toml::from_str::<TrainOverrides>("n_layers = 3").is_err());
    }

    #[test]
    fn indivisible_heads_name_both_flags() {
        let o = overrides("n_embd = 100\nn_head = 3");
        let CliError::Usage(msg) = TrainConfig::resolve(&o).unwrap_err() else {
            panic!("expected a usage error")
        };
        assert!(
            msg.contains("--n-embd 100") && msg.contains("--n-head 3"),
            "{msg}"
        );
    }

    #[test]
    fn resume_refuses_a_model_change_but_takes_max_iters() {
        let mut c = TrainConfig::resolve(&overrides("preset = 'tiny'")).unwrap();
        assert!(c.apply(&overrides("n_layer = 5"), false).is_err());
        c.apply(&overrides("max_iters = 77"), false).unwrap();
        assert_eq!(c.max_iters, 77);
    }

    use crate::error::CliError;
}
