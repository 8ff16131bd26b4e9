//! The reference ZeRO++ quantized collectives, on host f32 buffers: the int8 blockwise
//! all-gather (qwZ) and the int4 / int8 gradient reduce-scatter as a hierarchical all-to-all
//! (qgZ), with optional error feedback, over any [`Path`]. The product runs these on device
//! tensors (ember-sharding's `route`); `comm/tests/mpi_quantized.rs` checks this reference
//! against a sequential simulation, and `sharding/tests/qgz_reference.rs` checks the product
//! against this reference bit for bit. The arithmetic runs on whichever [`QuantKernels`] the
//! caller passes; this file holds only the data movement.
//!
//! # Layouts
//!
//! Both use the padding rule of `padding` with the quantization block: a buffer of `n`
//! elements over the path's group `G` of `P` ranks is padded to `P * s` with
//! `s = ceil(n / (P * B)) * B`, so every shard and every all-to-all part is whole blocks. qgZ
//! returns the rank with `G` index `i` the mean of chunk `i`, exactly the layout of a flat mean
//! reduce-scatter on `G` with that padding; qwZ returns every member's dequantized shard in `G`
//! index order, exactly what [`all_gather_int8`] on `G` returns.
//!
//! # qgZ steps
//!
//! Chunks are put in hop order (the permutation of `path`); then for each hop `k`, innermost
//! first, over its group of size `D_k`: add this hop's residual (error feedback), quantize the
//! buffer, keep `buffer - dequantized` as the new residual, all-to-all the `D_k` parts,
//! dequantize and sum what arrives (in member order). The buffer shrinks by `D_k` each hop;
//! after the last, divide by `P`. Hops of size 1 are skipped (nothing to exchange, and
//! quantizing would only add error). Each hop's all-to-all is charged to the hop's scope on the
//! wire bytes it hands MPI (data plus scales).

#![allow(dead_code)]

use ember_comm::hier::all_gather_path;
use ember_comm::path::{Path, to_hop_order};
use ember_comm::quant::{BlockSize, QuantFormat, QuantKernels, Quantized};
use ember_comm::quantized::all_to_all_parts;
use ember_comm::{Comm, CommError, Group, ShardLayout};

/// Residuals kept by one rank between steps for error feedback, one buffer per hop of the path
/// they were first used with (for [`reduce_scatter_int4`], one per level).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Residuals {
    per_hop: Vec<Vec<f32>>,
    // The path boundaries and format these residuals belong to, fixed by the first use.
    owner: Option<(Vec<usize>, QuantFormat)>,
}

impl Residuals {
    /// The residual of hop `hop` (empty before the first step, and for size-1 hops).
    pub fn hop(&self, hop: usize) -> &[f32] {
        self.per_hop.get(hop).map_or(&[], |v| v.as_slice())
    }

    /// The residual of level `level` for the one-hop-per-level path of
    /// [`reduce_scatter_int4`] (the same as [`Residuals::hop`]).
    pub fn level(&self, level: usize) -> &[f32] {
        self.hop(level)
    }

    /// Binds fresh residuals to `path` and `format`, or refuses ones bound to others.
    fn bind(&mut self, path: &Path, format: QuantFormat) -> Result<(), CommError> {
        match &self.owner {
            None => {
                self.owner = Some((path.bounds().to_vec(), format));
                self.per_hop = vec![Vec::new(); path.hop_count()];
                Ok(())
            }
            Some((bounds, f)) if bounds == path.bounds() && *f == format => Ok(()),
            Some((bounds, f)) => Err(CommError::Shape(format!(
                "error-feedback residuals were made for path {bounds:?} in {f:?}, not path \
                 {path} in {format:?}: keep one Residuals per (gradient buffer, path, format)"
            ))),
        }
    }
}

