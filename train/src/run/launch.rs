//! `ember launch`: a job that restarts by itself. The launcher runs `ember train` under
//! `mpirun`, watches the ranks through the records each writes into the attempt's folder
//! (started, ready, first step, exited), and after a failure restarts from the newest complete
//! checkpoint on the hosts that still answer, with the topology shrunk to the nodes left.
//! Every failure, restart and recovery goes to `metrics.jsonl` as an event line.
//!
//! The ranks' side is [`RankRecords`]: where `EMBER_LAUNCH_DIR` is set (the launcher sets it
//! for every attempt), each rank writes small JSON files there. They are what lets the
//! launcher end an attempt once every rank has exited, without waiting for `mpirun` to reach
//! a node that is gone.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow};
use serde::{Deserialize, Serialize};

/// The variable naming the folder where a launched job's ranks write their records.
pub const LAUNCH_DIR_ENV: &str = "EMBER_LAUNCH_DIR";

/// Seconds since the Unix epoch: the clock the ranks and the launcher share.
pub fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// What a rank of a launched job writes about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankRecord {
    /// The rank.
    pub rank: usize,
    /// The machine's host name.
    pub host: String,
    /// The process id.
    pub pid: u32,
    /// When, in seconds since the Unix epoch.
    pub time: f64,
    /// Optimizer steps completed by then (the step the run resumed at, before any step).
    pub step: u64,
    /// The exit code (exit records only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<i32>,
    /// The error, if the rank failed (exit records only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The records this process writes when launched: `rank-R.start.json` at its start,
/// `rank-R.exit.json` at its end (error or not, a panic included), and, on rank 0,
/// `ready.json` once the model is built and resumed and `first-step.json` after its first step.
#[derive(Debug)]
pub struct RankRecords {
    dir: PathBuf,
    rank: usize,
}

/// Steps this process has completed (the resumed step until the first one).
static STEP: AtomicU64 = AtomicU64::new(0);
static RECORDS: OnceLock<Option<RankRecords>> = OnceLock::new();

impl RankRecords {
    /// This process's records, where a launcher asked for them.
    pub fn get() -> Option<&'static RankRecords> {
        RECORDS
            .get_or_init(|| {
                let dir = PathBuf::from(std::env::var_os(LAUNCH_DIR_ENV)?);
                let rank = ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK"]
                    .iter()
                    .find_map(|v| std::env::var(v).ok()?.parse().ok())
                    .unwrap_or(0);
                Some(RankRecords { dir, rank })
            })
            .as_ref()
    }

    fn record(&self, code: Option<i32>, error: Option<String>) -> RankRecord {
        RankRecord {
            rank: self.rank,
            host: host_name(),
            pid: std::process::id(),
            time: now(),
            step: STEP.load(Ordering::Relaxed),
            code,
            error,
        }
    }

    /// Writes `name` whole or not at all (a temporary name, then a rename).
    fn write(&self, name: &str, record: &RankRecord) {
        let path = self.dir.join(name);
        let partial = self.dir.join(format!(".{name}.partial"));
        let text = serde_json::to_string(record).expect("a record serialises");
        // A launcher that cannot be told is no reason to fail the rank: it ends the attempt
        // at its grace period instead.
        if std::fs::write(&partial, text).is_ok() {
            let _ = std::fs::rename(&partial, &path);
        }
    }

    /// Records this process's start.
    pub fn started(&self) {
        self.write(
            &format!("rank-{}.start.json", self.rank),
            &self.record(None, None),
        );
    }

    /// Records this process's exit with `code` and its error, if any.
    pub fn exited(&self, code: i32, error: Option<String>) {
        self.write(
            &format!("rank-{}.exit.json", self.rank),
            &self.record(Some(code), error),
        );
    }

    /// Records that the run is built at `step` (resumed or fresh) and about to train.
    pub fn ready(step: u64) {
        STEP.store(step, Ordering::Relaxed);
        if let Some(r) = Self::get().filter(|r| r.rank == 0) {
            r.write("ready.json", &r.record(None, None));
        }
    }

    /// Records that `step` steps are done: rank 0 writes the first one it completes, and
    /// keeps `progress.json` at the latest (a file of a few dozen bytes per step), which is
    /// what the launcher counts the steps a failure lost from.
    pub fn stepped(step: u64) {
        let before = STEP.swap(step, Ordering::Relaxed);
        if let Some(r) = Self::get().filter(|r| r.rank == 0) {
            let record = r.record(None, None);
            if step > before && !r.dir.join("first-step.json").exists() {
                r.write("first-step.json", &record);
            }
            r.write("progress.json", &record);
        }
    }
}

