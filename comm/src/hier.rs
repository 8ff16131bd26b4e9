//! Hierarchical all-gather and reduce-scatter over a [`Path`]: the collective over the group
//! `G = Span{0, hi}` composed hop by hop, producing exactly the layout of the flat collective on
//! `G` (rank with `G` index `i` gets padded chunk `i`; all-gather returns shards in `G` index
//! order). It deliberately adds no algorithm of its own beyond
//! the one chunk permutation of `path` (see its module doc for why and which).
//!
//! Reduce-scatter runs the hops innermost first (the largest volume on the fastest link),
//! all-gather outermost first (the smallest volume on the slowest link). Hops of size 1 are
//! skipped (they move nothing). Hop `k` charges its own scope per the formulas in `counters`:
//! a reduce-scatter hop of size `D_k` on the buffer left by the inner hops, an all-gather hop on
//! the buffer it produces. The original world-only functions ([`reduce_scatter`],
//! [`all_gather`]) are the one-hop-per-level path over the world.

use crate::collective::Reduce;
use crate::comm::{Comm, Group};
use crate::element::Element;
use crate::error::CommError;
use crate::padding::ShardLayout;
use crate::path::{Path, from_hop_order, to_hop_order};
use crate::topology::Topology;

/// Position of world chunk `r` in digit-reversed order: the chunk permutation of the
/// one-hop-per-level path over the world ([`Path::per_level`]).
pub fn digit_reversed_position(topology: &Topology, r: usize) -> usize {
    Path::per_level(topology).chunk_position(topology, r)
}

/// The groups of `path`'s hops that move data (size > 1), innermost first; checks the path.
pub(crate) fn live_hops<'c>(comm: &'c Comm, path: &Path) -> Result<Vec<Group<'c>>, CommError> {
    let topology = comm.topology();
    path.check(topology)?;
    let mut groups = Vec::with_capacity(path.hop_count());
    for hop in path.hops(topology) {
        let group = comm.try_group(hop)?;
        if group.size() > 1 {
            groups.push(group);
        }
    }
    Ok(groups)
}

/// Reduce-scatter over `path`'s group `G`, innermost hop first: the same result as
/// `comm.group(path.group(topology)).reduce_scatter(data, reduce)` (this rank's chunk of
/// `ShardLayout::new(data.len(), |G|, 1)`). `Mean` divides by `|G|` once, at the end.
pub fn reduce_scatter_path<T: Element>(
    comm: &Comm,
    data: &[T],
    path: &Path,
    reduce: Reduce,
) -> Result<Vec<T>, CommError> {
    let topology = comm.topology();
    let hops = live_hops(comm, path)?;
    let p = topology.group_size(path.group(topology));
    if reduce == Reduce::Mean {
        // Refuse integer means before anything moves, so the ranks stay in step.
        T::divide(&mut [], 1)?;
    }
    let layout = ShardLayout::new(data.len(), p, 1);
    if let [group] = hops.as_slice()
        && data.len() == layout.padded()
    {
        // One hop moves data: the hop order is the natural order and nothing needs padding,
        // so reduce straight from the caller's buffer (no staging copy).
        let mut out = vec![T::default(); data.len() / group.size()];
        group.reduce_scatter_into(data, &mut out, Reduce::Sum)?;
        if reduce == Reduce::Mean {
            T::divide(&mut out, p)?;
        }
        return Ok(out);
    }
    let mut buf = to_hop_order(topology, path, data, layout);
    for group in &hops {
        let mut out = vec![T::default(); buf.len() / group.size()];
        group.reduce_scatter_into(&buf, &mut out, Reduce::Sum)?;
        buf = out;
    }
    if reduce == Reduce::Mean {
        T::divide(&mut buf, p)?;
    }
    Ok(buf)
}

/// All-gather over `path`'s group `G`, outermost hop first: the same result as
/// `comm.group(path.group(topology)).all_gather(shard)` (every member's shard in `G` index
/// order).
pub fn all_gather_path<T: Element>(
    comm: &Comm,
    shard: &[T],
    path: &Path,
) -> Result<Vec<T>, CommError> {
    let hops = live_hops(comm, path)?;
    // The first hop sends from the caller's buffer, each later one from the hop before's.
    let mut buf = std::borrow::Cow::Borrowed(shard);
    for group in hops.iter().rev() {
        buf = std::borrow::Cow::Owned(group.all_gather(&buf)?);
    }
    if hops.len() <= 1 {
        // With at most one hop moving data the hop order is the natural order.
        return Ok(buf.into_owned());
    }
    Ok(from_hop_order(comm.topology(), path, &buf, shard.len()))
}

/// Hierarchical reduce-scatter over the world, one hop per level: the same result as
/// `comm.world().reduce_scatter(data, reduce)`.
pub fn reduce_scatter<T: Element>(
    comm: &Comm,
    data: &[T],
    reduce: Reduce,
) -> Result<Vec<T>, CommError> {
    reduce_scatter_path(comm, data, &Path::per_level(comm.topology()), reduce)
}

/// Hierarchical all-gather over the world, one hop per level: the same result as
/// `comm.world().all_gather(shard)`.
pub fn all_gather<T: Element>(comm: &Comm, shard: &[T]) -> Result<Vec<T>, CommError> {
    all_gather_path(comm, shard, &Path::per_level(comm.topology()))
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
            // The coordinates read with c_0 most significant.
            for r in 0..t.world_size() {
                let want = t
                    .coords(r)
                    .iter()
                    .zip(t.dims())
                    .fold(0, |acc, (c, d)| acc * d + c);
                assert_eq!(digit_reversed_position(&t, r), want);
            }
        }
    }
}
