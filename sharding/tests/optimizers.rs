//! Each shipped optimizer, driven through `backward` and `apply`, trains as Burn's own optimizer
//! of the same name does: one process (a world of one, as a user's program runs without
//! `mpirun`), the MLP example's model from the same initial weights, the same 20 batches.

#[path = "../examples/mlp.rs"]
#[allow(dead_code)]
mod mlp;

use burn::module::Module;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::Device;
use ember_comm::{Comm, CommConfig, Topology, TopologySource};
use ember_sharding::params::named_values;
use ember_sharding::{
    Adam, AdamW, Blocks, Checkpoint, DecayOn, Optimizer, Pieces, Preset, SaveOptions, Sgd, Shard,
    ShardError, ShardedModel,
};

const STEPS: u64 = 20;
const BATCH: usize = 32;

fn value(t: burn::tensor::Tensor<1>) -> f64 {
    t.into_data().convert::<f64>().try_to_vec::<f64>().unwrap()[0]
}

/// Losses of `STEPS` steps of Burn's `optim` on `start`, and the trained module.
fn with_burn(start: mlp::Mlp, mut optim: ModuleOptimizer, lr: f64) -> (Vec<f64>, mlp::Mlp) {
    let ad = Device::flex().autodiff();
    let mut model = start.fork(&ad).train().set_require_grad(true);
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = mlp::draw(step, 0, BATCH, &ad);
        let err = model.forward(x) - y;
        let loss = (err.clone() * err).mean();
        losses.push(value(loss.clone().inner()));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(lr, model, grads);
    }
    (losses, model.valid())
}

/// The three pieces of the MLP's forward, as the example gives them.
fn pieces() -> Pieces<mlp::Mlp, mlp::Points, 2> {
    Pieces::new(
        |m: &mlp::Mlp, (x, _): &mlp::Points, _| m.stem(x.clone()),
        |m, i, h, _| m.layer(i, h),
        |m, h, (_, y), _| m.loss(h, y),
    )
}

/// The MLP at one process, zero3, from Burn's initialisers with seed 3.
fn build(comm: &Comm) -> ShardedModel<'_, Blocks<mlp::Mlp, mlp::Points, 2>, 2> {
    let size = mlp::MlpConfig {
        width: 16,
        depth: 2,
    };
    Shard::blocks("hidden")
        .pieces(pieces())
        .seed(3)
        .build(comm, |d| size.init(d), Device::flex())
        .unwrap()
}

