//! Sharding a model that is not a GPT: a three-layer MLP regressing `sin(3a) cos(2b)`, built
//! with Burn's own `Linear` layers, trained with ZeRO-3 (or any preset) over MPI ranks.
//!
//! ```text
//! cargo build --release -p ember-sharding --example mlp
//! mpirun -np 4 --oversubscribe target/release/examples/mlp --shard zero3 --topology 2x2x1 \
//!   --steps 150 --save /tmp/mlp
//! mpirun -np 2 --oversubscribe target/release/examples/mlp --shard hier3 --topology 1x2x1 \
//!   --steps 300 --resume /tmp/mlp
//! ```
//!
//! The second job continues the first's checkpoint at another world size and preset (each
//! rank reads only the ranges it owns there).
//!
//! The model's code knows nothing of sharding: the user writes only `MlpStages` (which
//! layers form a unit and how a unit runs) and an initialiser that can draw any range of any
//! parameter alone (`init`), and hands the model's skeleton to `ShardedModel`. Burn's
//! `LinearConfig::init` makes lazy parameters, so the skeleton allocates nothing: each rank
//! draws only the elements it owns.

use std::path::PathBuf;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor, TensorData};
use ember_comm::{Comm, CommConfig, Topology, TopologySource};

use ember_sharding::{
    AdamW, Checkpoint, DecayOn, Flow, FnSource, SaveOptions, ShardConfig, ShardError, ShardedModel,
    Staged, StepHyper, UnitDecl,
};

/// An ordinary Burn model.
#[derive(Module, Debug)]
pub struct Mlp {
    l1: Linear,
    l2: Linear,
    l3: Linear,
}

impl Mlp {
    /// Two inputs, two hidden layers of `width`, one output.
    pub fn new(width: usize, device: &Device) -> Self {
        Self {
            l1: LinearConfig::new(2, width).init(device),
            l2: LinearConfig::new(width, width).init(device),
            l3: LinearConfig::new(width, 1).init(device),
        }
    }
}

impl Mlp {
    /// The model's forward: one prediction per input row of `x` (`[n, 2]`).
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = relu(self.l1.forward(x));
        let h = relu(self.l2.forward(h));
        self.l3.forward(h)
    }
}

/// A counter-based uniform draw in [-1, 1): value `k` of a stream is a pure function of `k`.
fn unit(k: u64) -> f32 {
    let mut z = k.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
}

/// The initial value of elements `range` of parameter `name` (shape `shape`, `[in, out]` for
/// weights): weights uniform in `±1/sqrt(in)` (PyTorch's `nn.Linear` bound), biases zero;
/// each element keyed by (seed, name, index), so a rank draws its range alone.
pub fn init(seed: u64, name: &str, shape: &[usize], range: std::ops::Range<usize>) -> Vec<f32> {
    if shape.len() < 2 {
        return vec![0.0; range.len()];
    }
    let key = name.bytes().fold(seed ^ 0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    let bound = 1.0 / (shape[0] as f32).sqrt();
    range
        .map(|i| bound * unit(key ^ (i as u64).wrapping_mul(0xA24B_AED4_963E_E407)))
        .collect()
}

/// One micro-batch: `n` inputs `(a, b)` and their targets.
#[derive(Debug, Clone)]
pub struct Points {
    x: Vec<f32>,
    y: Vec<f32>,
    n: usize,
}

impl Points {
    /// The inputs as a `[n, 2]` tensor.
    pub fn inputs(&self, device: &Device) -> Tensor<2> {
        Tensor::from_data(TensorData::new(self.x.clone(), [self.n, 2]), device)
    }

    /// The targets as a `[n, 1]` tensor.
    pub fn targets(&self, device: &Device) -> Tensor<2> {
        Tensor::from_data(TensorData::new(self.y.clone(), [self.n, 1]), device)
    }

    /// Points `index * n ..` of a deterministic stream, so every rank draws its own share of a
    /// step's global batch.
    pub fn draw(step: u64, first: u64, n: usize) -> Self {
        let mut x = Vec::with_capacity(2 * n);
        let mut y = Vec::with_capacity(n);
        for i in 0..n as u64 {
            let k = (step << 32) ^ ((first + i) << 1);
            let (a, b) = (unit(k), unit(k | 1));
            x.extend([a, b]);
            y.push((3.0 * a).sin() * (2.0 * b).cos());
        }
        Self { x, y, n }
    }
}

/// How the MLP runs unit by unit: each layer is a unit.
#[derive(Debug, Clone, Copy)]
pub struct MlpStages;

impl Staged<2> for MlpStages {
    type Module = Mlp;
    type Batch = Points;

    fn units(&self, _module: &Mlp) -> Vec<UnitDecl> {
        vec![
            UnitDecl::new("l1", &["l1"]),
            UnitDecl::new("l2", &["l2"]),
            UnitDecl::new("l3", &["l3"]),
        ]
    }

    fn forward(
        &self,
        m: &Mlp,
        unit: usize,
        input: Option<Tensor<2>>,
        batch: &Points,
        device: &Device,
    ) -> Flow<2> {
        match (unit, input) {
            (0, _) => Flow::Hidden(relu(m.l1.forward(batch.inputs(device)))),
            (1, Some(h)) => Flow::Hidden(relu(m.l2.forward(h))),
            (_, Some(h)) => {
                let err = m.l3.forward(h) - batch.targets(device);
                Flow::Loss((err.clone() * err).mean())
            }
            (u, None) => panic!("unit {u} needs its input"),
        }
    }
}

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

/// The record this example keeps in its checkpoints' manifests.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Record {
    seed: u64,
}