/// This machine's host name.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// A host of the job, with the ranks it takes (`mpirun --host NAME:SLOTS`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Host {
    /// Its name or address.
    pub name: String,
    /// Ranks it runs.
    pub slots: usize,
}

/// Parses `mpirun --host` syntax: `a:4,b:4` (a host without `:N` takes one slot).
pub fn parse_hosts(spec: &str) -> Result<Vec<Host>> {
    spec.split(',')
        .filter(|h| !h.trim().is_empty())
        .map(|h| {
            let h = h.trim();
            match h.rsplit_once(':') {
                Some((name, n)) => Ok(Host {
                    name: name.to_string(),
                    slots: n.parse().map_err(|_| {
                        anyhow!("--host {h}: the slots after `:` must be a number, e.g. {name}:4")
                    })?,
                }),
                None => Ok(Host {
                    name: h.to_string(),
                    slots: 1,
                }),
            }
        })
        .collect()
}

/// Parses an `mpirun --hostfile`: one host per line, `NAME [slots=N]`, `#` comments.
pub fn parse_hostfile(text: &str) -> Result<Vec<Host>> {
    let mut hosts = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        let mut words = line.split_whitespace();
        let Some(name) = words.next() else { continue };
        let mut slots = 1;
        for w in words {
            if let Some(n) = w.strip_prefix("slots=") {
                slots = n
                    .parse()
                    .map_err(|_| anyhow!("line {}: `{w}`: slots=N takes a number", i + 1))?;
            }
        }
        hosts.push(Host {
            name: name.to_string(),
            slots,
        });
    }
    Ok(hosts)
}

/// The hosts of `hosts` that run each node's ranks, when `ranks_per_node` consecutive ranks
/// make a node and `mpirun --map-by slot` fills each host's slots in order: node `k` holds
/// ranks `k * ranks_per_node ..`. A host whose slots straddle two nodes belongs to both.
pub fn nodes_of(hosts: &[Host], ranks_per_node: usize) -> Vec<Vec<usize>> {
    let mut nodes: Vec<Vec<usize>> = Vec::new();
    let mut rank = 0;
    for (h, host) in hosts.iter().enumerate() {
        for _ in 0..host.slots {
            let node = rank / ranks_per_node.max(1);
            if nodes.len() <= node {
                nodes.resize(node + 1, Vec::new());
            }
            if !nodes[node].contains(&h) {
                nodes[node].push(h);
            }
            rank += 1;
        }
    }
    nodes
}

/// The host running `rank` under `--map-by slot`.
pub fn host_of_rank(hosts: &[Host], rank: usize) -> Option<&Host> {
    let mut first = 0;
    for h in hosts {
        if rank < first + h.slots {
            return Some(h);
        }
        first += h.slots;
    }
    None
}

