//! Hierarchical all-gather and reduce-scatter over the world, composed level by level from the
//! `Across(i)` groups, producing exactly the layout of the flat world collectives. It
//! deliberately adds no algorithm of its own beyond one chunk permutation.
//!
//! # Why a permutation, and which
//!
//! Flat reduce-scatter over `W` ranks gives rank `r` chunk `r` of the (padded) buffer. Doing it
//! innermost level first (largest volume on the fastest link), the first step over
//! `Across(0)` hands the rank with coordinate `c_0` part `c_0` of the buffer; for the final
//! result to be chunk `r = c_0 + d_0 (c_1 + d_1 (...))`, part `c_0` must hold every chunk with
//! that `c_0`. So chunks are first reordered to *digit-reversed* order: chunk `r` goes to
//! position `p(r) = c_0 d_1 ... d_{L-1} + c_1 d_2 ... d_{L-1} + ... + c_{L-1}` (`c_0` most
//! significant). Each later step splits by the next coordinate, and after the last one rank `r`
//! holds chunk `r`. All-gather runs the steps in reverse (outermost first, so the smallest
//! volume crosses the slowest link) and undoes the permutation at the end.

use crate::collective::Reduce;
use crate::comm::Comm;
use crate::element::Element;
use crate::error::CommError;
use crate::padding::{ShardLayout, pad_zeros};
use crate::topology::{Scope, Topology};

/// Position of world chunk `r` in digit-reversed order (see the module doc).
pub fn digit_reversed_position(topology: &Topology, r: usize) -> usize {
    let dims = topology.dims();
    topology
        .coords(r)
        .iter()
        .zip(&dims)
        .fold(0, |acc, (c, d)| acc * d + c)
}

/// Copies `chunks` of `chunk` elements from `src` into `dst`, chunk `r` of `src` landing at
/// position `position(r)` of `dst` (or the inverse with `Direction::Gather`).
fn permute<T: Copy>(
    src: &[T],
    dst: &mut [T],
    chunk: usize,
    map: impl Fn(usize) -> usize,
    dir: Direction,
) {
    for r in 0..src.len() / chunk.max(1) {
        let p = map(r);
        let (from, to) = match dir {
            Direction::Scatter => (r, p),
            Direction::Gather => (p, r),
        };
        dst[to * chunk..(to + 1) * chunk].copy_from_slice(&src[from * chunk..(from + 1) * chunk]);
    }
}

/// Which way a chunk permutation goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// Natural order to digit-reversed order.
    Scatter,
    /// Digit-reversed order back to natural order.
    Gather,
}

/// Buffer permuted to digit-reversed order, padded per `padding` for the world.
pub(crate) fn to_digit_reversed<T: Element>(
    topology: &Topology,
    data: &[T],
    layout: ShardLayout,
) -> Vec<T> {
    let padded = pad_zeros(data, layout.padded());
    let mut out = vec![T::default(); layout.padded()];
    permute(
        &padded,
        &mut out,
        layout.shard,
        |r| digit_reversed_position(topology, r),
        Direction::Scatter,
    );
    out
}

/// Hierarchical reduce-scatter over the world: the same result as
/// `comm.world().reduce_scatter(data, reduce)` (this rank's padded chunk), moved innermost
/// level first. Levels of size 1 are skipped (they move nothing).
pub fn reduce_scatter<T: Element>(
    comm: &Comm,
    data: &[T],
    reduce: Reduce,
) -> Result<Vec<T>, CommError> {
    let topology = comm.topology();
    let world = topology.world_size();
    let layout = ShardLayout::new(data.len(), world, 1);
    if reduce == Reduce::Mean {
        T::divide(&mut [], 1)?;
    }
    let mut buf = to_digit_reversed(topology, data, layout);
    for level in 0..topology.depth() {
        let group = comm.group(Scope::Across(level));
        if group.size() == 1 {
            continue;
        }
        let mut out = vec![T::default(); buf.len() / group.size()];
        group.reduce_scatter_into(&buf, &mut out, Reduce::Sum)?;
        buf = out;
    }
    if reduce == Reduce::Mean {
        T::divide(&mut buf, world)?;
    }
    Ok(buf)
}

/// Hierarchical all-gather over the world: the same result as `comm.world().all_gather(shard)`
/// (every rank's shard in rank order), moved outermost level first.
pub fn all_gather<T: Element>(comm: &Comm, shard: &[T]) -> Result<Vec<T>, CommError> {
    let topology = comm.topology();
    let mut buf = shard.to_vec();
    for level in (0..topology.depth()).rev() {
        let group = comm.group(Scope::Across(level));
        if group.size() == 1 {
            continue;
        }
        buf = group.all_gather(&buf)?;
    }
    let mut out = vec![T::default(); buf.len()];
    permute(
        &buf,
        &mut out,
        shard.len(),
        |r| digit_reversed_position(topology, r),
        Direction::Gather,
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digit_reversal_is_a_permutation_with_inner_coordinate_most_significant() {
        let t = Topology::parse("2x2x2").unwrap();
        // rank 1 = (gcd 1, gpu 0, node 0) -> 1 * 4 + 0 * 2 + 0 = 4
        assert_eq!(digit_reversed_position(&t, 1), 4);
        assert_eq!(digit_reversed_position(&t, 2), 2);
        for spec in ["4x1x2", "2x4x1", "1x2x2"] {
            let t = Topology::parse(spec).unwrap();
            let mut seen: Vec<usize> = (0..t.world_size())
                .map(|r| digit_reversed_position(&t, r))
                .collect();
            seen.sort();
            assert_eq!(seen, (0..t.world_size()).collect::<Vec<_>>());
        }
    }

    #[test]
    fn permutation_round_trips() {
        let t = Topology::parse("4x1x2").unwrap();
        let layout = ShardLayout::new(21, 8, 1);
        let data: Vec<f32> = (0..21).map(|i| i as f32).collect();
        let perm = to_digit_reversed(&t, &data, layout);
        let mut back = vec![0.0; perm.len()];
        permute(
            &perm,
            &mut back,
            layout.shard,
            |r| digit_reversed_position(&t, r),
            Direction::Gather,
        );
        assert_eq!(&back[..21], &data[..]);
    }
}
