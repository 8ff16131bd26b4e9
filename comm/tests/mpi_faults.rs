//! Fault handling under real `mpirun`: a panicking rank, a killed rank and a collective that
//! waits past the timeout (on one group or over a path of hops) must each end
//! the whole job promptly, with a message that says why; a job that hangs where no timeout
//! of the library fires ends at the tests' own limit, saying where every rank was.

mod common;

use std::time::{Duration, Instant};

use common::*;
use ember_comm::{Reduce, Scope};

/// Runs `name` on 4 ranks (2x2x1) and returns (success, seconds, stderr + stdout).
fn run_failing(name: &str) -> (bool, f64, String) {
    let start = Instant::now();
    let out = mpirun(name, 4, "2x2x1", Duration::from_secs(90), &[]);
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    (out.status.success(), start.elapsed().as_secs_f64(), text)
}

#[test]
fn a_panic_in_one_rank_ends_the_job_promptly() {
    if !is_child() {
        let (ok, secs, text) = run_failing("a_panic_in_one_rank_ends_the_job_promptly");
        assert!(!ok, "the job must fail\n{text}");
        assert!(secs < 60.0, "took {secs:.1} s\n{text}");
        assert!(text.contains("rank 2 panicked"), "{text}");
        return;
    }
    // A long timeout: only the panic hook may end this job.
    let comm = child_comm_with(Duration::from_secs(600));
    if comm.rank() == 2 {
        panic!("deliberate panic in rank 2");
    }
    let _ = comm.world().all_reduce(&[1.0f32; 16], Reduce::Sum);
    unreachable!("rank 2 never joins");
}

#[test]
fn a_killed_rank_ends_the_job_promptly() {
    if !is_child() {
        let (ok, secs, text) = run_failing("a_killed_rank_ends_the_job_promptly");
        assert!(!ok, "the job must fail\n{text}");
        assert!(secs < 60.0, "took {secs:.1} s\n{text}");
        return;
    }
    let comm = child_comm_with(Duration::from_secs(600));
    if comm.rank() == 1 {
        let pid = std::process::id().to_string();
        // SIGKILL: no hook, no unwinding, exactly what a crashed node looks like to MPI.
        let _ = std::process::Command::new("kill")
            .args(["-9", &pid])
            .status();
        std::thread::sleep(Duration::from_secs(60));
    }
    let _ = comm.world().all_gather(&[1u8; 8]);
    unreachable!("rank 1 never joins");
}

#[test]
fn a_collective_past_the_timeout_aborts_naming_op_level_and_rank() {
    if !is_child() {
        let (ok, secs, text) =
            run_failing("a_collective_past_the_timeout_aborts_naming_op_level_and_rank");
        assert!(!ok, "the job must fail\n{text}");
        assert!(secs < 45.0, "took {secs:.1} s\n{text}");
        assert!(
            text.contains("rank 1: reduce_scatter on level within-gpu waited longer than"),
            "{text}"
        );
        return;
    }
    let comm = child_comm_with(Duration::from_secs(2));
    if comm.rank() == 0 {
        std::thread::sleep(Duration::from_secs(60));
    }
    // Rank 1 waits for rank 0 in their node's group; ranks 2 and 3 finish theirs and idle
    // outside MPI, so rank 1's watchdog is the only one that can fire.
    let _ = comm
        .group(Scope::Within(1))
        .reduce_scatter(&[1.0f32; 64], Reduce::Sum);
    std::thread::sleep(Duration::from_secs(60));
    unreachable!("rank 0 never joins in time");
}

#[test]
fn a_path_collective_past_the_timeout_aborts_naming_op_and_scope() {
    if !is_child() {
        let (ok, secs, text) =
            run_failing("a_path_collective_past_the_timeout_aborts_naming_op_and_scope");
        assert!(!ok, "the job must fail\n{text}");
        assert!(secs < 45.0, "took {secs:.1} s\n{text}");
        // Rank 2 waits for rank 0 on the outer hop (across-node, all-gathers go outermost
        // first), ranks 1 and 3 then on the inner one (across-gpu): whichever watchdog fires
        // first names its hop.
        assert!(
            [
                ": all_gather on level across-node waited longer than",
                ": all_gather on level across-gpu waited longer than"
            ]
            .iter()
            .any(|m| text.contains(m)),
            "{text}"
        );
        return;
    }
    let comm = child_comm_with(Duration::from_secs(2));
    if comm.rank() == 0 {
        std::thread::sleep(Duration::from_secs(60));
    }
    // Two hops that move data on 2x2x1 (gpu, node).
    let path = ember_comm::Path::per_level(comm.topology());
    let _ = ember_comm::hier::all_gather_path(&comm, &[1.0f32; 64], &path);
    unreachable!("rank 0 never joins in time");
}

/// The tests' own limit (tests/support/jobs.rs), with the library's collective timeout far
/// off: a hung job ends at the limit, fails with every rank's stacks in its stderr, and leaves
/// no rank running.
#[test]
fn a_hung_job_ends_at_its_limit_with_every_ranks_stacks() {
    const NAME: &str = "a_hung_job_ends_at_its_limit_with_every_ranks_stacks";
    if !is_child() {
        let start = Instant::now();
        let out = mpirun(NAME, 2, "2x1x1", Duration::from_secs(8), &[]);
        let secs = start.elapsed().as_secs_f64();
        let text = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(jobs::TIMED_OUT), "{text}");
        assert!(text.contains("ran past its 8 s limit"), "{text}");
        // mpirun and both ranks, each rank's threads by name (the test's thread is named
        // after the test, cut to Linux's 15 characters).
        assert!(text.matches("\n---- process ").count() >= 3, "{text}");
        assert!(text.matches(&NAME[..15]).count() >= 2, "{text}");
        if gdb() {
            // Rank 0 inside the all-reduce rank 1 never joins, rank 1 in its sleep.
            assert!(text.contains("all_reduce"), "{text}");
            assert!(text.contains("sleep"), "{text}");
        }
        // Reading the stacks, TERM, and KILL 5 s after.
        assert!(secs < 60.0, "took {secs:.1} s\n{text}");
        let left: Vec<_> = std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|&pid| {
                pid != std::process::id()
                    && std::fs::read(format!("/proc/{pid}/cmdline"))
                        .is_ok_and(|c| c.windows(NAME.len()).any(|w| w == NAME.as_bytes()))
            })
            .collect();
        assert!(left.is_empty(), "ranks still running: {left:?}");
        return;
    }
    let comm = child_comm_with(Duration::from_secs(600));
    if comm.rank() == 1 {
        std::thread::sleep(Duration::from_secs(600));
    }
    let _ = comm.world().all_reduce(&[1.0f32; 16], Reduce::Sum);
    unreachable!("rank 1 never joins");
}

/// Whether `gdb` runs here (the stacks then hold frames, not only thread names).
fn gdb() -> bool {
    std::process::Command::new("gdb")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}
