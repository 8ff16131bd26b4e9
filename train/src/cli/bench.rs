//! `ember bench train`, `ember bench comm`, `ember bench shard`, `ember bench matmul` and
//! `ember bench staging`: throughput, collectives, sharding presets, a step's products and the
//! crossings between device and host measured, printed as tables or JSON lines.

use clap::{Args, Subcommand};

use ember_train::error::{CliResult, usage};
use ember_train::run::config::{DeviceKind, Dtype, TrainOverrides};
use ember_train::run::shard_args::ShardArgs;
use ember_train::tools::bench;
use ember_train::tools::planning::load_profile;
use ember_train::tools::sharing;
use ember_train::units::parse_size;

// Parsed once per process and matched at once: the size of its largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Training tokens/s and MFU per preset on one process
    #[command(allow_negative_numbers = true)]
    Train(BenchTrainArgs),
    /// Collectives through ember against the raw MPI call, per op, level and size, and the
    /// quantization kernels against memcpy (run under mpirun; rank 0 prints)
    Comm(BenchCommArgs),
    /// Sharded training step time per preset against ddp, bytes per level and memory beside
    /// `ember plan`'s predictions (run under mpirun; rank 0 prints)
    #[command(allow_negative_numbers = true)]
    Shard(BenchShardArgs),
    /// The matrix products of one training step, each timed alone through the op a GPU step
    /// runs it with (Burn's linear or matmul; on flex the step's linear layers run ember's own
    /// products instead), with its TFLOP/s and its accuracy against f64 in bits (about 15
    /// where f32 operands ran on tensor cores as TF32, about 23 in IEEE f32)
    Matmul(BenchMatmulArgs),
    /// The crossings between device and host memory an MPI call makes (f32 and bf16, each
    /// way), measured alone through the functions the sharded step stages with, in GB/s
    Staging(BenchStagingArgs),
}

#[derive(Debug, Args)]
pub struct BenchStagingArgs {
    /// The device: flex, wgpu, cuda[:I] or rocm[:I] (those this binary was built with)
    #[arg(long, default_value = "flex")]
    pub device: DeviceKind,
    /// Bytes per crossing, comma-separated, with K, M or G suffixes
    #[arg(long, value_delimiter = ',', default_value = "1M,16M,64M,256M")]
    pub sizes: Vec<String>,
    /// Crossings per size and kind (the median is reported)
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// One JSON object per line instead of a table
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct BenchMatmulArgs {
    /// The device: flex, wgpu, cuda[:I] or rocm[:I] (those this binary was built with)
    #[arg(long, default_value = "flex")]
    pub device: DeviceKind,
    /// Floating-point type of the operands
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: Dtype,
    /// Model preset whose step's products are timed
    #[arg(long, default_value = "gpt2")]
    pub preset: String,
    /// Sequences per step
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
    /// Tokens per sequence
    #[arg(long, default_value_t = 1024)]
    pub block_size: usize,
    /// Vocabulary size of the head [default: the preset's]
    #[arg(long)]
    pub vocab_size: Option<usize>,
    /// Timed rounds per product (the median is reported)
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Products back to back per round
    #[arg(long, default_value_t = 10)]
    pub per_round: usize,
    /// Also time each product through `torch.mm` with this Python (which must import torch),
    /// on the same threads and operand layouts, after ember's (flex only)
    #[arg(long, value_name = "PYTHON")]
    pub against_torch: Option<String>,
    /// One JSON object per line instead of a table
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct BenchShardArgs {
    /// Sharding presets to measure, comma-separated (put ddp first for the ratio)
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "ddp,zero1,zero2,zero3,zeropp,hier3"
    )]
    pub shards: Vec<String>,
    /// Timed steps per preset
    #[arg(long, default_value_t = 8)]
    pub steps: u64,
    /// Untimed warm-up steps per preset
    #[arg(long, default_value_t = 2)]
    pub warmup: u64,
    /// One JSON object per line instead of a table
    #[arg(long)]
    pub json: bool,
    /// Print `ember plan`'s prediction on this link profile (`frontier` or a file) beside
    /// each measurement [default: the emulated cluster's, when run on one]
    #[arg(long)]
    pub profile: Option<String>,
    /// Also print what ran when in rank 0's last step, beside `ember plan`'s replay
    #[arg(long)]
    pub timeline: bool,
    #[command(flatten)]
    pub settings: TrainOverrides,
    #[command(flatten)]
    pub shard: ShardArgs,
}

