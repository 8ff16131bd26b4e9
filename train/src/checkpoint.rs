//! Checkpoints: a directory `step-NNNNNN/` holding one safetensors file per rank (flat f32
//! ranges of the master weights and Adam moments, each with its global shape and element
//! offset), a copy of the tokenizer, and `manifest.json` (config, step, data position, RNG
//! scheme, SHA-256 of every file). A directory appears under its final name only once it is
//! complete (temp dir, fsync, rename), so a crash never damages an existing checkpoint.
//!
//! The layout is already that of a sharded checkpoint with one shard per tensor; loading
//! assembles each tensor from whatever ranges the files hold and refuses gaps and overlaps.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, ensure};
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::TrainConfig;

/// Name of the manifest inside a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";
/// Value of `Manifest::format`.
pub const FORMAT: &str = "ember-checkpoint";
/// Metadata key, inside each safetensors file, of the JSON layout of its entries.
const LAYOUT_KEY: &str = "ember.layout";

/// The kinds of state saved per parameter; the safetensors key is `<kind>/<name>`.
pub const KINDS: [&str; 3] = ["param", "exp_avg", "exp_avg_sq"];

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

/// A parameter's global name and shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorMeta {
    /// Dotted module path (`h.0.attn.c_attn.weight`).
    pub name: String,
    /// Global shape.
    pub shape: Vec<usize>,
}

/// A file of the checkpoint and its checksum.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Path relative to the checkpoint directory.
    pub path: String,
    /// Size in bytes.
    pub bytes: u64,
    /// Lower-case hex SHA-256.
    pub sha256: String,
}

/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// Layout version.
    pub version: u32,
    /// Optimizer steps completed.
    pub step: u64,
    /// The run's resolved configuration (model shape included).
    pub train: TrainConfig,
    /// World size of the job that wrote it (the files list says which ranks wrote one).
    pub world_size: usize,
    /// Data stream position.
    pub data: DataPosition,
    /// Random state.
    pub rng: RngState,
    /// SHA-256 of the tokenizer the tokens were made with.
    pub tokenizer_sha256: String,
    /// Every parameter, in model order.
    pub tensors: Vec<TensorMeta>,
    /// Every file with its checksum (the tokenizer and the rank shards).
    pub files: Vec<FileEntry>,
    /// The sharding of the run that wrote it (absent for single-process runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<ember_sharding::ShardConfig>,
    /// Its topology, `NODESxGPUSxGCDS` (absent for single-process runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<String>,
}

impl Manifest {
    /// The manifest of a checkpoint at `step` of a run configured by `train` (files are
    /// filled in by [`finish`]).
    pub fn new(
        train: &TrainConfig,
        step: u64,
        tokens_seen: u64,
        world_size: usize,
        rng_scheme: &str,
        tokenizer_sha256: String,
        tensors: Vec<TensorMeta>,
    ) -> Self {
        Manifest {
            format: FORMAT.into(),
            version: 1,
            step,
            train: train.clone(),
            world_size,
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
            tensors,
            files: Vec::new(),
            shard: None,
            topology: None,
        }
    }
}

/// One flat range of a tensor held by a shard file.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Range {
    /// First element, in the flattened global tensor.
    pub offset: usize,
    /// Elements of the global tensor.
    pub global_numel: usize,
}

/// The state of one parameter, whole.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorState {
    /// Name and shape.
    pub meta: TensorMeta,
    /// `[param, exp_avg, exp_avg_sq]`, flattened.
    pub values: [Vec<f32>; 3],
}

/// A checkpoint read back and verified.
#[derive(Debug)]
pub struct Loaded {
    /// Its directory.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// Adam's step counter.
    pub adam_step: u64,
    /// Every parameter's state, in manifest order.
    pub tensors: Vec<TensorState>,
}

/// Hex SHA-256 of a file, streamed.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(format!("{:x}", hasher.finalize()))
}

fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing directory {}", dir.display()))
}

/// Name of the checkpoint directory for `step`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:06}")
}

/// What one rank writes: for each parameter, a range and its three state arrays.
#[derive(Debug)]
pub struct ShardData {
    /// Rank that owns these ranges.
    pub rank: usize,
    /// `(name, range, [param, exp_avg, exp_avg_sq])`.
    pub entries: Vec<(String, Range, [Vec<f32>; 3])>,
    /// Adam's step counter.
    pub adam_step: u64,
}

