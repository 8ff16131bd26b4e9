//! A cluster as it is asked for (`ClusterSpec`) and as `up` built and measured it
//! (`Cluster`, the state file), and the byte counters of its links.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, anyhow, bail};
use ember_comm::Topology;
use serde::{Deserialize, Serialize};

/// Where cluster states live: one directory per prefix.
pub const STATE_ROOT: &str = "/run/ember-cluster";
/// The environment variable `ember cluster run` sets for the ranks: the state file's path.
pub const CLUSTER_ENV: &str = "EMBER_CLUSTER";
/// The address range every emulated cluster uses (RFC 2544).
pub const RANGE: &str = "198.18.0.0/16";

/// What to bring up.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterSpec {
    /// Prefix of every name the cluster creates (1 to 4 lower-case letters).
    pub prefix: String,
    /// Nodes, GPUs per node, GCD ranks per GPU.
    pub topology: String,
    /// Rate of each GPU's link, each direction, Mbit/s.
    pub gpu_link_mbit: f64,
    /// Rate of each node's uplink, each direction, Mbit/s.
    pub uplink_mbit: f64,
}

/// One GPU's namespace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    /// Namespace name (and its link's bridge-side interface).
    pub namespace: String,
    /// Address of its `eth0`.
    pub address: String,
    /// The hostname its ranks see (the node's).
    pub hostname: String,
    /// Node index.
    pub node: usize,
}

/// What `up` built and measured: the state file's contents.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    /// The request.
    pub spec: ClusterSpec,
    /// GPUs in rank order (node-major).
    pub gpus: Vec<Gpu>,
    /// Node uplinks, node-side interface names.
    pub uplinks: Vec<String>,
    /// The state directory.
    pub dir: PathBuf,
    /// Probed TCP round trip between two GPUs of one node and across nodes, microseconds.
    pub rtt_us: BTreeMap<String, f64>,
    /// Probed TCP throughput of one stream across one GPU link and across one uplink, Mbit/s.
    pub probed_mbit: BTreeMap<String, f64>,
    /// The compute and CPU costs measured on this machine (see `calibrate`).
    pub measured: Measured,
    /// Each tier's links as MPI moves data over them (see `probe_links`).
    #[serde(default)]
    pub mpi: Option<MpiProbe>,
}

/// Each tier's links measured through ember's collectives under `mpirun`: the rate of the
/// busiest link while every group of the tier's GPUs or nodes exchanges at once, and the
/// latency of a small exchange.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MpiProbe {
    /// GB/s per direction of one link of each level from the GPU level out, by level name.
    pub link_gbps: Vec<(String, f64)>,
    /// One-way microseconds of a small exchange across each level, by level name.
    pub latency_us: Vec<(String, f64)>,
    /// The fraction of `link_gbps` one link direction of each level carries when several
    /// rank pairs send across it at once, by level name.
    #[serde(default)]
    pub flow_efficiency: Vec<(String, f64)>,
}

/// What `up` measures of this machine's compute and CPU, for the profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Measured {
    /// Sustained TFLOP/s of one rank when every rank computes.
    pub rank_tflops: f64,
    /// The CPU costs of communication and of the engine's bookkeeping.
    pub cpu: ember_sharding::plan::profile::CpuProfile,
    /// What the compute rate was measured on.
    pub calibration: String,
}

impl ClusterSpec {
    /// Checks the request; the error names the flag to fix.
    pub fn validate(&self) -> Result<Topology> {
        if self.prefix.is_empty()
            || self.prefix.len() > 4
            || !self.prefix.chars().all(|c| c.is_ascii_lowercase())
        {
            bail!(
                "--prefix {}: use 1 to 4 lower-case letters (interface names are limited to 15 \
                 characters)",
                self.prefix
            );
        }
        let t = Topology::parse(&self.topology)
            .map_err(|e| anyhow!("--topology {}: {e}", self.topology))?;
        let dims = t.dims();
        if dims[2] > 200 || dims[1] > 200 {
            bail!(
                "--topology {}: at most 200 nodes and 200 GPUs per node fit the address plan",
                self.topology
            );
        }
        for (flag, v) in [
            ("--gpu-link", self.gpu_link_mbit),
            ("--uplink", self.uplink_mbit),
        ] {
            if !(v.is_finite() && v > 0.0) {
                bail!("{flag} {v}: give a positive rate in Mbit/s");
            }
        }
        Ok(t)
    }
}

impl Cluster {
    /// The state file of cluster `prefix`.
    pub fn state_file(prefix: &str) -> PathBuf {
        Path::new(STATE_ROOT).join(prefix).join("cluster.json")
    }

