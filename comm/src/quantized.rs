//! ZeRO++ quantized collectives on host f32 buffers: the int8 blockwise all-gather (qwZ) and
//! the int4 gradient reduce-scatter as a hierarchical all-to-all (qgZ), with optional error
//! feedback. The arithmetic runs on whichever [`QuantKernels`] the caller passes; this file
//! deliberately holds only the data movement.
//!
//! # Layouts
//!
//! Both use the padding rule of `padding` with the quantization block: a buffer of `n`
//! elements over `W` ranks is padded to `W * s` with `s = ceil(n / (W * B)) * B`, so every
//! shard and every all-to-all part is whole blocks. qgZ returns rank `r` the mean of chunk `r`,
//! exactly the layout of a flat mean reduce-scatter with that padding.
//!
//! # qgZ steps
//!
//! Chunks are put in digit-reversed order (as in `hier`); then for each level `i`, innermost
//! first, over `Across(i)` of size `d`: add this level's residual (error feedback), quantize
//! the buffer to int4, keep `buffer - dequantized` as the new residual, all-to-all the `d`
//! parts, dequantize and sum what arrives (in member order). The buffer shrinks by `d` each
//! level; after the last, divide by `W`. Levels of size 1 are skipped (nothing to exchange,
//! and quantizing would only add error).

use crate::comm::{Comm, Group};
use crate::error::CommError;
use crate::hier::to_digit_reversed;
use crate::padding::ShardLayout;
use crate::quant::{BlockSize, QuantFormat, QuantKernels, Quantized};
use crate::topology::Scope;

/// Residuals kept by one rank between steps for error feedback, one buffer per level.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Residuals {
    per_level: Vec<Vec<f32>>,
}

impl Residuals {
    /// The residual of level `level` (empty before the first step).
    pub fn level(&self, level: usize) -> &[f32] {
        self.per_level.get(level).map_or(&[], |v| v.as_slice())
    }
}

/// Whether qgZ compensates this step with the error the last step's quantization made.
#[derive(Debug)]
pub enum ErrorFeedback<'a> {
    /// DeepSpeed's base qgZ: quantization errors are dropped.
    Off,
    /// LoCo-style compensation (arXiv 2407.04480, without its averaging): each level adds the
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

/// qwZ over the world composed level by level (outermost first, as `hier::all_gather`): the
/// same result as `all_gather_int8` on the world group, with the least data on the slowest
/// link.
pub fn all_gather_int8_hier(
    comm: &Comm,
    kernels: &dyn QuantKernels,
    shard: &[f32],
    block: BlockSize,
) -> Result<Vec<f32>, CommError> {
    let wire = quantize_to_wire(kernels, shard, block)?;
    let gathered = crate::hier::all_gather(comm, &wire)?;
    Ok(dequantize_wires(
        kernels,
        &gathered,
        wire.len(),
        shard.len(),
        block,
    ))
}

/// This rank's shard quantized to int8 in wire form (data, then scales).
fn quantize_to_wire(
    kernels: &dyn QuantKernels,
    shard: &[f32],
    block: BlockSize,
) -> Result<Vec<u8>, CommError> {
    if !shard.len().is_multiple_of(block.get()) {
        return Err(CommError::Shape(format!(
            "qwZ shard of {} elements is not a whole number of {}-element blocks: pad with \
             ShardLayout::new(len, group size, block)",
            shard.len(),
            block.get()
        )));
    }
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

/// qgZ: int4 hierarchical all-to-all reduce-scatter over the world, averaged (see the module
/// doc). Returns this rank's chunk of `ShardLayout::new(grad.len(), W, block)`.
pub fn reduce_scatter_int4(
    comm: &Comm,
    kernels: &dyn QuantKernels,
    grad: &[f32],
    block: BlockSize,
    feedback: ErrorFeedback<'_>,
) -> Result<Vec<f32>, CommError> {
    let topology = comm.topology();
    let world = topology.world_size();
    let layout = ShardLayout::new(grad.len(), world, block.get());
    let mut residuals = match feedback {
        ErrorFeedback::Off => None,
        ErrorFeedback::On(r) => {
            r.per_level.resize(topology.depth(), Vec::new());
            Some(r)
        }
    };
    if layout.padded() == 0 {
        return Ok(Vec::new());
    }
    let mut buf = to_digit_reversed(topology, grad, layout);
    for level in 0..topology.depth() {
        let group = comm.group(Scope::Across(level));
        let d = group.size();
        if d == 1 {
            continue;
        }
        if let Some(r) = residuals.as_deref_mut() {
            let res = &mut r.per_level[level];
            if res.is_empty() {
                *res = vec![0.0; buf.len()];
            } else if res.len() != buf.len() {
                return Err(CommError::Shape(format!(
                    "error-feedback residual of {} elements for a buffer of {}: use one \
                     Residuals per gradient buffer (or a fresh one after resizing)",
                    res.len(),
                    buf.len()
                )));
            }
            buf.iter_mut().zip(res.iter()).for_each(|(x, e)| *x += e);
        }
        let q = kernels.quantize(&buf, QuantFormat::Int4, block);
        if let Some(r) = residuals.as_deref_mut() {
            let back = kernels.dequantize(&q);
            for ((e, x), y) in r.per_level[level].iter_mut().zip(&buf).zip(&back) {
                *e = x - y;
            }
        }
        let part = buf.len() / d;
        let mut wire = Vec::with_capacity(d * Quantized::wire_bytes(q.format, block, part));
        for j in 0..d {
            q.part(j * part, part).write_wire(&mut wire);
        }
        let received = group.all_to_all(&wire)?;
        let parts: Vec<Quantized> = received
            .chunks_exact(wire.len() / d)
            .map(|w| Quantized::read_wire(QuantFormat::Int4, block, part, w))
            .collect();
        buf = kernels.dequantize_sum(&parts);
    }
    let w = world as f32;
    buf.iter_mut().for_each(|x| *x /= w);
    Ok(buf)
}
