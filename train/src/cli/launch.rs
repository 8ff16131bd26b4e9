//! `ember launch`: `ember train` under `mpirun`, restarted by itself after a failure from the
//! newest complete checkpoint, on the hosts that still answer (the library side is
//! `ember_train::run::launch`).

use std::io::BufRead;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Args, Parser};
use serde_json::json;

use ember_comm::Topology;
use ember_train::cluster::Cluster;
use ember_train::error::{CliError, CliResult, usage};
use ember_train::files::checkpoint::completed;
use ember_train::run::config::{Dtype, TrainOverrides};
use ember_train::run::launch::{
    Attempt, Host, LAUNCH_DIR_ENV, answering, flag_value, host_name, host_of_rank, nodes_of, now,
    parse_hostfile, parse_hosts, with_flag, write_event,
};

use super::train::TrainArgs;

#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Ranks to start [default: the world size of train's --topology, or the hosts' slots]
    #[arg(long)]
    pub np: Option<usize>,
    /// Hosts and the ranks each takes, as mpirun takes them: a:4,b:4
    #[arg(long, conflicts_with_all = ["hostfile", "cluster"])]
    pub host: Option<String>,
    /// A file of hosts, as mpirun takes it: one `NAME slots=N` per line
    #[arg(long, conflicts_with = "cluster")]
    pub hostfile: Option<PathBuf>,
    /// Run on the emulated cluster of this prefix (`ember cluster up`): its hosts, its agent
    /// and its network
    #[arg(long, value_name = "PREFIX")]
    pub cluster: Option<String>,
    /// Restarts after failures before giving up
    #[arg(long, default_value_t = 3)]
    pub max_restarts: usize,
    /// Seconds before the first restart, doubled for each later one
    #[arg(long, default_value_t = 1.0)]
    pub backoff: f64,
    /// Seconds to wait, once a rank has reported its failure, for the other ranks to exit
    /// before ending mpirun [default: train's --comm-timeout + 10]
    #[arg(long)]
    pub grace: Option<f64>,
    /// What starts a command on a host, to ask it whether it answers (mpirun's rsh agent)
    /// [default: ssh -o BatchMode=yes -o ConnectTimeout=5; the cluster's with --cluster]
    #[arg(long)]
    pub agent: Option<String>,
    /// The address of this machine that hosts connect back to when asked [default: its host
    /// name; the cluster's hub with --cluster]
    #[arg(long)]
    pub address: Option<String>,
    /// An extra mpirun argument (repeatable), e.g. --mpi=--mca --mpi=btl --mpi=self,vader
    #[arg(long = "mpi", allow_hyphen_values = true)]
    pub mpi: Vec<String>,
    /// `train` and its flags
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// `ember train`'s flags, parsed as it parses them.
#[derive(Debug, Parser)]
#[command(name = "train", allow_negative_numbers = true)]
struct TrainCommand {
    #[command(flatten)]
    args: TrainArgs,
}

/// The flags that change a sharding preset's states: a restart that falls back to zero3 drops
/// them with the preset.
const PRESET_FLAGS: [&str; 6] = [
    "--secondary",
    "--accumulate-at",
    "--quantize-weights",
    "--quantize-grads",
    "--quant-block",
    "--prefetch",
];

/// How one attempt ended.
#[derive(Debug)]
enum Ended {
    /// mpirun exited.
    Mpirun(ExitStatus),
    /// Every rank exited; mpirun was ended.
    RanksExited,
    /// A rank failed and the others did not all exit within the grace period; mpirun was
    /// ended.
    Grace,
}

/// A recovery under way: from the failure to the next attempt's first step.
#[derive(Debug, Clone, Copy)]
struct Recovery {
    failed_at: f64,
    decided_at: f64,
    spawned_at: f64,
    from_step: u64,
    steps_lost: u64,
    reported: bool,
}

