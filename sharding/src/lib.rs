//! Hierarchical ZeRO for any Burn module: parameters, gradients and optimizer state each
//! partitioned over a configurable level of the machine's topology (die pair, node, cluster),
//! with ZeRO++'s quantized gathers and reductions and secondary parameter copies as options.
//! Every state is a Burn tensor on the run's device; communication goes through `ember-comm`
//! (MPI) only. The crate knows no particular model.
//!
//! # Sharding a model whose blocks sit in a `Vec`
//!
//! A model in plain Burn, with its repeated blocks in a field such as `blocks: Vec<Block>`,
//! tells the partitioner the three pieces its own forward is made of: what comes before the
//! blocks, one block, and what comes after them down to the loss, as three closures (or a
//! [`BlockModel`] impl). Its `forward` can call the same three pieces, so no math is written
//! twice. Then:
//!
//! ```
//! # use burn::module::Module;
//! # use burn::nn::{Linear, LinearConfig};
//! # use burn::tensor::activation::relu;
//! # use burn::tensor::{Device, Tensor, TensorData};
//! # use ember_comm::Comm;
//! # use ember_sharding::{AdamW, Preset, SaveOptions, Shard, ShardError};
//! # // A model in plain Burn whose blocks sit in `blocks`.
//! # #[derive(Module, Debug)]
//! # struct Mlp { stem: Linear, blocks: Vec<Linear>, head: Linear }
//! # #[derive(serde::Serialize)]
//! # struct MlpConfig { width: usize }
//! # impl MlpConfig {
//! #     fn init(&self, d: &Device) -> Mlp {
//! #         let linear = |i, o| LinearConfig::new(i, o).init(d);
//! #         let w = self.width;
//! #         Mlp { stem: linear(2, w), blocks: (0..3).map(|_| linear(w, w)).collect(), head: linear(w, 1) }
//! #     }
//! # }
//! # // A batch: inputs and targets, Burn tensors that split by rows as they are.
//! # type Batch = (Tensor<2>, Tensor<2>);
//! # fn global_batch(step: u64, device: &Device) -> Batch {
//! #     let x: Vec<f32> = (0..16).map(|i| (i + step) as f32 / 16.0).collect();
//! #     let y: Vec<f32> = x.chunks(2).map(|p| p[0] * p[1]).collect();
//! #     (Tensor::from_data(TensorData::new(x, [8, 2]), device),
//! #      Tensor::from_data(TensorData::new(y, [8, 1]), device))
//! # }
//! # fn mse(prediction: Tensor<2>, target: &Tensor<2>) -> Tensor<1> {
//! #     let e = prediction - target.clone();
//! #     (e.clone() * e).mean()
//! # }
//! # fn main() -> Result<(), ShardError> {
//! # let (steps, lr) = (3, |_: u64| 1e-3);
//! # let dir = std::env::temp_dir().join(format!("ember-guide-{}", std::process::id()));
//! # let (config, resume) = (MlpConfig { width: 16 }, None::<std::path::PathBuf>);
//! let comm = Comm::from_env()?;                   // mpirun's ranks, or one process
//! let device = Device::flex();                    // or a GPU's
//! let adamw = AdamW::default();                   // torch.optim.AdamW's defaults
//! let mut model = Shard::blocks("blocks")         // each element of `blocks` a unit
//!     .preset(Preset::Hier3)
//!     .record(&config)                            // kept in saves, checked on resume
//!     .resume_from(resume.as_deref())             // a checkpoint, or None: Burn's init
//!     .forward(
//!         |m: &Mlp, (x, _): &Batch, _| m.stem.forward(x.clone()),
//!         |m, i, h, _| h.clone() + relu(m.blocks[i].forward(h)),
//!         |m, h, (_, y), _| mse(m.head.forward(h), y),
//!     )
//!     .build(&comm, |device| config.init(device), device.clone())?;
//! for step in model.step()..steps {
//!     let mut grads = model.backward(&[model.share(&global_batch(step, &device))?])?;
//!     grads.clip_norm(1.0);
//!     model.apply(grads, &adamw, lr(step))?;
//! }
//! model.save(&dir, &SaveOptions::default())?;     // with the record
//! let trained: Mlp = model.gather()?;             // whole, on every rank
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok(())
//! # }
//! ```
//!
//! - [`Shard::blocks`] makes each element of the field a unit and the rest of the model (the
//!   embedding, final norm, head) one more, the root. The starting weights are those of the
//!   model's own `Config::init` (Burn's `Initializer`s): each rank materialises only the
//!   parameters whose ranges it owns, one at a time, with the generator seeded by the
//!   parameter's path, so every world size starts from the same model ([`InitSource`]).
//! - [`Shard::forward`] takes the pieces: `embed(model, batch, device)` to the first block's
//!   input, `block(model, i, x, batch)` to block `i`'s output (or a [`BlockOutput`] with an
//!   auxiliary loss), `loss(model, x, batch, device)` to the loss (see "The step's loss"
//!   below for what it averages). The batch is at hand
//!   in every piece, for side inputs (masks, positions); `device` is where a piece builds
//!   tensors from host data (the partitioner's device, with autodiff or without). A model
//!   may implement [`BlockModel`] instead, and [`Shard::build`] uses it.
//! - [`ShardedModel::backward`] takes this rank's micro-batches of the step (one per
//!   gradient-accumulation micro-step; [`ShardedModel::share`] cuts this rank's rows out of the
//!   global batch, for a batch that implements [`Rows`]: Burn tensors, `Vec`s and tuples of
//!   them do) and returns this rank's shard of the
//!   reduced [`Gradients`], with the loss and the global norm, to read, scale or clip.
//! - [`ShardedModel::apply`] updates the parameters with any [`Optimizer`]: [`AdamW`],
//!   [`Adam`] and [`Sgd`] ship, each matching Burn's optimizer of the same name, and each
//!   `Default` to PyTorch's defaults: `torch.optim.AdamW`'s betas 0.9 and 0.999, eps 1e-8,
//!   weight decay 0.01 on every parameter; `torch.optim.Adam`'s the same without weight
//!   decay; `torch.optim.SGD`'s no momentum, dampening, weight decay or Nesterov.
//!   [`ShardedModel::train_step`] is both calls with clipping ([`StepHyper`]: AdamW unless
//!   it names another optimizer).
//! - [`ShardedModel::save`] writes every rank's own ranges to a safetensors checkpoint, with
//!   the caller's own record in its manifest ([`Shard::record`], or [`SaveOptions::record`]);
//!   [`Shard::resume_from`] continues it at any world size, topology or configuration, each
//!   rank reading only what it owns there, after checking the record, and
//!   [`ShardedModel::step`] says where ([`Shard::resume`] and [`ShardedModel::resume`] take a
//!   [`Checkpoint::open`]ed one).
//! - [`Comm::from_env`](ember_comm::Comm::from_env) takes the ranks `mpirun` started (a world
//!   of one without it) and the topology from `EMBER_TOPOLOGY` (`-x EMBER_TOPOLOGY=2x4x2`),
//!   or detects it: nodes from the ranks that share memory.
//! - [`ShardedModel::gather`] returns the whole module (the f32 master weights) on every rank,
//!   for inference or export with the model's own `forward`; [`ShardedModel::gather_to`] on
//!   one rank alone.
//! - [`Plan`] gives the partition, the per-rank memory and the per-step traffic as plain data,
//!   without MPI.
//!
//! `examples/mlp.rs` is a complete program (an MLP of Burn `Linear` layers, trained under
//! `mpirun`, saved, resumed at another world size, gathered back).
//!
//! # Several stacks of blocks, and side tensors
//!
//! A model with more than one `Vec` of blocks (an encoder and a decoder) names each field
//! with its block piece, in forward order, between [`Shard::embed`] and [`Shard::loss`]; a
//! [`Shard::then`] piece between two stacks turns the first one's output into the second
//! one's input. Every piece gets a [`Side`]: named tensors a piece puts for the pieces after
//! it, of this micro-batch, to read, such as the encoder's output that every decoder block's
//! cross-attention reads. A `then` piece hands one over by returning `(input, handed)`:
//! `handed` is put under the finished stack's field name ([`Handover`]). Gradients flow back
//! through side tensors to where they were put, summed over every unit that read them.
//!
//! ```
//! # use burn::module::Module;
//! # use burn::nn::{Linear, LinearConfig};
//! # use burn::tensor::{Device, Tensor, TensorData};
//! # use ember_comm::Comm;
//! # use ember_sharding::{AdamW, Shard, ShardError, StepLoss};
//! #[derive(Module, Debug)]
//! struct EncDec { embed: Linear, enc: Vec<Linear>, dec: Vec<Linear>, head: Linear }
//! # fn init(d: &Device) -> EncDec {
//! #     let l = |i, o| LinearConfig::new(i, o).init(d);
//! #     EncDec { embed: l(2, 8), enc: vec![l(8, 8), l(8, 8)], dec: vec![l(8, 8)], head: l(8, 1) }
//! # }
//! type Batch = (Tensor<2>, Tensor<2>);
//! # fn main() -> Result<(), ShardError> {
//! # let comm = Comm::from_env()?;
//! # let x = Tensor::<2>::from_data(TensorData::new(vec![0.5f32; 16], [8, 2]), &Device::flex());
//! # let batch: Batch = (x.clone(), x.sum_dim(1));
//! let mut model = Shard::embed(|m: &EncDec, (x, _): &Batch, _, _| m.embed.forward(x.clone()))
//!     .stack("enc", |m, i, h, _, _| m.enc[i].forward(h).tanh())
//!     .then(|m, h, (x, _), _, _| (m.embed.forward(x.clone()), h)) // `h` put as "enc"
//!     .stack("dec", |m, i, h, _, side| m.dec[i].forward(h + side.get::<2>("enc")).tanh())
//!     .loss(|m, h, (_, y), _, _| {
//!         let e = m.head.forward(h) - y.clone();
//!         (e.clone() * e).sum() / 8.0 // this micro-batch's share of the global batch's mean
//!     })
//!     .step_loss(StepLoss::Sum)
//!     .build(&comm, init, Device::flex())?;
//! let grads = model.backward(&model.micro_batches(&batch, 4)?)?;
//! model.apply(grads, &AdamW::default(), 1e-3)?;
//! # Ok(())
//! # }
//! ```
//!
//! The units are the root (every parameter outside the fields), then each block of each
//! field (`enc.0`, `enc.1`, `dec.0`). The root runs `embed`; the first block after a `then`
//! piece runs it first, and the last block runs `loss`, both reading the root.
//! `examples/seq2seq.rs` is a complete encoder-decoder in 16 such lines.
//!
//! # The unit model, for any model
//!
//! Burn's autodiff builds one graph per forward, so a sharded model runs as a sequence of
//! *units*: before a unit computes, its parameters are gathered; after its backward, its
//! gradients are reduced to their owners and the gathered copy is freed. Units are groups of
//! parameters named by path prefix, usually one per transformer block plus the embedding and
//! the head. [`Blocks`] is one way of cutting a model into units; any other is described with
//! [`Staged`], without changing the model's code, and built with [`Shard::staged`] (with the
//! options of every route: preset, seed, record, resume) or with [`ShardedModel::new`] and a
//! [`ParamSource`] (an [`InitSource`], or any function of path and element range):
//!
//! - [`Staged::units`] returns one [`UnitDecl`] per unit, in forward order:
//!   `UnitDecl::new("block3", &["blocks.3"])` owns every parameter whose path starts with
//!   `blocks.3.`; every parameter must belong to exactly one unit. [`UnitDecl::using`] lets a
//!   unit read another unit's parameters too (a tied head reading the embedding). A unit that
//!   reads a parameter of a unit it does not declare fails the step with a
//!   [`ShardError::Model`] naming the unit, the parameter, its owner and the `using` to add
//!   (the read gives zeros, so nothing panics inside Burn first).
//! - [`Staged::forward`] runs unit `k` on the previous unit's activation (one float tensor,
//!   `None` for the first unit), the [`Side`] tensors earlier units put, and the batch,
//!   calling the model's own layers, and returns [`Flow::Hidden`] for the next unit or, from
//!   the last, [`Flow::Loss`].
//!
//! # Randomness, and recompute
//!
//! Unless [`Recompute::None`] keeps every unit's graph, backward runs each unit's forward a
//! second time, with autodiff, from the input its first forward was given, and takes the
//! gradients from that second run. Both runs are training forwards (on the autodiff device,
//! where Burn's `Dropout` is on), and before each the device's generator is seeded with
//! [`draw_seed`]`(seed, step, micro-batch, unit)`, so the second run draws what the first drew:
//! Burn's `Dropout`, in residual branches or inside `MultiHeadAttention`, and
//! `Tensor::random` give the same masks, and the gradients are those of the loss the step
//! reports, as PyTorch's activation checkpointing replays its saved generator state. Every
//! preset and recompute setting draws the same, and the micro-batch counts the global batch's
//! micro-batches, so `N` ranks of `A` micro-batches each draw what one process of `N * A`
//! micro-batches of the same rows draws ([`ShardedModel::micro_batches`] cuts them); plain
//! Burn draws the same by seeding its device with [`draw_seed`] before each unit's part of its
//! forward. The seed is [`Shard::seed`]'s, kept in checkpoints. The device's generator is the
//! process's: nothing else should draw from it while a step runs.
//!
//! Anything else that makes a unit give other values the second time (a generator of its
//! own, state kept between calls, a layer that computes otherwise with autodiff) would give
//! gradients of another function. The first step of every [`ShardedModel`] holds each
//! recomputed unit's output, auxiliary loss and side tensors against its first run's and
//! refuses a unit, by its declared name ([`ShardError::Model`]), where an element differs by
//! more than rounding: more than [`rounding_tolerance`] of the output's largest magnitude,
//! that is two units in the last place of its dtype and never less than 2^-14 (2^-14 in f32,
//! 2^-6 in bf16, 2^-9 in f16). Replicated parameters (`ddp`) and [`Recompute::None`] never
//! recompute, so such a unit trains there, as it would in plain Burn.
//!
//! # The step's loss
//!
//! Each micro-batch's loss is what the loss piece (or the last unit's [`Flow::Loss`]) gives,
//! plus the auxiliary losses of its blocks. [`StepLoss`] says how a step combines them over
//! the micro-batches and the ranks, for [`Gradients::loss`], [`StepReport::loss`] and the
//! gradients:
//!
//! - [`StepLoss::Mean`] (the default): their mean. With a loss that averages over each
//!   micro-batch's own tokens, this is the mean over the global batch only when every
//!   micro-batch holds as many tokens; with padding it is the mean of the ranks' means, which
//!   changes with the world size (as DDP's and FSDP's averaging does).
//! - [`StepLoss::Sum`]: their sum, for a loss piece that gives its micro-batch's share of the
//!   global mean: its sum over its own tokens divided by the count of tokens in the whole
//!   global batch, which every rank can count before [`ShardedModel::share`] (torchtitan and
//!   Hugging Face's `num_items_in_batch` do the same). The step's loss is then the mean over
//!   the global batch's tokens, and the run trains as one process at any world size and
//!   micro-batch count.
//!
//! # Parameter paths
//!
//! A parameter's path is its module's field names joined by dots, with `Vec` elements by index:
//! a field `blocks: Vec<Block>` whose block holds `attn: Linear` gives `blocks.3.attn.weight`
//! and `blocks.3.attn.bias`. Burn's layers name their parameters `weight` and `bias`
//! (`Linear`, whose `weight` is `[in, out]`; `Embedding`, `[vocab, dim]`), `gamma` and `beta`
//! (`LayerNorm`), `gamma` (`RmsNorm`). [`params::param_shapes`] lists every path and
//! shape of a module in visit order, which is the order of each unit's flat buffer.
//!
//! # Presets, and what they are elsewhere
//!
//! A [`ShardConfig`] gives each state the [`Span`] of levels it is split over; the presets are
//! the common combinations ("world" is every rank, "node" the ranks of a node, "GPU" the GCDs
//! of one GPU):
//!
//! | preset | parameters | gradients | optimizer state | quantization | elsewhere |
//! |---|---|---|---|---|---|
//! | `ddp` | replicated | all-reduced | replicated | none | PyTorch DDP |
//! | `zero1` | replicated | whole, then reduce-scattered | world | none | DeepSpeed ZeRO-1 |
//! | `zero2` | replicated | world | world | none | DeepSpeed ZeRO-2 |
//! | `zero3` | world | world | world | none | DeepSpeed ZeRO-3; FSDP2 `fully_shard` per block and root |
//! | `zeropp` | world, secondary copy per node | node, then world | world | int8 weights, int4 gradients | DeepSpeed ZeRO++ (qwZ, hpZ, qgZ) |
//! | `hier3` | world, secondary copy per GPU | GPU and node every micro-batch, accumulated over the node, then world once per step | world | int8 weights, int4 gradients | the three-level scheme of arXiv 2501.04266 |
//!
//! A program run without `mpirun` is a world of one rank
//! ([`Comm::from_env`](ember_comm::Comm::from_env)), and every preset trains there. Nothing
//! is sent, so nothing is quantized and no secondary copy is kept: `zeropp` and `hier3` train
//! exactly as `zero3` does ([`Plan::quantizes_weights`], [`Plan::secondary`]).
//!
//! Other equivalents: [`Shard::blocks`] is FSDP2's `fully_shard` on each block and on the
//! root; one [`UnitDecl`] per block is the same by hand;
//! [`Recompute::Unit`] is activation checkpointing per block with parameters resharded after
//! forward; [`ShardConfig::prefetch`] is FSDP2's forward prefetch; [`ShardedModel::save`] and
//! [`Checkpoint::open`] are torch.distributed.checkpoint's save and load; [`ShardedModel::gather`]
//! is a full state dict.
//!
//! # What each state costs a rank
//!
//! For `N` parameters in f32 compute, per rank: the optimizer state is 12 bytes per parameter
//! with Adam or AdamW (f32 master, first and second moment; 8 with SGD's one velocity) over
//! the optimizer group; gradients 4 bytes per
//! parameter over that group when sharded, whole otherwise; the primary parameters 4 bytes
//! (2 in bf16) over their group, or nothing when they are the master itself (f32, split like
//! the optimizer); a secondary copy 1 byte plus one f32 scale per block when weights are
//! quantized. So `zero3` on 8 ranks holds `16 N / 8` bytes of states, `ddp` `16 N`. Gathered
//! units and activations come on top, the largest at one moment of the step: [`Plan::memory`]
//! replays the step's schedule for it, and `ember plan` prints it. With bf16 parameters on a
//! device where bf16 arithmetic is slow, [`Plan::computing_in`] keeps them bf16 in memory and
//! on the wire and computes in f32 (pass that plan to [`ShardedModel::new`]).
//!
//! # Errors and speed
//!
//! Every fallible call returns [`ShardError`]; an impossible configuration is
//! [`ShardError::Setting`], naming the field, its value and what to do, and a step the device
//! cannot run (out of its memory, most often) is [`ShardError::Device`] with the runtime's
//! reason. The float tensors of a batch must come in the dtype the modules compute in
//! (`model.plan().module_dtype`): the partitioner does not see inside a batch, and Burn panics
//! on a product of f32 inputs with bf16 weights. On the CPU, the
//! dependency on this crate brings Burn's flex backend with its multithreaded, SIMD kernels
//! (`rayon`, `simd`) and the AVX-512 matrix kernels, chosen at run time.

pub mod blocks;
mod builder;
mod checkpoint;
pub mod config;
mod engine;
pub mod error;
pub mod optim;
pub mod params;
pub mod plan;
pub mod plumbing;
mod reduce;
mod rows;
mod side;
mod source;
mod stage;
mod transport;

pub use blocks::{BlockModel, BlockOutput, Blocks, Handover, InitSource, Pieces};
pub use builder::{Described, Shard};
pub use checkpoint::{Checkpoint, FileEntry, Manifest, PendingSave, SaveOptions, TensorMeta};
pub use config::{Compute, GradQuant, Preset, Recompute, ShardConfig, Span, WeightQuant};
pub use engine::{
    Gradients, Layout, ShardedModel, StepHyper, StepLoss, StepReport, draw_seed, rounding_tolerance,
};
pub use error::ShardError;
pub use optim::{Adam, AdamW, DecayOn, FlatState, Optimizer, Sgd};
pub use plan::crossings::StagedBytes;
pub use plan::simulate::Interval;
pub use plan::{Memory, Plan};
pub use rows::Rows;
pub use side::Side;
pub use source::{FnSource, ParamSource};
pub use stage::{Flow, Staged, UnitDecl, assign};
pub use transport::memory::Resident;
pub use transport::staging::Staging;
