//! A small mixture-of-experts decoder in plain Burn, sharded with any preset over MPI ranks or
//! run as one process without `mpirun`. Each block is causal self-attention, then a top-1
//! routed feed-forward layer of several experts whose router learns under a load-balancing
//! loss; sequences are left-padded to one length, and a padding mask keeps the padding out of
//! attention, the loss and the balance statistics. It learns a token sequence whose next token
//! is a fixed function of the last.
//!
//! ```text
//! cargo build --release -p ember-sharding --example moe
//! mpirun -np 4 --oversubscribe -x EMBER_TOPOLOGY=1x2x2 target/release/examples/moe --shard hier3
//! target/release/examples/moe --steps 60
//! ```
//!
//! The blocks take a side input, the batch's padding mask, and give an auxiliary loss, the
//! router's balance loss: both go through `BlockModel::block` (its `batch` argument and its
//! `BlockOutput::with_aux`). The balance loss is taken per sequence (as DeepSeek-V3's
//! sequence-wise balance loss is), and the cross-entropy is a mean over each sequence's tokens
//! and then over sequences, so a rank's share of the global batch weighs what it weighs in one
//! process: the sharded run is the one-process run, at any world size.

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::{gelu, log_softmax, softmax};
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use ember_comm::Comm;
use ember_sharding::{AdamW, BlockModel, BlockOutput, Preset, Rows, Shard, ShardError};

/// The model's size.
#[derive(Debug, Clone, Copy)]
pub struct MoeConfig {
    /// Tokens in the vocabulary, the padding token included.
    pub vocab: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Attention heads.
    pub heads: usize,
    /// Decoder blocks.
    pub layers: usize,
    /// Experts per block.
    pub experts: usize,
    /// Width of an expert's hidden layer.
    pub hidden: usize,
    /// Longest sequence.
    pub max_seq: usize,
    /// Weight of the balance loss in the loss.
    pub balance: f64,
}

/// One expert: a GELU feed-forward layer.
#[derive(Module, Debug)]
pub struct Expert {
    up: Linear,
    down: Linear,
}

/// One decoder block: pre-norm causal self-attention, then a pre-norm top-1 mixture of experts.
#[derive(Module, Debug)]
pub struct Block {
    attn_norm: LayerNorm,
    qkv: Linear,
    out: Linear,
    moe_norm: LayerNorm,
    router: Linear,
    experts: Vec<Expert>,
    heads: usize,
    /// Weight of the balance loss in the loss.
    balance: f64,
}

/// The decoder.
#[derive(Module, Debug)]
pub struct Moe {
    tokens: Embedding,
    positions: Embedding,
    blocks: Vec<Block>,
    norm: LayerNorm,
    head: Linear,
}

impl MoeConfig {
    /// A model with lazy parameters (drawn when first read).
    pub fn init(&self, device: &Device) -> Moe {
        let d = self.d_model;
        let linear = |i: usize, o: usize| LinearConfig::new(i, o).init(device);
        Moe {
            tokens: EmbeddingConfig::new(self.vocab, d).init(device),
            positions: EmbeddingConfig::new(self.max_seq, d).init(device),
            blocks: (0..self.layers)
                .map(|_| Block {
                    attn_norm: LayerNormConfig::new(d).init(device),
                    qkv: linear(d, 3 * d),
                    out: linear(d, d),
                    moe_norm: LayerNormConfig::new(d).init(device),
                    router: LinearConfig::new(d, self.experts)
                        .with_bias(false)
                        .init(device),
                    experts: (0..self.experts)
                        .map(|_| Expert {
                            up: linear(d, self.hidden),
                            down: linear(self.hidden, d),
                        })
                        .collect(),
                    heads: self.heads,
                    balance: self.balance,
                })
                .collect(),
            norm: LayerNormConfig::new(d).init(device),
            head: linear(d, self.vocab),
        }
    }
}

/// Per-token weights of one sequence each: `[batch, seq]` with 1 at every token that is not
/// padding, and the count of such tokens per sequence, `[batch, 1]`.
struct Mask {
    real: Tensor<2>,
    count: Tensor<2>,
}

impl Mask {
    /// The mean of `x` (`[batch, seq]`) over each sequence's real tokens, then over sequences.
    fn mean(&self, x: Tensor<2>) -> Tensor<1> {
        ((x * self.real.clone()).sum_dim(1) / self.count.clone())
            .mean()
            .reshape([1])
    }
}

