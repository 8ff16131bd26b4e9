//! Rayon's threads kept awake between the parallel ops of a CPU step, as OpenMP's threads
//! spin between parallel regions.
//!
//! A training step on the CPU is a few hundred parallel ops (products, row kernels, attention,
//! Burn's own element-wise ops), most of them well under a millisecond apart. Left alone,
//! rayon's idle workers go to sleep a few microseconds after their last task, and a thread
//! outside the pool hands each op to the pool and sleeps until it is done, so every op pays a
//! wake-up or two: an empty parallel op from outside the pool took 16-95 us on a 2-core VM
//! (BENCHMARKS.md, "Threads kept awake"). [`warm_threads`] runs a closure on one of the pool's
//! workers and keeps each of the others polling for work until the closure returns.
//!
//! A keeper starts only before the closure does: the closure's owner opens a door, asks every
//! other worker for a keeper, waits a moment for them ([`ADMIT_WAIT`]) and closes the door
//! before running the closure. A keeper started later could start on a worker waiting inside
//! one of the closure's own tasks, and would hold that task until the closure returned, which
//! waits for it. A keeper that has polled a while without finding work sleeps briefly between
//! polls, leaving its core to other threads (a checkpoint writer); after a call it lingers a
//! few thousand polls and keeps for the next call if one comes (the next step).
//!
//! A keeper holds whatever its worker was running when it started (a task of another thread
//! that the worker was waiting inside) until it stops: a closure must not wait for tasks that
//! other threads run on the pool meanwhile (`ember`'s run loop runs none).
//!
//! Keepers only pay where this process has the CPUs its pool's threads run on: the callers
//! use it for single-process runs on the CPU. The closure allocates on a worker: with glibc,
//! a process that runs it every step wants one arena for all its threads (`ember` sets it),
//! or a worker's own arena returns the freed blocks to the kernel between calls.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Odd while a [`warm_threads`] call runs, counting calls.
static GENERATION: AtomicUsize = AtomicUsize::new(0);
/// Keepers now (see [`keepers`]).
static KEEPERS: AtomicUsize = AtomicUsize::new(0);
/// Keepers admitted to the call whose door is open.
static ADMITTED: AtomicUsize = AtomicUsize::new(0);
/// Where keepers are admitted to a call.
static DOOR: Mutex<Door> = Mutex::new(Door {
    generation: 0,
    open: false,
    owner: None,
});

/// A call's door: keepers may join it while it is open, on any worker but the call's own.
struct Door {
    generation: usize,
    open: bool,
    owner: Option<usize>,
}

/// Polls without finding work after which a keeper sleeps [`BACKOFF`] between polls, or, with
/// no call running, stops (each poll looks at every worker's queue).
const SPINS: u32 = 1 << 12;
/// A keeper's sleep between polls once it has found nothing for [`SPINS`] polls.
const BACKOFF: Duration = Duration::from_micros(20);
/// How long a call waits for its keepers before it starts without those not yet there.
const ADMIT_WAIT: Duration = Duration::from_micros(300);

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
    warm_threads_admitting(ADMIT_WAIT, f)
}

/// [`warm_threads`], waiting up to `admit` for the keepers.
fn warm_threads_admitting<R: Send>(admit: Duration, f: impl FnOnce() -> R + Send) -> R {
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
    /// Odd to even, once, when the call ends however it ends: its keepers stop keeping it.
    struct Release(usize);
    impl Drop for Release {
        fn drop(&mut self) {
            let ended = self.0;
            let _ =
                GENERATION.compare_exchange(ended, ended + 1, Ordering::AcqRel, Ordering::Acquire);
        }
    }
    // Where the closure below never ran.
    let _release = Release(generation);
    rayon::scope(|_| {
        let _release = Release(generation);
        let owner = rayon::current_thread_index();
        {
            let mut door = DOOR.lock().unwrap_or_else(PoisonError::into_inner);
            *door = Door {
                generation,
                open: true,
                owner,
            };
            ADMITTED.store(0, Ordering::Release);
        }
        rayon::spawn_broadcast(|_| keep());
        let start = Instant::now();
        while ADMITTED.load(Ordering::Acquire) < threads - 1 && start.elapsed() < admit {
            std::hint::spin_loop();
        }
        DOOR.lock().unwrap_or_else(PoisonError::into_inner).open = false;
        f()
    })
}

/// How many keepers there are now (the worker running a call may hold one of an earlier call
/// under it, idle until the call returns).
pub fn keepers() -> usize {
    KEEPERS.load(Ordering::Acquire)
}

/// Whether this worker may keep for call `generation`.
enum Entry {
    Admitted,
    /// The call's door is not open yet.
    NotYet,
    /// Closed, ended, or this worker runs the call.
    Refused,
}

