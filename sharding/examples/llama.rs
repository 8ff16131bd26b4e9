//! A Llama-style decoder in plain Burn (RMSNorm, rotary attention, SwiGLU, untied head),
//! sharded with ZeRO-3 or any preset over MPI ranks, or run as one process without `mpirun`.
//! It learns a token sequence whose next token is a fixed function of the last, then writes
//! one greedily.
//!
//! ```text
//! cargo build --release -p ember-sharding --example llama
//! mpirun -np 4 --oversubscribe target/release/examples/llama --shard zero3 --topology 2x2x1 \
//!   --steps 60 --save /tmp/llama
//! mpirun -np 2 --oversubscribe target/release/examples/llama --shard hier3 --topology 1x2x1 \
//!   --steps 120 --resume /tmp/llama/step-000060
//! target/release/examples/llama --steps 120
//! ```
//!
//! Nothing in `Llama` or `Block` knows of sharding. The sharding-specific code is the
//! `BlockModel` impl (the three pieces `Llama::forward` is made of), the `Rows` impl and the
//! lines marked `// sharding` in `train`.

use std::path::PathBuf;

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{
    Embedding, EmbeddingConfig, Linear, LinearConfig, RmsNorm, RmsNormConfig, RotaryEncoding,
    RotaryEncodingConfig,
};
use burn::tensor::activation::{silu, softmax};
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use ember_comm::{Comm, CommConfig, Topology, TopologySource};

use ember_sharding::{
    AdamW, BlockModel, BlockOutput, Checkpoint, DecayOn, Preset, Rows, SaveOptions, Shard,
    ShardError,
};

/// The model's size.
#[derive(Debug, Clone, Copy)]
pub struct LlamaConfig {
    /// Tokens in the vocabulary.
    pub vocab: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Attention heads.
    pub heads: usize,
    /// Decoder blocks.
    pub layers: usize,
    /// Width of the SwiGLU feed-forward layer.
    pub hidden: usize,
    /// Longest sequence.
    pub max_seq: usize,
}

/// One decoder block: pre-norm rotary self-attention, then a pre-norm SwiGLU feed-forward.
#[derive(Module, Debug)]
pub struct Block {
    attn_norm: RmsNorm,
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    ffn_norm: RmsNorm,
    gate: Linear,
    up: Linear,
    down: Linear,
    heads: usize,
}

/// The decoder.
#[derive(Module, Debug)]
pub struct Llama {
    embed: Embedding,
    blocks: Vec<Block>,
    norm: RmsNorm,
    head: Linear,
    rope: RotaryEncoding,
}

impl LlamaConfig {
    /// A model with lazy parameters (drawn when first read).
    pub fn init(&self, device: &Device) -> Llama {
        let d = self.d_model;
        let linear = |i: usize, o: usize| LinearConfig::new(i, o).with_bias(false).init(device);
        Llama {
            embed: EmbeddingConfig::new(self.vocab, d).init(device),
            blocks: (0..self.layers)
                .map(|_| Block {
                    attn_norm: RmsNormConfig::new(d).init(device),
                    wq: linear(d, d),
                    wk: linear(d, d),
                    wv: linear(d, d),
                    wo: linear(d, d),
                    ffn_norm: RmsNormConfig::new(d).init(device),
                    gate: linear(d, self.hidden),
                    up: linear(d, self.hidden),
                    down: linear(self.hidden, d),
                    heads: self.heads,
                })
                .collect(),
            norm: RmsNormConfig::new(d).init(device),
            head: linear(d, self.vocab),
            rope: RotaryEncodingConfig::new(self.max_seq, d / self.heads).init(device),
        }
    }
}

impl Block {
    /// `x` (`[batch, seq, d_model]`) through the block.
    pub fn forward(&self, x: Tensor<3>, rope: &RotaryEncoding) -> Tensor<3> {
        let [b, t, d] = x.dims();
        let (h, dh) = (self.heads, d / self.heads);
        let heads = |y: Tensor<3>| y.reshape([b, t, h, dh]).swap_dims(1, 2);
        let n = self.attn_norm.forward(x.clone());
        let q = rope.forward(heads(self.wq.forward(n.clone())));
        let k = rope.forward(heads(self.wk.forward(n.clone())));
        let v = heads(self.wv.forward(n));
        let scores = q.matmul(k.swap_dims(2, 3)) / (dh as f64).sqrt();
        let future = Tensor::<2, Bool>::tril_mask([t, t], 0, &scores.device())
            .reshape([1, 1, t, t])
            .expand([b, h, t, t]);
        let att = softmax(scores.mask_fill(future, f32::NEG_INFINITY), 3).matmul(v);
        let x = x + self.wo.forward(att.swap_dims(1, 2).reshape([b, t, d]));
        let n = self.ffn_norm.forward(x.clone());
        x + self
            .down
            .forward(silu(self.gate.forward(n.clone())) * self.up.forward(n))
    }
}

