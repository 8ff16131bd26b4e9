//! What is partitioned where: a [`ShardConfig`] gives each training state the topology level it
//! is split over, plus quantization, compute dtype and prefetch. Presets (`ddp` ... `hier3`)
//! are constructors. The types hold only combinations that mean something: parameters are
//! replicated or split exactly like the optimizer state, a secondary copy and weight
//! quantization exist only for split parameters, gradient settings only for split optimizer
//! state, error feedback only with quantized gradients. [`ShardConfig::validate`] checks what
//! depends on the topology (spans that exist, hops that widen). Plain data; it deliberately
//! touches no MPI.
//!
//! # Spans
//!
//! A state "partitioned over level X" is split evenly among the ranks that share one X. With
//! the topology's levels innermost first (`gcd`, `gpu`, `node`), a [`Span`] counts how many
//! innermost levels the splitting group covers:
//!
//! | span | name | group | size on `2x4x2` |
//! |---|---|---|---|
//! | 0 | `gcd` | this rank alone: a whole copy per rank | 1 |
//! | 1 | `gpu` | the GCDs of one GPU | 2 |
//! | 2 | `node` | the ranks of one node | 8 |
//! | 3 | `world` | every rank | 16 |
//!
//! Span `s > 0` is the communicator `Scope::Within(s - 1)`; a rank's shard index in it is
//! `rank mod size`, the index flat collectives over that group use.

use std::fmt;
use std::str::FromStr;

use burn::tensor::DType;
use ember_comm::Topology;
use serde::{Deserialize, Serialize};

use crate::error::ShardError;

/// How many innermost topology levels a partition group covers (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Span(pub usize);

impl Span {
    /// Size of the group at this span on `topology`.
    pub fn group_size(self, topology: &Topology) -> usize {
        topology.dims()[..self.0].iter().product()
    }

    /// The name of the level whose members share one copy (`gcd`, `gpu`, `node`, `world`).
    pub fn name(self, topology: &Topology) -> String {
        match topology.levels().get(self.0) {
            Some(level) => level.name.clone(),
            None => "world".to_string(),
        }
    }

    /// Parses a level name (`gcd`, `gpu`, `node`, `world`, or any level name of `topology`).
    pub fn parse(name: &str, topology: &Topology) -> Result<Self, ShardError> {
        if name == "world" {
            return Ok(Span(topology.depth()));
        }
        topology
            .levels()
            .iter()
            .position(|l| l.name == name)
            .map(Span)
            .ok_or_else(|| {
                let mut names: Vec<String> =
                    topology.levels().iter().map(|l| l.name.clone()).collect();
                names.push("world".into());
                ShardError::setting(
                    "span",
                    name,
                    format!("not a level; use one of {}", names.join(", ")),
                )
            })
    }
}

/// Weight quantization for the parameter all-gather (ZeRO++ qwZ).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightQuant {
    /// Gather in the compute dtype.
    Off,
    /// Symmetric blockwise int8 with an f32 scale per block.
    Int8,
}

/// Gradient quantization for the reduce-scatter (ZeRO++ qgZ: an all-to-all per hop).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GradQuant {
    /// Reduce in the compute dtype (f32, or bf16 when computing in bf16).
    Off,
    /// Symmetric blockwise int8.
    Int8,
    /// Symmetric blockwise int4, two per byte.
    Int4,
}

/// The dtype parameters are held, gathered and reduced in, and forward and backward compute in
/// unless the plan widens them to f32 ([`crate::Plan::computing_in`]); masters and optimizer
/// state are always f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compute {
    /// 4 bytes per parameter.
    F32,
    /// 2 bytes per parameter; gathers and unquantized gradient reductions move bf16.
    Bf16,
}

impl fmt::Display for Compute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Compute::F32 => "f32",
            Compute::Bf16 => "bf16",
        })
    }
}

impl Compute {
    /// The tensor dtype.
    pub fn dtype(self) -> DType {
        match self {
            Compute::F32 => DType::F32,
            Compute::Bf16 => DType::BF16,
        }
    }

    /// Bytes per parameter element.
    pub fn bytes(self) -> usize {
        match self {
            Compute::F32 => 4,
            Compute::Bf16 => 2,
        }
    }
}