/// The example's step settings: AdamW without weight decay, gradients clipped to norm 1.
pub fn hyper() -> StepHyper {
    StepHyper {
        lr: 1e-2,
        grad_clip: 1.0,
        adam: AdamW {
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
pub fn mse(model: &Mlp, points: &Points, device: &Device) -> f64 {
    let err = model.forward(points.inputs(device)) - points.targets(device);
    (err.clone() * err)
        .mean()
        .into_data()
        .convert::<f64>()
        .try_to_vec::<f64>()
        .map_or(f64::NAN, |v| v[0])
}

/// 256 points no training step draws.
pub fn held_out() -> Points {
    Points::draw(u64::from(u32::MAX), 0, 256)
}

/// Trains the MLP as `run` says.
pub fn train(comm: &Comm, run: &Run) -> Result<Trained, ShardError> {
    let device = Device::flex();
    // A skeleton: Burn's Linear parameters are lazy, and nothing here reads them.
    let model = Mlp::new(64, &device);
    let config = ShardConfig::preset(&run.preset, comm.topology().depth())?;
    let seed = 7;
    let mut sharded = match &run.resume {
        Some(dir) => {
            let checkpoint = Checkpoint::open(comm, dir)?;
            let record: Record = checkpoint.manifest().app_record()?;
            if record.seed != seed {
                return Err(ShardError::setting(
                    "seed",
                    seed,
                    format!("{} was trained with seed {}", dir.display(), record.seed),
                ));
            }
            ShardedModel::resume(comm, MlpStages, model, config, device, &checkpoint)?
        }
        None => {
            let mut source = FnSource::new(seed, |name: &str, shape: &[usize], range| {
                Ok(init(seed, name, shape, range))
            });
            ShardedModel::new(comm, MlpStages, model, config, device, &mut source)?
        }
    };
    let world = comm.topology().world_size();
    if !run.batch.is_multiple_of(world) {
        return Err(ShardError::setting(
            "batch",
            run.batch,
            format!("does not split over {world} ranks"),
        ));
    }
    let share = run.batch / world;
    let hyper = hyper();
    let mut losses = Vec::new();
    // Adam's step count is the number of steps taken, so a resumed run continues its data.
    for step in sharded.adam_step()..run.steps {
        let points = Points::draw(step, (comm.rank() * share) as u64, share);
        let report = sharded.train_step(&[points], &hyper)?;
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
        let options = SaveOptions {
            app: match serde_json::to_value(Record { seed }) {
                Ok(serde_json::Value::Object(map)) => map,
                _ => unreachable!("a struct serialises to an object"),
            },
            ..SaveOptions::default()
        };
        let saved = ember_sharding::checkpoint::save(&sharded, dir, run.steps, &options)?;
        if comm.rank() == 0 {
            println!("saved {}", saved.display());
        }
    }
    let sharded_mse = sharded.eval_loss(&held_out())?;
    // The trained module back, whole, for inference with its own forward.
    let model = sharded.gather()?;
    if comm.rank() == 0 {
        println!(
            "held-out mse {:.5}",
            mse(&model, &held_out(), sharded.device())
        );
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
        steps: flag("--steps").and_then(|s| s.parse().ok()).unwrap_or(300),
        batch: 64,
        resume: flag("--resume").map(PathBuf::from),
        save: flag("--save").map(PathBuf::from),
    };
    let result = Comm::init(CommConfig {
        topology,
        ..CommConfig::default()
    })
    .map_err(ShardError::from)
    .and_then(|comm| train(&comm, &run));
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
