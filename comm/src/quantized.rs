//! The wire exchange of the ZeRO++ quantized gradient reduce-scatter (qgZ): each hop's
//! all-to-all of blockwise-quantized parts. The quantization and the sums run where the data
//! lives (ember-sharding's `route`, on device tensors); the reference qgZ and qwZ on host
//! buffers, which the tests check the product against bit for bit, are in
//! `comm/tests/reference/qgz.rs`.

use crate::comm::Group;
use crate::error::CommError;
use crate::quant::{BlockSize, Quantized};

/// The all-to-all of a qgZ hop: part `j` of `q` (of the group's `size` equal parts) goes to
/// member `j`, and each member returns the parts it received, one per member in member
/// order, for its kernels to dequantize and sum (on the host or on a device).
pub fn all_to_all_parts(
    group: &Group,
    q: &Quantized,
    block: BlockSize,
) -> Result<Vec<Quantized>, CommError> {
    let d = group.size();
    let part = q.len / d;
    let mut wire = Vec::with_capacity(d * Quantized::wire_bytes(q.format, block, part));
    for j in 0..d {
        q.part(j * part, part).write_wire(&mut wire);
    }
    let received = group.all_to_all(&wire)?;
    Ok(received
        .chunks_exact(wire.len() / d)
        .map(|w| Quantized::read_wire(q.format, block, part, w))
        .collect())
}
