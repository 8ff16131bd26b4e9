//! Reading checkpoints: [`Index`] opens one by its headers alone and reads any element range
//! of any state on demand (only those bytes); [`Checkpoint`] is an index that every rank of a
//! job opened and verified together, the source a [`ShardedModel`] resumes from.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use ember_comm::Comm;
use safetensors::SafeTensors;
use safetensors::tensor::Dtype as StDtype;

use super::{
    ADAM_STEP_KEY, LAYOUT_KEY, Manifest, RESIDUALS_KEY, Range, STATE_KEY, io, locate,
    read_manifest, residual_file_name, sha256_file,
};
use crate::error::ShardError;
use crate::source::ParamSource;
use crate::transport::route::agree;

/// A rank's stored error-feedback residuals: the layout JSON they were written for, and the
/// values by (unit, hop).
pub type StoredResiduals = (String, BTreeMap<(usize, usize), Vec<f32>>);

/// One range of one state of one tensor inside a rank file.
#[derive(Debug, Clone, Copy)]
struct Piece {
    /// Index into `Index::files`.
    file: usize,
    /// First element, in the flattened global tensor.
    offset: usize,
    /// Elements.
    len: usize,
    /// Byte offset of its data in the file.
    start: usize,
}

/// A checkpoint opened for reading: the manifest, every rank file's header parsed and
/// bounds-checked, and where each range of each tensor lies, checked to tile every tensor
/// exactly (no gap, no overlap). No tensor data is read until [`Index::read`] asks for a
/// range, so a rank of a resharded job reads only the bytes of the ranges it owns. Checksums
/// are [`Index::verify`]'s job (a job splits it over its ranks).
#[derive(Debug)]
pub struct Index {
    /// Its directory.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// Optimizer updates applied.
    pub updates: u64,
    /// The optimizer states held besides `param`, in the optimizer's order.
    kinds: Vec<String>,
    files: Vec<(PathBuf, File)>,
    pieces: HashMap<String, Vec<Piece>>,
    numel: HashMap<String, usize>,
}

fn map_file(path: &Path, expect: u64) -> Result<memmap2::Mmap, ShardError> {
    let len = fs::metadata(path)
        .map_err(|e| {
            ShardError::Io(format!(
                "checkpoint file {} is missing or unreadable: {e}",
                path.display()
            ))
        })?
        .len();
    if len != expect {
        return Err(ShardError::Io(format!(
            "{} has {len} bytes, the manifest says {expect}: the file is truncated or replaced",
            path.display()
        )));
    }
    let file = File::open(path).map_err(|e| io(path, "opening", e))?;
    // SAFETY: the file is opened read-only and checkpoints are never modified in place (they
    // are written under a temporary name and renamed).
    unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io(path, "mapping", e))
}

