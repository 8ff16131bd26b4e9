//! Whether the MPI library takes GPU memory as message buffers, as it answers at run time, and
//! which way a run's collectives therefore cross between a GPU and MPI.
//!
//! Open MPI answers through `MPIX_Query_cuda_support()` (and, from 5.0,
//! `MPIX_Query_rocm_support()`); MPICH through the same CUDA function and
//! `MPIX_Query_hip_support()`. Each is looked up by name in the running process, so a library
//! without it (or built without the extension) answers [`Support::Unknown`] instead of failing
//! to link.

use std::ffi::CStr;
use std::fmt;

/// A GPU memory kind a collective's buffers could live in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuMemory {
    /// NVIDIA CUDA device memory.
    Cuda,
    /// AMD ROCm (HIP) device memory.
    Rocm,
    /// Vulkan, Metal or DX12 buffers (wgpu): no MPI library takes these.
    Wgpu,
}

/// What the MPI library said of one memory kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Support {
    /// Its query returned non-zero: it takes such buffers.
    Yes,
    /// Its query returned zero.
    No,
    /// It has no query for this kind (not built with the extension, or another library).
    Unknown,
}

/// The MPI library's answers, with the name of the query that gave each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceMemorySupport {
    /// CUDA device memory.
    pub cuda: (Support, Option<&'static str>),
    /// ROCm device memory.
    pub rocm: (Support, Option<&'static str>),
}

/// How a run's collectives move data that lives on a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Crossing {
    /// The data lives in host memory already: nothing to stage.
    Host,
    /// Copied to host memory before each MPI call and back after it.
    Staged {
        /// Why, in words for the run's log.
        why: String,
    },
}

impl fmt::Display for Crossing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Crossing::Host => write!(f, "tensors live in host memory: MPI reads them in place"),
            Crossing::Staged { why } => write!(f, "staged through host memory: {why}"),
        }
    }
}

/// Calls the `int f(void)` named `name` if this process has it.
fn query(name: &'static CStr) -> Option<i32> {
    // SAFETY: dlsym with RTLD_DEFAULT searches the objects already loaded; a non-null result
    // is the address of a function the MPI library exports under that name, which every
    // library that has it declares `int f(void)` (Open MPI's mpi-ext.h, MPICH's mpi.h).
    unsafe {
        let f = libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr());
        if f.is_null() {
            return None;
        }
        let f: extern "C" fn() -> libc::c_int = std::mem::transmute(f);
        Some(f())
    }
}

fn answer(names: &[&'static CStr]) -> (Support, Option<&'static str>) {
    for name in names {
        if let Some(v) = query(name) {
            let s = if v != 0 { Support::Yes } else { Support::No };
            return (s, name.to_str().ok());
        }
    }
    (Support::Unknown, None)
}

impl DeviceMemorySupport {
    /// Asks the running MPI library (after `MPI_Init`, which [`crate::Comm::init`] called).
    pub(crate) fn query() -> Self {
        Self {
            cuda: answer(&[c"MPIX_Query_cuda_support"]),
            rocm: answer(&[c"MPIX_Query_rocm_support", c"MPIX_Query_hip_support"]),
        }
    }

    /// How collectives of data on `memory` (`None`: host memory) cross to MPI. ember stages
    /// GPU data through host memory in every case: handing device buffers to an MPI that
    /// takes them is not built yet, and the reason says so where the library would.
    pub fn crossing(&self, memory: Option<GpuMemory>) -> Crossing {
        let (kind, (support, query)) = match memory {
            None => return Crossing::Host,
            Some(GpuMemory::Wgpu) => {
                return Crossing::Staged {
                    why: "no MPI library takes wgpu (Vulkan) buffers".into(),
                };
            }
            Some(GpuMemory::Cuda) => ("CUDA", self.cuda),
            Some(GpuMemory::Rocm) => ("ROCm", self.rocm),
        };
        let why = match (support, query) {
            (Support::Yes, Some(q)) => format!(
                "the MPI library takes {kind} device memory ({q}() = 1), but ember does not \
                 hand device buffers to MPI yet"
            ),
            (Support::No, Some(q)) => {
                format!("the MPI library does not take {kind} device memory ({q}() = 0)")
            }
            _ => format!("the MPI library has no query for {kind} device memory"),
        };
        Crossing::Staged { why }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_crossing_follows_the_memory_and_what_the_library_said() {
        let s = DeviceMemorySupport {
            cuda: (Support::Yes, Some("MPIX_Query_cuda_support")),
            rocm: (Support::Unknown, None),
        };
        assert_eq!(s.crossing(None), Crossing::Host);
        let staged = |c: Crossing| match c {
            Crossing::Staged { why } => why,
            Crossing::Host => panic!("GPU memory is never read in place"),
        };
        let cuda = staged(s.crossing(Some(GpuMemory::Cuda)));
        assert!(cuda.contains("takes CUDA") && cuda.contains("= 1") && cuda.contains("not"));
        assert!(staged(s.crossing(Some(GpuMemory::Rocm))).contains("no query for ROCm"));
        assert!(staged(s.crossing(Some(GpuMemory::Wgpu))).contains("wgpu"));
        let no = DeviceMemorySupport {
            cuda: (Support::No, Some("MPIX_Query_cuda_support")),
            ..s
        };
        assert!(staged(no.crossing(Some(GpuMemory::Cuda))).contains("does not take CUDA"));
    }

    #[test]
    fn a_function_the_process_lacks_is_unknown() {
        assert_eq!(
            answer(&[c"ember_no_such_mpi_query"]),
            (Support::Unknown, None)
        );
    }
}
