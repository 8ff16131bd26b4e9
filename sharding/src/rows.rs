//! Batches that split by rows: a step's global batch shared among the ranks, and a rank's
//! share cut into micro-batches.

use std::ops::Range;

use burn::tensor::Tensor;
use burn::tensor::kind::Basic;

use crate::engine::ShardedModel;
use crate::error::ShardError;
use crate::stage::Staged;

/// A batch that splits by rows, so a step's global batch can be shared among the ranks.
///
/// A Burn tensor is a batch already (one index of its first dimension a row), and so are a
/// `Vec` of samples (one element a row) and a tuple of batches (inputs, targets, a mask: every
/// part split at the same rows); a batch of one's own implements `rows` and `select`.
pub trait Rows: Sized {
    /// Rows (sequences, samples) in the batch.
    fn rows(&self) -> usize;

    /// Rows `range` of the batch.
    fn select(&self, range: Range<usize>) -> Self;

    /// The rows of each part of a batch made of several (a tuple's), which must agree; one
    /// entry for a batch of one part.
    fn part_rows(&self) -> Vec<usize> {
        vec![self.rows()]
    }
}

/// A batch of samples (or sequences), one element a row.
impl<T: Clone> Rows for Vec<T> {
    fn rows(&self) -> usize {
        self.len()
    }

    fn select(&self, range: Range<usize>) -> Self {
        self[range].to_vec()
    }
}

/// A batch of Burn tensors, one row per index of the first dimension (a `[batch, seq]` tensor
/// of token ids, a `[batch, features]` tensor of inputs).
impl<const N: usize, K: Basic> Rows for Tensor<N, K> {
    fn rows(&self) -> usize {
        self.dims()[0]
    }

    fn select(&self, range: Range<usize>) -> Self {
        self.clone().narrow(0, range.start, range.len())
    }
}

macro_rules! tuple_rows {
    ($($part:ident $i:tt),+) => {
        impl<$($part: Rows),+> Rows for ($($part,)+) {
            fn rows(&self) -> usize {
                self.0.rows()
            }

            fn select(&self, range: Range<usize>) -> Self {
                ($(self.$i.select(range.clone()),)+)
            }

            fn part_rows(&self) -> Vec<usize> {
                let mut rows = Vec::new();
                $(rows.extend(self.$i.part_rows());)+
                rows
            }
        }
    };
}
tuple_rows!(A 0, B 1);
tuple_rows!(A 0, B 1, C 2);
tuple_rows!(A 0, B 1, C 2, E 3);

/// Rank `rank`'s rows of a global batch of `rows` rows over `world` ranks, refusing a batch that
/// does not split evenly (every rank's loss weighs the same in the step's mean).
pub(crate) fn share_of(rows: usize, rank: usize, world: usize) -> Result<Range<usize>, ShardError> {
    if rows == 0 || !rows.is_multiple_of(world) {
        return Err(ShardError::setting(
            "batch",
            rows,
            format!(
                "a global batch of {rows} rows does not split evenly over {world} ranks: use a \
                 multiple of {world}"
            ),
        ));
    }
    let each = rows / world;
    Ok(rank * each..(rank + 1) * each)
}

/// Rank `rank`'s rows of `global` over `world` ranks, refusing parts that disagree on their
/// rows and a batch that does not split evenly.
pub(crate) fn share_rows<B: Rows>(global: &B, rank: usize, world: usize) -> Result<B, ShardError> {
    let parts = global.part_rows();
    if parts.iter().any(|&r| r != parts[0]) {
        return Err(ShardError::setting(
            "batch",
            format!("{parts:?}"),
            "the batch's parts have different rows: every part (inputs, targets, masks) must \
             hold one row per sequence or sample of the batch",
        ));
    }
    Ok(global.select(share_of(global.rows(), rank, world)?))
}

impl<S: Staged<D>, const D: usize> ShardedModel<'_, S, D>
where
    S::Batch: Rows,
{
    /// This rank's share of the step's global batch (rows `rank * n / world ..`); every rank
    /// passes the same global batch.
    pub fn share(&self, global: &S::Batch) -> Result<S::Batch, ShardError> {
        let comm = self.comm();
        share_rows(global, comm.rank(), comm.topology().world_size())
    }

    /// This rank's share of the step's global batch cut into micro-batches of `rows` rows
    /// each, in order: for [`backward`](Self::backward) with gradient accumulation. The
    /// micro-batches of every rank, rank after rank, are the global batch's consecutive
    /// micro-batches of `rows` rows, at any world size; a share that does not split into
    /// them is refused.
    pub fn micro_batches(
        &self,
        global: &S::Batch,
        rows: usize,
    ) -> Result<Vec<S::Batch>, ShardError> {
        let share = self.share(global)?;
        let n = share.rows();
        if rows == 0 || !n.is_multiple_of(rows) {
            return Err(ShardError::setting(
                "rows",
                rows,
                format!(
                    "this rank's share of {n} rows does not split into micro-batches of {rows} \
                     rows: use a divisor of {n}, or a global batch of a multiple of {rows} \
                     rows per rank"
                ),
            ));
        }
        Ok((0..n / rows)
            .map(|i| share.select(i * rows..(i + 1) * rows))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vecs_and_tuples_of_them_split_by_rows() {
        let x: Vec<[f32; 2]> = (0..6).map(|i| [i as f32, -(i as f32)]).collect();
        let ids: Vec<i64> = (0..6).collect();
        // Rank 1 of 3 holds rows 2 and 3 of every part.
        let (x1, ids1) = share_rows(&(x.clone(), ids.clone()), 1, 3).unwrap();
        assert_eq!(x1, [[2.0, -2.0], [3.0, -3.0]]);
        assert_eq!(ids1, [2, 3]);
        // Parts that disagree on their rows, and rows that do not split: setting errors.
        let short = x[..4].to_vec();
        let err = share_rows(&(x.clone(), short, ids), 0, 2).unwrap_err();
        assert!(
            matches!(&err, ShardError::Setting { field: "batch", value, .. } if value == "[6, 4, 6]"),
            "{err:?}"
        );
        assert!(matches!(
            share_rows(&x, 0, 4),
            Err(ShardError::Setting { field: "batch", .. })
        ));
    }
}
