//! The emulated cluster (`ember cluster`): two nodes of one GPU of two GCD ranks, as network
//! namespaces with shaped links, running real `mpirun` jobs of the `ember` binary across them.
//! One test, in phases that share the cluster: sharded training matches one process; the bytes
//! the kernel counted on the GPU links and node uplinks match `ember plan`'s; a node uplink
//! taken down mid-run ends every rank within `--comm-timeout` + 10 s, naming the ranks it
//! cannot reach, and the last checkpoint resumes once the link is back; under `ember launch`
//! the same cut restarts the job by itself on the node left, which finishes it; `ember
//! cluster down` leaves nothing behind.
//!
//! It needs root and network namespaces (`ip netns`); where they cannot be made it says so in
//! one line and checks nothing else.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use ember_train::files::metrics::read_metrics;

/// The cluster's name prefix: distinct from the default, so a user's cluster is left alone.
const PREFIX: &str = "embt";
/// The parity tolerance of `tests/sharded.rs` (its module doc gives the reasoning).
const PARITY_TOL: f64 = 2e-5;
/// Measured interface bytes over the plan's payload: TCP/IP headers and acknowledgements add
/// a few percent (measured 0.98-1.06 on the links of `ember bench shard`).
const WIRE_OVER_PAYLOAD: (f64, f64) = (0.9, 1.2);

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_ember")
}

fn cache_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("ember-cache")
}

fn ember(args: &[&str]) -> Output {
    Command::new("timeout")
        .args(["--kill-after=5", "600", exe()])
        .args(args)
        .env("EMBER_CACHE_DIR", cache_dir())
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .expect("running ember")
}

fn ok(args: &[&str]) -> Output {
    let out = ember(args);
    assert!(
        out.status.success(),
        "ember {args:?} failed ({:?}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `ember cluster run` with the cache directory passed to the ranks.
fn on_cluster(args: &[&str]) -> Vec<String> {
    let mut all: Vec<String> = ["cluster", "run", "--prefix", PREFIX]
        .iter()
        .map(|s| s.to_string())
        .collect();
    all.extend(["--mpi=-x".to_string(), "--mpi=EMBER_CACHE_DIR".to_string()]);
    all.push("--".into());
    all.push("ember".into());
    all.extend(args.iter().map(|s| s.to_string()));
    all
}

/// Removes the cluster when the test ends, however it ends.
struct Cluster;

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "set", &format!("{PREFIX}-n1u"), "up"])
            .output();
        let _ = ember(&["cluster", "down", "--prefix", PREFIX]);
    }
}

/// Why namespaces cannot be made here, if they cannot.
fn no_namespaces() -> Option<String> {
    let probe = format!("{PREFIX}-probe");
    match Command::new("ip").args(["netns", "add", &probe]).output() {
        Ok(o) if o.status.success() => {
            let _ = Command::new("ip")
                .args(["netns", "delete", &probe])
                .output();
            None
        }
        Ok(o) => Some(String::from_utf8_lossy(&o.stderr).trim().to_string()),
        Err(e) => Some(format!("ip: {e}")),
    }
}

fn losses(dir: &Path) -> Vec<f64> {
    read_metrics(&dir.join("metrics.jsonl"))
        .unwrap()
        .iter()
        .map(|m| m.loss)
        .collect()
}

/// Rank processes of a training run writing to `out` (not the launchers).
fn ranks_alive(out: &Path) -> usize {
    let mut n = 0;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(cmd) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmd
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let is_rank = args.first().is_some_and(|a| a.ends_with("/ember"))
            && args.get(1).is_some_and(|a| a == "train")
            && args.iter().any(|a| a == &out.display().to_string());
        n += usize::from(is_rank);
    }
    n
}