/// Where every training state lives and how it moves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Flat", into = "Flat")]
pub struct ShardConfig {
    /// Preset this was built from (informational; the fields below are what runs).
    pub preset: Preset,
    /// Where the optimizer state, gradients and parameters live.
    pub states: States,
    /// Elements per quantization block (one f32 scale each).
    pub quant_block: usize,
    /// The parameters' dtype in gathers, reductions and (unless widened) compute.
    pub compute: Compute,
    /// Units gathered ahead of the one computing (0 = no overlap).
    pub prefetch: usize,
    /// Whether partitioned parameters' units recompute their forward in backward (and gather
    /// again for it), or keep their activations and gathered parameters from forward to
    /// backward. Replicated parameters never recompute.
    pub recompute: Recompute,
}

/// Where the training states live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum States {
    /// Every state whole on every rank; gradients all-reduced (DDP).
    Replicated,
    /// The optimizer state split over a group of levels (ZeRO-1 and up).
    Sharded(Sharded),
}

/// Split optimizer state, and what follows from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sharded {
    /// The optimizer state's partition (f32 master, and the optimizer's own state); at
    /// least one level.
    pub optimizer: Span,
    /// The gradient reduce-scatter's hops before the last, innermost first, as the span each
    /// ends at; the last hop ends at `optimizer`. Empty: one hop.
    pub inner_hops: Vec<Span>,
    /// Whether gradients are partitioned (ZeRO-2 and up: reduced after every micro-batch into
    /// the optimizer's shard) or kept whole until the step's last micro-batch (ZeRO-1).
    pub shard_grads: bool,
    /// Where partitioned gradients accumulate over a step's micro-batches: one of
    /// `inner_hops`. Every micro-batch's reduction runs the hops up to it and adds the result
    /// into an f32 shard of that span; the hops beyond it run once, after the last
    /// micro-batch, so the slow outer links carry gradients once per step instead of once per
    /// micro-batch. `None`: every hop after every micro-batch (ZeRO-2/3, ZeRO++).
    pub accumulate: Option<Span>,
    /// Gradient quantization of the reduce-scatter (`None`: reduce in the compute dtype).
    pub quantize_grads: Option<GradQuantize>,
    /// The parameters.
    pub params: Params,
}

/// Quantized gradient reduction (ZeRO++ qgZ: an all-to-all per hop).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GradQuantize {
    /// Int8 or int4.
    pub format: GradQuant,
    /// Keep each rank's quantization error per hop and add it to the next step's gradient
    /// (LoCo-style error feedback). DeepSpeed's qgZ has none.
    pub error_feedback: bool,
}

/// The parameters of split optimizer state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Params {
    /// Whole on every rank (ZeRO-1, ZeRO-2): the updated shards are all-gathered each step.
    Replicated,
    /// Split exactly like the optimizer state (ZeRO-3): the updated master shard becomes the
    /// parameter shard.
    Sharded {
        /// Secondary parameter copy (hpZ), sliced from the first forward gather of a step and
        /// used by backward and later micro-batches; `None` re-gathers from the primary.
        secondary: Option<Span>,
        /// Weight quantization of parameter gathers.
        quantize_weights: WeightQuant,
    },
}

/// The on-disk form of a [`ShardConfig`] (checkpoint manifests, `ember plan --json`): one
/// field per setting, as earlier versions wrote it. Reading one checks that its fields
/// combine into a [`ShardConfig`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Flat {
    preset: Preset,
    params: Span,
    secondary: Option<Span>,
    optimizer: Span,
    grad_hops: Vec<Span>,
    shard_grads: bool,
    /// Absent in manifests written before gradients could accumulate inside the path.
    #[serde(default)]
    accumulate: Option<Span>,
    quantize_weights: WeightQuant,
    quantize_grads: GradQuant,
    quant_block: usize,
    error_feedback: bool,
    compute: Compute,
    prefetch: usize,
    #[serde(default)]
    recompute: Recompute,
}