#[test]
fn each_optimizer_trains_as_burns_own() {
    let comm = Comm::init(CommConfig {
        topology: TopologySource::Explicit(Topology::parse("1x1x1").unwrap()),
        ..CommConfig::default()
    })
    .unwrap();
    // Weight decay on every parameter, as Burn's optimizers apply it. Burn holds betas as f32
    // and these optimizers as f64 (PyTorch's Python floats): at beta2 = 0.999 that alone moved
    // Adam's losses by 2.1e-6 over these steps, so the betas here are ones f32 holds to 3e-7.
    let cases: Vec<(&str, Box<dyn Optimizer>, ModuleOptimizer, f64)> = vec![
        (
            "AdamW",
            Box::new(AdamW {
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
                decay_on: DecayOn::All,
            }),
            AdamWConfig::new()
                .with_beta_1(0.9)
                .with_beta_2(0.95)
                .with_epsilon(1e-8)
                .with_weight_decay(0.1)
                .init(),
            1e-2,
        ),
        (
            "Adam",
            Box::new(Adam {
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.01,
                decay_on: DecayOn::All,
            }),
            AdamConfig::new()
                .with_beta_1(0.9)
                .with_beta_2(0.95)
                .with_epsilon(1e-8)
                .with_weight_decay(Some(WeightDecayConfig::new(0.01)))
                .init(),
            1e-2,
        ),
        (
            "SGD with momentum",
            Box::new(Sgd {
                momentum: 0.9,
                dampening: 0.1,
                nesterov: true,
                weight_decay: 0.01,
                decay_on: DecayOn::All,
            }),
            SgdConfig::new()
                .with_momentum(Some(MomentumConfig {
                    momentum: 0.9,
                    dampening: 0.1,
                    nesterov: true,
                }))
                .with_weight_decay(Some(WeightDecayConfig::new(0.01)))
                .init(),
            5e-2,
        ),
    ];
    for (name, ours, theirs, lr) in cases {
        let mut sharded = build(&comm);
        // The initial weights, whole: where Burn's run starts.
        let start = sharded.gather().unwrap();
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let grads = sharded
                .backward(&[mlp::draw(step, 0, BATCH, &Device::flex())])
                .unwrap();
            losses.push(grads.loss());
            sharded.apply(grads, ours.as_ref(), lr).unwrap();
        }
        let (burn_losses, burn_model) = with_burn(start, theirs, lr);
        assert!(
            losses[STEPS as usize - 1] < 0.8 * losses[0],
            "{name}: loss {losses:?} did not fall"
        );
        let mut worst_loss = 0.0f64;
        for (a, b) in losses.iter().zip(&burn_losses) {
            worst_loss = worst_loss.max((a - b).abs() / b.abs());
        }
        // Parameters: each element against Burn's, relative to the model's largest weight
        // (a single bias near zero differs from Burn's by 1e-8 in absolute terms, which is
        // 1.7e-6 of its own size under Adam).
        let values = |m: &mlp::Mlp| -> Vec<(String, Vec<f32>)> {
            named_values(m)
                .into_iter()
                .map(|(n, _, t)| (n, t.to_data().try_to_vec::<f32>().unwrap()))
                .collect()
        };
        let (a, b) = (values(&sharded.gather().unwrap()), values(&burn_model));
        let scale = b
            .iter()
            .flat_map(|(_, v)| v)
            .fold(0.0f32, |s, x| s.max(x.abs())) as f64;
        let mut worst_param = 0.0f64;
        for ((n, x), (m, y)) in a.iter().zip(&b) {
            assert_eq!((n, x.len()), (m, y.len()));
            for (x, y) in x.iter().zip(y) {
                worst_param = worst_param.max((x - y).abs() as f64 / scale);
            }
        }
        eprintln!(
            "{name}: largest relative difference from Burn over {STEPS} steps: loss {worst_loss:e}, parameters {worst_param:e}"
        );
        assert!(
            worst_loss <= 1e-6,
            "{name}: losses {losses:?} vs Burn's {burn_losses:?}"
        );
        assert!(
            worst_param <= 1e-6,
            "{name}: parameters differ from Burn's by {worst_param:e}"
        );
    }

    // A checkpoint keeps the optimizer's own state: SGD's velocity resumes bit for bit, and
    // another optimizer is refused, naming the state the model holds.
    let sgd = Sgd {
        momentum: 0.9,
        dampening: 0.0,
        nesterov: false,
        weight_decay: 0.0,
        decay_on: DecayOn::Matrices,
    };
    let step = |m: &mut ShardedModel<'_, Blocks<mlp::Mlp, mlp::Points, 2>, 2>, i: u64| {
        let g = m
            .backward(&[mlp::draw(i, 0, BATCH, &Device::flex())])
            .unwrap();
        let loss = g.loss();
        m.apply(g, &sgd, 5e-2).unwrap();
        loss
    };
    let mut whole = build(&comm);
    let through: Vec<f64> = (0..10).map(|i| step(&mut whole, i)).collect();
    let tmp = tempfile::tempdir().unwrap();
    let mut first = build(&comm);
    (0..5).for_each(|i| {
        step(&mut first, i);
    });
    let saved = first.save(tmp.path(), &SaveOptions::default()).unwrap();
    let open = || Checkpoint::open(&comm, &saved).unwrap();
    let resume = || {
        let size = mlp::MlpConfig {
            width: 16,
            depth: 2,
        };
        let checkpoint = open();
        Shard::blocks("hidden")
            .pieces(pieces())
            .preset(Preset::Zero2)
            .resume(&checkpoint)
            .build(&comm, |d| size.init(d), Device::flex())
            .unwrap()
    };
    let mut resumed = resume();
    assert_eq!(resumed.state_names(), ["momentum_buffer"]);
    let after: Vec<f64> = (5..10).map(|i| step(&mut resumed, i)).collect();
    assert_eq!(after, through[5..], "SGD resumed from its checkpoint");
    let mut wrong = resume();
    let g = wrong
        .backward(&[mlp::draw(5, 0, BATCH, &Device::flex())])
        .unwrap();
    match wrong.apply(
        g,
        &AdamW {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
            decay_on: DecayOn::Matrices,
        },
        1e-3,
    ) {
        Err(ShardError::Setting { field, reason, .. }) => {
            assert_eq!(field, "optimizer");
            assert!(reason.contains("momentum_buffer"), "{reason}");
        }
        other => panic!("AdamW on SGD's state gave {other:?}"),
    }
}
