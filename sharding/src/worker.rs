//! The communication threads of a step: one runs the gathers the training thread hands it, the
//! other the gradient reductions, each in the order handed and each on its own lane of
//! communicators (`Comm::lane`), like two communication streams. Both overlap the unit
//! computing on the training thread, and gathers never queue behind reductions. Every rank
//! hands over the same jobs in the same order (the plan's schedule), so MPI matches them lane
//! by lane. The gather thread owns the step's secondary copies (hpZ), which live from a unit's
//! first gather of the step to the step's end; the reduction thread owns the error-feedback
//! residuals while the step runs.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::{Scope, ScopedJoinHandle};
use std::time::Instant;

use burn::tensor::{Device, Tensor};
use ember_comm::Comm;

use crate::error::ShardError;
use crate::plan::Plan;
use crate::route::{self, Residuals, Secondary};
use crate::schedule::Source;

/// A request to the communication threads.
pub(crate) enum Job {
    /// Gather a unit whole.
    Gather { unit: usize, source: Source },
    /// Reduce a unit's complete gradient to this rank's optimizer shard.
    Reduce { unit: usize, grad: Box<Tensor<1>> },
}

/// What the threads hand back when the step's jobs are done.
pub(crate) struct Finished {
    /// The residuals, updated.
    pub residuals: Vec<Residuals>,
    /// Bytes of the secondary copies at the step's end (their peak: they only grow).
    pub secondary_bytes: u64,
}

/// The lanes the two threads issue their collectives on.
pub(crate) const GATHER_LANE: usize = 1;
/// See [`GATHER_LANE`].
pub(crate) const REDUCE_LANE: usize = 2;

type Reduced = Result<(usize, Tensor<1>), ShardError>;

/// The running communication threads and their channels.
pub(crate) struct Worker<'scope> {
    gathers: Option<Sender<(usize, Source)>>,
    reductions: Option<Sender<(usize, Tensor<1>)>>,
    gathered: Receiver<Result<Tensor<1>, ShardError>>,
    reduced: Receiver<Reduced>,
    gather_thread: ScopedJoinHandle<'scope, u64>,
    reduce_thread: ScopedJoinHandle<'scope, Vec<Residuals>>,
    /// Seconds the training thread spent waiting for answers.
    pub waited_s: f64,
}

impl<'scope> Worker<'scope> {
    /// Starts the threads for one step over `primary` (each unit's primary partition):
    /// gathers on `gather_comm`, reductions on `reduce_comm` (two lanes of one `Comm`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn spawn<'env>(
        scope: &'scope Scope<'scope, 'env>,
        gather_comm: &'env Comm,
        reduce_comm: &'env Comm,
        plan: &'env Plan,
        primary: &'env [Tensor<1>],
        mut residuals: Vec<Residuals>,
        device: &'env Device,
    ) -> Self {
        let (gathers, gather_rx) = channel::<(usize, Source)>();
        let (gathered_tx, gathered) = channel();
        let gather_thread = scope.spawn(move || {
            let mut secondary: Vec<Option<Secondary>> = vec![None; plan.units.len()];
            for (unit, source) in gather_rx {
                debug_assert_eq!(
                    source == Source::Secondary,
                    secondary[unit].is_some(),
                    "the schedule and the secondary copies agree"
                );
                let out = route::gather(
                    gather_comm,
                    plan,
                    unit,
                    &primary[unit],
                    &mut secondary[unit],
                    device,
                );
                let failed = out.is_err();
                if gathered_tx.send(out).is_err() || failed {
                    break;
                }
            }
            secondary.iter().flatten().map(Secondary::bytes).sum()
        });
        let (reductions, reduce_rx) = channel::<(usize, Tensor<1>)>();
        let (reduced_tx, reduced) = channel::<Reduced>();
        let reduce_thread = scope.spawn(move || {
            for (unit, grad) in reduce_rx {
                let out = route::reduce(
                    reduce_comm,
                    plan,
                    unit,
                    grad,
                    &mut residuals[unit],
                    device,
                )
                .map(|shard| (unit, shard));
                let failed = out.is_err();
                if reduced_tx.send(out).is_err() || failed {
                    break;
                }
            }
            residuals
        });
        Self {
            gathers: Some(gathers),
            reductions: Some(reductions),
            gathered,
            reduced,
            gather_thread,
            reduce_thread,
            waited_s: 0.0,
        }
    }

    /// Hands a job over (a thread that stopped reports its error when its answers are read).
    pub(crate) fn send(&self, job: Job) {
        match job {
            Job::Gather { unit, source } => {
                if let Some(g) = &self.gathers {
                    let _ = g.send((unit, source));
                }
            }
            Job::Reduce { unit, grad } => {
                if let Some(r) = &self.reductions {
                    let _ = r.send((unit, *grad));
                }
            }
        }
    }

    /// The next gathered unit (in the order the gathers were handed over), timing the wait;
    /// reduced shards that arrived meanwhile are added to `grads`.
    pub(crate) fn next_gathered(
        &mut self,
        grads: &mut [Option<Tensor<1>>],
    ) -> Result<Tensor<1>, ShardError> {
        self.collect_reduced(grads)?;
        let t = Instant::now();
        let msg = self.gathered.recv();
        self.waited_s += t.elapsed().as_secs_f64();
        match msg {
            Ok(gathered) => gathered,
            // The thread stopped without an answer: a reduction failure says why.
            Err(_) => {
                self.collect_reduced(grads)?;
                Err(thread_gone())
            }
        }
    }

    /// Adds the reduced shards that have arrived to `grads`, without waiting.
    fn collect_reduced(&mut self, grads: &mut [Option<Tensor<1>>]) -> Result<(), ShardError> {
        while let Ok(r) = self.reduced.try_recv() {
            let (unit, shard) = r?;
            add_to(&mut grads[unit], shard);
        }
        Ok(())
    }

    /// No more jobs: waits for the remaining reductions (adding them to `grads`, timing the
    /// wait) and for both threads to end.
    pub(crate) fn finish(
        mut self,
        grads: &mut [Option<Tensor<1>>],
    ) -> Result<(Finished, f64), ShardError> {
        self.gathers = None;
        self.reductions = None;
        let t = Instant::now();
        let mut failure = None;
        for r in self.reduced.iter() {
            match r {
                Ok((unit, shard)) => add_to(&mut grads[unit], shard),
                Err(e) => failure = failure.or(Some(e)),
            }
        }
        self.waited_s += t.elapsed().as_secs_f64();
        // A gather that failed after the last visit took its answer is reported here.
        for g in self.gathered.try_iter() {
            if let Err(e) = g {
                failure = failure.or(Some(e));
            }
        }
        let secondary_bytes = self.gather_thread.join().map_err(|_| thread_gone())?;
        let residuals = self.reduce_thread.join().map_err(|_| thread_gone())?;
        match failure {
            Some(e) => Err(e),
            None => Ok((
                Finished {
                    residuals,
                    secondary_bytes,
                },
                self.waited_s,
            )),
        }
    }
}

/// `acc += x`, taking `x` whole when `acc` is empty.
pub(crate) fn add_to(acc: &mut Option<Tensor<1>>, x: Tensor<1>) {
    *acc = Some(match acc.take() {
        Some(a) => a + x,
        None => x,
    });
}

fn thread_gone() -> ShardError {
    ShardError::Model("a communication thread stopped unexpectedly".into())
}