impl Index {
    /// Opens `dir`: manifest, file sizes, headers, layouts and coverage.
    pub fn open(dir: &Path) -> Result<Self, ShardError> {
        let manifest = read_manifest(dir)?;
        let numel: HashMap<String, usize> = manifest
            .tensors
            .iter()
            .map(|t| (t.name.clone(), t.shape.iter().product()))
            .collect();
        let mut files = Vec::new();
        let mut pieces: HashMap<String, Vec<Piece>> = HashMap::new();
        let mut updates = None;
        let mut stated: Option<Vec<String>> = None;
        let mut seen = BTreeSet::new();
        for entry in &manifest.files {
            let path = dir.join(&entry.path);
            let map = map_file(&path, entry.bytes)?;
            if !(entry.path.starts_with("rank-") && entry.path.ends_with(".safetensors")) {
                continue;
            }
            // `read_metadata` bounds-checks the header length and every tensor's offsets
            // against the file before anything is allocated.
            let (header_len, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
                ShardError::Io(format!("{}: bad safetensors header: {e}", path.display()))
            })?;
            let data_start = 8 + header_len;
            let extra = meta.metadata().clone().unwrap_or_default();
            let bad = |what: String| ShardError::Io(format!("{}: {what}", path.display()));
            let layout: BTreeMap<String, Range> = serde_json::from_str(
                extra
                    .get(LAYOUT_KEY)
                    .ok_or_else(|| bad(format!("no {LAYOUT_KEY} metadata")))?,
            )
            .map_err(|e| bad(format!("bad {LAYOUT_KEY}: {e}")))?;
            let step: u64 = extra
                .get(ADAM_STEP_KEY)
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| bad(format!("no {ADAM_STEP_KEY} metadata")))?;
            if *updates.get_or_insert(step) != step {
                return Err(bad(format!(
                    "its Adam step {step} differs from the other shards'"
                )));
            }
            if let Some(names) = extra.get(STATE_KEY) {
                let names: Vec<String> = serde_json::from_str(names)
                    .map_err(|e| bad(format!("bad {STATE_KEY}: {e}")))?;
                if *stated.get_or_insert_with(|| names.clone()) != names {
                    return Err(bad(format!(
                        "its optimizer state {names:?} differs from the other shards'"
                    )));
                }
            }
            let file_index = files.len();
            for (key, info) in meta.tensors() {
                let range = layout
                    .get(&key)
                    .ok_or_else(|| bad(format!("tensor {key} has no layout entry")))?;
                let (kind, name) = key
                    .split_once('/')
                    .ok_or_else(|| bad(format!("unexpected tensor name {key}")))?;
                seen.insert(kind.to_string());
                if info.dtype != StDtype::F32 || info.shape.len() != 1 {
                    return Err(bad(format!(
                        "{key} is {:?} of shape {:?}, expected flat F32",
                        info.dtype, info.shape
                    )));
                }
                let total = *numel
                    .get(name)
                    .ok_or_else(|| bad(format!("{name} is not a parameter of this model")))?;
                let n = info.shape[0];
                if range.global_numel != total
                    || range.offset.checked_add(n).is_none_or(|end| end > total)
                {
                    return Err(bad(format!(
                        "{key} covers [{}, {}) of {} elements, but the manifest's shape has \
                         {total}",
                        range.offset,
                        range.offset.saturating_add(n),
                        range.global_numel
                    )));
                }
                pieces.entry(key.clone()).or_default().push(Piece {
                    file: file_index,
                    offset: range.offset,
                    len: n,
                    start: data_start + info.data_offsets.0,
                });
            }
            // The map served the header; data is read with `pread` (`Index::read`), so the
            // pages read are page cache, not this process's resident memory.
            drop(map);
            let file = File::open(&path).map_err(|e| io(&path, "opening", e))?;
            files.push((path, file));
        }
        // Checkpoints written before the state's names were recorded hold AdamW's.
        let kinds =
            stated.unwrap_or_else(|| seen.iter().filter(|k| *k != "param").cloned().collect());
        if let Some(stray) = seen.iter().find(|k| *k != "param" && !kinds.contains(k)) {
            return Err(ShardError::Io(format!(
                "{}: state {stray} is not among the optimizer state {kinds:?} the files name",
                dir.display()
            )));
        }
        for t in &manifest.tensors {
            let n = numel[&t.name];
            for kind in std::iter::once("param").chain(kinds.iter().map(String::as_str)) {
                let key = format!("{kind}/{}", t.name);
                let mut ranges: Vec<(usize, usize)> = pieces
                    .get(&key)
                    .map(|p| p.iter().map(|p| (p.offset, p.len)).collect())
                    .unwrap_or_default();
                check_coverage(&mut ranges, n).map_err(|what| {
                    ShardError::Io(format!(
                        "{}: {key} {what}; a rank's file is missing or inconsistent",
                        dir.display()
                    ))
                })?;
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            updates: updates.ok_or_else(|| {
                ShardError::Io(format!(
                    "{}: the checkpoint has no rank file",
                    dir.display()
                ))
            })?,
            manifest,
            kinds,
            files,
            pieces,
            numel,
        })
    }

    /// Verifies the size and checksum of the files whose position in the manifest `pick`
    /// accepts (a job gives each rank a share).
    pub fn verify(&self, pick: impl Fn(usize) -> bool) -> Result<(), ShardError> {
        for (i, entry) in self.manifest.files.iter().enumerate() {
            if !pick(i) {
                continue;
            }
            let path = self.dir.join(&entry.path);
            let sum = sha256_file(&path)?;
            if sum != entry.sha256 {
                return Err(ShardError::Io(format!(
                    "{} fails its SHA-256 check (corrupted): expected {}, found {sum}",
                    path.display(),
                    entry.sha256
                )));
            }
        }
        Ok(())
    }

    /// The optimizer states the checkpoint holds besides `param`, in the optimizer's order
    /// (AdamW's: `exp_avg`, `exp_avg_sq`); empty when it was saved before the first update.
    pub fn state_kinds(&self) -> Vec<String> {
        self.kinds.clone()
    }

    /// Elements `range` of state `kind` (`param`, or one of [`Index::state_kinds`]) of tensor
    /// `name`,
    /// copied from the pieces that overlap it (only those bytes are read).
    pub fn read(
        &self,
        kind: &str,
        name: &str,
        range: std::ops::Range<usize>,
    ) -> Result<Vec<f32>, ShardError> {
        let n = *self.numel.get(name).ok_or_else(|| {
            ShardError::Source(format!("{}: no tensor {name}", self.dir.display()))
        })?;
        if range.end > n {
            return Err(ShardError::Source(format!(
                "{}: {name} has {n} elements, [{}, {}) asked",
                self.dir.display(),
                range.start,
                range.end
            )));
        }
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
            let (path, file) = &self.files[p.file];
            let mut bytes = vec![0u8; 4 * (hi - lo)];
            file.read_exact_at(&mut bytes, (p.start + 4 * (lo - p.offset)) as u64)
                .map_err(|e| io(path, "reading", e))?;
            for (d, c) in out[lo - range.start..hi - range.start]
                .iter_mut()
                .zip(bytes.chunks_exact(4))
            {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Ok(out)
    }

    /// Rank `rank`'s error-feedback residuals, `(unit, hop) -> values`, with the layout JSON
    /// they were written for; `None` when the checkpoint holds none for that rank.
    pub fn residuals(&self, rank: usize) -> Result<Option<StoredResiduals>, ShardError> {
        let name = residual_file_name(rank);
        let Some(entry) = self.manifest.files.iter().find(|f| f.path == name) else {
            return Ok(None);
        };
        let path = self.dir.join(&entry.path);
        let map = map_file(&path, entry.bytes)?;
        let st = SafeTensors::deserialize(&map).map_err(|e| {
            ShardError::Io(format!("{}: bad safetensors file: {e}", path.display()))
        })?;
        let (_, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
            ShardError::Io(format!("{}: bad safetensors file: {e}", path.display()))
        })?;
        let layout = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get(RESIDUALS_KEY).cloned())
            .ok_or_else(|| {
                ShardError::Io(format!("{}: no {RESIDUALS_KEY} metadata", path.display()))
            })?;
        let mut out = BTreeMap::new();
        for (key, view) in st.tensors() {
            let parsed = key
                .split_once('/')
                .and_then(|(u, h)| Some((u.parse().ok()?, h.parse().ok()?)));
            let Some(slot) = parsed.filter(|_| view.dtype() == StDtype::F32) else {
                return Err(ShardError::Io(format!(
                    "{}: unexpected residual {key}",
                    path.display()
                )));
            };
            let values = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            out.insert(slot, values);
        }
        Ok(Some((layout, out)))
    }
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

