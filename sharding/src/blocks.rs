//! Sharding a model whose repeated blocks sit in `Vec` fields, in a few lines: each element of
//! each field is a unit, the rest of the model is one more (the root), and the model's own
//! forward is cut into the pieces it is already made of. One stack of blocks (a decoder) takes
//! three pieces: what comes before the blocks, one block, and what comes after them down to
//! the loss. Several stacks (an encoder and a decoder) take one block piece per stack and,
//! between two stacks, a piece that turns the first stack's output into the second's input
//! (and puts what the second reads beside it, such as the encoder's output, in the [`Side`]).
//! Burn's own initialisers give the starting weights ([`InitSource`]).
//!
//! The crate guide's first example runs it end to end (a doctest); `examples/llama.rs`,
//! `examples/mlp.rs`, `examples/moe.rs` and `examples/seq2seq.rs` are complete programs.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use burn::module::Module;
use burn::tensor::{Device, Tensor};

use crate::error::ShardError;
use crate::params::{param_shapes, take_value};
use crate::side::Side;
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

    /// Everything after the last block: its output to the batch's loss (`[1]`).
    fn loss(&self, x: Tensor<D>, batch: &Self::Batch, device: &Device) -> Tensor<1>;
}

/// What a block hands on: its output, and an auxiliary loss if it has one.
#[derive(Debug, Clone)]
pub struct BlockOutput<const D: usize> {
    /// The input of the next block (or of the loss piece).
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

/// `(hidden, aux)`: an output with an auxiliary loss, as [`BlockOutput::with_aux`].
impl<const D: usize> From<(Tensor<D>, Tensor<1>)> for BlockOutput<D> {
    fn from((hidden, aux): (Tensor<D>, Tensor<1>)) -> Self {
        Self::with_aux(hidden, aux)
    }
}

/// What a `then` piece hands the next stack: its input, and side tensors for its blocks to read.
/// A `then` piece returns the input alone; `(input, handed)`, which also puts `handed` (the
/// finished stack's output as the next stack reads it: an encoder's output after its final
/// norm) under the finished stack's field name; or `(input, [(name, tensor), ..])`, which puts
/// each under its own name.
#[derive(Debug, Clone)]
pub struct Handover<const D: usize> {
    /// The next stack's input.
    pub input: Tensor<D>,
    /// Put under the finished stack's field name.
    pub handed: Option<Tensor<D>>,
    /// Put under their own names.
    pub side: Vec<(String, Tensor<D>)>,
}

impl<const D: usize> From<Tensor<D>> for Handover<D> {
    fn from(input: Tensor<D>) -> Self {
        Self {
            input,
            handed: None,
            side: Vec::new(),
        }
    }
}

/// `(input, handed)`: `handed` is put under the finished stack's field name.
impl<const D: usize> From<(Tensor<D>, Tensor<D>)> for Handover<D> {
    fn from((input, handed): (Tensor<D>, Tensor<D>)) -> Self {
        Self {
            input,
            handed: Some(handed),
            side: Vec::new(),
        }
    }
}

/// `(input, [(name, tensor), ..])`: each tensor is put under its name.
impl<const D: usize, const N: usize, S: Into<String>> From<(Tensor<D>, [(S, Tensor<D>); N])>
    for Handover<D>
{
    fn from((input, side): (Tensor<D>, [(S, Tensor<D>); N])) -> Self {
        Self {
            input,
            handed: None,
            side: side.into_iter().map(|(n, t)| (n.into(), t)).collect(),
        }
    }
}

type EmbedFn<M, B, const D: usize> = dyn Fn(&M, &B, &mut Side, &Device) -> Tensor<D> + Send + Sync;
type BlockFn<M, B, const D: usize> =
    dyn Fn(&M, usize, Tensor<D>, &B, &mut Side) -> BlockOutput<D> + Send + Sync;
type ThenFn<M, B, const D: usize> =
    dyn Fn(&M, Tensor<D>, &B, &mut Side, &Device) -> Handover<D> + Send + Sync;
type LossFn<M, B, const D: usize> =
    dyn Fn(&M, Tensor<D>, &B, &mut Side, &Device) -> Tensor<1> + Send + Sync;

/// One stack's pieces: its block, and the piece that runs before its first block (the
/// transition from the stack before it).
struct StackPieces<M, B, const D: usize> {
    block: Arc<BlockFn<M, B, D>>,
    before: Option<Arc<ThenFn<M, B, D>>>,
}

impl<M, B, const D: usize> Clone for StackPieces<M, B, D> {
    fn clone(&self) -> Self {
        Self {
            block: self.block.clone(),
            before: self.before.clone(),
        }
    }
}

/// The pieces of a model's forward as closures, for a model that does not implement
/// [`BlockModel`] or has several stacks of blocks: `embed` before the first stack, a block
/// piece per stack, a `then` piece between two stacks where the second does not take the
/// first one's output as it is, and `loss` after the last stack. [`Shard::forward`],
/// [`Shard::embed`], [`Shard::stack`], [`Shard::then`] and [`Shard::loss`] build them.
///
/// [`Shard::forward`]: crate::Shard::forward
/// [`Shard::embed`]: crate::Shard::embed
/// [`Shard::stack`]: crate::Shard::stack
/// [`Shard::then`]: crate::Shard::then
/// [`Shard::loss`]: crate::Shard::loss
pub struct Pieces<M, B, const D: usize> {
    embed: Arc<EmbedFn<M, B, D>>,
    stacks: Vec<StackPieces<M, B, D>>,
    /// A `then` given after the last stack so far, for the next one.
    then: Option<Arc<ThenFn<M, B, D>>>,
    loss: Option<Arc<LossFn<M, B, D>>>,
}

impl<M, B, const D: usize> Clone for Pieces<M, B, D> {
    fn clone(&self) -> Self {
        Self {
            embed: self.embed.clone(),
            stacks: self.stacks.clone(),
            then: self.then.clone(),
            loss: self.loss.clone(),
        }
    }
}

impl<M, B, const D: usize> fmt::Debug for Pieces<M, B, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pieces")
            .field("stacks", &self.stacks.len())
            .finish_non_exhaustive()
    }
}

