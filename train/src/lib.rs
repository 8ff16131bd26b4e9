//! The `ember` binary's library: configuration, the training loop, checkpoints, evaluation,
//! generation, benchmarks and run output. The binary (`main.rs`) only parses flags and calls
//! into here, so tests can drive the same code.

pub mod bench;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod device;
pub mod error;
pub mod eval;
pub mod export;
pub mod generate;
pub mod metrics;
pub mod optim;
pub mod planning;
pub mod plot;
pub mod sharded;
pub mod stages;
pub mod trainer;
