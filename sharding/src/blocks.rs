//! Sharding a model whose repeated blocks sit in a `Vec` field, in a few lines: each element of
//! the field is a unit, the rest of the model is one more (the root), the model's own forward
//! is cut into three hooks it is already made of, and Burn's own initialisers give the
//! starting weights.
//!
//! The crate guide's first example runs it end to end (a doctest); `examples/llama.rs`,
//! `examples/mlp.rs` and `examples/moe.rs` are complete programs.

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::module::Module;
use burn::tensor::kind::Basic;
use burn::tensor::{Device, Tensor};
use ember_comm::Comm;
use serde::Serialize;
use serde_json::{Map, Value};

use crate::checkpoint::Checkpoint;
use crate::config::{Preset, ShardConfig};
use crate::engine::ShardedModel;
use crate::error::ShardError;
use crate::params::{param_shapes, take_value};
use crate::source::ParamSource;
use crate::stage::{Flow, Staged, UnitDecl};

/// A model whose repeated blocks sit in one `Vec` field, described by the three pieces its
/// forward is made of: everything before the blocks, one block, everything after them. A
/// model's own `forward` can be written as `embed`, each `block` in turn, then its head; the
/// partitioner runs the same three pieces unit by unit. `D` is the rank of the activations
/// between blocks (3 for `[batch, seq, d_model]`).
pub trait BlockModel<const D: usize>: Module + Clone {
    /// One micro-batch, as host data.
    type Batch;

    /// Everything before the first block: the batch to the first block's input, on `device`.
    fn embed(&self, batch: &Self::Batch, device: &Device) -> Tensor<D>;

    /// Block `i` of the `Vec` field, on the previous block's output `x`, with the
    /// micro-batch at hand for what else the block takes (an attention or padding mask,
    /// positions, any tensor built from the batch on `x.device()`). A plain block returns its
    /// output (`.into()`); one with an auxiliary loss returns [`BlockOutput::with_aux`].
    fn block(&self, i: usize, x: Tensor<D>, batch: &Self::Batch) -> BlockOutput<D>;

    /// Everything after the last block: its output to the batch's mean loss (`[1]`).
    fn loss(&self, x: Tensor<D>, batch: &Self::Batch, device: &Device) -> Tensor<1>;
}

/// What a block hands on: its output, and an auxiliary loss if it has one.
#[derive(Debug, Clone)]
pub struct BlockOutput<const D: usize> {
    /// The input of the next block (or of [`BlockModel::loss`]).
    pub hidden: Tensor<D>,
    /// An auxiliary loss (`[1]`, weighted as it should count: a mixture of experts'
    /// load-balancing loss times its coefficient), added to the model's loss: the step's
    /// loss and gradients are those of the sum.
    pub aux: Option<Tensor<1>>,
}

impl<const D: usize> BlockOutput<D> {
    /// An output with an auxiliary loss.
    pub fn with_aux(hidden: Tensor<D>, aux: Tensor<1>) -> Self {
        Self {
            hidden,
            aux: Some(aux),
        }
    }
}

impl<const D: usize> From<Tensor<D>> for BlockOutput<D> {
    fn from(hidden: Tensor<D>) -> Self {
        Self { hidden, aux: None }
    }
}

/// The three pieces of a model's forward as closures, for a model that does not implement
/// [`BlockModel`]: `embed(model, batch, device)`, `block(model, i, x, batch)` (returning the
/// block's output, or a [`BlockOutput`] with an auxiliary loss) and
/// `loss(model, x, batch, device)`, with the meaning of the trait's methods. [`Shard::forward`]
/// takes them directly.
pub struct Pieces<M, B, const D: usize> {
    embed: Arc<EmbedFn<M, B, D>>,
    block: Arc<BlockFn<M, B, D>>,
    loss: Arc<LossFn<M, B, D>>,
}

type EmbedFn<M, B, const D: usize> = dyn Fn(&M, &B, &Device) -> Tensor<D> + Send + Sync;
type BlockFn<M, B, const D: usize> =
    dyn Fn(&M, usize, Tensor<D>, &B) -> BlockOutput<D> + Send + Sync;
type LossFn<M, B, const D: usize> = dyn Fn(&M, Tensor<D>, &B, &Device) -> Tensor<1> + Send + Sync;

impl<M, B, const D: usize> Clone for Pieces<M, B, D> {
    fn clone(&self) -> Self {
        Self {
            embed: self.embed.clone(),
            block: self.block.clone(),
            loss: self.loss.clone(),
        }
    }
}

impl<M, B, const D: usize> fmt::Debug for Pieces<M, B, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pieces").finish_non_exhaustive()
    }
}

