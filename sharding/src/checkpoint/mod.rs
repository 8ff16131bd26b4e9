//! Sharded checkpoints of any model partitioned by this crate, in safetensors: every rank
//! writes only the ranges it owns, and a checkpoint resumes at any world size, topology or
//! configuration, each rank reading only the ranges it owns there.
//!
//! # Layout
//!
//! A checkpoint is a directory `step-NNNNNN/` holding
//!
//! - `rank-RRRRR.safetensors`, one per writing rank (the first rank of each group holding the
//!   same optimizer shard): for every parameter range it owns, flat f32 tensors `param/<path>`
//!   and one per optimizer state (AdamW: `exp_avg/<path>`, `exp_avg_sq/<path>`; SGD:
//!   `momentum_buffer/<path>`), with each range's element offset and the parameter's length
//!   in the `ember.layout` metadata, the state's names in `ember.optimizer_state` and the
//!   count of updates in `ember.adam_step`;
//! - `ef-RRRRR.safetensors`, one per rank when gradients are quantized with error feedback:
//!   the rank's residual per unit and hop (`<unit>/<hop>`), with the layout they belong to;
//! - the application's files (ember copies its tokenizer), and
//! - `manifest.json`: format, step, world size, every parameter's shape, the sharding it was
//!   written with, every file's size and SHA-256, and the application's own record.
//!
//! A directory appears under its final name only once it is complete (temporary directory,
//! fsync, the manifest last, rename), so a crash or kill never damages a checkpoint that
//! existed before. [`save`] streams the files one parameter range at a time: it needs no
//! memory beyond the model's own state. [`save_async`] copies each rank's state to host memory
//! and writes it on a thread of its own while training goes on ([`PendingSave`]); each rank
//! leaves a record of its files in the temporary directory, and rank 0's writer completes the
//! checkpoint once every rank's record is there.
//!
//! The layout is that of PyTorch DCP: shards with global offsets, loadable into any partition
//! (which refuses gaps and overlaps, and reads only the bytes of the ranges it asks for).

mod read;
mod write;

use std::fs::{self, File};
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::ShardConfig;
use crate::error::ShardError;

pub use read::{Checkpoint, Index};
pub use write::{
    FileDtype, PendingSave, Piece, SaveOptions, ShardView, ShardWriter, save, save_async,
};

/// Name of the manifest inside a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";
/// Value of `Manifest::format`.
pub const FORMAT: &str = "ember-checkpoint";
/// Metadata key, inside each rank file, of the JSON layout of its entries.
pub(crate) const LAYOUT_KEY: &str = "ember.layout";
/// Metadata key of the count of optimizer updates.
pub(crate) const ADAM_STEP_KEY: &str = "ember.adam_step";
/// Metadata key of the optimizer state's names, a JSON list in the optimizer's order.
pub(crate) const STATE_KEY: &str = "ember.optimizer_state";
/// Metadata key, inside each residual file, of the layout the residuals belong to.
pub(crate) const RESIDUALS_KEY: &str = "ember.residuals";

/// The kinds of state an AdamW run saves per parameter (the ember binary's); the safetensors
/// key is `<kind>/<path>`.
pub const KINDS: [&str; 3] = ["param", "exp_avg", "exp_avg_sq"];

/// A parameter's path and whole shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorMeta {
    /// Dotted module path (`h.0.attn.c_attn.weight`).
    pub name: String,
    /// Global shape.
    pub shape: Vec<usize>,
}

/// A file of the checkpoint and its checksum.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Path relative to the checkpoint directory.
    pub path: String,
    /// Size in bytes.
    pub bytes: u64,
    /// Lower-case hex SHA-256.
    pub sha256: String,
}

/// One flat range of a parameter held by a rank file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Range {
    /// First element, in the flattened parameter.
    pub offset: usize,
    /// Elements of the whole parameter.
    pub global_numel: usize,
}

/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// Layout version.
    pub version: u32,
    /// Training steps completed (the application's count).
    pub step: u64,
    /// World size of the job that wrote it (`files` says which ranks wrote one).
    pub world_size: usize,
    /// Every parameter, in the model's order.
    pub tensors: Vec<TensorMeta>,
    /// Every file with its checksum.
    pub files: Vec<FileEntry>,
    /// The sharding of the job that wrote it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<ShardConfig>,
    /// Its topology, `NODESxGPUSxGCDS`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<String>,
    /// The seed of the device's generator the model's units drew from
    /// ([`draw_seed`](crate::draw_seed)), which a resumed model keeps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generator_seed: Option<u64>,
    /// The application's own record (ember: its run configuration, data position, RNG scheme
    /// and tokenizer checksum), kept beside the fields above.
    #[serde(flatten)]
    pub app: serde_json::Map<String, serde_json::Value>,
}

