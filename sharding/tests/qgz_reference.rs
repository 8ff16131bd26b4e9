//! The product's quantized gradient reduce-scatter (qgZ on device tensors, inside
//! `ShardedModel::backward`) against the reference qgZ on host buffers
//! (`comm/tests/reference/qgz.rs`), bit for bit, under a real `mpirun` job: int4 and int8, with
//! and without error feedback carried over steps, over hier3's and zeropp's hop paths.
//!
//! The probe model's gradients are known exactly without running it: every parameter `w` enters
//! the loss only as `sum(w * c)`, with coefficients `c` from the batch, so its gradient is `c`,
//! bit for bit. Each rank gives its own coefficients; the reference reduces the same
//! coefficients on the host.

mod common;
#[path = "../../comm/tests/reference/qgz.rs"]
mod qgz;

use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor};
use ember_comm::path::Path;
use ember_comm::quant::host::HostKernels;
use ember_comm::quant::{BlockSize, QuantFormat};
use ember_sharding::{BlockModel, BlockOutput, GradQuant, Preset, Sgd, Shard, ShardConfig};

const CHILD: &str = "EMBER_QGZ_CHILD";
const TEST: &str = "device_qgz_matches_the_reference_bit_for_bit";
/// Blocks of the probe (units: the root and one per block).
const BLOCKS: usize = 2;
const STEPS: usize = 3;

#[derive(Module, Debug)]
struct Probe {
    head: Param<Tensor<1>>,
    blocks: Vec<Cell>,
}

#[derive(Module, Debug)]
struct Cell {
    w: Param<Tensor<1>>,
}

fn probe(n: usize, device: &Device) -> Probe {
    let zeros = || Param::from_tensor(Tensor::zeros([n], device));
    Probe {
        head: zeros(),
        blocks: (0..BLOCKS).map(|_| Cell { w: zeros() }).collect(),
    }
}

/// The coefficients of every unit, one after another (the root's first).
#[derive(Debug, Clone)]
struct Coefficients(Vec<f32>);

/// The boundary carries the running loss in element 0 and the blocks' coefficients after it.
impl BlockModel<1> for Probe {
    type Batch = Coefficients;

    fn embed(&self, batch: &Coefficients, device: &Device) -> Tensor<1> {
        let n = self.head.dims()[0];
        let c = Tensor::<1>::from_floats(batch.0.as_slice(), device);
        let loss = (self.head.val() * c.clone().slice(0..n)).sum();
        Tensor::cat(vec![loss, c.slice(n..)], 0)
    }

    fn block(&self, i: usize, x: Tensor<1>, _: &Coefficients) -> BlockOutput<1> {
        let w = self.blocks[i].w.val();
        let n = w.dims()[0];
        let c = x.clone().slice(1 + i * n..1 + (i + 1) * n);
        let loss = x.clone().slice(0..1) + (w * c).sum();
        let rest = x.dims()[0];
        Tensor::cat(vec![loss, x.slice(1..rest)], 0).into()
    }

    fn loss(&self, x: Tensor<1>, _: &Coefficients, _: &Device) -> Tensor<1> {
        x.slice(0..1)
    }
}

/// Rank `rank`'s coefficients for unit `unit` at step `step`: values of varying magnitude per
/// block, so the blocks' scales differ.
fn coefficients(rank: usize, unit: usize, step: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let a = ((rank * 7 + unit * 31 + i * 13 + step * 3) % 101) as f32 / 101.0 - 0.5;
            a * (1.0 + (i / 16 % 5) as f32)
        })
        .collect()
}

