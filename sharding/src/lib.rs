//! Hierarchical ZeRO for any Burn module: parameters, gradients and optimizer state each
//! partitioned over a configurable level of the machine's topology (die pair, node, cluster),
//! with ZeRO++'s quantized gathers and reductions and secondary parameter copies as options.
//!
//! A user describes their built model as a sequence of units ([`Staged`]) without changing
//! the model's code, picks a [`ShardConfig`] (a preset or any valid combination), and trains
//! with [`ShardedModel::train_step`]. [`Plan`] gives the partition, the per-rank memory and
//! the per-step traffic as plain data, without running anything. It deliberately knows no
//! particular model; communication goes through `ember-comm` only.

pub mod buf;
pub mod config;
pub mod engine;
pub mod error;
pub mod optim;
pub mod params;
pub mod plan;
pub mod profile;
mod route;
pub mod stage;

pub use buf::Buf;
pub use config::{Compute, GradQuant, PRESETS, ShardConfig, Span, WeightQuant};
pub use engine::{ShardedModel, StepHyper, StepReport};
pub use error::ShardError;
pub use optim::{AdamConfig, ShardState};
pub use plan::{Levels, Memory, Plan, UnitSpec};
pub use stage::{Flow, Staged, UnitDecl};