/// Which of `hosts` answer: each is asked, through `agent` (what `mpirun` starts its daemons
/// with: `ssh`, or the emulated cluster's), to run `ember probe-back`, which connects back to
/// this process at `back` over the job's network and says its token. A host that cannot be
/// reached, or cannot reach back within `timeout`, does not answer.
pub fn answering(
    hosts: &[Host],
    agent: &[String],
    exe: &Path,
    back: &str,
    timeout: Duration,
) -> Result<Vec<bool>> {
    let listener = TcpListener::bind((back, 0))
        .with_context(|| format!("listening on {back} for the hosts' answers"))?;
    listener.set_nonblocking(true)?;
    let port = listener.local_addr()?.port();
    let token = |i: usize| format!("ember-probe-{}-{i}", std::process::id());
    let mut children = Vec::new();
    for (i, h) in hosts.iter().enumerate() {
        let mut cmd = std::process::Command::new(&agent[0]);
        cmd.args(&agent[1..])
            .arg(&h.name)
            .arg(exe)
            .args(["probe-back", back, &port.to_string(), &token(i)])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        children.push(cmd.spawn().ok());
    }
    let mut answered = vec![false; hosts.len()];
    let start = Instant::now();
    while start.elapsed() < timeout && answered.iter().any(|a| !a) {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_read_timeout(Some(Duration::from_secs(1)))?;
                let mut said = String::new();
                let _ = stream.take(64).read_to_string(&mut said);
                if let Some(i) = (0..hosts.len()).find(|&i| said.trim() == token(i)) {
                    answered[i] = true;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e.into()),
        }
    }
    for child in children.iter_mut().flatten() {
        let _ = child.kill();
        let _ = child.wait();
    }
    Ok(answered)
}

/// `ember probe-back`: connects to the launcher at `addr:port` within 3 seconds and says
/// `token`.
pub fn probe_back(addr: &str, port: u16, token: &str) -> Result<()> {
    let target = (addr, port)
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| anyhow!("{addr} resolves to no address"))?;
    let mut s = TcpStream::connect_timeout(&target, Duration::from_secs(3))
        .with_context(|| format!("connecting to the launcher at {addr}:{port}"))?;
    s.write_all(token.as_bytes())?;
    Ok(())
}

/// The records an attempt's ranks wrote so far.
#[derive(Debug, Default, Clone)]
pub struct Attempt {
    /// Start records by rank.
    pub started: BTreeMap<usize, RankRecord>,
    /// Exit records by rank.
    pub exited: BTreeMap<usize, RankRecord>,
    /// Rank 0's record of the run built and about to train.
    pub ready: Option<RankRecord>,
    /// Rank 0's record of its first step.
    pub first_step: Option<RankRecord>,
    /// Rank 0's record of its latest step.
    pub progress: Option<RankRecord>,
}

impl Attempt {
    /// Reads the records of `dir`.
    pub fn read(dir: &Path) -> Self {
        let mut out = Attempt::default();
        let Ok(entries) = std::fs::read_dir(dir) else {
            return out;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || !name.ends_with(".json") {
                continue;
            }
            let Some(record) = std::fs::read_to_string(entry.path())
                .ok()
                .and_then(|t| serde_json::from_str::<RankRecord>(&t).ok())
            else {
                continue;
            };
            if name == "ready.json" {
                out.ready = Some(record);
            } else if name == "first-step.json" {
                out.first_step = Some(record);
            } else if name == "progress.json" {
                out.progress = Some(record);
            } else if name.ends_with(".start.json") {
                out.started.insert(record.rank, record);
            } else if name.ends_with(".exit.json") {
                out.exited.insert(record.rank, record);
            }
        }
        out
    }

    /// The exit records of ranks that failed, earliest first.
    pub fn failures(&self) -> Vec<&RankRecord> {
        let mut v: Vec<&RankRecord> = self.exited.values().filter(|r| r.code != Some(0)).collect();
        v.sort_by(|a, b| a.time.total_cmp(&b.time));
        v
    }

    /// The furthest step any rank reported.
    pub fn step_reached(&self) -> u64 {
        self.exited
            .values()
            .chain(&self.first_step)
            .chain(&self.progress)
            .chain(&self.ready)
            .map(|r| r.step)
            .max()
            .unwrap_or(0)
    }
}