impl Llama {
    /// The logits of the last block's output `x`.
    fn logits(&self, x: Tensor<3>) -> Tensor<3> {
        self.head.forward(self.norm.forward(x))
    }

    /// The model's forward: logits (`[batch, seq, vocab]`) for token ids `ids` (`[batch, seq]`).
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        let mut x = self.embed.forward(ids);
        for block in &self.blocks {
            x = block.forward(x, &self.rope);
        }
        self.logits(x)
    }

    /// `prompt` continued by `n` tokens, each the most likely next one.
    pub fn generate(&self, prompt: &[usize], n: usize, device: &Device) -> Vec<usize> {
        let mut ids = prompt.to_vec();
        for _ in 0..n {
            let t = ids.len();
            let input: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
            let input = Tensor::<2, Int>::from_data(TensorData::new(input, [1, t]), device);
            let last = self.forward(input).slice([0..1, t - 1..t]).argmax(2);
            let next = last
                .into_data()
                .convert::<i64>()
                .try_to_vec::<i64>()
                .unwrap()[0];
            ids.push(next as usize);
        }
        ids
    }
}

/// Cross-entropy of `logits` (`[batch, seq, vocab]`) against `targets` (`[batch, seq]`).
fn cross_entropy(logits: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
    let [b, t, v] = logits.dims();
    let device = logits.device();
    CrossEntropyLossConfig::new()
        .init(&device)
        .forward(logits.reshape([b * t, v]), targets.reshape([b * t]))
}

/// The pieces of `Llama::forward`, for the partitioner.
impl BlockModel<3> for Llama {
    type Batch = Tokens;

    fn embed(&self, batch: &Tokens, device: &Device) -> Tensor<3> {
        self.embed.forward(batch.inputs(device))
    }

    fn block(&self, i: usize, x: Tensor<3>, _: &Tokens) -> BlockOutput<3> {
        self.blocks[i].forward(x, &self.rope).into()
    }

    fn loss(&self, x: Tensor<3>, batch: &Tokens, device: &Device) -> Tensor<1> {
        cross_entropy(self.logits(x), batch.targets(device))
    }
}

/// The token stream's rule: the token after `t`.
pub fn next_token(t: usize, vocab: usize) -> usize {
    (5 * t + 3) % vocab
}

/// Sequences of token ids, `rows` of `cols` each.
#[derive(Debug, Clone)]
pub struct Tokens {
    ids: Vec<i64>,
    rows: usize,
    cols: usize,
}

impl Tokens {
    /// Step `step`'s batch: `rows` sequences of `cols` tokens, each from its own start token.
    pub fn draw(step: u64, rows: usize, cols: usize, vocab: usize) -> Self {
        let mut ids = Vec::with_capacity(rows * cols);
        for r in 0..rows as u64 {
            let mut z = (step << 20 ^ r).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            z ^= z >> 29;
            let mut t = (z % vocab as u64) as usize;
            for _ in 0..cols {
                ids.push(t as i64);
                t = next_token(t, vocab);
            }
        }
        Self { ids, rows, cols }
    }

    fn slice(&self, from: usize, to: usize, device: &Device) -> Tensor<2, Int> {
        let ids: Vec<i64> = self
            .ids
            .chunks(self.cols)
            .flat_map(|row| row[from..to].iter().copied())
            .collect();
        Tensor::from_data(TensorData::new(ids, [self.rows, to - from]), device)
    }

    /// Every token but the last of each sequence.
    pub fn inputs(&self, device: &Device) -> Tensor<2, Int> {
        self.slice(0, self.cols - 1, device)
    }

    /// Every token but the first: what each input position predicts.
    pub fn targets(&self, device: &Device) -> Tensor<2, Int> {
        self.slice(1, self.cols, device)
    }
}

impl Rows for Tokens {
    fn rows(&self) -> usize {
        self.rows
    }

