//! The one training loop. Every way ember trains (one process, many ranks, `ember bench`)
//! runs [`run`]: it drives a [`Trainee`] step by step and owns the schedule of evaluation,
//! logging, metrics, the progress bar and checkpoints. How the model is partitioned lives in
//! the trainee and never here, as torchtitan's single `train.py` serves every parallelism.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;

use crate::files::metrics::{MetricsWriter, StepMetrics, progress_bar};
use crate::log0;
use crate::run::config::TrainConfig;
use crate::run::device::peak_flops;

/// What one optimizer step reports to the loop.
#[derive(Debug, Clone)]
pub struct Stepped {
    /// Mean training loss over the global batch.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate of the step.
    pub lr: f64,
    /// Seconds the step took.
    pub step_s: f64,
    /// Seconds of it spent waiting on communication.
    pub comm_wait_s: f64,
}

/// A model the loop trains: one step at a time, a validation loss, a checkpoint, and what a
/// logged step adds to its metrics line. Under MPI every rank runs the loop, so every method
/// is called on every rank in the same order (they may communicate).
pub trait Trainee {
    /// Trains optimizer step `step` (0-based).
    fn step(&mut self, step: u64) -> Result<Stepped>;
    /// The validation loss with the run's evaluation settings.
    fn val_loss(&mut self) -> Result<f64>;
    /// Writes a checkpoint after `steps` steps and `tokens_seen` tokens (the run's `last`
    /// one is complete when this returns; others may be written in the background).
    fn save(&mut self, steps: u64, tokens_seen: u64, last: bool) -> Result<Saved>;
    /// Fills the fields of a logged step's metrics that the trainee measures (bytes sent,
    /// resident memory) into `m`.
    fn observe(&mut self, m: &mut StepMetrics) -> Result<()>;
    /// This process's rank (0 logs and writes).
    fn rank(&self) -> usize;
    /// Ranks training together.
    fn ranks(&self) -> usize;
    /// The dtype its forward and backward compute in (the plan's module dtype).
    fn arithmetic(&self) -> ember_sharding::Compute;
}

/// What a save did.
#[derive(Debug, Clone)]
pub struct Saved {
    /// The checkpoint's directory (complete, or once its writer is done).
    pub dir: PathBuf,
    /// Seconds training was held by this save: the whole write, or the copy to host memory.
    pub blocked_s: f64,
    /// Bytes of this rank's state copied to host memory for a background write (0 when the
    /// save was written before it returned).
    pub staged_bytes: u64,
    /// The earlier checkpoint this save first waited for, and how long (its writer was not
    /// done yet).
    pub waited: Option<(PathBuf, f64)>,
}

/// What the loop writes besides stepping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// Everything the configuration asks for: evaluation, `metrics.jsonl`, log lines, the
    /// progress bar, checkpoints at the save interval and at the end.
    Run,
    /// Steps only, nothing written or evaluated (benchmarks).
    Quiet,
}

/// `f(trainee)`, inside [`ember_model::kernels::warm_threads`] when `warm`.
fn on_warm_threads<T: Send, R: Send>(
    warm: bool,
    trainee: &mut T,
    f: impl FnOnce(&mut T) -> R + Send,
) -> R {
    if warm {
        ember_model::kernels::warm_threads(|| f(trainee))
    } else {
        f(trainee)
    }
}

