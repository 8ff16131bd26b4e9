//! An encoder-decoder in plain Burn (T5- and BART-like: pre-norm blocks of Burn's
//! `MultiHeadAttention`, cross-attention over the encoder's output, a token embedding tied to
//! the head, source padding masks, Burn's `Dropout` on the embeddings, in the residual branches
//! and inside attention, an auxiliary loss per decoder block and a z-loss), sharded with any
//! preset over MPI ranks, or run as one process without `mpirun`. It learns to write each
//! source sequence with every token mapped by a fixed function, then writes one greedily.
//!
//! ```text
//! cargo build --release -p ember-sharding --example seq2seq
//! mpirun -np 4 --oversubscribe -x EMBER_TOPOLOGY=2x2x1 target/release/examples/seq2seq \
//!   --shard zero3 --steps 60 --save /tmp/seq2seq
//! mpirun -np 2 --oversubscribe -x EMBER_TOPOLOGY=1x2x1 target/release/examples/seq2seq \
//!   --shard hier3 --steps 120 --resume /tmp/seq2seq/step-000060
//! target/release/examples/seq2seq --steps 120 --dropout 0.1
//! ```
//!
//! Nothing in `Seq2Seq` or its blocks knows of sharding. The sharding-specific code is the 16
//! lines marked `// sharding`: the communicator, the build (the model's two stacks `enc` and
//! `dec` named with their block pieces, the embedding before them, the step from one to the
//! other that hands the decoder the encoder's output beside its input, the loss after them;
//! the options), the step, the save and the module gathered back.
//!
//! Sequences are padded, so micro-batches hold different counts of target tokens. The loss
//! piece gives each micro-batch's sum over its target tokens divided by the count in the whole
//! global batch (`Pairs::share`), and the step sums those shares (`StepLoss::Sum`): the loss is
//! the mean over the global batch's tokens at any world size. Dropout comes from the device's
//! generator, which the partitioner seeds before each unit from (seed, step, micro-batch of the
//! global batch, unit) and again before backward recomputes the unit: `N` ranks of
//! micro-batches of `MICRO` rows draw what one process of the same micro-batches draws.

use std::path::PathBuf;

use burn::module::Module;
use burn::nn::attention::{MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};
use burn::nn::{
    Dropout, DropoutConfig, Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear,
    LinearConfig,
};
use burn::tensor::activation::gelu;
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use ember_comm::Comm;
use ember_sharding::{AdamW, Preset, SaveOptions, Shard, ShardError, StepLoss};

/// The model's size (also the record its checkpoints keep: a resumed one must have the same).
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Seq2SeqConfig {
    /// Tokens in the vocabulary, padding and start included.
    pub vocab: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Attention heads.
    pub heads: usize,
    /// Encoder blocks.
    pub enc_layers: usize,
    /// Decoder blocks.
    pub dec_layers: usize,
    /// Width of the feed-forward layers.
    pub hidden: usize,
    /// Longest sequence.
    pub max_len: usize,
    /// Dropout on the embeddings, the residual branches and the attention weights.
    pub dropout: f64,
    /// Weight of each decoder block's activation penalty.
    pub aux: f64,
    /// Weight of the z-loss (the squared log-partition of the logits).
    pub z_loss: f64,
}

/// One encoder block: pre-norm self-attention over the source, then a pre-norm GELU
/// feed-forward layer.
#[derive(Module, Debug)]
pub struct EncBlock {
    attn_norm: LayerNorm,
    attn: MultiHeadAttention,
    ffn_norm: LayerNorm,
    up: Linear,
    down: Linear,
    drop: Dropout,
}

/// One decoder block: pre-norm causal self-attention, pre-norm cross-attention over the
/// encoder's output, then a pre-norm GELU feed-forward layer.
#[derive(Module, Debug)]
pub struct DecBlock {
    self_norm: LayerNorm,
    self_attn: MultiHeadAttention,
    cross_norm: LayerNorm,
    cross_attn: MultiHeadAttention,
    ffn_norm: LayerNorm,
    up: Linear,
    down: Linear,
    drop: Dropout,
    aux: f64,
}

