//! Writing checkpoints: a streaming safetensors writer (header first, then each tensor's
//! values as they are produced, hashed on the way, so nothing is held twice), the temporary
//! directory protocol (create, fill, manifest, fsync, rename), and the collective save of a
//! sharded model in which every rank writes only what it owns. The model is read through
//! [`ShardView`], all a checkpoint needs of it: the engine implements it for its
//! `ShardedModel`, and nothing here reaches into the step.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{
    ADAM_STEP_KEY, FileEntry, LAYOUT_KEY, MANIFEST, Manifest, RESIDUALS_KEY, Range, STATE_KEY,
    TensorMeta, io, prune, residual_file_name, shard_file_name, step_dir_name,
};
use burn::tensor::Tensor;
use ember_comm::Comm;

use crate::error::ShardError;
use crate::plan::Plan;
use crate::transport::route::agree;
use crate::transport::staging;

/// One parameter range of a rank's optimizer shard, as its file stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// The parameter's path.
    pub name: String,
    /// First element of the range, in the flattened parameter.
    pub offset: usize,
    /// Elements in the range.
    pub len: usize,
    /// Elements of the whole parameter.
    pub global_numel: usize,
}

/// What a checkpoint reads of a sharded model on one rank, and all it reads
/// (`ShardedModel` implements it).
pub trait ShardView {
    /// The job's communicator.
    fn comm(&self) -> &Comm;
    /// The partition the model runs.
    fn plan(&self) -> &Plan;
    /// Optimizer updates applied so far.
    fn updates(&self) -> u64;
    /// Whether this rank writes its optimizer shard (the first of the ranks holding it).
    fn is_writer(&self) -> bool;
    /// The optimizer's state names besides the master weights, in their stored order.
    fn state_names(&self) -> &[String];
    /// The parameter ranges of this rank's optimizer shard, in the order they are stored.
    fn pieces(&self) -> Vec<Piece>;
    /// For each of [`pieces`](Self::pieces) in turn: its master weights, then each optimizer
    /// state, copied to the host one at a time.
    /// Each is the device's failure where reading it back failed.
    fn piece_values(&self) -> Box<dyn Iterator<Item = Result<Vec<f32>, ShardError>> + '_>;
    /// This rank's error-feedback residuals as `(unit, hop, values)`.
    fn residual_tensors(&self) -> Vec<(usize, usize, Tensor<1>)>;
    /// The layout the residuals belong to (JSON), checked when they are read back.
    fn residual_layout(&self) -> String;
    /// The seed of the device's generator the model's units draw from, kept in the manifest.
    fn generator_seed(&self) -> Option<u64> {
        None
    }
}

/// Element type of a tensor in a written file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileDtype {
    /// 4 bytes, exact.
    F32,
    /// 2 bytes, rounded to nearest even.
    Bf16,
}

impl FileDtype {
    fn name(self) -> &'static str {
        match self {
            FileDtype::F32 => "F32",
            FileDtype::Bf16 => "BF16",
        }
    }

    fn size(self) -> usize {
        match self {
            FileDtype::F32 => 4,
            FileDtype::Bf16 => 2,
        }
    }
}

/// A safetensors file written as a stream: [`ShardWriter::create`] writes the header from the
/// tensors' names and shapes, [`ShardWriter::write`] appends each tensor's values in that
/// order, [`ShardWriter::finish`] syncs it and returns its size and SHA-256.
#[derive(Debug)]
pub struct ShardWriter {
    path: PathBuf,
    file: BufWriter<File>,
    hasher: Sha256,
    bytes: u64,
    dtype: FileDtype,
    tensors: Vec<(String, usize)>,
    next: usize,
}

impl ShardWriter {
    /// Creates `path` with a header for `tensors` (name, shape) in `dtype`, in that order, and
    /// `metadata`.
    pub fn create(
        path: &Path,
        metadata: &BTreeMap<String, String>,
        tensors: &[(String, Vec<usize>)],
        dtype: FileDtype,
    ) -> Result<Self, ShardError> {
        let mut header = serde_json::Map::new();
        if !metadata.is_empty() {
            header.insert(
                "__metadata__".into(),
                serde_json::to_value(metadata).expect("strings"),
            );
        }
        let mut offset = 0usize;
        for (name, shape) in tensors {
            let n: usize = shape.iter().product();
            let end = offset + n * dtype.size();
            header.insert(
                name.clone(),
                serde_json::json!({"dtype": dtype.name(), "shape": shape, "data_offsets": [offset, end]}),
            );
            offset = end;
        }
        let mut text = serde_json::to_string(&header).expect("a JSON object");
        // The header is padded with spaces to 8 bytes, as the safetensors crate writes it.
        while !text.len().is_multiple_of(8) {
            text.push(' ');
        }
        let file = File::create(path).map_err(|e| io(path, "creating", e))?;
        let mut w = Self {
            path: path.to_path_buf(),
            file: BufWriter::with_capacity(1 << 20, file),
            hasher: Sha256::new(),
            bytes: 0,
            dtype,
            tensors: tensors
                .iter()
                .map(|(n, s)| (n.clone(), s.iter().product()))
                .collect(),
            next: 0,
        };
        w.put(&(text.len() as u64).to_le_bytes())?;
        w.put(text.as_bytes())?;
        Ok(w)
    }