impl Manifest {
    /// A manifest of `tensors` at `step` for a job of `world_size` ranks (files are filled in
    /// when the checkpoint is completed).
    pub fn new(step: u64, world_size: usize, tensors: Vec<TensorMeta>) -> Self {
        Self {
            format: FORMAT.into(),
            version: 1,
            step,
            world_size,
            tensors,
            files: Vec::new(),
            shard: None,
            topology: None,
            generator_seed: None,
            app: serde_json::Map::new(),
        }
    }

    /// The application's record read back as `T`.
    pub fn app_record<T: serde::de::DeserializeOwned>(&self) -> Result<T, ShardError> {
        serde_json::from_value(serde_json::Value::Object(self.app.clone()))
            .map_err(|e| ShardError::Io(format!("the manifest's application record: {e}")))
    }
}

/// Name of the checkpoint directory for `step`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:06}")
}

/// The optimizer-shard file rank `rank` writes.
pub fn shard_file_name(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// The error-feedback residual file rank `rank` writes.
pub fn residual_file_name(rank: usize) -> String {
    format!("ef-{rank:05}.safetensors")
}

/// Hex SHA-256 of a file, streamed.
pub fn sha256_file(path: &Path) -> Result<String, ShardError> {
    let mut file = File::open(path).map_err(|e| io(path, "opening", e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| io(path, "reading", e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(format!("{:x}", hasher.finalize()))
}

/// Accepts a checkpoint directory, or an out dir (then its latest complete checkpoint).
pub fn locate(path: &Path) -> Result<PathBuf, ShardError> {
    if path.join(MANIFEST).is_file() {
        return Ok(path.to_path_buf());
    }
    if !path.is_dir() {
        return Err(ShardError::Io(format!(
            "{} does not exist or is not a directory; pass a checkpoint directory \
             (step-NNNNNN) or the directory a run saved into",
            path.display()
        )));
    }
    completed(path)?.pop().map(|(_, p)| p).ok_or_else(|| {
        ShardError::Io(format!(
            "{} is not a checkpoint: it has no {MANIFEST} and no step-NNNNNN checkpoint inside",
            path.display()
        ))
    })
}

/// The complete checkpoints (`step-NNNNNN` with a manifest) of `out_dir`, oldest first, as
/// (step, directory).
pub fn completed(out_dir: &Path) -> Result<Vec<(u64, PathBuf)>, ShardError> {
    let mut steps = Vec::new();
    for entry in fs::read_dir(out_dir).map_err(|e| io(out_dir, "listing", e))? {
        let entry = entry.map_err(|e| io(out_dir, "listing", e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(step) = name
            .strip_prefix("step-")
            .and_then(|s| s.parse::<u64>().ok())
            && entry.path().join(MANIFEST).is_file()
        {
            steps.push((step, entry.path()));
        }
    }
    steps.sort();
    Ok(steps)
}

/// Deletes all but the newest `keep` complete checkpoints of `out_dir`; call it only after a
/// new checkpoint is complete. Returns the deleted directories.
pub fn prune(out_dir: &Path, keep: usize) -> Result<Vec<PathBuf>, ShardError> {
    let steps = completed(out_dir)?;
    let excess = steps.len().saturating_sub(keep);
    let mut removed = Vec::new();
    for (_, dir) in steps.into_iter().take(excess) {
        fs::remove_dir_all(&dir).map_err(|e| io(&dir, "removing", e))?;
        removed.push(dir);
    }
    Ok(removed)
}

/// Reads and checks `dir/manifest.json`.
pub fn read_manifest(dir: &Path) -> Result<Manifest, ShardError> {
    let path = dir.join(MANIFEST);
    let text = fs::read_to_string(&path).map_err(|e| io(&path, "reading", e))?;
    let manifest: Manifest = serde_json::from_str(&text).map_err(|e| {
        ShardError::Io(format!(
            "{} is not a valid ember manifest: {e}",
            path.display()
        ))
    })?;
    let mut names: Vec<&str> = manifest.tensors.iter().map(|t| t.name.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(ShardError::Io(format!(
            "{}: tensor {} is listed twice",
            path.display(),
            w[0]
        )));
    }
    if manifest.format != FORMAT || manifest.version != 1 {
        return Err(ShardError::Io(format!(
            "{}: format {:?} version {} is not {FORMAT} version 1",
            path.display(),
            manifest.format,
            manifest.version
        )));
    }
    Ok(manifest)
}

/// An I/O error naming the file and what was being done.
pub(crate) fn io(path: &Path, doing: &str, e: impl std::fmt::Display) -> ShardError {
    ShardError::Io(format!("{doing} {}: {e}", path.display()))
}