impl<M: 'static, B: 'static, const D: usize> Pieces<M, B, D> {
    /// The pieces as closures.
    pub fn new<O: Into<BlockOutput<D>>>(
        embed: impl Fn(&M, &B, &Device) -> Tensor<D> + Send + Sync + 'static,
        block: impl Fn(&M, usize, Tensor<D>, &B) -> O + Send + Sync + 'static,
        loss: impl Fn(&M, Tensor<D>, &B, &Device) -> Tensor<1> + Send + Sync + 'static,
    ) -> Self {
        Self {
            embed: Arc::new(embed),
            block: Arc::new(move |m: &M, i, x, b: &B| block(m, i, x, b).into()),
            loss: Arc::new(loss),
        }
    }

    /// The pieces of a [`BlockModel`]: its own three methods.
    pub fn of_model() -> Self
    where
        M: BlockModel<D, Batch = B>,
    {
        Self::new(
            |m: &M, b: &B, d: &Device| m.embed(b, d),
            |m: &M, i, x, b: &B| m.block(i, x, b),
            |m: &M, x, b: &B, d: &Device| m.loss(x, b, d),
        )
    }
}

/// The units of a model whose blocks sit in a `Vec` field, run by its [`Pieces`]: unit 0 is
/// the root (every parameter outside the blocks' field) and runs `embed`; unit `i + 1` is
/// block `i`; the last block's unit also reads the root and runs `loss`.
#[derive(Debug, Clone)]
pub struct Blocks<M, B, const D: usize> {
    field: String,
    count: usize,
    pieces: Pieces<M, B, D>,
}

impl<M: Module, B, const D: usize> Blocks<M, B, D> {
    /// The units of `module` with its blocks in field `field`, run by `pieces`.
    pub fn of(module: &M, field: &str, pieces: Pieces<M, B, D>) -> Result<Self, ShardError> {
        let prefix = format!("{field}.");
        let mut count = 0;
        for (path, _) in param_shapes(module) {
            if let Some(rest) = path.strip_prefix(&prefix) {
                let index = rest.split('.').next().and_then(|i| i.parse::<usize>().ok());
                match index {
                    Some(i) => count = count.max(i + 1),
                    None => {
                        return Err(ShardError::setting(
                            "blocks",
                            field,
                            format!(
                                "parameter `{path}` is under the field but not in an element of \
                                 a Vec: name the Vec field that holds the blocks"
                            ),
                        ));
                    }
                }
            }
        }
        if count == 0 {
            let roots: Vec<String> = param_shapes(module)
                .into_iter()
                .filter_map(|(p, _)| p.split('.').next().map(str::to_string))
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            return Err(ShardError::setting(
                "blocks",
                field,
                format!(
                    "no parameter lies under `{prefix}`: the model's fields with parameters are \
                     {}",
                    roots.join(", ")
                ),
            ));
        }
        Ok(Self {
            field: field.to_string(),
            count,
            pieces,
        })
    }

    /// Blocks in the field.
    pub fn count(&self) -> usize {
        self.count
    }
}

impl<M: Module + Clone, B, const D: usize> Staged<D> for Blocks<M, B, D> {
    type Module = M;
    type Batch = B;

    fn units(&self, module: &M) -> Vec<UnitDecl> {
        let prefix = format!("{}.", self.field);
        let root: Vec<String> = param_shapes(module)
            .into_iter()
            .map(|(p, _)| p)
            .filter(|p| !p.starts_with(&prefix))
            .collect();
        let root = UnitDecl {
            name: "root".into(),
            prefixes: root,
            uses: Vec::new(),
        };
        let last = self.count;
        std::iter::once(root)
            .chain((0..self.count).map(|i| {
                let name = format!("{}.{i}", self.field);
                let unit = UnitDecl::new(name.clone(), &[&name]);
                if i + 1 == last {
                    unit.using(&[0])
                } else {
                    unit
                }
            }))
            .collect()
    }

    fn forward(
        &self,
        module: &M,
        unit: usize,
        input: Option<Tensor<D>>,
        batch: &B,
        device: &Device,
    ) -> Flow<D> {
        match input {
            None => Flow::Hidden((self.pieces.embed)(module, batch, device)),
            Some(x) => {
                let BlockOutput { hidden, aux } = (self.pieces.block)(module, unit - 1, x, batch);
                match (unit == self.count, aux) {
                    // The last block's auxiliary loss joins the model's loss here.
                    (true, aux) => {
                        let loss = (self.pieces.loss)(module, hidden, batch, device);
                        Flow::Loss(match aux {
                            Some(aux) => aux + loss,
                            None => loss,
                        })
                    }
                    (false, None) => Flow::Hidden(hidden),
                    (false, Some(aux)) => Flow::Aux(hidden, aux),
                }
            }
        }
    }
}

