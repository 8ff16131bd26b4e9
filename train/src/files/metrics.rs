//! Run output: rank-0 log lines on stderr, `metrics.jsonl` (one JSON object per logged
//! step), and the progress bar, which indicatif hides when stderr is not a terminal.

use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

/// Prints a log line from rank 0 only (llm.c's `printf0`); other ranks stay quiet.
#[macro_export]
macro_rules! log0 {
    ($rank:expr, $($arg:tt)*) => {
        if $rank == 0 {
            eprintln!("[ember] {}", format!($($arg)*));
        }
    };
}

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Optimizer steps completed.
    pub step: u64,
    /// Mean training loss of this step's global batch (nats/token).
    pub loss: f64,
    /// Learning rate used for this step.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Training throughput since the previous logged step.
    pub tokens_per_s: f64,
    /// Model FLOPs utilisation (6N + 12LdT per token over the device peak), if known.
    pub mfu: Option<f64>,
    /// Seconds since the run (or resume) started.
    pub elapsed_s: f64,
    /// Validation loss, on evaluation steps.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub val_loss: Option<f64>,
    /// Sharded runs: bytes this rank sent during the step, per group of levels (`gcd`,
    /// `gcd+gpu`, `node`, ...) and op, e.g. `"gcd+gpu+node/all_gather"`.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub comm_bytes: Option<std::collections::BTreeMap<String, u64>>,
    /// Sharded runs: share of the step's time the training thread waited on communication.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub comm_wait_frac: Option<f64>,
    /// Peak resident memory of each rank since it started, in bytes, as the OS reports it
    /// (`VmHWM`), rank 0 first.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub rss_peak_bytes: Option<Vec<u64>>,
    /// Bytes in use on each rank's device memory (rank 0 first), where the backend reports
    /// them (wgpu); absent on CPU backends, whose memory is the resident set.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub device_bytes: Option<Vec<u64>>,
    /// Bytes each rank's device memory pools hold from the driver (rank 0 first), in use or
    /// kept for reuse, where the backend reports them (CubeCL devices).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub device_reserved_bytes: Option<Vec<u64>>,
    /// Steps that saved a checkpoint: seconds the save held training on rank 0 (the whole
    /// write, or only the copy to host memory of a checkpoint written in the background).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub save_blocked_s: Option<f64>,
    /// Sharded runs: rank 0's seconds in the step's crossings between device and host memory
    /// (collectives' bytes staged for MPI, quantized bytes to and from the device kernels),
    /// summed over its threads, and that as a share of the step.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub staging_s: Option<f64>,
    /// Sharded runs: `staging_s` over the step's time.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub staging_frac: Option<f64>,
    /// Sharded runs: bytes rank 0's step moved between device and host memory, both ways.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub staging_bytes: Option<u64>,
    /// Sharded runs on a device with memory of its own: the plan's prediction of the bytes
    /// each rank's step moves between device and host memory, each way (what `step_split`
    /// measures).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub plan_staging: Option<ember_sharding::StagedBytes>,
    /// Sharded runs: the plan's prediction of what one rank holds at its peak, in bytes.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub plan_bytes: Option<u64>,
    /// Sharded runs on several GPUs: every rank's last step and its links' throughput.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub stragglers: Option<Stragglers>,
    /// Sharded runs: where every rank's step went (rank 0 first): compute, crossings between
    /// device and host memory each way, and waiting on MPI.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub step_split: Option<Vec<StepSplit>>,
}

/// One rank's step, split. On the training thread the step is `compute_s + staging_s +
/// comm_wait_s`: `compute_s` is what the other two leave. The crossings each way are every
/// thread's (communication threads stage too, beside the training thread's compute), with
/// their bytes and the rate they moved at.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepSplit {
    /// The step, seconds.
    pub step_s: f64,
    /// The training thread's time in neither a crossing nor a wait on communication.
    pub compute_s: f64,
    /// The training thread's seconds in crossings between device and host memory.
    pub staging_s: f64,
    /// The training thread's seconds blocked on communication.
    pub comm_wait_s: f64,
    /// Every thread's seconds in crossings from the device to the host, and their bytes.
    pub to_host_s: f64,
    /// Every thread's seconds waiting, before those crossings, for the kernels that produce
    /// what they read (not part of `to_host_s`).
    #[serde(default)]
    pub to_host_wait_s: f64,
    /// Bytes read back from the device.
    pub to_host_bytes: u64,
    /// `to_host_bytes / to_host_s`, GB/s (0 where nothing crossed).
    pub to_host_gbps: f64,
    /// Every thread's seconds in crossings from the host to the device.
    pub to_device_s: f64,
    /// Bytes written to the device.
    pub to_device_bytes: u64,
    /// `to_device_bytes / to_device_s`, GB/s (0 where nothing crossed).
    pub to_device_gbps: f64,
}

