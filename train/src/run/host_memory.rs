//! Host memory: every rank's peak resident memory as the OS reports it, and the allocator
//! settings a run starts with.

use anyhow::Result;
use ember_comm::Comm;

/// Peak resident memory of every rank (rank 0 first), gathered to all.
pub fn rss_peaks(comm: &Comm) -> Result<Vec<u64>> {
    gather_u64(comm, ember_sharding::plumbing::memory::resident().peak)
}

/// Every rank's `mine` (rank 0 first), gathered to all.
pub fn gather_u64(comm: &Comm, mine: u64) -> Result<Vec<u64>> {
    let all = comm.world().all_gather(&mine.to_le_bytes())?;
    Ok(all
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect())
}

/// Makes every thread allocate from glibc's main arena, so that the thresholds
/// [`set_allocator_for_training`] sets govern all of the process's blocks. Called first in
/// `main`, before any other thread allocates: a thread keeps the arena of its first
/// allocation.
///
/// A one-process step on the CPU runs on rayon's workers (`kernels::warm_threads`). From
/// their own arenas, the freed activations went back to the kernel between steps: `small-cpu`
/// faulted about 1,140 pages in again per step (`perf stat -e page-faults`, 5 against 25
/// steps), and none with one arena, which ran it 2.7% faster (8 pairs, Emerald Rapids).
/// Blocks are allocated per tensor, not per element, so threads seldom meet on the arena's
/// lock.
pub fn one_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: as in `set_thresholds`.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

/// Sets glibc's allocator for training on `world` ranks. Both thresholds are fixed, which
/// also stops glibc from raising the mmap threshold as large blocks are freed.
///
/// - Sharded ranks: buffers under 8 MiB come from the heap and, once freed, stay there (up
///   to 64 MiB at its top) for the next step to reuse; larger ones are their own mappings and
///   go back to the OS when freed.
/// - One process: the same with 32 MiB, and up to 1 GiB kept at the heap's top. Every step
///   allocates and frees the same activations and gradients; returned to the OS, their pages
///   fault again in every step. gpt2 (T 256, B 4) on one process frees more than 256 MiB at
///   the end of each step: with that threshold it faulted 73 thousand pages (286 MiB) per
///   step, with 1 GiB about 20.
///
/// Measured on the EPYC machine of BENCHMARKS.md with `ember bench shard` / `bench train`:
/// `small-cpu` `zero3` at 2 ranks takes 214 ms/step with the sharded setting, 435 with a
/// 1 MiB mmap threshold (every activation a fresh mapping) and 257 with glibc's sliding
/// default; one process takes 222-229 ms/step with its setting and 265-285 with the sharded
/// one. The sliding default lets units of many megabytes land in the heap, and its holes kept
/// each rank of gpt2-large at 8 ranks 0.3 GB (17%) above its plan (2.14 GB against 1.76 GB
/// with a fixed threshold); gpt2-medium `zero3` at 4 ranks peaks at 1.40-1.45 GB per rank with
/// the sharded setting and at 1.38-1.46 GB with the 1 MiB threshold.
///
/// - A device with memory of its own (CubeCL's GPUs): host memory holds the staging buffers of
///   the MPI calls, not activations, so they come from the heap at any size up to 1 GiB and up
///   to 1 GiB stays there: each crossing reuses the last one's pages. From a fresh mapping, a
///   crossing runs at the rate the kernel faults pages in: `ember bench staging` on wgpu
///   (lavapipe) read 16 and 64 MiB tensors back at about 2 GB/s with the sharded setting and
///   at 7 to 9 GB/s with these ([`set_allocator_for_device_staging`]).
pub fn set_allocator_for_training(world: usize, device_memory: bool) {
    if device_memory {
        set_allocator_for_device_staging();
        return;
    }
    let (mmap, trim) = if world > 1 {
        (8 << 20, 64 << 20)
    } else {
        (32 << 20, 1 << 30)
    };
    set_thresholds(mmap, trim);
}

/// The allocator of a run on a device with memory of its own (see
/// [`set_allocator_for_training`]).
pub fn set_allocator_for_device_staging() {
    set_thresholds(1 << 30, 1 << 30);
}

fn set_thresholds(mmap: i32, trim: i32) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only sets allocator parameters, under glibc's own lock, so other
    // threads may allocate meanwhile; blocks already allocated keep their placement.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, mmap);
        libc::mallopt(libc::M_TRIM_THRESHOLD, trim);
    }
}
