//! Shared by the MPI integration tests: launching this test binary under `mpirun`, and the
//! deterministic per-rank inputs every rank can regenerate for its sequential reference.
//! It deliberately contains no assertions about collectives.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ember_comm::{Bf16, Comm, CommConfig, PanicPolicy, Topology, TopologySource};

#[path = "../../tests/support/jobs.rs"]
pub mod jobs;

/// Set in the ranks' environment: run the MPI body instead of launching.
pub const CHILD_ENV: &str = "EMBER_MPI_CHILD";
/// The topology the ranks should use.
pub const TOPOLOGY_ENV: &str = "EMBER_TEST_TOPOLOGY";

/// The topologies every collective is checked at: one rank, each level alone, and mixes.
pub const TOPOLOGIES: [&str; 6] = ["1", "2x1x1", "1x2x2", "2x2x2", "2x4x1", "4x1x2"];

/// True inside an `mpirun`-launched rank.
pub fn is_child() -> bool {
    std::env::var_os(CHILD_ENV).is_some()
}

/// One `mpirun` at a time per test binary: the test harness runs tests on several threads, and
/// concurrent launchers race to create Open MPI's session directory (`/tmp/ompi.HOST.UID`
/// "File exists"); eight oversubscribed ranks per job also saturate two cores on their own.
static LAUNCH: Mutex<()> = Mutex::new(());
static LAUNCHES: AtomicUsize = AtomicUsize::new(0);

/// A session directory of its own for each launch, so jobs of different test binaries or of a
/// previous crashed run never share Open MPI's temporary files either.
fn session_dir() -> PathBuf {
    let n = LAUNCHES.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("ember-mpi-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("creating the mpirun session directory");
    dir
}

/// Runs test `name` of this binary on `np` ranks under `mpirun`; a job past `limit` ends with
/// its ranks' stacks in its stderr and exit status [`jobs::TIMED_OUT`].
pub fn mpirun(
    name: &str,
    np: usize,
    topology: &str,
    limit: Duration,
    env: &[(&str, &str)],
) -> Output {
    let exe = std::env::current_exe().expect("test binary path");
    // A failed job must not poison the lock for the tests after it.
    let _one_at_a_time = LAUNCH.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = session_dir();
    let mut cmd = Command::new("mpirun");
    cmd.args(["-np", &np.to_string(), "--oversubscribe"])
        .args(["--mca", "btl_vader_single_copy_mechanism", "none"])
        .args(["--mca", "orte_tmpdir_base"])
        .arg(&tmp)
        .args([
            "-x",
            "RAYON_NUM_THREADS=1",
            "-x",
            CHILD_ENV,
            "-x",
            TOPOLOGY_ENV,
        ]);
    for (k, _) in env {
        cmd.args(["-x", k]);
    }
    cmd.arg(exe)
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .env(TOPOLOGY_ENV, topology)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .envs(env.iter().copied());
    let out = jobs::output_within(cmd, limit);
    let _ = std::fs::remove_dir_all(&tmp);
    out
}

/// Runs `name` at `topology` and fails the test with the ranks' output if the job failed.
pub fn mpirun_ok(name: &str, topology: &str) {
    let t = Topology::parse(topology).unwrap();
    let out = mpirun(
        name,
        t.world_size(),
        topology,
        Duration::from_secs(180),
        &[],
    );
    assert!(
        out.status.success(),
        "{name} at {topology} failed ({:?})\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The `Comm` of a child rank, at the topology its launcher asked for.
pub fn child_comm() -> Comm {
    child_comm_with(std::time::Duration::from_secs(120))
}

/// As [`child_comm`] with a given collective timeout.
pub fn child_comm_with(timeout: std::time::Duration) -> Comm {
    let spec = std::env::var(TOPOLOGY_ENV).expect("launcher sets the topology");
    Comm::init(CommConfig {
        topology: TopologySource::Explicit(Topology::parse(&spec).unwrap()),
        timeout,
        panic_policy: PanicPolicy::AbortJob,
        lanes: 2,
    })
    .expect("comm init")
}

/// Rank `rank`'s input element `i` as a small integer: sums over 8 ranks stay exact in f32,
/// bf16, u8 and i8, so any reduction order gives the reference bit for bit.
pub fn small(rank: usize, i: usize, salt: usize) -> i32 {
    ((rank * 131 + i * 17 + salt * 7) % 11) as i32 - 5
}

/// Rank `rank`'s f32 input of `n` elements.
pub fn f32_input(rank: usize, n: usize, salt: usize) -> Vec<f32> {
    (0..n).map(|i| small(rank, i, salt) as f32).collect()
}

/// Rank `rank`'s bf16 input of `n` elements.
pub fn bf16_input(rank: usize, n: usize, salt: usize) -> Vec<Bf16> {
    (0..n)
        .map(|i| Bf16::from_f32(small(rank, i, salt) as f32 * 0.5))
        .collect()
}

/// Rank `rank`'s u8 input of `n` elements (0..=10).
pub fn u8_input(rank: usize, n: usize, salt: usize) -> Vec<u8> {
    (0..n).map(|i| (small(rank, i, salt) + 5) as u8).collect()
}

/// Rank `rank`'s i8 input of `n` elements (-5..=5).
pub fn i8_input(rank: usize, n: usize, salt: usize) -> Vec<i8> {
    (0..n).map(|i| small(rank, i, salt) as i8).collect()
}