    fn put(&mut self, bytes: &[u8]) -> Result<(), ShardError> {
        self.hasher.update(bytes);
        self.bytes += bytes.len() as u64;
        self.file
            .write_all(bytes)
            .map_err(|e| io(&self.path, "writing", e))
    }

    /// Appends the values of the next tensor (as many as its shape holds).
    pub fn write(&mut self, values: &[f32]) -> Result<(), ShardError> {
        let Some((name, n)) = self.tensors.get(self.next).cloned() else {
            return Err(ShardError::Io(format!(
                "{}: more tensors written than its header lists",
                self.path.display()
            )));
        };
        if values.len() != n {
            return Err(ShardError::Io(format!(
                "{}: {name} has {n} elements, {} given",
                self.path.display(),
                values.len()
            )));
        }
        self.next += 1;
        if self.dtype == FileDtype::F32 && cfg!(target_endian = "little") {
            // The file's bytes are the values' own: no copy.
            // SAFETY: `values` is `len * 4` initialised bytes, which any u8 may read.
            let bytes = unsafe {
                std::slice::from_raw_parts(
                    values.as_ptr().cast::<u8>(),
                    std::mem::size_of_val(values),
                )
            };
            return self.put(bytes);
        }
        let mut buf = Vec::with_capacity(values.len() * self.dtype.size());
        match self.dtype {
            FileDtype::F32 => values.iter().for_each(|x| buf.extend(x.to_le_bytes())),
            FileDtype::Bf16 => values
                .iter()
                .for_each(|&x| buf.extend(ember_comm::Bf16::from_f32(x).0.to_le_bytes())),
        }
        self.put(&buf)
    }

    /// Completes the file (every tensor written), syncs it, and returns its entry.
    pub fn finish(mut self) -> Result<FileEntry, ShardError> {
        if self.next != self.tensors.len() {
            return Err(ShardError::Io(format!(
                "{}: {} of {} tensors written",
                self.path.display(),
                self.next,
                self.tensors.len()
            )));
        }
        self.file
            .flush()
            .map_err(|e| io(&self.path, "writing", e))?;
        let file = self
            .file
            .into_inner()
            .map_err(|e| io(&self.path, "writing", e.error()))?;
        file.sync_all().map_err(|e| io(&self.path, "syncing", e))?;
        Ok(FileEntry {
            path: self
                .path
                .file_name()
                .expect("a file name")
                .to_string_lossy()
                .into_owned(),
            bytes: self.bytes,
            sha256: format!("{:x}", self.hasher.finalize()),
        })
    }
}

/// The temporary directory a checkpoint of `step` is written into, named with `token` (the
/// process id of rank 0) so every rank of a job can compute it.
pub(crate) fn tmp_dir(out_dir: &Path, step: u64, token: u32) -> PathBuf {
    out_dir.join(format!(".tmp-{}-{token}", step_dir_name(step)))
}

/// Creates the temporary directory of [`tmp_dir`] (removing a stale one a killed run left).
pub(crate) fn begin(out_dir: &Path, step: u64, token: u32) -> Result<PathBuf, ShardError> {
    fs::create_dir_all(out_dir).map_err(|e| io(out_dir, "creating", e))?;
    let tmp = tmp_dir(out_dir, step, token);
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| io(&tmp, "removing", e))?;
    }
    fs::create_dir(&tmp).map_err(|e| io(&tmp, "creating", e))?;
    Ok(tmp)
}

fn fsync_dir(dir: &Path) -> Result<(), ShardError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io(dir, "syncing", e))
}