/// Parameters drawn by Burn's own initialisers: each parameter of a freshly built module
/// (lazy, as `LinearConfig::init` and friends make them) is materialised alone, on the host,
/// with the device's generator seeded from `(seed, parameter path)`, and only the asked range
/// is kept. A parameter's values are thus the same on every rank and at every world size, and
/// a rank never holds more than the largest parameter at once.
pub struct InitSource<M> {
    module: Option<M>,
    seed: u64,
    /// The parameter last drawn, kept while the next read is of it too.
    last: Option<(String, Vec<f32>)>,
}

impl<M> fmt::Debug for InitSource<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InitSource")
            .field("seed", &self.seed)
            .finish_non_exhaustive()
    }
}

impl<M: Module> InitSource<M> {
    /// Draws from `module`'s initialisers, seeded by `seed`.
    pub fn new(module: M, seed: u64) -> Self {
        Self {
            module: Some(module),
            seed,
            last: None,
        }
    }
}

/// The generator's seed of parameter `name` (FNV-1a of the path, mixed with `seed`).
fn param_seed(seed: u64, name: &str) -> u64 {
    name.bytes().fold(seed ^ 0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

impl<M: Module> ParamSource for InitSource<M> {
    fn read(
        &mut self,
        name: &str,
        _shape: &[usize],
        range: Range<usize>,
    ) -> Result<Vec<f32>, ShardError> {
        if self.last.as_ref().is_none_or(|(n, _)| n != name) {
            let module = self
                .module
                .take()
                .expect("the module is put back after each read");
            let device = Device::flex();
            device.seed(param_seed(self.seed, name));
            let (module, value) = take_value(module, name);
            self.module = Some(module);
            let value = value.ok_or_else(|| {
                ShardError::Source(format!("the module has no parameter `{name}`"))
            })?;
            let values = crate::transport::staging::to_f32(value.to_device(&device));
            self.last = Some((name.to_string(), values));
        }
        let (_, values) = self.last.as_ref().expect("drawn above");
        values
            .get(range.clone())
            .map(<[f32]>::to_vec)
            .ok_or_else(|| {
                ShardError::Source(format!(
                    "{name} has {} elements, [{}, {}) asked",
                    values.len(),
                    range.start,
                    range.end
                ))
            })
    }

    fn fingerprint(&self) -> u64 {
        self.seed
    }
}

/// Builds a [`ShardedModel`] of a model whose blocks sit in a `Vec` field, with named
/// options: which field holds the blocks, the preset or a whole [`ShardConfig`], the seed of
/// the initialisers, a checkpoint to resume instead, and the application's record checked on
/// resume and kept in every save. The forward's pieces are the model's [`BlockModel`] impl, or
/// closures given to [`forward`](Self::forward) (`P` is then [`Pieces`]).
#[derive(Debug, Clone)]
pub struct Shard<'a, P = ()> {
    field: String,
    config: Option<ShardConfig>,
    preset: Preset,
    seed: u64,
    resume: Resume<'a>,
    record: Option<Result<Map<String, Value>, String>>,
    pieces: P,
}

/// Where a build's state comes from.
#[derive(Debug, Clone)]
enum Resume<'a> {
    /// Burn's initialisers.
    Fresh,
    /// A checkpoint the caller opened.
    Opened(&'a Checkpoint),
    /// A checkpoint directory the build opens.
    Dir(PathBuf),
}

impl<'a> Shard<'a> {
    /// Each element of the `Vec` field `field` is a unit; the rest of the model is the root.
    /// Defaults: [`Preset::Zero3`], seed 0.
    pub fn blocks(field: &str) -> Self {
        Self {
            field: field.to_string(),
            config: None,
            preset: Preset::Zero3,
            seed: 0,
            resume: Resume::Fresh,
            record: None,
            pieces: (),
        }
    }

    /// The model's forward as its three pieces, closures with the meaning of
    /// [`BlockModel`]'s methods (see [`Pieces::new`]), for a model without the trait; the
    /// crate guide's example shows them.
    pub fn forward<M: 'static, B: 'static, O: Into<BlockOutput<D>>, const D: usize>(
        self,
        embed: impl Fn(&M, &B, &Device) -> Tensor<D> + Send + Sync + 'static,
        block: impl Fn(&M, usize, Tensor<D>, &B) -> O + Send + Sync + 'static,
        loss: impl Fn(&M, Tensor<D>, &B, &Device) -> Tensor<1> + Send + Sync + 'static,
    ) -> Shard<'a, Pieces<M, B, D>> {
        self.pieces(Pieces::new(embed, block, loss))
    }

    /// The model's forward as [`Pieces`] built beforehand.
    pub fn pieces<M, B, const D: usize>(
        self,
        pieces: Pieces<M, B, D>,
    ) -> Shard<'a, Pieces<M, B, D>> {
        Shard {
            field: self.field,
            config: self.config,
            preset: self.preset,
            seed: self.seed,
            resume: self.resume,
            record: self.record,
            pieces,
        }
    }

    /// Partitions the module `init` builds (the model's `Config::init`, whose parameters
    /// are lazy) over `comm`, computing on `device`, run by its [`BlockModel`] impl. Every
    /// rank must call it.
    pub fn build<'c, M, const D: usize>(
        self,
        comm: &'c Comm,
        init: impl Fn(&Device) -> M,
        device: Device,
    ) -> Result<ShardedModel<'c, Blocks<M, M::Batch, D>, D>, ShardError>
    where
        M: BlockModel<D> + 'static,
        M::Batch: 'static,
    {
        self.pieces(Pieces::of_model()).build(comm, init, device)
    }
}

