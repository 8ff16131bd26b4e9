//! Sharding a model that is not a GPT: an MLP regressing `sin(3a) cos(2b)`, built from Burn's
//! own `Linear` layers with its hidden layers in a `Vec`, trained with ZeRO-3 (or any preset)
//! over MPI ranks.
//!
//! ```text
//! cargo build --release -p ember-sharding --example mlp
//! mpirun -np 4 --oversubscribe -x EMBER_TOPOLOGY=2x2x1 target/release/examples/mlp \
//!   --shard zero3 --steps 150 --save /tmp/mlp
//! mpirun -np 2 --oversubscribe -x EMBER_TOPOLOGY=1x2x1 target/release/examples/mlp \
//!   --shard hier3 --steps 300 --resume /tmp/mlp/step-000150
//! ```
//!
//! The second job continues the first's checkpoint at another world size and preset (each
//! rank reads only the ranges it owns there).
//!
//! The model is plain Burn. What sharding asks of it is the 15 lines marked `// sharding`: the
//! communicator from `mpirun`'s environment, the build (the three pieces its own `forward` is
//! made of, as closures; the checkpoint to resume, checked against the example's record), the
//! step, the save and the module gathered back. The batch is a pair of Burn tensors, which
//! split by rows among the ranks as they are. Burn's
//! `LinearConfig::init` makes lazy parameters: each rank materialises only the parameters
//! whose ranges it owns, one at a time.

use std::path::PathBuf;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor, TensorData};
use ember_comm::Comm;

use ember_sharding::{AdamW, DecayOn, SaveOptions, Shard, ShardError, StepHyper};

/// An ordinary Burn model.
#[derive(Module, Debug)]
pub struct Mlp {
    input: Linear,
    hidden: Vec<Linear>,
    output: Linear,
}

/// Its size (also the record its checkpoints keep: a resumed one must have the same).
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct MlpConfig {
    /// Width of the hidden layers.
    pub width: usize,
    /// Hidden layers after the input layer.
    pub depth: usize,
}

impl MlpConfig {
    /// Two inputs, `depth + 1` hidden layers of `width`, one output.
    pub fn init(&self, device: &Device) -> Mlp {
        Mlp {
            input: LinearConfig::new(2, self.width).init(device),
            hidden: (0..self.depth)
                .map(|_| LinearConfig::new(self.width, self.width).init(device))
                .collect(),
            output: LinearConfig::new(self.width, 1).init(device),
        }
    }
}

impl Mlp {
    /// The first layer.
    pub fn stem(&self, x: Tensor<2>) -> Tensor<2> {
        relu(self.input.forward(x))
    }

    /// Hidden layer `i`.
    pub fn layer(&self, i: usize, h: Tensor<2>) -> Tensor<2> {
        relu(self.hidden[i].forward(h))
    }

    /// The model's forward: one prediction per input row of `x` (`[n, 2]`).
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let mut h = self.stem(x);
        for i in 0..self.hidden.len() {
            h = self.layer(i, h);
        }
        self.output.forward(h)
    }

    /// The mean squared error of the last hidden layer's output `h` against `targets`.
    pub fn loss(&self, h: Tensor<2>, targets: &Tensor<2>) -> Tensor<1> {
        let err = self.output.forward(h) - targets.clone();
        (err.clone() * err).mean()
    }
}

/// A counter-based uniform draw in [-1, 1): value `k` of a stream is a pure function of `k`.
fn unit(k: u64) -> f32 {
    let mut z = k.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
}

/// A batch: inputs `(a, b)` (`[n, 2]`) and their targets (`[n, 1]`).
pub type Points = (Tensor<2>, Tensor<2>);

/// Points `first .. first + n` of step `step`'s deterministic stream, on `device`.
pub fn draw(step: u64, first: u64, n: usize, device: &Device) -> Points {
    let mut x = Vec::with_capacity(2 * n);
    let mut y = Vec::with_capacity(n);
    for i in 0..n as u64 {
        let k = (step << 32) ^ ((first + i) << 1);
        let (a, b) = (unit(k), unit(k | 1));
        x.extend([a, b]);
        y.push((3.0 * a).sin() * (2.0 * b).cos());
    }
    (
        Tensor::from_data(TensorData::new(x, [n, 2]), device),
        Tensor::from_data(TensorData::new(y, [n, 1]), device),
    )
}

/// The example's model size.
pub const SIZE: MlpConfig = MlpConfig {
    width: 64,
    depth: 2,
};

