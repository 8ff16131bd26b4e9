//! `ember bench train`: training throughput (tokens/s) and MFU of presets on the chosen
//! backend, measured on the embedded corpus after warm-up steps. Not a test: numbers go to
//! BENCHMARKS.md with the command that produced them.

use std::time::Instant;

use anyhow::Result;
use serde::Serialize;

use crate::config::{TrainConfig, TrainOverrides};
use crate::device::{device, peak_flops};
use crate::error::CliResult;
use crate::trainer::Trainer;

/// One benchmark result.
#[derive(Debug, Clone, Serialize)]
pub struct TrainBench {
    /// Preset measured.
    pub preset: String,
    /// Backend.
    pub device: String,
    /// Parameters.
    pub params: u64,
    /// Sequences per step.
    pub batch_size: usize,
    /// Tokens per sequence.
    pub block_size: usize,
    /// CPU threads available to the backend.
    pub threads: usize,
    /// Timed steps.
    pub steps: u64,
    /// Median step time, ms.
    pub step_ms_median: f64,
    /// Tokens per second at the median step.
    pub tokens_per_s: f64,
    /// Achieved model FLOP/s (6N + 12LdT per token), in GFLOP/s.
    pub gflops: f64,
    /// Peak FLOP/s used for MFU, in GFLOP/s.
    pub peak_gflops: Option<f64>,
    /// Model FLOPs utilisation.
    pub mfu: Option<f64>,
}

/// Times `steps` training steps of each preset after `warmup` untimed ones.
pub fn bench_train(
    presets: &[String],
    base: &TrainOverrides,
    steps: u64,
    warmup: u64,
) -> CliResult<Vec<TrainBench>> {
    let mut out = Vec::new();
    for preset in presets {
        let o = TrainOverrides {
            preset: Some(preset.clone()),
            max_iters: Some(steps + warmup),
            eval_interval: Some(0),
            save_interval: Some(0),
            ..Default::default()
        }
        .overridden_by(base);
        let mut config = TrainConfig::resolve(&o)?;
        let dev = device(config.device)?;
        let data = crate::data::load(&config)?;
        config.model.vocab_size = data.tokenizer.vocab_size();
        let mut trainer = Trainer::new(config.clone(), dev, data, None)?;
        let mut times = Vec::new();
        for i in 0..steps + warmup {
            let t0 = Instant::now();
            trainer.train_step()?;
            if i >= warmup {
                times.push(t0.elapsed().as_secs_f64());
            }
        }
        out.push(summarise(&config, times)?);
    }
    Ok(out)
}

fn summarise(config: &TrainConfig, mut times: Vec<f64>) -> Result<TrainBench> {
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let tokens = config.tokens_per_step() as f64;
    let tokens_per_s = tokens / median;
    let flops = config.model.train_flops_per_token(config.block_size) * tokens_per_s;
    let peak = peak_flops(config.device, config.peak_tflops);
    Ok(TrainBench {
        preset: config.preset.clone(),
        device: format!("{:?}", config.device).to_lowercase(),
        params: config.model.num_params(),
        batch_size: config.batch_size,
        block_size: config.block_size,
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        steps: times.len() as u64,
        step_ms_median: median * 1e3,
        tokens_per_s,
        gflops: flops / 1e9,
        peak_gflops: peak.map(|p| p / 1e9),
        mfu: peak.map(|p| flops / p),
    })
}
