//! The single padding rule for sizes that don't divide by the group size, as pure functions.
//! It deliberately moves no data itself beyond the one zero-padded copy in [`pad_zeros`].
//!
//! # The rule
//!
//! A logical buffer of `len` elements split over `g` ranks with quantization blocks of `block`
//! elements (1 when unquantized) is padded **at the end with zeros** to
//! `padded = g * shard`, where `shard = ceil(len / (g * block)) * block`. Rank `i` owns
//! elements `[i * shard, (i + 1) * shard)` of the padded buffer. Zeros are neutral for sums and
//! quantize to exactly zero, so padding never changes a real element. All-gather returns the
//! padded buffer; the caller drops the tail (`&out[..len]`).

use serde::{Deserialize, Serialize};

/// Where each rank's shard lies in a padded buffer (see the module doc for the rule).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardLayout {
    /// Logical length the caller cares about.
    pub len: usize,
    /// Number of ranks the buffer is split over.
    pub group_size: usize,
    /// Elements per shard (a multiple of the block).
    pub shard: usize,
}

impl ShardLayout {
    /// The layout of `len` elements over `group_size` ranks with shards a multiple of `block`.
    pub fn new(len: usize, group_size: usize, block: usize) -> Self {
        assert!(
            group_size > 0 && block > 0,
            "group size and block must be positive"
        );
        let unit = group_size * block;
        let shard = len.div_ceil(unit) * block;
        Self {
            len,
            group_size,
            shard,
        }
    }

    /// Length after padding: `group_size * shard`.
    pub fn padded(&self) -> usize {
        self.group_size * self.shard
    }

    /// Element range `[start, end)` of rank `index`'s shard in the padded buffer.
    pub fn range(&self, index: usize) -> std::ops::Range<usize> {
        index * self.shard..(index + 1) * self.shard
    }
}

/// A copy of `data` with zeros appended up to `padded` elements.
pub fn pad_zeros<T: Copy + Default>(data: &[T], padded: usize) -> Vec<T> {
    assert!(padded >= data.len(), "padding never shrinks a buffer");
    let mut out = Vec::with_capacity(padded);
    out.extend_from_slice(data);
    out.resize(padded, T::default());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pads_to_a_multiple_of_group_times_block() {
        let l = ShardLayout::new(10, 4, 1);
        assert_eq!((l.shard, l.padded()), (3, 12));
        assert_eq!(l.range(3), 9..12);
        let l = ShardLayout::new(10, 4, 8);
        assert_eq!((l.shard, l.padded()), (8, 32));
        let l = ShardLayout::new(64, 4, 8);
        assert_eq!((l.shard, l.padded()), (16, 64));
        assert_eq!(ShardLayout::new(0, 3, 1).padded(), 0);
        assert_eq!(pad_zeros(&[1.0f32, 2.0], 4), vec![1.0, 2.0, 0.0, 0.0]);
    }
}
