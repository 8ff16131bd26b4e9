//! The reference quantized collectives (qwZ, qgZ; `reference/qgz.rs`, which the product's
//! device path is checked against in ember-sharding) under real `mpirun` at every topology,
//! over the library's wire exchange: bit-exact against a
//! sequential simulation built from the scalar reference kernels, error within the summed
//! half-scales, error feedback exact and converging, and bytes equal to the formulas; over the
//! world per level and over every path of every prefix group.

mod common;
#[path = "reference/qgz.rs"]
mod qgz;

use common::*;
use ember_comm::counters::{Counters, formula};
use ember_comm::path::all_paths;
use ember_comm::quant::host::HostKernels;
use ember_comm::quant::{BlockSize, QuantFormat, Quantized, reference};
use ember_comm::{Comm, Op, Path, Role, Scope, ShardLayout, Topology};
use qgz::{
    ErrorFeedback, Residuals, all_gather_int8, all_gather_int8_hier, all_gather_int8_path,
    reduce_scatter_int4, reduce_scatter_quantized_path,
};

/// Rank `rank`'s gradient: smooth values of varying magnitude per block, so scales differ.
fn grad(rank: usize, n: usize, step: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let a = ((rank * 7 + i * 13 + step * 3) % 101) as f32 / 101.0 - 0.5;
            a * (1.0 + (i / 16 % 5) as f32)
        })
        .collect()
}

/// Position of chunk `i` (an index in the group of levels `0..hi`) in hop order, computed from
/// coordinates (independently of the library): each hop's member index is the mixed-radix
/// number of its coordinates, and hop 1's is the most significant digit.
fn hop_position(topo: &Topology, bounds: &[usize], i: usize) -> usize {
    let dims = topo.dims();
    let hi = bounds[bounds.len() - 1];
    let mut rest = i;
    let coords: Vec<usize> = dims[..hi]
        .iter()
        .map(|d| {
            let c = rest % d;
            rest /= d;
            c
        })
        .collect();
    bounds.windows(2).fold(0, |acc, w| {
        let size: usize = dims[w[0]..w[1]].iter().product();
        let index = (w[0]..w[1]).rev().fold(0, |m, l| m * dims[l] + coords[l]);
        acc * size + index
    })
}

/// qgZ over the path `bounds` for every rank of the world at once (each in its own group
/// `Span{0, hi}`), using only the reference kernels. Returns each rank's output and, per
/// element, the bound on its quantization error. `residuals[rank][hop]` for error feedback.
fn simulate_path(
    topo: &Topology,
    bounds: &[usize],
    inputs: &[Vec<f32>],
    block: BlockSize,
    format: QuantFormat,
    mut residuals: Option<&mut Vec<Vec<Vec<f32>>>>,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let w = topo.world_size();
    let dims = topo.dims();
    let hi = bounds[bounds.len() - 1];
    let p: usize = dims[..hi].iter().product();
    let layout = ShardLayout::new(inputs[0].len(), p, block.get());
    let s = layout.shard;
    let mut bufs: Vec<Vec<f32>> = inputs
        .iter()
        .map(|x| {
            let mut padded = x.clone();
            padded.resize(layout.padded(), 0.0);
            let mut out = vec![0.0; layout.padded()];
            for i in 0..p {
                let q = hop_position(topo, bounds, i);
                out[q * s..(q + 1) * s].copy_from_slice(&padded[i * s..(i + 1) * s]);
            }
            out
        })
        .collect();
    let mut err: Vec<Vec<f32>> = bufs.iter().map(|b| vec![0.0; b.len()]).collect();
    for (hop, win) in bounds.windows(2).enumerate() {
        let (lo, hi) = (win[0], win[1]);
        let d: usize = dims[lo..hi].iter().product();
        if d == 1 {
            continue;
        }
        let mut qs = Vec::new();
        for r in 0..w {
            if let Some(res) = residuals.as_deref_mut() {
                let e = &mut res[r][hop];
                if e.is_empty() {
                    *e = vec![0.0; bufs[r].len()];
                }
                bufs[r].iter_mut().zip(e.iter()).for_each(|(x, e)| *x += e);
            }
            let q = reference::quantize(&bufs[r], format, block);
            if let Some(res) = residuals.as_deref_mut() {
                let back = reference::dequantize(&q);
                for ((e, x), y) in res[r][hop].iter_mut().zip(&bufs[r]).zip(&back) {
                    *e = x - y;
                }
            }
            // Quantizing adds at most scale/2 to each element this rank sends.
            for (i, b) in err[r].iter_mut().enumerate() {
                *b += q.scales[i / block.get()] / 2.0;
            }
            qs.push(q);
        }
        let part = bufs[0].len() / d;
        let mut next = Vec::new();
        let mut next_err = Vec::new();
        for r in 0..w {
            let c = topo.coords(r);
            let me = (lo..hi).rev().fold(0, |m, l| m * dims[l] + c[l]);
            let members = topo.members(Scope::Span { lo, hi }, r);
            let parts: Vec<Quantized> = members
                .iter()
                .map(|&m| qs[m].part(me * part, part))
                .collect();
            next.push(reference::dequantize_sum(&parts));
            next_err.push(
                (0..part)
                    .map(|i| members.iter().map(|&m| err[m][me * part + i]).sum())
                    .collect(),
            );
        }
        bufs = next;
        err = next_err;
    }
    for (b, e) in bufs.iter_mut().zip(err.iter_mut()) {
        b.iter_mut().for_each(|x| *x /= p as f32);
        e.iter_mut().for_each(|x| *x /= p as f32);
    }
    (bufs, err)
}

