//! `Comm`: MPI started once, the topology resolved, and every group's communicator created
//! once at start-up; plus the per-step byte counters. It deliberately holds no collective
//! algorithms (see `collective`, `hier`, `quant`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use mpi::collective::{CommunicatorCollectives, SystemOperation, UnsafeUserOperation};
use mpi::environment::{Threading, Universe};
use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::{Color, Communicator, SimpleCommunicator};

use crate::counters::{Counters, Op, Traffic};
use crate::element::{Dtype, Element, bf16_sum};
use crate::error::CommError;
use crate::fault::{Armed, Watchdog, install_panic_hook};
use crate::topology::{Scope, Topology};

/// Environment variable read for GCDs per GPU when neither `--topology` nor a flag gives it.
pub const GCDS_PER_GPU_ENV: &str = "EMBER_GCDS_PER_GPU";

/// Default `--comm-timeout`: long enough for a first step's JIT and autotune on a slow device.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Where the topology comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TopologySource {
    /// Given explicitly (`--topology NODESxGPUSxGCDS`).
    Explicit(Topology),
    /// Nodes from `MPI_Comm_split_type(SHARED)`; GCDs per GPU from this value, else from the
    /// environment variable [`GCDS_PER_GPU_ENV`], else 1.
    Detect {
        /// GCDs per GPU from a flag, if given.
        gcds_per_gpu: Option<usize>,
    },
}

/// What to do when a rank panics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PanicPolicy {
    /// Abort the whole MPI job (the default: otherwise the other ranks hang).
    AbortJob,
    /// Leave the panic hook alone (for embedding in a program with its own hook).
    KeepHook,
}

/// How to start communication. Plain data; `Comm::init` validates it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommConfig {
    /// Where the topology comes from.
    pub topology: TopologySource,
    /// A collective waiting longer than this aborts the job (`--comm-timeout`).
    pub timeout: Duration,
    /// What a panic in this rank does.
    pub panic_policy: PanicPolicy,
}

impl Default for CommConfig {
    fn default() -> Self {
        Self {
            topology: TopologySource::Detect { gcds_per_gpu: None },
            timeout: DEFAULT_TIMEOUT,
            panic_policy: PanicPolicy::AbortJob,
        }
    }
}

/// The communication context of one rank: MPI, the topology and one communicator per scope.
///
/// Create exactly one per process; dropping it finalises MPI.
pub struct Comm {
    // Declaration order is drop order: communicators and the user op must be freed before
    // `universe` finalises MPI.
    within: Vec<SimpleCommunicator>,
    across: Vec<SimpleCommunicator>,
    bf16_sum: UnsafeUserOperation,
    watchdog: Watchdog,
    // True while the panic hook may call MPI_Abort; cleared before MPI is finalised.
    panic_hook_live: Option<Arc<AtomicBool>>,
    counters: Mutex<Counters>,
    topology: Topology,
    rank: usize,
    world: SimpleCommunicator,
    _universe: Universe,
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm")
            .field("topology", &self.topology.to_string())
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

/// A handle on one group's communicator; collectives are its methods (see `collective`).
#[derive(Clone, Copy)]
pub struct Group<'c> {
    pub(crate) comm: &'c Comm,
    pub(crate) scope: Scope,
    pub(crate) raw: ffi::MPI_Comm,
    pub(crate) size: usize,
    pub(crate) index: usize,
}

impl std::fmt::Debug for Group<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("scope", &self.scope)
            .field("size", &self.size)
            .field("index", &self.index)
            .finish()
    }
}

