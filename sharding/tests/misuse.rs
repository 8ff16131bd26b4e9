//! A library user's mistakes come back as errors, not panics. One process, a world of one, as a
//! user's program runs without `mpirun`. Kept apart from `mlp_example.rs`, whose test starts
//! `mpirun`: the test harness runs a binary's tests on several threads, and an `mpirun`
//! started while another thread of the same process initialises MPI once exited at once,
//! printing nothing.

#[path = "../examples/mlp.rs"]
#[allow(dead_code)]
mod mlp;

use burn::tensor::{Device, Distribution, Tensor};
use ember_comm::{Comm, CommConfig, Topology, TopologySource};
use std::sync::atomic::Ordering;

use ember_sharding::{
    Blocks, Pieces, Preset, Recompute, Rows, SaveOptions, Shard, ShardError, ShardedModel,
};

/// The three pieces of the MLP's forward, as the example gives them.
fn pieces() -> Pieces<mlp::Mlp, mlp::Points, 2> {
    pieces_with(|m, i, h| m.layer(i, h))
}

/// The MLP's pieces with hidden layer `i` run by `block(model, i, h)`.
fn pieces_with(
    block: impl Fn(&mlp::Mlp, usize, Tensor<2>) -> Tensor<2> + Send + Sync + 'static,
) -> Pieces<mlp::Mlp, mlp::Points, 2> {
    Pieces::new(
        |m: &mlp::Mlp, (x, _): &mlp::Points, _| m.stem(x.clone()),
        move |m, i, h, _| block(m, i, h),
        |m, h, (_, y), _| m.loss(h, y),
    )
}

fn setting_field<T: std::fmt::Debug>(result: Result<T, ShardError>) -> &'static str {
    match result {
        Err(ShardError::Setting { field, .. }) => field,
        other => panic!("expected a setting error, got {other:?}"),
    }
}