/// The encoder-decoder.
#[derive(Module, Debug)]
pub struct Seq2Seq {
    /// Token embedding, tied to the head.
    pub tokens: Embedding,
    /// Position embedding.
    pub positions: Embedding,
    /// Dropout of the embeddings.
    pub drop: Dropout,
    /// The encoder's blocks.
    pub enc: Vec<EncBlock>,
    /// The encoder's final norm.
    pub enc_norm: LayerNorm,
    /// The decoder's blocks.
    pub dec: Vec<DecBlock>,
    /// The decoder's final norm.
    pub dec_norm: LayerNorm,
    /// Weight of the z-loss.
    pub z_loss: f64,
}

impl Seq2SeqConfig {
    /// A model with lazy parameters (drawn when first read).
    pub fn init(&self, device: &Device) -> Seq2Seq {
        let d = self.d_model;
        let linear = |i: usize, o: usize| LinearConfig::new(i, o).init(device);
        let norm = || LayerNormConfig::new(d).init(device);
        let attention = || {
            MultiHeadAttentionConfig::new(d, self.heads)
                .with_dropout(self.dropout)
                .init(device)
        };
        let drop = || DropoutConfig::new(self.dropout).init();
        Seq2Seq {
            tokens: EmbeddingConfig::new(self.vocab, d).init(device),
            positions: EmbeddingConfig::new(self.max_len, d).init(device),
            drop: drop(),
            enc: (0..self.enc_layers)
                .map(|_| EncBlock {
                    attn_norm: norm(),
                    attn: attention(),
                    ffn_norm: norm(),
                    up: linear(d, self.hidden),
                    down: linear(self.hidden, d),
                    drop: drop(),
                })
                .collect(),
            enc_norm: norm(),
            dec: (0..self.dec_layers)
                .map(|_| DecBlock {
                    self_norm: norm(),
                    self_attn: attention(),
                    cross_norm: norm(),
                    cross_attn: attention(),
                    ffn_norm: norm(),
                    up: linear(d, self.hidden),
                    down: linear(self.hidden, d),
                    drop: drop(),
                    aux: self.aux,
                })
                .collect(),
            dec_norm: norm(),
            z_loss: self.z_loss,
        }
    }
}

impl EncBlock {
    /// `x` (`[batch, source, d_model]`) through the block, padding keys masked.
    pub fn forward(&self, x: Tensor<3>, pairs: &Pairs) -> Tensor<3> {
        let pad = pairs.source_padding(&x.device());
        let n = self.attn_norm.forward(x.clone());
        let a = self.attn.forward(MhaInput::self_attn(n).mask_pad(pad));
        let x = x + self.drop.forward(a.context);
        let n = self.ffn_norm.forward(x.clone());
        x + self
            .drop
            .forward(self.down.forward(gelu(self.up.forward(n))))
    }
}

impl DecBlock {
    /// `y` (`[batch, target, d_model]`) through the block, attending to `memory` (the
    /// encoder's output): the output, and the block's share of its activation penalty (the
    /// mean square of its output over the global batch's target tokens, times its weight).
    pub fn forward(
        &self,
        y: Tensor<3>,
        memory: Tensor<3>,
        pairs: &Pairs,
    ) -> (Tensor<3>, Tensor<1>) {
        let device = y.device();
        let [b, t, _] = y.dims();
        let causal = Tensor::<2, Bool>::tril_mask([t, t], 0, &device).expand([b, t, t]);
        let n = self.self_norm.forward(y.clone());
        let a = self
            .self_attn
            .forward(MhaInput::self_attn(n).mask_attn(causal));
        let y = y + self.drop.forward(a.context);
        let n = self.cross_norm.forward(y.clone());
        let pad = pairs.source_padding(&device);
        let c = self
            .cross_attn
            .forward(MhaInput::new(n, memory.clone(), memory).mask_pad(pad));
        let y = y + self.drop.forward(c.context);
        let n = self.ffn_norm.forward(y.clone());
        let y = y + self
            .drop
            .forward(self.down.forward(gelu(self.up.forward(n))));
        let square = (y.clone() * y.clone()).mean_dim(2).reshape([b, t]);
        let aux = pairs.share(square, &device) * self.aux;
        (y, aux)
    }
}

