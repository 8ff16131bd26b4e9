//! The partition as plain data: which elements of which unit each rank owns at each span, the
//! model-state bytes every rank holds, and the bytes every collective of a step moves per
//! group and op. Pure functions of (units, config, topology): `ember plan` prints them without
//! running anything, and the engine's measurements are tested against them.
//!
//! # Layout
//!
//! A unit's parameters are concatenated in visit order into one flat buffer of `numel`
//! elements, padded with zeros at the end to `padded = W * ceil(numel / (W * b)) * b` (`W` the
//! world size, `b` the quantization block when anything is quantized, else 1). Every span's
//! group size divides `W`, so the same padded buffer splits evenly at every span: at span `s`
//! (group size `P`) rank `r` owns `[i * padded / P, (i + 1) * padded / P)` with `i = r mod P`.
//!
//! # Traffic
//!
//! Per optimizer step of `A` micro-batches (see [`Plan::traffic`]): parameter gathers (forward
//! and backward recompute of every micro-batch; from the secondary copy once one exists this
//! step), gradient reductions (every micro-batch when gradients are partitioned, else once),
//! the parameter all-gather after the update when parameters are replicated but optimizer
//! state is not, and two scalar all-reduces (the gradient norm over the optimizer group, the
//! step loss over the world).

pub mod crossings;
pub mod network;
pub mod policy;
pub mod profile;
pub mod schedule;
pub mod simulate;

use std::collections::BTreeMap;

use ember_comm::counters::{Op, Role, Traffic, formula};
use ember_comm::quant::{BlockSize, QuantFormat, Quantized};
use ember_comm::{ShardLayout, Topology};
use serde::Serialize;

use crate::config::{Compute, GradQuant, ShardConfig, Span, WeightQuant};
use crate::error::ShardError;

/// A unit as the user declares it: a name, its parameters (path and shape, in the module's
/// visit order) and the other units whose parameters its computation also reads (a tied
/// output head reads the embedding's).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UnitSpec {
    /// Name for messages and plans (`embed`, `h.3`, `head`).
    pub name: String,
    /// Parameter paths and shapes owned by this unit.
    pub params: Vec<(String, Vec<usize>)>,
    /// Indices of other units this unit's stage also needs gathered.
    pub uses: Vec<usize>,
}

/// One parameter's place in its unit's flat buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ParamSlot {
    /// Module path.
    pub name: String,
    /// Logical shape.
    pub shape: Vec<usize>,
    /// First element in the unit's flat buffer.
    pub offset: usize,
    /// Number of elements.
    pub numel: usize,
    /// Whether AdamW's weight decay applies (tensors of two or more dimensions).
    pub decay: bool,
}

/// A unit's layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UnitPlan {
    /// Unit name.
    pub name: String,
    /// Parameters in flat order.
    pub params: Vec<ParamSlot>,
    /// Real elements.
    pub numel: usize,
    /// Elements after padding (see the module doc).
    pub padded: usize,
    /// Units gathered for this unit's stage: itself first, then its `uses`.
    pub needs: Vec<usize>,
    /// The lowest stage that needs this unit: its gradient is complete once backward has
    /// passed that stage.
    pub grad_ready_at: usize,
}

/// The ranks that vary levels `lo..hi` and share every other coordinate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Levels {
    /// Innermost level varied.
    pub lo: usize,
    /// One past the outermost level varied.
    pub hi: usize,
}

impl Levels {
    /// Number of ranks in the group.
    pub fn size(self, topology: &Topology) -> usize {
        topology.dims()[self.lo..self.hi].iter().product()
    }

    /// A readable name: the levels varied, joined (`gcd`, `gpu+node`, `gcd+gpu+node`).
    pub fn name(self, topology: &Topology) -> String {
        topology.levels()[self.lo..self.hi]
            .iter()
            .map(|l| l.name.as_str())
            .collect::<Vec<_>>()
            .join("+")
    }
}

/// One unit computation in the step's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Visit {
    /// Micro-batch index.
    pub micro: usize,
    /// Backward (with recompute) or inference-only forward.
    pub backward: bool,
    /// The stage (= unit index) computed.
    pub stage: usize,
}

/// The levels a communicator scope varies on a topology of `depth` levels.
pub fn levels_of(scope: ember_comm::Scope, depth: usize) -> Levels {
    match scope {
        ember_comm::Scope::World => Levels { lo: 0, hi: depth },
        ember_comm::Scope::Within(i) => Levels { lo: 0, hi: i + 1 },
        ember_comm::Scope::Across(i) => Levels { lo: i, hi: i + 1 },
        ember_comm::Scope::Span { lo, hi } => Levels { lo, hi },
    }
}

