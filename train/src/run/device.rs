//! Turns `--device` into a Burn `Device`, refusing backends this binary was built without,
//! and estimates the device's peak FLOP/s for MFU.

use burn::tensor::Device;

use ember_model::kernels::{self, Bf16Products};
use ember_sharding::Compute;

use crate::error::{CliResult, usage};
use crate::run::config::DeviceKind;

/// The (non-autodiff) device for `kind`, or a usage error saying how to build it in, or that
/// this machine has no such GPU. A CubeCL device starts with the chosen kernel cache
/// ([`crate::run::kernel_cache`]).
pub fn device(kind: DeviceKind) -> CliResult<Device> {
    let missing = |feature: &str| {
        usage(format!(
            "--device {feature} needs a binary built with it: \
             cargo run --release --features {feature} -- ..."
        ))
    };
    match kind {
        DeviceKind::Flex => Ok(Device::flex()),
        #[cfg(feature = "ndarray")]
        #[allow(deprecated)] // measured for BENCHMARKS.md; flex is the default
        DeviceKind::Ndarray => Ok(Device::ndarray()),
        #[cfg(not(feature = "ndarray"))]
        DeviceKind::Ndarray => Err(missing("ndarray")),
        #[cfg(feature = "wgpu")]
        DeviceKind::Wgpu => {
            crate::run::kernel_cache::configure(kind)?;
            Ok(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice))
        }
        #[cfg(not(feature = "wgpu"))]
        DeviceKind::Wgpu => Err(missing("wgpu")),
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda(index) => {
            let index = index.unwrap_or_else(local_rank);
            // Asked first: Burn's CUDA device panics inside the driver loader without one.
            ember_comm::quant::cube::cuda_device(index)
                .map_err(|e| usage(format!("--device {kind}: {e}")))?;
            crate::run::kernel_cache::configure(kind)?;
            Ok(Device::cuda(index))
        }
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Cuda(_) => Err(missing("cuda")),
        #[cfg(feature = "rocm")]
        DeviceKind::Rocm(index) => {
            crate::run::kernel_cache::configure(kind)?;
            Ok(Device::rocm(index.unwrap_or_else(local_rank)))
        }
        #[cfg(not(feature = "rocm"))]
        DeviceKind::Rocm(_) => Err(missing("rocm")),
    }
}

/// This process's index among the ranks of its node, as the launcher numbers them (Open MPI,
/// MPICH/Hydra, Slurm, torchrun-style `LOCAL_RANK`); 0 outside a launcher.
pub fn local_rank() -> usize {
    [
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MPI_LOCALRANKID",
        "SLURM_LOCALID",
        "LOCAL_RANK",
    ]
    .iter()
    .find_map(|v| std::env::var(v).ok()?.parse().ok())
    .unwrap_or(0)
}

/// Peak f32 FLOP/s of this machine's CPUs: the larger of the nominal figure (cores x the
/// highest `cpu MHz` x FLOPs per cycle: two FMA pipes x lanes x 2, i.e. 64 with AVX-512, 32
/// with AVX2 + FMA, 8 otherwise) and cores x one core's measured FMA rate. The measurement
/// catches boost clocks above the reported one (MFU over 100% otherwise); the nominal floor
/// keeps a busy machine (ranks starting together on shared cores) from lowering the peak and
/// inflating MFU. Measured once per process, in about 20 ms; `--peak-tflops` overrides both.
pub fn cpu_peak_flops() -> f64 {
    static PEAK: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *PEAK.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        nominal_core_flops().max(measured_core_flops().unwrap_or(0.0)) * cores
    })
}

/// One core's nominal peak from `/proc/cpuinfo`.
fn nominal_core_flops() -> f64 {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let mhz = info
        .lines()
        .filter(|l| l.starts_with("cpu MHz"))
        .filter_map(|l| l.split(':').nth(1)?.trim().parse::<f64>().ok())
        .fold(0.0, f64::max);
    let flags = info
        .lines()
        .find(|l| l.starts_with("flags"))
        .unwrap_or_default();
    let has = |f: &str| flags.split_whitespace().any(|x| x == f);
    let per_cycle = if has("avx512f") {
        64.0
    } else if has("avx2") && has("fma") {
        32.0
    } else {
        8.0
    };
    let mhz = if mhz > 0.0 { mhz } else { 2000.0 };
    mhz * 1e6 * per_cycle
}

