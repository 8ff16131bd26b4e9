//! The communication threads of a step. Every gather and reduction is a chain of collectives,
//! one per group (`route::Flow`: a unit's hops, outermost first for a gather, innermost first
//! for a reduction); each group has a thread of its own on each of two lanes of communicators
//! (`Comm::lane`), one lane for gathers and one for reductions. A job runs its first stage on
//! its first group's thread, then moves on to the next group's thread, so while one unit
//! crosses the node uplink the unit before it can cross the GPU links: consecutive jobs
//! overlap on different links, and all of them overlap the unit computing on the training
//! thread.
//!
//! Every rank hands over the same jobs in the same order (the plan's schedule), and each
//! thread runs its stages in that order (a sequence number per thread, fixed when the job is
//! handed over), so MPI matches them group by group whatever the timing. Gathered units come
//! back to the training thread in the order it asked for them.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::{Scope, ScopedJoinHandle};
use std::time::Instant;

use burn::tensor::{Device, StreamId, Tensor};
use ember_comm::Comm;

use crate::error::ShardError;
use crate::plan::schedule::Source;
use crate::plan::simulate::Interval;
use crate::plan::{Levels, Plan};
use crate::transport::host::add_to;
use crate::transport::route::{
    self, Accumulated, Carry, FinishFn, Flow, HostShards, Residuals, Secondaries, StageFn,
};

/// A request to the communication threads.
pub(crate) enum Job {
    /// Gather a unit whole.
    Gather { unit: usize, source: Source },
    /// Reduce a unit's complete gradient to this rank's optimizer shard (only over the hops
    /// up to the accumulation span when `inner_only`).
    Reduce {
        unit: usize,
        grad: Box<Tensor<1>>,
        inner_only: bool,
    },
}

/// The lane gathers run on (lane 0 is the training thread's).
pub(crate) const GATHER_LANE: usize = 1;
/// The lane reductions run on.
pub(crate) const REDUCE_LANE: usize = 2;

/// A job's stage as it travels: its place in its group's order, what the previous stage
/// produced, and what follows.
struct Msg<'e> {
    seq: u64,
    name: String,
    carry: Carry,
    stage: StageFn<'e>,
    rest: VecDeque<Next<'e>>,
    finish: FinishFn<'e>,
}

/// A later stage, with the thread and the place in its order it was given when handed over.
struct Next<'e> {
    to: Sender<Msg<'e>>,
    seq: u64,
    name: String,
    stage: StageFn<'e>,
}

/// One group's thread on one lane: its queue and the sequence number of its next stage.
struct Thread<'e> {
    to: Sender<Msg<'e>>,
    next_seq: u64,
}

type Reduced = Result<(usize, Tensor<1>), ShardError>;

/// The device stream each communication thread submits its work on, one per lane and group,
/// allocated on first use and kept for the model's life. A step's threads are new threads,
/// and a CubeCL runtime gives every new thread a stream of its own, each with its own memory
/// pools (device memory, and pinned host memory for crossings): without a fixed stream every
/// step would fill fresh pools (measured on wgpu, `tiny` zero3 at 2 ranks: two more streams
/// and 22 MB more reserved device memory per step) instead of reusing the last step's.
#[derive(Debug, Default)]
pub(crate) struct CommStreams(Mutex<HashMap<(usize, Levels), StreamId>>);

impl CommStreams {
    /// The stream of the thread of `group` on `lane`.
    fn of(&self, lane: usize, group: Levels) -> StreamId {
        *self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((lane, group))
            .or_insert_with(StreamId::allocate)
    }
}

/// The running communication threads of one step.
pub(crate) struct Worker<'scope, 'env> {
    scope: &'scope Scope<'scope, 'env>,
    gather_comm: &'env Comm,
    reduce_comm: &'env Comm,
    plan: &'env Plan,
    primary: &'env [Tensor<1>],
    secondaries: &'env Secondaries,
    residuals: &'env Mutex<Vec<Residuals>>,
    shared: &'env Shared,
    device: &'env Device,
    streams: &'env CommStreams,
    threads: HashMap<(usize, Levels), Thread<'env>>,
    handles: Vec<ScopedJoinHandle<'scope, ()>>,
    /// Gathers in the order handed over, each with its own answer.
    gathered: VecDeque<Receiver<Result<Tensor<1>, ShardError>>>,
    reduced_tx: Sender<Reduced>,
    reduced: Receiver<Reduced>,
    failures_tx: Sender<ShardError>,
    failures: Receiver<ShardError>,
    /// Seconds the training thread spent waiting for answers.
    pub waited_s: f64,
}