impl StepSplit {
    /// Words of [`StepSplit::to_words`].
    pub const WORDS: usize = 8;

    /// From a step's report.
    pub fn new(step_s: f64, comm_wait_s: f64, staging: &ember_sharding::Staging) -> Self {
        let gbps = |r: Option<f64>| r.map_or(0.0, |r| r / 1e9);
        Self {
            step_s,
            compute_s: (step_s - comm_wait_s - staging.this_thread_seconds).max(0.0),
            staging_s: staging.this_thread_seconds,
            comm_wait_s,
            to_host_s: staging.to_host_seconds,
            to_host_wait_s: staging.to_host_wait_seconds,
            to_host_bytes: staging.to_host_bytes,
            to_host_gbps: gbps(staging.to_host_rate()),
            to_device_s: staging.to_device_seconds,
            to_device_bytes: staging.to_device_bytes,
            to_device_gbps: gbps(staging.to_device_rate()),
        }
    }

    /// As little-endian words, for gathering over the ranks.
    pub fn to_words(&self) -> [[u8; 8]; Self::WORDS] {
        [
            self.step_s.to_le_bytes(),
            self.comm_wait_s.to_le_bytes(),
            self.staging_s.to_le_bytes(),
            self.to_host_s.to_le_bytes(),
            self.to_host_bytes.to_le_bytes(),
            self.to_device_s.to_le_bytes(),
            self.to_device_bytes.to_le_bytes(),
            self.to_host_wait_s.to_le_bytes(),
        ]
    }

    /// From the words of [`StepSplit::to_words`].
    pub fn from_words(w: &[[u8; 8]; Self::WORDS]) -> Self {
        let f = |i: usize| f64::from_le_bytes(w[i]);
        let staging = ember_sharding::Staging {
            to_host_seconds: f(3),
            to_host_wait_seconds: f(7),
            to_device_seconds: f(5),
            this_thread_seconds: f(2),
            to_host_bytes: u64::from_le_bytes(w[4]),
            to_device_bytes: u64::from_le_bytes(w[6]),
        };
        Self::new(f(0), f(1), &staging)
    }

    /// One log line for `rank`.
    pub fn line(&self, rank: usize) -> String {
        let way = |bytes: u64, s: f64, gbps: f64| {
            format!(
                "{:.1} MB in {:.3} s at {:.2} GB/s",
                bytes as f64 / 1e6,
                s,
                gbps
            )
        };
        format!(
            "rank {rank} step {:.3} s: compute {:.3} + staging {:.3} + MPI wait {:.3}; \
             device to host {} (after {:.3} s waiting for its kernels), host to device {}",
            self.step_s,
            self.compute_s,
            self.staging_s,
            self.comm_wait_s,
            way(self.to_host_bytes, self.to_host_s, self.to_host_gbps),
            self.to_host_wait_s,
            way(self.to_device_bytes, self.to_device_s, self.to_device_gbps),
        )
    }
}

/// How evenly the ranks moved in the last step: their step times, and the megabytes per
/// second each one's messages to and from other GPUs moved at (measured around every
/// exchange), whose slowest rank is the one behind a slow link.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stragglers {
    /// Every rank's last step, seconds, rank 0 first.
    pub step_s: Vec<f64>,
    /// Every rank's throughput to other GPUs, MB/s (0 where it sent nothing there).
    pub link_mbytes_per_s: Vec<f64>,
    /// The rank with the slowest links.
    pub slowest_rank: usize,
}

impl Stragglers {
    /// From every rank's `(step seconds, off-GPU bytes, off-GPU nanoseconds)`.
    pub fn new(ranks: &[(f64, u64, u64)]) -> Option<Self> {
        let rates: Vec<f64> = ranks
            .iter()
            .map(|&(_, b, n)| {
                if n > 0 {
                    b as f64 / n as f64 * 1e3
                } else {
                    0.0
                }
            })
            .collect();
        let slowest_rank = rates
            .iter()
            .enumerate()
            .filter(|(_, r)| **r > 0.0)
            .min_by(|a, b| a.1.total_cmp(b.1))?
            .0;
        Some(Self {
            step_s: ranks.iter().map(|r| r.0).collect(),
            link_mbytes_per_s: rates,
            slowest_rank,
        })
    }

    /// One log line: the spread of step times, and the slowest rank against the median.
    pub fn line(&self) -> String {
        let lo = self.step_s.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = self.step_s.iter().copied().fold(0.0, f64::max);
        let mut rates: Vec<f64> = self
            .link_mbytes_per_s
            .iter()
            .copied()
            .filter(|r| *r > 0.0)
            .collect();
        rates.sort_by(f64::total_cmp);
        let median = rates.get(rates.len() / 2).copied().unwrap_or(0.0);
        format!(
            "stragglers: step {:.3}-{:.3} s over {} ranks; slowest links: rank {} at {:.2} MB/s \
             to other GPUs (median rank {:.2} MB/s)",
            lo,
            hi,
            self.step_s.len(),
            self.slowest_rank,
            self.link_mbytes_per_s[self.slowest_rank],
            median
        )
    }
}