impl Seq2Seq {
    /// Token ids (`[batch, len]`) to the first block's input: token and position embeddings.
    pub fn embed(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        let [b, t] = ids.dims();
        let positions = Tensor::<1, Int>::arange(0..t as i64, &ids.device())
            .reshape([1, t])
            .expand([b, t]);
        self.drop
            .forward(self.tokens.forward(ids) + self.positions.forward(positions))
    }

    /// The encoder's output `x` as the decoder reads it: after the encoder's final norm.
    pub fn memory(&self, x: Tensor<3>) -> Tensor<3> {
        self.enc_norm.forward(x)
    }

    /// The logits of the decoder's output `y` (`[batch, target, d_model]`): the final norm,
    /// then the head tied to the token embedding (scaled by `1 / sqrt(d_model)`, as T5 does).
    pub fn logits(&self, y: Tensor<3>) -> Tensor<3> {
        let [b, t, d] = y.dims();
        let n = self.dec_norm.forward(y).reshape([b * t, d]) / (d as f64).sqrt();
        let logits = n.matmul(self.tokens.weight.val().transpose());
        let vocab = logits.dims()[1];
        logits.reshape([b, t, vocab])
    }

    /// The micro-batch's share of the step's loss: cross-entropy and z-loss summed over its
    /// target tokens, over the count of target tokens in the global batch.
    pub fn loss(&self, y: Tensor<3>, pairs: &Pairs, device: &Device) -> Tensor<1> {
        let logits = self.logits(y);
        let [b, t, _] = logits.dims();
        let max = logits.clone().max_dim(2).detach();
        let lse = (logits.clone() - max.clone()).exp().sum_dim(2).log() + max;
        let targets = pairs.targets(device).reshape([b, t, 1]);
        let nll = (lse.clone() - logits.gather(2, targets)).reshape([b, t]);
        let z = (lse.clone() * lse).reshape([b, t]) * self.z_loss;
        pairs.share(nll + z, device)
    }

    /// The micro-batch's share of the loss, by the model's own forward: what the partitioner
    /// runs unit by unit.
    pub fn forward(&self, pairs: &Pairs, device: &Device) -> Tensor<1> {
        let mut x = self.embed(pairs.sources(device));
        for block in &self.enc {
            x = block.forward(x, pairs);
        }
        let memory = self.memory(x);
        let mut y = self.embed(pairs.shifted(device));
        let mut aux = Tensor::zeros([1], device);
        for block in &self.dec {
            let (out, penalty) = block.forward(y, memory.clone(), pairs);
            (y, aux) = (out, aux + penalty);
        }
        aux + self.loss(y, pairs, device)
    }

    /// Greedy decoding of `source` (token ids without padding), `len` tokens.
    pub fn generate(&self, source: &[i64], len: usize, device: &Device) -> Vec<i64> {
        let pairs = Pairs::inference(source);
        let mut x = self.embed(pairs.sources(device));
        for block in &self.enc {
            x = block.forward(x, &pairs);
        }
        let memory = self.memory(x);
        let mut out = vec![BOS];
        for _ in 0..len {
            let ids = Tensor::from_data(TensorData::new(out.clone(), [1, out.len()]), device);
            let mut y = self.embed(ids);
            for block in &self.dec {
                y = block.forward(y, memory.clone(), &pairs).0;
            }
            let logits = self.logits(y);
            let t = out.len();
            let last = logits
                .slice([0..1, t - 1..t])
                .reshape([SIZE.vocab])
                .argmax(0);
            out.push(
                last.into_data()
                    .convert::<i64>()
                    .try_to_vec::<i64>()
                    .unwrap()[0],
            );
        }
        out.split_off(1)
    }
}