/// Whether qgZ compensates this step with the error the last step's quantization made.
#[derive(Debug)]
pub enum ErrorFeedback<'a> {
    /// DeepSpeed's base qgZ: quantization errors are dropped.
    Off,
    /// LoCo-style compensation (arXiv 2407.04480, without its averaging): each hop adds the
    /// previous step's quantization error before quantizing and stores the new one.
    On(&'a mut Residuals),
}

/// qwZ: int8 blockwise all-gather of `shard` (a whole number of blocks) over `group`; returns
/// every member's dequantized shard in index order. Data and scales travel together in one
/// all-gather of bytes (one latency instead of two).
pub fn all_gather_int8(
    group: &Group,
    kernels: &dyn QuantKernels,
    shard: &[f32],
    block: BlockSize,
) -> Result<Vec<f32>, CommError> {
    let wire = quantize_to_wire(kernels, shard, block)?;
    let gathered = group.all_gather(&wire)?;
    Ok(dequantize_wires(
        kernels,
        &gathered,
        wire.len(),
        shard.len(),
        block,
    ))
}

/// qwZ over `path`'s group `G`, hop by hop (outermost first, as `hier::all_gather_path`): the
/// same result as [`all_gather_int8`] on `G`, bit for bit. Each rank quantizes its shard once;
/// the hops move the wire bytes.
pub fn all_gather_int8_path(
    comm: &Comm,
    kernels: &dyn QuantKernels,
    shard: &[f32],
    block: BlockSize,
    path: &Path,
) -> Result<Vec<f32>, CommError> {
    path.check(comm.topology())?;
    let wire = quantize_to_wire(kernels, shard, block)?;
    let gathered = all_gather_path(comm, &wire, path)?;
    Ok(dequantize_wires(
        kernels,
        &gathered,
        wire.len(),
        shard.len(),
        block,
    ))
}

/// qwZ over the world, one hop per level (outermost first): the same result as
/// [`all_gather_int8`] on the world group.
pub fn all_gather_int8_hier(
    comm: &Comm,
    kernels: &dyn QuantKernels,
    shard: &[f32],
    block: BlockSize,
) -> Result<Vec<f32>, CommError> {
    all_gather_int8_path(
        comm,
        kernels,
        shard,
        block,
        &Path::per_level(comm.topology()),
    )
}

fn check_whole_blocks(len: usize, block: BlockSize) -> Result<(), CommError> {
    if len.is_multiple_of(block.get()) {
        Ok(())
    } else {
        Err(CommError::Shape(format!(
            "qwZ shard of {len} elements is not a whole number of {}-element blocks: pad with \
             ShardLayout::new(len, group size, block)",
            block.get()
        )))
    }
}

/// This rank's shard quantized to int8 in wire form (data, then scales).
fn quantize_to_wire(
    kernels: &dyn QuantKernels,
    shard: &[f32],
    block: BlockSize,
) -> Result<Vec<u8>, CommError> {
    check_whole_blocks(shard.len(), block)?;
    let q = kernels.quantize(shard, QuantFormat::Int8, block);
    let mut wire = Vec::with_capacity(Quantized::wire_bytes(q.format, block, q.len));
    q.write_wire(&mut wire);
    Ok(wire)
}

/// Every rank's dequantized shard from the gathered wire forms, in rank order.
fn dequantize_wires(
    kernels: &dyn QuantKernels,
    gathered: &[u8],
    wire_len: usize,
    shard_len: usize,
    block: BlockSize,
) -> Vec<f32> {
    let ranks = gathered.len().checked_div(wire_len).unwrap_or(0);
    let mut out = Vec::with_capacity(shard_len * ranks);
    for w in gathered.chunks_exact(wire_len.max(1)).take(ranks) {
        let part = Quantized::read_wire(QuantFormat::Int8, block, shard_len, w);
        out.extend(kernels.dequantize(&part));
    }
    out
}