impl From<ShardConfig> for Flat {
    fn from(c: ShardConfig) -> Self {
        Flat {
            params: c.params(),
            secondary: c.secondary(),
            optimizer: c.optimizer(),
            grad_hops: c.grad_hops(),
            shard_grads: c.shard_grads(),
            accumulate: c.accumulate(),
            quantize_weights: c.quantize_weights(),
            quantize_grads: c.quantize_grads(),
            error_feedback: c.error_feedback(),
            preset: c.preset,
            quant_block: c.quant_block,
            compute: c.compute,
            prefetch: c.prefetch,
            recompute: c.recompute,
        }
    }
}

impl TryFrom<Flat> for ShardConfig {
    type Error = ShardError;

    fn try_from(f: Flat) -> Result<Self, ShardError> {
        let hops = format!("{:?}", f.grad_hops);
        let states = match f.grad_hops.split_last() {
            None if f.optimizer == Span(0) && f.params == Span(0) && !f.shard_grads => {
                States::Replicated
            }
            Some((&last, inner)) if last == f.optimizer && f.optimizer != Span(0) => {
                let params = if f.params == Span(0) {
                    Params::Replicated
                } else if f.params == f.optimizer {
                    Params::Sharded {
                        secondary: None,
                        quantize_weights: WeightQuant::Off,
                    }
                } else {
                    return Err(ShardError::setting(
                        "params",
                        f.params.0,
                        format!(
                            "parameters are either replicated (span 0) or split exactly like \
                             the optimizer state (span {}): the updated master shard becomes \
                             the parameter shard",
                            f.optimizer.0
                        ),
                    ));
                };
                States::Sharded(Sharded {
                    optimizer: f.optimizer,
                    inner_hops: inner.to_vec(),
                    shard_grads: f.shard_grads,
                    accumulate: None,
                    quantize_grads: None,
                    params,
                })
            }
            _ => {
                return Err(ShardError::setting(
                    "grad_hops",
                    hops,
                    format!(
                        "the gradient path must end at the optimizer state's span ({}) so each \
                         rank receives the shard it updates; replicated optimizer state (span \
                         0) all-reduces whole gradients into replicated parameters, with no \
                         path",
                        f.optimizer.0
                    ),
                ));
            }
        };
        let mut c = ShardConfig {
            preset: f.preset,
            states,
            quant_block: f.quant_block,
            compute: f.compute,
            prefetch: f.prefetch,
            recompute: f.recompute,
        };
        c.set_secondary(f.secondary)?;
        c.set_quantize_weights(f.quantize_weights)?;
        c.set_quantize_grads(f.quantize_grads)?;
        c.set_error_feedback(f.error_feedback)?;
        c.set_accumulate(f.accumulate)?;
        Ok(c)
    }
}

/// What a unit with partitioned parameters keeps from its forward for its backward.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Only its input: backward gathers the unit again and recomputes its forward with
    /// autodiff (4/3 of the forward FLOPs; one unit's activations and parameters at a time).
    #[default]
    Unit,
    /// Its autodiff graph: activations and the gathered parameters stay from forward to
    /// backward (no second gather, no recompute; every unit's at once per micro-batch).
    None,
}

impl fmt::Display for Recompute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Recompute::Unit => "unit",
            Recompute::None => "none",
        })
    }
}

/// The sharding presets, by the names the CLI and checkpoints use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Preset {
    /// Everything replicated; gradients all-reduced (PyTorch DDP).
    Ddp,
    /// Optimizer state sharded over the world.
    Zero1,
    /// Optimizer state and gradients sharded.
    Zero2,
    /// Parameters too (FSDP2 `fully_shard`, DeepSpeed stage 3).
    Zero3,
    /// ZeRO-3 with int8 weight gathers, an int8 secondary copy per node and int8 two-hop
    /// gradients (DeepSpeed ZeRO++).
    Zeropp,
    /// ZeRO++ with the secondary copy and every hop following the topology's levels.
    Hier3,
}

impl Preset {
    /// Every preset, from plain data parallelism to the three-level hierarchy.
    pub const ALL: [Preset; 6] = [
        Preset::Ddp,
        Preset::Zero1,
        Preset::Zero2,
        Preset::Zero3,
        Preset::Zeropp,
        Preset::Hier3,
    ];

