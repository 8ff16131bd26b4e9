//! Shared by the tests that run ranks: this test binary started again as the ranks of one job
//! under a real `mpirun`, or as one process without it.

#![allow(dead_code)]

use std::process::Command;
use std::time::Duration;

#[path = "../../../tests/support/jobs.rs"]
pub mod jobs;

/// How long one job may run: a cold start of eight wgpu ranks on two cores, compiling every
/// kernel on lavapipe, took 28-63 s on a Zen 5 and ran past 300 s on a Sapphire Rapids (a
/// second start there, with part of the kernels cached, 181 s; 73 s at four ranks). A job past
/// this is hung, and fails with its stacks.
const LIMIT: Duration = Duration::from_secs(600);

/// Runs test `test` of this binary as `np` ranks under `mpirun` (as one process without
/// `mpirun` when `np` is 0), with `spec` in the ranks' environment variable `child`; returns
/// their standard output, after failing the test with both outputs if the job failed.
pub fn run_ranks(test: &str, child: &str, spec: &str, np: usize) -> String {
    let out = run_job(test, child, spec, np);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{spec} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// [`run_ranks`]'s job, whatever its outcome: its status and outputs. A job past [`LIMIT`] is
/// ended with its processes' stacks in its stderr and exit status [`jobs::TIMED_OUT`], so a
/// job that hangs fails the test, saying where it hung, instead of the test hanging.
pub fn run_job(test: &str, child: &str, spec: &str, np: usize) -> std::process::Output {
    let exe = std::env::current_exe().expect("test binary path");
    // A session directory of its own, so jobs of other test binaries, or of a crashed run,
    // never share Open MPI's temporary files.
    let tmp = std::env::temp_dir().join(format!(
        "ember-{test}-{}-{np}-{:x}",
        std::process::id(),
        fnv(spec)
    ));
    std::fs::create_dir_all(&tmp).expect("creating the mpirun session directory");
    let mut command = if np > 0 {
        let mut mpirun = Command::new("mpirun");
        mpirun
            .args(["-np", &np.to_string(), "--oversubscribe"])
            .args(["--mca", "btl_vader_single_copy_mechanism", "none"])
            .args(["--mca", "orte_tmpdir_base"])
            .arg(&tmp)
            .args(["-x", "RAYON_NUM_THREADS=1", "-x", child])
            .arg(&exe);
        mpirun
    } else {
        Command::new(&exe)
    };
    command
        .args(["--exact", test, "--nocapture"])
        .env(child, spec)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    let out = jobs::output_within(command, LIMIT);
    let _ = std::fs::remove_dir_all(&tmp);
    out
}

/// The text after `key` on the first line of `stdout` that starts with it.
pub fn line<'a>(stdout: &'a str, key: &str) -> &'a str {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key} in\n{stdout}"))
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// An example run as one line for the ranks' environment: `topology|preset|steps|resume|save`
/// (an absent directory is empty).
pub fn spec(
    topology: &str,
    preset: &str,
    steps: u64,
    resume: &Option<std::path::PathBuf>,
    save: &Option<std::path::PathBuf>,
) -> String {
    let path = |p: &Option<std::path::PathBuf>| {
        p.as_ref()
            .map_or(String::new(), |p| p.display().to_string())
    };
    format!(
        "{topology}|{preset}|{steps}|{}|{}",
        path(resume),
        path(save)
    )
}

/// An example run a rank read back from [`spec`], with its communicator.
pub struct Child {
    pub comm: ember_comm::Comm,
    pub preset: String,
    pub steps: u64,
    pub resume: Option<std::path::PathBuf>,
    pub save: Option<std::path::PathBuf>,
}

/// The run of a rank started by [`run_ranks`] (from its variable `child`), with MPI set up at
/// the spec's topology; `None` in the launching test.
pub fn child(child: &str) -> Option<Child> {
    let spec = std::env::var(child).ok()?;
    let parts: Vec<&str> = spec.split('|').collect();
    let path = |s: &str| (!s.is_empty()).then(|| std::path::PathBuf::from(s));
    let topology = ember_comm::Topology::parse(parts[0]).expect("the spec's topology");
    let comm = ember_comm::Comm::init(ember_comm::CommConfig {
        topology: ember_comm::TopologySource::Explicit(topology),
        ..ember_comm::CommConfig::default()
    })
    .expect("MPI");
    Some(Child {
        comm,
        preset: parts[1].into(),
        steps: parts[2].parse().expect("the spec's steps"),
        resume: path(parts[3]),
        save: path(parts[4]),
    })
}

/// The largest relative difference between two runs' losses at the same steps.
pub fn largest_relative_difference(a: &[(u64, f64)], b: &[(u64, f64)]) -> f64 {
    assert_eq!(
        a.iter().map(|x| x.0).collect::<Vec<_>>(),
        b.iter().map(|x| x.0).collect::<Vec<_>>()
    );
    a.iter()
        .zip(b)
        .map(|((_, x), (_, y))| (x - y).abs() / x.abs())
        .fold(0.0, f64::max)
}