/// One configuration: `steps` of backward, each unit's gradient shard compared with the
/// reference's; returns the elements compared and how many of them differ from the exact
/// mean (the quantization's footprint).
fn check(comm: &ember_comm::Comm, name: &str, config: ShardConfig) -> (usize, usize) {
    let topology = comm.topology().clone();
    let rank = comm.rank();
    let p = topology.world_size();
    let block = BlockSize::new(config.quant_block).unwrap();
    let n = 2 * p * block.get();
    let format = match config.quantize_grads() {
        GradQuant::Int4 => QuantFormat::Int4,
        GradQuant::Int8 => QuantFormat::Int8,
        GradQuant::Off => panic!("{name}: gradients are not quantized"),
    };
    let mut bounds = vec![0];
    bounds.extend(config.grad_hops().iter().map(|s| s.0));
    let path = Path::new(&topology, &bounds).unwrap();
    let feedback = config.error_feedback();
    let device = Device::flex();
    let mut model = Shard::blocks("blocks")
        .config(config)
        .build(comm, |d| probe(n, d), device.clone())
        .unwrap();
    let sgd = Sgd {
        momentum: 0.0,
        dampening: 0.0,
        nesterov: false,
        weight_decay: 0.0,
        decay_on: Default::default(),
    };
    let units = 1 + BLOCKS;
    let mut residuals = vec![qgz::Residuals::default(); units];
    let (mut compared, mut rounded) = (0, 0);
    for step in 0..STEPS {
        let mine: Vec<Vec<f32>> = (0..units).map(|u| coefficients(rank, u, step, n)).collect();
        let grads = model
            .backward(&[Coefficients(mine.concat())])
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        // The reference: the same gradients reduced on the host; this rank's chunk of each.
        let chunk = n / p;
        let reference: Vec<Vec<f32>> = (0..units)
            .map(|u| {
                let fb = if feedback {
                    qgz::ErrorFeedback::On(&mut residuals[u])
                } else {
                    qgz::ErrorFeedback::Off
                };
                qgz::reduce_scatter_quantized_path(
                    comm,
                    &HostKernels,
                    &mine[u],
                    format,
                    block,
                    &path,
                    fb,
                )
                .unwrap()
            })
            .collect();
        let exact = |u: usize, i: usize| -> f32 {
            (0..p).map(|r| coefficients(r, u, step, n)[i]).sum::<f32>() / p as f32
        };
        let mut seen = vec![0; units];
        for (param, offset, values) in grads.pieces() {
            let u = if param == "head" {
                0
            } else {
                1 + param
                    .strip_prefix("blocks.")
                    .and_then(|r| r.split('.').next())
                    .and_then(|i| i.parse::<usize>().ok())
                    .unwrap_or_else(|| panic!("{name}: unexpected parameter {param}"))
            };
            let got = values.into_data().try_to_vec::<f32>().unwrap();
            let at = offset - rank * chunk;
            let want = &reference[u][at..at + got.len()];
            for (k, (g, w)) in got.iter().zip(want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "{name}, rank {rank}, step {step}, {param}[{}]: device {g} vs reference {w}",
                    offset + k
                );
                rounded += usize::from(*g != exact(u, offset + k));
            }
            compared += got.len();
            seen[u] += got.len();
        }
        assert_eq!(
            seen,
            vec![chunk; units],
            "{name}, rank {rank}: the shards cover each unit's chunk"
        );
        model.apply(grads, &sgd, 0.1).unwrap();
    }
    (compared, rounded)
}

#[test]
fn device_qgz_matches_the_reference_bit_for_bit() {
    if let Some(child) = common::child(CHILD) {
        let comm = child.comm;
        let depth = comm.topology().depth();
        let mut int8_fed = Preset::Hier3.config(depth);
        int8_fed.set_quantize_grads(GradQuant::Int8).unwrap();
        int8_fed.set_error_feedback(true).unwrap();
        let mut zeropp_fed = Preset::Zeropp.config(depth);
        zeropp_fed.set_error_feedback(true).unwrap();
        for (name, config) in [
            ("hier3 int4", Preset::Hier3.config(depth)),
            ("hier3 int8 with error feedback", int8_fed),
            ("zeropp int4 with error feedback", zeropp_fed),
        ] {
            let (compared, rounded) = check(&comm, name, config);
            let all = comm
                .world()
                .all_reduce(&[compared as f32, rounded as f32], ember_comm::Reduce::Sum)
                .unwrap();
            if comm.rank() == 0 {
                println!("CHECKED {name}|{}|{}", all[0], all[1]);
            }
        }
        return;
    }
    let stdout = common::run_ranks(TEST, CHILD, "2x2x1|hier3|0||", 4);
    let checked: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("CHECKED "))
        .collect();
    assert_eq!(checked.len(), 3, "three configurations in\n{stdout}");
    for line in checked {
        let parts: Vec<&str> = line.split('|').collect();
        let (compared, rounded): (f64, f64) =
            (parts[1].parse().unwrap(), parts[2].parse().unwrap());
        eprintln!(
            "{}: {compared} elements equal, {rounded} of them off the exact mean",
            parts[0]
        );
        // Every rank compared its shard of every unit at every step, and the quantization
        // moved most of them off the exact mean (so the comparison is of quantized sums).
        assert!(compared > 0.0, "{line}");
        assert!(
            rounded > 0.5 * compared,
            "{line}: the gradients were not quantized"
        );
    }
}