/// Appends to `metrics.jsonl`, flushing each line so a crash loses at most one.
#[derive(Debug)]
pub struct MetricsWriter {
    path: PathBuf,
    file: File,
}

impl MetricsWriter {
    /// Opens `out_dir/metrics.jsonl`. When resuming at `resume_step`, lines of later steps
    /// (written after that checkpoint by the interrupted run) are dropped first, so the file
    /// never holds two histories.
    pub fn open(out_dir: &Path, resume_step: Option<u64>) -> Result<Self> {
        fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
        let path = out_dir.join("metrics.jsonl");
        match resume_step {
            Some(step) if path.exists() => {
                // Events (a launcher's failures and restarts) stay; steps past the
                // checkpoint go.
                let text = fs::read_to_string(&path)
                    .with_context(|| format!("reading {}", path.display()))?;
                let mut kept = String::new();
                for line in text.lines().filter(|l| !l.trim().is_empty()) {
                    let v: serde_json::Value = serde_json::from_str(line)
                        .with_context(|| format!("{}: bad line {line}", path.display()))?;
                    if v.get("event").is_some() || v["step"].as_u64().is_some_and(|s| s <= step) {
                        kept.push_str(line);
                        kept.push('\n');
                    }
                }
                fs::write(&path, kept).with_context(|| format!("writing {}", path.display()))?;
            }
            None => {
                File::create(&path).with_context(|| format!("creating {}", path.display()))?;
            }
            Some(_) => {}
        }
        let file = OpenOptions::new().append(true).create(true).open(&path)?;
        Ok(Self { path, file })
    }

    /// Writes one line.
    pub fn write(&mut self, m: &StepMetrics) -> Result<()> {
        writeln!(self.file, "{}", serde_json::to_string(m)?)
            .with_context(|| format!("writing {}", self.path.display()))?;
        self.file.flush()?;
        Ok(())
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Reads every step line of a metrics file (event lines are [`read_events`]').
pub fn read_metrics(path: &Path) -> Result<Vec<StepMetrics>> {
    let mut out = Vec::new();
    for v in read_lines(path)? {
        if v.get("event").is_none() {
            out.push(
                serde_json::from_value(v.clone())
                    .with_context(|| format!("{}: bad line {v}", path.display()))?,
            );
        }
    }
    Ok(out)
}

/// Reads the event lines of a metrics file: those `ember launch` writes (`failure`,
/// `restart`, `recovered`, `finished`, `gave_up`), in order.
pub fn read_events(path: &Path) -> Result<Vec<serde_json::Value>> {
    Ok(read_lines(path)?
        .into_iter()
        .filter(|v| v.get("event").is_some())
        .collect())
}

fn read_lines(path: &Path) -> Result<Vec<serde_json::Value>> {
    let f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    BufReader::new(f)
        .lines()
        .filter(|l| l.as_ref().map_or(true, |l| !l.trim().is_empty()))
        .map(|l| {
            let l = l?;
            serde_json::from_str(&l).with_context(|| format!("{}: bad line {l}", path.display()))
        })
        .collect()
}

/// A progress bar over training steps on a terminal; hidden otherwise (and on ranks > 0).
pub fn progress_bar(total: u64, start: u64, rank: usize) -> indicatif::ProgressBar {
    if rank != 0 {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:30}] {pos}/{len} steps  {msg}  (eta {eta})",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    bar.set_position(start);
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_split_crosses_ranks_whole_and_leaves_compute_what_the_rest_leave() {
        let staging = ember_sharding::Staging {
            to_host_seconds: 0.2,
            to_host_wait_seconds: 0.125,
            to_device_seconds: 0.3,
            this_thread_seconds: 0.25,
            to_host_bytes: 400_000_000,
            to_device_bytes: 150_000_000,
        };
        let s = StepSplit::new(1.0, 0.5, &staging);
        assert_eq!(s.compute_s, 0.25);
        assert_eq!((s.to_host_gbps, s.to_device_gbps), (2.0, 0.5));
        assert_eq!(s.to_host_wait_s, 0.125);
        assert_eq!(StepSplit::from_words(&s.to_words()), s);
        assert!(
            s.line(1)
                .starts_with("rank 1 step 1.000 s: compute 0.250 + staging 0.250")
        );
        // Nothing crossed: no rate, and compute never negative.
        let idle = StepSplit::new(0.1, 0.2, &ember_sharding::Staging::default());
        assert_eq!((idle.compute_s, idle.to_host_gbps), (0.0, 0.0));
    }
}