#[derive(Debug, Args)]
pub struct BenchCommArgs {
    /// Rank layout NODESxGPUSxGCDS [default: detected]
    #[arg(long)]
    pub topology: Option<String>,
    /// Payload sizes, comma-separated, with K, M or G suffixes [default: 4K to 256M by x4]
    #[arg(long, value_delimiter = ',')]
    pub sizes: Option<Vec<String>>,
    /// Bytes moved per size and side, bounding the iterations [default: the library's]
    #[arg(long)]
    pub bytes_per_size: Option<String>,
    /// Skip the quantize / dequantize kernel timings
    #[arg(long)]
    pub no_kernels: bool,
    /// Skip the collectives (kernels only)
    #[arg(long)]
    pub no_collectives: bool,
    /// One JSON object per line (op, level, bytes, ember_gbps, mpi_gbps, ratio, ...)
    #[arg(long)]
    pub json: bool,
    /// Abort when a collective waits longer than this many seconds
    #[arg(long, default_value_t = 300.0)]
    pub comm_timeout: f64,
}

#[derive(Debug, Args)]
pub struct BenchTrainArgs {
    /// Presets to measure, comma-separated
    #[arg(long, value_delimiter = ',', default_value = "tiny,small-cpu")]
    pub presets: Vec<String>,
    /// Timed steps per preset
    #[arg(long, default_value_t = 20)]
    pub steps: u64,
    /// Untimed warm-up steps per preset
    #[arg(long, default_value_t = 3)]
    pub warmup: u64,
    /// One JSON object per line instead of a table
    #[arg(long)]
    pub json: bool,
    /// Also time the PyTorch eager reference of the same step under this Python interpreter
    /// (which must have torch), alternating with ember, and print both and their ratio
    #[arg(long, value_name = "PYTHON")]
    pub against_torch: Option<String>,
    /// Rounds of ember and PyTorch alternated per preset (with --against-torch)
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Also time PyTorch's model under torch.compile in each round (with --against-torch)
    #[arg(long, requires = "against_torch")]
    pub torch_compile: bool,
    #[command(flatten)]
    pub settings: TrainOverrides,
}

pub fn bench_comm(args: BenchCommArgs) -> CliResult<()> {
    use ember_comm::bench::{BenchConfig, KernelBench, run_comm_bench};
    let shard = ShardArgs {
        topology: args.topology.clone(),
        comm_timeout: args.comm_timeout,
        ..ShardArgs::default()
    };
    let size = |flag: &str, s: &str| {
        parse_size(s).ok_or_else(|| {
            usage(format!(
                "{flag} {s}: write a positive size such as 4K, 1M or 256M"
            ))
        })
    };
    let mut sizes = Vec::new();
    for s in args.sizes.iter().flatten() {
        sizes.push(size("--sizes", s)?);
    }
    let bytes_per_size = args
        .bytes_per_size
        .as_deref()
        .map(|b| size("--bytes-per-size", b))
        .transpose()?;
    let comm = shard.init_comm()?;
    let mut config = BenchConfig::full(&comm);
    if !sizes.is_empty() {
        config.sizes = sizes;
    }
    if let Some(b) = bytes_per_size {
        config.bytes_per_size = b;
    }
    if args.no_kernels {
        config.kernels = KernelBench::Skip;
    }
    if args.no_collectives {
        config.scopes.clear();
    }
    let records = run_comm_bench(&comm, &config);
    if comm.rank() != 0 {
        return Ok(());
    }
    if !args.json {
        println!(
            "{:<20} {:<16} {:>12} {:>6} {:>10} {:>10} {:>7} {:>8}",
            "op", "level", "bytes", "ranks", "ember GB/s", "base GB/s", "ratio", "baseline"
        );
    }
    for r in &records {
        if args.json {
            println!("{}", serde_json::to_string(r).map_err(anyhow::Error::new)?);
        } else {
            println!(
                "{:<20} {:<16} {:>12} {:>6} {:>10.3} {:>10.3} {:>7.3} {:>8}",
                r.op, r.level, r.bytes, r.ranks, r.ember_gbps, r.mpi_gbps, r.ratio, r.baseline
            );
        }
    }
    Ok(())
}

