//! The communication thread of a step: it runs the gathers and gradient reductions the
//! training thread hands it, one at a time in the order handed, like a dedicated
//! communication stream, so they overlap the unit computing on the training thread. Every rank
//! hands over the same jobs in the same order (the plan's schedule), so MPI matches them. The
//! thread also owns the step's secondary copies (hpZ), which live from a unit's first gather of
//! the step to the step's end, and the error-feedback residuals while the step runs.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::{Scope, ScopedJoinHandle};
use std::time::Instant;

use burn::tensor::{Device, Tensor};
use ember_comm::Comm;

use crate::error::ShardError;
use crate::plan::Plan;
use crate::route::{self, Residuals, Secondary};
use crate::schedule::Source;

/// A request to the communication thread.
pub(crate) enum Job {
    /// Gather a unit whole.
    Gather { unit: usize, source: Source },
    /// Reduce a unit's complete gradient to this rank's optimizer shard.
    Reduce { unit: usize, grad: Box<Tensor<1>> },
}

/// An answer, in request order.
pub(crate) enum Done {
    Gathered(Tensor<1>),
    Reduced { unit: usize, shard: Tensor<1> },
}

/// What the thread hands back when the step's jobs are done.
pub(crate) struct Finished {
    /// The residuals, updated.
    pub residuals: Vec<Residuals>,
    /// Bytes of the secondary copies at the step's end (their peak: they only grow).
    pub secondary_bytes: u64,
}

/// The running communication thread and its two channels.
pub(crate) struct Worker<'scope> {
    jobs: Option<Sender<Job>>,
    done: Receiver<Result<Done, ShardError>>,
    handle: ScopedJoinHandle<'scope, Finished>,
    /// Seconds the training thread spent waiting for answers.
    pub waited_s: f64,
}

impl<'scope> Worker<'scope> {
    /// Starts the thread for one step over `primary` (each unit's primary partition).
    pub(crate) fn spawn<'env>(
        scope: &'scope Scope<'scope, 'env>,
        comm: &'env Comm,
        plan: &'env Plan,
        primary: &'env [Tensor<1>],
        mut residuals: Vec<Residuals>,
        device: &'env Device,
    ) -> Self {
        let (jobs, job_rx) = channel::<Job>();
        let (done_tx, done) = channel::<Result<Done, ShardError>>();
        let handle = scope.spawn(move || {
            let mut secondary: Vec<Option<Secondary>> = vec![None; plan.units.len()];
            for job in job_rx {
                let out = match job {
                    Job::Gather { unit, source } => {
                        debug_assert_eq!(
                            source == Source::Secondary,
                            secondary[unit].is_some(),
                            "the schedule and the secondary copies agree"
                        );
                        route::gather(
                            comm,
                            plan,
                            unit,
                            &primary[unit],
                            &mut secondary[unit],
                            device,
                        )
                        .map(Done::Gathered)
                    }
                    Job::Reduce { unit, grad } => {
                        route::reduce(comm, plan, unit, *grad, &mut residuals[unit], device)
                            .map(|shard| Done::Reduced { unit, shard })
                    }
                };
                let failed = out.is_err();
                if done_tx.send(out).is_err() || failed {
                    break;
                }
            }
            Finished {
                residuals,
                secondary_bytes: secondary.iter().flatten().map(Secondary::bytes).sum(),
            }
        });
        Self {
            jobs: Some(jobs),
            done,
            handle,
            waited_s: 0.0,
        }
    }

    /// Hands a job over (a thread that stopped reports its error on the next receive).
    pub(crate) fn send(&self, job: Job) {
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(job);
        }
    }

    /// The next answer, timing the wait.
    pub(crate) fn recv(&mut self) -> Result<Option<Done>, ShardError> {
        let t = Instant::now();
        let msg = self.done.recv();
        self.waited_s += t.elapsed().as_secs_f64();
        match msg {
            Ok(done) => done.map(Some),
            Err(_) => Ok(None),
        }
    }

    /// No more jobs: answers still arrive until the thread has done them all.
    pub(crate) fn close(&mut self) {
        self.jobs = None;
    }

    /// Waits for the thread to end.
    pub(crate) fn join(self) -> Result<Finished, ShardError> {
        drop(self.jobs);
        drop(self.done);
        self.handle
            .join()
            .map_err(|_| ShardError::Model("the communication thread stopped unexpectedly".into()))
    }
}
