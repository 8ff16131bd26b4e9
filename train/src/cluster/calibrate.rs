//! The machine measured for the planner: the engine's compute, the optimizer's, copies' and
//! quantization's costs, and the profile (`profile.toml`) `ember plan --profile` reads.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Instant;

use super::state::*;
use anyhow::{Context, Result, anyhow, bail};
use ember_comm::Topology;
use serde::Serialize;

/// The link profile of the cluster, for `ember plan --profile`.
///
/// Link rates and latencies are what ember's own collectives reach over each tier under MPI
/// (`probe_links`); the GCD level is shared memory inside one namespace, at the measured copy
/// rate. Compute and CPU costs are measured (`calibrate`).
pub fn profile_toml(c: &Cluster) -> Result<String> {
    let rate = |tier: &str, shaped: f64| c.probed_mbit.get(tier).copied().unwrap_or(shaped);
    let gbps = |mbit: f64| mbit / 8.0 / 1000.0;
    let lat = |tier: &str| c.rtt_us.get(tier).map_or(50.0, |r| r / 2.0);
    let dims = c.topology().dims();
    let m = &c.measured;
    let shm = 1e-9 / m.cpu.copy_byte_s;
    let mpi = |level: &str, field: fn(&MpiProbe) -> &Vec<(String, f64)>| {
        c.mpi
            .as_ref()
            .and_then(|m| field(m).iter().find(|l| l.0 == level).map(|l| l.1))
    };
    let gpu = mpi("gpu", |m| &m.link_gbps).unwrap_or(gbps(rate("gpu", c.spec.gpu_link_mbit)));
    let node = mpi("node", |m| &m.link_gbps).unwrap_or(gbps(rate("node", c.spec.uplink_mbit)));
    let lat = |tier: &str| mpi(tier, |m| &m.latency_us).unwrap_or(lat(tier));
    #[derive(Serialize)]
    struct File<'a> {
        name: String,
        level_gbps: Vec<(String, f64)>,
        link_gbps: Vec<(String, f64)>,
        latency_us: Vec<(String, f64)>,
        #[serde(skip_serializing_if = "Option::is_none")]
        flow_efficiency: Option<Vec<(String, f64)>>,
        rank_tflops: f64,
        peak_tflops: f64,
        mfu: f64,
        cpu: &'a ember_sharding::plan::profile::CpuProfile,
    }
    let names = ["gcd", "gpu", "node"].map(String::from);
    let file = File {
        name: format!("emulated-{}", c.spec.prefix),
        level_gbps: names
            .iter()
            .cloned()
            .zip([shm, gpu / dims[0] as f64, node / (dims[0] * dims[1]) as f64])
            .collect(),
        link_gbps: names.iter().cloned().zip([shm, gpu, node]).collect(),
        latency_us: names
            .iter()
            .cloned()
            .zip([5.0, lat("gpu"), lat("node")])
            .collect(),
        flow_efficiency: c
            .mpi
            .as_ref()
            .filter(|m| !m.flow_efficiency.is_empty())
            .map(|_| {
                let shared = |level: &str| mpi(level, |m| &m.flow_efficiency).unwrap_or(1.0);
                names
                    .iter()
                    .cloned()
                    .zip([1.0, shared("gpu"), shared("node")])
                    .collect()
            }),
        rank_tflops: m.rank_tflops,
        peak_tflops: m.rank_tflops,
        mfu: 1.0,
        cpu: &m.cpu,
    };
    Ok(format!(
        "# The emulated cluster `{}` ({}), written by `ember cluster up`: links as probed, \
         compute and CPU costs as measured ({}).\n{}",
        c.spec.prefix,
        c.spec.topology,
        m.calibration,
        toml::to_string(&file)?
    ))
}

/// The model whose training steps `up` times to measure the engine's compute.
#[derive(Debug, Clone)]
pub struct Calibration {
    /// The model.
    pub model: ember_model::GptConfig,
    /// Its preset's name (the calibration runs `ember bench shard --preset` with it).
    pub preset: String,
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Measures what the profile needs of this machine for `topology`'s ranks on its cores:
///
/// - the engine's compute: two single-process runs of `ember bench shard --shards zero3
///   --recompute none` on one thread (the calibration model at 1 and 4 sequences), whose step
///   times give the seconds per FLOP and per parameter a visit computes;
/// - the optimizer step, copies and quantization: timed here on one thread;
/// - the TCP/IP stack: `tcp_byte_s`, the CPU per byte of the probes.
///
/// Each rank gets the machine's cores over its ranks.
pub fn calibrate(
    c: &Calibration,
    topology: &Topology,
    tcp_byte_s: BTreeMap<String, f64>,
) -> Result<Measured> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .context("starting a one-thread pool")?;
    let (copy_byte_s, quant_element_s, optimizer_element_s) = pool.install(kernel_costs);
    let (flop_s, visit_param_s) = engine_costs(c, optimizer_element_s)?;
    let cores_per_rank = (cores() as f64 / topology.world_size() as f64).min(1.0);
    let tcp = |tier: &str| tcp_byte_s.get(tier).copied().unwrap_or(0.0);
    Ok(Measured {
        rank_tflops: cores_per_rank / flop_s / 1e12,
        cpu: ember_sharding::plan::profile::CpuProfile {
            cores_per_rank,
            // A shared-memory message is copied out and in.
            message_byte_s: vec![
                ("gcd".into(), 2.0 * copy_byte_s),
                ("gpu".into(), tcp("gpu")),
                ("node".into(), tcp("node")),
            ],
            copy_byte_s,
            quant_element_s,
            visit_param_s,
            optimizer_element_s,
        },
        calibration: format!(
            "{} at 1 and 4 x {} tokens on one thread; {} core(s) / {} ranks",
            c.preset,
            c.model.block_size,
            cores(),
            topology.world_size()
        ),
    })
}

