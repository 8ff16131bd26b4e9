//! Quantized collectives (qwZ, qgZ) under real `mpirun` at every topology: bit-exact against a
//! sequential simulation built from the scalar reference kernels, error within the summed
//! half-scales, error feedback exact and converging, and bytes equal to the formulas.

mod common;

use common::*;
use ember_comm::counters::formula;
use ember_comm::hier::digit_reversed_position;
use ember_comm::quant::host::HostKernels;
use ember_comm::quant::{BlockSize, QuantFormat, Quantized, reference};
use ember_comm::quantized::{
    ErrorFeedback, Residuals, all_gather_int8, all_gather_int8_hier, reduce_scatter_int4,
};
use ember_comm::{Op, Role, Scope, ShardLayout, Topology};

/// Rank `rank`'s gradient: smooth values of varying magnitude per block, so scales differ.
fn grad(rank: usize, n: usize, step: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let a = ((rank * 7 + i * 13 + step * 3) % 101) as f32 / 101.0 - 0.5;
            a * (1.0 + (i / 16 % 5) as f32)
        })
        .collect()
}

/// The whole qgZ algorithm for every rank at once, using only the reference kernels.
/// Returns each rank's output and, per element, the bound on its quantization error.
fn simulate_qgz(
    topo: &Topology,
    inputs: &[Vec<f32>],
    block: BlockSize,
    mut residuals: Option<&mut Vec<Vec<Vec<f32>>>>,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let w = topo.world_size();
    let layout = ShardLayout::new(inputs[0].len(), w, block.get());
    let s = layout.shard;
    let mut bufs: Vec<Vec<f32>> = inputs
        .iter()
        .map(|x| {
            let mut padded = x.clone();
            padded.resize(layout.padded(), 0.0);
            let mut out = vec![0.0; layout.padded()];
            for r in 0..w {
                let p = digit_reversed_position(topo, r);
                out[p * s..(p + 1) * s].copy_from_slice(&padded[r * s..(r + 1) * s]);
            }
            out
        })
        .collect();
    let mut bounds: Vec<Vec<f32>> = bufs.iter().map(|b| vec![0.0; b.len()]).collect();
    for (level, d) in topo.dims().into_iter().enumerate() {
        if d == 1 {
            continue;
        }
        let mut qs = Vec::new();
        for r in 0..w {
            if let Some(res) = residuals.as_deref_mut() {
                let e = &mut res[r][level];
                if e.is_empty() {
                    *e = vec![0.0; bufs[r].len()];
                }
                bufs[r].iter_mut().zip(e.iter()).for_each(|(x, e)| *x += e);
            }
            let q = reference::quantize(&bufs[r], QuantFormat::Int4, block);
            if let Some(res) = residuals.as_deref_mut() {
                let back = reference::dequantize(&q);
                for ((e, x), y) in res[r][level].iter_mut().zip(&bufs[r]).zip(&back) {
                    *e = x - y;
                }
            }
            // Quantizing adds at most scale/2 to each element this rank sends.
            for (i, b) in bounds[r].iter_mut().enumerate() {
                *b += q.scales[i / block.get()] / 2.0;
            }
            qs.push(q);
        }
        let part = bufs[0].len() / d;
        let mut next = Vec::new();
        let mut next_bounds = Vec::new();
        for r in 0..w {
            let me = topo.coords(r)[level];
            let members = topo.members(Scope::Across(level), r);
            let parts: Vec<Quantized> = members
                .iter()
                .map(|&m| qs[m].part(me * part, part))
                .collect();
            next.push(reference::dequantize_sum(&parts));
            next_bounds.push(
                (0..part)
                    .map(|i| members.iter().map(|&m| bounds[m][me * part + i]).sum())
                    .collect(),
            );
        }
        bufs = next;
        bounds = next_bounds;
    }
    for (b, e) in bufs.iter_mut().zip(bounds.iter_mut()) {
        b.iter_mut().for_each(|x| *x /= w as f32);
        e.iter_mut().for_each(|x| *x /= w as f32);
    }
    (bufs, bounds)
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
