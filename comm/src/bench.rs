//! The communication benchmark as a library function: per op, scope and size, the bandwidth
//! through ember and through the raw MPI call on the same buffers, plus quantize / dequantize
//! throughput beside a plain memcpy. It deliberately parses no arguments and prints nothing:
//! the `ember bench comm` subcommand owns the CLI and output.
//!
//! # What the numbers mean
//!
//! `bytes` is the op's payload per rank as in `counters` (all-gather: the gathered output;
//! reduce-scatter, all-to-all: the input; all-reduce, broadcast: the buffer). GB/s is
//! `bytes / time / 1e9` with `time` the median over iterations of the slowest rank's time
//! (the "algorithm bandwidth" of nccl-tests). Ember and raw MPI iterations alternate on the
//! same buffers, so drift in the machine hits both equally.

use mpi::collective::{CommunicatorCollectives, Root, SystemOperation};
use mpi::topology::Communicator;
use serde::{Deserialize, Serialize};

use crate::collective::Reduce;
use crate::comm::Comm;
use crate::counters::Op;
use crate::quant::host::HostKernels;
use crate::quant::{BlockSize, QuantFormat};
use crate::topology::Scope;

/// One measurement (one JSON line with `--json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchRecord {
    /// `all_gather`, `reduce_scatter`, `all_reduce`, `broadcast`, `all_to_all`, or for local
    /// kernels `quantize_int8`, `dequantize_int8`, `quantize_int4`, `dequantize_sum_int4`.
    pub op: String,
    /// Scope name (`world`, `within-gpu`, `across-node`, ...) or `local` for kernels.
    pub level: String,
    /// Payload bytes per rank (see the module doc); f32 input bytes for kernels.
    pub bytes: u64,
    /// Ranks in the group (1 for kernels).
    pub ranks: usize,
    /// Bandwidth through ember, GB/s.
    pub ember_gbps: f64,
    /// Bandwidth of the baseline: the raw MPI call, or memcpy of the same bytes for kernels.
    pub mpi_gbps: f64,
    /// `ember_gbps / mpi_gbps`.
    pub ratio: f64,
    /// What `mpi_gbps` measured: `mpi` or `memcpy`.
    pub baseline: String,
    /// Timed iterations per side.
    pub iters: usize,
}

/// What to measure.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchConfig {
    /// Payload sizes in bytes; rounded down to a whole number of f32 per group member.
    pub sizes: Vec<u64>,
    /// Collectives to time.
    pub ops: Vec<Op>,
    /// Scopes to time them on; groups of one rank are skipped.
    pub scopes: Vec<Scope>,
    /// Aim for about this many bytes moved per side and size (bounds the iteration count).
    pub bytes_per_size: u64,
    /// Also time the quantization kernels on the host (rank 0's numbers are reported).
    pub kernels: KernelBench,
}

/// Whether to time the quantization kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum KernelBench {
    /// Collectives only.
    Skip,
    /// Host kernels beside memcpy.
    Host,
}

impl BenchConfig {
    /// The full sweep: 4 KiB to 256 MiB by factors of 4, every op, the world and each
    /// level's `Across` group, with the kernels.
    pub fn full(comm: &Comm) -> Self {
        let mut scopes = vec![Scope::World];
        scopes.extend((0..comm.topology().depth()).map(Scope::Across));
        Self {
            sizes: (0..9).map(|i| 4096u64 << (2 * i)).collect(),
            ops: vec![
                Op::AllGather,
                Op::ReduceScatter,
                Op::AllReduce,
                Op::Broadcast,
                Op::AllToAll,
            ],
            scopes,
            // 1 GiB per side keeps a size under a few seconds on one node.
            bytes_per_size: 1 << 30,
            kernels: KernelBench::Host,
        }
    }
}

/// Runs the benchmark on every rank (collective: all ranks must call it with the same
/// config); every rank returns the same records.
pub fn run_comm_bench(comm: &Comm, config: &BenchConfig) -> Vec<BenchRecord> {
    let mut out = Vec::new();
    for &scope in &config.scopes {
        let group = comm.group(scope);
        if group.size() == 1 {
            continue;
        }
        for &op in &config.ops {
            for &size in &config.sizes {
                out.push(bench_op(comm, scope, op, size, config.bytes_per_size));
            }
        }
    }
    if config.kernels == KernelBench::Host {
        for &size in &config.sizes {
            out.extend(bench_kernels(size, config.bytes_per_size));
        }
    }
    out
}

fn iterations(size: u64, budget: u64) -> usize {
    (budget / size.max(1)).clamp(3, 50) as usize
}