/// Bytes one rank holds during a step, as the plan predicts them from the step's schedule
/// (the same [`crate::plan::schedule::Event`]s the engine executes). Runs measure the process's
/// resident memory instead (see [`plumbing::memory`](crate::plumbing::memory)); tests compare the two.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Memory {
    /// Primary parameter partition in the compute dtype; 0 when it is the f32 master itself
    /// (f32 compute with parameters split like the optimizer state).
    pub params: u64,
    /// Secondary copy, from a unit's first gather of the step to the optimizer step: int8
    /// blocks when weights are quantized (the bytes the gather delivered), else the compute
    /// dtype.
    pub secondary: u64,
    /// Gradient accumulators, f32.
    pub grads: u64,
    /// f32 master, first and second moments.
    pub optimizer: u64,
    /// Error-feedback residuals, f32, one buffer per quantized hop per unit.
    pub residuals: u64,
    /// Largest bytes of gathered whole units alive at once.
    pub gathered_peak: u64,
    /// Largest activation bytes alive at once (unit boundaries kept for backward plus the
    /// autodiff graph being built), from the units' [`ActivationBytes`].
    pub activations_peak: u64,
    /// Largest sum, at one moment of the step, of gathered units, gradient buffers on their
    /// way to the reduction, their staging copies and activations, plus the staging each
    /// communication thread's heap keeps for reuse.
    pub working_peak: u64,
    /// The host copy of the optimizer shard and residuals that a checkpoint written in the
    /// background ([`save_async`](crate::checkpoint::save_async)) is written from, held while
    /// training goes on; 0 unless [`with_background_saves`](Self::with_background_saves).
    #[serde(default)]
    pub checkpoint_staging: u64,
}

impl Memory {
    /// Everything a rank holds at its peak: the states held through the step plus the
    /// working peak (and the host copy of a checkpoint being written in the background).
    pub fn total(&self) -> u64 {
        self.params
            + self.secondary
            + self.grads
            + self.optimizer
            + self.residuals
            + self.working_peak
            + self.checkpoint_staging
    }

    /// The same with checkpoints written in the background: a copy of the optimizer shard
    /// and the residuals in host memory while one is written.
    pub fn with_background_saves(self) -> Self {
        Self {
            checkpoint_staging: self.optimizer + self.residuals,
            ..self
        }
    }
}

/// What one unit's computation keeps alive for one micro-batch: the activation it hands to the
/// next unit, and what autodiff saves for its backward (inputs of matmuls, norms, softmax).
/// The model's owner estimates these; they only feed the plan's memory prediction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ActivationBytes {
    /// Bytes of the unit's output (the next unit's input).
    pub output: u64,
    /// Bytes the unit's autodiff graph keeps until its backward.
    pub saved: u64,
}

/// Bytes per (group, op) of one optimizer step, as one rank sends and receives them.
pub type TrafficTable = BTreeMap<(Levels, Op), Traffic>;

/// The partition of a model's units over a topology.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// The configuration it was built for.
    pub config: ShardConfig,
    /// The topology it was built for.
    pub topology: Topology,
    /// Units in stage order.
    pub units: Vec<UnitPlan>,
    /// What each unit's computation keeps alive per micro-batch (zeros unless given with
    /// [`Plan::with_activations`]).
    pub activations: Vec<ActivationBytes>,
    /// Each unit's forward FLOPs per micro-batch on one rank (zeros unless given with
    /// [`Plan::with_flops`]); its backward is taken as twice that, as for matrix products.
    pub flops: Vec<f64>,
    /// The dtype the modules compute in: the configuration's compute dtype, or f32 over bf16
    /// parameters and gradients (see [`Plan::computing_in`]).
    pub module_dtype: Compute,
}

