//! An emulated cluster on one Linux machine, to rehearse a multi-node job at a cluster's link
//! speeds: every GPU is a network namespace holding its GCD ranks (which share memory), every
//! GPU reaches its node's bridge through a link shaped with `tbf`, and every node reaches the
//! others through one shaped uplink, so the node's GPUs share it as Frontier's GCDs share the
//! node's NICs. Ranks start through `mpirun` with an rsh agent (`ember cluster rsh`) that
//! enters the namespace. It needs root, `iproute2` (`ip`, `tc`) and `unshare`; it uses only
//! addresses of 198.18.0.0/15, which RFC 2544 reserves for benchmarking interconnects.
//!
//! Everything it creates carries the cluster's prefix, so [`down`] finds it again from the
//! names alone, also after a crash that lost the state file. It deliberately runs nothing
//! itself beyond the link probes: `ember cluster run` hands the job to `mpirun`.
//!
//! # Layout (prefix `emb`, node `n`, GPU `g`)
//!
//! | what | name | address |
//! |---|---|---|
//! | hub bridge (root namespace, where `mpirun` runs) | `emb-hub` | 198.18.0.1/16 |
//! | node bridge | `emb-n{n}` | - |
//! | node uplink, node side / hub side | `emb-n{n}u` / `emb-n{n}h` | - |
//! | GPU namespace | `emb-n{n}g{g}` | 198.18.{n+1}.{g+1}/16 on its `eth0` |
//! | GPU link, bridge side | `emb-n{n}g{g}` | - |
//!
//! Both ends of every shaped link carry a `tbf` qdisc, so each direction gets the full rate.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

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
    /// The compute and CPU costs measured on this machine (see [`calibrate`]).
    pub measured: Measured,
    /// Each tier's links as MPI moves data over them (see [`probe_links`]).
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
    pub cpu: ember_sharding::plumbing::profile::CpuProfile,
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
            cpu: ember_sharding::plumbing::profile::CpuProfile {
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

/// Measures TCP round trips and one stream's throughput between GPU namespaces: over a GPU
/// link (two GPUs of node 0) and over the uplinks (GPU 0 of nodes 0 and 1), where they exist.
/// Returns the CPU time spent per byte streamed (both ends and the TCP/IP stack), per tier.
fn probe(c: &mut Cluster) -> Result<BTreeMap<String, f64>> {
    let first = &c.gpus[0];
    let same_node = c
        .gpus
        .iter()
        .find(|g| g.node == 0 && g.namespace != first.namespace);
    let other_node = c.gpus.iter().find(|g| g.node == 1);
    let mut cpu = BTreeMap::new();
    for (tier, peer) in [("gpu", same_node), ("node", other_node)] {
        let Some(peer) = peer else { continue };
        let p = probe_pair(first, peer)
            .with_context(|| format!("probing {} <-> {}", first.namespace, peer.namespace))?;
        c.rtt_us.insert(tier.to_string(), p.rtt_us);
        c.probed_mbit.insert(tier.to_string(), p.mbit);
        cpu.insert(tier.to_string(), p.cpu_byte_s);
    }
    Ok(cpu)
}

/// What one probe measured.
struct Probe {
    rtt_us: f64,
    mbit: f64,
    cpu_byte_s: f64,
}

/// CPU time this process has used so far, seconds (user and system, every thread): the probe's
/// two ends, and the kernel's network path, which runs in the sending and receiving threads.
fn busy_cpu_s() -> f64 {
    // SAFETY: getrusage writes one `rusage` into the zeroed value it is handed.
    let usage = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// Enters network namespace `ns` on the calling thread only.
fn enter_namespace(ns: &str) -> Result<()> {
    let path = format!("/run/netns/{ns}");
    let file = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
    use std::os::fd::AsRawFd;
    // SAFETY: `file` is an open namespace file; setns changes only this thread's namespace.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc != 0 {
        bail!("setns into {ns}: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// Round trip (microseconds, median of 200 one-byte echoes), one stream's throughput (Mbit/s,
/// 8 MB) from `a` to `b`, and the machine's CPU time per byte of it.
fn probe_pair(a: &Gpu, b: &Gpu) -> Result<Probe> {
    const PORT: u16 = 47_123;
    const BYTES: usize = 8 << 20;
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let server_ns = b.namespace.clone();
    let server = std::thread::spawn(move || -> Result<()> {
        enter_namespace(&server_ns)?;
        let listener = TcpListener::bind((Ipv4Addr::UNSPECIFIED, PORT))?;
        let _ = ready_tx.send(());
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut byte = [0u8; 1];
        for _ in 0..200 {
            s.read_exact(&mut byte)?;
            s.write_all(&byte)?;
        }
        let mut buf = vec![0u8; 1 << 16];
        let mut got = 0;
        while got < BYTES {
            let n = s.read(&mut buf)?;
            if n == 0 {
                break;
            }
            got += n;
        }
        s.write_all(&[1])?;
        Ok(())
    });
    ready_rx
        .recv_timeout(Duration::from_secs(10))
        .map_err(|_| anyhow!("the probe server in {} did not start", b.namespace))?;
    let client_ns = a.namespace.clone();
    let addr: SocketAddr = format!("{}:{PORT}", b.address).parse()?;
    let client = std::thread::spawn(move || -> Result<Probe> {
        enter_namespace(&client_ns)?;
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10))?;
        s.set_nodelay(true)?;
        let mut rtts = Vec::with_capacity(200);
        let mut byte = [0u8; 1];
        for _ in 0..200 {
            let t = Instant::now();
            s.write_all(&byte)?;
            s.read_exact(&mut byte)?;
            rtts.push(t.elapsed().as_secs_f64() * 1e6);
        }
        rtts.sort_by(f64::total_cmp);
        let payload = vec![0u8; BYTES];
        let (t, cpu) = (Instant::now(), busy_cpu_s());
        s.write_all(&payload)?;
        s.read_exact(&mut byte)?;
        let mbit = BYTES as f64 * 8.0 / t.elapsed().as_secs_f64() / 1e6;
        Ok(Probe {
            rtt_us: rtts[100],
            mbit,
            cpu_byte_s: (busy_cpu_s() - cpu).max(0.0) / BYTES as f64,
        })
    });
    let result = client
        .join()
        .map_err(|_| anyhow!("the probe client panicked"))?;
    server
        .join()
        .map_err(|_| anyhow!("the probe server panicked"))??;
    result
}

/// The link profile of the cluster, for `ember plan --profile`.
///
/// Link rates and latencies are what ember's own collectives reach over each tier under MPI
/// ([`probe_links`]); the GCD level is shared memory inside one namespace, at the measured copy
/// rate. Compute and CPU costs are measured (`calibrate`).
pub fn profile_toml(c: &Cluster) -> Result<String> {
    let rate = |tier: &str, shaped: f64| c.probed_mbit.get(tier).copied().unwrap_or(shaped);
    let gbps = |mbit: f64| mbit / 8.0 / 1000.0;
    let lat = |tier: &str| c.rtt_us.get(tier).map_or(50.0, |r| r / 2.0);
    let dims = c.topology().dims();
    let m = &c.measured;
    let shm = 1e-9 / m.cpu.copy_byte_s;
    let mpi = |level: &str, field: fn(&MpiProbe) -> &Vec<(String, f64)>| {
        c.mpi
            .as_ref()
            .and_then(|m| field(m).iter().find(|l| l.0 == level).map(|l| l.1))
    };
    let gpu = mpi("gpu", |m| &m.link_gbps).unwrap_or(gbps(rate("gpu", c.spec.gpu_link_mbit)));
    let node = mpi("node", |m| &m.link_gbps).unwrap_or(gbps(rate("node", c.spec.uplink_mbit)));
    let lat = |tier: &str| mpi(tier, |m| &m.latency_us).unwrap_or(lat(tier));
    #[derive(Serialize)]
    struct File<'a> {
        name: String,
        level_gbps: Vec<(String, f64)>,
        link_gbps: Vec<(String, f64)>,
        latency_us: Vec<(String, f64)>,
        #[serde(skip_serializing_if = "Option::is_none")]
        flow_efficiency: Option<Vec<(String, f64)>>,
        rank_tflops: f64,
        peak_tflops: f64,
        mfu: f64,
        cpu: &'a ember_sharding::plumbing::profile::CpuProfile,
    }
    let names = ["gcd", "gpu", "node"].map(String::from);
    let file = File {
        name: format!("emulated-{}", c.spec.prefix),
        level_gbps: names
            .iter()
            .cloned()
            .zip([shm, gpu / dims[0] as f64, node / (dims[0] * dims[1]) as f64])
            .collect(),
        link_gbps: names.iter().cloned().zip([shm, gpu, node]).collect(),
        latency_us: names
            .iter()
            .cloned()
            .zip([5.0, lat("gpu"), lat("node")])
            .collect(),
        flow_efficiency: c
            .mpi
            .as_ref()
            .filter(|m| !m.flow_efficiency.is_empty())
            .map(|_| {
                let shared = |level: &str| mpi(level, |m| &m.flow_efficiency).unwrap_or(1.0);
                names
                    .iter()
                    .cloned()
                    .zip([1.0, shared("gpu"), shared("node")])
                    .collect()
            }),
        rank_tflops: m.rank_tflops,
        peak_tflops: m.rank_tflops,
        mfu: 1.0,
        cpu: &m.cpu,
    };
    Ok(format!(
        "# The emulated cluster `{}` ({}), written by `ember cluster up`: links as probed, \
         compute and CPU costs as measured ({}).\n{}",
        c.spec.prefix,
        c.spec.topology,
        m.calibration,
        toml::to_string(&file)?
    ))
}

/// The model whose training steps `up` times to measure the engine's compute.
#[derive(Debug, Clone)]
pub struct Calibration {
    /// The model.
    pub model: ember_model::GptConfig,
    /// Its preset's name (the calibration runs `ember bench shard --preset` with it).
    pub preset: String,
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Measures what the profile needs of this machine for `topology`'s ranks on its cores:
///
/// - the engine's compute: two single-process runs of `ember bench shard --shards zero3
///   --recompute none` on one thread (the calibration model at 1 and 4 sequences), whose step
///   times give the seconds per FLOP and per parameter a visit computes;
/// - the optimizer step, copies and quantization: timed here on one thread;
/// - the TCP/IP stack: `tcp_byte_s`, the CPU per byte of the probes.
///
/// Each rank gets the machine's cores over its ranks.
pub fn calibrate(
    c: &Calibration,
    topology: &Topology,
    tcp_byte_s: BTreeMap<String, f64>,
) -> Result<Measured> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .context("starting a one-thread pool")?;
    let (copy_byte_s, quant_element_s, optimizer_element_s) = pool.install(kernel_costs);
    let (flop_s, visit_param_s) = engine_costs(c, optimizer_element_s)?;
    let cores_per_rank = (cores() as f64 / topology.world_size() as f64).min(1.0);
    let tcp = |tier: &str| tcp_byte_s.get(tier).copied().unwrap_or(0.0);
    Ok(Measured {
        rank_tflops: cores_per_rank / flop_s / 1e12,
        cpu: ember_sharding::plumbing::profile::CpuProfile {
            cores_per_rank,
            // A shared-memory message is copied out and in.
            message_byte_s: vec![
                ("gcd".into(), 2.0 * copy_byte_s),
                ("gpu".into(), tcp("gpu")),
                ("node".into(), tcp("node")),
            ],
            copy_byte_s,
            quant_element_s,
            visit_param_s,
            optimizer_element_s,
        },
        calibration: format!(
            "{} at 1 and 4 x {} tokens on one thread; {} core(s) / {} ranks",
            c.preset,
            c.model.block_size,
            cores(),
            topology.world_size()
        ),
    })
}

/// Seconds per byte copied, per byte of int8 quantized and dequantized, and per AdamW element,
/// on the calling thread.
fn kernel_costs() -> (f64, f64, f64) {
    use burn::tensor::{Device, Tensor, TensorData};
    use ember_comm::quant::host::HostKernels;
    use ember_comm::quant::{BlockSize, QuantFormat, QuantKernels};
    const N: usize = 1 << 22;
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let src: Vec<f32> = (0..N).map(|i| (i % 977) as f32 * 1e-3).collect();
    let mut dst = vec![0.0f32; N];
    let copy = median(
        (0..5)
            .map(|_| {
                let t = Instant::now();
                dst.copy_from_slice(std::hint::black_box(&src));
                t.elapsed().as_secs_f64()
            })
            .collect(),
    ) / (4 * N) as f64;
    let block = BlockSize::new(ember_sharding::config::DEFAULT_QUANT_BLOCK).expect("valid");
    let quant = median(
        (0..5)
            .map(|_| {
                let t = Instant::now();
                let q = HostKernels.quantize(&src, QuantFormat::Int8, block);
                std::hint::black_box(HostKernels.dequantize(&q));
                t.elapsed().as_secs_f64()
            })
            .collect(),
    ) / N as f64;
    let device = Device::flex();
    let tensor = |v: Vec<f32>| Tensor::<1>::from_data(TensorData::new(v, [N]), &device);
    let mut state =
        ember_sharding::FlatState::new(tensor(src.clone()), 2, std::iter::once(0..N).collect());
    let adam = ember_sharding::AdamW {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        decay_on: ember_sharding::DecayOn::Matrices,
    };
    let optimizer = median(
        (1..=5)
            .map(|step| {
                let grad = tensor(src.clone());
                let t = Instant::now();
                ember_sharding::Optimizer::update(&adam, step, 1e-3, &mut state, grad);
                t.elapsed().as_secs_f64()
            })
            .collect(),
    ) / N as f64;
    (copy, quant, optimizer)
}

/// Seconds per FLOP and per parameter a visit computes, fitted to two single-process, one-thread
/// runs of the engine on the calibration model (1 and 4 sequences).
fn engine_costs(c: &Calibration, optimizer_element_s: f64) -> Result<(f64, f64)> {
    use ember_sharding::plumbing::schedule::Event;
    let exe = std::env::current_exe().context("locating this binary")?;
    let one = Topology::parse("1").expect("valid");
    let mut points = Vec::new();
    for batch in [1usize, 4] {
        let out = Command::new(&exe)
            .args(["bench", "shard", "--shards", "zero3", "--recompute", "none"])
            .args(["--preset", &c.preset, "--topology", "1", "--json"])
            .args([
                "--batch-size",
                &batch.to_string(),
                "--steps",
                "4",
                "--warmup",
                "2",
            ])
            .env("RAYON_NUM_THREADS", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .env_remove(CLUSTER_ENV)
            .output()
            .context("running the calibration step")?;
        let text = String::from_utf8_lossy(&out.stdout);
        let row: serde_json::Value = text
            .lines()
            .find_map(|l| serde_json::from_str(l).ok())
            .ok_or_else(|| {
                anyhow!(
                    "the calibration step printed no result: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                )
            })?;
        let step_s = row["step_ms_median"].as_f64().unwrap_or(f64::NAN) / 1e3;
        let mut shard = ember_sharding::ShardConfig::preset("zero3", 3).expect("a preset");
        shard.recompute = ember_sharding::Recompute::None;
        let plan = crate::planning::gpt_plan(
            &c.model,
            &one,
            shard,
            batch,
            1,
            c.model.block_size,
            crate::config::DeviceKind::Flex,
        )?;
        let (mut flops, mut params) = (0.0, 0.0);
        for e in plan.schedule(1) {
            if let Event::Visit(v) = e {
                let f = plan.flops[v.stage];
                flops += match (v.backward, plan.keeps_graph(v.stage)) {
                    (false, _) => f,
                    (true, true) => 2.0 * f,
                    (true, false) => 3.0 * f,
                };
                params += plan.units[v.stage]
                    .needs
                    .iter()
                    .map(|&u| plan.units[u].numel as f64)
                    .sum::<f64>();
            }
        }
        let optimizer = plan.numel() as f64 * optimizer_element_s;
        points.push((flops, params, step_s - optimizer));
    }
    // step = flops x a + params x b, at two batch sizes (the parameters are the same).
    let ((f1, p1, t1), (f4, _, t4)) = (points[0], points[1]);
    let a = (t4 - t1) / (f4 - f1);
    let b = ((t1 - f1 * a) / p1).max(0.0);
    if !(a.is_finite() && a > 0.0) {
        bail!("the calibration steps took {t1:.4} s and {t4:.4} s: no compute rate fits them");
    }
    Ok((a, b))
}

/// Runs [`probe_links`] on every rank of the cluster through `mpirun` and reads what rank 0
/// wrote.
fn probe_through_mpi(c: &Cluster) -> Result<MpiProbe> {
    let exe = std::env::current_exe().context("locating this binary")?;
    let out = c.dir.join("mpi-probe.json");
    let _ = std::fs::remove_file(&out);
    let status = Command::new("mpirun")
        .args(c.mpirun_args(&exe))
        .args(["-x", "RAYON_NUM_THREADS=1"])
        .arg(&exe)
        .args(["cluster", "probe", "--out"])
        .arg(&out)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .context("running mpirun for the link probe (is openmpi-bin installed?)")?;
    if !status.success() {
        bail!("the link probe under mpirun failed ({status})");
    }
    let text =
        std::fs::read_to_string(&out).with_context(|| format!("reading {}", out.display()))?;
    Ok(serde_json::from_str(&text)?)
}

/// The message one rank sends per step of the link probe. A training step's ring steps send
/// a unit's buffer over the group's size: 80-400 KB for ddp's gradients of `small-cpu` at 8
/// ranks, less for the quantized presets. A shaped link's rate depends on the message: measured on a 2x2x2 cluster with 4x uplinks,
/// 1 MiB ran at 74% of the GPU links' shaped rate and left the plan 1.26-1.30x the measured
/// step of the presets bound by them; 256 KiB ran at 87%, and 1.09-1.10x.
pub const PROBE_BYTES: usize = 256 << 10;

/// The link probe every rank runs. For each level from the GPU out, the ranks under one link
/// of the level above (a node's, or the world) all-gather in ember's ring, whose every step
/// sends one block over each of the level's links, as a step's collectives do back to back:
///
/// - the latency is 20 one-byte rings back to back, per ring step (the slowest rank's time);
/// - the rate is the busiest link's bytes (by `ember_sharding::network`, the algorithm the
///   collectives run) over the median of 5 timed rings of [`PROBE_BYTES`] per rank (after 2
///   warm-ups, from a common start, until the slowest rank is done).
///
/// The ring puts one flow (one rank pair's messages) on each direction of each link. The flow
/// efficiency is then timed the same way with every rank all-gathering [`PROBE_BYTES`] with
/// its peers across the level, which puts the messages of every rank under a link on it at
/// once: its busiest link's rate over the ring's.
///
/// A level whose links are not the bottleneck at the shaped rates (an uplink at least as fast
/// as its GPUs' links together, which all its traffic crosses first) cannot be timed this
/// way: it gets its shaped rate scaled by the efficiency measured on the levels that could, and
/// their mean flow efficiency. Rank 0 writes the result to `out`.
pub fn probe_links(out: &Path) -> Result<()> {
    use ember_comm::{Comm, CommConfig, Op, Scope};
    use ember_sharding::plumbing::network::Network;
    use ember_sharding::plumbing::plan::{Collective, Levels};
    const PER_RANK: usize = PROBE_BYTES;
    let comm = Comm::init(CommConfig::default())?;
    let t = comm.topology().clone();
    let state = std::env::var(CLUSTER_ENV)
        .map_err(|_| anyhow!("{CLUSTER_ENV} is not set: run the probe through ember cluster"))?;
    let spec = Cluster::load(Path::new(&state))?.spec;
    let shaped = [f64::INFINITY, spec.gpu_link_mbit, spec.uplink_mbit].map(|m| m / 8e3);
    let mut unit = ember_sharding::plumbing::profile::Profile::frontier();
    unit.link_gbps = Some(t.levels().iter().map(|l| (l.name.clone(), 1.0)).collect());
    let mut net = Network::new(&t, &unit);
    // The slowest rank's time of `f`, from a common start.
    let slowest = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        comm.barrier();
        let start = Instant::now();
        f()?;
        let mine = start.elapsed().as_secs_f64();
        let all = comm.world().all_gather(&mine.to_le_bytes())?;
        Ok(all
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
            .fold(0.0, f64::max))
    };
    // The median of 5 timed runs of `f` after 2 warm-ups.
    let median = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        let mut times = Vec::new();
        for i in 0..7 {
            let s = slowest(f)?;
            if i >= 2 {
                times.push(s);
            }
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    };
    // The level of `busy` (seconds at 1 GB/s per level) that bounds it at the shaped rates.
    let bottleneck = |busy: &[f64], level: usize| {
        (1..=level)
            .max_by(|&a, &b| (busy[a] / shaped[a]).total_cmp(&(busy[b] / shaped[b])))
            .expect("a level")
    };
    let mut measured: Vec<(usize, f64, f64)> = Vec::new(); // (level, GB/s, latency s)
    let mut unidentified: Vec<(usize, f64)> = Vec::new(); // (level, latency s)
    let mut shared: Vec<(usize, f64)> = Vec::new(); // (level, flow efficiency)
    for level in 1..t.depth() {
        let group = comm.try_group(Scope::Within(level))?;
        let g = group.size();
        if g < 2 {
            continue;
        }
        let one = [1u8];
        let latency = slowest(&mut || {
            for _ in 0..20 {
                group.all_gather(&one)?;
            }
            Ok(())
        })? / (20 * (g - 1)) as f64;
        let data = vec![1u8; PER_RANK];
        let seconds = median(&mut || group.all_gather(&data).map(|_| ()).map_err(Into::into))?;
        // Seconds of each level's busiest link at 1 GB/s: its gigabytes.
        let busy = net
            .cost(&Collective::new(
                Levels {
                    lo: 0,
                    hi: level + 1,
                },
                Op::AllGather,
                (PER_RANK * g) as u64,
            ))
            .busy_s;
        if busy[level] <= 0.0 {
            // No link of this level in the group (a node of one GPU): nothing to measure.
            continue;
        }
        if bottleneck(&busy, level) != level {
            unidentified.push((level, latency));
            continue;
        }
        let one = busy[level] / seconds;
        measured.push((level, one, latency));
        let peers = comm.try_group(Scope::Across(level))?;
        let across = net.cost(&Collective::new(
            Levels {
                lo: level,
                hi: level + 1,
            },
            Op::AllGather,
            (PER_RANK * peers.size()) as u64,
        ));
        if across.flows[level] > 1 && bottleneck(&across.busy_s, level) == level {
            let seconds = median(&mut || peers.all_gather(&data).map(|_| ()).map_err(Into::into))?;
            shared.push((level, (across.busy_s[level] / seconds / one).min(1.0)));
        }
    }
    let efficiency = {
        let e: Vec<f64> = measured.iter().map(|&(l, r, _)| r / shaped[l]).collect();
        if e.is_empty() {
            1.0
        } else {
            e.iter().sum::<f64>() / e.len() as f64
        }
    };
    let mut all: Vec<(usize, f64, f64)> = measured;
    all.extend(
        unidentified
            .into_iter()
            .map(|(l, lat)| (l, shaped[l] * efficiency, lat)),
    );
    all.sort_by_key(|x| x.0);
    let mean_shared =
        (!shared.is_empty()).then(|| shared.iter().map(|s| s.1).sum::<f64>() / shared.len() as f64);
    let probe = MpiProbe {
        flow_efficiency: mean_shared.map_or_else(Vec::new, |mean| {
            all.iter()
                .map(|&(l, _, _)| {
                    let e = shared.iter().find(|s| s.0 == l).map_or(mean, |s| s.1);
                    (t.levels()[l].name.clone(), e)
                })
                .collect()
        }),
        link_gbps: all
            .iter()
            .map(|&(l, r, _)| (t.levels()[l].name.clone(), r))
            .collect(),
        latency_us: all
            .iter()
            .map(|&(l, _, lat)| (t.levels()[l].name.clone(), lat * 1e6))
            .collect(),
    };
    if comm.rank() == 0 {
        std::fs::write(out, serde_json::to_string(&probe)?)
            .with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

/// The rsh agent: runs `command` (one shell command line, as `ssh` would) in the namespace of
/// the GPU whose address is `host`, under the node's hostname, with scratch directories of its
/// own (Open MPI names shared-memory files by hostname, which the node's GPUs share), and
/// `EMBER_GCDS_PER_GPU` set to the cluster's GCDs per GPU.
pub fn rsh(prefix: &str, host: &str, command: &[String]) -> Result<std::process::ExitStatus> {
    let cluster = Cluster::load(&Cluster::state_file(prefix))?;
    let gpu = cluster
        .gpus
        .iter()
        .find(|g| g.address == host)
        .ok_or_else(|| anyhow!("host {host} is not a GPU of cluster {prefix}"))?;
    let tmp = cluster.dir.join("tmp").join(&gpu.namespace);
    let shm = Path::new("/dev/shm").join(&gpu.namespace);
    std::fs::create_dir_all(&tmp)?;
    std::fs::create_dir_all(&shm)?;
    let script = format!("hostname {} && exec {}", gpu.hostname, command.join(" "));
    Command::new("ip")
        .args([
            "netns",
            "exec",
            &gpu.namespace,
            "unshare",
            "--uts",
            "sh",
            "-c",
        ])
        .arg(script)
        .env("TMPDIR", &tmp)
        .env("OMPI_MCA_btl_vader_backing_directory", &shm)
        // The documented hint for GCDs per GPU: a node of one GPU has one namespace, whose
        // shared-memory domain is the whole host.
        .env(
            ember_comm::comm::GCDS_PER_GPU_ENV,
            cluster.topology().dims()[0].to_string(),
        )
        .status()
        .context("running ip netns exec")
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