    /// Reads a cluster's state from its file.
    pub fn load(path: &Path) -> Result<Cluster> {
        let text = std::fs::read_to_string(path).with_context(|| {
            format!(
                "reading {}: is the cluster up? (`ember cluster up`)",
                path.display()
            )
        })?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    /// The topology of ranks it runs.
    pub fn topology(&self) -> Topology {
        Topology::parse(&self.spec.topology).expect("validated at up")
    }

    /// `mpirun --host` list: every GPU's address with its GCD ranks as slots.
    pub fn hosts(&self) -> String {
        let gcds = self.topology().dims()[0];
        self.gpus
            .iter()
            .map(|g| format!("{}:{gcds}", g.address))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The `mpirun` flags that start a job on the cluster (before the program).
    pub fn mpirun_args(&self, exe: &Path) -> Vec<String> {
        self.mpirun_args_on(exe, self.topology().world_size(), &self.hosts())
    }

    /// The `mpirun` flags that start `np` ranks on `hosts` of the cluster (`--host` syntax).
    pub fn mpirun_args_on(&self, exe: &Path, np: usize, hosts: &str) -> Vec<String> {
        let agent = format!(
            "{} cluster rsh --prefix {}",
            exe.display(),
            self.spec.prefix
        );
        [
            "-np",
            &np.to_string(),
            "--host",
            hosts,
            "--map-by",
            "slot",
            "--mca",
            "plm_rsh_agent",
            &agent,
            "--mca",
            "oob_tcp_if_include",
            RANGE,
            "--mca",
            "btl_tcp_if_include",
            RANGE,
            "--mca",
            "btl",
            "tcp,vader,self",
            "-x",
            &format!(
                "{CLUSTER_ENV}={}",
                Cluster::state_file(&self.spec.prefix).display()
            ),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }

    /// Ends the MPI daemons left in the cluster's namespaces: after mpirun is ended, those of
    /// a node it can no longer reach would wait for it until the node came back.
    pub fn end_daemons(&self) {
        for g in &self.gpus {
            let Ok(out) = Command::new("ip")
                .args(["netns", "pids", &g.namespace])
                .output()
            else {
                continue;
            };
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                let is_daemon = cmdline
                    .split(|&b| b == 0)
                    .next()
                    .is_some_and(|exe| exe.ends_with(b"orted"));
                if is_daemon && let Ok(pid) = pid.parse::<i32>() {
                    // SAFETY: a signal to an MPI daemon of this cluster's namespace.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
        }
    }

    /// Bytes that crossed the cluster's links so far, read from the kernel's interface
    /// counters of the root namespace (`/proc/1/net/dev`, readable from inside the GPU
    /// namespaces too): per GPU link and per uplink, both directions.
    pub fn link_bytes(&self) -> Result<LinkBytes> {
        let text = std::fs::read_to_string("/proc/1/net/dev")
            .context("reading /proc/1/net/dev (the root namespace's interface counters)")?;
        let counters = parse_net_dev(&text);
        let get = |name: &str| -> Result<(u64, u64)> {
            counters
                .get(name)
                .copied()
                .ok_or_else(|| anyhow!("interface {name} is missing: is the cluster still up?"))
        };
        let mut out = LinkBytes::default();
        for g in &self.gpus {
            // The bridge side: its rx is what left the GPU, its tx what entered it.
            let (rx, tx) = get(&g.namespace)?;
            out.gpu_links.push((g.namespace.clone(), rx, tx));
        }
        for u in &self.uplinks {
            // The node side: its tx leaves the node towards the hub.
            let (rx, tx) = get(u)?;
            out.uplinks.push((u.clone(), tx, rx));
        }
        Ok(out)
    }
}

/// Interface byte counters of an emulated cluster: `(name, bytes out, bytes in)` per link,
/// out meaning away from the GPU (for GPU links) or from the node (for uplinks).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LinkBytes {
    /// Per GPU link.
    pub gpu_links: Vec<(String, u64, u64)>,
    /// Per node uplink.
    pub uplinks: Vec<(String, u64, u64)>,
}

impl LinkBytes {
    /// What moved between `self` (earlier) and `later`.
    pub fn delta(&self, later: &LinkBytes) -> LinkBytes {
        let d = |a: &[(String, u64, u64)], b: &[(String, u64, u64)]| {
            a.iter()
                .zip(b)
                .map(|(x, y)| (x.0.clone(), y.1 - x.1, y.2 - x.2))
                .collect()
        };
        LinkBytes {
            gpu_links: d(&self.gpu_links, &later.gpu_links),
            uplinks: d(&self.uplinks, &later.uplinks),
        }
    }

    /// Bytes over all GPU links, both directions.
    pub fn gpu_total(&self) -> u64 {
        self.gpu_links.iter().map(|l| l.1 + l.2).sum()
    }

    /// Bytes over all uplinks, both directions.
    pub fn uplink_total(&self) -> u64 {
        self.uplinks.iter().map(|l| l.1 + l.2).sum()
    }
}

/// `name -> (rx_bytes, tx_bytes)` of a `/proc/net/dev` table.
fn parse_net_dev(text: &str) -> BTreeMap<String, (u64, u64)> {
    text.lines()
        .skip(2)
        .filter_map(|line| {
            let (name, rest) = line.split_once(':')?;
            let f: Vec<u64> = rest
                .split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect();
            Some((name.trim().to_string(), (*f.first()?, *f.get(8)?)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn net_dev_counters_parse() {
        let text = "Inter-|   Receive                                                |  Transmit\n \
                    face |bytes    packets errs drop fifo frame compressed multicast|bytes    \
                    packets errs drop fifo colls carrier compressed\n    lo: 100 2 0 0 0 0 0 0 \
                    100 2 0 0 0 0 0 0\nemb-n0g0: 12345 10 0 0 0 0 0 0 67890 20 0 0 0 0 0 0\n";
        let c = parse_net_dev(text);
        assert_eq!(c["emb-n0g0"], (12345, 67890));
        assert_eq!(c["lo"], (100, 100));
    }

    #[test]
    fn specs_are_checked() {
        let mut s = ClusterSpec {
            prefix: "emb".into(),
            topology: "2x2x2".into(),
            gpu_link_mbit: 133.0,
            uplink_mbit: 67.0,
        };
        assert!(s.validate().is_ok());
        s.prefix = "toolong".into();
        assert!(s.validate().unwrap_err().to_string().contains("--prefix"));
        s.prefix = "emb".into();
        s.uplink_mbit = 0.0;
        assert!(s.validate().unwrap_err().to_string().contains("--uplink"));
    }
}