/// Copies `copies` into `tmp`, writes the manifest (listing them and `files`), syncs it and
/// renames it into place as `out_dir/step-NNNNNN`. A checkpoint of the same step that exists
/// is moved aside first, so at every instant one complete copy exists.
pub(crate) fn complete(
    out_dir: &Path,
    tmp: &Path,
    mut manifest: Manifest,
    mut files: Vec<FileEntry>,
    copies: &[PathBuf],
) -> Result<PathBuf, ShardError> {
    let name = step_dir_name(manifest.step);
    let final_dir = out_dir.join(&name);
    for (i, src) in copies.iter().enumerate() {
        let file_name = src
            .file_name()
            .ok_or_else(|| ShardError::Io(format!("{} names no file to copy", src.display())))?;
        let dst = tmp.join(file_name);
        fs::copy(src, &dst).map_err(|e| io(src, "copying", e))?;
        File::open(&dst)
            .and_then(|f| f.sync_all())
            .map_err(|e| io(&dst, "syncing", e))?;
        files.insert(
            i,
            FileEntry {
                path: file_name.to_string_lossy().into_owned(),
                bytes: fs::metadata(&dst)
                    .map_err(|e| io(&dst, "reading", e))?
                    .len(),
                sha256: super::sha256_file(&dst)?,
            },
        );
    }
    manifest.files = files;
    let path = tmp.join(MANIFEST);
    let text = serde_json::to_string_pretty(&manifest).expect("a manifest serialises");
    File::create(&path)
        .and_then(|mut f| {
            f.write_all(text.as_bytes())?;
            f.sync_all()
        })
        .map_err(|e| io(&path, "writing", e))?;
    fsync_dir(tmp)?;
    let old = out_dir.join(format!(".old-{name}-{}", std::process::id()));
    let had_old = final_dir.exists();
    if had_old {
        fs::rename(&final_dir, &old).map_err(|e| io(&final_dir, "moving aside", e))?;
    }
    fs::rename(tmp, &final_dir).map_err(|e| io(tmp, "renaming into place", e))?;
    fsync_dir(out_dir)?;
    if had_old {
        fs::remove_dir_all(&old).map_err(|e| io(&old, "removing", e))?;
    }
    Ok(final_dir)
}

/// How [`save`] completes a checkpoint.
#[derive(Debug, Clone, Default)]
pub struct SaveOptions {
    /// The application's record for the manifest (ember: its configuration, data position,
    /// RNG scheme, tokenizer checksum).
    pub app: serde_json::Map<String, serde_json::Value>,
    /// Files copied into the checkpoint and checksummed (ember: its tokenizer).
    pub files: Vec<PathBuf>,
    /// Keep only the newest this many complete checkpoints in the directory, deleting older
    /// ones once the new one is complete (0 keeps all).
    pub keep_last: usize,
}

impl SaveOptions {
    /// Options holding `record`, the caller's own metadata (a struct that serialises to a JSON
    /// object), kept in the manifest beside the checkpoint's fields; read it back with
    /// [`Manifest::app_record`](super::Manifest::app_record).
    pub fn record<T: serde::Serialize>(record: &T) -> Result<Self, ShardError> {
        match serde_json::to_value(record) {
            Ok(serde_json::Value::Object(app)) => Ok(Self {
                app,
                ..Self::default()
            }),
            Ok(other) => Err(ShardError::Io(format!(
                "a checkpoint's record must serialise to a JSON object, not {other}"
            ))),
            Err(e) => Err(ShardError::Io(format!(
                "serialising the checkpoint's record: {e}"
            ))),
        }
    }
}

/// Writes a checkpoint of `sharded` at `step` into `out_dir/step-NNNNNN`: every writing rank
/// its own optimizer shard, every rank its error-feedback residuals (if any), rank 0 the
/// copied files and the manifest, then the directory is renamed into place. Every rank must
/// call it. Nothing is gathered: each rank streams its ranges from the device one parameter
/// at a time. A failure on any rank fails every rank and leaves earlier checkpoints untouched.
pub fn save(
    sharded: &dyn ShardView,
    out_dir: &Path,
    step: u64,
    options: &SaveOptions,
) -> Result<PathBuf, ShardError> {
    let comm = sharded.comm();
    let job = SaveJob::begin(sharded, out_dir, step, options)?;
    let files = RankFiles::of(sharded, &job.tmp);
    // Streamed from the model, one range at a time.
    let mut values = sharded.piece_values();
    let mut residuals = sharded
        .residual_tensors()
        .into_iter()
        .map(|(_, _, t)| staging::to_f32(t));
    let written = files.write(&mut || values.next(), &mut || residuals.next());
    agree(comm, written).map_err(|e| job.discard(comm.rank(), e))?;
    let finished = job.finish(Ok(()));
    agree(comm, finished).map_err(|e| job.discard(comm.rank(), e))
}