impl Block {
    /// `x` (`[batch, seq, d_model]`) through the block, with the padding mask `real`
    /// (`[batch, seq]`, 1 at real tokens): the output and the block's balance loss.
    fn forward(&self, x: Tensor<3>, mask: &Mask) -> (Tensor<3>, Tensor<1>) {
        let [b, t, d] = x.dims();
        let (h, dh) = (self.heads, d / self.heads);
        let n = self.attn_norm.forward(x.clone());
        let qkv = self.qkv.forward(n).reshape([b, t, 3, h, dh]);
        let part = |i: usize| {
            qkv.clone()
                .slice([0..b, 0..t, i..i + 1, 0..h, 0..dh])
                .reshape([b, t, h, dh])
                .swap_dims(1, 2)
        };
        let (q, k, v) = (part(0), part(1), part(2));
        let scores = q.matmul(k.swap_dims(2, 3)) / (dh as f64).sqrt();
        // Future keys and padding keys are masked: with left padding a real token's past
        // holds padding, which must not be attended to.
        let future = Tensor::<2, Bool>::tril_mask([t, t], 0, &x.device())
            .reshape([1, 1, t, t])
            .expand([b, h, t, t]);
        let padding = mask
            .real
            .clone()
            .equal_elem(0.0)
            .reshape([b, 1, 1, t])
            .expand([b, h, t, t]);
        // A padding query sees only padding: its own key stays open so its row is defined
        // (its output never reaches the loss).
        let off_diagonal = Tensor::<2, Bool>::diag_mask([t, t], 0, &x.device())
            .reshape([1, 1, t, t])
            .expand([b, h, t, t]);
        let masked = future.bool_or(padding.bool_and(off_diagonal));
        let att = softmax(scores.mask_fill(masked, f32::NEG_INFINITY), 3).matmul(v);
        let x = x + self.out.forward(att.swap_dims(1, 2).reshape([b, t, d]));
        // Top-1 routing: each token goes to its most likely expert, scaled by that
        // probability (the router's gradient path).
        let n = self.moe_norm.forward(x.clone());
        let e = self.experts.len();
        let probs = softmax(self.router.forward(n.clone()), 2);
        let chosen = probs
            .clone()
            .argmax(2)
            .reshape([b * t])
            .one_hot::<2>(e)
            .float()
            .reshape([b, t, e]);
        let gates = chosen.clone() * probs.clone();
        let mut y = x.zeros_like();
        for (i, expert) in self.experts.iter().enumerate() {
            let out = expert.down.forward(gelu(expert.up.forward(n.clone())));
            let gate = gates.clone().slice([0..b, 0..t, i..i + 1]);
            y = y + out * gate;
        }
        // Sequence-wise balance loss: experts * sum_e f_e * P_e per sequence, f_e the share of
        // its real tokens routed to e and P_e their mean probability of e.
        let real = mask.real.clone().reshape([b, t, 1]);
        let count = mask.count.clone().reshape([b, 1, 1]);
        let share = (chosen * real.clone()).sum_dim(1) / count.clone();
        let mean_prob = (probs * real).sum_dim(1) / count;
        let balance = (share * mean_prob).sum_dim(2).reshape([b]).mean() * (e as f64);
        (x + y, balance * self.balance)
    }
}

impl Moe {
    fn embed(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        let [b, t] = ids.dims();
        let positions = Tensor::<1, Int>::arange(0..t as i64, &ids.device())
            .reshape([1, t])
            .expand([b, t]);
        self.tokens.forward(ids) + self.positions.forward(positions)
    }

    fn loss(&self, x: Tensor<3>, batch: &Padded, mask: &Mask) -> Tensor<1> {
        let [b, t, _] = x.dims();
        let log_probs = log_softmax(self.head.forward(self.norm.forward(x)), 2);
        let targets = batch.targets(&log_probs.device()).reshape([b, t, 1]);
        let nll = -log_probs.gather(2, targets).reshape([b, t]);
        mask.mean(nll)
    }
}

/// The model's forward in three pieces, for the partitioner: each block takes the padding mask
/// from the batch and gives its balance loss.
impl BlockModel<3> for Moe {
    type Batch = Padded;

    fn embed(&self, batch: &Padded, device: &Device) -> Tensor<3> {
        Moe::embed(self, batch.inputs(device))
    }

    fn block(&self, i: usize, x: Tensor<3>, batch: &Padded) -> BlockOutput<3> {
        let mask = batch.mask(&x.device());
        let (y, balance) = self.blocks[i].forward(x, &mask);
        BlockOutput::with_aux(y, balance)
    }

    fn loss(&self, x: Tensor<3>, batch: &Padded, device: &Device) -> Tensor<1> {
        Moe::loss(self, x, batch, &batch.mask(device))
    }
}

/// The padding token.
pub const PAD: i64 = 0;

/// The token stream's rule: the token after `t` (never the padding token).
pub fn next_token(t: usize, vocab: usize) -> usize {
    1 + (5 * t + 3) % (vocab - 1)
}