/// The state a step's communication threads share with the training thread.
pub(crate) struct Shared {
    /// The secondary copies cut this step.
    pub secondaries: Secondaries,
    /// The host forms of the primary shards read this step.
    pub shards: HostShards,
    /// Error-feedback residuals, per unit.
    pub residuals: Mutex<Vec<Residuals>>,
    /// Gradients accumulated inside the path over the step's earlier micro-batches, per unit.
    pub accumulated: Accumulated,
    /// When the step started, and what ran when (the training thread's visits, every stage).
    pub clock: Instant,
    pub spans: Mutex<Vec<Interval>>,
}

impl Shared {
    pub(crate) fn new(units: usize, residuals: Vec<Residuals>, clock: Instant) -> Self {
        Self {
            secondaries: Secondaries::new(units),
            shards: HostShards::new(units),
            residuals: Mutex::new(residuals),
            accumulated: Mutex::new(vec![Default::default(); units]),
            clock,
            spans: Mutex::new(Vec::new()),
        }
    }

    /// Records `what` as running from `start` until now.
    pub(crate) fn record(&self, what: String, start: Instant) {
        let span = Interval {
            what,
            start: start.duration_since(self.clock).as_secs_f64(),
            end: self.clock.elapsed().as_secs_f64(),
        };
        self.spans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(span);
    }
}

