//! `Comm`: MPI started once, the topology resolved, and every group's communicator created
//! once at start-up; plus the per-step byte counters. It deliberately holds no collective
//! algorithms (see `collective`, `hier`, `quantized`).
//!
//! # Invariants
//!
//! - One communicator per distinct group: every level range `lo..hi` (`Topology::scopes`, 6 on
//!   three levels) is split once in [`Comm::init`]; any spelling of a scope is normalised by
//!   `Topology::canonical` first, so `Within(0)` and `Across(0)` are the same communicator and
//!   the same counter key. `Span{0, depth}` is the world communicator itself.
//! - MPI runs with `MPI_THREAD_MULTIPLE` (refused otherwise), which is what makes `Comm`
//!   `Sync` (see the `unsafe impl` on `Core`); it is not `Send`, so MPI is finalised on the
//!   thread that started it.

use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use mpi::collective::{CommunicatorCollectives, SystemOperation};
use mpi::environment::{Threading, Universe};
use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::{Color, Communicator, SimpleCommunicator};

use crate::counters::{Counters, Op, Traffic};
use crate::error::CommError;
use crate::fault::{Armed, Watchdog, install_panic_hook};
use crate::topology::{Scope, Topology};

/// Environment variable read for GCDs per GPU when neither an explicit topology nor the
/// caller gives it.
pub const GCDS_PER_GPU_ENV: &str = "EMBER_GCDS_PER_GPU";

/// Environment variable read for the topology (`NODESxGPUSxGCDS`, as `Topology::parse` reads
/// it) by [`Comm::from_env`].
pub const TOPOLOGY_ENV: &str = "EMBER_TOPOLOGY";

/// Default collective timeout: long enough for a first step's JIT and autotune on a slow device.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Bytes of a failing rank's message that [`Comm::agree`] hands to every rank.
pub const AGREE_MESSAGE_BYTES: usize = 1000;

/// The failure a rank reported to [`Comm::agree`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Disagreement {
    /// The lowest rank that failed.
    pub rank: usize,
    /// Its message (cut to [`AGREE_MESSAGE_BYTES`]).
    pub message: String,
}

/// Where the topology comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TopologySource {
    /// Given explicitly (e.g. parsed from `NODESxGPUSxGCDS`).
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
    /// A collective waiting longer than this aborts the job.
    pub timeout: Duration,
    /// What a panic in this rank does.
    pub panic_policy: PanicPolicy,
    /// Independent sets of communicators (see [`Comm::lane`]), for threads that run
    /// collectives on the same groups at the same time. The default, 3, is one for the caller
    /// and one each for a thread of gathers and a thread of reductions.
    pub lanes: usize,
}

impl Default for CommConfig {
    fn default() -> Self {
        Self {
            topology: TopologySource::Detect { gcds_per_gpu: None },
            timeout: DEFAULT_TIMEOUT,
            panic_policy: PanicPolicy::AbortJob,
            lanes: 3,
        }
    }
}

/// The communication context of one rank: MPI, the topology and one communicator per scope.
///
/// Create exactly one per process with [`Comm::init`]; dropping the last handle finalises MPI.
/// It is `Sync`: threads may share `&Comm` (MPI runs with `MPI_THREAD_MULTIPLE`), but
/// collectives on one group must still be issued in the same order on every rank, so two
/// threads must not race collectives on the same group. Threads that need the same groups at
/// once take separate lanes ([`Comm::lane`]): duplicated communicators, matched separately.
pub struct Comm {
    core: Arc<Core>,
    /// The set of communicators this handle's groups use (0 for the handle `init` returns).
    lane: usize,
    // Not `Send` (but `Sync`): MPI is finalised where the last handle drops, which should be
    // the thread that initialised it (MPI 4.0 section 11.2.1).
    _not_send: PhantomData<MutexGuard<'static, ()>>,
}

// `Comm` must be shareable with communication threads and with callers' threads.
const _: fn() = || {
    fn assert_sync<T: Sync>() {}
    assert_sync::<Comm>();
};

