//! The threads a process computes on: rayon's global pool, with the command itself running
//! on one of its workers.

/// Stack of each of rayon's threads. The command runs on one of them, so it gets the 8 MiB a
/// main thread has on Linux rather than the 2 MiB of a spawned thread.
const STACK: usize = 8 << 20;

/// Runs `f` on one of rayon's worker threads, the calling thread waiting for it, so that every
/// parallel pass of the kernels starts from inside the pool: the starting worker runs the
/// first piece at once while the others steal the rest. A pass started from outside the pool
/// waits for a worker to take it up, and its caller for a wake-up at the end. On the Zen 4
/// machine of BENCHMARKS.md a pass of two empty pieces took 17 µs from outside the pool
/// started back to back, 52-65 µs after 1-5 ms of serial work, and 0-12 µs from inside it; a
/// training step starts one for each matrix product and element-wise pass.
///
/// Builds the global pool (threads as `RAYON_NUM_THREADS` says, else one per CPU) unless
/// something built it before, and moves every thread's allocations to one arena
/// ([`super::host_memory::one_arena`]).
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    // Before any worker allocates: a thread takes its arena at its first allocation.
    super::host_memory::one_arena();
    // An error means the pool was built already; it then runs `f` as it is.
    let _ = rayon::ThreadPoolBuilder::new()
        .stack_size(STACK)
        .build_global();
    rayon::scope(|_| f())
}