/// One core's f32 FMA rate, the best of three timed runs of 12 independent FMA chains in the
/// widest vectors the CPU has; `None` without AVX2 + FMA.
fn measured_core_flops() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        let (lanes, run): (f64, fn(u64) -> f32) = match ember_cpu::vector() {
            // SAFETY: the CPU has AVX-512F.
            ember_cpu::Vector::Avx512 => (16.0, |n| unsafe { fma_chains_avx512(n) }),
            // SAFETY: the CPU has AVX2 and FMA.
            ember_cpu::Vector::Avx2 => (8.0, |n| unsafe { fma_chains_avx2(n) }),
            ember_cpu::Vector::Baseline => return None,
        };
        const ITERS: u64 = 1 << 20;
        let best = (0..3)
            .map(|_| {
                let start = std::time::Instant::now();
                std::hint::black_box(run(std::hint::black_box(ITERS)));
                start.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min);
        Some(ITERS as f64 * CHAINS as f64 * lanes * 2.0 / best)
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// Independent FMA chains per iteration: enough to cover the FMA latency on every pipe.
#[cfg(target_arch = "x86_64")]
const CHAINS: usize = 12;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn fma_chains_avx512(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    let (b, c) = (_mm512_set1_ps(1.000_000_1), _mm512_set1_ps(1e-7));
    let mut acc = [_mm512_set1_ps(1.0); CHAINS];
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = _mm512_fmadd_ps(*a, b, c);
        }
    }
    acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fma_chains_avx2(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    let (b, c) = (_mm256_set1_ps(1.000_000_1), _mm256_set1_ps(1e-7));
    let mut acc = [_mm256_set1_ps(1.0); CHAINS];
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = _mm256_fmadd_ps(*a, b, c);
        }
    }
    let mut lanes = [0.0f32; 8];
    for a in acc {
        let mut v = [0.0f32; 8];
        // SAFETY: `v` holds 8 f32.
        unsafe { _mm256_storeu_ps(v.as_mut_ptr(), a) };
        for (l, x) in lanes.iter_mut().zip(v) {
            *l += x;
        }
    }
    lanes.iter().sum()
}

/// Peak FLOP/s used for MFU: `--peak-tflops` if given, else the CPU estimate for CPU backends
/// (f32's, times [`cpu_bf16_speedup`] where the products run in bf16: `arithmetic`, the
/// plan's module dtype); `None` for GPUs without `--peak-tflops` (their peak depends on
/// dtype and card).
pub fn peak_flops(kind: DeviceKind, peak_tflops: Option<f64>, arithmetic: Compute) -> Option<f64> {
    match (peak_tflops, kind) {
        (Some(t), _) => Some(t * 1e12),
        (None, DeviceKind::Flex | DeviceKind::Ndarray) => {
            let bf16 = arithmetic == Compute::Bf16 && kind == DeviceKind::Flex;
            Some(cpu_peak_flops() * if bf16 { cpu_bf16_speedup() } else { 1.0 })
        }
        (None, DeviceKind::Wgpu | DeviceKind::Cuda(_) | DeviceKind::Rocm(_)) => None,
    }
}

/// How many times f32's peak this CPU's bf16 products reach: 16 on AMX tiles (1,024 bf16
/// FLOPs per cycle and core, against AVX-512 FMA's 64 in f32), the measured speedup of
/// `vdpbf16ps` where the products run on it (2, its width, where not measured), and 1 where
/// bf16 computes in f32 ([`kernels::bf16_products`]).
pub fn cpu_bf16_speedup() -> f64 {
    match kernels::bf16_products() {
        Bf16Products::Amx => 16.0,
        Bf16Products::Dot(speedup) => speedup.unwrap_or(2.0),
        Bf16Products::F32(_) => 1.0,
    }
}