pub fn bench_shard(args: BenchShardArgs) -> CliResult<()> {
    if args.steps == 0 {
        return Err(usage("--steps must be at least 1"));
    }
    if args.shard.shard.is_some() {
        return Err(usage("ember bench shard takes --shards LIST, not --shard"));
    }
    let comm = args.shard.init_comm()?;
    let profile = match (
        &args.profile,
        std::env::var(ember_train::cluster::CLUSTER_ENV),
    ) {
        (Some(spec), _) => Some(load_profile(spec)?),
        (None, Ok(state)) => {
            let dir = std::path::Path::new(&state)
                .parent()
                .map(|d| d.join("profile.toml"))
                .unwrap_or_default();
            Some(load_profile(&dir.display().to_string())?)
        }
        (None, Err(_)) => None,
    };
    if let Some(p) = &profile {
        p.validate(comm.topology().depth())
            .map_err(|e| usage(format!("--profile: {e}")))?;
    }
    let results = bench::bench_shard(
        &comm,
        &args.shard,
        &args.shards,
        &args.settings,
        args.steps,
        args.warmup,
        profile.as_ref(),
    )?;
    if comm.rank() != 0 {
        return Ok(());
    }
    for r in &results {
        if args.json {
            println!("{}", serde_json::to_string(r).map_err(anyhow::Error::new)?);
            continue;
        }
        println!(
            "{:<7} {} on {} ({} ranks), batch {} x {}, recompute {}: {:>9.1} ms/step ({:.1}-{:.1}){}{} \
             {:>7.0} tok/s, comm wait {:>3.0}%{}, outermost level {} B/step, peak resident \
             memory {:.1} MB on the largest rank (plan {:.1} MB)",
            r.shard,
            r.model,
            r.topology,
            r.ranks,
            r.batch_size,
            r.block_size,
            r.recompute,
            r.step_ms_median,
            r.step_ms_range.0,
            r.step_ms_range.1,
            r.step_ms_predicted.map_or(String::new(), |p| format!(
                ", plan {p:.1} ({:.2}x)",
                p / r.step_ms_median
            )),
            r.vs_ddp
                .map_or(String::new(), |x| format!(" ({x:.2}x ddp)")),
            r.tokens_per_s,
            100.0 * r.comm_wait_frac,
            r.comm_wait_predicted
                .map_or(String::new(), |w| format!(" (plan {:.0}%)", 100.0 * w)),
            r.outermost_bytes,
            r.rss_peak_bytes.iter().copied().max().unwrap_or(0) as f64 / 1e6,
            r.plan_bytes as f64 / 1e6
        );
        if let Some(m) = &r.link_bytes_measured {
            for (level, bytes) in m {
                let p = r
                    .link_bytes_predicted
                    .as_ref()
                    .and_then(|p| p.get(level))
                    .copied();
                println!(
                    "          {level} links: {bytes:>12.0} B/step measured on the interfaces{}",
                    p.map_or(String::new(), |p| format!(
                        ", plan {p:.0} of payload (measured {:.3}x)",
                        bytes / p.max(1.0)
                    ))
                );
            }
        }
        for (k, v) in &r.bytes_sent {
            let p = r.bytes_predicted.get(k).copied().unwrap_or(0);
            println!("          {k:<28} {v:>12} B sent (plan {p})");
        }
        if args.timeline {
            print_timelines(&r.timeline, &r.timeline_predicted);
        }
    }
    Ok(())
}

