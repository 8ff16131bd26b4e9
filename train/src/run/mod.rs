//! A training run: its settings (`config`, `shard_args`, resolved by `setup`), the device and
//! data it runs on, the GPT described to the partitioner (`stages`) and trained (`gpt_run`),
//! the learning-rate schedule, the kernel cache of CubeCL devices, the one training loop (`run_loop`), the host memory it holds,
//! and `launch`'s records of a job that restarts by itself.

pub mod config;
pub mod data;
pub mod device;
pub mod gpt_run;
pub mod host_memory;
pub mod kernel_cache;
pub mod launch;
pub mod run_loop;
pub mod schedule;
pub mod setup;
pub mod shard_args;
pub mod stages;