/// A checkpoint every rank of a job opened and verified together: the source a
/// [`crate::ShardedModel`] resumes from (see [`crate::ShardedModel::resume`]).
#[derive(Debug)]
pub struct Checkpoint {
    index: Index,
}

impl Checkpoint {
    /// Opens the checkpoint at `path` (a checkpoint directory, or a directory of them: the
    /// newest complete one) on every rank: each rank checks every header and layout and
    /// verifies the checksums of a share of the files. A failure on any rank (a missing or
    /// unreadable file, a bad checksum) fails every rank, naming the rank and the file; then
    /// nothing was loaded. Every rank must call it.
    pub fn open(comm: &Comm, path: &Path) -> Result<Self, ShardError> {
        let (rank, world) = (comm.rank(), comm.topology().world_size());
        let index = agree(comm, locate(path).and_then(|dir| Index::open(&dir)))?;
        agree(comm, index.verify(|i| i % world == rank))?;
        Ok(Self { index })
    }

    /// Opens and verifies every file of the checkpoint at `path` in this process alone.
    pub fn open_local(path: &Path) -> Result<Self, ShardError> {
        let index = Index::open(&locate(path)?)?;
        index.verify(|_| true)?;
        Ok(Self { index })
    }

    /// The index, to read ranges.
    pub fn index(&self) -> &Index {
        &self.index
    }

    /// Its manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.index.manifest
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.index.dir
    }
}

/// A checkpoint's master weights, the source a model reads its own ranges from.
impl ParamSource for &Checkpoint {
    fn read(
        &mut self,
        name: &str,
        _shape: &[usize],
        range: std::ops::Range<usize>,
    ) -> Result<Vec<f32>, ShardError> {
        self.index.read("param", name, range)
    }

    fn fingerprint(&self) -> u64 {
        // Every rank opened the same checkpoint: the checksums of its files.
        self.index
            .manifest
            .files
            .iter()
            .flat_map(|f| f.sha256.bytes())
            .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
            })
    }
}
