//! Host memory: every rank's peak resident memory as the OS reports it, and the allocator
//! settings a run starts with (one process keeps freed buffers for reuse; sharded ranks hand
//! large ones back at once).

use anyhow::Result;
use ember_comm::Comm;

/// Peak resident memory of every rank (rank 0 first), gathered to all.
pub fn rss_peaks(comm: &Comm) -> Result<Vec<u64>> {
    gather_u64(comm, ember_sharding::memory::resident().peak)
}

/// Every rank's `mine` (rank 0 first), gathered to all.
pub fn gather_u64(comm: &Comm, mine: u64) -> Result<Vec<u64>> {
    let all = comm.world().all_gather(&mine.to_le_bytes())?;
    Ok(all
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect())
}

/// Makes freed buffers of 1 MiB and more go back to the OS at once (glibc: a fixed
/// `M_MMAP_THRESHOLD`, which also stops glibc from raising the threshold as large blocks are
/// freed). A sharded step allocates and frees whole units of many megabytes; with glibc's
/// sliding threshold they land in the heap, and its holes kept each rank of gpt2-large at
/// 8 ranks 0.3 GB (17%) above its plan (measured: 2.14 GB against 1.76 GB with the fixed
/// threshold, plan 1.84 GB).
pub fn return_large_frees_to_the_os() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only sets an allocator parameter; no allocation is in flight.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}

/// Makes freed buffers up to 32 MiB stay in the heap for the next step to reuse (glibc: fixed
/// `M_MMAP_THRESHOLD` and a high `M_TRIM_THRESHOLD`), for one process, where memory is not
/// what limits the run: every step allocates and frees the same activations, and as fresh
/// mappings their page faults cost `small-cpu` a fifth of its step (measured: 490k faults in
/// 12 steps, against 70k with the buffers kept).
pub fn keep_freed_buffers_for_reuse() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only sets allocator parameters; no allocation is in flight.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}
