//! The command-line flags of the partition: the `--shard` preset and the per-state flags that
//! adjust it, the rank topology, and MPI start-up. A run without `--shard` is one process: a
//! world of one rank under the `ddp` preset, through the same engine and loop.

use std::time::Duration;

use clap::Args;
use ember_comm::{Comm, CommConfig, PanicPolicy, Topology, TopologySource};
use ember_sharding::{GradQuant, Preset, Recompute, ShardConfig, ShardError, Span, WeightQuant};

use crate::error::{CliResult, usage};
use crate::run::config::Dtype;

/// Flags of sharded training. `train` refuses them without `--shard`; `bench shard` takes
/// them with `--shards`, and `--comm-timeout` also applies to `bench comm`.
#[derive(Debug, Clone, Args)]
pub struct ShardArgs {
    /// Shard over the MPI ranks with this preset: ddp, zero1, zero2, zero3, zeropp, hier3
    /// (run under mpirun; one process without it is a world of one)
    #[arg(long, value_name = "PRESET")]
    pub shard: Option<String>,
    /// Rank layout NODESxGPUSxGCDS, e.g. 2x2x2 for 8 ranks [default: detected: nodes from
    /// shared memory, GCDs per GPU from EMBER_GCDS_PER_GPU or 1]
    #[arg(long)]
    pub topology: Option<String>,
    /// Secondary parameter copy for backward and later micro-batches: none, gcd (a whole
    /// copy per rank), gpu (split over the GCDs of a GPU), node (split over the node)
    #[arg(long)]
    pub secondary: Option<String>,
    /// Where gradients accumulate over the micro-batches of a step: a level inside the
    /// gradient path (gpu, node), whose hops run after every micro-batch while the hops
    /// beyond it run once per step, or none (every hop after every micro-batch) [default:
    /// node for hier3, none for the other presets]
    #[arg(long, value_name = "LEVEL")]
    pub accumulate_at: Option<String>,
    /// Weight quantization of parameter gathers: off, int8
    #[arg(long)]
    pub quantize_weights: Option<String>,
    /// Gradient quantization of the reduce-scatter: off, int4, int8
    #[arg(long)]
    pub quantize_grads: Option<String>,
    /// Units gathered ahead of the one computing [default: 1]
    #[arg(long)]
    pub prefetch: Option<usize>,
    /// Keep each rank's gradient quantization error and add it back next step (LoCo-style)
    #[arg(long)]
    pub error_feedback: bool,
    /// Elements per quantization block [default: 128]
    #[arg(long)]
    pub quant_block: Option<usize>,
    /// What a unit with partitioned parameters keeps for backward: unit (its input; backward
    /// gathers it again and recomputes its forward) or none (its activations and gathered
    /// parameters, no recompute) [default: for `train` and `bench shard`, none when the plan
    /// then fits this machine's available memory, else unit; for `plan` and `reshard`, unit]
    #[arg(long, value_name = "unit|none")]
    pub recompute: Option<String>,
    /// Abort the job when a collective waits longer than this many seconds
    #[arg(long, default_value_t = COMM_TIMEOUT_S)]
    pub comm_timeout: f64,
}

/// The default collective timeout, seconds.
pub const COMM_TIMEOUT_S: f64 = 300.0;

impl Default for ShardArgs {
    /// One process, no sharding flags, the default timeout (what no flags parse to).
    fn default() -> Self {
        Self {
            shard: None,
            topology: None,
            secondary: None,
            accumulate_at: None,
            quantize_weights: None,
            quantize_grads: None,
            prefetch: None,
            error_feedback: false,
            quant_block: None,
            recompute: None,
            comm_timeout: COMM_TIMEOUT_S,
        }
    }
}

impl ShardArgs {
    /// Refuses sharding flags given without `--shard`.
    pub fn check_unused(&self) -> CliResult<()> {
        let given = [
            ("--topology", self.topology.is_some()),
            ("--secondary", self.secondary.is_some()),
            ("--accumulate-at", self.accumulate_at.is_some()),
            ("--quantize-weights", self.quantize_weights.is_some()),
            ("--quantize-grads", self.quantize_grads.is_some()),
            ("--prefetch", self.prefetch.is_some()),
            ("--error-feedback", self.error_feedback),
            ("--quant-block", self.quant_block.is_some()),
            ("--recompute", self.recompute.is_some()),
        ];
        if let Some((flag, _)) = given.iter().find(|g| g.1) {
            return Err(usage(format!(
                "{flag} applies to sharded training: add --shard PRESET (e.g. --shard zero3)"
            )));
        }
        Ok(())
    }