/// Trains `trainee` from step `first_step` (with `tokens_seen` tokens behind it) to
/// `c.max_iters`. Returns every step's report and the metrics lines it logged.
pub fn run(
    trainee: &mut (impl Trainee + Send),
    c: &TrainConfig,
    first_step: u64,
    mut tokens_seen: u64,
    output: Output,
) -> Result<(Vec<Stepped>, Vec<StepMetrics>)> {
    let rank = trainee.rank();
    let writing = output == Output::Run;
    let mut writer = if writing && rank == 0 {
        Some(MetricsWriter::open(
            &c.out_dir,
            (first_step > 0).then_some(first_step),
        )?)
    } else {
        None
    };
    let peak = peak_flops(c.device, c.peak_tflops, trainee.arithmetic());
    let flops_per_token = c.model.train_flops_per_token(c.block_size);
    let bar = if writing {
        progress_bar(c.max_iters, first_step, rank)
    } else {
        indicatif::ProgressBar::hidden()
    };
    let start = Instant::now();
    // (seconds spent in training steps, tokens) since the last logged step: evaluation and
    // checkpointing are kept out of the throughput figure.
    let mut window = (0.0f64, 0u64);
    let mut stepped = Vec::new();
    let mut logged = Vec::new();
    // One process on the CPU has the CPUs to itself: its steps and evaluations run with
    // rayon's other threads kept awake between their parallel ops (BENCHMARKS.md, "Threads
    // kept awake").
    let warm = !c.device.is_cubecl() && trainee.ranks() == 1;
    for step in first_step..c.max_iters {
        let s = on_warm_threads(warm, trainee, |t| t.step(step))?;
        crate::run::launch::RankRecords::stepped(step + 1);
        window.0 += s.step_s;
        window.1 += c.tokens_per_step() as u64;
        tokens_seen += c.tokens_per_step() as u64;
        stepped.push(s.clone());
        if !writing {
            continue;
        }
        let done = step + 1;
        let last = done == c.max_iters;
        let eval_now = c.eval_interval > 0 && (done.is_multiple_of(c.eval_interval) || last);
        let val_loss = if eval_now {
            Some(on_warm_threads(warm, trainee, |t| t.val_loss())?)
        } else {
            None
        };
        bar.set_position(done);
        bar.set_message(format!("loss {:.4}", s.loss));
        // Saved before the step's metrics line, which says how long the save held training.
        let saved = if (c.save_interval > 0 && done.is_multiple_of(c.save_interval)) || last {
            let saved = trainee.save(done, tokens_seen, last)?;
            if let Some((dir, s)) = &saved.waited {
                bar.suspend(|| {
                    log0!(
                        rank,
                        "waited {s:.2} s for {} to be written before the next save",
                        dir.display()
                    )
                });
            }
            bar.suspend(|| {
                if saved.staged_bytes > 0 {
                    log0!(
                        rank,
                        "saving {} in the background (training held {:.3} s to copy {:.1} MB)",
                        saved.dir.display(),
                        saved.blocked_s,
                        saved.staged_bytes as f64 / 1e6
                    )
                } else {
                    log0!(
                        rank,
                        "saved {} ({:.2} s)",
                        saved.dir.display(),
                        saved.blocked_s
                    )
                }
            });
            Some(saved)
        } else {
            None
        };
        if done.is_multiple_of(c.log_interval) || eval_now || last {
            let tokens_per_s = window.1 as f64 / window.0.max(1e-9);
            let ranks = trainee.ranks() as f64;
            let mut m = StepMetrics {
                step: done,
                loss: s.loss,
                lr: s.lr,
                grad_norm: s.grad_norm,
                tokens_per_s,
                // Per-rank MFU: the job's throughput over the sum of the ranks' peaks.
                mfu: peak.map(|p| tokens_per_s * flops_per_token / (p * ranks)),
                elapsed_s: start.elapsed().as_secs_f64(),
                val_loss,
                comm_bytes: None,
                comm_wait_frac: None,
                rss_peak_bytes: None,
                device_bytes: None,
                device_reserved_bytes: None,
                save_blocked_s: saved.as_ref().map(|s| s.blocked_s),
                staging_s: None,
                staging_frac: None,
                staging_bytes: None,
                plan_bytes: None,
                plan_staging: None,
                stragglers: None,
                step_split: None,
            };
            trainee.observe(&mut m)?;
            if let Some(w) = writer.as_mut() {
                w.write(&m)?;
            }
            let val = val_loss.map_or(String::new(), |v| format!(" val {v:.4}"));
            let mfu = m
                .mfu
                .map_or(String::new(), |u| format!(" mfu {:.1}%", 100.0 * u));
            let wait = m
                .comm_wait_frac
                .filter(|_| ranks > 1.0)
                .map_or(String::new(), |w| format!(" comm wait {:.0}%", 100.0 * w));
            bar.suspend(|| {
                log0!(
                    rank,
                    "step {done:>6} loss {:.4}{val} lr {:.2e} norm {:.3} {tokens_per_s:.0} tok/s\
                     {mfu}{wait}",
                    s.loss,
                    s.lr,
                    s.grad_norm
                )
            });
            if let Some(s) = &m.stragglers {
                bar.suspend(|| log0!(rank, "{}", s.line()));
            }
            // On devices with their own memory (where crossings cost): every rank up to 8;
            // beyond, rank 0 and the slowest. metrics.jsonl has every rank on every device.
            let split = m.step_split.as_ref().filter(|_| m.device_bytes.is_some());
            if let Some(split) = split.filter(|s| s.len() > 1) {
                let slowest = (0..split.len())
                    .max_by(|&a, &b| split[a].step_s.total_cmp(&split[b].step_s))
                    .unwrap_or(0);
                for (r, x) in split.iter().enumerate() {
                    if split.len() <= 8 || r == 0 || r == slowest {
                        bar.suspend(|| log0!(rank, "{}", x.line(r)));
                    }
                }
            }
            logged.push(m);
            window = (0.0, 0);
        }
    }
    bar.finish_and_clear();
    Ok((stepped, logged))
}