/// One line of `metrics.jsonl` written by the launcher: `{"event": "failure" | "restart" |
/// "recovered" | "finished" | "gave_up", "time": ..., ...}`.
pub fn write_event(out_dir: &Path, event: &str, fields: serde_json::Value) -> Result<()> {
    let mut line = serde_json::json!({"event": event, "time": now()});
    if let (Some(obj), serde_json::Value::Object(more)) = (line.as_object_mut(), fields) {
        obj.extend(more);
    }
    std::fs::create_dir_all(out_dir)?;
    let path = out_dir.join("metrics.jsonl");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    writeln!(f, "{line}").with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// `args` with `flag` set to `value` (replacing `flag V` or `flag=V` where given), or
/// removed with its value when `value` is `None`.
pub fn with_flag(args: &[String], flag: &str, value: Option<&str>) -> Vec<String> {
    let mut out = Vec::with_capacity(args.len() + 2);
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        if a == flag {
            i += 2;
            continue;
        }
        if a.starts_with(&format!("{flag}=")) {
            i += 1;
            continue;
        }
        out.push(a.clone());
        i += 1;
    }
    if let Some(v) = value {
        out.push(flag.to_string());
        out.push(v.to_string());
    }
    out
}

/// The value of `flag` in `args` (`flag V` or `flag=V`), the last one given.
pub fn flag_value(args: &[String], flag: &str) -> Option<String> {
    let mut found = None;
    for (i, a) in args.iter().enumerate() {
        if a == flag {
            found = args.get(i + 1).cloned();
        } else if let Some(v) = a.strip_prefix(&format!("{flag}=")) {
            found = Some(v.to_string());
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_parse_as_mpirun_writes_them() {
        let h = parse_hosts("a:4,b:2,c").unwrap();
        assert_eq!(h.iter().map(|h| h.slots).collect::<Vec<_>>(), [4, 2, 1]);
        assert!(
            parse_hosts("a:x")
                .unwrap_err()
                .to_string()
                .contains("--host a:x")
        );
        let f = parse_hostfile("# nodes\nn0 slots=4\nn1 slots=4 # second\n\nn2\n").unwrap();
        assert_eq!(
            f,
            [("n0", 4), ("n1", 4), ("n2", 1)]
                .map(|(n, s)| Host {
                    name: n.into(),
                    slots: s
                })
                .to_vec()
        );
    }

    #[test]
    fn ranks_fall_on_hosts_and_nodes_in_slot_order() {
        // Four GPU hosts of two GCD ranks each, two GPUs per node: 2 nodes of 4 ranks.
        let hosts = parse_hosts("g0:2,g1:2,g2:2,g3:2").unwrap();
        assert_eq!(nodes_of(&hosts, 4), vec![vec![0, 1], vec![2, 3]]);
        assert_eq!(host_of_rank(&hosts, 5).unwrap().name, "g2");
        assert!(host_of_rank(&hosts, 8).is_none());
        // One host per node.
        let hosts = parse_hosts("n0:4,n1:4").unwrap();
        assert_eq!(nodes_of(&hosts, 4), vec![vec![0], vec![1]]);
    }

    #[test]
    fn flags_are_set_replaced_and_removed() {
        let args: Vec<String> = ["--preset", "tiny", "--topology", "2x2x1", "--resume=x"]
            .map(String::from)
            .to_vec();
        let a = with_flag(&args, "--topology", Some("1x2x1"));
        assert_eq!(flag_value(&a, "--topology").as_deref(), Some("1x2x1"));
        assert_eq!(a.iter().filter(|x| x.starts_with("--topology")).count(), 1);
        let a = with_flag(&a, "--resume", None);
        assert_eq!(flag_value(&a, "--resume"), None);
        assert_eq!(flag_value(&args, "--resume").as_deref(), Some("x"));
        assert_eq!(flag_value(&a, "--preset").as_deref(), Some("tiny"));
    }

    #[test]
    fn a_probe_answers_only_with_its_token() {
        let l = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = l.local_addr().unwrap().port();
        probe_back("127.0.0.1", port, "tok").unwrap();
        let (mut s, _) = l.accept().unwrap();
        let mut said = String::new();
        s.read_to_string(&mut said).unwrap();
        assert_eq!(said, "tok");
        drop(l);
        assert!(probe_back("127.0.0.1", port, "tok").is_err());
    }
}
