//! [`Shard`], the builder every way of describing a model goes through: one stack of blocks
//! (three pieces, or a [`BlockModel`] impl), several stacks (a block piece each and pieces
//! between them), or any [`Staged`] description. Its options (the preset or a whole
//! configuration, the seed, a checkpoint to resume, the application's record, how the step's
//! loss is formed) are the same for all of them.

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::{Device, Tensor};
use ember_comm::Comm;
use serde::Serialize;
use serde_json::{Map, Value};

use crate::blocks::{BlockModel, BlockOutput, Blocks, Handover, InitSource, Pieces};
use crate::checkpoint::Checkpoint;
use crate::config::{Preset, ShardConfig};
use crate::engine::{ShardedModel, StepLoss};
use crate::error::ShardError;
use crate::side::Side;
use crate::stage::Staged;

/// Builds a [`ShardedModel`], with named options: the preset or a whole [`ShardConfig`], the
/// seed of the initialisers and of the device's generator, a checkpoint to resume instead, the
/// application's record checked on resume and kept in every save, and how the step's loss is
/// formed from its micro-batches' ([`StepLoss`]). What the model is made of comes first:
///
/// - [`Shard::blocks`]: one `Vec` field of blocks, with the model's [`BlockModel`] impl
///   ([`build`](Shard::build)) or three closures ([`forward`](Shard::forward));
/// - [`Shard::embed`], then [`stack`](Shard::stack) per `Vec` field of blocks, with
///   [`then`](Shard::then) between two stacks where needed, and [`loss`](Shard::loss): several
///   stacks (an encoder and a decoder);
/// - [`Shard::staged`]: any [`Staged`] description of the model's units.
#[derive(Debug, Clone)]
pub struct Shard<'a, P = ()> {
    /// The `Vec` fields of blocks, in forward order.
    fields: Vec<String>,
    options: Options<'a>,
    pieces: P,
}

/// A model described by its own [`Staged`] implementation, for [`Shard::staged`].
#[derive(Debug, Clone)]
pub struct Described<S>(S);