impl<M: 'static, B: 'static, const D: usize> Pieces<M, B, D> {
    /// The three pieces of a model with one stack of blocks, as closures:
    /// `embed(model, batch, device)`, `block(model, i, x, batch)` (returning the block's
    /// output, or a [`BlockOutput`] with an auxiliary loss) and `loss(model, x, batch,
    /// device)`, with the meaning of [`BlockModel`]'s methods.
    pub fn new<O: Into<BlockOutput<D>>>(
        embed: impl Fn(&M, &B, &Device) -> Tensor<D> + Send + Sync + 'static,
        block: impl Fn(&M, usize, Tensor<D>, &B) -> O + Send + Sync + 'static,
        loss: impl Fn(&M, Tensor<D>, &B, &Device) -> Tensor<1> + Send + Sync + 'static,
    ) -> Self {
        Self::embed(move |m: &M, b: &B, _: &mut Side, d: &Device| embed(m, b, d))
            .stack(move |m: &M, i, x, b: &B, _: &mut Side| block(m, i, x, b))
            .loss(move |m: &M, x, b: &B, _: &mut Side, d: &Device| loss(m, x, b, d))
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

    /// Pieces that start with `embed(model, batch, side, device)`: the batch to the first
    /// stack's input, on `device`.
    pub fn embed(
        embed: impl Fn(&M, &B, &mut Side, &Device) -> Tensor<D> + Send + Sync + 'static,
    ) -> Self {
        Self {
            embed: Arc::new(embed),
            stacks: Vec::new(),
            then: None,
            loss: None,
        }
    }

    /// The same pieces and the next stack's block: `block(model, i, x, batch, side)` runs
    /// block `i` of the stack on `x`.
    pub fn stack<O: Into<BlockOutput<D>>>(
        mut self,
        block: impl Fn(&M, usize, Tensor<D>, &B, &mut Side) -> O + Send + Sync + 'static,
    ) -> Self {
        self.stacks.push(StackPieces {
            block: Arc::new(move |m: &M, i, x, b: &B, s: &mut Side| block(m, i, x, b, s).into()),
            before: self.then.take(),
        });
        self
    }

    /// The same pieces and what runs between the last stack so far and the next:
    /// `then(model, x, batch, side, device)` takes the last block's output `x` and returns the
    /// next stack's input, alone or with side tensors for the next stack's blocks
    /// ([`Handover`]).
    pub fn then<O: Into<Handover<D>>>(
        mut self,
        then: impl Fn(&M, Tensor<D>, &B, &mut Side, &Device) -> O + Send + Sync + 'static,
    ) -> Self {
        self.then = Some(Arc::new(
            move |m: &M, x, b: &B, side: &mut Side, d: &Device| then(m, x, b, side, d).into(),
        ));
        self
    }

    /// The same pieces and the last: `loss(model, x, batch, side, device)` takes the last
    /// block's output to the micro-batch's loss (`[1]`).
    pub fn loss(
        mut self,
        loss: impl Fn(&M, Tensor<D>, &B, &mut Side, &Device) -> Tensor<1> + Send + Sync + 'static,
    ) -> Self {
        self.loss = Some(Arc::new(loss));
        self
    }

    /// Stacks given a block piece.
    pub fn stacks(&self) -> usize {
        self.stacks.len()
    }
}

/// The units of a model whose blocks sit in one or more `Vec` fields, run by its [`Pieces`]:
/// unit 0 is the root (every parameter outside the blocks' fields) and runs `embed`; then one
/// unit per block, stack after stack, named `field.i`. The first block of a stack after a
/// `then` piece also reads the root and runs that piece first; the last block of the last
/// stack also reads the root and runs `loss`.
#[derive(Debug, Clone)]
pub struct Blocks<M, B, const D: usize> {
    /// Each stack's field and count of blocks.
    stacks: Vec<(String, usize)>,
    pieces: Pieces<M, B, D>,
}

impl<M: Module, B, const D: usize> Blocks<M, B, D> {
    /// The units of `module` with its blocks in field `field`, run by `pieces`.
    pub fn of(module: &M, field: &str, pieces: Pieces<M, B, D>) -> Result<Self, ShardError> {
        Self::of_stacks(module, &[field], pieces)
    }