/// Sequences of token ids, `rows` of `cols` each, left-padded: row `r` starts with `pads[r]`
/// padding tokens.
#[derive(Debug, Clone)]
pub struct Padded {
    ids: Vec<i64>,
    pads: Vec<usize>,
    cols: usize,
}

impl Padded {
    /// Step `step`'s batch: `rows` sequences of `cols` tokens, each of its own length (at
    /// least half of `cols`) from its own start token.
    pub fn draw(step: u64, rows: usize, cols: usize, vocab: usize) -> Self {
        let mut ids = Vec::with_capacity(rows * cols);
        let mut pads = Vec::with_capacity(rows);
        for r in 0..rows as u64 {
            let mut z = (step << 20 ^ r).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            z ^= z >> 29;
            let pad = (z >> 8) as usize % (cols / 2);
            let mut t = 1 + (z % (vocab as u64 - 1)) as usize;
            ids.extend(std::iter::repeat_n(PAD, pad));
            for _ in pad..cols {
                ids.push(t as i64);
                t = next_token(t, vocab);
            }
            pads.push(pad);
        }
        Self { ids, pads, cols }
    }

    fn slice(&self, from: usize, to: usize, device: &Device) -> Tensor<2, Int> {
        let ids: Vec<i64> = self
            .ids
            .chunks(self.cols)
            .flat_map(|row| row[from..to].iter().copied())
            .collect();
        Tensor::from_data(TensorData::new(ids, [self.pads.len(), to - from]), device)
    }

    /// Every token but the last of each sequence.
    pub fn inputs(&self, device: &Device) -> Tensor<2, Int> {
        self.slice(0, self.cols - 1, device)
    }

    /// Every token but the first: what each input position predicts.
    pub fn targets(&self, device: &Device) -> Tensor<2, Int> {
        self.slice(1, self.cols, device)
    }

    /// The input positions that are real tokens (their targets are too).
    fn mask(&self, device: &Device) -> Mask {
        let t = self.cols - 1;
        let real: Vec<f32> = self
            .pads
            .iter()
            .flat_map(|&p| (0..t).map(move |i| if i >= p { 1.0 } else { 0.0 }))
            .collect();
        let count: Vec<f32> = self.pads.iter().map(|&p| (t - p) as f32).collect();
        let b = self.pads.len();
        Mask {
            real: Tensor::from_data(TensorData::new(real, [b, t]), device),
            count: Tensor::from_data(TensorData::new(count, [b, 1]), device),
        }
    }
}

impl Rows for Padded {
    fn rows(&self) -> usize {
        self.pads.len()
    }

    fn select(&self, rows: std::ops::Range<usize>) -> Self {
        Self {
            ids: self.ids[rows.start * self.cols..rows.end * self.cols].to_vec(),
            pads: self.pads[rows].to_vec(),
            cols: self.cols,
        }
    }
}

/// The example's model.
pub const SIZE: MoeConfig = MoeConfig {
    vocab: 33,
    d_model: 32,
    heads: 2,
    layers: 2,
    experts: 4,
    hidden: 64,
    max_seq: 32,
    balance: 0.01,
};

/// Sequences per step, over all ranks, and tokens per sequence.
pub const BATCH: (usize, usize) = (16, 17);

/// Trains the decoder with `preset` for `steps` steps; returns every step's loss.
pub fn train(comm: &Comm, preset: Preset, steps: u64) -> Result<Vec<(u64, f64)>, ShardError> {
    let mut model = Shard::blocks("blocks") // sharding
        .preset(preset)
        .seed(5)
        .build(comm, |d| SIZE.init(d), Device::flex())?;
    let adamw = AdamW::default();
    let mut losses = Vec::new();
    for step in model.step()..steps {
        let batch = Padded::draw(step, BATCH.0, BATCH.1, SIZE.vocab);
        let mut grads = model.backward(&[model.share(&batch)?])?; // sharding
        grads.clip_norm(1.0);
        let report = model.apply(grads, &adamw, 3e-3)?; // sharding
        losses.push((step, report.loss));
        if comm.rank() == 0 && (step % 20 == 0 || step + 1 == steps) {
            println!("step {step:>4} loss {:.4}", report.loss);
        }
    }
    Ok(losses)
}

#[allow(dead_code)] // `main` is unused when a test includes this file as a module.
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let steps = flag("--steps").and_then(|s| s.parse().ok()).unwrap_or(60);
    let result = flag("--shard")
        .unwrap_or_else(|| "zero3".into())
        .parse::<Preset>()
        .and_then(|preset| {
            let comm = Comm::from_env()?;
            train(&comm, preset, steps)
        });
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