/// The options every route shares.
#[derive(Debug, Clone)]
struct Options<'a> {
    config: Option<ShardConfig>,
    preset: Preset,
    seed: u64,
    resume: Resume<'a>,
    record: Option<Result<Map<String, Value>, String>>,
    step_loss: StepLoss,
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
    fn with_fields(fields: Vec<String>) -> Self {
        Self {
            fields,
            options: Options {
                config: None,
                preset: Preset::Zero3,
                seed: 0,
                resume: Resume::Fresh,
                record: None,
                step_loss: StepLoss::Mean,
            },
            pieces: (),
        }
    }

    /// Each element of the `Vec` field `field` is a unit; the rest of the model is the root.
    /// Defaults: [`Preset::Zero3`], seed 0, [`StepLoss::Mean`].
    pub fn blocks(field: &str) -> Self {
        Self::with_fields(vec![field.to_string()])
    }

    /// A model of several stacks of blocks (or one), described piece by piece, starting with
    /// `embed(model, batch, side, device)`: the batch to the first stack's input, on `device`.
    /// Then [`stack`](Shard::stack) names each `Vec` field of blocks in forward order with its
    /// block piece, [`then`](Shard::then) goes between two stacks where the second does not
    /// take the first one's output as it is, and [`loss`](Shard::loss) ends the forward.
    /// Every element of every field is a unit; the rest of the model is the root.
    pub fn embed<M: 'static, B: 'static, const D: usize>(
        embed: impl Fn(&M, &B, &mut Side, &Device) -> Tensor<D> + Send + Sync + 'static,
    ) -> Shard<'a, Pieces<M, B, D>> {
        Self::with_fields(Vec::new()).pieces(Pieces::embed(embed))
    }

    /// A model described by its own [`Staged`] implementation (which parameters form each
    /// unit, and how one unit runs), built with the options every route shares.
    pub fn staged<S>(stages: S) -> Shard<'a, Described<S>> {
        Self::with_fields(Vec::new()).with_pieces(Described(stages))
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

    /// The model's forward as [`Pieces`] built beforehand (one block piece per field).
    pub fn pieces<M, B, const D: usize>(
        self,
        pieces: Pieces<M, B, D>,
    ) -> Shard<'a, Pieces<M, B, D>> {
        self.with_pieces(pieces)
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
    /// The same builder with what the model is made of replaced by `pieces`.
    fn with_pieces<Q>(self, pieces: Q) -> Shard<'a, Q> {
        Shard {
            fields: self.fields,
            options: self.options,
            pieces,
        }
    }

    /// The preset, sized to the communicator's topology.
    pub fn preset(mut self, preset: Preset) -> Self {
        self.options.preset = preset;
        self
    }

    /// A whole configuration instead of a preset.
    pub fn config(mut self, config: ShardConfig) -> Self {
        self.options.config = Some(config);
        self
    }

    /// The seed of the initialisers' generator, and of the device's generator the units'
    /// forwards draw from (dropout): see [`draw_seed`](crate::draw_seed). A resumed model
    /// keeps the seed it was saved with.
    pub fn seed(mut self, seed: u64) -> Self {
        self.options.seed = seed;
        self
    }

    /// How the step's loss and gradients are formed from the micro-batches' losses: their
    /// mean ([`StepLoss::Mean`], the default) or their sum ([`StepLoss::Sum`], for a loss
    /// that is a mean over the global batch's tokens).
    pub fn step_loss(mut self, step_loss: StepLoss) -> Self {
        self.options.step_loss = step_loss;
        self
    }

    /// Continue `checkpoint` (of any world size and preset) instead of initialising.
    pub fn resume(mut self, checkpoint: &'a Checkpoint) -> Self {
        self.options.resume = Resume::Opened(checkpoint);
        self
    }

    /// Continue the checkpoint in `dir` (a `step-NNNNNN` directory, or a run's directory for
    /// its newest complete checkpoint; of any world size and preset) when there is one, else
    /// initialise: `.resume_from(args.resume.as_deref())`.
    pub fn resume_from(mut self, dir: Option<&Path>) -> Self {
        if let Some(dir) = dir {
            self.options.resume = Resume::Dir(dir.to_path_buf());
        }
        self
    }

    /// The application's record (a struct that serialises to a JSON object: its settings,
    /// its data's position): a resumed checkpoint must hold the same value under each of its
    /// fields, or the build fails naming the first that differs, and every
    /// [`ShardedModel::save`] whose options carry no record of their own keeps it.
    pub fn record<R: Serialize>(mut self, record: &R) -> Self {
        self.options.record = Some(match serde_json::to_value(record) {
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
    M: Module + Clone + 'static,
    B: 'static,
{
    /// The next stack of blocks: the `Vec` field `field`, each element a unit, run by
    /// `block(model, i, x, batch, side)` (block `i` of the field on the previous block's
    /// output `x`, returning its output or a [`BlockOutput`] with an auxiliary loss).
    pub fn stack<O: Into<BlockOutput<D>>>(
        mut self,
        field: &str,
        block: impl Fn(&M, usize, Tensor<D>, &B, &mut Side) -> O + Send + Sync + 'static,
    ) -> Self {
        self.fields.push(field.to_string());
        self.pieces = self.pieces.stack(block);
        self
    }

    /// What runs between the last stack and the next, in the unit of the next stack's first
    /// block (which then reads the root too): `then(model, x, batch, side, device)` takes the
    /// last block's output `x` and returns the next stack's input, alone or with side tensors
    /// for the next stack's blocks to read ([`Handover`]: an encoder's output, for
    /// cross-attention).
    pub fn then<O: Into<Handover<D>>>(
        mut self,
        then: impl Fn(&M, Tensor<D>, &B, &mut Side, &Device) -> O + Send + Sync + 'static,
    ) -> Self {
        self.pieces = self.pieces.then(then);
        self
    }

    /// The end of the forward, in the unit of the last stack's last block (which then reads
    /// the root too): `loss(model, x, batch, side, device)` takes the last block's output to
    /// the micro-batch's loss (`[1]`; see [`StepLoss`] for what it is a mean of).
    pub fn loss(
        mut self,
        loss: impl Fn(&M, Tensor<D>, &B, &mut Side, &Device) -> Tensor<1> + Send + Sync + 'static,
    ) -> Self {
        self.pieces = self.pieces.loss(loss);
        self
    }

    /// Partitions the module `init` builds (the model's `Config::init`, whose parameters
    /// are lazy) over `comm`, computing on `device`. Every rank must call it.
    pub fn build<'c>(
        self,
        comm: &'c Comm,
        init: impl Fn(&Device) -> M,
        device: Device,
    ) -> Result<ShardedModel<'c, Blocks<M, B, D>, D>, ShardError> {
        let fields: Vec<&str> = self.fields.iter().map(String::as_str).collect();
        let pieces = self.pieces;
        self.options.build(
            comm,
            |skeleton| Blocks::of_stacks(skeleton, &fields, pieces),
            init,
            device,
        )
    }
}

impl<'a, S> Shard<'a, Described<S>> {
    /// Partitions the module `init` builds (the model's `Config::init`, whose parameters
    /// are lazy) over `comm` into the units of the description, computing on `device`. Every
    /// rank must call it.
    pub fn build<'c, const D: usize>(
        self,
        comm: &'c Comm,
        init: impl Fn(&Device) -> S::Module,
        device: Device,
    ) -> Result<ShardedModel<'c, S, D>, ShardError>
    where
        S: Staged<D>,
    {
        let stages = self.pieces.0;
        self.options.build(comm, |_| Ok(stages), init, device)
    }
}

impl Options<'_> {
    /// The model `init` builds, described by `describe(skeleton)`, partitioned per these
    /// options.
    fn build<'c, S: Staged<D>, const D: usize>(
        self,
        comm: &'c Comm,
        describe: impl FnOnce(&S::Module) -> Result<S, ShardError>,
        init: impl Fn(&Device) -> S::Module,
        device: Device,
    ) -> Result<ShardedModel<'c, S, D>, ShardError> {
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
        let stages = describe(&skeleton)?;
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
        let model = model.with_step_loss(self.step_loss);
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