/// Everything MPI-related a rank holds, shared by every lane's handle.
pub(crate) struct Core {
    // Declaration order is drop order: communicators and the user op must be freed before
    // `universe` finalises MPI.
    /// Per lane, one communicator per level range; lane 0's world is `world` itself.
    lanes: Vec<BTreeMap<(usize, usize), SimpleCommunicator>>,
    watchdog: Watchdog,
    // True while the panic hook may call MPI_Abort; cleared before MPI is finalised.
    panic_hook_live: Option<Arc<AtomicBool>>,
    counters: Mutex<Counters>,
    topology: Topology,
    rank: usize,
    /// Ranks sharing this rank's memory.
    node_ranks: usize,
    world: SimpleCommunicator,
    /// What the MPI library said of GPU memory at start-up.
    device_memory: crate::device_memory::DeviceMemorySupport,
    _universe: Universe,
}

// SAFETY: the fields that are not `Send`/`Sync` are MPI handles (communicators, the user op):
// plain integers or pointers into the MPI library that our code never dereferences, only passes
// to MPI calls. `Comm::init` refuses to run unless MPI grants `MPI_THREAD_MULTIPLE`, under which
// every MPI call may be made from any thread concurrently (MPI 4.0 section 11.6). The handles are
// freed only in `Drop`, which runs once, when the last `Comm` handle (all of them `!Send`, so on
// the initialising thread) lets go. Counters are behind a mutex; the rest is immutable after
// `init`.
unsafe impl Send for Core {}
// SAFETY: as for `Send`.
unsafe impl Sync for Core {}

impl Drop for Core {
    fn drop(&mut self) {
        // After this MPI is finalised: a later panic must not call MPI_Abort.
        if let Some(live) = &self.panic_hook_live {
            live.store(false, Ordering::SeqCst);
        }
    }
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm")
            .field("topology", &self.core.topology.to_string())
            .field("rank", &self.core.rank)
            .field("lane", &self.lane)
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
    /// MPI as `mpirun` started this process, or a world of one without it, with every other
    /// setting at its default: the topology from [`TOPOLOGY_ENV`] when it is set
    /// (`mpirun -x EMBER_TOPOLOGY=2x4x2`), else detected (nodes from the ranks that share
    /// memory, GCDs per GPU from [`GCDS_PER_GPU_ENV`] or 1).
    pub fn from_env() -> Result<Self, CommError> {
        let topology = match std::env::var(TOPOLOGY_ENV) {
            Ok(spec) => TopologySource::Explicit(
                Topology::parse(&spec)
                    .map_err(|e| CommError::Topology(format!("{TOPOLOGY_ENV}={spec}: {e}")))?,
            ),
            Err(_) => TopologySource::Detect { gcds_per_gpu: None },
        };
        Self::init(CommConfig {
            topology,
            ..CommConfig::default()
        })
    }

