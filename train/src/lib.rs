//! The `ember` binary's library, grouped by what it does:
//!
//! - [`run`]: a training run, from its settings to its last step: configuration and its
//!   resolution (`setup`), the partition's flags, the device, the data, the GPT described to
//!   the partitioner (`stages`) and trained (`gpt_run`), the one training loop (`run_loop`),
//!   and `ember launch`, which restarts a run after a failure;
//! - [`files`]: what a run reads and writes: checkpoints, the Hugging Face export, metrics and
//!   the loss curve;
//! - [`tools`]: the commands around a run: benchmarks, evaluation, generation, `ember plan`;
//! - [`cluster`]: the emulated cluster and the calibration that writes the planner's profiles.
//!
//! The binary (`main.rs`, `cli/`) only parses flags and calls into here, so tests can drive the
//! same code.

pub mod cluster;
pub mod error;
pub mod files;
pub mod run;
pub mod tools;
pub mod units;
