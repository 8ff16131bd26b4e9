//! ember's checkpoints: the library's sharded format (`ember_sharding::checkpoint`, which
//! every sharded run writes and reads range by range) plus ember's own record in each
//! manifest (run configuration, data position, RNG scheme, tokenizer checksum), and a whole
//! read of a checkpoint by one process (generation, tests).

use std::path::{Path, PathBuf};

use anyhow::{Result, anyhow};
use ember_sharding::plumbing::checkpoint::Checkpoint;
use serde::{Deserialize, Serialize};

use crate::run::config::TrainConfig;

pub use ember_sharding::plumbing::checkpoint::{
    Index, KINDS, MANIFEST, Manifest, TensorMeta, completed, locate, prune, read_manifest,
    shard_file_name, step_dir_name,
};

/// Where the data stream resumes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DataPosition {
    /// Seed of the batch sampler.
    pub seed: u64,
    /// The next optimizer step to draw batches for (batches are a pure function of it).
    pub next_step: u64,
    /// Tokens consumed so far.
    pub tokens_seen: u64,
}

/// How random state is derived, so a resumed run draws the same numbers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RngState {
    /// Human-readable derivation of every random draw.
    pub scheme: String,
    /// The run seed it starts from.
    pub seed: u64,
}

/// ember's fields in a checkpoint's manifest, beside the library's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// The run's resolved configuration (model shape included).
    pub train: TrainConfig,
    /// Data stream position.
    pub data: DataPosition,
    /// Random state.
    pub rng: RngState,
    /// SHA-256 of the tokenizer the tokens were made with.
    pub tokenizer_sha256: String,
}

impl RunRecord {
    /// The record of a checkpoint at `step` of a run configured by `train`.
    pub fn new(
        train: &TrainConfig,
        step: u64,
        tokens_seen: u64,
        rng_scheme: &str,
        tokenizer_sha256: String,
    ) -> Self {
        Self {
            train: train.clone(),
            data: DataPosition {
                seed: train.seed,
                next_step: step,
                tokens_seen,
            },
            rng: RngState {
                scheme: rng_scheme.into(),
                seed: train.seed,
            },
            tokenizer_sha256,
        }
    }

    /// The record of checkpoint `dir`'s `manifest`, its configuration validated.
    pub fn of(manifest: &Manifest, dir: &Path) -> Result<Self> {
        let record: RunRecord = manifest.app_record().map_err(|e| {
            anyhow!(
                "{}: {e}; it was not written by ember train",
                dir.join(MANIFEST).display()
            )
        })?;
        record.train.validate().map_err(|e| {
            anyhow!(
                "{}: invalid configuration: {e}",
                dir.join(MANIFEST).display()
            )
        })?;
        Ok(record)
    }

    /// The record as the manifest's application fields.
    pub fn app(&self) -> serde_json::Map<String, serde_json::Value> {
        match serde_json::to_value(self).expect("a record serialises") {
            serde_json::Value::Object(map) => map,
            _ => unreachable!("a struct serialises to an object"),
        }
    }
}

/// The state of one parameter, whole.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorState {
    /// Name and shape.
    pub meta: TensorMeta,
    /// `[param, exp_avg, exp_avg_sq]`, flattened.
    pub values: [Vec<f32>; 3],
}

/// A checkpoint read back whole by one process and verified.
#[derive(Debug)]
pub struct Loaded {
    /// Its directory.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// ember's record in it.
    pub run: RunRecord,
    /// The optimizer updates it holds.
    pub updates: u64,
    /// Every parameter's state, in manifest order.
    pub tensors: Vec<TensorState>,
}

/// Reads checkpoint `dir` whole: manifest, checksums, every tensor assembled from its ranges.
/// Nothing is returned unless every check passes.
pub fn load(dir: &Path) -> Result<Loaded> {
    let checkpoint = Checkpoint::open_local(dir)?;
    let index = checkpoint.index();
    let run = RunRecord::of(&index.manifest, &index.dir)?;
    let tensors = index
        .manifest
        .tensors
        .iter()
        .map(|meta| {
            let n: usize = meta.shape.iter().product();
            let mut values: [Vec<f32>; 3] = Default::default();
            for (k, kind) in KINDS.iter().enumerate() {
                values[k] = index.read(kind, &meta.name, 0..n)?;
            }
            Ok(TensorState {
                meta: meta.clone(),
                values,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Loaded {
        dir: index.dir.clone(),
        updates: index.updates,
        manifest: index.manifest.clone(),
        run,
        tensors,
    })
}