/// Seconds per byte copied, per byte of int8 quantized and dequantized, and per AdamW element,
/// on the calling thread.
fn kernel_costs() -> (f64, f64, f64) {
    use burn::tensor::{Device, Tensor, TensorData};
    use ember_comm::quant::host::HostKernels;
    use ember_comm::quant::{BlockSize, QuantFormat, QuantKernels};
    const N: usize = 1 << 22;
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let src: Vec<f32> = (0..N).map(|i| (i % 977) as f32 * 1e-3).collect();
    let mut dst = vec![0.0f32; N];
    let copy = median(
        (0..5)
            .map(|_| {
                let t = Instant::now();
                dst.copy_from_slice(std::hint::black_box(&src));
                t.elapsed().as_secs_f64()
            })
            .collect(),
    ) / (4 * N) as f64;
    let block = BlockSize::new(ember_sharding::config::DEFAULT_QUANT_BLOCK).expect("valid");
    let quant = median(
        (0..5)
            .map(|_| {
                let t = Instant::now();
                let q = HostKernels.quantize(&src, QuantFormat::Int8, block);
                std::hint::black_box(HostKernels.dequantize(&q));
                t.elapsed().as_secs_f64()
            })
            .collect(),
    ) / N as f64;
    let device = Device::flex();
    let tensor = |v: Vec<f32>| Tensor::<1>::from_data(TensorData::new(v, [N]), &device);
    let mut state =
        ember_sharding::FlatState::new(tensor(src.clone()), 2, std::iter::once(0..N).collect());
    let adam = ember_sharding::AdamW {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        decay_on: ember_sharding::DecayOn::Matrices,
    };
    let optimizer = median(
        (1..=5)
            .map(|step| {
                let grad = tensor(src.clone());
                let t = Instant::now();
                ember_sharding::Optimizer::update(&adam, step, 1e-3, &mut state, grad);
                t.elapsed().as_secs_f64()
            })
            .collect(),
    ) / N as f64;
    (copy, quant, optimizer)
}

/// Seconds per FLOP and per parameter a visit computes, fitted to two single-process, one-thread
/// runs of the engine on the calibration model (1 and 4 sequences).
fn engine_costs(c: &Calibration, optimizer_element_s: f64) -> Result<(f64, f64)> {
    use ember_sharding::plan::schedule::Event;
    let exe = std::env::current_exe().context("locating this binary")?;
    let one = Topology::parse("1").expect("valid");
    let mut points = Vec::new();
    for batch in [1usize, 4] {
        let out = Command::new(&exe)
            .args(["bench", "shard", "--shards", "zero3", "--recompute", "none"])
            .args(["--preset", &c.preset, "--topology", "1", "--json"])
            .args([
                "--batch-size",
                &batch.to_string(),
                "--steps",
                "4",
                "--warmup",
                "2",
            ])
            .env("RAYON_NUM_THREADS", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .env_remove(CLUSTER_ENV)
            .output()
            .context("running the calibration step")?;
        let text = String::from_utf8_lossy(&out.stdout);
        let row: serde_json::Value = text
            .lines()
            .find_map(|l| serde_json::from_str(l).ok())
            .ok_or_else(|| {
                anyhow!(
                    "the calibration step printed no result: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                )
            })?;
        let step_s = row["step_ms_median"].as_f64().unwrap_or(f64::NAN) / 1e3;
        let mut shard = ember_sharding::Preset::Zero3.config(3);
        shard.recompute = ember_sharding::Recompute::None;
        let plan = crate::tools::planning::gpt_plan(
            &c.model,
            &one,
            shard,
            batch,
            1,
            c.model.block_size,
            crate::run::config::DeviceKind::Flex,
        )?;
        let (mut flops, mut params) = (0.0, 0.0);
        for e in plan.schedule(1) {
            if let Event::Visit(v) = e {
                let f = plan.flops[v.stage];
                flops += match (v.backward, plan.keeps_graph(v.stage)) {
                    (false, _) => f,
                    (true, true) => 2.0 * f,
                    (true, false) => 3.0 * f,
                };
                params += plan.units[v.stage]
                    .needs
                    .iter()
                    .map(|&u| plan.units[u].numel as f64)
                    .sum::<f64>();
            }
        }
        let optimizer = plan.numel() as f64 * optimizer_element_s;
        points.push((flops, params, step_s - optimizer));
    }
    // step = flops x a + params x b, at two batch sizes (the parameters are the same).
    let ((f1, p1, t1), (f4, _, t4)) = (points[0], points[1]);
    let a = (t4 - t1) / (f4 - f1);
    let b = ((t1 - f1 * a) / p1).max(0.0);
    if !(a.is_finite() && a > 0.0) {
        bail!("the calibration steps took {t1:.4} s and {t4:.4} s: no compute rate fits them");
    }
    Ok((a, b))
}