    /// Starts MPI for a training job: with `--shard`, as the flags say; without, as one
    /// process (sharding flags are refused then, and so are several ranks, since each would
    /// train alone).
    pub fn start(&self) -> CliResult<Comm> {
        if self.shard.is_none() {
            self.check_unused()?;
            refuse_unsharded_mpi_job()?;
        }
        self.init_comm()
    }

    /// Starts MPI with the requested topology and timeout.
    pub fn init_comm(&self) -> CliResult<Comm> {
        if !(self.comm_timeout > 0.0 && self.comm_timeout.is_finite()) {
            return Err(usage(format!(
                "--comm-timeout {} must be a positive number of seconds",
                self.comm_timeout
            )));
        }
        let topology = match &self.topology {
            Some(spec) => TopologySource::Explicit(
                Topology::parse(spec).map_err(|e| usage(format!("--topology {spec}: {e}")))?,
            ),
            None => TopologySource::Detect { gcds_per_gpu: None },
        };
        Comm::init(CommConfig {
            topology,
            timeout: Duration::from_secs_f64(self.comm_timeout),
            panic_policy: PanicPolicy::AbortJob,
            ..CommConfig::default()
        })
        .map_err(|e| match &self.topology {
            Some(spec) => usage(format!("--topology {spec}: {e}")),
            None => usage(format!("{e} (--topology NODESxGPUSxGCDS)")),
        })
    }

    /// The preset with the per-state flags applied, validated against `topology`.
    pub fn resolve(&self, topology: &Topology, dtype: Dtype) -> CliResult<ShardConfig> {
        let preset = self.shard.as_deref().unwrap_or("ddp");
        let mut c = preset.parse::<Preset>()?.config(topology.depth());
        if let Some(s) = &self.secondary {
            c.set_secondary(level_or_none("--secondary", s, topology)?)?;
        }
        if let Some(s) = &self.accumulate_at {
            c.set_accumulate(level_or_none("--accumulate-at", s, topology)?)?;
        }
        if let Some(q) = &self.quantize_weights {
            c.set_quantize_weights(match q.as_str() {
                "off" => WeightQuant::Off,
                "int8" => WeightQuant::Int8,
                other => {
                    return Err(usage(format!(
                        "--quantize-weights {other}: use off or int8"
                    )));
                }
            })?;
        }
        if let Some(q) = &self.quantize_grads {
            c.set_quantize_grads(match q.as_str() {
                "off" => GradQuant::Off,
                "int4" => GradQuant::Int4,
                "int8" => GradQuant::Int8,
                other => {
                    return Err(usage(format!(
                        "--quantize-grads {other}: use off, int4 or int8"
                    )));
                }
            })?;
        }
        if let Some(p) = self.prefetch {
            c.prefetch = p;
        }
        if let Some(b) = self.quant_block {
            c.quant_block = b;
        }
        if let Some(r) = &self.recompute {
            c.recompute = match r.as_str() {
                "unit" => Recompute::Unit,
                "none" => Recompute::None,
                other => return Err(usage(format!("--recompute {other}: use unit or none"))),
            };
        }
        c.set_error_feedback(self.error_feedback)?;
        c.compute = dtype.into();
        c.validate(topology)?;
        Ok(c)
    }
}

/// A level's span, or `None` for `none`, as flag `flag` gave it.
fn level_or_none(flag: &str, name: &str, topology: &Topology) -> CliResult<Option<Span>> {
    if name == "none" {
        return Ok(None);
    }
    Span::parse(name, topology).map(Some).map_err(|e| match e {
        ShardError::Setting { .. } => {
            let levels: Vec<&str> = topology.levels().iter().map(|l| l.name.as_str()).collect();
            usage(format!(
                "{flag} {name}: not a level; use one of {}, or none",
                levels.join(", ")
            ))
        }
        e => e.into(),
    })
}

/// Several ranks started by a launcher without `--shard` would each train alone and write the
/// same out dir: refuse, saying what to add.
fn refuse_unsharded_mpi_job() -> CliResult<()> {
    for var in ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"] {
        if let Ok(v) = std::env::var(var)
            && v.trim().parse::<usize>().is_ok_and(|n| n > 1)
        {
            return Err(usage(format!(
                "started as one of {} ranks ({var}) without --shard: add --shard PRESET \
                 (e.g. --shard ddp) or run one process",
                v.trim()
            )));
        }
    }
    Ok(())
}