impl Plan {
    /// This plan, if it lays out exactly `units` over `topology` (the same units in the same
    /// order, each with the same parameters, shapes and uses); else an error naming the first
    /// difference.
    pub fn checked_against(
        self,
        units: &[UnitSpec],
        topology: &Topology,
    ) -> Result<Self, ShardError> {
        if self.topology != *topology {
            return Err(ShardError::Units(format!(
                "the plan is for topology {}, the job's is {topology}",
                self.topology
            )));
        }
        if self.units.len() != units.len() {
            return Err(ShardError::Units(format!(
                "the plan has {} units, the module {}",
                self.units.len(),
                units.len()
            )));
        }
        for (k, (planned, spec)) in self.units.iter().zip(units).enumerate() {
            let params: Vec<(&str, &[usize])> = planned
                .params
                .iter()
                .map(|p| (p.name.as_str(), p.shape.as_slice()))
                .collect();
            let wanted: Vec<(&str, &[usize])> = spec
                .params
                .iter()
                .map(|(n, s)| (n.as_str(), s.as_slice()))
                .collect();
            let same = planned.name == spec.name
                && params == wanted
                && planned.needs[1..] == spec.uses[..];
            if !same {
                return Err(ShardError::Units(format!(
                    "unit {k} is `{}` with {params:?} in the plan but `{}` with {wanted:?} in                      the module: make the plan from the module's units",
                    planned.name, spec.name
                )));
            }
        }
        Ok(self)
    }

    /// Lays `units` out; refuses an invalid config, unknown `uses`, empty or duplicate units.
    pub fn new(
        units: Vec<UnitSpec>,
        config: ShardConfig,
        topology: Topology,
    ) -> Result<Self, ShardError> {
        config.validate(&topology)?;
        if units.is_empty() {
            return Err(ShardError::Units("a model needs at least one unit".into()));
        }
        let world = topology.world_size();
        let block = config.pad_block();
        let mut out = Vec::with_capacity(units.len());
        for (k, u) in units.iter().enumerate() {
            if let Some(&bad) = u.uses.iter().find(|&&j| j >= units.len() || j == k) {
                return Err(ShardError::Units(format!(
                    "unit `{}` uses unit {bad}, which is itself or out of range (0..{})",
                    u.name,
                    units.len()
                )));
            }
            let mut offset = 0;
            let params = u
                .params
                .iter()
                .map(|(name, shape)| {
                    let numel = shape.iter().product();
                    let slot = ParamSlot {
                        name: name.clone(),
                        shape: shape.clone(),
                        offset,
                        numel,
                        decay: shape.len() >= 2,
                    };
                    offset += numel;
                    slot
                })
                .collect();
            let mut needs = vec![k];
            needs.extend(u.uses.iter().copied());
            out.push(UnitPlan {
                name: u.name.clone(),
                params,
                numel: offset,
                padded: ShardLayout::new(offset, world, block).padded(),
                needs,
                grad_ready_at: k,
            });
        }
        for k in 0..out.len() {
            for j in out[k].needs.clone() {
                out[j].grad_ready_at = out[j].grad_ready_at.min(k);
            }
        }
        Ok(Self {
            activations: vec![ActivationBytes::default(); out.len()],
            flops: vec![0.0; out.len()],
            module_dtype: config.compute,
            config,
            topology,
            units: out,
        })
    }

    /// The same plan with its modules computing in `dtype`: the compute dtype, or f32 when
    /// the parameters are bf16. With f32 over bf16, parameters are held, gathered and reduced
    /// in bf16 as before, but each visit widens its units' parameters to f32, and forward,
    /// backward and their activations are f32: for a device on which bf16 arithmetic is
    /// slower than f32 (a CPU without bf16 dot-product instructions), at the cost of an f32
    /// copy of the units a visit computes. Activation estimates depend on the dtype: give
    /// them ([`Plan::with_activations`]) after choosing it.
    pub fn computing_in(mut self, dtype: Compute) -> Result<Self, ShardError> {
        if dtype != self.config.compute && dtype != Compute::F32 {
            return Err(ShardError::setting(
                "module_dtype",
                dtype,
                format!(
                    "modules compute in the parameters' dtype ({}) or in f32",
                    self.config.compute
                ),
            ));
        }
        self.module_dtype = dtype;
        Ok(self)
    }

    /// The same plan with each unit's activation bytes per micro-batch, for the memory
    /// prediction.
    pub fn with_activations(
        mut self,
        activations: Vec<ActivationBytes>,
    ) -> Result<Self, ShardError> {
        if activations.len() != self.units.len() {
            return Err(ShardError::Units(format!(
                "{} activation estimates for {} units",
                activations.len(),
                self.units.len()
            )));
        }
        self.activations = activations;
        Ok(self)
    }

    /// The same plan with each unit's forward FLOPs per micro-batch on one rank, for the
    /// step-time prediction (`simulate`).
    pub fn with_flops(mut self, flops: Vec<f64>) -> Result<Self, ShardError> {
        if flops.len() != self.units.len() {
            return Err(ShardError::Units(format!(
                "{} FLOP counts for {} units",
                flops.len(),
                self.units.len()
            )));
        }
        self.flops = flops;
        Ok(self)
    }

