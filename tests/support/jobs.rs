//! A job of the tests that launch processes (`mpirun` and its ranks, or one process), with a
//! time limit: a job past it fails its test with every one of its processes' stacks in the
//! message, then ends. Shared by the test harnesses of ember-comm, ember-sharding and the
//! `ember` binary, which include this file by path.

#![allow(dead_code)]

use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

/// The exit status of a job that ran past its limit: `timeout`'s, 124.
pub const TIMED_OUT: i32 = 124;

/// Runs `command` to its end, or for `limit` at most. A job still running at `limit` gets its
/// processes' stacks (`gdb` where it is installed, else each thread's name and kernel wait
/// channel) appended to its standard error, then TERM, and KILL for whatever is left 5 s
/// later; its status then reads [`TIMED_OUT`].
pub fn output_within(mut command: Command, limit: Duration) -> Output {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "starting {:?}: {e} (for mpirun: is openmpi-bin installed?)",
                command.get_program()
            )
        });
    let stdout = drain(child.stdout.take().expect("piped stdout"));
    let stderr = drain(child.stderr.take().expect("piped stderr"));
    let start = Instant::now();
    let (status, stacks) = loop {
        if let Some(status) = child.try_wait().expect("waiting for the job") {
            break (status, String::new());
        }
        if start.elapsed() >= limit {
            break take_down(&mut child, limit);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (stdout, mut stderr) = (stdout.join().unwrap(), stderr.join().unwrap());
    stderr.extend_from_slice(stacks.as_bytes());
    Output {
        status,
        stdout,
        stderr,
    }
}

/// Reads `pipe` to its end on a thread of its own (a job that fills a pipe nobody reads
/// would stop there).
fn drain(mut pipe: impl Read + Send + 'static) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        bytes
    })
}

/// Ends a job that ran past `limit`, its stacks read first; returns [`TIMED_OUT`] and the
/// stacks.
fn take_down(child: &mut Child, limit: Duration) -> (ExitStatus, String) {
    let pids = descendants(child.id());
    let mut report = format!(
        "\n==== the job ran past its {} s limit; the stacks of its {} processes ====\n",
        limit.as_secs(),
        pids.len() + 1
    );
    for pid in std::iter::once(child.id()).chain(pids.iter().copied()) {
        report.push_str(&stacks(pid));
    }
    signal(child.id(), "TERM");
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if child.try_wait().ok().flatten().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for pid in descendants(child.id()).into_iter().chain(pids) {
        signal(pid, "KILL");
    }
    let _ = child.kill();
    let _ = child.wait();
    (ExitStatus::from_raw(TIMED_OUT << 8), report)
}

/// Every live process below `root`, from each process's parent in `/proc/PID/stat`.
fn descendants(root: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            // `pid (comm) state ppid ...`, where comm may hold spaces and parentheses.
            let ppid = stat.rsplit_once(") ")?.1.split(' ').nth(1)?.parse().ok()?;
            Some((pid, ppid))
        })
        .collect();
    let mut found = vec![root];
    let mut next = 0;
    while next < found.len() {
        let parent = found[next];
        found.extend(
            parents
                .iter()
                .filter(|&&(_, ppid)| ppid == parent)
                .map(|&(pid, _)| pid),
        );
        next += 1;
    }
    found.remove(0);
    found
}

/// What process `pid` is doing, thread by thread.
fn stacks(pid: u32) -> String {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default();
    let mut out = format!("\n---- process {pid}: {}\n", cmdline.trim_end());
    let gdb = Command::new("gdb")
        .args(["-p", &pid.to_string(), "-batch", "-nx"])
        .args(["-ex", "set print frame-arguments none"])
        .args(["-ex", "thread apply all bt 24"])
        .stdin(Stdio::null())
        .output();
    match gdb {
        Ok(o) if o.status.success() && !o.stdout.is_empty() => {
            for line in String::from_utf8_lossy(&o.stdout).lines() {
                // The threads and their frames, each cut to a line's width; not gdb's
                // chatter about symbols it loaded.
                if line.starts_with("Thread ") || line.starts_with('#') {
                    out.extend(line.chars().take(220));
                    out.push('\n');
                }
            }
        }
        _ => {
            out.push_str("(no gdb: each thread's name, state and kernel wait channel)\n");
            let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
                .into_iter()
                .flatten();
            for task in tasks.flatten() {
                let read = |f: &str| {
                    std::fs::read_to_string(task.path().join(f))
                        .unwrap_or_default()
                        .trim()
                        .to_string()
                };
                let state = read("stat");
                let state = state.rsplit_once(") ").map_or("", |(_, s)| &s[..1]);
                out.push_str(&format!(
                    "  {} {:<16} {state} {}\n",
                    task.file_name().to_string_lossy(),
                    read("comm"),
                    read("wchan")
                ));
            }
        }
    }
    out
}

/// Sends signal `name` to `pid`; a process already gone is no error.
fn signal(pid: u32, name: &str) {
    let _ = Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .stderr(Stdio::null())
        .status();
}