    /// The units of `module` with its blocks in the fields `fields`, one stack each in forward
    /// order, run by `pieces` (one block piece per field, and a loss).
    pub fn of_stacks(
        module: &M,
        fields: &[&str],
        pieces: Pieces<M, B, D>,
    ) -> Result<Self, ShardError> {
        let names = fields.join(", ");
        if fields.is_empty() || pieces.stacks.len() != fields.len() {
            return Err(ShardError::setting(
                "blocks",
                &names,
                format!(
                    "{} fields of blocks and {} block pieces: give one block piece per field, \
                     in the fields' order",
                    fields.len(),
                    pieces.stacks.len()
                ),
            ));
        }
        if pieces.loss.is_none() {
            return Err(ShardError::setting(
                "blocks",
                &names,
                "no loss piece: give one after the last stack's block piece",
            ));
        }
        if pieces.then.is_some() {
            return Err(ShardError::setting(
                "blocks",
                &names,
                "a `then` piece after the last stack: it runs between two stacks, so give it \
                 before the next stack's block piece, or drop it",
            ));
        }
        let params = param_shapes(module);
        let mut stacks = Vec::with_capacity(fields.len());
        for field in fields {
            stacks.push((field.to_string(), count_blocks(&params, field)?));
        }
        Ok(Self { stacks, pieces })
    }

    /// Blocks in all the fields.
    pub fn count(&self) -> usize {
        self.stacks.iter().map(|(_, n)| n).sum()
    }

