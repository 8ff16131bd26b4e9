//! Rayon's threads kept awake between the parallel ops of a CPU step, as OpenMP's threads
//! spin between parallel regions.
//!
//! A training step on the CPU is a few hundred parallel ops (products, row kernels, attention,
//! Burn's own element-wise ops), most of them well under a millisecond apart. Left alone,
//! rayon's idle workers go to sleep a few microseconds after their last task, and a thread
//! outside the pool hands each op to the pool and sleeps until it is done, so every op pays a
//! wake-up or two: an empty parallel op from outside the pool took 16-95 us on a 2-core VM
//! (BENCHMARKS.md, "Threads kept awake"). [`warm_threads`] runs a closure on one of the pool's
//! workers and keeps each of the others polling for work until the closure returns. A keeper
//! polls for a while, then gives its core to any other thread that wants it between polls
//! (`sched_yield`), so that a thread outside the pool (I/O, a checkpoint writer) still runs.
//!
//! Keepers only pay where this process has the CPUs its pool's threads run on: the callers
//! use it for single-process runs on the CPU. The closure allocates on a worker: with glibc,
//! a process that runs it every step wants one arena for all its threads (`ember` sets it),
//! or a worker's own arena returns the freed blocks to the kernel between calls.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Odd while a [`warm_threads`] call runs: its keepers poll while it keeps the value it had
/// when they started.
static GENERATION: AtomicUsize = AtomicUsize::new(0);
/// Keepers polling now.
static KEEPERS: AtomicUsize = AtomicUsize::new(0);

/// Polls without finding work after which a keeper yields its core between polls (a few
/// hundred microseconds of polling).
const SPINS: u32 = 1 << 12;

thread_local! {
    /// Whether this thread is a keeper now (a second keeper reaching it returns at once).
    static KEEPING: Cell<bool> = const { Cell::new(false) };
}

/// `f()`, run on a worker of rayon's global pool while the pool's other workers poll for its
/// parallel work instead of sleeping between tasks; the keepers stop when `f` returns or
/// panics (the panic goes on to the caller).
///
/// Runs `f` on the calling thread, with no keepers, where the pool has one thread, where the
/// caller is already one of the pool's workers, or while another call runs.
pub fn warm_threads<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let threads = rayon::current_num_threads();
    if threads < 2 || rayon::current_thread_index().is_some() {
        return f();
    }
    // Claims the pool: even to odd.
    let Ok(before) = GENERATION.fetch_update(Ordering::AcqRel, Ordering::Acquire, |g| {
        g.is_multiple_of(2).then_some(g + 1)
    }) else {
        return f();
    };
    let generation = before + 1;
    /// Odd to even when the call ends, however it ends: the keepers stop.
    struct Release;
    impl Drop for Release {
        fn drop(&mut self) {
            GENERATION.fetch_add(1, Ordering::AcqRel);
        }
    }
    let _release = Release;
    rayon::scope(|_| {
        let owner = rayon::current_thread_index();
        rayon::spawn_broadcast(move |context| {
            if Some(context.index()) != owner {
                keep(generation);
            }
        });
        f()
    })
}

/// How many keepers poll now.
pub fn keepers() -> usize {
    KEEPERS.load(Ordering::Acquire)
}

/// Runs the pool's pending tasks on this worker, polling for more, while [`GENERATION`] is
/// `generation`.
fn keep(generation: usize) {
    if KEEPING.get() {
        return;
    }
    KEEPING.set(true);
    KEEPERS.fetch_add(1, Ordering::AcqRel);
    let mut idle = 0u32;
    while GENERATION.load(Ordering::Acquire) == generation {
        if rayon::yield_now() == Some(rayon::Yield::Executed) {
            idle = 0;
        } else if idle < SPINS {
            idle += 1;
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
    KEEPERS.fetch_sub(1, Ordering::AcqRel);
    KEEPING.set(false);
}

#[cfg(test)]
mod tests {
    use super::{keepers, warm_threads};
    use rayon::prelude::*;
    use std::sync::Mutex;
    use std::time::{Duration, Instant};

    /// One test at a time claims the pool (a second call would run plainly).
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

    /// Waits up to 5 s for `keepers()` to read `want`.
    fn keepers_reach(want: usize) -> bool {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(5) {
            if keepers() == want {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        false
    }

    #[test]
    fn the_closure_runs_on_a_worker_while_the_others_keep_and_they_stop_after_it() {
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let threads = rayon::current_num_threads();
        if threads < 2 {
            eprintln!("skipped: rayon's pool has one thread here, so nothing keeps");
            return;
        }
        let (sum, on_worker, kept, nested) = warm_threads(|| {
            let on_worker = rayon::current_thread_index().is_some();
            let kept = keepers_reach(threads - 1);
            let sum: u64 = (0..100_000u64).into_par_iter().map(|x| x * x).sum();
            // A call from inside runs its closure where it is, adding no keepers.
            let nested = warm_threads(|| (rayon::current_thread_index(), keepers()));
            (sum, on_worker, kept, nested)
        });
        assert!(on_worker, "the closure ran outside the pool");
        assert!(kept, "{} of {} other workers kept", keepers(), threads - 1);
        assert_eq!(sum, (0..100_000u64).map(|x| x * x).sum::<u64>());
        assert!(nested.0.is_some());
        assert_eq!(nested.1, threads - 1);
        assert!(
            keepers_reach(0),
            "{} keepers still poll after the call",
            keepers()
        );
    }

    #[test]
    fn a_panic_in_the_closure_reaches_the_caller_and_stops_the_keepers() {
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let caught = std::panic::catch_unwind(|| warm_threads(|| panic!("in the step")));
        assert!(caught.is_err());
        assert!(
            keepers_reach(0),
            "{} keepers still poll after the panic",
            keepers()
        );
        // The pool can be claimed again.
        assert_eq!(
            warm_threads(|| rayon::current_thread_index().is_some()),
            rayon::current_num_threads() >= 2
        );
    }
}