#[test]
fn an_emulated_cluster_trains_counts_its_links_survives_a_link_down_and_cleans_up() {
    if let Some(why) = no_namespaces() {
        eprintln!("skipping the emulated cluster: network namespaces unavailable here ({why})");
        return;
    }
    let guard = Cluster;
    let up = ok(&[
        "cluster",
        "up",
        "--prefix",
        PREFIX,
        "--topology",
        "2x1x2",
        "--gpu-link",
        "400",
        "--uplink",
        "200",
        "--calibrate",
        "tiny",
    ]);
    let state = Path::new("/run/ember-cluster").join(PREFIX);
    assert!(state.join("profile.toml").exists(), "{up:?}");
    let tmp = tempfile::tempdir().unwrap();

    // Parity: zero3 over the two nodes against one process, at the same global batch.
    let one = tmp.path().join("one");
    let common = [
        "--preset",
        "tiny",
        "--max-iters",
        "8",
        "--log-interval",
        "1",
        "--eval-interval",
        "0",
        "--save-interval",
        "0",
    ];
    let mut args = vec!["train", "--out-dir", one.to_str().unwrap()];
    args.extend(common);
    ok(&args);
    let sharded = tmp.path().join("sharded");
    let mut args = vec![
        "train",
        "--shard",
        "zero3",
        "--out-dir",
        sharded.to_str().unwrap(),
    ];
    args.extend(common);
    let args = on_cluster(&args);
    ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let (a, b) = (losses(&one), losses(&sharded));
    assert_eq!(a.len(), 8);
    for (step, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= PARITY_TOL,
            "step {step}: one process {x}, zero3 on the cluster {y}"
        );
    }

    // The kernel's interface counters against the plan's bytes per link.
    let args = on_cluster(&[
        "bench",
        "shard",
        "--preset",
        "tiny",
        "--shards",
        "zero3,hier3",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--json",
    ]);
    let out = ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert_eq!(rows.len(), 2, "{}", String::from_utf8_lossy(&out.stdout));
    for row in &rows {
        let (measured, predicted) = (&row["link_bytes_measured"], &row["link_bytes_predicted"]);
        for level in ["gpu", "node"] {
            let m = measured[level].as_f64().unwrap();
            let p = predicted[level].as_f64().unwrap();
            let r = m / p;
            assert!(
                p > 0.0 && (WIRE_OVER_PAYLOAD.0..=WIRE_OVER_PAYLOAD.1).contains(&r),
                "{}: {level} links measured {m} B/step, plan {p}: {r:.3}",
                row["shard"]
            );
        }
        assert!(row["step_ms_predicted"].as_f64().unwrap() > 0.0);
    }

    // A node uplink down mid-run: every rank ends within the timeout + 10 s, naming the ranks
    // it waits on; once the link is back the last checkpoint resumes.
    let run = tmp.path().join("cut");
    let args = on_cluster(&[
        "train",
        "--preset",
        "tiny",
        "--shard",
        "hier3",
        "--max-iters",
        "100000",
        "--save-interval",
        "2",
        "--eval-interval",
        "0",
        "--comm-timeout",
        "5",
        "--out-dir",
        run.to_str().unwrap(),
    ]);
    let mut job = Command::new(exe())
        .args(&args)
        .env("EMBER_CACHE_DIR", cache_dir())
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while !run.join("step-000004").exists() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no checkpoint came"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let uplink = format!("{PREFIX}-n1u");
    let down = Command::new("ip")
        .args(["link", "set", &uplink, "down"])
        .output()
        .unwrap();
    assert!(down.status.success());
    let cut = Instant::now();
    while ranks_alive(&run) > 0 {
        assert!(
            cut.elapsed() < Duration::from_secs(15),
            "ranks still alive {:.1} s after the uplink went down",
            cut.elapsed().as_secs_f64()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let ended = cut.elapsed().as_secs_f64();
    // The launcher itself finishes once it reaches the other node's daemons again.
    let up = Command::new("ip")
        .args(["link", "set", &uplink, "up"])
        .output()
        .unwrap();
    assert!(up.status.success());
    let stderr = {
        let mut text = String::new();
        use std::io::Read;
        job.stderr
            .take()
            .unwrap()
            .read_to_string(&mut text)
            .unwrap();
        text
    };
    let status = job.wait().unwrap();
    assert!(!status.success(), "the job must fail:\n{stderr}");
    assert!(
        stderr.contains("waited longer than the collective timeout of 5 s for rank(s)"),
        "no unreachable ranks named:\n{stderr}"
    );
    eprintln!("every rank ended {ended:.1} s after the uplink went down");
    let last = ember_sharding::plumbing::checkpoint::locate(&run).unwrap();
    let step: u64 = last
        .file_name()
        .unwrap()
        .to_string_lossy()
        .trim_start_matches("step-")
        .parse()
        .unwrap();
    let target = (step + 2).to_string();
    let resumed = on_cluster(&[
        "train",
        "--resume",
        last.to_str().unwrap(),
        "--shard",
        "hier3",
        "--max-iters",
        &target,
    ]);
    ok(&resumed.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(run.join(format!("step-{:06}", step + 2)).exists());

    // `ember launch` on the cluster: a node's uplink goes down mid-run; the launcher ends the
    // attempt once every rank has exited (mpirun would wait for the node), finds that node's
    // host no longer answers, and finishes on the other node with half the ranks from the
    // newest checkpoint, the global batch kept. Unquantized, so the losses can be held to one
    // process's at fp32 parity before and after the restart.
    let launched = tmp.path().join("launched");
    let steps = "40";
    let train = [
        "--preset",
        "tiny",
        "--max-iters",
        steps,
        "--log-interval",
        "1",
        "--eval-interval",
        "0",
        "--save-interval",
        "5",
    ];
    let one_long = tmp.path().join("one-long");
    let mut args = vec!["train", "--out-dir", one_long.to_str().unwrap()];
    args.extend(train);
    ok(&args);
    let mut args = vec![
        "launch",
        "--cluster",
        PREFIX,
        "--max-restarts",
        "2",
        "--backoff",
        "0.2",
        "--mpi=-x",
        "--mpi=EMBER_CACHE_DIR",
        "--",
        "train",
        "--shard",
        "hier3",
        "--topology",
        "2x1x2",
        "--quantize-weights",
        "off",
        "--quantize-grads",
        "off",
        "--comm-timeout",
        "5",
        "--out-dir",
        launched.to_str().unwrap(),
    ];
    args.extend(train);
    let mut job = Command::new("timeout")
        .args(["--kill-after=5", "600", exe()])
        .args(&args)
        .env("EMBER_CACHE_DIR", cache_dir())
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    loop {
        let past = launched.join("step-000005").join("manifest.json").exists()
            && read_metrics(&launched.join("metrics.jsonl"))
                .ok()
                .and_then(|m| m.last().map(|m| m.step))
                .is_some_and(|s| s >= 7);
        if past {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(180),
            "the launched run did not get past step 7"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let down = Command::new("ip")
        .args(["link", "set", &uplink, "down"])
        .output()
        .unwrap();
    assert!(down.status.success());
    let cut = Instant::now();
    let status = job.wait().unwrap();
    let finished = cut.elapsed().as_secs_f64();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut job.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(
        status.success(),
        "ember launch did not finish on the node left:\n{stderr}"
    );
    let _ = Command::new("ip")
        .args(["link", "set", &uplink, "up"])
        .output();
    let events = ember_train::files::metrics::read_events(&launched.join("metrics.jsonl")).unwrap();
    let names: Vec<&str> = events
        .iter()
        .map(|e| e["event"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["failure", "restart", "recovered", "finished"],
        "{events:?}\n{stderr}"
    );
    let restart = &events[1];
    assert_eq!(restart["np"], 2, "{restart}");
    assert_eq!(restart["topology"], "1x1x2", "{restart}");
    assert_eq!(
        restart["dropped"],
        serde_json::json!(["198.18.2.1"]),
        "{restart}"
    );
    let (a, b) = (losses(&one_long), losses(&launched));
    assert_eq!(b.len(), 40, "one history of 40 steps");
    for (step, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= PARITY_TOL,
            "step {}: one process {x}, launched and restarted {y}",
            step + 1
        );
    }
    eprintln!(
        "the launched job finished {finished:.1} s after the uplink went down; recovery: {}",
        events[2]
    );

    // Down leaves no namespace, link or state behind.
    drop(guard);
    let netns = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let links = Command::new("ip").args(["-br", "link"]).output().unwrap();
    for (what, out) in [("namespace", &netns), ("link", &links)] {
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            !text.lines().any(|l| l.starts_with(&format!("{PREFIX}-"))),
            "a {what} of the cluster is left:\n{text}"
        );
    }
    assert!(!state.exists(), "{} is left", state.display());
}
