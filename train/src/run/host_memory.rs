//! Host memory: every rank's peak resident memory as the OS reports it, and the allocator
//! settings a run starts with.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

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
/// steps) and `gpt2` (T 256, B 4) about 60,000; with one arena about 5 and 60. `small-cpu`
/// ran 2.7% faster with it (8 pairs, Emerald Rapids).
/// Blocks are allocated per tensor, not per element, and the kernels keep their per-piece
/// buffers per thread: threads that met on the arena's lock for those sleep on it and queue
/// (BENCHMARKS.md, "Zen 5 at 10e49bf"). Also notes where the heap starts, for
/// [`HostAllocator`].
pub fn one_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: as in `set_thresholds`; `sbrk(0)` only reads the current break.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        HEAP_START.store(libc::sbrk(0) as usize, Ordering::Relaxed);
    }
}

/// The `ember` binary's allocator: glibc's `malloc`, whose heap, once a one-process run on
/// the CPU asks for it ([`set_allocator_for_training`]), is advised for transparent huge
/// pages as it grows (`madvise(MADV_HUGEPAGE)` on each stretch `brk` adds, right after the
/// allocation of 64 KiB or more that grew it or followed smaller ones that did, before the
/// caller writes there; `malloc` has written only its headers), much as glibc's
/// `glibc.malloc.hugetlb=1` tunable does. A step's operands then span 2 MiB pages instead of
/// thousands of 4 KiB ones, and the products' strided walks over them miss the TLB less.
/// Against the same build without it (Emerald Rapids, the kernel's THP mode `madvise`, pairs
/// of runs in turn): `small-cpu` 1.066x in f32 and 1.082x in bf16, `gpt2` (T 256, B 4) 1.033x
/// and 1.051x; 110 of `small-cpu`'s 144.5 MiB resident in huge pages, its peak 1.6% higher.
#[derive(Debug)]
pub struct HostAllocator;

/// The break when `main` started (about where the heap begins), or 0.
static HEAP_START: AtomicUsize = AtomicUsize::new(0);
/// Whether the heap's growth is advised for huge pages.
static ADVISE_HEAP: AtomicBool = AtomicBool::new(false);
/// The end of the heap as far as it has been advised (or was when advising began).
static ADVISED_TO: AtomicUsize = AtomicUsize::new(0);
/// What the heap grows by beyond a block that does not fit (glibc's default is 128 KiB): few,
/// long stretches, of which `malloc` has written only the first page when they are advised.
const TOP_PAD: i32 = 64 << 20;
/// Blocks from this size up may grow the heap; smaller ones seldom do and are not checked.
const GROWS_HEAP: usize = 64 << 10;

// SAFETY: every call goes to `System` with the caller's arguments; `advise_heap` neither
// allocates nor touches the blocks.
unsafe impl GlobalAlloc for HostAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as the caller guarantees.
        let p = unsafe { System.alloc(layout) };
        if layout.size() >= GROWS_HEAP {
            advise_heap();
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as the caller guarantees.
        let p = unsafe { System.alloc_zeroed(layout) };
        if layout.size() >= GROWS_HEAP {
            advise_heap();
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as the caller guarantees.
        unsafe { System.dealloc(ptr, layout) };
        // Any free may let glibc trim the heap (the freed block merging into its top).
        note_heap_end();
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as the caller guarantees.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if new_size >= GROWS_HEAP {
            advise_heap();
        } else {
            note_heap_end();
        }
        p
    }
}

/// Advises the heap's stretch past [`ADVISED_TO`] for huge pages, where asked to.
fn advise_heap() {
    if !ADVISE_HEAP.load(Ordering::Relaxed) {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `sbrk(0)` only reads the current break.
        let end = unsafe { libc::sbrk(0) } as usize;
        // Two threads at once at worst advise a stretch twice.
        let from = ADVISED_TO.swap(end, Ordering::Relaxed);
        // The page where the last stretch ended is already in use.
        advise_pages_from(from, end);
    }
}

/// Advises the whole pages from the first page boundary at or after `from` up to `end` for
/// huge pages; nothing where `end <= from` (the common case, so the page size is read only
/// past it).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn advise_pages_from(from: usize, end: usize) {
    if end <= from {
        return;
    }
    // SAFETY: `sysconf` only reads a constant of the system.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
    let start = from.next_multiple_of(page);
    if start < end {
        // SAFETY: the advice changes only how pages are backed, never their contents. Where
        // the heap has shrunk meanwhile, the kernel advises the part still mapped (and
        // whatever mapping may have taken the rest's place) and reports ENOMEM, which is
        // ignored: harmless either way.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
}

/// Lowers [`ADVISED_TO`] to the heap's end where the heap has shrunk (glibc trims its top past
/// [`set_thresholds`]' threshold), so that what grows back is advised again. A read of a
/// variable (`sbrk(0)`) and an atomic, on every free once advising has begun.
fn note_heap_end() {
    if !ADVISE_HEAP.load(Ordering::Relaxed) {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `sbrk(0)` only reads the current break.
        let end = unsafe { libc::sbrk(0) } as usize;
        if end < ADVISED_TO.load(Ordering::Relaxed) {
            ADVISED_TO.fetch_min(end, Ordering::Relaxed);
        }
    }
}

/// Starts advising the heap's growth from here on for huge pages ([`HostAllocator`], where
/// it is the process's allocator).
///
/// The heap so far is advised too, and its free pages given back (`malloc_trim`): a run that
/// first trained its tokenizer in the same process has a heap grown and freed before training
/// starts, which the step's tensors then reuse without growing it; given back, its free
/// stretches fault in again as huge pages where a whole 2 MiB of them is free.
fn advise_heap_from_now() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `sbrk(0)` only reads the current break.
        let end = unsafe { libc::sbrk(0) } as usize;
        let start = match HEAP_START.load(Ordering::Relaxed) {
            0 => end,
            start => start,
        };
        advise_pages_from(start, end);
        // SAFETY: `malloc_trim` only gives free memory back, under glibc's lock; as in
        // `set_thresholds` for `mallopt`.
        unsafe {
            libc::malloc_trim(0);
            libc::mallopt(libc::M_TOP_PAD, TOP_PAD);
        }
        // SAFETY: `sbrk(0)` only reads the current break.
        let end = unsafe { libc::sbrk(0) } as usize;
        ADVISED_TO.store(end, Ordering::Relaxed);
        ADVISE_HEAP.store(true, Ordering::Relaxed);
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
        advise_heap_from_now();
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