/// What one training run does: its steps, and where it resumes from and saves to.
#[derive(Debug, Clone, Default)]
pub struct Run {
    /// The sharding preset.
    pub preset: String,
    /// Steps to train to (from 0, or from the resumed checkpoint's step).
    pub steps: u64,
    /// Points per step, over all ranks.
    pub batch: usize,
    /// A checkpoint (of any world size and preset) to continue.
    pub resume: Option<PathBuf>,
    /// A directory to save a checkpoint of the last step into.
    pub save: Option<PathBuf>,
}

/// The example's step settings: AdamW without weight decay, gradients clipped to norm 1.
pub fn hyper() -> StepHyper {
    StepHyper {
        lr: 1e-2,
        grad_clip: 1.0,
        optimizer: AdamW {
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.0,
            decay_on: DecayOn::Matrices,
        },
    }
}

/// What a training run returns.
#[derive(Debug, Clone)]
pub struct Trained {
    /// Every step's loss from where the run started (the same on every rank).
    pub losses: Vec<(u64, f64)>,
    /// The trained module, gathered whole onto this rank.
    pub model: Mlp,
    /// The mean squared error of the sharded model on 256 held-out points, computed unit by
    /// unit as training runs (`eval_loss`, with the gathers of the preset).
    pub sharded_mse: f64,
}

/// The mean squared error of `model` on `points`, with the model's own forward.
pub fn mse(model: &Mlp, (x, y): &Points) -> f64 {
    let err = model.forward(x.clone()) - y.clone();
    (err.clone() * err)
        .mean()
        .into_data()
        .convert::<f64>()
        .try_to_vec::<f64>()
        .map_or(f64::NAN, |v| v[0])
}

/// 256 points no training step draws.
pub fn held_out(device: &Device) -> Points {
    draw(u64::from(u32::MAX), 0, 256, device)
}

/// Trains the MLP as `run` says.
pub fn train(comm: &Comm, run: &Run) -> Result<Trained, ShardError> {
    let device = Device::flex();
    // The three pieces `Mlp::forward` is made of.
    let embed = |m: &Mlp, (x, _): &Points, _: &Device| m.stem(x.clone()); // sharding
    let block = |m: &Mlp, i: usize, h, _: &Points| m.layer(i, h); // sharding
    let loss = |m: &Mlp, h, (_, y): &Points, _: &Device| m.loss(h, y); // sharding
    let mut sharded = Shard::blocks("hidden") // sharding
        .preset(run.preset.parse()?) // sharding
        .seed(7) // sharding
        .record(&SIZE) // sharding
        .resume_from(run.resume.as_deref()) // sharding
        .forward(embed, block, loss) // sharding
        .build(comm, |d| SIZE.init(d), device.clone())?; // sharding
    let hyper = hyper();
    let mut losses = Vec::new();
    // The model's step count is the number of steps taken, so a resumed run continues its data.
    for step in sharded.step()..run.steps {
        let batch = draw(step, 0, run.batch, &device);
        let mut grads = sharded.backward(&[sharded.share(&batch)?])?; // sharding
        grads.clip_norm(hyper.grad_clip);
        let report = sharded.apply(grads, &hyper.optimizer, hyper.lr)?; // sharding
        losses.push((step, report.loss));
        if comm.rank() == 0 && (step % 50 == 0 || step + 1 == run.steps) {
            println!(
                "step {step:>4} loss {:.5}  ({} bytes sent this step)",
                report.loss,
                report
                    .traffic
                    .entries()
                    .map(|(_, _, t)| t.sent)
                    .sum::<u64>()
            );
        }
    }
    if let Some(dir) = &run.save {
        let saved = sharded.save(dir, &SaveOptions::default())?; // sharding
        if comm.rank() == 0 {
            println!("saved {}", saved.display());
        }
    }
    let sharded_mse = sharded.eval_loss(&held_out(&device))?;
    // The trained module back, whole, for inference with its own forward.
    let model = sharded.gather()?; // sharding
    if comm.rank() == 0 {
        println!("held-out mse {:.5}", mse(&model, &held_out(&device)));
    }
    Ok(Trained {
        losses,
        model,
        sharded_mse,
    })
}

#[allow(dead_code)] // `main` is unused when the test includes this file as a module.
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let run = Run {
        preset: flag("--shard").unwrap_or_else(|| "zero3".into()),
        steps: flag("--steps").and_then(|s| s.parse().ok()).unwrap_or(300),
        batch: 64,
        resume: flag("--resume").map(PathBuf::from),
        save: flag("--save").map(PathBuf::from),
    };
    let result = Comm::from_env() // sharding
        .map_err(ShardError::from)
        .and_then(|comm| train(&comm, &run));
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
