//! Stateless batch sampling: which token window each sample reads is a pure function of
//! (seed, stream, step, global sample index). A run therefore splits over data-parallel ranks
//! and resumes exactly without saving sampler state, and the global batch is the same at any
//! world size. It deliberately holds no RNG, no epoch bookkeeping and no shuffling state.

use std::ops::Range;

use crate::error::DataError;
use crate::tokens::TokenFile;

/// Stream id for sampling training batches.
pub const STREAM_TRAIN: u64 = 0;
/// Stream id for sampling validation batches, so evaluation never draws the same windows as
/// training at the same (seed, step).
pub const STREAM_VAL: u64 = 1;

/// The splitmix64 finaliser (Steele, Lea & Flood, "Fast splittable pseudorandom number
/// generators", OOPSLA 2014; the constants are Vigna's): a bijection on u64 whose output bits
/// each depend on every input bit.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The start of sample `sample`'s window at `step`: uniform over `[0, n_tokens - block_size
/// - 1]`, i.e. every window of `block_size + 1` tokens (inputs plus the shifted target).
///
/// Hash: `h = splitmix64(splitmix64(splitmix64(splitmix64(seed) ^ stream) ^ step) ^ sample)`,
/// chaining the finaliser so each integer is fully mixed before the next is folded in. The
/// 64-bit hash maps to the range by Lemire's multiply-shift, `(h * m) >> 64` with `m` windows,
/// whose bias (at most m / 2^64) is negligible and which needs no division or rejection loop.
///
/// Never panics: with `n_tokens <= block_size` (which [`Sampler::new`] refuses) it returns 0.
pub fn window_start(
    seed: u64,
    stream: u64,
    step: u64,
    sample: u64,
    n_tokens: usize,
    block_size: usize,
) -> usize {
    let h = splitmix64(splitmix64(splitmix64(splitmix64(seed) ^ stream) ^ step) ^ sample);
    let windows = n_tokens.saturating_sub(block_size).max(1) as u128;
    ((h as u128 * windows) >> 64) as usize
}

/// How a global batch divides over data-parallel ranks and gradient-accumulation micro-steps.
/// Fields are private so that only [`BatchPlan::new`] can make one, and it refuses
/// combinations that do not divide evenly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchPlan {
    global_batch: usize,
    grad_accum: usize,
    world_size: usize,
    rank: usize,
}

impl BatchPlan {
    /// Plans `global_batch` sequences per optimiser step over `world_size` ranks, each
    /// running `grad_accum` micro-batches. Refuses zeros, `rank >= world_size`, and a
    /// global batch not divisible by `grad_accum * world_size`, naming the numbers.
    pub fn new(
        global_batch: usize,
        grad_accum: usize,
        world_size: usize,
        rank: usize,
    ) -> Result<Self, DataError> {
        if global_batch == 0 || grad_accum == 0 || world_size == 0 {
            return Err(DataError::Invalid(format!(
                "global batch {global_batch}, grad accumulation {grad_accum} and world size \
                 {world_size} must all be at least 1"
            )));
        }
        if rank >= world_size {
            return Err(DataError::Invalid(format!(
                "rank {rank} is out of range for world size {world_size} (ranks are 0..{world_size})"
            )));
        }
        let parts = grad_accum * world_size;
        if !global_batch.is_multiple_of(parts) {
            let lower = (global_batch / parts).max(1) * parts;
            return Err(DataError::Setting {
                field: "global_batch",
                value: global_batch,
                reason: format!(
                    "does not divide evenly over {world_size} ranks x {grad_accum} \
                     accumulation steps ({parts} micro-batches); use a multiple of {parts} \
                     (e.g. {lower} or {}), or change the accumulation steps or the number of ranks",
                    lower + parts
                ),
            });
        }
        Ok(BatchPlan {
            global_batch,
            grad_accum,
            world_size,
            rank,
        })
    }

    /// Sequences per optimiser step, summed over all ranks and micro-batches.
    pub fn global_batch(&self) -> usize {
        self.global_batch
    }

    /// Micro-batches per optimiser step on each rank.
    pub fn grad_accum(&self) -> usize {
        self.grad_accum
    }

    /// Number of data-parallel ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Sequences in one micro-batch: `global_batch / (grad_accum * world_size)`.
    pub fn micro_batch_size(&self) -> usize {
        self.global_batch / (self.grad_accum * self.world_size)
    }

    /// Global sample indices of this rank's micro-batch `micro`. Rank r owns the contiguous
    /// block `[r*B/W, (r+1)*B/W)`, cut into `grad_accum` consecutive micro-batches, so
    /// concatenating all ranks' micro-batches in (rank, micro) order gives `0..B`.
    ///
    /// # Panics
    /// If `micro >= grad_accum`.
    pub fn samples(&self, micro: usize) -> Range<u64> {
        assert!(
            micro < self.grad_accum,
            "micro-batch {micro} out of range for grad_accum {}",
            self.grad_accum
        );
        let per_rank = self.global_batch / self.world_size;
        let mb = self.micro_batch_size();
        let start = (self.rank * per_rank + micro * mb) as u64;
        start..start + mb as u64
    }
}

