//! `ember selftest`: this binary checked on one device before it trains there. The
//! quantization kernels of the quantized collectives run against their scalar reference, bit
//! for bit, twice: on the device runtime's own client, as `ember-comm` launches them, and on
//! the device's Burn tensors, the path a training step takes (through Burn's fusion on a GPU).
//! The wgpu tests make the same checks (`comm/tests/quant_runtimes.rs`).

use std::time::Instant;

use clap::Args;
use serde::Serialize;

use ember_comm::quant::selfcheck::{SelfCheck, check};
use ember_sharding::plumbing::kernels::DeviceKernels;
use ember_train::error::CliResult;
use ember_train::run::config::DeviceKind;
use ember_train::run::device::device;

#[derive(Debug, Args)]
pub struct SelftestArgs {
    /// The device to check: flex, wgpu, cuda[:I] or rocm[:I] (those this binary was built with)
    #[arg(long, default_value = "flex")]
    pub device: DeviceKind,
    /// One JSON object instead of lines
    #[arg(long)]
    pub json: bool,
    /// Instead of checking a device, compile every CubeCL kernel of ember's own to PTX for a
    /// CUDA device of this compute capability (90 for Hopper, 80 for Ampere; an H100's limits),
    /// with no GPU: what the CUDA runtime would compile at the kernels' first launch (builds
    /// with CUDA)
    #[arg(long, value_name = "SM", conflicts_with = "device",
          value_parser = clap::value_parser!(u32).range(80..=120))]
    pub ptx: Option<u32>,
    /// With --ptx: also write each kernel's PTX into this folder (for `ptxas`)
    #[arg(long, value_name = "DIR", requires = "ptx")]
    pub ptx_dir: Option<std::path::PathBuf>,
    /// With --ptx: which of CubeCL's CUDA compilers: `llvm` (LLVM's NVPTX backend, to PTX) or
    /// `cpp` (CUDA C++ source, which NVRTC compiles at run time: written as `.cu` files);
    /// default: the one this binary's CUDA runtime uses
    #[arg(long, value_name = "llvm|cpp", requires = "ptx", value_parser = ["llvm", "cpp"])]
    pub ptx_compiler: Option<String>,
}

/// What `ember selftest` found.
#[derive(Debug, Serialize)]
struct Report {
    /// `--device`.
    device: String,
    /// The device as its runtime names it, or `host`.
    device_name: String,
    /// Every runtime checked.
    checks: Vec<SelfCheck>,
    /// Whether every comparison matched.
    passed: bool,
    /// Seconds the checks took, kernel compilation included.
    seconds: f64,
}

pub fn run(args: SelftestArgs) -> CliResult<()> {
    if let Some(sm) = args.ptx {
        return ptx(
            sm,
            args.ptx_dir.as_deref(),
            args.ptx_compiler.as_deref(),
            args.json,
        );
    }
    let start = Instant::now();
    let burn_device = device(args.device)?;
    let mut checks = Vec::new();
    // The runtime's own client. On a host backend the host kernels are what runs.
    match args.device {
        DeviceKind::Flex | DeviceKind::Ndarray => {
            checks.push(check(&ember_comm::quant::host::HostKernels));
        }
        #[cfg(feature = "wgpu")]
        DeviceKind::Wgpu => {
            let kernels = ember_comm::quant::cube::CubeKernels::wgpu()
                .map_err(|e| ember_train::error::usage(format!("--device wgpu: {e}")))?;
            checks.push(check(&kernels));
        }
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda(index) => {
            let index = index.unwrap_or_else(ember_train::run::device::local_rank);
            let kernels = ember_comm::quant::cube::CubeKernels::cuda(index)
                .map_err(|e| ember_train::error::usage(format!("--device {}: {e}", args.device)))?;
            checks.push(check(&kernels));
        }
        // ROCm: the training path below only.
        _ => {}
    }
    let kernels = DeviceKernels::new(burn_device);
    checks.push(check(&kernels));
    let report = Report {
        device: args.device.to_string(),
        device_name: kernels.device_name(),
        passed: checks.iter().all(SelfCheck::passed),
        checks,
        seconds: start.elapsed().as_secs_f64(),
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&report).map_err(anyhow::Error::new)?
        );
    } else {
        println!("device {}: {}", report.device, report.device_name);
        for c in &report.checks {
            println!(
                "{}: {} of {} comparisons bit-identical to the reference",
                c.runtime,
                c.checks - c.failures.len(),
                c.checks
            );
            for f in &c.failures {
                println!("  differs: {f}");
            }
        }
    }
    if !report.passed {
        return Err(anyhow::anyhow!(
            "selftest on {}: some kernels differ from the reference (listed above)",
            report.device
        )
        .into());
    }
    Ok(())
}

/// `--ptx SM`: every kernel compiled for compute capability `sm`, one line each.
#[cfg(feature = "cuda")]
fn ptx(
    sm: u32,
    dir: Option<&std::path::Path>,
    compiler: Option<&str>,
    json: bool,
) -> CliResult<()> {
    use cubecl::cuda::compiler::CudaBackend;
    let start = Instant::now();
    let backend = match compiler {
        Some("cpp") => CudaBackend::Cpp,
        Some(_) => CudaBackend::Llvm,
        None => CudaBackend::default(),
    };
    let what = match backend {
        CudaBackend::Llvm => "PTX (LLVM's NVPTX backend)",
        CudaBackend::Cpp => "CUDA C++ (for NVRTC)",
    };
    let kernels = ember_train::tools::ptx::compile_all(sm, dir, backend).map_err(|e| {
        ember_train::error::usage(format!(
            "--ptx-dir {}: {e}",
            dir.map_or(String::new(), |d| d.display().to_string())
        ))
    })?;
    let failed = kernels.iter().filter(|k| k.error.is_some()).count();
    if json {
        let report = serde_json::json!({
            "sm": sm,
            "compiler": format!("{backend:?}").to_lowercase(),
            "kernels": kernels,
            "passed": failed == 0,
            "seconds": start.elapsed().as_secs_f64(),
        });
        println!("{report}");
    } else {
        println!(
            "{} kernels of ember's own compiled to {what} for sm_{sm} (modelled device, no GPU \
             used):",
            kernels.len()
        );
        let unit = match backend {
            CudaBackend::Llvm => "PTX",
            CudaBackend::Cpp => "C++",
        };
        for k in &kernels {
            match &k.error {
                None => println!(
                    "  {}: {:.1} KiB of {unit}, {} bytes of shared memory, {:.2} s",
                    k.name,
                    k.ptx_bytes as f64 / 1024.0,
                    k.shared_bytes,
                    k.seconds
                ),
                Some(e) => println!("  {}: FAILED: {e}", k.name),
            }
        }
    }
    if failed > 0 {
        return Err(anyhow::anyhow!(
            "selftest --ptx {sm}: {failed} of {} kernels did not compile (listed above)",
            kernels.len()
        )
        .into());
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn ptx(_: u32, _: Option<&std::path::Path>, _: Option<&str>, _: bool) -> CliResult<()> {
    Err(ember_train::error::usage(
        "--ptx: this ember was built without CUDA; build it with `--features cuda` \
         (scripts/gpu-bundle does)",
    ))
}