/// The measured and the predicted step side by side, by start time (milliseconds).
fn print_timelines(measured: &[ember_sharding::Interval], predicted: &[ember_sharding::Interval]) {
    let sorted = |v: &[ember_sharding::Interval]| {
        let mut v = v.to_vec();
        v.sort_by(|a, b| a.start.total_cmp(&b.start));
        v
    };
    let (m, p) = (sorted(measured), sorted(predicted));
    println!(
        "          {:<24} {:>9} {:>9}   {:<24} {:>9} {:>9}",
        "measured", "start ms", "ms", "plan", "start ms", "ms"
    );
    for i in 0..m.len().max(p.len()) {
        let cell = |v: &[ember_sharding::Interval]| {
            v.get(i)
                .map_or(format!("{:<24} {:>9} {:>9}", "", "", ""), |s| {
                    format!(
                        "{:<24} {:>9.1} {:>9.1}",
                        s.what,
                        s.start * 1e3,
                        (s.end - s.start) * 1e3
                    )
                })
        };
        println!("          {}   {}", cell(&m), cell(&p));
    }
}

pub fn bench_train(args: BenchTrainArgs) -> CliResult<()> {
    if args.steps == 0 {
        return Err(usage("--steps must be at least 1"));
    }
    if args.rounds == 0 {
        return Err(usage("--rounds must be at least 1"));
    }
    if let Some(p) = &args.settings.preset {
        return Err(usage(format!(
            "bench train measures the presets of --presets; use --presets {p} instead of \
             --preset {p}"
        )));
    }
    if let Some(p) = args
        .presets
        .iter()
        .find(|p| ember_model::GptConfig::preset(p).is_none())
    {
        return Err(usage(format!(
            "--presets: `{p}` is not a preset; choose from: {}",
            ember_model::PRESETS.join(", ")
        )));
    }
    let comm = ShardArgs::default().start()?;
    if let Some(python) = &args.against_torch {
        let torch = bench::TorchReference {
            python: python.clone(),
            compile: args.torch_compile,
        };
        let results = bench::against_torch(
            &comm,
            &torch,
            &args.presets,
            &args.settings,
            args.steps,
            args.warmup,
            args.rounds,
        )?;
        for r in &results {
            if args.json {
                println!("{}", serde_json::to_string(r).map_err(anyhow::Error::new)?);
                warn_if_busy(&[r.ember_elsewhere, r.torch_elsewhere]);
                continue;
            }
            let spread = |v: &[f64]| {
                let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
                let hi = v.iter().copied().fold(0.0, f64::max);
                format!("{lo:.1}-{hi:.1}")
            };
            let compiled = r.torch_compile_median_ms.map_or(String::new(), |c| {
                format!(
                    "  torch.compile {c:>8.1} ms/step ({})  ember/compiled {:.2}x",
                    spread(&r.torch_compile_ms),
                    r.ratio_compile.unwrap_or(f64::NAN)
                )
            });
            let on = if r.device == "cpu" {
                format!("{} threads", r.threads)
            } else {
                format!("on {} ({})", r.device, r.device_name)
            };
            println!(
                "{:<10} {}{} {}  ember {:>8.1} ms/step ({} over {} rounds)  PyTorch {}{} \
                 {:>8.1} ms/step ({})  ember/PyTorch tokens/s {:.2}x{compiled}",
                r.preset,
                r.dtype,
                if r.ember_arithmetic == r.dtype {
                    String::new()
                } else {
                    format!(" (ember computing in {})", r.ember_arithmetic)
                },
                on,
                r.ember_median_ms,
                spread(&r.ember_ms),
                r.ember_ms.len(),
                r.torch,
                if r.dtype == "bf16" {
                    " bf16 autocast"
                } else {
                    ""
                },
                r.torch_median_ms,
                spread(&r.torch_ms),
                r.ratio
            );
            if let Some(line) = elsewhere_line(&[
                ("ember's rounds", r.ember_elsewhere),
                ("PyTorch's", r.torch_elsewhere),
            ]) {
                println!("{:<10} {line}", "");
            }
            warn_if_busy(&[r.ember_elsewhere, r.torch_elsewhere]);
        }
        return Ok(());
    }
    let results = bench::bench_train(
        &comm,
        &args.presets,
        &args.settings,
        args.steps,
        args.warmup,
    )?;
    for r in &results {
        if args.json {
            println!("{}", serde_json::to_string(r).map_err(anyhow::Error::new)?);
        } else {
            println!(
                "{:<10} {:>6} {:>4}{} {:>8.2}M params  batch {} x {}  {} threads  {:>8.1} ms/step  \
                 {:>8.0} tok/s  {:>6.1} GFLOP/s  MFU {}  first step {:.1} ms",
                r.preset,
                r.device,
                r.dtype,
                if r.arithmetic == r.dtype {
                    String::new()
                } else {
                    format!(" computing in {}", r.arithmetic)
                },
                r.params as f64 / 1e6,
                r.batch_size,
                r.block_size,
                r.threads,
                r.step_ms_median,
                r.tokens_per_s,
                r.gflops,
                r.mfu.map_or("n/a".into(), |m| format!("{:.1}%", m * 100.0)),
                r.first_step_ms,
            );
            if let Some(line) = elsewhere_line(&[("the run", r.elsewhere)]) {
                println!("{:<10} {line}", "");
            }
        }
        warn_if_busy(&[r.elsewhere]);
    }
    Ok(())
}