    /// Real parameter elements of the model.
    pub fn numel(&self) -> usize {
        self.units.iter().map(|u| u.numel).sum()
    }

    /// Elements of unit `u` a rank holds at `span`.
    pub fn shard_len(&self, u: usize, span: Span) -> usize {
        self.units[u].padded / span.group_size(&self.topology)
    }

    /// Rank `rank`'s element range of unit `u` at `span`.
    pub fn shard_range(&self, u: usize, span: Span, rank: usize) -> std::ops::Range<usize> {
        let p = span.group_size(&self.topology);
        let len = self.units[u].padded / p;
        let i = rank % p;
        i * len..(i + 1) * len
    }

    /// Ranks the primary parameter partition splits each unit over.
    pub fn params_group_size(&self) -> usize {
        self.config.params().group_size(&self.topology)
    }

    /// Whether parameter gathers move int8 blocks: configured, and the parameters split over
    /// more than one rank. Where they are not (one process), a gather moves nothing, and
    /// quantizing would only round the weights.
    pub fn quantizes_weights(&self) -> bool {
        self.config.quantize_weights() == WeightQuant::Int8 && self.params_group_size() > 1
    }

    /// The span of the secondary parameter copy, where one is kept: configured, and the
    /// parameters split over more than one rank (one process gathers its whole units from
    /// the primary partition, which it holds).
    pub fn secondary(&self) -> Option<Span> {
        self.config
            .secondary()
            .filter(|_| self.params_group_size() > 1)
    }

    /// The group a span partitions over.
    pub fn group(&self, span: Span) -> Levels {
        Levels { lo: 0, hi: span.0 }
    }

    /// The hops of the gradient reduce-scatter (and, reversed, of primary parameter gathers).
    pub fn hops(&self) -> Vec<Levels> {
        let mut lo = 0;
        self.config
            .grad_hops()
            .iter()
            .map(|s| {
                let h = Levels { lo, hi: s.0 };
                lo = s.0;
                h
            })
            .collect()
    }

    /// The order units compute in one optimizer step: per micro-batch, the forward of every
    /// stage but the last (inference only, saving each stage's input), then the backward of
    /// every stage from the last (recomputing its forward with autodiff; the last stage's
    /// loss comes from this pass, so its forward runs once).
    pub fn visits(&self, grad_accum: usize) -> Vec<Visit> {
        let k = self.units.len();
        let mut out = Vec::with_capacity(grad_accum * (2 * k - 1));
        for micro in 0..grad_accum {
            out.extend((0..k - 1).map(|stage| Visit {
                micro,
                backward: false,
                stage,
            }));
            out.extend((0..k).rev().map(|stage| Visit {
                micro,
                backward: true,
                stage,
            }));
        }
        out
    }

    /// The collectives of one gather of unit `u` from the primary partition, in the order
    /// they run (outermost hop first; each hop multiplies what every rank holds by its group's
    /// size).
    pub fn gather_primary_collectives(&self, u: usize) -> Vec<Collective> {
        let c = self.config.compute.bytes();
        let shard = self.shard_len(u, self.config.params());
        let mut per_rank = if self.quantizes_weights() {
            Quantized::wire_bytes(QuantFormat::Int8, self.block(), shard)
        } else {
            shard * c
        };
        let mut out = Vec::new();
        for hop in self.hops().into_iter().rev() {
            let g = hop.size(&self.topology);
            if g > 1 {
                out.push(Collective::new(hop, Op::AllGather, (per_rank * g) as u64));
                per_rank *= g;
            }
        }
        if self.quantizes_weights()
            && let Some(last) = out.len().checked_sub(1)
        {
            // The shard is quantized before the first hop, the whole unit dequantized after
            // the last (half a round trip each).
            out[0].quant_elements += shard as f64 / 2.0;
            out[last].quant_elements += self.units[u].padded as f64 / 2.0;
        }
        out
    }

    /// Bytes one rank holds of unit `u`'s secondary copy at `span`: int8 blocks (the bytes the
    /// primary gather delivered) when weights are quantized, else the compute dtype.
    pub fn secondary_bytes(&self, u: usize, span: Span) -> usize {
        let len = self.shard_len(u, span);
        if self.quantizes_weights() {
            Quantized::wire_bytes(QuantFormat::Int8, self.block(), len)
        } else {
            len * self.config.compute.bytes()
        }
    }

