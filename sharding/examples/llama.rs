//! A Llama-style decoder in plain Burn (RMSNorm, rotary attention, SwiGLU, untied head),
//! sharded with ZeRO-3 or any preset over MPI ranks, or run as one process without `mpirun`.
//! It learns a token sequence whose next token is a fixed function of the last, then writes
//! one greedily.
//!
//! ```text
//! cargo build --release -p ember-sharding --example llama
//! mpirun -np 4 --oversubscribe -x EMBER_TOPOLOGY=2x2x1 target/release/examples/llama \
//!   --shard zero3 --steps 60 --save /tmp/llama
//! mpirun -np 2 --oversubscribe -x EMBER_TOPOLOGY=1x2x1 target/release/examples/llama \
//!   --shard hier3 --steps 120 --resume /tmp/llama/step-000060
//! target/release/examples/llama --steps 120
//! ```
//!
//! Nothing in `Llama` or `Block` knows of sharding. The sharding-specific code is the 15 lines
//! marked `// sharding`: the communicator from `mpirun`'s environment, the build (the three
//! pieces `Llama::forward` is made of, as closures; the checkpoint to resume, checked against
//! the example's record), the step, the save and the module gathered back. The batch is a
//! pair of Burn tensors, which split by rows among the ranks as they are.

use std::path::PathBuf;

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{
    Embedding, EmbeddingConfig, Linear, LinearConfig, RmsNorm, RmsNormConfig, RotaryEncoding,
    RotaryEncodingConfig,
};
use burn::tensor::activation::{silu, softmax};
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use ember_comm::Comm;

use ember_sharding::{AdamW, DecayOn, Preset, SaveOptions, Shard, ShardError};

/// The model's size (also the record its checkpoints keep: a resumed one must have the same).
#[derive(Debug, Clone, Copy, serde::Serialize)]
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

/// The token stream's rule: the token after `t`.
pub fn next_token(t: usize, vocab: usize) -> usize {
    (5 * t + 3) % vocab
}

/// A batch: token ids (`[batch, seq]`) and the ids each position predicts, the next ones.
pub type Batch = (Tensor<2, Int>, Tensor<2, Int>);

/// Step `step`'s batch on `device`: `rows` sequences of `cols + 1` tokens, each from its own
/// start token, as inputs and targets of `cols` tokens.
pub fn draw(step: u64, rows: usize, cols: usize, vocab: usize, device: &Device) -> Batch {
    let (mut inputs, mut targets) = (Vec::new(), Vec::new());
    for r in 0..rows as u64 {
        let mut z = (step << 20 ^ r).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z ^= z >> 29;
        let mut t = (z % vocab as u64) as usize;
        for _ in 0..cols {
            inputs.push(t as i64);
            t = next_token(t, vocab);
            targets.push(t as i64);
        }
    }
    let ids = |v: Vec<i64>| Tensor::from_data(TensorData::new(v, [rows, cols]), device);
    (ids(inputs), ids(targets))
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
pub const BATCH: (usize, usize) = (16, 32);

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
    let adamw = AdamW {
        beta2: 0.95,
        weight_decay: 0.1,
        decay_on: DecayOn::Matrices,
        ..AdamW::default()
    };
    // The three pieces `Llama::forward` is made of.
    let embed = |m: &Llama, (ids, _): &Batch, _: &Device| m.embed.forward(ids.clone()); // sharding
    let block = |m: &Llama, i: usize, x, _: &Batch| m.blocks[i].forward(x, &m.rope); // sharding
    let loss = |m: &Llama, x, (_, y): &Batch, _: &Device| cross_entropy(m.logits(x), y.clone()); // sharding
    let mut model = Shard::blocks("blocks") // sharding
        .preset(run.preset.parse::<Preset>()?) // sharding
        .seed(11) // sharding
        .record(&SIZE) // sharding
        .resume_from(run.resume.as_deref()) // sharding
        .forward(embed, block, loss) // sharding
        .build(comm, |d| SIZE.init(d), device.clone())?; // sharding
    let mut losses = Vec::new();
    for step in model.step()..run.steps {
        let batch = draw(step, BATCH.0, BATCH.1, SIZE.vocab, &device);
        let mut grads = model.backward(&[model.share(&batch)?])?; // sharding
        grads.clip_norm(1.0);
        let report = model.apply(grads, &adamw, 3e-3)?; // sharding
        losses.push((step, report.loss));
        if comm.rank() == 0 && (step % 20 == 0 || step + 1 == run.steps) {
            println!("step {step:>4} loss {:.4}", report.loss);
        }
    }
    if let Some(dir) = &run.save {
        model.save(dir, &SaveOptions::default())?; // sharding
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
    let run = Run {
        preset: flag("--shard").unwrap_or_else(|| "zero3".into()),
        steps: flag("--steps").and_then(|s| s.parse().ok()).unwrap_or(120),
        resume: flag("--resume").map(PathBuf::from),
        save: flag("--save").map(PathBuf::from),
    };
    let result = Comm::from_env() // sharding
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
