//! Every CubeCL kernel of ember's own compiled to PTX for a CUDA device that is not here
//! (`ember selftest --ptx`): the kernels of the model (attention, cross-entropy, bias and
//! GELU, LayerNorm), of the optimizer and of the quantized collectives, defined as a gpt2
//! step launches them, for the properties the CUDA runtime reports on a device of the chosen
//! compute capability, and compiled by the runtime's own compiler (LLVM's NVPTX backend)
//! with the options it uses there. A kernel that a GPU would refuse at its first launch is
//! found on a machine without one.
//!
//! The properties are modelled, not read from a device: those the runtime queries (warp
//! size, shared memory, limits) are the H100's, and the features it derives from the compute
//! capability are derived here the same way. Kernels of Burn and cubek (products,
//! reductions, element-wise fusion) are not listed: they are generated per shape at run time.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use cubecl::cuda::compiler::CudaBackend;
use cubecl::cuda::{CUDA_MAX_BINDINGS, CudaCompilationOptions, CudaCompiler};
use cubecl::cuda::{CudaRepresentation, CudaRuntime};
use cubecl::ir::features::{AtomicUsage, Plane, Tma, TypeUsage};
use cubecl::ir::nvidia::SmArch;
use cubecl::ir::{
    DeviceIdentity, DeviceProperties, ElemType, FloatKind, HardwareProperties,
    MemoryDeviceProperties, OpaqueType, Type, VectorSize,
};
use cubecl::{CubeKernel, define_kernel};
use cubecl_cpp::cuda::arch::CudaArchitecture;
use cubecl_cpp::cuda::mma::CudaCmmaCompiler;
use cubecl_cpp::shared::{
    CompilationOptions, CppSupportedFeatures, register_mma_features, register_wmma_features,
};
use cubecl_llvm::nvptx::ptx_version::PtxVersion;
use cubecl_llvm::shared::lowered_features::{GpuTarget, restrict_features};
use cubecl_runtime::runtime::Runtime;
use ember_comm::ahead::Target;
use serde::Serialize;

/// The CUDA driver the PTX is emitted for (13.0, the lent H100s' driver 580): its newest PTX
/// version is what the runtime emits there.
const DRIVER: i32 = 13000;

/// One kernel compiled.
#[derive(Debug, Serialize)]
pub struct PtxKernel {
    /// The kernel and the launch it stands for.
    pub name: String,
    /// Bytes of PTX, 0 when it did not compile.
    pub ptx_bytes: usize,
    /// Shared memory a launch takes, bytes.
    pub shared_bytes: usize,
    /// Seconds to define and compile it.
    pub seconds: f64,
    /// Why it did not compile (or took more shared memory than the device has).
    pub error: Option<String>,
    /// The file its PTX was written to.
    pub file: Option<String>,
}

/// The properties CubeCL's CUDA runtime reports on an H100-class device of compute
/// capability `sm` (80 or more) with `backend` as its compiler (the LLVM backend narrows them
/// to what it lowers), and the compile options it uses there.
pub fn device(sm: u32, backend: CudaBackend) -> (Target, CudaCompilationOptions) {
    let arch = CudaArchitecture {
        version: sm,
        tensor_cores: true,
    };
    let max_memory: u64 = 80 << 30;
    let memory = MemoryDeviceProperties::new(max_memory / 4, 512).with_max_memory(max_memory);
    let hardware = HardwareProperties {
        load_width: 128,
        vector_register_count: None,
        plane_size_min: 32,
        plane_size_max: 32,
        max_bindings: CUDA_MAX_BINDINGS,
        // The H100's opt-in shared memory per block, and its limits.
        max_shared_memory_size: 232_448,
        max_cube_count: (i32::MAX as u32, 65_535, 65_535),
        max_units_per_cube: 1024,
        max_cube_dim: (1024, 1024, 64),
        num_streaming_multiprocessors: Some(132),
        num_tensor_cores: Some(4),
        min_tensor_cores_dim: Some(8),
        num_cpu_cores: None,
        last_level_cache_size: None,
        max_vector_size: VectorSize::MAX,
        cube_mma_reserved_shared_memory: 0,
    };
    let mut props = DeviceProperties::new(
        Default::default(),
        memory,
        hardware,
        cubecl::profile::TimingMethod::Device,
        DeviceIdentity {
            name: format!("modelled sm_{sm}"),
            fingerprint: format!("ptx_sm{sm}"),
            physical: None,
        },
    );
    cubecl_cpp::register_supported_types(&mut props);
    let mut features = CppSupportedFeatures {
        fast_math: true,
        dp4a: true,
        grid_constants: true,
        fast_tanh: true,
        ..Default::default()
    };
    props.register_atomic_type_usage(
        Type::atomic(ElemType::Float(FloatKind::F64)),
        AtomicUsage::Add | AtomicUsage::LoadStore | AtomicUsage::Exchange,
    );
    props.register_atomic_type_usage(
        Type::atomic(ElemType::Float(FloatKind::F16)),
        AtomicUsage::Add,
    );
    props.register_opaque_type(OpaqueType::Barrier);
    props.features.plane.insert(Plane::Sync);
    for kind in [FloatKind::F16, FloatKind::BF16] {
        props.features.matmul.ldmatrix.insert(ElemType::Float(kind));
    }
    props.register_type_usage(ElemType::Float(FloatKind::TF32), TypeUsage::Conversion);
    props.features.copy_async = true;
    if sm >= 90 {
        props.features.tma.insert(Tma::Base);
        props.register_opaque_type(OpaqueType::TensorMap);
        props.features.cube_cluster = true;
        features.clusters = true;
        features.elect_sync = true;
        for kind in [FloatKind::F16, FloatKind::BF16] {
            props.features.matmul.stmatrix.insert(ElemType::Float(kind));
        }
        for vec in [2, 4, 8] {
            for kind in [FloatKind::BF16, FloatKind::F16] {
                props.register_atomic_type_usage(
                    Type::atomic(Type::new(kind).with_vector_size(vec)),
                    AtomicUsage::Add | AtomicUsage::LoadStore | AtomicUsage::Exchange,
                );
            }
        }
    }
    props.features.memory_reinterpret = true;
    props.features.alignment = true;
    props.features.device_memory_scope = true;
    props.features.plane.insert(Plane::Ops);
    props.features.plane.insert(Plane::NonUniformControlFlow);
    register_wmma_features(
        CudaCmmaCompiler::Cpp.supported_cmma_combinations(&arch),
        &mut props,
    );
    register_mma_features(
        cubecl_cpp::cuda::supported_mma_combinations(&arch),
        &mut props,
    );
    if backend == CudaBackend::Llvm {
        restrict_features(&mut props, GpuTarget::Nvptx);
    }
    let options = CudaCompilationOptions {
        cpp: CompilationOptions {
            warp_size: 32,
            supports_features: features,
            ..Default::default()
        },
        arch: Some(SmArch::new(sm, true)),
        ptx_version: PtxVersion::for_driver(DRIVER),
    };
    let target = Target {
        device: Arc::new(props),
        target: Arc::new(CudaRuntime::target_properties()),
    };
    (target, options)
}