    /// The collectives of one gather of unit `u` from a secondary partition at `span`.
    pub fn gather_secondary_collectives(&self, u: usize, span: Span) -> Vec<Collective> {
        let g = span.group_size(&self.topology);
        if g > 1 {
            let bytes = self.secondary_bytes(u, span) * g;
            let c = Collective::new(self.group(span), Op::AllGather, bytes as u64);
            // The whole unit is dequantized after an int8 gather.
            vec![if self.quantizes_weights() {
                c.quantizing(self.units[u].padded as f64 / 2.0)
            } else {
                c
            }]
        } else {
            Vec::new()
        }
    }

    /// The collectives of reducing unit `u`'s gradient once, in the order they run: only the
    /// hops up to the accumulation span when `inner_only` (see [`Plan::accumulated_hops`]).
    pub fn reduce_collectives(&self, u: usize, inner_only: bool) -> Vec<Collective> {
        let padded = self.units[u].padded;
        let world = Levels {
            lo: 0,
            hi: self.topology.depth(),
        };
        let o = self.config.optimizer();
        // Unquantized reductions move the compute dtype.
        let c = self.config.compute.bytes();
        let mut out = Vec::new();
        if o == Span(0) {
            if world.size(&self.topology) > 1 {
                out.push(Collective::new(world, Op::AllReduce, (padded * c) as u64));
            }
            return out;
        }
        let mut len = padded;
        // Hops run, when only those up to the accumulation span do.
        let inner = self.accumulated_hops().filter(|_| inner_only);
        for hop in self.hops().into_iter().take(inner.unwrap_or(usize::MAX)) {
            let g = hop.size(&self.topology);
            if g == 1 {
                continue;
            }
            let format = match self.config.quantize_grads() {
                GradQuant::Off => None,
                GradQuant::Int8 => Some(QuantFormat::Int8),
                GradQuant::Int4 => Some(QuantFormat::Int4),
            };
            match format {
                None => out.push(Collective::new(hop, Op::ReduceScatter, (len * c) as u64)),
                Some(f) => {
                    let part = Quantized::wire_bytes(f, self.block(), len / g);
                    // The hop's buffer is quantized, and as much arrives to dequantize.
                    out.push(
                        Collective::new(hop, Op::AllToAll, (part * g) as u64)
                            .quantizing(len as f64),
                    );
                }
            }
            len /= g;
        }
        let across = Levels {
            lo: o.0,
            hi: self.topology.depth(),
        };
        if across.size(&self.topology) > 1 && inner.is_none() {
            out.push(Collective::new(across, Op::AllReduce, (len * c) as u64));
        }
        out
    }

    /// How many of the gradient path's hops every micro-batch runs when gradients accumulate
    /// inside the path ([`ShardConfig::accumulate`](crate::ShardConfig::accumulate)): the hops
    /// up to the accumulation span, when some of them and some beyond it move data. The hops
    /// beyond run once, after the step's last micro-batch. `None`: every hop, every time.
    pub fn accumulated_hops(&self) -> Option<usize> {
        let span = self.config.accumulate()?;
        let hops = self.hops();
        let i = hops.iter().position(|h| h.hi == span.0)? + 1;
        let moves = |h: &Levels| h.size(&self.topology) > 1;
        (hops[..i].iter().any(moves) && hops[i..].iter().any(moves)).then_some(i)
    }

    pub(crate) fn block(&self) -> BlockSize {
        BlockSize::new(self.config.quant_block).expect("validated: a positive multiple of 8")
    }
}

/// One collective a rank takes part in, as every member of every group of its kind runs it at
/// once: its group of levels, its op and its payload (`n` of the comm crate's formulas: the
/// output of an all-gather, the input of a reduce-scatter or all-to-all, the buffer of an
/// all-reduce).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Collective {
    /// The group it runs over.
    pub group: Levels,
    /// The operation.
    pub op: Op,
    /// Payload bytes.
    pub bytes: u64,
    /// Elements this rank quantizes or dequantizes around it, counted in round trips (a
    /// quantization and a dequantization make one).
    pub quant_elements: f64,
}

impl Collective {
    /// A collective of `op` over `group` on `bytes` of plain payload.
    pub fn new(group: Levels, op: Op, bytes: u64) -> Self {
        Self {
            group,
            op,
            bytes,
            quant_elements: 0.0,
        }
    }

    /// The same collective with `elements` quantization round trips around it.
    pub fn quantizing(self, elements: f64) -> Self {
        Self {
            quant_elements: elements,
            ..self
        }
    }