    fn select(&self, rows: std::ops::Range<usize>) -> Self {
        Self {
            ids: self.ids[rows.start * self.cols..rows.end * self.cols].to_vec(),
            rows: rows.len(),
            cols: self.cols,
        }
    }
}

/// The example's model.
pub const SIZE: LlamaConfig = LlamaConfig {
    vocab: 64,
    d_model: 64,
    heads: 4,
    layers: 4,
    hidden: 128,
    max_seq: 64,
};

/// Sequences per step, over all ranks, and tokens per sequence.
pub const BATCH: (usize, usize) = (16, 33);

/// What one training run does.
#[derive(Debug, Clone, Default)]
pub struct Run {
    /// The sharding preset.
    pub preset: String,
    /// Steps to train to (from 0, or from the resumed checkpoint's step).
    pub steps: u64,
    /// A checkpoint (of any world size and preset) to continue.
    pub resume: Option<PathBuf>,
    /// A directory to save a checkpoint of the last step into.
    pub save: Option<PathBuf>,
}

/// The record this example keeps in its checkpoints.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Record {
    seed: u64,
}

/// What a run returns.
#[derive(Debug)]
pub struct Trained {
    /// Every step's loss from where the run started.
    pub losses: Vec<(u64, f64)>,
    /// The trained module, gathered whole onto rank 0 (`None` on the others).
    pub model: Option<Llama>,
}

/// Trains the decoder as `run` says.
pub fn train(comm: &Comm, run: &Run) -> Result<Trained, ShardError> {
    let device = Device::flex();
    let seed = 11;
    let adamw = AdamW {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        decay_on: DecayOn::Matrices,
    };
    let checkpoint = match &run.resume {
        Some(dir) => Some(Checkpoint::open(comm, dir)?), // sharding
        None => None,
    };
    let mut shard = Shard::blocks("blocks") // sharding
        .preset(run.preset.parse::<Preset>()?)
        .seed(seed);
    if let Some(checkpoint) = &checkpoint {
        let record: Record = checkpoint.manifest().app_record()?;
        if record.seed != seed {
            return Err(ShardError::setting(
                "seed",
                seed,
                "the checkpoint has another",
            ));
        }
        shard = shard.resume(checkpoint); // sharding
    }
    let mut model = shard.build(comm, |d| SIZE.init(d), device)?; // sharding
    let mut losses = Vec::new();
    for step in model.step()..run.steps {
        let batch = Tokens::draw(step, BATCH.0, BATCH.1, SIZE.vocab);
        let mut grads = model.backward(&[model.share(&batch)?])?; // sharding
        grads.clip_norm(1.0);
        let report = model.apply(grads, &adamw, 3e-3)?; // sharding
        losses.push((step, report.loss));
        if comm.rank() == 0 && (step % 20 == 0 || step + 1 == run.steps) {
            println!("step {step:>4} loss {:.4}", report.loss);
        }
    }
    if let Some(dir) = &run.save {
        model.save(dir, &SaveOptions::record(&Record { seed })?)?; // sharding
    }
    let model = model.gather_to(0)?; // sharding
    Ok(Trained { losses, model })
}

#[allow(dead_code)] // `main` is unused when a test includes this file as a module.
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let topology = match flag("--topology") {
        Some(t) => match Topology::parse(&t) {
            Ok(t) => TopologySource::Explicit(t),
            Err(e) => {
                eprintln!("--topology {t}: {e}");
                std::process::exit(2);
            }
        },
        None => TopologySource::Detect { gcds_per_gpu: None },
    };
    let run = Run {
        preset: flag("--shard").unwrap_or_else(|| "zero3".into()),
        steps: flag("--steps").and_then(|s| s.parse().ok()).unwrap_or(120),
        resume: flag("--resume").map(PathBuf::from),
        save: flag("--save").map(PathBuf::from),
    };
    let result = Comm::init(CommConfig {
        topology,
        ..CommConfig::default()
    })
    .map_err(ShardError::from)
    .and_then(|comm| Ok((comm.rank(), train(&comm, &run)?)));
    match result {
        Ok((_, Trained { model: None, .. })) => {}
        Ok((
            _,
            Trained {
                model: Some(model), ..
            },
        )) => {
            let text = model.generate(&[1], 16, &Device::flex());
            println!("greedy from token 1: {text:?}");
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