impl Comm {
    /// Starts MPI (with `MPI_THREAD_MULTIPLE`, so the watchdog may abort from its thread),
    /// resolves the topology and creates every group's communicator.
    pub fn init(config: CommConfig) -> Result<Self, CommError> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| {
                CommError::Unsupported(
                    "MPI is already initialised: create exactly one Comm per process".into(),
                )
            })?;
        if threading != Threading::Multiple {
            // The abort still works with OpenMPI, but the standard does not promise it.
            eprintln!(
                "ember-comm: MPI provides {threading:?} threading, not Multiple; \
                 timeout aborts from the watchdog thread rely on the implementation"
            );
        }
        let world = universe.world();
        let rank = world.rank() as usize;
        let world_size = world.size() as usize;
        let topology = match config.topology {
            TopologySource::Explicit(t) => t,
            TopologySource::Detect { gcds_per_gpu } => detect(&world, gcds_per_gpu)?,
        };
        topology.check_world(world_size)?;
        let split = |scope: Scope| {
            let (color, index) = topology.color_and_index(scope, rank);
            world
                .split_by_color_with_key(Color::with_value(color as i32), index as i32)
                .expect("every rank passes a defined colour")
        };
        let within = (0..topology.depth())
            .map(|i| split(Scope::Within(i)))
            .collect();
        let across = (0..topology.depth())
            .map(|i| split(Scope::Across(i)))
            .collect();
        // SAFETY: `bf16_sum` reads and writes exactly `len` u16 values, never panics, and is
        // commutative and associative up to rounding (as MPI_SUM on floats is).
        let bf16_sum = unsafe { UnsafeUserOperation::commutative(bf16_sum) };
        let panic_hook_live = match config.panic_policy {
            PanicPolicy::AbortJob => Some(install_panic_hook(rank)),
            PanicPolicy::KeepHook => None,
        };
        Ok(Self {
            within,
            across,
            bf16_sum,
            watchdog: Watchdog::start(rank, &topology, config.timeout),
            panic_hook_live,
            counters: Mutex::new(Counters::default()),
            topology,
            rank,
            world,
            _universe: universe,
        })
    }

    /// This rank's number in the world.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The resolved topology.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The group of `scope` that contains this rank. Panics on a level the topology lacks.
    pub fn group(&self, scope: Scope) -> Group<'_> {
        let comm = match scope {
            Scope::World => &self.world,
            Scope::Within(i) => &self.within[i],
            Scope::Across(i) => &self.across[i],
        };
        Group {
            comm: self,
            scope,
            raw: comm.as_raw(),
            size: comm.size() as usize,
            index: comm.rank() as usize,
        }
    }

    /// The world group.
    pub fn world(&self) -> Group<'_> {
        self.group(Scope::World)
    }

    /// The rsmpi communicator of `scope`, for callers that need a raw MPI call (the benchmark).
    pub fn raw(&self, scope: Scope) -> &SimpleCommunicator {
        match scope {
            Scope::World => &self.world,
            Scope::Within(i) => &self.within[i],
            Scope::Across(i) => &self.across[i],
        }
    }

    /// A copy of the counters since the last reset.
    pub fn counters(&self) -> Counters {
        self.lock_counters().clone()
    }

    /// Returns the counters and resets them (call once per step).
    pub fn take_counters(&self) -> Counters {
        std::mem::take(&mut *self.lock_counters())
    }

    /// Blocks until every rank of the world arrives (not counted: it moves no payload).
    pub fn barrier(&self) {
        // Charged to nothing, but watched like an all-reduce of the world (what it is).
        let _armed = self.watchdog.arm(Op::AllReduce, Scope::World);
        self.world.barrier();
    }

    /// Runtime of MPI's wall clock, identical in meaning on every rank.
    pub fn wtime(&self) -> f64 {
        mpi::time()
    }

    /// The element-wise sum for `T` (MPI_SUM, or our bf16 operation).
    pub(crate) fn sum_op<T: Element>(&self) -> ffi::MPI_Op {
        match T::DTYPE {
            Dtype::Bf16 => self.bf16_sum.as_raw(),
            Dtype::F32 | Dtype::U8 | Dtype::I8 => SystemOperation::sum().as_raw(),
        }
    }

    pub(crate) fn charge(&self, scope: Scope, op: Op, traffic: Traffic) {
        self.lock_counters().add(scope, op, traffic);
    }

    pub(crate) fn arm(&self, op: Op, scope: Scope) -> Armed<'_> {
        self.watchdog.arm(op, scope)
    }

    fn lock_counters(&self) -> MutexGuard<'_, Counters> {
        self.counters.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // After this MPI is finalised: a later panic must not call MPI_Abort.
        if let Some(live) = &self.panic_hook_live {
            live.store(false, Ordering::SeqCst);
        }
    }
}

/// Detects nodes from shared memory and checks that node-local ranks are numbered
/// consecutively, which the rank <-> coordinate mapping assumes.
fn detect(world: &SimpleCommunicator, gcds_per_gpu: Option<usize>) -> Result<Topology, CommError> {
    let rank = world.rank();
    let node = world.split_shared(rank);
    let local = node.size();
    let mut lo = 0i32;
    let mut hi = 0i32;
    node.all_reduce_into(&rank, &mut lo, SystemOperation::min());
    node.all_reduce_into(&rank, &mut hi, SystemOperation::max());
    let mut sizes = [0i32; 2];
    world.all_reduce_into(&local, &mut sizes[0], SystemOperation::min());
    world.all_reduce_into(&local, &mut sizes[1], SystemOperation::max());
    if sizes[0] != sizes[1] {
        return Err(CommError::Topology(format!(
            "nodes run between {} and {} ranks: start the same number on every node \
             or pass --topology",
            sizes[0], sizes[1]
        )));
    }
    if hi - lo + 1 != local || lo % local != 0 {
        return Err(CommError::Topology(
            "ranks of one node are not numbered consecutively: launch with \
             `mpirun --map-by slot` (or pass --topology to simulate levels)"
                .into(),
        ));
    }
    let gcds = match gcds_per_gpu {
        Some(g) => g,
        None => match std::env::var(GCDS_PER_GPU_ENV) {
            Ok(v) => v.trim().parse().map_err(|_| {
                CommError::Topology(format!(
                    "{GCDS_PER_GPU_ENV}=`{v}` is not a positive integer: set it to e.g. 2"
                ))
            })?,
            Err(_) => 1,
        },
    };
    Topology::from_counts(world.size() as usize, local as usize, gcds)
}