/// The padding token.
pub const PAD: i64 = 0;
/// The decoder's start token.
pub const BOS: i64 = 1;

/// The task's rule: the target token for source token `t`.
pub fn map_token(t: i64, vocab: usize) -> i64 {
    2 + (3 * t + 1) % (vocab as i64 - 2)
}

/// Source and target sequences, `rows` of them, right-padded to `len` tokens: a source of `n`
/// tokens has a target of `n` tokens, its source with every token mapped.
#[derive(Debug, Clone)]
pub struct Pairs {
    sources: Vec<i64>,
    targets: Vec<i64>,
    lens: Vec<usize>,
    len: usize,
    /// Target tokens in the whole global batch this batch was cut from.
    tokens: usize,
}

impl Pairs {
    /// Step `step`'s global batch: `rows` pairs of `len` tokens at most, each at least a third
    /// of `len` long.
    pub fn draw(step: u64, rows: usize, len: usize, vocab: usize) -> Self {
        let (mut sources, mut targets, mut lens) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..rows as u64 {
            let mut z = (step << 20 ^ r).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            z ^= z >> 31;
            let n = len / 3 + (z >> 8) as usize % (len - len / 3 + 1);
            let source: Vec<i64> = (0..n)
                .map(|i| {
                    let h = (z ^ (i as u64 + 1)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                    2 + ((h >> 33) % (vocab as u64 - 2)) as i64
                })
                .collect();
            let target = source.iter().map(|&t| map_token(t, vocab));
            sources.extend(
                source
                    .iter()
                    .copied()
                    .chain(std::iter::repeat_n(PAD, len - n)),
            );
            targets.extend(target.chain(std::iter::repeat_n(PAD, len - n)));
            lens.push(n);
        }
        let tokens = lens.iter().sum();
        Self {
            sources,
            targets,
            lens,
            len,
            tokens,
        }
    }

    /// One source to decode.
    fn inference(source: &[i64]) -> Self {
        Self {
            sources: source.to_vec(),
            targets: vec![PAD; source.len()],
            lens: vec![source.len()],
            len: source.len(),
            tokens: source.len(),
        }
    }

    fn ids(&self, ids: Vec<i64>, device: &Device) -> Tensor<2, Int> {
        Tensor::from_data(TensorData::new(ids, [self.lens.len(), self.len]), device)
    }

    /// The source token ids, `[batch, len]`.
    pub fn sources(&self, device: &Device) -> Tensor<2, Int> {
        self.ids(self.sources.clone(), device)
    }

    /// The target token ids, `[batch, len]`.
    pub fn targets(&self, device: &Device) -> Tensor<2, Int> {
        self.ids(self.targets.clone(), device)
    }

    /// The decoder's inputs: the targets shifted right, after the start token.
    pub fn shifted(&self, device: &Device) -> Tensor<2, Int> {
        let ids = self
            .targets
            .chunks(self.len)
            .flat_map(|row| std::iter::once(BOS).chain(row[..self.len - 1].iter().copied()))
            .collect();
        self.ids(ids, device)
    }

    /// Which source positions are padding, `[batch, len]`.
    pub fn source_padding(&self, device: &Device) -> Tensor<2, Bool> {
        self.sources(device).equal_elem(PAD)
    }

    /// `x` (`[batch, positions]`, a value per target position) summed over the target tokens,
    /// over the count of target tokens in the global batch: this batch's share of the mean.
    pub fn share(&self, x: Tensor<2>, device: &Device) -> Tensor<1> {
        let [b, t] = x.dims();
        let real: Vec<f32> = self
            .lens
            .iter()
            .flat_map(|&n| (0..t).map(move |i| if i < n { 1.0 } else { 0.0 }))
            .collect();
        let real = Tensor::<2>::from_data(TensorData::new(real, [b, t]), device);
        (x * real).sum() / self.tokens as f64
    }
}

impl ember_sharding::Rows for Pairs {
    fn rows(&self) -> usize {
        self.lens.len()
    }