/// mpirun's process group while an attempt runs (0 otherwise), for [`on_signal`].
static MPIRUN_GROUP: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// SIGTERM, SIGINT or SIGHUP to the launcher: the job it started goes with it, then the
/// signal does what it would have done.
extern "C" fn on_signal(sig: libc::c_int) {
    let group = MPIRUN_GROUP.load(std::sync::atomic::Ordering::SeqCst);
    // SAFETY: kill, signal and raise are async-signal-safe.
    unsafe {
        if group > 0 {
            libc::kill(-group, libc::SIGTERM);
        }
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
}

pub fn run(a: LaunchArgs) -> CliResult<()> {
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // SAFETY: installs a handler that only calls async-signal-safe functions.
        unsafe {
            libc::signal(
                sig,
                on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
            )
        };
    }
    if a.command.first().map(String::as_str) != Some("train") {
        return Err(usage(
            "ember launch runs ember train: write `ember launch [OPTIONS] -- train FLAGS...`",
        ));
    }
    let mut args: Vec<String> = a.command[1..].to_vec();
    // Parsed as ember train parses them, so a bad flag is refused before any mpirun.
    let parsed =
        TrainCommand::try_parse_from(std::iter::once("train".to_string()).chain(args.clone()))
            .map_err(|e| usage(format!("the train flags: {}", e.to_string().trim())))?
            .args;
    let file = match &parsed.config {
        Some(path) => TrainOverrides::from_toml_file(path)?,
        None => TrainOverrides::default(),
    };
    let out_dir = parsed
        .settings
        .out_dir
        .clone()
        .or(file.out_dir.clone())
        .unwrap_or_else(|| PathBuf::from("out"));
    let mut topology = parsed
        .shard
        .topology
        .as_deref()
        .map(|t| Topology::parse(t).map_err(|e| usage(format!("--topology {t}: {e}"))))
        .transpose()?;
    let grace = a.grace.unwrap_or(parsed.shard.comm_timeout + 10.0);
    let exe = std::env::current_exe().map_err(|e| anyhow::anyhow!("locating this binary: {e}"))?;
    let cluster = a
        .cluster
        .as_deref()
        .map(|p| Cluster::load(&Cluster::state_file(p)))
        .transpose()?;
    let mut hosts: Option<Vec<Host>> = match (&a.host, &a.hostfile, &cluster) {
        (Some(h), _, _) => Some(parse_hosts(h).map_err(|e| usage(e.to_string()))?),
        (_, Some(f), _) => {
            let text = std::fs::read_to_string(f)
                .map_err(|e| usage(format!("--hostfile {}: {e}", f.display())))?;
            Some(
                parse_hostfile(&text)
                    .map_err(|e| usage(format!("--hostfile {}: {e}", f.display())))?,
            )
        }
        (_, _, Some(c)) => Some(parse_hosts(&c.hosts()).map_err(|e| usage(e.to_string()))?),
        _ => None,
    };
    let mut np =
        a.np.or(topology.as_ref().map(Topology::world_size))
            .or(hosts.as_ref().map(|h| h.iter().map(|h| h.slots).sum()))
            .ok_or_else(|| usage("give --np N, or train's --topology, or --host"))?;
    if let (Some(t), Some(n)) = (&topology, a.np)
        && t.world_size() != n
    {
        return Err(usage(format!(
            "--np {n} does not match train's --topology {t} ({} ranks)",
            t.world_size()
        )));
    }
    let agent: Vec<String> = match (&cluster, &a.agent) {
        (Some(c), _) => vec![
            exe.display().to_string(),
            "cluster".into(),
            "rsh".into(),
            "--prefix".into(),
            c.spec.prefix.clone(),
        ],
        (None, Some(s)) => s.split_whitespace().map(String::from).collect(),
        (None, None) => ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]
            .map(String::from)
            .to_vec(),
    };
    let back = match (&a.address, &cluster) {
        (Some(addr), _) => addr.clone(),
        (None, Some(_)) => "198.18.0.1".into(),
        (None, None) => host_name(),
    };
    say(&format!(
        "{} ranks{} under mpirun, up to {} restart{}; events in {}",
        np,
        hosts
            .as_ref()
            .map_or(String::new(), |h| format!(" on {}", list(h))),
        a.max_restarts,
        if a.max_restarts == 1 { "" } else { "s" },
        out_dir.join("metrics.jsonl").display()
    ));

    let mut restarts = 0;
    let mut recovery: Option<Recovery> = None;
    for attempt in 1.. {
        let dir = out_dir.join(".launch").join(format!("attempt-{attempt}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .map_err(|e| anyhow::anyhow!("creating {}: {e}", dir.display()))?;
        let mut cmd = Command::new("mpirun");
        match (&cluster, &hosts) {
            (Some(c), Some(h)) => {
                cmd.args(c.mpirun_args_on(&exe, np, &host_list(h)));
            }
            (None, Some(h)) => {
                cmd.args(["-np", &np.to_string(), "--host", &host_list(h)]);
            }
            (_, None) => {
                cmd.args(["-np", &np.to_string()]);
            }
        }
        cmd.args(&a.mpi)
            .arg("-x")
            .arg(format!("{LAUNCH_DIR_ENV}={}", dir.display()));
        if let Some(cache) = ember_train::run::kernel_cache::for_ranks() {
            cmd.args(["-x", &cache]);
        }
        cmd.arg(&exe)
            .arg("train")
            .args(&args)
            .stderr(Stdio::piped())
            .process_group(0);
        let spawned_at = now();
        if let Some(r) = recovery.as_mut() {
            r.spawned_at = spawned_at;
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| anyhow::anyhow!("running mpirun: {e} (is openmpi-bin installed?)"))?;
        MPIRUN_GROUP.store(child.id() as i32, std::sync::atomic::Ordering::SeqCst);
        let signalled = forward_stderr(&mut child);
        let ended = watch(&mut child, attempt, np, grace, &out_dir, &mut recovery)?;
        MPIRUN_GROUP.store(0, std::sync::atomic::Ordering::SeqCst);
        if let Some(c) = &cluster {
            c.end_daemons();
        }
        let records = Attempt::read(&dir);
        report_recovery(&out_dir, attempt, &records, &mut recovery)?;
        let all_clean =
            records.exited.len() >= np && records.exited.values().all(|r| r.code == Some(0));
        let clean = match ended {
            Ended::Mpirun(status) => status.success(),
            Ended::RanksExited | Ended::Grace => all_clean,
        };
        if clean {
            write_event(
                &out_dir,
                "finished",
                json!({"attempt": attempt, "restarts": restarts}),
            )?;
            say(&format!(
                "the job finished after {restarts} restart{}",
                if restarts == 1 { "" } else { "s" }
            ));
            return Ok(());
        }
        let decided_at = now();
        let failures = records.failures();
        if let Some(refused) = failures.iter().find(|r| r.code == Some(2)) {
            write_event(
                &out_dir,
                "gave_up",
                json!({"attempt": attempt, "reason": "a usage error", "error": refused.error}),
            )?;
            return Err(usage(format!(
                "rank {} refused the job's configuration, which a restart would not change: {}",
                refused.rank,
                refused.error.as_deref().unwrap_or("(no message)")
            )));
        }
        let failed_at = failures.first().map_or(decided_at, |r| r.time);
        let signalled = signalled.lock().map(|s| s.clone()).unwrap_or_default();
        let mut ranks: Vec<serde_json::Value> = failures
            .iter()
            .map(|r| {
                json!({
                    "rank": r.rank,
                    "host": hosts.as_deref().and_then(|h| host_of_rank(h, r.rank)).map_or(r.host.clone(), |h| h.name.clone()),
                    "code": r.code,
                    "error": r.error,
                })
            })
            .collect();
        for line in &signalled {
            ranks.push(json!({"mpirun": line}));
        }
        let reached = records.step_reached();
        let checkpoint = completed(&out_dir).ok().and_then(|mut c| c.pop());
        let (ckpt_step, ckpt_dir) = match &checkpoint {
            Some((s, d)) => (*s, Some(d.clone())),
            None => (0, None),
        };
        let steps_lost = reached.saturating_sub(ckpt_step);
        write_event(
            &out_dir,
            "failure",
            json!({
                "attempt": attempt,
                "ended": format!("{ended:?}"),
                "ranks": ranks,
                "step_reached": reached,
                "checkpoint": ckpt_dir,
                "steps_lost": steps_lost,
                "detection_s": decided_at - failed_at,
            }),
        )?;
        let what = describe(&failures, &signalled, hosts.as_deref());
        say(&format!(
            "attempt {attempt} failed at step {reached}: {what}"
        ));
        let Some(ckpt_dir) = ckpt_dir else {
            write_event(
                &out_dir,
                "gave_up",
                json!({"attempt": attempt, "reason": "no checkpoint"}),
            )?;
            return Err(CliError::Runtime(anyhow::anyhow!(
                "the job failed ({what}) before its first checkpoint: {} holds none to restart \
                 from; lower --save-interval, and run ember launch again",
                out_dir.display()
            )));
        };
        if restarts >= a.max_restarts {
            write_event(
                &out_dir,
                "gave_up",
                json!({"attempt": attempt, "reason": "--max-restarts"}),
            )?;
            return Err(CliError::Runtime(anyhow::anyhow!(
                "the job failed ({what}) and --max-restarts {} are used up; the newest \
                 checkpoint is {}",
                a.max_restarts,
                ckpt_dir.display()
            )));
        }
        // The hosts that still answer, whole nodes of them.
        let mut dropped = Vec::new();
        if let Some(h) = hosts.clone() {
            let alive = answering(&h, &agent, &exe, &back, Duration::from_secs(4))
                .map_err(CliError::Runtime)?;
            let per_node = topology
                .as_ref()
                .map(|t| t.world_size() / t.dims()[t.depth() - 1]);
            let nodes: Vec<Vec<usize>> = match per_node {
                Some(n) => nodes_of(&h, n),
                None => (0..h.len()).map(|i| vec![i]).collect(),
            };
            let kept: Vec<&Vec<usize>> = nodes
                .iter()
                .filter(|n| n.iter().all(|&i| alive[i]))
                .collect();
            dropped = h
                .iter()
                .zip(&alive)
                .filter(|(_, a)| !**a)
                .map(|(h, _)| h.name.clone())
                .collect();
            if kept.is_empty() {
                write_event(
                    &out_dir,
                    "gave_up",
                    json!({"attempt": attempt, "reason": "no host answers"}),
                )?;
                return Err(CliError::Runtime(anyhow::anyhow!(
                    "no node has every host answering ({} did not answer); the newest checkpoint \
                     is {}",
                    dropped.join(", "),
                    ckpt_dir.display()
                )));
            }
            let new_hosts: Vec<Host> = kept
                .iter()
                .flat_map(|n| n.iter().map(|&i| h[i].clone()))
                .collect();
            np = new_hosts.iter().map(|h| h.slots).sum();
            if let Some(t) = &topology {
                let d = t.dims();
                let spec = format!("{}x{}x{}", kept.len(), d[1], d[0]);
                topology = Some(Topology::parse(&spec).map_err(|e| usage(format!("{spec}: {e}")))?);
                np = topology.as_ref().map_or(np, Topology::world_size);
            }
            hosts = Some(new_hosts);
        }
        let backoff = a.backoff * 2f64.powi(restarts as i32);
        std::thread::sleep(Duration::from_secs_f64(backoff.max(0.0)));
        restarts += 1;
        args = with_flag(&args, "--resume", Some(&ckpt_dir.display().to_string()));
        args = with_flag(&args, "--init-from", None);
        if let Some(t) = &topology {
            args = with_flag(&args, "--topology", Some(&t.to_string()));
        }
        // The sharding asked for, on what is left; zero3 where it no longer fits the layout.
        if let Some(t) = &topology {
            let mut shard = parsed.shard.clone();
            shard.topology = Some(t.to_string());
            let dtype = parsed.settings.dtype.or(file.dtype).unwrap_or(Dtype::F32);
            if let Err(e) = shard.resolve(t, dtype)
                && shard.shard.is_some()
            {
                say(&format!(
                    "--shard {} with its flags does not fit --topology {t} ({e}): the restart \
                     runs --shard zero3",
                    shard.shard.as_deref().unwrap_or("ddp")
                ));
                args = with_flag(&args, "--shard", Some("zero3"));
                for flag in PRESET_FLAGS {
                    args = with_flag(&args, flag, None);
                }
                args.retain(|a| a != "--error-feedback");
            }
        }
        let shard = flag_value(&args, "--shard").unwrap_or_else(|| "ddp".into());
        say(&format!(
            "restart {restarts} of {}: from {} (step {ckpt_step}, {steps_lost} step{} lost) on {np} \
             rank{}{}{}, --shard {shard}{}",
            a.max_restarts,
            ckpt_dir.display(),
            if steps_lost == 1 { "" } else { "s" },
            if np == 1 { "" } else { "s" },
            topology
                .as_ref()
                .map_or(String::new(), |t| format!(", --topology {t}")),
            hosts
                .as_ref()
                .map_or(String::new(), |h| format!(" on {}", list(h))),
            if dropped.is_empty() {
                String::new()
            } else {
                format!(
                    "; {} did not answer and {} dropped",
                    dropped.join(", "),
                    if dropped.len() == 1 { "is" } else { "are" }
                )
            }
        ));
        write_event(
            &out_dir,
            "restart",
            json!({
                "attempt": attempt + 1,
                "restart": restarts,
                "from": ckpt_dir,
                "from_step": ckpt_step,
                "np": np,
                "topology": topology.as_ref().map(|t| t.to_string()),
                "hosts": hosts.as_ref().map(|h| h.iter().map(|h| h.name.clone()).collect::<Vec<_>>()),
                "dropped": dropped,
                "backoff_s": backoff,
            }),
        )?;
        recovery = Some(Recovery {
            failed_at,
            decided_at,
            spawned_at: 0.0,
            from_step: ckpt_step,
            steps_lost,
            reported: false,
        });
    }
    unreachable!("the attempts loop returns")
}

fn say(line: &str) {
    eprintln!("[ember launch] {line}");
}

fn host_list(hosts: &[Host]) -> String {
    hosts
        .iter()
        .map(|h| format!("{}:{}", h.name, h.slots))
        .collect::<Vec<_>>()
        .join(",")
}

fn list(hosts: &[Host]) -> String {
    hosts
        .iter()
        .map(|h| h.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The failed ranks in a few words.
fn describe(
    failures: &[&ember_train::run::launch::RankRecord],
    signalled: &[String],
    hosts: Option<&[Host]>,
) -> String {
    if let Some(line) = signalled.first() {
        return line.clone();
    }
    match failures.first() {
        Some(r) => format!(
            "rank {} on {} exited with {}: {}{}",
            r.rank,
            hosts
                .and_then(|h| host_of_rank(h, r.rank))
                .map_or(r.host.clone(), |h| h.name.clone()),
            r.code.unwrap_or(-1),
            r.error.as_deref().unwrap_or("(no message)"),
            if failures.len() > 1 {
                format!(" (and {} other ranks after it)", failures.len() - 1)
            } else {
                String::new()
            }
        ),
        None => "mpirun failed without a rank's report".into(),
    }
}

/// Passes mpirun's stderr through, keeping the lines where it names a rank that died of a
/// signal.
fn forward_stderr(child: &mut Child) -> Arc<Mutex<Vec<String>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    if let Some(stderr) = child.stderr.take() {
        let seen = seen.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                if line.contains("plm:rsh: Warning: setpgid") {
                    continue;
                }
                if line.contains("exited on signal")
                    && let Ok(mut s) = seen.lock()
                {
                    s.push(line.trim().to_string());
                }
                eprintln!("{line}");
            }
        });
    }
    seen
}