/// Starts a checkpoint of `sharded` at `step` that is written in the background: every rank
/// copies its optimizer shard and residuals to host memory now (the only part training waits
/// for), then a thread of its own writes its files while training goes on, and rank 0's
/// thread completes the checkpoint (manifest last, then the rename) once every rank's files
/// are on disk. Until then the previous checkpoint stays the newest complete one. Every rank
/// must call it, and later [`PendingSave::wait`] together (before the next save, and before
/// the end of the job).
pub fn save_async(
    sharded: &dyn ShardView,
    out_dir: &Path,
    step: u64,
    options: &SaveOptions,
) -> Result<PendingSave, ShardError> {
    let start = std::time::Instant::now();
    let job = SaveJob::begin(sharded, out_dir, step, options)?;
    let files = RankFiles::of(sharded, &job.tmp);
    // A read the device fails goes to the writer as it is: its file is not written and this
    // rank's record says why, so rank 0 fails the checkpoint as for any other rank's error.
    let values: Vec<Result<Vec<f32>, ShardError>> = sharded.piece_values().collect();
    let residuals: Vec<Result<Vec<f32>, ShardError>> = sharded
        .residual_tensors()
        .into_iter()
        .map(|(_, _, t)| staging::to_f32(t))
        .collect();
    let staged_bytes = 4 * values
        .iter()
        .chain(&residuals)
        .flatten()
        .map(Vec::len)
        .sum::<usize>() as u64;
    let blocked_s = start.elapsed().as_secs_f64();
    let dir = out_dir.join(step_dir_name(step));
    let rank = sharded.comm().rank();
    let handle = std::thread::Builder::new()
        .name(format!("ember-save-{step}"))
        .spawn(move || {
            // Training comes first: the writer takes what the step leaves of the cores.
            // SAFETY: setpriority on this thread's own id (Linux threads have their own
            // nice value); a refusal only leaves the priority as it was.
            #[cfg(target_os = "linux")]
            unsafe {
                libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 19);
            }
            let mut values = values.into_iter();
            let mut residuals = residuals.into_iter();
            let written = files.write(&mut || values.next(), &mut || residuals.next());
            let finished = job.finish(written);
            finished.map_err(|e| job.discard(rank, e))
        })
        .map_err(|e| ShardError::Io(format!("starting the checkpoint writer: {e}")))?;
    Ok(PendingSave {
        step,
        dir,
        handle,
        staged_bytes,
        blocked_s,
    })
}

/// A checkpoint being written in the background ([`save_async`]).
#[derive(Debug)]
#[must_use = "a checkpoint being written must be waited for before the next save and the end"]
pub struct PendingSave {
    step: u64,
    dir: PathBuf,
    handle: std::thread::JoinHandle<Result<PathBuf, ShardError>>,
    staged_bytes: u64,
    blocked_s: f64,
}

impl PendingSave {
    /// The step it saves.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The directory it becomes once complete.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Seconds the caller was held: agreeing on the temporary directory and copying this
    /// rank's state to host memory.
    pub fn blocked_s(&self) -> f64 {
        self.blocked_s
    }

    /// Bytes of this rank's state copied to host memory for the writer.
    pub fn staged_bytes(&self) -> u64 {
        self.staged_bytes
    }

    /// Whether this rank's writer is done (rank 0's once the checkpoint is complete).
    pub fn is_written(&self) -> bool {
        self.handle.is_finished()
    }

    /// Waits for the writer, then agrees with every rank on the outcome: the directory of the
    /// complete checkpoint, or the first rank's error (and no partial directory is left).
    /// Every rank must call it together.
    pub fn wait(self, comm: &ember_comm::Comm) -> Result<PathBuf, ShardError> {
        let done = self.handle.join().unwrap_or_else(|_| {
            Err(ShardError::Io(format!(
                "the writer of the checkpoint of step {} panicked",
                self.step
            )))
        });
        agree(comm, done)
    }
}

/// One checkpoint being written: its temporary directory (agreed by every rank), and what
/// rank 0 needs to complete it.
struct SaveJob {
    step: u64,
    out_dir: PathBuf,
    tmp: PathBuf,
    world: usize,
    /// Rank 0's manifest (its files filled in at completion) and files to copy in.
    manifest: Option<(Manifest, SaveOptions)>,
}

