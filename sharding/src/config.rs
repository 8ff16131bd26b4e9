//! What is partitioned where: a [`ShardConfig`] gives each training state the topology level it
//! is split over, plus quantization, compute dtype and prefetch. Presets (`ddp` ... `hier3`)
//! are constructors; every combination that [`ShardConfig::validate`] accepts runs, and the
//! ones it refuses are refused with the reason. Plain data; it deliberately touches no MPI.
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
    /// Reduce in f32.
    Off,
    /// Symmetric blockwise int8.
    Int8,
    /// Symmetric blockwise int4, two per byte.
    Int4,
}

/// The dtype forward and backward compute in (masters and optimizer state are always f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compute {
    /// 4 bytes per parameter.
    F32,
    /// 2 bytes per parameter; gathers move bf16.
    Bf16,
}

impl Compute {
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
pub struct ShardConfig {
    /// Preset this was built from (informational; the fields below are what runs).
    pub preset: String,
    /// Primary parameter partition (compute dtype). `Span(0)` = replicated.
    pub params: Span,
    /// Secondary parameter copy (hpZ), sliced from the first forward gather of a step and used
    /// by backward and later micro-batches; `None` re-gathers from the primary.
    pub secondary: Option<Span>,
    /// Optimizer state partition: f32 master, first and second moments.
    pub optimizer: Span,
    /// The gradient reduce-scatter's hops, innermost first, as the span each hop ends at; the
    /// last is `optimizer`. Empty when the optimizer state is replicated (an all-reduce).
    pub grad_hops: Vec<Span>,
    /// Whether gradients are partitioned (ZeRO-2 and up: reduced after every micro-batch into
    /// the optimizer's shard) or kept whole until the step's last micro-batch (DDP, ZeRO-1).
    pub shard_grads: bool,
    /// Weight quantization of parameter gathers.
    pub quantize_weights: WeightQuant,
    /// Gradient quantization of the reduce-scatter.
    pub quantize_grads: GradQuant,
    /// Elements per quantization block (one f32 scale each).
    pub quant_block: usize,
    /// Quantized gradients: keep each rank's quantization error per hop and add it to the
    /// next step's gradient (LoCo-style error feedback). DeepSpeed's qgZ has none.
    pub error_feedback: bool,
    /// Forward/backward dtype.
    pub compute: Compute,
    /// Units gathered ahead of the one computing (0 = no overlap).
    pub prefetch: usize,
    /// Whether partitioned parameters' units recompute their forward in backward (and gather
    /// again for it), or keep their activations and gathered parameters from forward to
    /// backward. Replicated parameters never recompute.
    #[serde(default)]
    pub recompute: Recompute,
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

/// Preset names, from plain data parallelism to the three-level hierarchy.
pub const PRESETS: [&str; 6] = ["ddp", "zero1", "zero2", "zero3", "zeropp", "hier3"];

/// Default quantization block. Smaller blocks track the gradient's local scale better at the
/// cost of one f32 scale per block (6% more bytes than the int4 data at 128, 3% at 256).
/// Measured on `tiny`, 300 steps, hier3 at 2x2x2 against zero3: the largest gap of a logged
/// step's loss is 1.99% with blocks of 256, 1.08% with 128, 0.53% with 64 (val loss +1.21%,
/// +0.70%, +0.25%; BENCHMARKS.md): 128 keeps every step within 2% with room to spare.
pub const DEFAULT_QUANT_BLOCK: usize = 128;

impl ShardConfig {
    /// A preset on a topology of `depth` levels (the level spans depend on it). Presets are
    /// defined for any depth: `zeropp`'s secondary is the outermost-but-one level (the node on
    /// a three-level topology), `hier3`'s the innermost shared one (the GPU's GCD pair).
    pub fn preset(name: &str, depth: usize) -> Result<Self, ShardError> {
        let world = Span(depth);
        let base = ShardConfig {
            preset: name.to_string(),
            params: Span(0),
            secondary: None,
            optimizer: world,
            grad_hops: vec![world],
            shard_grads: false,
            quantize_weights: WeightQuant::Off,
            quantize_grads: GradQuant::Off,
            quant_block: DEFAULT_QUANT_BLOCK,
            error_feedback: false,
            compute: Compute::F32,
            prefetch: 1,
            recompute: Recompute::Unit,
        };
        let config = match name {
            "ddp" => ShardConfig {
                optimizer: Span(0),
                grad_hops: Vec::new(),
                ..base
            },
            "zero1" => base,
            "zero2" => ShardConfig {
                shard_grads: true,
                ..base
            },
            "zero3" => ShardConfig {
                params: world,
                shard_grads: true,
                ..base
            },
            "zeropp" => ShardConfig {
                params: world,
                secondary: Some(Span(depth.saturating_sub(1))),
                grad_hops: if depth >= 2 {
                    vec![Span(depth - 1), world]
                } else {
                    vec![world]
                },
                shard_grads: true,
                quantize_weights: WeightQuant::Int8,
                quantize_grads: GradQuant::Int4,
                ..base
            },
            "hier3" => ShardConfig {
                params: world,
                secondary: Some(Span(1.min(depth))),
                grad_hops: (1..=depth).map(Span).collect(),
                shard_grads: true,
                quantize_weights: WeightQuant::Int8,
                quantize_grads: GradQuant::Int4,
                ..base
            },
            other => {
                return Err(ShardError::setting(
                    "preset",
                    other,
                    format!("not a preset; use one of {}", PRESETS.join(", ")),
                ));
            }
        };
        Ok(config)
    }

