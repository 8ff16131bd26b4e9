//! The `ember` binary's library: configuration and its resolution (`setup`), the one training
//! loop (`run_loop`) and the GPT it trains (`gpt_run`), checkpoints, evaluation, generation,
//! benchmarks and run output. The binary (`main.rs`, `cli/`) only parses flags and calls into
//! here, so tests can drive the same code.

pub mod bench;
pub mod checkpoint;
pub mod cluster;
pub mod config;
pub mod data;
pub mod device;
pub mod error;
pub mod eval;
pub mod export;
pub mod generate;
pub mod gpt_run;
pub mod host_memory;
pub mod launch;
pub mod metrics;
pub mod planning;
pub mod plot;
pub mod run_loop;
pub mod schedule;
pub mod setup;
pub mod shard_args;
pub mod stages;
pub mod units;