#[test]
fn library_misuse_returns_errors_instead_of_panicking() {
    let comm = Comm::init(CommConfig {
        topology: TopologySource::Explicit(Topology::parse("1x1x1").unwrap()),
        ..CommConfig::default()
    })
    .unwrap();
    let hyper = mlp::hyper();
    let size = mlp::MlpConfig { width: 8, depth: 1 };
    let init = |d: &Device| size.init(d);
    let build = || {
        Shard::blocks("hidden")
            .pieces(pieces())
            .build(&comm, init, Device::flex())
    };
    // A field that holds no blocks, or a preset that does not exist: setting errors.
    let wrong = Shard::blocks("layers")
        .pieces(pieces())
        .build(&comm, init, Device::flex());
    assert_eq!(setting_field(wrong), "blocks");
    assert_eq!(setting_field("zero4".parse::<Preset>()), "preset");
    // No micro-batch, or a batch with no rows: setting errors naming the argument.
    let mut model = build().unwrap();
    assert_eq!(
        setting_field(model.train_step(&[], &hyper)),
        "micro_batches"
    );
    assert_eq!(
        setting_field(model.share(&mlp::draw(0, 0, 0, &Device::flex()))),
        "batch"
    );
    assert_eq!(setting_field(model.gather_to(1)), "root");
    assert!(model.gather_to(0).unwrap().is_some());
    let points = mlp::draw(0, 0, 4, &Device::flex());
    assert_eq!(model.share(&points).unwrap().rows(), 4);
    assert!(model.train_step(&[points], &hyper).is_ok());
    // The application's record: kept in a save without options of its own, checked on resume;
    // a resume under another record is a setting error naming the field that differs.
    let tmp = tempfile::tempdir().unwrap();
    let with_record = |width: usize, resume: Option<&std::path::Path>| {
        Shard::blocks("hidden")
            .pieces(pieces())
            .record(&mlp::MlpConfig { width, depth: 1 })
            .resume_from(resume)
            .build(&comm, init, Device::flex())
    };
    let saved = with_record(8, None)
        .unwrap()
        .save(tmp.path(), &SaveOptions::default())
        .unwrap();
    assert!(with_record(8, Some(&saved)).is_ok());
    match with_record(16, Some(&saved)).err() {
        Some(ShardError::Setting {
            field: "record",
            value,
            reason,
            ..
        }) => {
            assert_eq!(value, "width = 16");
            assert!(reason.contains("was saved with width = 8"), "{reason}");
        }
        other => panic!("a resume under another record gave {other:?}"),
    }
    // A `Staged` description takes the builder's options too: the MLP's units through
    // `Shard::staged` train as through `Shard::blocks`, keep the record and resume.
    let stages = Blocks::of(&size.init(&Device::flex()), "hidden", pieces()).unwrap();
    let staged = |resume: Option<&std::path::Path>, width: usize| {
        Shard::staged(stages.clone())
            .seed(3)
            .record(&mlp::MlpConfig { width, depth: 1 })
            .resume_from(resume)
            .build(&comm, init, Device::flex())
    };
    let blocks = Shard::blocks("hidden").pieces(pieces()).seed(3);
    let mut blocks = blocks.build(&comm, init, Device::flex()).unwrap();
    let mut by_staged = staged(None, 8).unwrap();
    for step in 0..3 {
        let batch = || mlp::draw(step, 0, 16, &Device::flex());
        let a = blocks.train_step(&[batch()], &hyper).unwrap().loss;
        let b = by_staged.train_step(&[batch()], &hyper).unwrap().loss;
        assert_eq!(a, b, "step {step}: Shard::staged against Shard::blocks");
    }
    let saved = by_staged.save(tmp.path(), &SaveOptions::default()).unwrap();
    assert_eq!(staged(Some(&saved), 8).unwrap().step(), 3);
    assert_eq!(setting_field(staged(Some(&saved), 16)), "record");
    // One process sends nothing: hier3 and zeropp neither quantize its weights nor keep a
    // secondary copy, and train exactly as zero3 (their gradients' hops move nothing either).
    let losses = |preset: Preset| -> Vec<f64> {
        let mut model = Shard::blocks("hidden")
            .pieces(pieces())
            .preset(preset)
            .build(&comm, init, Device::flex())
            .unwrap();
        (0..5)
            .map(|step| {
                let batch = mlp::draw(step, 0, 16, &Device::flex());
                model.train_step(&[batch], &hyper).unwrap().loss
            })
            .collect()
    };
    let zero3 = losses(Preset::Zero3);
    assert_eq!(losses(Preset::Hier3), zero3, "hier3 at one process");
    assert_eq!(losses(Preset::Zeropp), zero3, "zeropp at one process");
    // A unit that does not use its input (unit `hidden.0`, whose layer's input is cut off by
    // a `detach`, as a user might leave in): a model error naming the unit.
    let mut model = Shard::blocks("hidden")
        .seed(7)
        .pieces(pieces_with(|m, i, h| m.layer(i, h.detach())))
        .build(&comm, init, Device::flex())
        .unwrap();
    match model.train_step(&[mlp::draw(0, 0, 4, &Device::flex())], &hyper) {
        Err(ShardError::Model(m)) => {
            assert!(m.contains("unit `hidden.0` does not use its input"), "{m}")
        }
        other => panic!("a unit ignoring its input gave {other:?}"),
    }
    let deep = mlp::MlpConfig { width: 8, depth: 2 };
    let deep_init = |d: &Device| deep.init(d);
    let points = || mlp::draw(0, 0, 64, &Device::flex());
    // Dropout from the device's generator inside a unit that backward recomputes: the
    // partitioner seeds the generator alike before the forward and its recompute, so the
    // recompute draws the same mask and the unit trains, as it does keeping its graph.
    let dropout = |recompute: Recompute| {
        let mut config = Preset::Zero3.config(comm.topology().depth());
        config.recompute = recompute;
        Shard::blocks("hidden")
            .config(config)
            .seed(7)
            .pieces(pieces_with(|m, i, h| {
                let h = m.layer(i, h);
                if i > 0 {
                    return h;
                }
                let keep =
                    Tensor::<2>::random(h.shape(), Distribution::Bernoulli(0.9), &h.device());
                h * keep / 0.9
            }))
            .build(&comm, deep_init, Device::flex())
            .unwrap()
    };
    let trained = |mut model: ShardedModel<'_, Blocks<mlp::Mlp, mlp::Points, 2>, 2>| -> Vec<f64> {
        (0..3)
            .map(|_| model.train_step(&[points()], &hyper).unwrap().loss)
            .collect()
    };
    assert_eq!(
        trained(dropout(Recompute::Unit)),
        trained(dropout(Recompute::None)),
        "recomputed and kept graphs draw the same masks"
    );
    // Any other impurity is refused, by the unit's name, once it exceeds rounding: a unit
    // whose every second run adds `shift` times its output's largest magnitude to it passes
    // at half the f32 threshold and is refused at twice it.
    let tolerance = ember_sharding::rounding_tolerance(burn::tensor::DType::F32);
    let shifted = |shift: f64| {
        let runs = std::sync::atomic::AtomicUsize::new(0);
        Shard::blocks("hidden")
            .seed(7)
            .pieces(pieces_with(move |m, i, h| {
                let h = m.layer(i, h);
                let run = runs.fetch_add(usize::from(i == 0), Ordering::Relaxed);
                if i > 0 || run.is_multiple_of(2) {
                    return h;
                }
                let largest = h.clone().abs().max().into_scalar::<f32>() as f64;
                h + largest * shift
            }))
            .build(&comm, deep_init, Device::flex())
            .unwrap()
            .train_step(&[points()], &hyper)
    };
    assert!(shifted(0.5 * tolerance).is_ok(), "within rounding");
    match shifted(2.0 * tolerance) {
        Err(ShardError::Model(m)) => {
            assert!(m.contains("unit `hidden.0` gave other values"), "{m}");
            assert!(m.contains("beyond rounding"), "{m}");
        }
        other => panic!("a unit beyond rounding gave {other:?}"),
    }
    // A block that reads a parameter of a unit it does not declare (the output layer, in the
    // root, read from the first block): a model error naming the unit, the parameter and
    // `using`, not a panic inside Burn.
    let mut reads_root = Shard::blocks("hidden")
        .seed(7)
        .pieces(pieces_with(|m, i, h| {
            let h = m.layer(i, h);
            if i > 0 {
                return h;
            }
            let zero = Tensor::<2>::zeros([h.dims()[0], 1], &h.device());
            h + m
                .loss(m.stem(Tensor::zeros([1, 2], &zero.device())), &zero)
                .reshape([1, 1])
                * 0.0
        }))
        .build(&comm, deep_init, Device::flex())
        .unwrap();
    match reads_root.train_step(&[points()], &hyper) {
        Err(ShardError::Model(m)) => {
            assert!(
                m.contains("unit `hidden.0` read parameter `input.weight`"),
                "{m}"
            );
            assert!(m.contains("unit `root` (unit 0)"), "{m}");
            assert!(m.contains(".using(&[0])"), "{m}");
        }
        other => panic!("a block reading the root gave {other:?}"),
    }
}