    /// Starts MPI (with `MPI_THREAD_MULTIPLE`: the watchdog aborts from its thread and
    /// communication threads issue collectives), resolves the topology and creates every
    /// group's communicator, once per lane.
    pub fn init(config: CommConfig) -> Result<Self, CommError> {
        if config.lanes == 0 {
            return Err(CommError::Unsupported(
                "CommConfig::lanes must be at least 1".into(),
            ));
        }
        let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| {
                CommError::Unsupported(
                    "MPI is already initialised: create exactly one Comm per process".into(),
                )
            })?;
        if threading != Threading::Multiple {
            // Without it, communication and watchdog threads calling MPI would be undefined
            // behaviour, and `Comm: Sync` would be unsound.
            return Err(CommError::Unsupported(format!(
                "MPI provides {threading:?} threading, but ember-comm needs Multiple (its \
                 watchdog and communication threads call MPI from other threads): use an MPI \
                 built with thread support (Open MPI >= 3 and MPICH have it by default)"
            )));
        }
        let world = universe.world();
        let rank = world.rank() as usize;
        let world_size = world.size() as usize;
        // The ranks sharing this rank's memory, whatever the topology says (a pre-flight
        // memory check needs the real count).
        let node_ranks = world.split_shared(world.rank()).size() as usize;
        let topology = match config.topology {
            TopologySource::Explicit(t) => t,
            TopologySource::Detect { gcds_per_gpu } => detect(&world, gcds_per_gpu)?,
        };
        topology.check_world(world_size)?;
        let depth = topology.depth();
        let mut lanes: Vec<BTreeMap<(usize, usize), SimpleCommunicator>> =
            (0..config.lanes).map(|_| BTreeMap::new()).collect();
        for scope in topology.scopes() {
            let bounds = topology.bounds(scope);
            if bounds == (0, depth) {
                // Lane 0's world is `world` itself; other lanes get duplicates.
                for map in lanes.iter_mut().skip(1) {
                    map.insert(bounds, world.duplicate());
                }
                continue;
            }
            let (color, index) = topology.color_and_index(scope, rank);
            let split = world
                .split_by_color_with_key(Color::with_value(color as i32), index as i32)
                .ok_or_else(|| {
                    CommError::Topology(format!(
                        "MPI_Comm_split for {} gave no communicator",
                        topology.scope_name(scope)
                    ))
                })?;
            for map in lanes.iter_mut().skip(1) {
                map.insert(bounds, split.duplicate());
            }
            lanes[0].insert(bounds, split);
        }
        let panic_hook_live = match config.panic_policy {
            PanicPolicy::AbortJob => Some(install_panic_hook(rank)),
            PanicPolicy::KeepHook => None,
        };
        Ok(Self {
            core: Arc::new(Core {
                lanes,
                watchdog: Watchdog::start(rank, &topology, config.timeout),
                panic_hook_live,
                counters: Mutex::new(Counters::default()),
                topology,
                rank,
                node_ranks,
                world,
                device_memory: crate::device_memory::DeviceMemorySupport::query(),
                _universe: universe,
            }),
            lane: 0,
            _not_send: PhantomData,
        })
    }

    /// A handle on lane `lane` (below [`CommConfig::lanes`]): the same ranks, topology, counters
    /// and timeout, but every group on its own duplicated communicator, so a thread can run
    /// collectives on groups another thread is using at the same time.
    pub fn lane(&self, lane: usize) -> Result<Comm, CommError> {
        if lane >= self.core.lanes.len() {
            return Err(CommError::Unsupported(format!(
                "lane {lane} of a Comm started with {} lane(s): raise CommConfig::lanes",
                self.core.lanes.len()
            )));
        }
        Ok(Comm {
            core: Arc::clone(&self.core),
            lane,
            _not_send: PhantomData,
        })
    }

    /// How many lanes [`Comm::init`] created.
    pub fn lanes(&self) -> usize {
        self.core.lanes.len()
    }

    /// This rank's number in the world.
    pub fn rank(&self) -> usize {
        self.core.rank
    }

    /// How many ranks of the job share this rank's machine (its shared-memory domain).
    pub fn ranks_on_this_node(&self) -> usize {
        self.core.node_ranks
    }

    /// The resolved topology.
    pub fn topology(&self) -> &Topology {
        &self.core.topology
    }

    /// What the MPI library said at start-up of taking GPU memory as message buffers.
    pub fn device_memory(&self) -> &crate::device_memory::DeviceMemorySupport {
        &self.core.device_memory
    }

    /// The MPI library's name and version (`MPI_Get_library_version` up to its first comma or
    /// line end, e.g. `Open MPI v4.1.4`).
    pub fn library_version(&self) -> String {
        mpi::environment::library_version()
            .ok()
            .and_then(|v| {
                let first = v.lines().next()?.split(',').next()?;
                let words: Vec<&str> = first.split_whitespace().collect();
                (!words.is_empty()).then(|| words.join(" "))
            })
            .unwrap_or_else(|| "an MPI library that does not name itself".into())
    }

    /// The group of `scope` that contains this rank (any spelling; the group reports the
    /// canonical one). Refuses a scope naming levels the topology lacks.
    pub fn try_group(&self, scope: Scope) -> Result<Group<'_>, CommError> {
        let comm = self.communicator(scope)?;
        Ok(Group {
            comm: self,
            scope: self.core.topology.canonical(scope),
            raw: comm.as_raw(),
            size: comm.size() as usize,
            index: comm.rank() as usize,
        })
    }

    /// The group of `scope` that contains this rank. Panics on a level the topology lacks
    /// (use [`Comm::try_group`] for scopes built from user input).
    pub fn group(&self, scope: Scope) -> Group<'_> {
        self.try_group(scope).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The world group.
    pub fn world(&self) -> Group<'_> {
        self.group(Scope::World)
    }

    /// The rsmpi communicator of `scope`, for callers that need a raw MPI call (the benchmark).
    /// Panics on a level the topology lacks.
    pub fn raw(&self, scope: Scope) -> &SimpleCommunicator {
        self.communicator(scope).unwrap_or_else(|e| panic!("{e}"))
    }

    fn communicator(&self, scope: Scope) -> Result<&SimpleCommunicator, CommError> {
        let topology = &self.core.topology;
        topology.check_scope(scope)?;
        let bounds = topology.bounds(scope);
        let found = if self.lane == 0 && bounds == (0, topology.depth()) {
            Some(&self.core.world)
        } else {
            self.core.lanes[self.lane].get(&bounds)
        };
        // `init` created one communicator per valid level range, so this cannot miss.
        found.ok_or_else(|| {
            CommError::Topology(format!(
                "no communicator for {}: Comm::init creates one per level range",
                topology.scope_name(scope)
            ))
        })
    }

    /// A copy of the counters since the last reset.
    pub fn counters(&self) -> Counters {
        self.lock_counters().clone()
    }

    /// Returns the counters and resets them (call once per step). Collectives charge as they
    /// run, so let other threads' collectives finish first.
    pub fn take_counters(&self) -> Counters {
        std::mem::take(&mut *self.lock_counters())
    }

    /// Blocks until every rank of the world arrives (not counted: it moves no payload).
    pub fn barrier(&self) {
        // Charged to nothing, but watched like an all-reduce of the world (what it is).
        let _armed = self.arm(Op::AllReduce, Scope::World);
        self.raw(Scope::World).barrier();
    }

    /// Every rank reports whether its part of a collective phase (opening a file, reading its
    /// ranges, writing its shard) succeeded: `failure` is its error message, or `None`. Returns
    /// `Ok` on every rank when every rank succeeded, else, on every rank, the lowest failing
    /// rank and its message (up to [`AGREE_MESSAGE_BYTES`] bytes of it). Every rank must call
    /// it: it is how one rank's I/O error reaches the others at once instead of leaving them
    /// waiting in the next collective.
    pub fn agree(&self, failure: Option<&str>) -> Result<(), Disagreement> {
        let mut record = [0u8; 3 + AGREE_MESSAGE_BYTES];
        if let Some(message) = failure {
            // Cut at a character boundary so the message stays valid UTF-8.
            let mut end = message.len().min(AGREE_MESSAGE_BYTES);
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            record[0] = 1;
            record[1..3].copy_from_slice(&(end as u16).to_le_bytes());
            record[3..3 + end].copy_from_slice(&message.as_bytes()[..end]);
        }
        let all = if self.topology().world_size() == 1 {
            record.to_vec()
        } else {
            self.world()
                .all_gather(&record)
                .expect("one fixed-size record per rank")
        };
        match all
            .chunks_exact(record.len())
            .enumerate()
            .find(|(_, r)| r[0] == 1)
        {
            None => Ok(()),
            Some((rank, r)) => {
                let len = u16::from_le_bytes([r[1], r[2]]) as usize;
                Err(Disagreement {
                    rank,
                    message: String::from_utf8_lossy(&r[3..3 + len]).into_owned(),
                })
            }
        }
    }

    /// `result` on every rank once all have one ([`agree`](Self::agree) on its error's
    /// message): a failure on any rank fails every rank, this rank's own error where it failed
    /// itself, else `other_rank`'s error naming the lowest failing rank and its message.
    pub fn agreed<T, E: std::fmt::Display>(
        &self,
        result: Result<T, E>,
        other_rank: impl FnOnce(Disagreement) -> E,
    ) -> Result<T, E> {
        let mine = result.as_ref().err().map(|e| e.to_string());
        match self.agree(mine.as_deref()) {
            Ok(()) => result,
            Err(failure) if failure.rank == self.rank() => result,
            Err(failure) => Err(other_rank(failure)),
        }
    }

    /// Runtime of MPI's wall clock, identical in meaning on every rank.
    pub fn wtime(&self) -> f64 {
        mpi::time()
    }

    pub(crate) fn record_off_gpu(&self, bytes: u64, nanos: u64) {
        self.lock_counters().add_off_gpu(bytes, nanos);
    }

    pub(crate) fn charge(&self, scope: Scope, op: Op, traffic: Traffic) {
        self.lock_counters().add(scope, op, traffic);
    }

    pub(crate) fn arm(&self, op: Op, scope: Scope) -> Armed<'_> {
        self.core.watchdog.arm(op, scope)
    }

    fn lock_counters(&self) -> MutexGuard<'_, Counters> {
        self.core.counters.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Detects the topology of a job: nodes from hostnames; GPUs from shared-memory domains where