/// Waits for the attempt to end: mpirun's exit, or every rank's exit record (then mpirun is
/// ended: it may be waiting for a node that is gone), or `grace` seconds after the first
/// failure record. Reports a recovery once the attempt's first step is done.
fn watch(
    child: &mut Child,
    attempt: usize,
    np: usize,
    grace: f64,
    out_dir: &Path,
    recovery: &mut Option<Recovery>,
) -> CliResult<Ended> {
    let dir = out_dir.join(".launch").join(format!("attempt-{attempt}"));
    let mut first_failure: Option<Instant> = None;
    loop {
        if let Some(status) = child
            .try_wait()
            .map_err(|e| anyhow::anyhow!("waiting for mpirun: {e}"))?
        {
            return Ok(Ended::Mpirun(status));
        }
        let records = Attempt::read(&dir);
        if recovery.is_some_and(|r| !r.reported) && records.first_step.is_some() {
            report_recovery(out_dir, attempt, &records, recovery)?;
        }
        if records.exited.len() >= np {
            end(child);
            return Ok(Ended::RanksExited);
        }
        if !records.failures().is_empty() {
            let since = *first_failure.get_or_insert_with(Instant::now);
            if since.elapsed().as_secs_f64() > grace {
                end(child);
                return Ok(Ended::Grace);
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Ends mpirun and what runs in its process group: politely, then for good.
fn end(child: &mut Child) {
    let pgid = child.id() as i32;
    // SAFETY: signals to the process group the launcher created for mpirun.
    unsafe { libc::kill(-pgid, libc::SIGTERM) };
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(3) {
        if matches!(child.try_wait(), Ok(Some(_))) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: as above.
    unsafe { libc::kill(-pgid, libc::SIGKILL) };
    let _ = child.wait();
}

/// Writes the `recovered` event once the attempt after a failure has done its first step.
fn report_recovery(
    out_dir: &Path,
    attempt: usize,
    records: &Attempt,
    recovery: &mut Option<Recovery>,
) -> CliResult<()> {
    let (Some(r), Some(first)) = (recovery.as_mut(), &records.first_step) else {
        return Ok(());
    };
    if r.reported {
        return Ok(());
    }
    r.reported = true;
    let ready = records.ready.as_ref().map_or(first.time, |x| x.time);
    let total = first.time - r.failed_at;
    write_event(
        out_dir,
        "recovered",
        json!({
            "attempt": attempt,
            "from_step": r.from_step,
            "steps_lost": r.steps_lost,
            "seconds_to_recover": total,
            "detection_s": r.decided_at - r.failed_at,
            "restart_s": r.spawned_at - r.decided_at,
            "load_s": ready - r.spawned_at,
            "first_step_s": first.time - ready,
        }),
    )?;
    say(&format!(
        "recovered: step {} done {total:.1} s after the failure (detection {:.1} s, restart {:.1} s, \
         start and load {:.1} s, first step {:.1} s)",
        first.step,
        r.decided_at - r.failed_at,
        r.spawned_at - r.decided_at,
        ready - r.spawned_at,
        first.time - ready
    ));
    Ok(())
}