    /// The stack and index within it of unit `unit` (`unit >= 1`).
    fn locate(&self, unit: usize) -> (usize, usize) {
        let mut i = unit - 1;
        for (s, (_, n)) in self.stacks.iter().enumerate() {
            if i < *n {
                return (s, i);
            }
            i -= n;
        }
        unreachable!("unit {unit} is past the last block")
    }
}

/// The count of blocks of the `Vec` field `field` among `params`.
fn count_blocks(params: &[(String, Vec<usize>)], field: &str) -> Result<usize, ShardError> {
    let prefix = format!("{field}.");
    let mut count = 0;
    for (path, _) in params {
        if let Some(rest) = path.strip_prefix(&prefix) {
            match rest.split('.').next().and_then(|i| i.parse::<usize>().ok()) {
                Some(i) => count = count.max(i + 1),
                None => {
                    return Err(ShardError::setting(
                        "blocks",
                        field,
                        format!(
                            "parameter `{path}` is under the field but not in an element of a \
                             Vec: name the Vec field that holds the blocks"
                        ),
                    ));
                }
            }
        }
    }
    if count == 0 {
        let roots: std::collections::BTreeSet<&str> = params
            .iter()
            .filter_map(|(p, _)| p.split('.').next())
            .collect();
        return Err(ShardError::setting(
            "blocks",
            field,
            format!(
                "no parameter lies under `{prefix}`: the model's fields with parameters are {}",
                roots.into_iter().collect::<Vec<_>>().join(", ")
            ),
        ));
    }
    Ok(count)
}

impl<M: Module + Clone, B, const D: usize> Staged<D> for Blocks<M, B, D> {
    type Module = M;
    type Batch = B;

    fn units(&self, module: &M) -> Vec<UnitDecl> {
        let prefixes: Vec<String> = self.stacks.iter().map(|(f, _)| format!("{f}.")).collect();
        let root: Vec<String> = param_shapes(module)
            .into_iter()
            .map(|(p, _)| p)
            .filter(|p| !prefixes.iter().any(|f| p.starts_with(f)))
            .collect();
        let mut units = vec![UnitDecl {
            name: "root".into(),
            prefixes: root,
            uses: Vec::new(),
        }];
        let last = self.count();
        for (s, (field, n)) in self.stacks.iter().enumerate() {
            for i in 0..*n {
                let name = format!("{field}.{i}");
                let unit = UnitDecl::new(name.clone(), &[&name]);
                let reads_root =
                    units.len() == last || (i == 0 && self.pieces.stacks[s].before.is_some());
                units.push(if reads_root { unit.using(&[0]) } else { unit });
            }
        }
        units
    }

    fn forward(
        &self,
        module: &M,
        unit: usize,
        input: Option<Tensor<D>>,
        side: &mut Side,
        batch: &B,
        device: &Device,
    ) -> Flow<D> {
        let Some(x) = input else {
            return Flow::Hidden((self.pieces.embed)(module, batch, side, device));
        };
        let (s, i) = self.locate(unit);
        let stack = &self.pieces.stacks[s];
        let x = match (&stack.before, i) {
            (Some(before), 0) => {
                let Handover {
                    input,
                    handed,
                    side: put,
                } = before(module, x, batch, side, device);
                if let Some(handed) = handed {
                    let finished = s.checked_sub(1).map_or("embed", |f| &self.stacks[f].0);
                    side.put(finished, handed);
                }
                for (name, t) in put {
                    side.put(name, t);
                }
                input
            }
            _ => x,
        };
        let BlockOutput { hidden, aux } = (stack.block)(module, i, x, batch, side);
        match (unit == self.count(), aux) {
            // The last block's auxiliary loss joins the model's loss here.
            (true, aux) => {
                let loss = self.pieces.loss.as_ref().expect("checked when built");
                let loss = loss(module, hidden, batch, side, device);
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
            let values = crate::transport::staging::to_f32(value.to_device(&device))?;
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