/// One batch of token windows, row-major `[batch, block]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// Input tokens, `[batch, block]` row-major.
    pub inputs: Vec<i64>,
    /// Next-token targets, `[batch, block]`: row i is row i of `inputs` shifted left by one.
    pub targets: Vec<i64>,
    /// Number of rows (sequences).
    pub batch: usize,
    /// Tokens per row (the context length T).
    pub block: usize,
    /// The optimiser step the batch belongs to.
    pub step: u64,
    /// The global sample index of row 0; row i is sample `first_sample + i` of the step's
    /// global batch (what per-sample randomness such as dropout masks is keyed by).
    pub first_sample: u64,
}

/// Draws batches of `block_size`-token windows from one split.
#[derive(Debug, Clone, Copy)]
pub struct Sampler<'a> {
    data: &'a TokenFile,
    block_size: usize,
    seed: u64,
    stream: u64,
}

impl<'a> Sampler<'a> {
    /// A sampler over `data` (use [`STREAM_TRAIN`] or [`STREAM_VAL`] for `stream`). Refuses a
    /// zero block size and a split with `<= block_size + 1` tokens (too few for two distinct
    /// windows), naming the numbers.
    pub fn new(
        data: &'a TokenFile,
        block_size: usize,
        seed: u64,
        stream: u64,
    ) -> Result<Self, DataError> {
        if block_size == 0 {
            return Err(DataError::Setting {
                field: "block_size",
                value: 0,
                reason: "windows need at least 1 token".to_owned(),
            });
        }
        if data.len() <= block_size + 1 {
            return Err(DataError::Setting {
                field: "block_size",
                value: block_size,
                reason: format!(
                    "{} has {} tokens, too few for windows of this size (it needs more than \
                     {}); use a block size of at most {} or more data",
                    data.path().display(),
                    data.len(),
                    block_size + 1,
                    data.len().saturating_sub(2)
                ),
            });
        }
        Ok(Sampler {
            data,
            block_size,
            seed,
            stream,
        })
    }