    fn select(&self, rows: std::ops::Range<usize>) -> Self {
        let cut = |v: &[i64]| v[rows.start * self.len..rows.end * self.len].to_vec();
        Self {
            sources: cut(&self.sources),
            targets: cut(&self.targets),
            lens: self.lens[rows].to_vec(),
            len: self.len,
            tokens: self.tokens,
        }
    }
}

/// The example's model.
pub const SIZE: Seq2SeqConfig = Seq2SeqConfig {
    vocab: 24,
    d_model: 32,
    heads: 4,
    enc_layers: 2,
    dec_layers: 2,
    hidden: 64,
    max_len: 10,
    dropout: 0.1,
    aux: 1e-3,
    z_loss: 1e-4,
};

/// Pairs per step over all ranks, and tokens per sequence at most.
pub const BATCH: (usize, usize) = (16, 10);

/// The learning rate.
pub const LR: f64 = 3e-3;

/// The seed of the weights and of the device's generator.
pub const SEED: u64 = 7;

/// What to run.
#[derive(Debug, Clone)]
pub struct Run {
    /// The preset's name.
    pub preset: String,
    /// Train until this step.
    pub steps: u64,
    /// Dropout of the model.
    pub dropout: f64,
    /// Clip the gradients' global norm to this (0 = off).
    pub clip: f64,
    /// Pairs per micro-batch (a rank's share of the step's pairs is cut into micro-batches of
    /// this many).
    pub micro: usize,
    /// A checkpoint to continue.
    pub resume: Option<PathBuf>,
    /// Where to save the last step.
    pub save: Option<PathBuf>,
}

/// What a run gives back.
#[derive(Debug)]
pub struct Trained {
    /// Every step's loss from where the run started.
    pub losses: Vec<(u64, f64)>,
    /// The trained module, gathered whole onto rank 0 (`None` on the others).
    pub model: Option<Seq2Seq>,
}

/// Trains the encoder-decoder as `run` says.
pub fn train(comm: &Comm, run: &Run) -> Result<Trained, ShardError> {
    let device = Device::flex();
    let size = Seq2SeqConfig {
        dropout: run.dropout,
        ..SIZE
    };
    let mut model = Shard::embed(|m: &Seq2Seq, b: &Pairs, _, d| m.embed(b.sources(d))) // sharding
        .stack("enc", |m, i, x, b, _| m.enc[i].forward(x, b)) // sharding
        .then(|m, x, b, _, d| (m.embed(b.shifted(d)), m.memory(x))) // sharding
        .stack("dec", |m, i, y, b, s| m.dec[i].forward(y, s.get("enc"), b)) // sharding
        .loss(|m, y, b, _, d| m.loss(y, b, d)) // sharding
        .preset(run.preset.parse::<Preset>()?) // sharding
        .seed(SEED) // sharding
        .record(&size) // sharding
        .resume_from(run.resume.as_deref()) // sharding
        .step_loss(StepLoss::Sum) // sharding
        .build(comm, |d| size.init(d), device)?; // sharding
    let adamw = AdamW {
        beta2: 0.95,
        ..AdamW::default()
    };
    let mut losses = Vec::new();
    for step in model.step()..run.steps {
        let batch = Pairs::draw(step, BATCH.0, BATCH.1, SIZE.vocab);
        let mut grads = model.backward(&model.micro_batches(&batch, run.micro)?)?; // sharding
        grads.clip_norm(run.clip);
        let report = model.apply(grads, &adamw, LR)?; // sharding
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
        dropout: flag("--dropout")
            .and_then(|s| s.parse().ok())
            .unwrap_or(SIZE.dropout),
        clip: 1.0,
        micro: flag("--micro").and_then(|s| s.parse().ok()).unwrap_or(4),
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
            let source = [5, 9, 2, 14, 7];
            let written = model.generate(&source, source.len(), &Device::flex());
            let wanted: Vec<i64> = source.iter().map(|&t| map_token(t, SIZE.vocab)).collect();
            println!("source {source:?}: wrote {written:?}, the rule gives {wanted:?}");
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