/// Every kernel of ember's own, defined for `target`.
pub fn kernels(target: &Target) -> Vec<(String, Box<dyn CubeKernel>)> {
    let mut all = ember_model::kernels::ahead(target.device.clone(), target.target.clone());
    all.extend(ember_sharding::plumbing::kernels::ahead(target));
    all
}

/// Compiles every kernel for compute capability `sm` with `backend`, writing each one's PTX
/// (LLVM) or CUDA C++ source (C++, for NVRTC) into `dir` when given.
pub fn compile_all(
    sm: u32,
    dir: Option<&Path>,
    backend: CudaBackend,
) -> std::io::Result<Vec<PtxKernel>> {
    let (target, options) = device(sm, backend);
    let limit = target.device.hardware.max_shared_memory_size;
    if let Some(dir) = dir {
        std::fs::create_dir_all(dir)?;
    }
    let mut compiler = CudaCompiler::new(backend);
    let extension = match backend {
        CudaBackend::Llvm => "ptx",
        CudaBackend::Cpp => "cu",
    };
    let mut out = Vec::new();
    for (name, kernel) in kernels(&target) {
        let start = Instant::now();
        let compiled = compile(&mut compiler, &*kernel, &options);
        let mut k = PtxKernel {
            name,
            ptx_bytes: 0,
            shared_bytes: 0,
            seconds: 0.0,
            error: None,
            file: None,
        };
        match compiled {
            Ok((ptx, shared)) => {
                k.ptx_bytes = ptx.len();
                k.shared_bytes = shared;
                if shared > limit {
                    k.error = Some(format!(
                        "takes {shared} bytes of shared memory, the device has {limit}"
                    ));
                }
                if let Some(dir) = dir {
                    let file = dir.join(format!("{}.{extension}", file_name(&k.name)));
                    std::fs::write(&file, &ptx)?;
                    k.file = Some(file.display().to_string());
                }
            }
            Err(e) => k.error = Some(e),
        }
        k.seconds = start.elapsed().as_secs_f64();
        out.push(k);
    }
    Ok(out)
}

/// The kernel's PTX text and shared memory bytes, or why it did not compile (a panic in the
/// compiler included).
fn compile(
    compiler: &mut CudaCompiler,
    kernel: &dyn CubeKernel,
    options: &CudaCompilationOptions,
) -> Result<(Vec<u8>, usize), String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let definition = define_kernel(kernel).map_err(|e| format!("definition: {e:?}"))?;
        match cubecl::Compiler::compile(compiler, definition, options) {
            Ok(CudaRepresentation::Llvm(module)) => {
                let ptx: Vec<u8> = module
                    .ptx
                    .iter()
                    .map(|&c| c as u8)
                    .take_while(|&c| c != 0)
                    .collect();
                Ok((ptx, module.shared_memory_size))
            }
            Ok(CudaRepresentation::Cpp(kernel)) => {
                Ok((kernel.source.into_bytes(), kernel.shared_memory_size))
            }
            Err(e) => Err(format!("{e}")),
        }
    }))
    .unwrap_or_else(|panic| {
        let message = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic without a message".to_string());
        Err(format!("the compiler panicked: {message}"))
    })
}

/// A file name for a kernel's name: letters, digits and `_`.
fn file_name(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}