    /// Checks the combination against `topology`; the error says what is wrong and why.
    pub fn validate(&self, topology: &Topology) -> Result<(), ShardError> {
        let depth = topology.depth();
        let bad = |field: &'static str, value: String, reason: String| {
            Err(ShardError::setting(field, value, reason))
        };
        let name = |s: Span| s.name(topology);
        for (field, span) in [("params", self.params), ("optimizer", self.optimizer)]
            .into_iter()
            .chain(self.secondary.map(|s| ("secondary", s)))
            .chain(self.grad_hops.iter().map(|&s| ("grad_hops", s)))
        {
            if span.0 > depth {
                return bad(
                    field,
                    format!("span {}", span.0),
                    format!("exceeds the topology's {depth} levels"),
                );
            }
        }
        if self.params != Span(0) && self.params != self.optimizer {
            return bad(
                "params",
                name(self.params),
                format!(
                    "parameters partitioned over the {} but optimizer state over the {}: the \
                     updated master shard becomes the parameter shard, so parameters are \
                     either replicated (gcd) or split exactly like the optimizer state",
                    name(self.params),
                    name(self.optimizer)
                ),
            );
        }
        if let Some(s) = self.secondary {
            if self.params == Span(0) {
                return bad(
                    "secondary",
                    name(s),
                    "a secondary copy needs partitioned parameters: replicated parameters are \
                     never re-gathered"
                        .into(),
                )
                .map_err(|e| e.with_fix("secondary", "none"));
            }
            if s >= self.params {
                return bad(
                    "secondary",
                    name(s),
                    format!(
                        "the secondary copy must be split over a smaller group than the \
                         primary ({}): otherwise it saves no traffic",
                        name(self.params)
                    ),
                );
            }
        }
        if self.optimizer == Span(0) {
            if !self.grad_hops.is_empty() {
                return bad(
                    "grad_hops",
                    format!("{:?}", self.grad_hops),
                    "replicated optimizer state all-reduces gradients: a reduce-scatter path \
                     does not apply"
                        .into(),
                );
            }
            if self.shard_grads {
                return bad(
                    "shard_grads",
                    "true".into(),
                    "gradients cannot be partitioned finer than the optimizer state they feed \
                     (replicated here)"
                        .into(),
                );
            }
            if self.quantize_grads != GradQuant::Off {
                return bad(
                    "quantize_grads",
                    format!("{:?}", self.quantize_grads).to_lowercase(),
                    "gradient quantization rides the all-to-all reduce-scatter; with replicated \
                     optimizer state gradients are all-reduced"
                        .into(),
                )
                .map_err(|e| e.with_fix("quantize_grads", "off"));
            }
        } else {
            let hops = &self.grad_hops;
            if hops.last() != Some(&self.optimizer) {
                return bad(
                    "grad_hops",
                    format!("{:?}", self.grad_hops),
                    format!(
                        "the gradient path must end at the optimizer state's level ({}) so \
                         each rank receives the shard it updates",
                        name(self.optimizer)
                    ),
                );
            }
            if hops.windows(2).any(|w| w[0] >= w[1]) || hops[0] == Span(0) {
                return bad(
                    "grad_hops",
                    format!("{:?}", self.grad_hops),
                    "gradient hops must widen strictly, innermost first, starting above the \
                     gcd level"
                        .into(),
                );
            }
        }
        if self.params == Span(0) && self.quantize_weights != WeightQuant::Off {
            return bad(
                "quantize_weights",
                "int8".into(),
                "weight quantization applies to parameter gathers; replicated parameters are \
                 never gathered"
                    .into(),
            )
            .map_err(|e| e.with_fix("quantize_weights", "off"));
        }
        if self.error_feedback && self.quantize_grads == GradQuant::Off {
            return bad(
                "error_feedback",
                "true".into(),
                "error feedback compensates gradient quantization, which is off".into(),
            )
            .map_err(|e| e.with_fix("quantize_grads", "int4"));
        }
        if self.quant_block == 0 || !self.quant_block.is_multiple_of(8) {
            return bad(
                "quant_block",
                self.quant_block.to_string(),
                "must be a positive multiple of 8".into(),
            );
        }
        Ok(())
    }