    /// Charges it to `table` by the comm crate's formula (the one its counters use; a 4-byte
    /// scalar all-reduce over more than 4 ranks rounds to 0 bytes there too).
    pub(crate) fn charge(&self, topology: &Topology, table: &mut TrafficTable) {
        let g = self.group.size(topology);
        *table.entry((self.group, self.op)).or_default() +=
            formula(self.op, self.bytes, g, Role::Member);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DEFAULT_QUANT_BLOCK, Preset};
    use crate::plan::schedule::Event;

    fn units() -> Vec<UnitSpec> {
        vec![
            UnitSpec {
                name: "embed".into(),
                params: vec![("wte".into(), vec![10, 4]), ("wpe".into(), vec![3, 4])],
                uses: vec![],
            },
            UnitSpec {
                name: "h.0".into(),
                params: vec![("h.0.w".into(), vec![4, 4]), ("h.0.b".into(), vec![4])],
                uses: vec![],
            },
            UnitSpec {
                name: "head".into(),
                params: vec![("ln.w".into(), vec![4])],
                uses: vec![0],
            },
        ]
    }

    fn plan(preset: &str, spec: &str) -> Plan {
        let t = Topology::parse(spec).unwrap();
        Plan::new(units(), preset.parse::<Preset>().unwrap().config(3), t).unwrap()
    }

    #[test]
    fn a_plan_made_beforehand_is_kept_only_for_its_own_units() {
        let t = Topology::parse("2x2x1").unwrap();
        let made = plan("hier3", "2x2x1");
        assert_eq!(
            made.clone().checked_against(&units(), &t).unwrap().units,
            made.units
        );
        let other_shape = {
            let mut u = units();
            u[1].params[0].1 = vec![4, 5];
            u
        };
        let err = made.clone().checked_against(&other_shape, &t).unwrap_err();
        assert!(err.to_string().contains("unit 1 is `h.0`"), "{err}");
        let other_uses = {
            let mut u = units();
            u[2].uses.clear();
            u
        };
        assert!(made.clone().checked_against(&other_uses, &t).is_err());
        assert!(made.clone().checked_against(&units()[..2], &t).is_err());
        let elsewhere = Topology::parse("4x1x1").unwrap();
        let err = made.checked_against(&units(), &elsewhere).unwrap_err();
        assert!(err.to_string().contains("topology"), "{err}");
    }

    /// Units large enough that quantization blocks are a small part of them.
    fn big_plan(preset: &str, spec: &str) -> Plan {
        let units = vec![
            UnitSpec {
                name: "embed".into(),
                params: vec![("wte".into(), vec![4096, 256])],
                uses: vec![],
            },
            UnitSpec {
                name: "h.0".into(),
                params: vec![("h.0.w".into(), vec![256, 1024])],
                uses: vec![],
            },
            UnitSpec {
                name: "head".into(),
                params: vec![("ln.w".into(), vec![256])],
                uses: vec![0],
            },
        ];
        let t = Topology::parse(spec).unwrap();
        Plan::new(units, preset.parse::<Preset>().unwrap().config(3), t).unwrap()
    }

    #[test]
    fn units_are_laid_out_flat_and_padded_for_the_world() {
        let p = plan("zero3", "2x2x2");
        assert_eq!(p.units[0].numel, 52);
        assert_eq!(p.units[0].padded, 56);
        assert_eq!(p.units[0].params[1].offset, 40);
        assert!(p.units[0].params[0].decay && !p.units[1].params[1].decay);
        assert_eq!(p.units[2].needs, vec![2, 0]);
        // The tied embedding's gradient is complete only after stage 0's backward.
        assert_eq!(p.units[0].grad_ready_at, 0);
        assert_eq!(p.shard_range(0, Span(3), 5), 35..42);
        assert_eq!(p.shard_range(0, Span(1), 5), 28..56);
        // Quantized presets pad to whole blocks per rank.
        let q = plan("zeropp", "2x2x2");
        assert_eq!(q.units[0].padded, 8 * DEFAULT_QUANT_BLOCK);
    }

