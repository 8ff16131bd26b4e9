//! The cluster's namespaces, bridges and shaped links: bringing them up, and down again.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use super::calibrate::{Calibration, calibrate, profile_toml};
use super::probe::{probe, probe_through_mpi};
use super::state::*;
use anyhow::{Context, Result, bail};
use ember_comm::Topology;

/// Runs a command, failing with its stderr.
fn run(cmd: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .with_context(|| format!("running {cmd}: is iproute2 installed?"))?;
    if !out.status.success() {
        bail!(
            "`{cmd} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The names of a listing command's output lines that start with `prefix-`.
fn ours(prefix: &str, cmd: &str, args: &[&str]) -> Vec<String> {
    let Ok(out) = Command::new(cmd).args(args).output() else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(|n| n.split('@').next().unwrap_or(n).trim_end_matches(':'))
        .filter(|n| n.starts_with(&format!("{prefix}-")))
        .map(str::to_string)
        .collect()
}

/// Removes everything of cluster `prefix`: namespaces, interfaces, its state and scratch
/// directories. Idempotent; returns what it removed.
pub fn down(prefix: &str) -> Result<Vec<String>> {
    let mut removed = Vec::new();
    for ns in ours(prefix, "ip", &["netns", "list"]) {
        run("ip", &["netns", "delete", &ns])?;
        removed.push(format!("namespace {ns}"));
    }
    // Deleting a veth end deletes its peer; deleting a bridge frees its ports.
    for link in ours(prefix, "ip", &["-o", "-br", "link", "show"]) {
        if run("ip", &["link", "delete", &link]).is_ok() {
            removed.push(format!("link {link}"));
        }
    }
    let dir = Path::new(STATE_ROOT).join(prefix);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
        removed.push(format!("{}", dir.display()));
    }
    if let Ok(entries) = std::fs::read_dir("/dev/shm") {
        for e in entries.flatten() {
            if e.file_name()
                .to_string_lossy()
                .starts_with(&format!("{prefix}-"))
            {
                let _ = std::fs::remove_dir_all(e.path());
                removed.push(format!("{}", e.path().display()));
            }
        }
    }
    Ok(removed)
}

/// Brings the cluster up (removing any leftovers of the same prefix first), probes its links
/// and writes its state file and profile. On any failure it removes what it made.
pub fn up(spec: &ClusterSpec, calibration: &Calibration) -> Result<Cluster> {
    let topology = spec.validate()?;
    if unsafe_geteuid() != 0 {
        bail!("ember cluster up needs root (network namespaces and tc): run it as root");
    }
    // Clusters share the address range (and the root namespace's route to it).
    if let Ok(entries) = std::fs::read_dir(STATE_ROOT) {
        for e in entries.flatten() {
            let other = e.file_name().to_string_lossy().into_owned();
            if other != spec.prefix && e.path().join("cluster.json").exists() {
                bail!(
                    "cluster `{other}` is up and uses the same addresses: take it down first \
                     (ember cluster down --prefix {other})"
                );
            }
        }
    }
    down(&spec.prefix)?;
    match build(spec, &topology, calibration) {
        Ok(c) => Ok(c),
        Err(e) => {
            let _ = down(&spec.prefix);
            Err(e)
        }
    }
}

fn unsafe_geteuid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// `tbf` at `mbit` on `dev` (in namespace `ns` when given). The bucket holds 2 ms of traffic,
/// the queue 50 ms. Measured: a 5 ms queue let four TCP flows fill a link both ways, but MPI's
/// bursts then lost packets to it, and retransmission timeouts made ember's steps 1.5x slower.
fn shape(ns: Option<&str>, dev: &str, mbit: f64) -> Result<()> {
    let rate = format!("{}kbit", (mbit * 1000.0).round() as u64);
    let burst = format!("{}", ((mbit * 1e6 / 8.0 * 0.002) as u64).max(128 * 1024));
    let mut args: Vec<&str> = Vec::new();
    if let Some(ns) = ns {
        args.extend(["-n", ns]);
    }
    args.extend([
        "qdisc", "replace", "dev", dev, "root", "tbf", "rate", &rate, "burst", &burst, "latency",
        "50ms",
    ]);
    run("tc", &args)
}

fn build(spec: &ClusterSpec, topology: &Topology, calibration: &Calibration) -> Result<Cluster> {
    let p = &spec.prefix;
    let dims = topology.dims();
    let (nodes, gpus_per_node) = (dims[2], dims[1]);
    let dir = Path::new(STATE_ROOT).join(p);
    std::fs::create_dir_all(dir.join("tmp"))
        .with_context(|| format!("creating {}", dir.display()))?;
    let hub = format!("{p}-hub");
    run("ip", &["link", "add", &hub, "type", "bridge"])?;
    run("ip", &["addr", "add", "198.18.0.1/16", "dev", &hub])?;
    run("ip", &["link", "set", &hub, "up"])?;
    let mut gpus = Vec::new();
    let mut uplinks = Vec::new();
    for n in 0..nodes {
        let bridge = format!("{p}-n{n}");
        let (up_node, up_hub) = (format!("{p}-n{n}u"), format!("{p}-n{n}h"));
        run("ip", &["link", "add", &bridge, "type", "bridge"])?;
        run("ip", &["link", "set", &bridge, "up"])?;
        run(
            "ip",
            &[
                "link", "add", &up_node, "type", "veth", "peer", "name", &up_hub,
            ],
        )?;
        run("ip", &["link", "set", &up_node, "master", &bridge, "up"])?;
        run("ip", &["link", "set", &up_hub, "master", &hub, "up"])?;
        shape(None, &up_node, spec.uplink_mbit)?;
        shape(None, &up_hub, spec.uplink_mbit)?;
        uplinks.push(up_node);
        for g in 0..gpus_per_node {
            let ns = format!("{p}-n{n}g{g}");
            let address = format!("198.18.{}.{}", n + 1, g + 1);
            run("ip", &["netns", "add", &ns])?;
            run(
                "ip",
                &[
                    "link", "add", &ns, "type", "veth", "peer", "name", "eth0", "netns", &ns,
                ],
            )?;
            run("ip", &["link", "set", &ns, "master", &bridge, "up"])?;
            run(
                "ip",
                &[
                    "-n",
                    &ns,
                    "addr",
                    "add",
                    &format!("{address}/16"),
                    "dev",
                    "eth0",
                ],
            )?;
            run("ip", &["-n", &ns, "link", "set", "eth0", "up"])?;
            run("ip", &["-n", &ns, "link", "set", "lo", "up"])?;
            shape(None, &ns, spec.gpu_link_mbit)?;
            shape(Some(&ns), "eth0", spec.gpu_link_mbit)?;
            std::fs::create_dir_all(dir.join("tmp").join(&ns))?;
            gpus.push(Gpu {
                namespace: ns,
                address,
                hostname: format!("{p}-node{n}"),
                node: n,
            });
        }
    }
    let mut cluster = Cluster {
        spec: spec.clone(),
        gpus,
        uplinks,
        dir: dir.clone(),
        rtt_us: BTreeMap::new(),
        probed_mbit: BTreeMap::new(),
        mpi: None,
        measured: Measured {
            rank_tflops: 0.0,
            cpu: ember_sharding::plan::profile::CpuProfile {
                cores_per_rank: 0.0,
                message_byte_s: Vec::new(),
                copy_byte_s: 0.0,
                quant_element_s: 0.0,
                visit_param_s: 0.0,
                optimizer_element_s: 0.0,
            },
            calibration: String::new(),
        },
    };
    let tcp_byte_s = probe(&mut cluster)?;
    cluster.measured = calibrate(calibration, topology, tcp_byte_s)?;
    let state = serde_json::to_string_pretty(&cluster)?;
    std::fs::write(dir.join("cluster.json"), state)?;
    cluster.mpi = Some(probe_through_mpi(&cluster)?);
    let state = serde_json::to_string_pretty(&cluster)?;
    std::fs::write(dir.join("cluster.json"), state)?;
    std::fs::write(dir.join("profile.toml"), profile_toml(&cluster)?)?;
    Ok(cluster)
}