    /// The context length T.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The batch for optimiser step `step` holding global samples `samples` (usually
    /// [`BatchPlan::samples`]). Pure: the same arguments always give the same batch, on any
    /// rank.
    pub fn batch(&self, step: u64, samples: Range<u64>) -> Batch {
        let t = self.block_size;
        let rows = (samples.end.saturating_sub(samples.start)) as usize;
        let first_sample = samples.start;
        let mut inputs = Vec::with_capacity(rows * t);
        let mut targets = Vec::with_capacity(rows * t);
        for sample in samples {
            let start = window_start(self.seed, self.stream, step, sample, self.data.len(), t);
            // start + t + 1 <= len by construction of window_start and Sampler::new.
            self.data.read_into(start, t, &mut inputs); // [T]
            self.data.read_into(start + 1, t, &mut targets); // [T]
        }
        Batch {
            inputs,
            targets,
            batch: rows,
            block: t,
            step,
            first_sample,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::{Split, TokenHeaderInfo, write_tokens};

    /// A token file holding 0, 1, ..., n-1, so a window's start is its first token.
    fn counting_file(dir: &std::path::Path, n: u32) -> TokenFile {
        let path = dir.join("count.bin");
        let tokens: Vec<u32> = (0..n).collect();
        let info = TokenHeaderInfo {
            vocab_size: n as usize,
            tokenizer_sha256: "0".repeat(64),
            split: Split::Train,
        };
        write_tokens(&path, &tokens, info).unwrap();
        TokenFile::open(&path).unwrap()
    }

    #[test]
    fn same_inputs_same_batch_and_step_changes_it() {
        let dir = tempfile::tempdir().unwrap();
        let data = counting_file(dir.path(), 10_000);
        let s = Sampler::new(&data, 16, 42, STREAM_TRAIN).unwrap();
        let a = s.batch(3, 0..8);
        assert_eq!(a, s.batch(3, 0..8));
        assert_eq!(a.batch, 8);
        assert_eq!(a.block, 16);
        assert_eq!(a.inputs.len(), 8 * 16);
        assert_ne!(a, s.batch(4, 0..8));
        let other_seed = Sampler::new(&data, 16, 43, STREAM_TRAIN).unwrap();
        assert_ne!(a, other_seed.batch(3, 0..8));
        let val = Sampler::new(&data, 16, 42, STREAM_VAL).unwrap();
        assert_ne!(a, val.batch(3, 0..8));
    }

    #[test]
    fn rows_are_contiguous_windows_and_targets_are_shifted() {
        let dir = tempfile::tempdir().unwrap();
        let data = counting_file(dir.path(), 5_000);
        let s = Sampler::new(&data, 32, 7, STREAM_TRAIN).unwrap();
        let b = s.batch(11, 100..116);
        for r in 0..b.batch {
            let row = &b.inputs[r * 32..(r + 1) * 32];
            let tgt = &b.targets[r * 32..(r + 1) * 32];
            let start = window_start(7, STREAM_TRAIN, 11, 100 + r as u64, 5_000, 32);
            assert_eq!(row[0], start as i64);
            for i in 0..32 {
                assert_eq!(row[i], start as i64 + i as i64);
                assert_eq!(tgt[i], row[i] + 1);
            }
        }
    }

    #[test]
    fn global_batch_is_identical_at_any_world_size() {
        let dir = tempfile::tempdir().unwrap();
        let data = counting_file(dir.path(), 20_000);
        let s = Sampler::new(&data, 8, 1234, STREAM_TRAIN).unwrap();
        let global = 16;
        let reference = s.batch(5, 0..global as u64);
        for world in [1, 2, 4] {
            for accum in [1, 2] {
                let mut covered = Vec::new();
                let mut inputs = Vec::new();
                let mut targets = Vec::new();
                for rank in 0..world {
                    let plan = BatchPlan::new(global, accum, world, rank).unwrap();
                    assert_eq!(plan.micro_batch_size(), global / (world * accum));
                    for micro in 0..accum {
                        let range = plan.samples(micro);
                        assert_eq!(range.end - range.start, plan.micro_batch_size() as u64);
                        covered.extend(range.clone());
                        let b = s.batch(5, range);
                        inputs.extend(b.inputs);
                        targets.extend(b.targets);
                    }
                }
                assert_eq!(
                    covered,
                    (0..global as u64).collect::<Vec<_>>(),
                    "W={world} A={accum}"
                );
                assert_eq!(inputs, reference.inputs, "W={world} A={accum}");
                assert_eq!(targets, reference.targets, "W={world} A={accum}");
            }
        }
    }

    #[test]
    fn batch_plan_refuses_uneven_split_naming_numbers() {
        let msg = BatchPlan::new(10, 1, 4, 0).unwrap_err().to_string();
        assert!(msg.contains("10") && msg.contains('4'), "{msg}");
        let msg = BatchPlan::new(12, 2, 4, 0).unwrap_err().to_string();
        assert!(msg.contains("12") && msg.contains('8'), "{msg}");
        assert!(BatchPlan::new(8, 2, 4, 4).is_err());
        assert!(BatchPlan::new(0, 1, 1, 0).is_err());
        assert!(BatchPlan::new(8, 2, 4, 3).is_ok());
    }

    #[test]
    fn sampler_refuses_short_split_and_suggests_block_size() {
        let dir = tempfile::tempdir().unwrap();
        let data = counting_file(dir.path(), 65);
        let msg = Sampler::new(&data, 64, 0, STREAM_VAL)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("65") && msg.contains("64") && msg.contains("block_size"),
            "{msg}"
        );
        assert!(Sampler::new(&data, 63, 0, STREAM_VAL).is_ok());
        assert!(Sampler::new(&data, 0, 0, STREAM_VAL).is_err());
    }

    #[test]
    fn window_starts_are_in_range_and_roughly_uniform() {
        let (n, block) = (1_000usize, 10usize);
        let max_start = n - block - 1;
        let draws = 20_000u64;
        let mut buckets = [0u64; 10];
        let (mut sum, mut lo, mut hi) = (0f64, usize::MAX, 0usize);
        for i in 0..draws {
            let s = window_start(99, STREAM_TRAIN, i / 64, i % 64, n, block);
            assert!(s <= max_start, "start {s} > {max_start}");
            sum += s as f64;
            lo = lo.min(s);
            hi = hi.max(s);
            buckets[s * 10 / (max_start + 1)] += 1;
        }
        let mean = sum / draws as f64;
        // Uniform on 0..=989 has mean 494.5 and sd ~286, so the mean of 20k draws has sd ~2.
        assert!((mean - 494.5).abs() < 10.0, "mean start {mean}");
        assert!(lo < 5 && hi > max_start - 5, "range {lo}..={hi}");
        for (i, &c) in buckets.iter().enumerate() {
            // Expected 2000 per bucket, sd ~42.
            assert!((1800..=2200).contains(&c), "bucket {i} has {c}");
        }
        // The last possible window is reachable and the degenerate case does not panic.
        assert_eq!(window_start(1, 2, 3, 4, 11, 10), 0);
        assert_eq!(window_start(1, 2, 3, 4, 5, 10), 0);
    }

    #[test]
    fn hash_inputs_are_not_interchangeable() {
        // Swapping step and sample must change the window, or micro-batches would repeat.
        let a = window_start(1, 0, 2, 3, 1 << 30, 64);
        let b = window_start(1, 0, 3, 2, 1 << 30, 64);
        assert_ne!(a, b);
    }
}