/// qgZ over the world, int4, one hop per level, averaged (see the module doc). Returns this
/// rank's chunk of `ShardLayout::new(grad.len(), W, block)`.
pub fn reduce_scatter_int4(
    comm: &Comm,
    kernels: &dyn QuantKernels,
    grad: &[f32],
    block: BlockSize,
    feedback: ErrorFeedback<'_>,
) -> Result<Vec<f32>, CommError> {
    let path = Path::per_level(comm.topology());
    reduce_scatter_quantized_path(
        comm,
        kernels,
        grad,
        QuantFormat::Int4,
        block,
        &path,
        feedback,
    )
}

/// qgZ in int4 over `path` (see [`reduce_scatter_quantized_path`]).
pub fn reduce_scatter_int4_path(
    comm: &Comm,
    kernels: &dyn QuantKernels,
    grad: &[f32],
    block: BlockSize,
    path: &Path,
    feedback: ErrorFeedback<'_>,
) -> Result<Vec<f32>, CommError> {
    reduce_scatter_quantized_path(
        comm,
        kernels,
        grad,
        QuantFormat::Int4,
        block,
        path,
        feedback,
    )
}

/// qgZ: quantized (int4 or int8) hierarchical all-to-all reduce-scatter over `path`'s group
/// `G` of `P` ranks, averaged over `P` (see the module doc). Returns this rank's chunk of
/// `ShardLayout::new(grad.len(), P, block)`: the layout of a flat mean reduce-scatter on `G`.
pub fn reduce_scatter_quantized_path(
    comm: &Comm,
    kernels: &dyn QuantKernels,
    grad: &[f32],
    format: QuantFormat,
    block: BlockSize,
    path: &Path,
    feedback: ErrorFeedback<'_>,
) -> Result<Vec<f32>, CommError> {
    let topology = comm.topology();
    path.check(topology)?;
    let p = topology.group_size(path.group(topology));
    let layout = ShardLayout::new(grad.len(), p, block.get());
    let mut residuals = match feedback {
        ErrorFeedback::Off => None,
        ErrorFeedback::On(r) => {
            r.bind(path, format)?;
            Some(r)
        }
    };
    if layout.padded() == 0 {
        return Ok(Vec::new());
    }
    let mut buf = to_hop_order(topology, path, grad, layout);
    for (hop, scope) in path.hops(topology).into_iter().enumerate() {
        let group = comm.try_group(scope)?;
        if group.size() == 1 {
            continue;
        }
        if let Some(r) = residuals.as_deref_mut() {
            add_residual(&mut r.per_hop[hop], &mut buf)?;
        }
        let q = kernels.quantize(&buf, format, block);
        if let Some(r) = residuals.as_deref_mut() {
            let back = kernels.dequantize(&q);
            for ((e, x), y) in r.per_hop[hop].iter_mut().zip(&buf).zip(&back) {
                *e = x - y;
            }
        }
        buf = exchange(&group, kernels, &q, block)?;
    }
    let p = p as f32;
    buf.iter_mut().for_each(|x| *x /= p);
    Ok(buf)
}

/// Adds last step's residual to `buf` (a zero residual the first time).
fn add_residual(res: &mut Vec<f32>, buf: &mut [f32]) -> Result<(), CommError> {
    if res.is_empty() {
        *res = vec![0.0; buf.len()];
    } else if res.len() != buf.len() {
        return Err(CommError::Shape(format!(
            "error-feedback residual of {} elements for a buffer of {}: use one Residuals per \
             gradient buffer (or a fresh one after resizing)",
            res.len(),
            buf.len()
        )));
    }
    buf.iter_mut().zip(res.iter()).for_each(|(x, e)| *x += e);
    Ok(())
}

/// One qgZ hop: all-to-all the group's parts of `q`, dequantize and sum what arrives.
fn exchange(
    group: &Group,
    kernels: &dyn QuantKernels,
    q: &Quantized,
    block: BlockSize,
) -> Result<Vec<f32>, CommError> {
    Ok(kernels.dequantize_sum(&all_to_all_parts(group, q, block)?))
}