    /// Its name (`zero3`).
    pub fn name(self) -> &'static str {
        match self {
            Preset::Ddp => "ddp",
            Preset::Zero1 => "zero1",
            Preset::Zero2 => "zero2",
            Preset::Zero3 => "zero3",
            Preset::Zeropp => "zeropp",
            Preset::Hier3 => "hier3",
        }
    }

    /// Every preset's name, for messages: `ddp, zero1, ...`.
    pub fn names() -> String {
        Self::ALL.map(Preset::name).join(", ")
    }

    /// Its configuration for a topology of `depth` levels (the level spans depend on it).
    /// Presets are defined for any depth: `zeropp`'s secondary is the outermost-but-one level
    /// (the node on a three-level topology), `hier3`'s the innermost shared one (the GPU's GCD
    /// pair).
    pub fn config(self, depth: usize) -> ShardConfig {
        ShardConfig::of_preset(self, depth)
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Preset {
    type Err = ShardError;

    fn from_str(s: &str) -> Result<Self, ShardError> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                ShardError::setting(
                    "preset",
                    s,
                    format!("not a preset; use one of {}", Self::names()),
                )
            })
    }
}

/// Default quantization block. Smaller blocks track the gradient's local scale better at the
/// cost of one f32 scale per block (6% more bytes than the int4 data at 128, 3% at 256).
/// Measured on `tiny`, 300 steps, hier3 at 2x2x2 against zero3: the largest gap of a logged
/// step's loss is 1.99% with blocks of 256, 1.08% with 128, 0.53% with 64 (val loss +1.21%,
/// +0.70%, +0.25%; BENCHMARKS.md): 128 keeps every step within 2% with room to spare.
pub const DEFAULT_QUANT_BLOCK: usize = 128;

impl ShardConfig {
    /// Everything replicated (DDP), in f32, one unit prefetched.
    fn replicated(preset: Preset) -> Self {
        ShardConfig {
            preset,
            states: States::Replicated,
            quant_block: DEFAULT_QUANT_BLOCK,
            compute: Compute::F32,
            prefetch: 1,
            recompute: Recompute::Unit,
        }
    }

    /// A preset on a topology of `depth` levels ([`Preset::config`]).
    fn of_preset(preset: Preset, depth: usize) -> Self {
        let world = Span(depth);
        let sharded = |inner_hops: Vec<Span>, shard_grads, quantize_grads, params| {
            States::Sharded(Sharded {
                optimizer: world,
                inner_hops,
                shard_grads,
                accumulate: None,
                quantize_grads,
                params,
            })
        };
        let int4 = Some(GradQuantize {
            format: GradQuant::Int4,
            error_feedback: false,
        });
        let split = |secondary, quantize_weights| Params::Sharded {
            secondary,
            quantize_weights,
        };
        let states = match preset {
            Preset::Ddp => States::Replicated,
            Preset::Zero1 => sharded(vec![], false, None, Params::Replicated),
            Preset::Zero2 => sharded(vec![], true, None, Params::Replicated),
            Preset::Zero3 => sharded(vec![], true, None, split(None, WeightQuant::Off)),
            Preset::Zeropp => sharded(
                if depth >= 2 {
                    vec![Span(depth - 1)]
                } else {
                    vec![]
                },
                true,
                int4,
                split(Some(Span(depth.saturating_sub(1))), WeightQuant::Int8),
            ),
            // Each state on a level of its own: the secondary copy over the GCD pair,
            // gradients accumulated over the node (the path's last inner hop), the optimizer
            // state over the world; only a step's last micro-batch sends gradients across
            // nodes.
            Preset::Hier3 => States::Sharded(Sharded {
                optimizer: world,
                inner_hops: (1..depth).map(Span).collect(),
                shard_grads: true,
                accumulate: (depth > 1).then(|| Span(depth - 1)),
                quantize_grads: int4,
                params: split(Some(Span(1.min(depth))), WeightQuant::Int8),
            }),
        };
        ShardConfig {
            states,
            ..ShardConfig::replicated(preset)
        }
    }

    /// The split optimizer state's settings (`None` when everything is replicated).
    fn sharded(&self) -> Option<&Sharded> {
        match &self.states {
            States::Replicated => None,
            States::Sharded(s) => Some(s),
        }
    }