/// Median of the slowest rank's time per iteration for each of two alternating closures.
fn time_pair(comm: &Comm, iters: usize, mut a: impl FnMut(), mut b: impl FnMut()) -> (f64, f64) {
    let world = comm.raw(Scope::World);
    let mut ta = Vec::with_capacity(iters);
    let mut tb = Vec::with_capacity(iters);
    a();
    b();
    for _ in 0..iters {
        for (f, times) in [(&mut a as &mut dyn FnMut(), &mut ta), (&mut b, &mut tb)] {
            world.barrier();
            let t0 = mpi::time();
            f();
            let mine = mpi::time() - t0;
            let mut slowest = 0.0f64;
            world.all_reduce_into(&mine, &mut slowest, SystemOperation::max());
            times.push(slowest);
        }
    }
    (median(&mut ta), median(&mut tb))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn bench_op(comm: &Comm, scope: Scope, op: Op, size: u64, budget: u64) -> BenchRecord {
    let group = comm.group(scope);
    let raw = comm.raw(scope);
    let g = group.size();
    let elems = ((size as usize / 4) / g).max(1) * g;
    let bytes = (elems * 4) as u64;
    let iters = iterations(bytes, budget);
    let full: Vec<f32> = (0..elems).map(|i| (i % 7) as f32).collect();
    let shard: Vec<f32> = full[..elems / g].to_vec();
    let out_full = || std::cell::RefCell::new(vec![0.0f32; elems]);
    let (t_ember, t_mpi) = match op {
        Op::AllGather => {
            let out = out_full();
            time_pair(
                comm,
                iters,
                || {
                    group
                        .all_gather_into(&shard, &mut out.borrow_mut())
                        .unwrap()
                },
                || raw.all_gather_into(&shard[..], &mut out.borrow_mut()[..]),
            )
        }
        Op::ReduceScatter => {
            let out = std::cell::RefCell::new(vec![0.0f32; elems / g]);
            time_pair(
                comm,
                iters,
                || {
                    group
                        .reduce_scatter_into(&full, &mut out.borrow_mut(), Reduce::Sum)
                        .unwrap()
                },
                || {
                    raw.reduce_scatter_block_into(
                        &full[..],
                        &mut out.borrow_mut()[..],
                        SystemOperation::sum(),
                    )
                },
            )
        }
        Op::AllReduce => {
            let out = out_full();
            time_pair(
                comm,
                iters,
                || {
                    group
                        .all_reduce_into(&full, &mut out.borrow_mut(), Reduce::Sum)
                        .unwrap()
                },
                || {
                    raw.all_reduce_into(
                        &full[..],
                        &mut out.borrow_mut()[..],
                        SystemOperation::sum(),
                    )
                },
            )
        }
        Op::Broadcast => {
            let buf = std::cell::RefCell::new(full.clone());
            time_pair(
                comm,
                iters,
                || group.broadcast(&mut buf.borrow_mut(), 0).unwrap(),
                || {
                    raw.process_at_rank(0)
                        .broadcast_into(&mut buf.borrow_mut()[..])
                },
            )
        }
        Op::AllToAll => {
            let out = out_full();
            time_pair(
                comm,
                iters,
                || group.all_to_all_into(&full, &mut out.borrow_mut()).unwrap(),
                || raw.all_to_all_into(&full[..], &mut out.borrow_mut()[..]),
            )
        }
    };
    comm.take_counters();
    record(
        op.name(),
        comm.topology().scope_name(scope),
        bytes,
        g,
        t_ember,
        t_mpi,
        "mpi",
        iters,
    )
}

#[allow(clippy::too_many_arguments)]
fn record(
    op: &str,
    level: String,
    bytes: u64,
    ranks: usize,
    t_ember: f64,
    t_base: f64,
    baseline: &str,
    iters: usize,
) -> BenchRecord {
    let gbps = |t: f64| bytes as f64 / t / 1e9;
    BenchRecord {
        op: op.to_string(),
        level,
        bytes,
        ranks,
        ember_gbps: gbps(t_ember),
        mpi_gbps: gbps(t_base),
        ratio: t_base / t_ember,
        baseline: baseline.to_string(),
        iters,
    }
}

/// Median wall time of `f` over `iters` runs, after one warm-up.
fn time_local(iters: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..iters)
        .map(|_| {
            let t0 = std::time::Instant::now();
            f();
            t0.elapsed().as_secs_f64()
        })
        .collect();
    median(&mut t)
}

/// Host kernel throughput on `size` bytes of f32 input beside memcpy of the same bytes.
fn bench_kernels(size: u64, budget: u64) -> Vec<BenchRecord> {
    let n = (size as usize / 4).max(8);
    let bytes = (n * 4) as u64;
    let iters = iterations(bytes, budget);
    let block = BlockSize::DEFAULT;
    let x: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5)
        .collect();
    let mut copy = vec![0.0f32; n];
    let t_copy = time_local(iters, || {
        copy.copy_from_slice(&x);
        std::hint::black_box(&mut copy);
    });
    let mut out = Vec::new();
    for format in [QuantFormat::Int8, QuantFormat::Int4] {
        let mut data = vec![0u8; format.data_bytes(n)];
        let mut scales = vec![0.0f32; n.div_ceil(block.get())];
        let t_q = time_local(iters, || {
            HostKernels.quantize_into(&x, format, block, &mut data, &mut scales);
            std::hint::black_box(&mut data);
        });
        let q = crate::quant::QuantKernels::quantize(&HostKernels, &x, format, block);
        let mut acc = vec![0.0f32; n];
        let t_d = time_local(iters, || {
            HostKernels.dequantize_add(&q, &mut acc);
            std::hint::black_box(&mut acc);
        });
        let name = match format {
            QuantFormat::Int8 => "int8",
            QuantFormat::Int4 => "int4",
        };
        out.push(record(
            &format!("quantize_{name}"),
            "local".into(),
            bytes,
            1,
            t_q,
            t_copy,
            "memcpy",
            iters,
        ));
        out.push(record(
            &format!("dequantize_add_{name}"),
            "local".into(),
            bytes,
            1,
            t_d,
            t_copy,
            "memcpy",
            iters,
        ));
    }
    out
}
