//! Writing checkpoints: a streaming safetensors writer (header first, then each tensor's
//! values as they are produced, hashed on the way, so nothing is held twice), the temporary
//! directory protocol (create, fill, manifest, fsync, rename), and the collective save of a
//! [`ShardedModel`] in which every rank writes only what it owns.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::{
    ADAM_STEP_KEY, FileEntry, LAYOUT_KEY, MANIFEST, Manifest, RESIDUALS_KEY, Range, STATE_KEY,
    TensorMeta, io, prune, residual_file_name, shard_file_name, step_dir_name,
};
use crate::engine::{ShardedModel, agree};
use crate::error::ShardError;
use crate::stage::Staged;

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
pub fn save<S: Staged<D>, const D: usize>(
    sharded: &ShardedModel<'_, S, D>,
    out_dir: &Path,
    step: u64,
    options: &SaveOptions,
) -> Result<PathBuf, ShardError> {
    let comm = sharded.comm();
    let rank = comm.rank();
    // Every rank names the temporary directory after rank 0's process id.
    let mut token = std::process::id().to_le_bytes();
    comm.world().broadcast(&mut token, 0)?;
    let tmp = tmp_dir(out_dir, step, u32::from_le_bytes(token));
    let begun = if rank == 0 {
        begin(out_dir, step, u32::from_le_bytes(token)).map(|_| ())
    } else {
        Ok(())
    };
    agree(comm, begun)?;
    let written = (|| -> Result<[Option<FileEntry>; 2], ShardError> {
        let shard = if sharded.is_writer() {
            Some(write_shard(sharded, &tmp.join(shard_file_name(rank)))?)
        } else {
            None
        };
        let residuals = write_residuals(sharded, &tmp.join(residual_file_name(rank)))?;
        Ok([shard, residuals])
    })();
    // Once every rank is past its writes, a failed save leaves no partial directory behind.
    let discard = |e: ShardError| {
        if rank == 0 {
            let _ = fs::remove_dir_all(&tmp);
        }
        e
    };
    let written = agree(comm, written).map_err(discard)?;
    // Two fixed-size records per rank to rank 0: (present, size, SHA-256).
    const RECORD: usize = 1 + 8 + 64;
    let mut records = [0u8; 2 * RECORD];
    for (slot, entry) in written.iter().enumerate() {
        if let Some(e) = entry {
            let r = &mut records[slot * RECORD..(slot + 1) * RECORD];
            r[0] = 1;
            r[1..9].copy_from_slice(&e.bytes.to_le_bytes());
            r[9..].copy_from_slice(e.sha256.as_bytes());
        }
    }
    let all = comm.world().all_gather(&records)?;
    let finished = if rank == 0 {
        let mut files = Vec::new();
        for (r, pair) in all.chunks_exact(2 * RECORD).enumerate() {
            for (slot, rec) in pair.chunks_exact(RECORD).enumerate() {
                if rec[0] == 1 {
                    files.push(FileEntry {
                        path: if slot == 0 {
                            shard_file_name(r)
                        } else {
                            residual_file_name(r)
                        },
                        bytes: u64::from_le_bytes(rec[1..9].try_into().expect("8 bytes")),
                        sha256: String::from_utf8_lossy(&rec[9..]).into_owned(),
                    });
                }
            }
        }
        let plan = sharded.plan();
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
            app: options.app.clone(),
            ..Manifest::new(step, plan.topology.world_size(), tensors)
        };
        complete(out_dir, &tmp, manifest, files, &options.files).and_then(|dir| {
            if options.keep_last > 0 {
                prune(out_dir, options.keep_last)?;
            }
            Ok(dir)
        })
    } else {
        Ok(out_dir.join(step_dir_name(step)))
    };
    agree(comm, finished).map_err(discard)
}

/// This rank's optimizer-shard file: `param` and each optimizer state of every range it
/// owns, streamed one range at a time.
fn write_shard<S: Staged<D>, const D: usize>(
    sharded: &ShardedModel<'_, S, D>,
    path: &Path,
) -> Result<FileEntry, ShardError> {
    let pieces = sharded.owned_pieces();
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
        (ADAM_STEP_KEY.to_string(), sharded.step().to_string()),
        (
            STATE_KEY.to_string(),
            serde_json::to_string(sharded.state_names()).expect("names serialise"),
        ),
    ]);
    let mut w = ShardWriter::create(path, &metadata, &tensors, FileDtype::F32)?;
    for p in &pieces {
        for values in sharded.read_piece(p) {
            w.write(&values)?;
        }
    }
    w.finish()
}

/// This rank's error-feedback residuals (`None` when it holds none), with the layout they
/// belong to.
fn write_residuals<S: Staged<D>, const D: usize>(
    sharded: &ShardedModel<'_, S, D>,
    path: &Path,
) -> Result<Option<FileEntry>, ShardError> {
    let residuals = sharded.residual_tensors();
    if residuals.is_empty() {
        return Ok(None);
    }
    let tensors: Vec<(String, Vec<usize>)> = residuals
        .iter()
        .map(|(unit, hop, t)| (format!("{unit}/{hop}"), vec![t.dims()[0]]))
        .collect();
    let metadata = BTreeMap::from([(RESIDUALS_KEY.to_string(), sharded.residual_layout())]);
    let mut w = ShardWriter::create(path, &metadata, &tensors, FileDtype::F32)?;
    for (_, _, t) in residuals {
        w.write(&crate::staging::to_f32(t))?;
    }
    w.finish().map(Some)
}