    /// Primary parameter partition (compute dtype): `Span(0)` when replicated, else the
    /// optimizer state's.
    pub fn params(&self) -> Span {
        match self.sharded() {
            Some(s) if matches!(s.params, Params::Sharded { .. }) => s.optimizer,
            _ => Span(0),
        }
    }

    /// The recompute that happens: [`recompute`](Self::recompute), except that replicated
    /// parameters never recompute (their units run in one autodiff graph per micro-batch).
    pub fn recompute_done(&self) -> Recompute {
        if self.params() == Span(0) {
            Recompute::None
        } else {
            self.recompute
        }
    }

    /// The secondary parameter copy's partition (hpZ), if any.
    pub fn secondary(&self) -> Option<Span> {
        match self.sharded().map(|s| s.params) {
            Some(Params::Sharded { secondary, .. }) => secondary,
            _ => None,
        }
    }

    /// Optimizer state partition: `Span(0)` when replicated.
    pub fn optimizer(&self) -> Span {
        self.sharded().map_or(Span(0), |s| s.optimizer)
    }

    /// The gradient reduce-scatter's hops, innermost first, as the span each hop ends at; the
    /// last is the optimizer's. Empty when the optimizer state is replicated (an all-reduce).
    pub fn grad_hops(&self) -> Vec<Span> {
        self.sharded().map_or_else(Vec::new, |s| {
            s.inner_hops
                .iter()
                .copied()
                .chain(std::iter::once(s.optimizer))
                .collect()
        })
    }

    /// Whether gradients are partitioned after every micro-batch (ZeRO-2 and up).
    pub fn shard_grads(&self) -> bool {
        self.sharded().is_some_and(|s| s.shard_grads)
    }

    /// Where partitioned gradients accumulate over a step's micro-batches, when inside the
    /// gradient path (see [`Sharded::accumulate`]).
    pub fn accumulate(&self) -> Option<Span> {
        self.sharded().and_then(|s| s.accumulate)
    }

    /// Weight quantization of parameter gathers.
    pub fn quantize_weights(&self) -> WeightQuant {
        match self.sharded().map(|s| s.params) {
            Some(Params::Sharded {
                quantize_weights, ..
            }) => quantize_weights,
            _ => WeightQuant::Off,
        }
    }

    /// Gradient quantization of the reduce-scatter.
    pub fn quantize_grads(&self) -> GradQuant {
        self.sharded()
            .and_then(|s| s.quantize_grads)
            .map_or(GradQuant::Off, |q| q.format)
    }

    /// Whether quantized gradients carry their error to the next step.
    pub fn error_feedback(&self) -> bool {
        self.sharded()
            .and_then(|s| s.quantize_grads)
            .is_some_and(|q| q.error_feedback)
    }

    /// Sets the secondary parameter copy; only split parameters have one.
    pub fn set_secondary(&mut self, span: Option<Span>) -> Result<(), ShardError> {
        match (&mut self.states, span) {
            (
                States::Sharded(Sharded {
                    params: Params::Sharded { secondary, .. },
                    ..
                }),
                span,
            ) => {
                *secondary = span;
                Ok(())
            }
            (_, None) => Ok(()),
            (_, Some(s)) => Err(ShardError::setting(
                "secondary",
                format!("span {}", s.0),
                "a secondary copy needs partitioned parameters: replicated parameters are \
                 never re-gathered",
            )
            .with_fix("secondary", "none")),
        }
    }

    /// Sets weight quantization; only split parameters are gathered.
    pub fn set_quantize_weights(&mut self, q: WeightQuant) -> Result<(), ShardError> {
        match (&mut self.states, q) {
            (
                States::Sharded(Sharded {
                    params:
                        Params::Sharded {
                            quantize_weights, ..
                        },
                    ..
                }),
                q,
            ) => {
                *quantize_weights = q;
                Ok(())
            }
            (_, WeightQuant::Off) => Ok(()),
            (_, WeightQuant::Int8) => Err(ShardError::setting(
                "quantize_weights",
                "int8",
                "weight quantization applies to parameter gathers; replicated parameters are \
                 never gathered",
            )
            .with_fix("quantize_weights", "off")),
        }
    }