/// The whole world qgZ (int4, one hop per level) for every rank at once.
fn simulate_qgz(
    topo: &Topology,
    inputs: &[Vec<f32>],
    block: BlockSize,
    residuals: Option<&mut Vec<Vec<Vec<f32>>>>,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let bounds: Vec<usize> = (0..=topo.depth()).collect();
    simulate_path(topo, &bounds, inputs, block, QuantFormat::Int4, residuals)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn quantized_collectives_match_simulation_at_every_topology() {
    if !is_child() {
        for t in TOPOLOGIES {
            mpirun_ok(
                "quantized_collectives_match_simulation_at_every_topology",
                t,
            );
        }
        return;
    }
    let comm = child_comm();
    let topo = comm.topology().clone();
    let rank = comm.rank();
    let w = topo.world_size();
    let block = BlockSize::new(16).unwrap();

    // qwZ over every scope: exact against reference quantize + dequantize of each member.
    for scope in topo.scopes() {
        let group = comm.group(scope);
        let members = topo.members(scope, rank);
        let shard = grad(rank, 48, 0);
        comm.take_counters();
        let got = all_gather_int8(&group, &HostKernels, &shard, block).unwrap();
        let counters = comm.take_counters();
        let mut want = Vec::new();
        for &m in &members {
            let x = grad(m, 48, 0);
            let q = reference::quantize(&x, QuantFormat::Int8, block);
            for (i, (a, b)) in x.iter().zip(reference::dequantize(&q)).enumerate() {
                assert!((a - b).abs() <= q.scales[i / 16] / 2.0 * (1.0 + 1e-6));
            }
            want.extend(reference::dequantize(&q));
        }
        assert_eq!(bits(&got), bits(&want), "qwZ on {scope:?}");
        let wire = Quantized::wire_bytes(QuantFormat::Int8, block, 48) * members.len();
        assert_eq!(
            counters.get(scope, Op::AllGather),
            formula(Op::AllGather, wire as u64, members.len(), Role::Member)
        );
        assert!(all_gather_int8(&group, &HostKernels, &shard[..40], block).is_err());
    }

    // Hierarchical qwZ equals flat qwZ over the world, bit for bit, and each level moves the
    // wire bytes gathered so far (outermost level first).
    let shard = grad(rank, 32, 2);
    let flat = all_gather_int8(&comm.world(), &HostKernels, &shard, block).unwrap();
    comm.take_counters();
    let hier = all_gather_int8_hier(&comm, &HostKernels, &shard, block).unwrap();
    let counters = comm.take_counters();
    assert_eq!(bits(&hier), bits(&flat), "hierarchical qwZ at {topo}");
    let mut wire = Quantized::wire_bytes(QuantFormat::Int8, block, 32);
    for (level, d) in topo.dims().into_iter().enumerate().rev() {
        let want = if d == 1 {
            Default::default()
        } else {
            formula(Op::AllGather, (wire * d) as u64, d, Role::Member)
        };
        assert_eq!(counters.get(Scope::Across(level), Op::AllGather), want);
        wire *= d;
    }

    // qgZ over the world, lengths that do and don't divide by W * block.
    for n in [16 * w, 16 * w * 3 + 5, 7] {
        let inputs: Vec<Vec<f32>> = (0..w).map(|r| grad(r, n, 0)).collect();
        comm.take_counters();
        let got = reduce_scatter_int4(
            &comm,
            &HostKernels,
            &inputs[rank],
            block,
            ErrorFeedback::Off,
        )
        .unwrap();
        let counters = comm.take_counters();
        let (sim, bound) = simulate_qgz(&topo, &inputs, block, None);
        assert_eq!(bits(&got), bits(&sim[rank]), "qgZ n={n} at {topo}");
        // Against the exact mean: within the summed half-scales (plus f32 summation slack).
        let layout = ShardLayout::new(n, w, 16);
        for (j, i) in layout.range(rank).enumerate() {
            let exact: f32 = inputs
                .iter()
                .map(|x| x.get(i).copied().unwrap_or(0.0))
                .sum::<f32>()
                / w as f32;
            assert!(
                (got[j] - exact).abs() <= bound[rank][j] * 1.001 + 1e-6,
                "element {i}: {} vs {exact}, bound {}",
                got[j],
                bound[rank][j]
            );
        }
        // Bytes: one all-to-all of int4 data plus scales per level, on a shrinking buffer.
        let mut len = layout.padded();
        for (level, d) in topo.dims().into_iter().enumerate() {
            let want = if d == 1 {
                Default::default()
            } else {
                let wire = Quantized::wire_bytes(QuantFormat::Int4, block, len / d) * d;
                formula(Op::AllToAll, wire as u64, d, Role::Member)
            };
            assert_eq!(counters.get(Scope::Across(level), Op::AllToAll), want);
            len /= d;
        }
    }

    // Error feedback: bit-exact with the simulation over steps, and the running average of a
    // constant gradient converges to the exact mean (no-feedback error stays put).
    let n = 16 * w * 2;
    let inputs: Vec<Vec<f32>> = (0..w).map(|r| grad(r, n, 1)).collect();
    let mut res = Residuals::default();
    let mut sim_res: Vec<Vec<Vec<f32>>> = vec![vec![Vec::new(); topo.depth()]; w];
    let steps = 16;
    let mut avg = vec![0.0f32; n / w];
    for _ in 0..steps {
        let got = reduce_scatter_int4(
            &comm,
            &HostKernels,
            &inputs[rank],
            block,
            ErrorFeedback::On(&mut res),
        )
        .unwrap();
        let (sim, _) = simulate_qgz(&topo, &inputs, block, Some(&mut sim_res));
        assert_eq!(bits(&got), bits(&sim[rank]), "qgZ with error feedback");
        avg.iter_mut()
            .zip(&got)
            .for_each(|(a, g)| *a += g / steps as f32);
    }
    let plain = reduce_scatter_int4(
        &comm,
        &HostKernels,
        &inputs[rank],
        block,
        ErrorFeedback::Off,
    )
    .unwrap();
    let layout = ShardLayout::new(n, w, 16);
    let exact: Vec<f32> = layout
        .range(rank)
        .map(|i| inputs.iter().map(|x| x[i]).sum::<f32>() / w as f32)
        .collect();
    let err = |v: &[f32]| {
        v.iter()
            .zip(&exact)
            .map(|(a, b)| (a - b).abs())
            .sum::<f32>()
    };
    if topo.dims().iter().any(|&d| d > 1) {
        assert!(
            err(&avg) < 0.25 * err(&plain),
            "error feedback: averaged error {} vs plain {}",
            err(&avg),
            err(&plain)
        );
    }
    comm.barrier();
}

/// Asserts that `counters` hold exactly `op` on each hop of `path` with the given wire bytes
/// (`(scope, payload bytes, group size)`), nothing else.
fn assert_hops(counters: &Counters, op: Op, want: &[(Scope, usize, usize)], what: &str) {
    for &(scope, bytes, d) in want {
        assert_eq!(
            counters.get(scope, op),
            formula(op, bytes as u64, d, Role::Member),
            "{what}: {op:?} on {scope:?}"
        );
    }
    assert_eq!(
        counters.entries().count(),
        want.len(),
        "{what}: only the hops"
    );
}

fn check_quantized_path(comm: &Comm, path: &Path, block: BlockSize) {
    let topo = comm.topology().clone();
    let rank = comm.rank();
    let w = topo.world_size();
    let b = block.get();
    let g = comm.group(path.group(&topo));
    let p = g.size();
    let members = topo.members(path.group(&topo), rank);
    let hops: Vec<(Scope, usize)> = path
        .hops(&topo)
        .into_iter()
        .map(|h| (h, topo.group_size(h)))
        .collect();

    // qwZ: path == flat on G bit for bit; bytes per hop.
    let shard = grad(rank, 32, 3);
    let flat = all_gather_int8(&g, &HostKernels, &shard, block).unwrap();
    comm.take_counters();
    let got = all_gather_int8_path(comm, &HostKernels, &shard, block, path).unwrap();
    let counters = comm.take_counters();
    assert_eq!(bits(&got), bits(&flat), "qwZ over {path} at {topo}");
    let mut wire = Quantized::wire_bytes(QuantFormat::Int8, block, 32);
    let mut want = Vec::new();
    for &(hop, d) in hops.iter().rev().filter(|(_, d)| *d > 1) {
        wire *= d;
        want.push((hop, wire, d));
    }
    assert_hops(&counters, Op::AllGather, &want, &format!("qwZ {path}"));
    assert!(all_gather_int8_path(comm, &HostKernels, &shard[..b / 2], block, path).is_err());

    // qgZ in both formats: == the simulation bit for bit, within the error bound of the exact
    // mean over G, bytes per hop.
    for format in [QuantFormat::Int4, QuantFormat::Int8] {
        for n in [b * p, b * p * 3 + 5, 7] {
            let what = format!("qgZ {format:?} n={n} over {path} at {topo}");
            let inputs: Vec<Vec<f32>> = (0..w).map(|r| grad(r, n, 4)).collect();
            comm.take_counters();
            let got = reduce_scatter_quantized_path(
                comm,
                &HostKernels,
                &inputs[rank],
                format,
                block,
                path,
                ErrorFeedback::Off,
            )
            .unwrap();
            let counters = comm.take_counters();
            let (sim, bound) = simulate_path(&topo, path.bounds(), &inputs, block, format, None);
            assert_eq!(bits(&got), bits(&sim[rank]), "{what}");
            let layout = ShardLayout::new(n, p, b);
            assert_eq!(got.len(), layout.shard);
            for (j, i) in layout.range(g.index()).enumerate() {
                let exact = members
                    .iter()
                    .map(|&m| inputs[m].get(i).copied().unwrap_or(0.0))
                    .sum::<f32>()
                    / p as f32;
                assert!(
                    (got[j] - exact).abs() <= bound[rank][j] * 1.001 + 1e-6,
                    "{what}: element {i}: {} vs {exact}, bound {}",
                    got[j],
                    bound[rank][j]
                );
            }
            let mut len = layout.padded();
            let mut want = Vec::new();
            for &(hop, d) in &hops {
                if d > 1 {
                    want.push((hop, Quantized::wire_bytes(format, block, len / d) * d, d));
                }
                len /= d;
            }
            assert_hops(&counters, Op::AllToAll, &want, &what);
        }

        // Error feedback over a few steps: the collective and the simulation agree bit for
        // bit, residuals included.
        let n = b * p * 2;
        let inputs: Vec<Vec<f32>> = (0..w).map(|r| grad(r, n, 5)).collect();
        let mut res = Residuals::default();
        let mut sim_res: Vec<Vec<Vec<f32>>> = vec![vec![Vec::new(); path.hop_count()]; w];
        for step in 0..3 {
            let got = reduce_scatter_quantized_path(
                comm,
                &HostKernels,
                &inputs[rank],
                format,
                block,
                path,
                ErrorFeedback::On(&mut res),
            )
            .unwrap();
            let (sim, _) = simulate_path(
                &topo,
                path.bounds(),
                &inputs,
                block,
                format,
                Some(&mut sim_res),
            );
            assert_eq!(
                bits(&got),
                bits(&sim[rank]),
                "feedback step {step} over {path}"
            );
            for (hop, e) in sim_res[rank].iter().enumerate() {
                assert_eq!(bits(res.hop(hop)), bits(e), "residual of hop {hop}");
            }
        }
        // Residuals are bound to their path and format.
        let other = if format == QuantFormat::Int4 {
            QuantFormat::Int8
        } else {
            QuantFormat::Int4
        };
        let err = reduce_scatter_quantized_path(
            comm,
            &HostKernels,
            &inputs[rank],
            other,
            block,
            path,
            ErrorFeedback::On(&mut res),
        )
        .unwrap_err();
        assert!(err.to_string().contains("one Residuals per"), "{err}");
    }
    comm.take_counters();
}

#[test]
fn quantized_path_collectives_match_simulation_at_every_topology() {
    if !is_child() {
        for t in TOPOLOGIES {
            mpirun_ok(
                "quantized_path_collectives_match_simulation_at_every_topology",
                t,
            );
        }
        return;
    }
    let comm = child_comm();
    let topo = comm.topology().clone();
    let block = BlockSize::new(16).unwrap();
    for hi in 1..=topo.depth() {
        for path in all_paths(&topo, hi) {
            check_quantized_path(&comm, &path, block);
        }
    }
    // The per-level world path is what the world-only functions run.
    let per_level = Path::per_level(&topo);
    let g = grad(comm.rank(), 16 * topo.world_size() + 3, 6);
    let a = reduce_scatter_int4(&comm, &HostKernels, &g, block, ErrorFeedback::Off).unwrap();
    let b = reduce_scatter_quantized_path(
        &comm,
        &HostKernels,
        &g,
        QuantFormat::Int4,
        block,
        &per_level,
        ErrorFeedback::Off,
    )
    .unwrap();
    assert_eq!(bits(&a), bits(&b));
    comm.barrier();
}