impl SaveJob {
    /// Agrees on the temporary directory (named after rank 0's process id) and creates it.
    fn begin(
        sharded: &dyn ShardView,
        out_dir: &Path,
        step: u64,
        options: &SaveOptions,
    ) -> Result<Self, ShardError> {
        let comm = sharded.comm();
        let rank = comm.rank();
        let mut token = std::process::id().to_le_bytes();
        comm.world().broadcast(&mut token, 0)?;
        let token = u32::from_le_bytes(token);
        let begun = if rank == 0 {
            begin(out_dir, step, token).map(|_| ())
        } else {
            Ok(())
        };
        agree(comm, begun)?;
        let plan = sharded.plan();
        let manifest = (rank == 0).then(|| {
            let tensors = plan
                .units
                .iter()
                .flat_map(|u| u.params.iter())
                .map(|p| TensorMeta {
                    name: p.name.clone(),
                    shape: p.shape.clone(),
                })
                .collect();
            let manifest = Manifest {
                shard: Some(plan.config.clone()),
                topology: Some(plan.topology.to_string()),
                generator_seed: sharded.generator_seed(),
                app: options.app.clone(),
                ..Manifest::new(step, plan.topology.world_size(), tensors)
            };
            (manifest, options.clone())
        });
        Ok(Self {
            step,
            out_dir: out_dir.to_path_buf(),
            tmp: tmp_dir(out_dir, step, token),
            world: plan.topology.world_size(),
            manifest,
        })
    }

    /// Rank 0: waits for every rank's record of its files, then writes the manifest and
    /// renames the directory into place; other ranks: the directory it will have. `written`
    /// is this rank's own outcome (already in its record).
    fn finish(&self, written: Result<(), ShardError>) -> Result<PathBuf, ShardError> {
        written?;
        let Some((manifest, options)) = &self.manifest else {
            return Ok(self.out_dir.join(step_dir_name(self.step)));
        };
        let mut files = Vec::new();
        for r in 0..self.world {
            files.extend(await_record(&self.tmp, r)?);
        }
        let dir = complete(
            &self.out_dir,
            &self.tmp,
            manifest.clone(),
            files,
            &options.files,
        )?;
        if options.keep_last > 0 {
            prune(&self.out_dir, options.keep_last)?;
        }
        Ok(dir)
    }

    /// `e`, after rank 0 removed the temporary directory: a failed save leaves nothing.
    fn discard(&self, rank: usize, e: ShardError) -> ShardError {
        if rank == 0 {
            let _ = fs::remove_dir_all(&self.tmp);
        }
        e
    }
}

/// What one rank writes into a checkpoint: the file of its optimizer shard (writing ranks
/// only) and that of its error-feedback residuals (when it holds any), each with its header.
struct RankFiles {
    rank: usize,
    tmp: PathBuf,
    shard: Option<FileHeader>,
    residuals: Option<FileHeader>,
}

/// A safetensors file's path, metadata and tensors, before its values.
struct FileHeader {
    path: PathBuf,
    metadata: BTreeMap<String, String>,
    tensors: Vec<(String, Vec<usize>)>,
}

impl RankFiles {
    fn of(sharded: &dyn ShardView, tmp: &Path) -> Self {
        let rank = sharded.comm().rank();
        let shard = sharded.is_writer().then(|| {
            let pieces = sharded.pieces();
            let mut layout = BTreeMap::new();
            let kinds: Vec<&str> = std::iter::once("param")
                .chain(sharded.state_names().iter().map(String::as_str))
                .collect();
            let mut tensors = Vec::with_capacity(kinds.len() * pieces.len());
            for p in &pieces {
                for kind in &kinds {
                    let key = format!("{kind}/{}", p.name);
                    layout.insert(
                        key.clone(),
                        Range {
                            offset: p.offset,
                            global_numel: p.global_numel,
                        },
                    );
                    tensors.push((key, vec![p.len]));
                }
            }
            let metadata = BTreeMap::from([
                (
                    LAYOUT_KEY.to_string(),
                    serde_json::to_string(&layout).expect("ranges serialise"),
                ),
                (ADAM_STEP_KEY.to_string(), sharded.updates().to_string()),
                (
                    STATE_KEY.to_string(),
                    serde_json::to_string(sharded.state_names()).expect("names serialise"),
                ),
            ]);
            FileHeader {
                path: tmp.join(shard_file_name(rank)),
                metadata,
                tensors,
            }
        });
        let residuals = sharded.residual_tensors();
        let residuals = (!residuals.is_empty()).then(|| FileHeader {
            path: tmp.join(residual_file_name(rank)),
            metadata: BTreeMap::from([(RESIDUALS_KEY.to_string(), sharded.residual_layout())]),
            tensors: residuals
                .iter()
                .map(|(unit, hop, t)| (format!("{unit}/{hop}"), vec![t.dims()[0]]))
                .collect(),
        });
        Self {
            rank,
            tmp: tmp.to_path_buf(),
            shard,
            residuals,
        }
    }