/// Asks the door of call `generation` to admit this worker.
fn check_in(generation: usize) -> Entry {
    let door = DOOR.lock().unwrap_or_else(PoisonError::into_inner);
    if door.generation < generation {
        Entry::NotYet
    } else if door.generation > generation
        || !door.open
        || rayon::current_thread_index() == door.owner
    {
        Entry::Refused
    } else {
        ADMITTED.fetch_add(1, Ordering::AcqRel);
        Entry::Admitted
    }
}

/// Runs the pool's pending tasks on this worker, polling for more, while the call it was
/// admitted to runs, and into the next call where that admits it.
fn keep() {
    if KEEPING.get() {
        return;
    }
    let mut generation = GENERATION.load(Ordering::Acquire);
    if generation.is_multiple_of(2) || !matches!(check_in(generation), Entry::Admitted) {
        return;
    }
    KEEPING.set(true);
    KEEPERS.fetch_add(1, Ordering::AcqRel);
    // Polls without finding work, and polls since the call kept last ended (work found or
    // not: tasks of other threads do not keep a keeper going).
    let (mut idle, mut after) = (0u32, 0u32);
    loop {
        let now = GENERATION.load(Ordering::Acquire);
        if now != generation {
            if now.is_multiple_of(2) {
                after += 1;
                if after > SPINS {
                    break;
                }
            } else {
                match check_in(now) {
                    Entry::Admitted => {
                        (generation, idle, after) = (now, 0, 0);
                    }
                    Entry::NotYet => {}
                    Entry::Refused => break,
                }
            }
        }
        if rayon::yield_now() == Some(rayon::Yield::Executed) {
            idle = 0;
            continue;
        }
        idle = idle.saturating_add(1);
        if idle < SPINS {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(BACKOFF);
        }
    }
    KEEPERS.fetch_sub(1, Ordering::AcqRel);
    KEEPING.set(false);
}

#[cfg(test)]
mod tests {
    use super::{keepers, warm_threads, warm_threads_admitting};
    use rayon::prelude::*;
    use std::sync::Mutex;
    use std::time::{Duration, Instant};

    /// One test at a time claims the pool (a second call would run plainly).
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

    /// Waits up to 5 s for `keepers()` to read `want`, or more with `at_least`.
    fn keepers_reach_(want: usize, at_least: bool) -> bool {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(5) {
            let now = keepers();
            if now == want || (at_least && now > want) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        false
    }

    /// Waits up to 5 s for `keepers()` to read `want`.
    fn keepers_reach(want: usize) -> bool {
        keepers_reach_(want, false)
    }

    #[test]
    fn the_closure_runs_on_a_worker_while_the_others_keep_and_they_stop_after_it() {
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let threads = rayon::current_num_threads();
        if threads < 2 {
            eprintln!("skipped: rayon's pool has one thread here, so nothing keeps");
            return;
        }
        // Admitting for up to 5 s: every other worker keeps before the closure starts.
        let (sum, on_worker, kept, nested) = warm_threads_admitting(Duration::from_secs(5), || {
            let on_worker = rayon::current_thread_index().is_some();
            // Every other worker was admitted before the closure started (the door is closed
            // now); the worker running the closure may also hold a keeper of an earlier call
            // under it, idle until the closure returns.
            let admitted = super::ADMITTED.load(std::sync::atomic::Ordering::Acquire);
            let kept = admitted == threads - 1 && keepers_reach_(threads - 1, true);
            let sum: u64 = (0..100_000u64).into_par_iter().map(|x| x * x).sum();
            // A call from inside runs its closure where it is, adding no keepers.
            let nested = warm_threads(|| (rayon::current_thread_index(), keepers()));
            (sum, on_worker, kept, nested)
        });
        assert!(on_worker, "the closure ran outside the pool");
        assert!(kept, "{} of {} other workers keep", keepers(), threads - 1);
        assert_eq!(sum, (0..100_000u64).map(|x| x * x).sum::<u64>());
        assert!(nested.0.is_some());
        assert!(nested.1 >= threads - 1);
        assert!(
            keepers_reach(0),
            "{} keepers still poll after the call",
            keepers()
        );
    }

    #[test]
    fn calls_back_to_back_with_parallel_work_all_finish() {
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        // On a thread of its own, so that a hang fails the test instead of stalling it.
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut total = 0u64;
            for call in 0..2_000u64 {
                total += warm_threads(|| {
                    (0..64u64)
                        .into_par_iter()
                        .map(|x| {
                            (0..64u64)
                                .into_par_iter()
                                .map(|y| x * y + call)
                                .sum::<u64>()
                        })
                        .sum::<u64>()
                });
            }
            done.send(total).unwrap();
        });
        let total = finished
            .recv_timeout(Duration::from_secs(120))
            .expect("2,000 calls did not finish in 120 s");
        let one = |call: u64| -> u64 {
            (0..64u64)
                .flat_map(|x| (0..64u64).map(move |y| x * y + call))
                .sum()
        };
        assert_eq!(total, (0..2_000u64).map(one).sum::<u64>());
        assert!(
            keepers_reach(0),
            "{} keepers still poll after the calls",
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