impl<'scope, 'env> Worker<'scope, 'env> {
    /// Ready to start threads in `scope` as jobs need them: gathers of `primary` (each unit's
    /// primary partition) on `gather_comm`, reductions on `reduce_comm` (two lanes of one
    /// `Comm`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        scope: &'scope Scope<'scope, 'env>,
        gather_comm: &'env Comm,
        reduce_comm: &'env Comm,
        plan: &'env Plan,
        primary: &'env [Tensor<1>],
        shared: &'env Shared,
        device: &'env Device,
        streams: &'env CommStreams,
    ) -> Self {
        let (reduced_tx, reduced) = channel();
        let (failures_tx, failures) = channel();
        Self {
            scope,
            gather_comm,
            reduce_comm,
            plan,
            primary,
            secondaries: &shared.secondaries,
            residuals: &shared.residuals,
            shared,
            device,
            streams,
            threads: HashMap::new(),
            handles: Vec::new(),
            gathered: VecDeque::new(),
            reduced_tx,
            reduced,
            failures_tx,
            failures,
            waited_s: 0.0,
        }
    }

    /// Hands a job over. Its stages are queued on their groups' threads at once, each with its
    /// place in that thread's order; a job that moves nothing finishes here.
    pub(crate) fn send(&mut self, job: Job) -> Result<(), ShardError> {
        let (kind, unit) = match &job {
            Job::Gather { unit, .. } => ("gather", *unit),
            Job::Reduce { unit, .. } => ("reduce", *unit),
        };
        let (lane, flow) = match job {
            Job::Gather { unit, source } => {
                let (tx, rx) = channel();
                self.gathered.push_back(rx);
                let flow = route::gather_flow(
                    self.plan,
                    self.gather_comm.rank(),
                    unit,
                    source,
                    &self.primary[unit],
                    self.secondaries,
                    &self.shared.shards,
                    self.device,
                    move |r| {
                        let _ = tx.send(r);
                    },
                )?;
                (GATHER_LANE, flow)
            }
            Job::Reduce {
                unit,
                grad,
                inner_only,
            } => {
                let tx = self.reduced_tx.clone();
                let flow = route::reduce_flow(
                    self.plan,
                    unit,
                    *grad,
                    inner_only,
                    self.residuals,
                    &self.shared.accumulated,
                    self.device,
                    move |r| {
                        let _ = tx.send(r.map(|shard| (unit, shard)));
                    },
                )?;
                (REDUCE_LANE, flow)
            }
        };
        let Flow { stages, finish } = flow;
        let mut rest: VecDeque<Next<'env>> = stages
            .into_iter()
            .map(|(group, stage)| {
                let name = format!("{kind} {unit} {}", group.name(&self.plan.topology));
                let thread = self.thread(lane, group);
                let seq = thread.next_seq;
                thread.next_seq += 1;
                Next {
                    to: thread.to.clone(),
                    seq,
                    name,
                    stage,
                }
            })
            .collect();
        match rest.pop_front() {
            None => finish(Carry::Empty),
            Some(first) => {
                let _ = first.to.send(Msg {
                    seq: first.seq,
                    name: first.name,
                    carry: Carry::Empty,
                    stage: first.stage,
                    rest,
                    finish,
                });
                Ok(())
            }
        }
    }

    /// The thread of `group` on `lane`, started on first use.
    fn thread(&mut self, lane: usize, group: Levels) -> &mut Thread<'env> {
        let comm = if lane == GATHER_LANE {
            self.gather_comm
        } else {
            self.reduce_comm
        };
        let (scope, failures, handles) = (self.scope, &self.failures_tx, &mut self.handles);
        let shared = self.shared;
        let stream = self.streams.of(lane, group);
        self.threads.entry((lane, group)).or_insert_with(|| {
            let (to, rx) = channel::<Msg<'env>>();
            let failures = failures.clone();
            handles.push(
                scope.spawn(move || stream.executes(|| run_stages(comm, rx, failures, shared))),
            );
            Thread { to, next_seq: 0 }
        })
    }

    /// The next gathered unit (in the order the gathers were handed over), timing the wait;
    /// reduced shards that arrived meanwhile are added to `grads`.
    pub(crate) fn next_gathered(
        &mut self,
        grads: &mut [Option<Tensor<1>>],
    ) -> Result<Tensor<1>, ShardError> {
        self.collect_reduced(grads)?;
        let rx = self
            .gathered
            .pop_front()
            .expect("the schedule gathers a unit before a visit takes it");
        let t = Instant::now();
        let msg = rx.recv();
        self.waited_s += t.elapsed().as_secs_f64();
        match msg {
            Ok(gathered) => gathered,
            // The job was dropped by a thread that failed: its error says why.
            Err(_) => Err(self.failure()),
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

    /// The first failure a thread reported (waiting for it if it is on its way).
    fn failure(&self) -> ShardError {
        self.failures
            .recv_timeout(std::time::Duration::from_secs(5))
            .unwrap_or_else(|_| thread_gone())
    }

    /// No more jobs: waits for the remaining reductions (adding them to `grads`, timing the
    /// wait) and for every thread to end.
    pub(crate) fn finish(self, grads: &mut [Option<Tensor<1>>]) -> Result<f64, ShardError> {
        let Worker {
            threads,
            handles,
            reduced_tx,
            reduced,
            failures_tx,
            failures,
            mut waited_s,
            ..
        } = self;
        // Threads end once every job queued on them is done and no sender is left.
        drop(threads);
        drop(reduced_tx);
        drop(failures_tx);
        let t = Instant::now();
        let mut failure = None;
        for r in reduced.iter() {
            match r {
                Ok((unit, shard)) => add_to(&mut grads[unit], shard),
                Err(e) => failure = failure.or(Some(e)),
            }
        }
        waited_s += t.elapsed().as_secs_f64();
        for h in handles {
            h.join().map_err(|_| thread_gone())?;
        }
        if let Some(e) = failures.try_iter().next().or(failure) {
            return Err(e);
        }
        Ok(waited_s)
    }
}

/// A group thread's loop: runs the stages handed to it in their sequence order, passing each
/// job on to its next stage's thread or finishing it. Stops at the first failure, reporting it.
fn run_stages<'e>(
    comm: &Comm,
    rx: Receiver<Msg<'e>>,
    failures: Sender<ShardError>,
    shared: &Shared,
) {
    raise_priority();
    let mut waiting: BTreeMap<u64, Msg<'e>> = BTreeMap::new();
    let mut next = 0u64;
    for msg in rx {
        waiting.insert(msg.seq, msg);
        while let Some(m) = waiting.remove(&next) {
            next += 1;
            let Msg {
                name,
                carry,
                stage,
                mut rest,
                finish,
                ..
            } = m;
            let start = Instant::now();
            let done = stage(comm, carry);
            shared.record(name, start);
            let done = done.and_then(|carry| match rest.pop_front() {
                Some(n) => {
                    let _ = n.to.send(Msg {
                        seq: n.seq,
                        name: n.name,
                        carry,
                        stage: n.stage,
                        rest,
                        finish,
                    });
                    Ok(())
                }
                None => finish(carry),
            });
            if let Err(e) = done {
                let _ = failures.send(e);
                return;
            }
        }
    }
}

fn thread_gone() -> ShardError {
    ShardError::Model("a communication thread stopped unexpectedly".into())
}

/// Lets this thread run before compute threads when it wakes: a collective's step waits for
/// its slowest member to poll, and on cores shared by many ranks a poll otherwise waits behind
/// their compute for a scheduler time slice. Best effort: without the privilege to lower the
/// nice value (root or CAP_SYS_NICE), the thread keeps the default priority.
fn raise_priority() {
    // SAFETY: gettid and setpriority have no memory preconditions; they only act on this
    // thread's scheduling.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, COMM_NICE);
    }
}

/// The nice value of the communication threads.
const COMM_NICE: i32 = -10;