    #[test]
    fn memory_follows_the_zero_table() {
        // f32 compute, 8 ranks, psi = padded elements.
        let psi: u64 = plan("ddp", "2x2x2")
            .units
            .iter()
            .map(|u| u.padded as u64)
            .sum();
        // With f32 compute the primary partition is the f32 master itself: no copy.
        let ddp = plan("ddp", "2x2x2").memory(1);
        assert_eq!(
            (ddp.params, ddp.grads, ddp.optimizer),
            (0, 4 * psi, 12 * psi)
        );
        let z1 = plan("zero1", "2x2x2").memory(1);
        assert_eq!(
            (z1.params, z1.grads, z1.optimizer),
            (4 * psi, 4 * psi, 12 * psi / 8)
        );
        let z2 = plan("zero2", "2x2x2").memory(1);
        assert_eq!((z2.params, z2.grads), (4 * psi, 4 * psi / 8));
        let z3 = plan("zero3", "2x2x2").memory(1);
        assert_eq!(
            (z3.params, z3.grads, z3.optimizer),
            (0, 4 * psi / 8, 12 * psi / 8)
        );
        // Prefetch 1: backward of the head (head + embed) with h.0 prefetched is the largest
        // window.
        assert_eq!(z3.gathered_peak, 4 * psi);
        // hier3 keeps its secondary copy over the GCD pair as the int8 blocks it gathered.
        let h3p = plan("hier3", "2x2x2");
        let int8: u64 = h3p
            .units
            .iter()
            .map(|u| (u.padded / 2 + 4 * (u.padded / 2).div_ceil(DEFAULT_QUANT_BLOCK)) as u64)
            .sum();
        assert_eq!(h3p.memory(1).secondary, int8);
    }

    #[test]
    fn hier3_accumulates_gradients_over_the_node_and_crosses_nodes_once_per_step() {
        let h3 = plan("hier3", "2x2x2");
        // The path's hops: gcd pair, node, world; the first two run every micro-batch.
        assert_eq!(h3.accumulated_hops(), Some(2));
        let hops = h3.hops();
        // Gradient collectives over one hop's group in a step of `accum` micro-batches.
        let reductions = |p: &Plan, accum: usize, hop: Levels| {
            p.schedule(accum)
                .into_iter()
                .filter(|e| matches!(e, Event::Reduce { .. }))
                .flat_map(|e| p.collectives(e))
                .filter(|c| c.group == hop)
                .count()
        };
        let across_nodes = |p: &Plan, accum: usize| reductions(p, accum, hops[2]);
        let inside_node = |p: &Plan, accum: usize| reductions(p, accum, hops[1]);
        let k = h3.units.len();
        assert_eq!(across_nodes(&h3, 1), k);
        assert_eq!(across_nodes(&h3, 4), k);
        assert_eq!(inside_node(&h3, 4), 4 * k);
        // Without accumulation every micro-batch crosses nodes.
        let mut every = h3.clone();
        every.config.set_accumulate(None).unwrap();
        assert_eq!(every.accumulated_hops(), None);
        assert_eq!(across_nodes(&every, 4), 4 * k);
        // The accumulated f32 shards over the node, only when there is more than one
        // micro-batch.
        let acc: u64 = (0..k).map(|u| 4 * h3.shard_len(u, Span(2)) as u64).sum();
        assert_eq!(h3.memory(2).grads, every.memory(2).grads + acc);
        assert_eq!(h3.memory(1).grads, every.memory(1).grads);
        // One node: nothing beyond the node to save, so every hop runs every time.
        assert_eq!(plan("hier3", "1x2x2").accumulated_hops(), None);
    }

    #[test]
    fn one_process_neither_quantizes_weights_nor_keeps_a_secondary_copy() {
        for preset in ["zeropp", "hier3"] {
            let alone = plan(preset, "1x1x1");
            assert!(
                !alone.quantizes_weights() && alone.secondary().is_none(),
                "{preset}"
            );
            assert_eq!(alone.memory(1).secondary, 0, "{preset}");
            assert!(alone.gather_primary_collectives(1).is_empty(), "{preset}");
            let split = plan(preset, "1x2x2");
            assert!(
                split.quantizes_weights() && split.secondary().is_some(),
                "{preset}"
            );
        }
    }