/// "the CPUs: other processes took 0.4% and steal 0.0% during ember's rounds, ...": the most
/// of the CPUs that went elsewhere in each of `shares` (none where nothing was measured).
fn elsewhere_line(shares: &[(&str, Option<sharing::Sharing>)]) -> Option<String> {
    let parts: Vec<String> = shares
        .iter()
        .filter_map(|(during, s)| {
            s.map(|s| {
                format!(
                    "{:.1}% to other processes and {:.1}% stolen during {during}",
                    s.others * 100.0,
                    s.steal * 100.0
                )
            })
        })
        .collect();
    (!parts.is_empty()).then(|| format!("the CPUs, at most: {}", parts.join("; ")))
}

/// A warning on standard error where more than [`sharing::QUIET_BELOW`] of the CPUs went to
/// other processes or the hypervisor in a round: figures from a busy machine are suspect.
fn warn_if_busy(shares: &[Option<sharing::Sharing>]) {
    let worst = shares
        .iter()
        .flatten()
        .map(|s| s.elsewhere())
        .fold(0.0, f64::max);
    if worst > sharing::QUIET_BELOW {
        eprintln!(
            "[ember] warning: up to {:.0}% of the CPUs went to other processes or were stolen \
             by the hypervisor during a round: these times are only as good as the machine was \
             quiet; rerun with nothing else running (on a VM, steal is the host's doing)",
            worst * 100.0
        );
    }
}