/// the launcher splits one host's ranks into several (an emulated cluster puts each GPU in a
/// network namespace of its own), else from `gcds_per_gpu`, [`GCDS_PER_GPU_ENV`] or 1 GCD per
/// GPU. Checks that every node and every GPU holds consecutive ranks, the order
/// `mpirun --map-by slot` places them in.
fn detect(world: &SimpleCommunicator, gcds_per_gpu: Option<usize>) -> Result<Topology, CommError> {
    let rank = world.rank();
    let size = world.size() as usize;
    // Every rank's hostname, as fixed-size records.
    const HOST: usize = 256;
    let mut mine = [0u8; HOST];
    let name = mpi::environment::processor_name().unwrap_or_default();
    let bytes = name.as_bytes();
    mine[..bytes.len().min(HOST)].copy_from_slice(&bytes[..bytes.len().min(HOST)]);
    let mut all = vec![0u8; HOST * size];
    world.all_gather_into(&mine[..], &mut all[..]);
    let hosts: Vec<&[u8]> = all.chunks_exact(HOST).collect();
    let per_node = consecutive_runs(&hosts).ok_or_else(|| {
        CommError::Topology(
            "the ranks of one host are not numbered consecutively, or hosts run different \
             numbers of ranks: launch with `mpirun --map-by slot` and the same number of ranks \
             per host (or give the topology explicitly)"
                .into(),
        )
    })?;
    // Shared-memory domains: consecutive and of one size too.
    let shm = world.split_shared(rank);
    let local = shm.size() as usize;
    let (mut lo, mut hi) = (0i32, 0i32);
    shm.all_reduce_into(&rank, &mut lo, SystemOperation::min());
    shm.all_reduce_into(&rank, &mut hi, SystemOperation::max());
    let mut sizes = [0i32; 2];
    world.all_reduce_into(&(local as i32), &mut sizes[0], SystemOperation::min());
    world.all_reduce_into(&(local as i32), &mut sizes[1], SystemOperation::max());
    if sizes[0] != sizes[1]
        || (hi - lo + 1) as usize != local
        || !(lo as usize).is_multiple_of(local)
    {
        return Err(CommError::Topology(
            "shared-memory domains hold different numbers of ranks, or not consecutive ones: \
             launch with `mpirun --map-by slot` (or give the topology explicitly)"
                .into(),
        ));
    }
    let gcds = if local < per_node {
        // Several memory domains under one hostname: each is a GPU.
        local
    } else {
        match gcds_per_gpu {
            Some(g) => g,
            None => match std::env::var(GCDS_PER_GPU_ENV) {
                Ok(v) => v.trim().parse().map_err(|_| {
                    CommError::Topology(format!(
                        "{GCDS_PER_GPU_ENV}=`{v}` is not a positive integer: set it to e.g. 2"
                    ))
                })?,
                Err(_) => 1,
            },
        }
    };
    Topology::from_counts(size, per_node, gcds)
}

/// The length of the runs of equal consecutive entries, when they all have one length.
fn consecutive_runs<T: PartialEq>(items: &[T]) -> Option<usize> {
    let first = items
        .iter()
        .position(|x| *x != items[0])
        .unwrap_or(items.len());
    let ok = items.len().is_multiple_of(first)
        && items.chunks(first).enumerate().all(|(i, run)| {
            run.iter().all(|x| *x == run[0])
                && items
                    .chunks(first)
                    .skip(i + 1)
                    .all(|later| later[0] != run[0])
        });
    ok.then_some(first)
}

#[cfg(test)]
mod tests {
    use super::consecutive_runs;

    #[test]
    fn hosts_must_hold_consecutive_runs_of_one_length() {
        assert_eq!(consecutive_runs(&["a", "a", "b", "b"]), Some(2));
        assert_eq!(consecutive_runs(&["a", "a", "a"]), Some(3));
        assert_eq!(consecutive_runs(&["a", "b", "a", "b"]), None);
        assert_eq!(consecutive_runs(&["a", "a", "b"]), None);
        assert_eq!(consecutive_runs(&["a", "b", "c"]), Some(1));
    }
}
