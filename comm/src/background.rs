//! Background collectives: one worker thread per `Comm` that runs blocking multi-hop and
//! quantized collectives while the caller computes, and the [`Background`] handle that returns
//! their result. It deliberately adds no algorithm: a job is the blocking function, run
//! elsewhere.
//!
//! # Why this is safe without rules for the caller
//!
//! - **Matching.** MPI matches collectives per communicator, in call order. The worker issues
//!   its collectives on its own duplicated communicators (the background lane of `comm`), so a
//!   job can never be matched against a collective the caller issues meanwhile on the same
//!   group, on any rank, whatever the timing. Jobs run one at a time in submission (FIFO)
//!   order, and every rank submits in its program order, so background collectives are issued
//!   in the same order everywhere, exactly as blocking ones would be. The only rule is the
//!   usual one: every rank starts the same collectives in the same order.
//! - **Threads.** `Comm::init` requires `MPI_THREAD_MULTIPLE`, so the worker may call MPI while
//!   the caller does.
//! - **Lifetimes.** A job owns everything it touches (inputs moved in, the kernels by value, an
//!   `Arc` of the communicators), so forgetting a handle can leak a result but never leaves
//!   the worker reading freed memory. Dropping the `Comm` finishes every queued job, then joins
//!   the worker, before MPI is finalised.
//! - **Timeouts.** Every MPI call a job makes is armed on the same watchdog as the caller's
//!   collectives, so a background collective stuck past the timeout aborts the job naming
//!   its op and scope. Waiting on a handle is not armed itself: it waits for a job that is
//!   either running (and armed) or queued behind one that is.
//! - **Panics.** A panic inside a job aborts the MPI job under `PanicPolicy::AbortJob` (the
//!   default); under `KeepHook` it is caught on the worker and resumed in the caller's `wait`.

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::thread::{self, JoinHandle};

use crate::comm::{Comm, Core};
use crate::error::CommError;

/// One queued job: runs on the worker with its background-lane `Comm`.
pub(crate) type Job = Box<dyn FnOnce(&Comm) + Send>;

/// What a job sends back: its result, or the panic that ended it.
type Outcome<R> = thread::Result<Result<R, CommError>>;

/// The worker thread and the queue feeding it. Dropping it finishes the queue and joins.
pub(crate) struct Worker {
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    /// Starts the worker over `core`'s background lane.
    pub(crate) fn spawn(core: Arc<Core>) -> Result<Self, CommError> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let thread = thread::Builder::new()
            .name("ember-comm-background".into())
            .spawn(move || {
                let comm = Comm::background_view(core);
                // Ends when the sender is dropped, after every job already queued has run.
                while let Ok(job) = queue.recv() {
                    job(&comm);
                }
            })
            .map_err(|e| {
                CommError::Unsupported(format!(
                    "could not start the background collective thread ({e}): raise the \
                     process's thread limit"
                ))
            })?;
        Ok(Self {
            jobs: Some(jobs),
            thread: Some(thread),
        })
    }

    /// Queues `job`.
    pub(crate) fn submit(&self, job: Job) -> Result<(), CommError> {
        let sent = self.jobs.as_ref().map(|jobs| jobs.send(job));
        match sent {
            Some(Ok(())) => Ok(()),
            _ => Err(CommError::Unsupported(
                "the background collective thread has stopped (a job panicked outside its \
                 guard?): restart the process"
                    .into(),
            )),
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A collective running on the background worker. `wait` returns its result; dropping the
/// handle without waiting blocks until the job is done (its result is discarded).
#[must_use = "a background collective's result is only available through `wait`"]
pub struct Background<R> {
    outcome: Receiver<Outcome<R>>,
    early: Option<Outcome<R>>,
    finished: bool,
}

impl<R> std::fmt::Debug for Background<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Background")
            .field("finished", &(self.finished || self.early.is_some()))
            .finish_non_exhaustive()
    }
}

impl<R> Background<R> {
    /// True once the job has finished (then `wait` returns at once). Never blocks.
    pub fn is_complete(&mut self) -> bool {
        if self.early.is_none() && !self.finished {
            match self.outcome.try_recv() {
                Ok(outcome) => self.early = Some(outcome),
                Err(TryRecvError::Disconnected) => self.finished = true,
                Err(TryRecvError::Empty) => {}
            }
        }
        self.early.is_some() || self.finished
    }

    /// Blocks until the job has finished and returns its result. A panic inside the job (only
    /// possible under `PanicPolicy::KeepHook`) resumes here.
    pub fn wait(mut self) -> Result<R, CommError> {
        let outcome = match self.early.take() {
            Some(outcome) => Ok(outcome),
            None => self.outcome.recv(),
        };
        self.finished = true;
        match outcome {
            Ok(Ok(result)) => result,
            Ok(Err(panic)) => resume_unwind(panic),
            Err(_) => Err(CommError::Unsupported(
                "the background collective thread stopped before finishing this collective: \
                 restart the process"
                    .into(),
            )),
        }
    }
}

impl<R> Drop for Background<R> {
    fn drop(&mut self) {
        if !self.finished && self.early.is_none() {
            // The job owns its buffers, so this wait is only for ordering: the caller may
            // assume the collective is over once the handle is gone.
            let _ = self.outcome.recv();
        }
    }
}

/// Queues `job` on `comm`'s worker and returns the handle to its result.
pub(crate) fn spawn<R, F>(comm: &Comm, job: F) -> Result<Background<R>, CommError>
where
    R: Send + 'static,
    F: FnOnce(&Comm) -> Result<R, CommError> + Send + 'static,
{
    let (send, outcome) = mpsc::sync_channel::<Outcome<R>>(1);
    comm.submit(Box::new(move |worker_comm: &Comm| {
        let result = catch_unwind(AssertUnwindSafe(|| job(worker_comm)));
        // The handle may be gone (forgotten or dropped mid-wait): nobody to tell.
        let _ = send.send(result);
    }))?;
    Ok(Background {
        outcome,
        early: None,
        finished: false,
    })
}
