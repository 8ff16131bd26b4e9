//! Hierarchical ZeRO for any Burn module: parameters, gradients and optimizer state each
//! partitioned over a configurable level of the machine's topology (die pair, node, cluster),
//! with ZeRO++'s quantized gathers and reductions and secondary parameter copies as options.
//!
//! A user describes their model as a sequence of units ([`Staged`]) without changing the
//! model's code, picks a [`ShardConfig`] (a preset or any valid combination), and builds a
//! [`ShardedModel`] from the module's skeleton (its parameters may stay lazy: no rank ever
//! materialises what it does not own) and a [`ParamSource`] for its own ranges. Every state is
//! a Burn tensor on the run's device. [`Plan`] gives the partition, the per-rank memory and
//! the per-step traffic as plain data, folded over the same schedule the engine runs. It
//! deliberately knows no particular model; communication goes through `ember-comm` only.

pub mod checkpoint;
pub mod config;
#[cfg(feature = "cubecl")]
mod cube;
pub mod engine;
pub mod error;
mod kernels;
pub mod memory;
pub mod network;
pub mod optim;
pub mod params;
pub mod plan;
pub mod profile;
mod route;
pub mod schedule;
pub mod simulate;
pub mod source;
pub mod stage;
mod staging;
mod worker;

pub use checkpoint::{Checkpoint, SaveOptions};
pub use config::{Compute, GradQuant, PRESETS, Recompute, ShardConfig, Span, WeightQuant};
pub use engine::{ShardedModel, StepHyper, StepReport};
pub use error::ShardError;
pub use optim::{AdamConfig, FlatState};
pub use plan::{ActivationBytes, Collective, Levels, Memory, Plan, UnitSpec};
pub use source::{FnSource, ParamSource};
pub use stage::{Flow, Staged, UnitDecl};