pub fn bench_matmul(args: BenchMatmulArgs) -> CliResult<()> {
    use ember_train::tools::products::{Layout, bench_products, step_products};
    let model = ember_model::GptConfig::preset(&args.preset).ok_or_else(|| {
        usage(format!(
            "--preset {}: no such preset; use one of {}",
            args.preset,
            ember_model::PRESETS.join(", ")
        ))
    })?;
    if args.batch_size == 0 || args.block_size == 0 || args.vocab_size == Some(0) {
        return Err(usage(
            "--batch-size, --block-size and --vocab-size must be at least 1",
        ));
    }
    let products = step_products(
        model.n_embd,
        model.n_layer,
        args.vocab_size.unwrap_or(model.vocab_size),
        args.batch_size,
        args.block_size,
    );
    if args.against_torch.is_some() && args.device != DeviceKind::Flex {
        return Err(usage(
            "--against-torch: ember bench matmul compares with torch.mm on the CPU (--device \
             flex); the GPU check sets a card's products beside torch.mm",
        ));
    }
    let results = bench_products(
        args.device,
        args.dtype,
        &products,
        args.rounds,
        args.per_round,
    )?;
    let torch = match &args.against_torch {
        Some(python) => Some(ember_train::tools::products::torch_mm(
            python,
            args.dtype,
            &products,
            args.rounds,
            args.per_round,
            rayon::current_num_threads(),
        )?),
        None => None,
    };
    let step_ms: f64 = results
        .iter()
        .map(|r| r.ms * r.product.per_step as f64)
        .sum();
    for (i, r) in results.iter().enumerate() {
        let torch_ms = torch.as_ref().map(|t| t[i]);
        if args.json {
            let mut v = serde_json::to_value(r).map_err(anyhow::Error::new)?;
            if let Some(ms) = torch_ms {
                v["torch_mm_ms"] = ms.into();
                v["ratio"] = (ms / r.ms).into();
            }
            println!("{v}");
            continue;
        }
        let p = &r.product;
        let beside = torch_ms.map_or(String::new(), |ms| {
            format!(
                "  torch.mm {ms:9.3} ms {:>8.2} TFLOP/s  ember/torch {:.2}x",
                2.0 * (p.m * p.n * p.k) as f64 / ms / 1e9,
                ms / r.ms
            )
        });
        println!(
            "{:<28} {:>6} x {:>6} x {:>6} {:<6} x{:<3} {:>9.3} ms {:>8.2} TFLOP/s {:>5.1} bits  (first {:.1} ms){beside}",
            p.name,
            p.m,
            p.k,
            p.n,
            match (p.lhs, p.rhs) {
                (Layout::Transposed, _) => "lhs^T",
                (_, Layout::Transposed) => "rhs^T",
                _ => "",
            },
            p.per_step,
            r.ms,
            r.tflops,
            r.accuracy.bits,
            r.first_ms
        );
    }
    if !args.json {
        let torch_step = torch.as_ref().map_or(String::new(), |t| {
            let ms: f64 = t
                .iter()
                .zip(&results)
                .map(|(ms, r)| ms * r.product.per_step as f64)
                .sum();
            format!(", torch.mm {ms:.2} ms: ember/torch {:.2}x", ms / step_ms)
        });
        println!(
            "{} {} products per step: {step_ms:.2} ms on {} in {:?}{torch_step}",
            args.preset,
            results.iter().map(|r| r.product.per_step).sum::<usize>(),
            args.device,
            args.dtype
        );
    }
    Ok(())
}

pub fn bench_staging(args: BenchStagingArgs) -> CliResult<()> {
    use ember_sharding::plumbing::staging::crossing_rates;
    let mut sizes = Vec::new();
    for s in &args.sizes {
        match parse_size(s) {
            Some(b) if b >= 4 => sizes.push(b as usize),
            _ => {
                return Err(usage(format!(
                    "--sizes {s}: write a size of at least 4 bytes such as 1M or 256M"
                )));
            }
        }
    }
    if args.rounds == 0 {
        return Err(usage("--rounds must be at least 1"));
    }
    let device = ember_train::run::device::device(args.device)?;
    // As a run on the device allocates its staging buffers.
    if args.device.is_cubecl() {
        ember_train::run::host_memory::set_allocator_for_device_staging();
    }
    if !args.json {
        println!(
            "{:>12}  {:>12} {:>12} {:>12} {:>12}   GB/s on {}",
            "bytes", "f32 to host", "to device", "bf16 to host", "to device", args.device
        );
    }
    for bytes in sizes {
        let r = crossing_rates(&device, bytes, args.rounds).map_err(|e| {
            ember_train::error::CliError::Runtime(anyhow::anyhow!(
                "--device {} --sizes {bytes}: {e}; give smaller --sizes",
                args.device
            ))
        })?;
        if args.json {
            let mut v = serde_json::to_value(r).map_err(anyhow::Error::new)?;
            v["device"] = args.device.to_string().into();
            println!("{v}");
        } else {
            println!(
                "{:>12}  {:>12.2} {:>12.2} {:>12.2} {:>12.2}",
                r.bytes,
                r.to_host_f32 / 1e9,
                r.to_device_f32 / 1e9,
                r.to_host_bf16 / 1e9,
                r.to_device_bf16 / 1e9
            );
        }
    }
    Ok(())
}