    /// Sets gradient quantization (keeping error feedback where it stays quantized); only a
    /// reduce-scatter into split optimizer state is quantized.
    pub fn set_quantize_grads(&mut self, q: GradQuant) -> Result<(), ShardError> {
        match (&mut self.states, q) {
            (States::Sharded(s), GradQuant::Off) => {
                s.quantize_grads = None;
                Ok(())
            }
            (States::Sharded(s), format) => {
                let error_feedback = s.quantize_grads.is_some_and(|q| q.error_feedback);
                s.quantize_grads = Some(GradQuantize {
                    format,
                    error_feedback,
                });
                Ok(())
            }
            (States::Replicated, GradQuant::Off) => Ok(()),
            (States::Replicated, q) => Err(ShardError::setting(
                "quantize_grads",
                format!("{q:?}").to_lowercase(),
                "gradient quantization rides the all-to-all reduce-scatter; with replicated \
                 optimizer state gradients are all-reduced",
            )
            .with_fix("quantize_grads", "off")),
        }
    }

    /// Turns error feedback on or off; it exists only for quantized gradients.
    pub fn set_error_feedback(&mut self, on: bool) -> Result<(), ShardError> {
        match &mut self.states {
            States::Sharded(Sharded {
                quantize_grads: Some(q),
                ..
            }) => {
                q.error_feedback = on;
                Ok(())
            }
            _ if !on => Ok(()),
            _ => Err(ShardError::setting(
                "error_feedback",
                true,
                "error feedback compensates gradient quantization, which is off",
            )
            .with_fix("quantize_grads", "int4")),
        }
    }

    /// Sets where partitioned gradients accumulate over a step's micro-batches: one of the
    /// gradient path's inner hops (checked by [`validate`](Self::validate)), or `None`.
    pub fn set_accumulate(&mut self, span: Option<Span>) -> Result<(), ShardError> {
        match (&mut self.states, span) {
            (States::Sharded(s), span) if s.shard_grads => {
                s.accumulate = span;
                Ok(())
            }
            (_, None) => Ok(()),
            (States::Sharded(_), Some(s)) => Err(ShardError::setting(
                "accumulate",
                format!("span {}", s.0),
                "unpartitioned gradients (ZeRO-1) already accumulate whole and are reduced once \
                 per step",
            )
            .with_fix("accumulate", "none")),
            (States::Replicated, Some(s)) => Err(ShardError::setting(
                "accumulate",
                format!("span {}", s.0),
                "replicated optimizer state all-reduces gradients in one hop: there is no \
                 inner hop to accumulate at",
            )
            .with_fix("accumulate", "none")),
        }
    }

    /// Checks the spans against `topology`; the error says what is wrong and why.
    pub fn validate(&self, topology: &Topology) -> Result<(), ShardError> {
        let depth = topology.depth();
        let name = |s: Span| s.name(topology);
        for (field, span) in [("optimizer", self.optimizer())]
            .into_iter()
            .chain(self.secondary().map(|s| ("secondary", s)))
            .chain(self.grad_hops().into_iter().map(|s| ("grad_hops", s)))
        {
            if span.0 > depth {
                return Err(ShardError::setting(
                    field,
                    format!("span {}", span.0),
                    format!("exceeds the topology's {depth} levels"),
                ));
            }
        }
        if let Some(s) = self.sharded() {
            if s.optimizer == Span(0) {
                return Err(ShardError::setting(
                    "optimizer",
                    name(s.optimizer),
                    "split optimizer state needs a group of at least one level; replicated \
                     state is States::Replicated",
                ));
            }
            let hops = self.grad_hops();
            if hops.windows(2).any(|w| w[0] >= w[1]) || hops[0] == Span(0) {
                return Err(ShardError::setting(
                    "grad_hops",
                    format!("{hops:?}"),
                    "gradient hops must widen strictly, innermost first, starting above the \
                     gcd level, and end at the optimizer state's",
                ));
            }
            if let Some(span) = s.accumulate
                && !s.inner_hops.contains(&span)
            {
                return Err(ShardError::setting(
                    "accumulate",
                    name(span),
                    format!(
                        "gradients accumulate at the end of one of the path's inner hops ({}), \
                         so that hops remain to run once per step",
                        if s.inner_hops.is_empty() {
                            "this path has none: it is one hop".to_string()
                        } else {
                            s.inner_hops
                                .iter()
                                .map(|&h| name(h))
                                .collect::<Vec<_>>()
                                .join(", ")
                        }
                    ),
                )
                .with_fix("accumulate", "none"));
            }
            if let Some(secondary) = self.secondary()
                && secondary >= s.optimizer
            {
                return Err(ShardError::setting(
                    "secondary",
                    name(secondary),
                    format!(
                        "the secondary copy must be split over a smaller group than the \
                         primary ({}): otherwise it saves no traffic",
                        name(s.optimizer)
                    ),
                ));
            }
        }
        if self.quant_block == 0 || !self.quant_block.is_multiple_of(8) {
            return Err(ShardError::setting(
                "quant_block",
                self.quant_block,
                "must be a positive multiple of 8",
            ));
        }
        Ok(())
    }