    /// Elements each unit's flat buffer is padded to a multiple of, per world rank: the
    /// quantization block when anything is quantized, else 1 (see `plan`).
    pub fn pad_block(&self) -> usize {
        if self.quantize_weights != WeightQuant::Off || self.quantize_grads != GradQuant::Off {
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
             sharded grads {}, weights {:?}, grads {:?}, {:?}, prefetch {}, recompute {:?})",
            self.preset,
            self.params.0,
            self.secondary.map(|s| s.0),
            self.optimizer.0,
            self.grad_hops.iter().map(|s| s.0).collect::<Vec<_>>(),
            self.shard_grads,
            self.quantize_weights,
            self.quantize_grads,
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
            for p in PRESETS {
                let c = ShardConfig::preset(p, 3).unwrap();
                c.validate(&t(spec))
                    .unwrap_or_else(|e| panic!("{p} at {spec}: {e}"));
            }
        }
    }

    #[test]
    fn presets_put_each_state_on_its_level() {
        let hier3 = ShardConfig::preset("hier3", 3).unwrap();
        assert_eq!(hier3.grad_hops, vec![Span(1), Span(2), Span(3)]);
        assert_eq!(hier3.secondary, Some(Span(1)));
        let zpp = ShardConfig::preset("zeropp", 3).unwrap();
        assert_eq!(zpp.grad_hops, vec![Span(2), Span(3)]);
        assert_eq!(zpp.secondary, Some(Span(2)));
        let ddp = ShardConfig::preset("ddp", 3).unwrap();
        assert_eq!((ddp.params, ddp.optimizer), (Span(0), Span(0)));
        let z1 = ShardConfig::preset("zero1", 3).unwrap();
        let z2 = ShardConfig::preset("zero2", 3).unwrap();
        assert!(!z1.shard_grads && z2.shard_grads);
        assert!(ShardConfig::preset("zero4", 3).is_err());
    }

    #[test]
    fn invalid_combinations_are_refused_with_the_reason() {
        let topo = t("2x2x2");
        let mut c = ShardConfig::preset("zero3", 3).unwrap();
        c.secondary = Some(Span(3));
        let e = c.validate(&topo).unwrap_err().to_string();
        assert!(e.contains("smaller group"), "{e}");
        let mut c = ShardConfig::preset("ddp", 3).unwrap();
        c.quantize_grads = GradQuant::Int4;
        assert!(
            c.validate(&topo)
                .unwrap_err()
                .to_string()
                .contains("all-reduced")
        );
        let mut c = ShardConfig::preset("zero1", 3).unwrap();
        c.quantize_weights = WeightQuant::Int8;
        assert!(
            c.validate(&topo)
                .unwrap_err()
                .to_string()
                .contains("never gathered")
        );
        let mut c = ShardConfig::preset("zero3", 3).unwrap();
        c.grad_hops = vec![Span(2)];
        assert!(
            c.validate(&topo)
                .unwrap_err()
                .to_string()
                .contains("must end")
        );
        let mut c = ShardConfig::preset("zero3", 3).unwrap();
        c.optimizer = Span(2);
        c.grad_hops = vec![Span(2)];
        assert!(
            c.validate(&topo)
                .unwrap_err()
                .to_string()
                .contains("exactly like")
        );
    }

    #[test]
    fn non_preset_combinations_are_accepted() {
        let topo = t("2x2x2");
        // HSDP-like: everything split inside the node, replicated across nodes.
        let mut c = ShardConfig::preset("zero3", 3).unwrap();
        c.params = Span(2);
        c.optimizer = Span(2);
        c.grad_hops = vec![Span(1), Span(2)];
        c.secondary = Some(Span(1));
        c.quantize_grads = GradQuant::Int8;
        c.validate(&topo).unwrap();
        // ZeRO-3 with a whole copy per rank kept through backward (FSDP's
        // reshard_after_forward=False).
        let mut c = ShardConfig::preset("zero3", 3).unwrap();
        c.secondary = Some(Span(0));
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
