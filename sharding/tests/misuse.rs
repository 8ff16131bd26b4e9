//! A library user's mistakes come back as errors, not panics. One process, a world of one, as a
//! user's program runs without `mpirun`. Kept apart from `mlp_example.rs`, whose test starts
//! `mpirun`: the test harness runs a binary's tests on several threads, and an `mpirun`
//! started while another thread of the same process initialises MPI once exited at once,
//! printing nothing.

#[path = "../examples/mlp.rs"]
#[allow(dead_code)]
mod mlp;

use burn::tensor::{Device, Tensor};
use ember_comm::{Comm, CommConfig, Topology, TopologySource};
use ember_sharding::{Flow, FnSource, ShardConfig, ShardError, ShardedModel, Staged, UnitDecl};

/// The MLP's units with unit 1 cut off from its input (a `detach`, as a user might leave in).
struct DetachedInput;

impl Staged<2> for DetachedInput {
    type Module = mlp::Mlp;
    type Batch = mlp::Points;

    fn units(&self, module: &mlp::Mlp) -> Vec<UnitDecl> {
        mlp::MlpStages.units(module)
    }

    fn forward(
        &self,
        module: &mlp::Mlp,
        unit: usize,
        input: Option<Tensor<2>>,
        batch: &mlp::Points,
        device: &Device,
    ) -> Flow<2> {
        let input = if unit == 1 {
            input.map(Tensor::detach)
        } else {
            input
        };
        mlp::MlpStages.forward(module, unit, input, batch, device)
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
    let config = || ShardConfig::preset("zero3", comm.topology().depth()).unwrap();
    let mut source = FnSource::new(7, |name: &str, shape: &[usize], range| {
        Ok(mlp::init(7, name, shape, range))
    });
    // No micro-batch: a setting error naming the argument.
    let device = Device::flex();
    let mut model = ShardedModel::new(
        &comm,
        mlp::MlpStages,
        mlp::Mlp::new(8, &device),
        config(),
        device,
        &mut source,
    )
    .unwrap();
    match model.train_step(&[], &hyper) {
        Err(ShardError::Setting { field, .. }) => assert_eq!(field, "micro_batches"),
        other => panic!("train_step(&[]) gave {other:?}"),
    }
    let points = mlp::Points::draw(0, 0, 4);
    assert!(model.train_step(&[points], &hyper).is_ok());
    // A unit that does not use its input: a model error naming the unit.
    let device = Device::flex();
    let mut model = ShardedModel::new(
        &comm,
        DetachedInput,
        mlp::Mlp::new(8, &device),
        config(),
        device,
        &mut source,
    )
    .unwrap();
    match model.train_step(&[mlp::Points::draw(0, 0, 4)], &hyper) {
        Err(ShardError::Model(m)) => {
            assert!(m.contains("unit 1 of 3 does not use its input"), "{m}")
        }
        other => panic!("a unit ignoring its input gave {other:?}"),
    }
}