    /// Elements each unit's flat buffer is padded to a multiple of, per world rank: the
    /// quantization block when anything is quantized, else 1 (see `plan`).
    pub fn pad_block(&self) -> usize {
        if self.quantize_weights() != WeightQuant::Off || self.quantize_grads() != GradQuant::Off {
            self.quant_block
        } else {
            1
        }
    }
}

impl fmt::Display for ShardConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (params span {}, secondary {:?}, optimizer span {}, grad hops {:?}, \
             sharded grads {}, accumulate {:?}, weights {:?}, grads {:?}, {:?}, prefetch {}, \
             recompute {:?})",
            self.preset,
            self.params().0,
            self.secondary().map(|s| s.0),
            self.optimizer().0,
            self.grad_hops().iter().map(|s| s.0).collect::<Vec<_>>(),
            self.shard_grads(),
            self.accumulate().map(|s| s.0),
            self.quantize_weights(),
            self.quantize_grads(),
            self.compute,
            self.prefetch,
            self.recompute
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(spec: &str) -> Topology {
        Topology::parse(spec).unwrap()
    }

    #[test]
    fn every_preset_is_valid_on_every_test_topology() {
        for spec in ["1", "2x1x1", "1x2x2", "2x2x2", "2x4x1", "4x1x2"] {
            for p in Preset::ALL {
                let c = p.config(3);
                c.validate(&t(spec))
                    .unwrap_or_else(|e| panic!("{p} at {spec}: {e}"));
            }
        }
    }

    #[test]
    fn presets_put_each_state_on_its_level() {
        let hier3 = Preset::Hier3.config(3);
        assert_eq!(hier3.grad_hops(), vec![Span(1), Span(2), Span(3)]);
        assert_eq!(hier3.secondary(), Some(Span(1)));
        assert_eq!(hier3.accumulate(), Some(Span(2)));
        let zpp = Preset::Zeropp.config(3);
        assert_eq!(zpp.grad_hops(), vec![Span(2), Span(3)]);
        assert_eq!(zpp.secondary(), Some(Span(2)));
        assert_eq!(zpp.accumulate(), None);
        let ddp = Preset::Ddp.config(3);
        assert_eq!((ddp.params(), ddp.optimizer()), (Span(0), Span(0)));
        let z1 = Preset::Zero1.config(3);
        let z2 = Preset::Zero2.config(3);
        assert!(!z1.shard_grads() && z2.shard_grads());
        assert!("zero4".parse::<Preset>().is_err());
    }

    #[test]
    fn settings_that_mean_nothing_are_refused_with_the_reason() {
        let mut ddp = Preset::Ddp.config(3);
        let e = ddp
            .set_quantize_grads(GradQuant::Int4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("all-reduced"), "{e}");
        let mut zero1 = Preset::Zero1.config(3);
        let e = zero1
            .set_quantize_weights(WeightQuant::Int8)
            .unwrap_err()
            .to_string();
        assert!(e.contains("never gathered"), "{e}");
        let e = zero1.set_secondary(Some(Span(1))).unwrap_err().to_string();
        assert!(e.contains("needs partitioned parameters"), "{e}");
        let mut zero3 = Preset::Zero3.config(3);
        let e = zero3.set_error_feedback(true).unwrap_err().to_string();
        assert!(e.contains("set quantize_grads to int4"), "{e}");
        // Turning something off is always fine.
        ddp.set_secondary(None).unwrap();
        ddp.set_error_feedback(false).unwrap();
    }

    #[test]
    fn spans_the_topology_cannot_hold_are_refused() {
        let topo = t("2x2x2");
        let mut c = Preset::Zero3.config(3);
        c.set_secondary(Some(Span(3))).unwrap();
        let e = c.validate(&topo).unwrap_err().to_string();
        assert!(e.contains("smaller group"), "{e}");
        let mut c = Preset::Hier3.config(3);
        if let States::Sharded(s) = &mut c.states {
            s.inner_hops = vec![Span(2), Span(1)];
        }
        let e = c.validate(&topo).unwrap_err().to_string();
        assert!(e.contains("widen strictly"), "{e}");
        // Gradients accumulate only where hops remain beyond.
        let mut c = Preset::Zero3.config(3);
        c.set_accumulate(Some(Span(2))).unwrap();
        let e = c.validate(&topo).unwrap_err().to_string();
        assert!(e.contains("one hop"), "{e}");
        let mut c = Preset::Hier3.config(3);
        c.set_accumulate(Some(Span(3))).unwrap();
        let e = c.validate(&topo).unwrap_err().to_string();
        assert!(e.contains("gpu, node"), "{e}");
        let e = Preset::Zero1
            .config(3)
            .set_accumulate(Some(Span(2)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("once per step"), "{e}");
    }

    #[test]
    fn the_disk_form_is_read_back_and_checked() {
        for p in Preset::ALL {
            let c = p.config(3);
            let json = serde_json::to_string(&c).unwrap();
            assert!(json.contains("\"grad_hops\""), "{json}");
            assert_eq!(
                serde_json::from_str::<ShardConfig>(&json).unwrap(),
                c,
                "{p}"
            );
        }
        // Parameters split over the node while the optimizer state spans the world.
        let mut flat: serde_json::Value = serde_json::to_value(Preset::Zero3.config(3)).unwrap();
        flat["params"] = serde_json::json!(2);
        let e = serde_json::from_value::<ShardConfig>(flat)
            .unwrap_err()
            .to_string();
        assert!(e.contains("exactly like"), "{e}");
        let mut flat: serde_json::Value = serde_json::to_value(Preset::Zero3.config(3)).unwrap();
        flat["grad_hops"] = serde_json::json!([2]);
        let e = serde_json::from_value::<ShardConfig>(flat)
            .unwrap_err()
            .to_string();
        assert!(e.contains("must end"), "{e}");
    }

    #[test]
    fn non_preset_combinations_are_accepted() {
        let topo = t("2x2x2");
        // HSDP-like: everything split inside the node, replicated across nodes.
        let mut c = Preset::Zero3.config(3);
        c.states = States::Sharded(Sharded {
            optimizer: Span(2),
            inner_hops: vec![Span(1)],
            shard_grads: true,
            accumulate: Some(Span(1)),
            quantize_grads: Some(GradQuantize {
                format: GradQuant::Int8,
                error_feedback: false,
            }),
            params: Params::Sharded {
                secondary: Some(Span(1)),
                quantize_weights: WeightQuant::Off,
            },
        });
        c.validate(&topo).unwrap();
        // ZeRO-3 with a whole copy per rank kept through backward (FSDP's
        // reshard_after_forward=False).
        let mut c = Preset::Zero3.config(3);
        c.set_secondary(Some(Span(0))).unwrap();
        c.validate(&topo).unwrap();
    }

    #[test]
    fn span_names_follow_the_topology() {
        let topo = t("2x4x2");
        assert_eq!(Span(0).name(&topo), "gcd");
        assert_eq!(Span(1).group_size(&topo), 2);
        assert_eq!(Span(2).group_size(&topo), 8);
        assert_eq!(Span(3).name(&topo), "world");
        assert_eq!(Span::parse("node", &topo).unwrap(), Span(2));
        assert!(Span::parse("rack", &topo).is_err());
    }
}
