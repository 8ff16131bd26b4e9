//! Ending the whole job instead of hanging it: a panic hook that aborts MPI, and one watchdog
//! thread that aborts when a collective waits longer than the configured timeout. It deliberately
//! does not try to recover: after a lost rank the collectives' state is undefined.
//!
//! Why one watchdog thread and not one per collective: spawning a thread costs tens of
//! microseconds, more than a small collective; registering in a shared table costs a lock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mpi::ffi;

use crate::counters::Op;
use crate::topology::{Scope, Topology};

/// Exit code of a job aborted by the watchdog (like `timeout(1)`).
pub const TIMEOUT_EXIT_CODE: i32 = 124;
/// Exit code of a job aborted because a rank panicked (like Rust's panic exit code).
pub const PANIC_EXIT_CODE: i32 = 101;

/// Aborts every rank of the job. Safe to call from any thread: we initialise MPI with
/// `MPI_THREAD_MULTIPLE` (see `comm`), and `MPI_Abort` does not return.
///
/// `MPI_Abort` asks the launcher to end the job, which it cannot do for ranks it can no longer
/// reach (a network cut off between them): this rank then ends itself after
/// [`ABORT_GRACE`], so every rank still ends on its own watchdog.
pub fn abort_job(code: i32, reason: &str) -> ! {
    if let Some(hook) = ABORT_HOOK.get() {
        hook(code, reason);
    }
    std::thread::spawn(move || {
        std::thread::sleep(ABORT_GRACE);
        // SAFETY: _exit ends the process at once; nothing is left to run on its behalf.
        unsafe { libc::_exit(code) }
    });
    // SAFETY: MPI is initialised while a `Comm` exists, which is the only time this is called.
    unsafe {
        ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code);
    }
    // MPI_Abort should not return; if a broken MPI lets it, make sure the job still ends.
    std::process::exit(code)
}

static ABORT_HOOK: std::sync::OnceLock<fn(i32, &str)> = std::sync::OnceLock::new();

/// Sets what [`abort_job`] does first, with the exit code and the reason (once per process;
/// later calls are ignored): the application records how the rank ended, for a launcher
/// that cannot see the abort otherwise.
pub fn before_abort(hook: fn(i32, &str)) {
    let _ = ABORT_HOOK.set(hook);
}

/// How long a rank waits for `MPI_Abort` to end it before it ends itself.
pub const ABORT_GRACE: Duration = Duration::from_secs(3);

/// Installs a panic hook that prints the usual message, names this rank and aborts the job,
/// so the other ranks do not wait forever in their next collective. The hook only aborts while
/// the returned flag is true (the `Comm` clears it before finalising MPI).
pub fn install_panic_hook(rank: usize) -> Arc<AtomicBool> {
    let live = Arc::new(AtomicBool::new(true));
    let seen = Arc::clone(&live);
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        previous(info);
        if seen.load(Ordering::SeqCst) {
            eprintln!("ember-comm: rank {rank} panicked; aborting the MPI job");
            abort_job(PANIC_EXIT_CODE, &format!("panicked: {info}"));
        }
    }));
    live
}

/// One collective being waited on.
#[derive(Debug, Clone)]
struct Waiting {
    op: Op,
    scope: Scope,
    since: Instant,
    /// World ranks it is waiting on right now, when known (a step of one of our collectives).
    peers: Vec<usize>,
}

#[derive(Debug)]
struct Shared {
    slots: Mutex<Vec<Option<Waiting>>>,
    stop: AtomicBool,
}

/// The watchdog: a thread that checks the waiting collectives a few times per timeout.
#[derive(Debug)]
pub struct Watchdog {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// Unregisters its collective when dropped (the wait finished).
#[derive(Debug)]
pub struct Armed<'w> {
    shared: &'w Shared,
    slot: usize,
}

impl Watchdog {
    /// Starts the watchdog thread for `rank` of `topology` with `timeout`.
    pub fn start(rank: usize, topology: &Topology, timeout: Duration) -> Self {
        // Names are formatted once here so arming a collective never allocates.
        let topology = topology.clone();
        let shared = Arc::new(Shared {
            slots: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
        });
        let seen = Arc::clone(&shared);
        // Check ten times per timeout (at most once a second) so an abort comes at most 10% late.
        let period = (timeout / 10).clamp(Duration::from_millis(10), Duration::from_secs(1));
        let thread = std::thread::Builder::new()
            .name("ember-comm-watchdog".into())
            .spawn(move || {
                while !seen.stop.load(Ordering::Relaxed) {
                    std::thread::park_timeout(period);
                    let overdue = {
                        let slots = seen.slots.lock().unwrap_or_else(|e| e.into_inner());
                        slots
                            .iter()
                            .flatten()
                            .find(|w| w.since.elapsed() > timeout)
                            .cloned()
                    };
                    if let Some(w) = overdue {
                        let peers = if w.peers.is_empty() {
                            String::new()
                        } else {
                            let names: Vec<String> =
                                w.peers.iter().map(|r| r.to_string()).collect();
                            format!(
                                " for rank(s) {} (a failed rank, or a link to it down)",
                                names.join(", ")
                            )
                        };
                        let reason = format!(
                            "{} on level {} waited longer than the collective timeout of {} \
                             s{peers}",
                            w.op.name(),
                            topology.scope_name(w.scope),
                            timeout.as_secs_f64()
                        );
                        eprintln!("ember-comm: rank {rank}: {reason}; aborting the MPI job");
                        abort_job(TIMEOUT_EXIT_CODE, &reason);
                    }
                }
            })
            .expect("spawning the comm watchdog thread");
        Self {
            shared,
            thread: Some(thread),
        }
    }

    /// Registers a wait for `op` on `scope`; the returned guard unregisters it.
    pub fn arm(&self, op: Op, scope: Scope) -> Armed<'_> {
        let mut slots = self.shared.slots.lock().unwrap_or_else(|e| e.into_inner());
        let waiting = Some(Waiting {
            op,
            scope,
            since: Instant::now(),
            peers: Vec::new(),
        });
        let slot = match slots.iter().position(Option::is_none) {
            Some(i) => {
                slots[i] = waiting;
                i
            }
            None => {
                slots.push(waiting);
                slots.len() - 1
            }
        };
        Armed {
            shared: &self.shared,
            slot,
        }
    }
}

impl Armed<'_> {
    /// Names the world ranks the collective is waiting on now (for the timeout's message).
    pub fn waiting_on(&self, peers: &[usize]) {
        let mut slots = self.shared.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = slots[self.slot].as_mut() {
            w.peers.clear();
            w.peers.extend_from_slice(peers);
        }
    }
}

impl Drop for Armed<'_> {
    fn drop(&mut self) {
        let mut slots = self.shared.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots[self.slot] = None;
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}