    #[test]
    fn f32_modules_over_bf16_parameters_hold_the_units_they_compute_with_in_f32() {
        let bf16 = |preset: &str| {
            let mut c = preset.parse::<Preset>().unwrap().config(3);
            c.compute = Compute::Bf16;
            Plan::new(units(), c, Topology::parse("2x2x2").unwrap()).unwrap()
        };
        let padded: Vec<u64> = bf16("zero3")
            .units
            .iter()
            .map(|u| u.padded as u64)
            .collect();
        let psi: u64 = padded.iter().sum();
        // zero3's largest window holds every unit (see above): the head's backward visit with
        // the embedding it reads, and block 0 prefetched. In bf16 all are bf16; with f32
        // modules the two the visit computes with are f32 and the prefetched one bf16.
        let narrow = bf16("zero3").memory(1);
        let wide = bf16("zero3").computing_in(Compute::F32).unwrap();
        assert_eq!(wide.module_dtype, Compute::F32);
        assert_eq!(narrow.gathered_peak, 2 * psi);
        assert_eq!(
            wide.memory(1).gathered_peak,
            4 * (padded[2] + padded[0]) + 2 * padded[1]
        );
        // Replicated parameters: the whole model's f32 copy while a micro-batch computes.
        let acts = vec![
            ActivationBytes {
                output: 0,
                saved: 1 << 30,
            };
            3
        ];
        let ddp = |dtype| {
            bf16("ddp")
                .computing_in(dtype)
                .unwrap()
                .with_activations(acts.clone())
                .unwrap()
                .memory(1)
        };
        assert_eq!(
            ddp(Compute::F32).working_peak - ddp(Compute::Bf16).working_peak,
            4 * psi
        );
        // An f32 run cannot compute in bf16.
        let err = plan("zero3", "2x2x2")
            .computing_in(Compute::Bf16)
            .unwrap_err();
        assert!(err.to_string().contains("or in f32"), "{err}");
    }

    #[test]
    fn activations_enter_the_working_peak() {
        let base = plan("zero3", "2x2x2").memory(1);
        let acts = vec![
            ActivationBytes {
                output: 1000,
                saved: 5000,
            };
            3
        ];
        let with = plan("zero3", "2x2x2")
            .with_activations(acts)
            .unwrap()
            .memory(1);
        assert!(with.activations_peak >= 5000 + 1000, "{with:?}");
        assert!(with.working_peak > base.working_peak);
        assert!(with.total() > base.total());
        assert!(
            plan("zero3", "2x2x2")
                .with_activations(vec![ActivationBytes::default(); 2])
                .is_err()
        );
    }

    #[test]
    fn every_backward_gathers_before_it_computes_and_reduces_after() {
        for preset in ["zero3", "hier3", "zero2", "ddp"] {
            let p = plan(preset, "2x2x2");
            let events = p.schedule(2);
            let mut gathered = vec![0usize; p.units.len()];
            for (i, e) in events.iter().enumerate() {
                match e {
                    Event::Gather { unit, .. } => gathered[*unit] += 1,
                    Event::Visit(v) => {
                        for &u in &p.units[v.stage].needs {
                            assert!(gathered[u] > 0, "{preset}: visit {i} before its gather");
                            gathered[u] -= 1;
                        }
                    }
                    Event::Reduce { unit, .. } => assert!(
                        events[..i].iter().any(|e| matches!(e, Event::Visit(v)
                            if v.backward && v.stage == p.units[*unit].grad_ready_at)
                            || matches!(e, Event::Whole { .. })),
                        "{preset}: reduce of {unit} before its gradient is complete"
                    ),
                    Event::Whole { .. } => {}
                }
            }
        }
    }

    #[test]
    fn zero3_moves_three_model_sizes_and_hier3_a_quarter_across_nodes() {
        let p = plan("zero3", "2x2x2");
        let t = p.traffic(1);
        let world = Levels { lo: 0, hi: 3 };
        let ag = t[&(world, Op::AllGather)].sent;
        let rs = t[&(world, Op::ReduceScatter)].sent;
        // Forward of stages 0 and 1, backward of 2 (head + embed), 1 and 0.
        let bytes = |u: usize| (p.units[u].padded * 4) as u64 * 7 / 8;
        assert_eq!(ag, 3 * bytes(0) + 2 * bytes(1) + bytes(2));
        assert_eq!(rs, bytes(0) + bytes(1) + bytes(2));
        // hier3 sends at most a quarter of zero3's bytes over the node level.
        let t = big_plan("zero3", "2x2x2").traffic(1);
        let h = big_plan("hier3", "2x2x2");
        let th = h.traffic(1);
        let node = Levels { lo: 2, hi: 3 };
        let cross: u64 = th
            .iter()
            .filter(|((g, _), _)| *g == node)
            .map(|(_, v)| v.sent)
            .sum();
        let zero3_world: u64 = t
            .iter()
            .filter(|((g, _), _)| *g == world)
            .map(|(_, v)| v.sent)
            .sum();
        assert!(
            cross > 0 && 4 * cross <= zero3_world,
            "{cross} vs {zero3_world}"
        );
    }
}