/// The file rank `rank` writes.
pub fn shard_file_name(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// Writes one rank's file (`rank-RRRRR.safetensors`) into `dir` and syncs it.
pub fn write_shard(dir: &Path, shard: &ShardData) -> Result<PathBuf> {
    let path = dir.join(shard_file_name(shard.rank));
    let mut layout = BTreeMap::new();
    let mut blobs: Vec<(String, usize, Vec<u8>)> = Vec::new();
    for (name, range, values) in &shard.entries {
        for (kind, v) in KINDS.iter().zip(values) {
            let key = format!("{kind}/{name}");
            layout.insert(key.clone(), *range);
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            blobs.push((key, v.len(), bytes));
        }
    }
    let views = blobs
        .iter()
        .map(|(k, n, b)| Ok((k.clone(), TensorView::new(StDtype::F32, vec![*n], b)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    let metadata = HashMap::from([
        (LAYOUT_KEY.to_string(), serde_json::to_string(&layout)?),
        ("ember.adam_step".to_string(), shard.adam_step.to_string()),
    ]);
    safetensors::serialize_to_file(views, Some(metadata), &path)
        .with_context(|| format!("writing {}", path.display()))?;
    File::open(&path)?.sync_all()?;
    Ok(path)
}

/// Writes a complete checkpoint for `manifest.step` under `out_dir` atomically and returns
/// its final path. `manifest.files` is filled in here. (One process; the sharded trainer
/// runs the same three steps, [`begin`], [`write_shard`] on every writing rank and
/// [`finish`] on rank 0.)
pub fn save(
    out_dir: &Path,
    manifest: Manifest,
    shards: &[ShardData],
    tokenizer_json: &Path,
) -> Result<PathBuf> {
    let tmp = begin(out_dir, manifest.step, std::process::id())?;
    let mut files = Vec::new();
    for shard in shards {
        files.push(file_entry(&write_shard(&tmp, shard)?)?);
    }
    finish(out_dir, &tmp, manifest, files, tokenizer_json)
}

/// Creates the temporary directory a checkpoint of `step` is written into (removing a stale
/// one a killed run left), named with `token` (the writer's process id) so every rank of a
/// job can compute it.
pub fn begin(out_dir: &Path, step: u64, token: u32) -> Result<PathBuf> {
    fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let tmp = tmp_dir(out_dir, step, token);
    if tmp.exists() {
        fs::remove_dir_all(&tmp)?;
    }
    fs::create_dir(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    Ok(tmp)
}

/// The temporary directory of [`begin`].
pub fn tmp_dir(out_dir: &Path, step: u64, token: u32) -> PathBuf {
    out_dir.join(format!(".tmp-{}-{token}", step_dir_name(step)))
}

/// Size and SHA-256 of a written file, for the manifest.
pub fn file_entry(path: &Path) -> Result<FileEntry> {
    Ok(FileEntry {
        path: path
            .file_name()
            .context("a file name")?
            .to_string_lossy()
            .into_owned(),
        bytes: fs::metadata(path)?.len(),
        sha256: sha256_file(path)?,
    })
}

/// Adds the tokenizer and the manifest (listing `files` and the tokenizer) to `tmp`, syncs
/// it and renames it into place as `out_dir/step-NNNNNN`.
pub fn finish(
    out_dir: &Path,
    tmp: &Path,
    mut manifest: Manifest,
    mut files: Vec<FileEntry>,
    tokenizer_json: &Path,
) -> Result<PathBuf> {
    let name = step_dir_name(manifest.step);
    let final_dir = out_dir.join(&name);
    let tok = tmp.join("tokenizer.json");
    fs::copy(tokenizer_json, &tok)
        .with_context(|| format!("copying {}", tokenizer_json.display()))?;
    File::open(&tok)?.sync_all()?;
    files.insert(0, file_entry(&tok)?);
    manifest.files = files;
    let mut f = File::create(tmp.join(MANIFEST))?;
    f.write_all(serde_json::to_string_pretty(&manifest)?.as_bytes())?;
    f.sync_all()?;
    fsync_dir(tmp)?;
    // Replacing an existing checkpoint of the same step: move it aside first, so that at
    // every instant one complete copy exists under a recognisable name.
    let old = out_dir.join(format!(".old-{name}-{}", std::process::id()));
    let had_old = final_dir.exists();
    if had_old {
        fs::rename(&final_dir, &old)?;
    }
    fs::rename(tmp, &final_dir)
        .with_context(|| format!("renaming {} into place", tmp.display()))?;
    fsync_dir(out_dir)?;
    if had_old {
        fs::remove_dir_all(&old)?;
    }
    Ok(final_dir)
}

/// Deletes all but the newest `keep` complete checkpoints of `out_dir` (`--keep-last`); call
/// it only after a new checkpoint is complete. Returns the deleted directories.
pub fn prune(out_dir: &Path, keep: usize) -> Result<Vec<PathBuf>> {
    let mut steps: Vec<(u64, PathBuf)> = Vec::new();
    for entry in fs::read_dir(out_dir)? {
        let entry = entry?;
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
    let excess = steps.len().saturating_sub(keep);
    let mut removed = Vec::new();
    for (_, dir) in steps.into_iter().take(excess) {
        fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
        removed.push(dir);
    }
    Ok(removed)
}

/// Accepts a checkpoint directory, or an out dir (then its latest complete checkpoint).
pub fn locate(path: &Path) -> Result<PathBuf> {
    if path.join(MANIFEST).is_file() {
        return Ok(path.to_path_buf());
    }
    ensure!(
        path.is_dir(),
        "{} does not exist or is not a directory; pass a checkpoint directory (step-NNNNNN) \
         or the --out-dir of a run",
        path.display()
    );
    let mut best: Option<(u64, PathBuf)> = None;
    for entry in fs::read_dir(path)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(step) = name
            .strip_prefix("step-")
            .and_then(|s| s.parse::<u64>().ok())
        else {
            continue;
        };
        if entry.path().join(MANIFEST).is_file() && best.as_ref().is_none_or(|(s, _)| step > *s) {
            best = Some((step, entry.path()));
        }
    }
    best.map(|(_, p)| p).with_context(|| {
        format!(
            "{} is not a checkpoint: it has no {MANIFEST} and no step-NNNNNN checkpoint inside",
            path.display()
        )
    })
}

/// Reads and checks `dir/manifest.json`.
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST);
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let manifest: Manifest = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a valid ember manifest", path.display()))?;
    let mut names: Vec<&str> = manifest.tensors.iter().map(|t| t.name.as_str()).collect();
    names.sort_unstable();
    ensure!(
        names.windows(2).all(|w| w[0] != w[1]),
        "{}: a tensor is listed twice",
        path.display()
    );
    manifest
        .train
        .validate()
        .map_err(|e| anyhow::anyhow!("{}: invalid configuration: {e}", path.display()))?;
    ensure!(
        manifest.format == FORMAT && manifest.version == 1,
        "{}: format {:?} version {} is not {FORMAT} version 1",
        path.display(),
        manifest.format,
        manifest.version
    );
    Ok(manifest)
}

/// Verifies every file's size and checksum against the manifest.
pub fn verify_files(dir: &Path, manifest: &Manifest) -> Result<()> {
    verify_some(dir, manifest, |_| true)
}

/// Verifies the size and checksum of the files whose position in the manifest `pick`
/// accepts (a sharded job gives each rank a share).
pub fn verify_some(dir: &Path, manifest: &Manifest, pick: impl Fn(usize) -> bool) -> Result<()> {
    for (i, entry) in manifest.files.iter().enumerate() {
        if !pick(i) {
            continue;
        }
        let path = dir.join(&entry.path);
        let len = fs::metadata(&path)
            .with_context(|| format!("checkpoint file {} is missing", path.display()))?
            .len();
        ensure!(
            len == entry.bytes,
            "{} has {len} bytes, the manifest says {}: the file is truncated or replaced",
            path.display(),
            entry.bytes
        );
        let sum = sha256_file(&path)?;
        ensure!(
            sum == entry.sha256,
            "{} fails its SHA-256 check (corrupted): expected {}, found {sum}",
            path.display(),
            entry.sha256
        );
    }
    Ok(())
}

/// Checks that `ranges` tile `[0, n)` exactly: no gap, no overlap (zero-length ranges are
/// allowed anywhere: a rank may own nothing of a small tensor).
fn check_coverage(ranges: &mut [(usize, usize)], n: usize) -> Result<(), String> {
    ranges.sort_unstable();
    let mut next = 0;
    for &(offset, len) in ranges.iter().filter(|r| r.1 > 0) {
        match offset.cmp(&next) {
            std::cmp::Ordering::Greater => {
                return Err(format!("has no data for [{next}, {offset})"));
            }
            std::cmp::Ordering::Less => return Err(format!("has overlapping data at {offset}")),
            std::cmp::Ordering::Equal => next = offset + len,
        }
    }
    if next != n {
        return Err(format!("has no data for [{next}, {n})"));
    }
    Ok(())
}

/// One range of one state of one tensor inside a shard file.
#[derive(Debug, Clone, Copy)]
struct Piece {
    /// Index into `Index::maps`.
    file: usize,
    /// First element in the flattened global tensor.
    offset: usize,
    /// Elements.
    len: usize,
    /// Byte offset of its data in the file.
    start: usize,
}

/// A checkpoint opened for reading: the manifest, every shard file's header parsed and
/// bounds-checked, and where each range of each tensor lies, checked to tile every tensor.
/// No tensor data is read until [`Index::read`] asks for a range, so a rank of a resharded
/// run reads only the bytes of the ranges it owns.
#[derive(Debug)]
pub struct Index {
    /// Its directory.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// Adam's step counter.
    pub adam_step: u64,
    maps: Vec<(PathBuf, memmap2::Mmap)>,
    pieces: HashMap<String, Vec<Piece>>,
    numel: HashMap<String, usize>,
}

impl Index {
    /// Opens `dir`: manifest, file sizes, headers, layouts and coverage. Checksums are
    /// [`verify_files`]'s job (a sharded job splits it over its ranks).
    pub fn open(dir: &Path) -> Result<Self> {
        let manifest = read_manifest(dir)?;
        let numel: HashMap<String, usize> = manifest
            .tensors
            .iter()
            .map(|t| (t.name.clone(), t.shape.iter().product()))
            .collect();
        let mut maps = Vec::new();
        let mut pieces: HashMap<String, Vec<Piece>> = HashMap::new();
        let mut adam_step = None;
        for entry in &manifest.files {
            let path = dir.join(&entry.path);
            let len = fs::metadata(&path)
                .with_context(|| format!("checkpoint file {} is missing", path.display()))?
                .len();
            ensure!(
                len == entry.bytes,
                "{} has {len} bytes, the manifest says {}: the file is truncated or replaced",
                path.display(),
                entry.bytes
            );
            if !entry.path.ends_with(".safetensors") {
                continue;
            }
            let file = File::open(&path)?;
            // SAFETY: the file is opened read-only and checkpoints are never modified in
            // place (they are written under a temporary name and renamed).
            let map = unsafe { memmap2::Mmap::map(&file)? };
            // `read_metadata` bounds-checks the header length and every tensor's offsets
            // against the file before anything is allocated.
            let (header_len, meta) = SafeTensors::read_metadata(&map)
                .map_err(|e| anyhow::anyhow!("{}: bad safetensors header: {e}", path.display()))?;
            let data_start = 8 + header_len;
            let extra = meta.metadata().clone().unwrap_or_default();
            let layout: BTreeMap<String, Range> = serde_json::from_str(
                extra
                    .get(LAYOUT_KEY)
                    .with_context(|| format!("{}: no {LAYOUT_KEY} metadata", path.display()))?,
            )
            .with_context(|| format!("{}: bad {LAYOUT_KEY}", path.display()))?;
            let step: u64 = extra
                .get("ember.adam_step")
                .and_then(|s| s.parse().ok())
                .with_context(|| format!("{}: no ember.adam_step metadata", path.display()))?;
            ensure!(
                *adam_step.get_or_insert(step) == step,
                "{}: its Adam step {step} differs from the other shards'",
                path.display()
            );
            let file_index = maps.len();
            for (key, info) in meta.tensors() {
                let range = layout.get(&key).with_context(|| {
                    format!("{}: tensor {key} has no layout entry", path.display())
                })?;
                let (kind, name) = key
                    .split_once('/')
                    .with_context(|| format!("{}: unexpected tensor name {key}", path.display()))?;
                ensure!(
                    KINDS.contains(&kind),
                    "{}: unknown state kind in {key}",
                    path.display()
                );
                ensure!(
                    info.dtype == StDtype::F32 && info.shape.len() == 1,
                    "{}: {key} is {:?} of shape {:?}, expected flat F32",
                    path.display(),
                    info.dtype,
                    info.shape
                );
                let total = *numel.get(name).with_context(|| {
                    format!(
                        "{}: {name} is not a parameter of this model",
                        path.display()
                    )
                })?;
                let n = info.shape[0];
                ensure!(
                    range.global_numel == total
                        && range.offset.checked_add(n).is_some_and(|end| end <= total),
                    "{}: {key} covers [{}, {}) of {} elements, but the manifest's shape has \
                     {total}",
                    path.display(),
                    range.offset,
                    range.offset.saturating_add(n),
                    range.global_numel
                );
                pieces.entry(key.clone()).or_default().push(Piece {
                    file: file_index,
                    offset: range.offset,
                    len: n,
                    start: data_start + info.data_offsets.0,
                });
            }
            maps.push((path, map));
        }
        for t in &manifest.tensors {
            let n = numel[&t.name];
            for kind in KINDS {
                let key = format!("{kind}/{}", t.name);
                let mut ranges: Vec<(usize, usize)> = pieces
                    .get(&key)
                    .map(|p| p.iter().map(|p| (p.offset, p.len)).collect())
                    .unwrap_or_default();
                check_coverage(&mut ranges, n).map_err(|what| {
                    anyhow::anyhow!(
                        "{}: {key} {what}; a rank's file is missing or inconsistent",
                        dir.display()
                    )
                })?;
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            adam_step: adam_step.context("checkpoint has no shard files")?,
            manifest,
            maps,
            pieces,
            numel,
        })
    }

    /// Elements `range` of state `kind` (`param`, `exp_avg`, `exp_avg_sq`) of tensor `name`,
    /// copied from the pieces that overlap it (only those bytes are read).
    pub fn read(&self, kind: &str, name: &str, range: std::ops::Range<usize>) -> Result<Vec<f32>> {
        let n = *self
            .numel
            .get(name)
            .with_context(|| format!("{}: no tensor {name}", self.dir.display()))?;
        ensure!(
            range.end <= n,
            "{}: {name} has {n} elements, [{}, {}) asked",
            self.dir.display(),
            range.start,
            range.end
        );
        let mut out = vec![0.0f32; range.len()];
        for p in self
            .pieces
            .get(&format!("{kind}/{name}"))
            .into_iter()
            .flatten()
        {
            let lo = p.offset.max(range.start);
            let hi = (p.offset + p.len).min(range.end);
            if lo >= hi {
                continue;
            }
            let bytes =
                &self.maps[p.file].1[p.start + 4 * (lo - p.offset)..p.start + 4 * (hi - p.offset)];
            for (d, c) in out[lo - range.start..hi - range.start]
                .iter_mut()
                .zip(bytes.chunks_exact(4))
            {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Ok(out)
    }
}

/// Reads a checkpoint whole: manifest, checksums, every tensor assembled from its ranges.
/// Nothing is returned unless every check passes.
pub fn load(dir: &Path) -> Result<Loaded> {
    let index = Index::open(dir)?;
    verify_files(dir, &index.manifest)?;
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
        dir: dir.to_path_buf(),
        adam_step: index.adam_step,
        manifest: index.manifest.clone(),
        tensors,
    })
}

/// A checkpoint's master weights as the source a sharded model reads its own ranges from.
#[derive(Debug)]
pub struct Params<'a>(pub &'a Index);

impl ember_sharding::ParamSource for Params<'_> {
    fn read(
        &mut self,
        name: &str,
        _shape: &[usize],
        range: std::ops::Range<usize>,
    ) -> std::result::Result<Vec<f32>, ember_sharding::ShardError> {
        self.0
            .read("param", name, range)
            .map_err(|e| ember_sharding::ShardError::Source(format!("{e:#}")))
    }

    fn fingerprint(&self) -> u64 {
        // Every rank opened the same checkpoint: the checksums of its files.
        self.0
            .manifest
            .files
            .iter()
            .flat_map(|f| f.sha256.bytes())
            .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
            })
    }
}