impl<'a, P> Shard<'a, P> {
    /// The preset, sized to the communicator's topology.
    pub fn preset(mut self, preset: Preset) -> Self {
        self.preset = preset;
        self
    }

    /// A whole configuration instead of a preset.
    pub fn config(mut self, config: ShardConfig) -> Self {
        self.config = Some(config);
        self
    }

    /// The seed of the initialisers' generator.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Continue `checkpoint` (of any world size and preset) instead of initialising.
    pub fn resume(mut self, checkpoint: &'a Checkpoint) -> Self {
        self.resume = Resume::Opened(checkpoint);
        self
    }

    /// Continue the checkpoint in `dir` (a `step-NNNNNN` directory, or a run's directory for
    /// its newest complete checkpoint; of any world size and preset) when there is one, else
    /// initialise: `.resume_from(args.resume.as_deref())`.
    pub fn resume_from(mut self, dir: Option<&Path>) -> Self {
        if let Some(dir) = dir {
            self.resume = Resume::Dir(dir.to_path_buf());
        }
        self
    }

    /// The application's record (a struct that serialises to a JSON object: its settings,
    /// its data's position): a resumed checkpoint must hold the same value under each of its
    /// fields, or the build fails naming the first that differs, and every
    /// [`ShardedModel::save`] whose options carry no record of their own keeps it.
    pub fn record<R: Serialize>(mut self, record: &R) -> Self {
        self.record = Some(match serde_json::to_value(record) {
            Ok(Value::Object(map)) => Ok(map),
            Ok(other) => Err(format!(
                "the record must serialise to a JSON object, not {other}"
            )),
            Err(e) => Err(format!("the record does not serialise: {e}")),
        });
        self
    }
}

impl<'a, M, B, const D: usize> Shard<'a, Pieces<M, B, D>>
where
    M: Module + Clone,
{
    /// Partitions the module `init` builds (the model's `Config::init`, whose parameters
    /// are lazy) over `comm`, computing on `device`. Every rank must call it.
    pub fn build<'c>(
        self,
        comm: &'c Comm,
        init: impl Fn(&Device) -> M,
        device: Device,
    ) -> Result<ShardedModel<'c, Blocks<M, B, D>, D>, ShardError> {
        let config = match self.config {
            Some(c) => c,
            None => self.preset.config(comm.topology().depth()),
        };
        let record = self
            .record
            .transpose()
            .map_err(|why| ShardError::setting("record", "", why))?;
        // A skeleton: its lazy parameters are never materialised.
        let skeleton = init(&Device::flex());
        let stages = Blocks::of(&skeleton, &self.field, self.pieces)?;
        let opened;
        let checkpoint = match self.resume {
            Resume::Fresh => None,
            Resume::Opened(checkpoint) => Some(checkpoint),
            Resume::Dir(dir) => {
                opened = Checkpoint::open(comm, &dir)?;
                Some(&opened)
            }
        };
        let model = match checkpoint {
            Some(checkpoint) => {
                if let Some(record) = &record {
                    check_record(record, checkpoint)?;
                }
                ShardedModel::resume(comm, stages, skeleton, config, device, checkpoint)?
            }
            None => {
                let mut source = InitSource::new(init(&Device::flex()), self.seed);
                ShardedModel::new(comm, stages, skeleton, config, device, &mut source)?
            }
        };
        Ok(match record {
            Some(record) => model.with_record(record),
            None => model,
        })
    }
}

/// Refuses a checkpoint whose application record differs from `record` under any of its
/// fields.
fn check_record(record: &Map<String, Value>, checkpoint: &Checkpoint) -> Result<(), ShardError> {
    let saved = &checkpoint.manifest().app;
    for (key, ours) in record {
        let theirs = saved.get(key).unwrap_or(&Value::Null);
        if theirs != ours {
            return Err(ShardError::setting(
                "record",
                format!("{key} = {ours}"),
                format!(
                    "{} was saved with {key} = {theirs}: resume it with the settings it was \
                     saved with, or start afresh",
                    checkpoint.dir().display()
                ),
            ));
        }
    }
    Ok(())
}

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