    /// Writes both files, taking their tensors' values in header order from `shard` and
    /// `residuals` (a writing rank's shard file holds the master weights, then each optimizer
    /// state, of every range), then this rank's record of them (or of its error) for rank 0.
    fn write(
        &self,
        shard: &mut dyn FnMut() -> Option<Result<Vec<f32>, ShardError>>,
        residuals: &mut dyn FnMut() -> Option<Result<Vec<f32>, ShardError>>,
    ) -> Result<(), ShardError> {
        let written = (|| -> Result<Record, ShardError> {
            if !self.tmp.is_dir() {
                return Err(ShardError::Io(format!(
                    "{}: rank 0 created this checkpoint directory but rank {} does not see it; \
                     every rank must save into one directory they share (a shared filesystem \
                     for --out-dir)",
                    self.tmp.display(),
                    self.rank
                )));
            }
            Ok(Record {
                shard: self.shard.as_ref().map(|h| h.write(shard)).transpose()?,
                residuals: self
                    .residuals
                    .as_ref()
                    .map(|h| h.write(residuals))
                    .transpose()?,
                error: None,
            })
        })();
        let record = match &written {
            Ok(r) => r.clone(),
            Err(e) => Record {
                shard: None,
                residuals: None,
                error: Some(e.to_string()),
            },
        };
        // This rank's own error says more than a record that could not be written after it.
        let recorded = write_record(&self.tmp, self.rank, &record);
        written?;
        recorded
    }
}

impl FileHeader {
    fn write(
        &self,
        next: &mut dyn FnMut() -> Option<Result<Vec<f32>, ShardError>>,
    ) -> Result<FileEntry, ShardError> {
        let mut w = ShardWriter::create(&self.path, &self.metadata, &self.tensors, FileDtype::F32)?;
        for _ in &self.tensors {
            let values = next().ok_or_else(|| {
                ShardError::Io(format!(
                    "{}: fewer values than tensors",
                    self.path.display()
                ))
            })??;
            w.write(&values)?;
        }
        w.finish()
    }
}

/// One rank's files as written, or why they were not: what rank 0 waits for before it
/// completes a checkpoint (`.rank-RRRRR.json` in the temporary directory, not part of the
/// checkpoint's file list).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    shard: Option<FileEntry>,
    residuals: Option<FileEntry>,
    error: Option<String>,
}

fn record_path(tmp: &Path, rank: usize) -> PathBuf {
    tmp.join(format!(".rank-{rank:05}.json"))
}

/// Writes `record` for `rank` whole, or not at all (a temporary name, synced, then renamed).
fn write_record(tmp: &Path, rank: usize, record: &Record) -> Result<(), ShardError> {
    let path = record_path(tmp, rank);
    let partial = path.with_extension("partial");
    let text = serde_json::to_string(record).expect("a record serialises");
    File::create(&partial)
        .and_then(|mut f| {
            f.write_all(text.as_bytes())?;
            f.sync_all()
        })
        .map_err(|e| io(&partial, "writing", e))?;
    fs::rename(&partial, &path).map_err(|e| io(&path, "renaming into place", e))
}

/// Waits for `rank`'s record (polling: the ranks share the directory, not a thread), then
/// returns its files in the manifest's order, or its error. The record is removed once read.
fn await_record(tmp: &Path, rank: usize) -> Result<Vec<FileEntry>, ShardError> {
    let path = record_path(tmp, rank);
    let text = loop {
        match fs::read_to_string(&path) {
            Ok(text) => break text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Err(e) => return Err(io(&path, "reading", e)),
        }
    };
    let record: Record = serde_json::from_str(&text)
        .map_err(|e| ShardError::Io(format!("{}: {e}", path.display())))?;
    if let Some(e) = record.error {
        return Err(ShardError::OtherRank { rank, message: e });
    }
    fs::remove_file(&path).map_err(|e| io(&path, "removing", e))?;
    Ok(record.shard.into_iter().chain(record.residuals).collect())
}
