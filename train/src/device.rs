//! Turns `--device` into a Burn `Device`, refusing backends this binary was built without,
//! and estimates the device's peak FLOP/s for MFU.

use burn::tensor::Device;

use crate::config::DeviceKind;
use crate::error::{CliResult, usage};

/// The (non-autodiff) device for `kind`, or a usage error saying how to build it in.
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
        DeviceKind::Wgpu => Ok(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)),
        #[cfg(not(feature = "wgpu"))]
        DeviceKind::Wgpu => Err(missing("wgpu")),
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda => Ok(Device::cuda(0)),
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Cuda => Err(missing("cuda")),
    }
}

/// Peak f32 FLOP/s of this machine's CPUs: cores x clock x FLOPs per cycle per core.
/// FLOPs per cycle: two FMA pipes x lanes x 2, i.e. 64 with AVX-512 (Zen 4/5, recent Xeons),
/// 32 with AVX2 + FMA, 8 otherwise. The clock is the highest `cpu MHz` reported; an estimate,
/// overridable with `--peak-tflops`.
pub fn cpu_peak_flops() -> f64 {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
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
    cores * mhz * 1e6 * per_cycle
}

/// Peak FLOP/s used for MFU: `--peak-tflops` if given, else the CPU estimate for CPU backends;
/// `None` for GPUs without `--peak-tflops` (their peak depends on dtype and card).
pub fn peak_flops(kind: DeviceKind, peak_tflops: Option<f64>) -> Option<f64> {
    match (peak_tflops, kind) {
        (Some(t), _) => Some(t * 1e12),
        (None, DeviceKind::Flex | DeviceKind::Ndarray) => Some(cpu_peak_flops()),
        (None, DeviceKind::Wgpu | DeviceKind::Cuda) => None,
    }
}
