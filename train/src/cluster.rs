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
    /// Measured sustained TFLOP/s of one rank when every rank computes (see
    /// [`measure_rank_tflops`]).
    pub rank_tflops: f64,
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
        let agent = format!(
            "{} cluster rsh --prefix {}",
            exe.display(),
            self.spec.prefix
        );
        [
            "-np",
            &self.topology().world_size().to_string(),
            "--host",
            &self.hosts(),
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
    down(&spec.prefix)?;
    let ranks = topology.world_size();
    let rank_tflops = measure_rank_tflops(calibration, ranks)?;
    match build(spec, &topology, rank_tflops, calibration.describe(ranks)) {
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

/// `tbf` at `mbit` on `dev` (in namespace `ns` when given). The bucket holds a few
/// milliseconds of traffic, the queue 50 ms: enough for TCP to fill the link.
fn shape(ns: Option<&str>, dev: &str, mbit: f64) -> Result<()> {
    let rate = format!("{}kbit", (mbit * 1000.0).round() as u64);
    let burst = format!("{}", ((mbit * 1e6 / 8.0 * 0.002) as u64).max(16 * 1024));
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

fn build(
    spec: &ClusterSpec,
    topology: &Topology,
    rank_tflops: f64,
    calibration: String,
) -> Result<Cluster> {
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
        rank_tflops,
        calibration,
    };
    probe(&mut cluster)?;
    let state = serde_json::to_string_pretty(&cluster)?;
    std::fs::write(dir.join("cluster.json"), state)?;
    std::fs::write(dir.join("profile.toml"), profile_toml(&cluster))?;
    Ok(cluster)
}

/// Measures TCP round trips and one stream's throughput between GPU namespaces: over a GPU
/// link (two GPUs of node 0) and over the uplinks (GPU 0 of nodes 0 and 1), where they exist.
fn probe(c: &mut Cluster) -> Result<()> {
    let first = &c.gpus[0];
    let same_node = c
        .gpus
        .iter()
        .find(|g| g.node == 0 && g.namespace != first.namespace);
    let other_node = c.gpus.iter().find(|g| g.node == 1);
    for (tier, peer) in [("gpu", same_node), ("node", other_node)] {
        let Some(peer) = peer else { continue };
        let (rtt, mbit) = probe_pair(first, peer)
            .with_context(|| format!("probing {} <-> {}", first.namespace, peer.namespace))?;
        c.rtt_us.insert(tier.to_string(), rtt);
        c.probed_mbit.insert(tier.to_string(), mbit);
    }
    Ok(())
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

/// Round trip (microseconds, median of 200 one-byte echoes) and one stream's throughput
/// (Mbit/s, 2 MB) from `a` to `b`.
fn probe_pair(a: &Gpu, b: &Gpu) -> Result<(f64, f64)> {
    const PORT: u16 = 47_123;
    const BYTES: usize = 2 << 20;
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
    let client = std::thread::spawn(move || -> Result<(f64, f64)> {
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
        let t = Instant::now();
        s.write_all(&payload)?;
        s.read_exact(&mut byte)?;
        let mbit = BYTES as f64 * 8.0 / t.elapsed().as_secs_f64() / 1e6;
        Ok((rtts[100], mbit))
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
/// Link rates are the shaped rates (per direction); latencies are half the probed round trips;
/// the GCD level is shared memory inside one namespace.
pub fn profile_toml(c: &Cluster) -> String {
    let gbps = |mbit: f64| mbit / 8.0 / 1000.0;
    let lat = |tier: &str| c.rtt_us.get(tier).map_or(50.0, |r| r / 2.0);
    let dims = c.topology().dims();
    format!(
        "# The emulated cluster `{prefix}` ({topo}), written by `ember cluster up`.\n\
         name = \"emulated-{prefix}\"\n\
         # GB/s one rank gets on each level's links when all ranks send at once.\n\
         level_gbps = [[\"gcd\", {shm:?}], [\"gpu\", {gpu_rank:?}], [\"node\", {node_rank:?}]]\n\
         # Each level's link, per direction: a GPU's link is shared by its {gcds} GCD rank(s),\n\
         # a node's uplink by its {per_node} rank(s).\n\
         link_gbps = [[\"gcd\", {shm:?}], [\"gpu\", {gpu:?}], [\"node\", {node:?}]]\n\
         # One-way latency of a message over each level's links (half the probed TCP round \
         trip).\n\
         latency_us = [[\"gcd\", 5.0], [\"gpu\", {lat_gpu:.1}], [\"node\", {lat_node:.1}]]\n\
         # Compute of one rank when all ranks compute: {calibration}.\n\
         rank_tflops = {rank_tflops:.6}\n\
         peak_tflops = {rank_tflops:.6}\n\
         mfu = 1.0\n",
        calibration = c.calibration,
        rank_tflops = c.rank_tflops,
        prefix = c.spec.prefix,
        topo = c.spec.topology,
        shm = SHM_GBPS,
        gcds = dims[0],
        per_node = dims[0] * dims[1],
        gpu = gbps(c.spec.gpu_link_mbit),
        node = gbps(c.spec.uplink_mbit),
        gpu_rank = gbps(c.spec.gpu_link_mbit) / dims[0] as f64,
        node_rank = gbps(c.spec.uplink_mbit) / (dims[0] * dims[1]) as f64,
        lat_gpu = lat("gpu"),
        lat_node = lat("node"),
    )
}

/// The model step `up` times to measure the compute rate of one rank.
#[derive(Debug, Clone)]
pub struct Calibration {
    /// The model.
    pub model: ember_model::GptConfig,
    /// Its preset's name, for the record.
    pub preset: String,
    /// Sequences per step (of the model's block size).
    pub sequences: usize,
}

impl Calibration {
    fn describe(&self, ranks: usize) -> String {
        format!(
            "a {} forward + backward of {} x {} tokens on one thread, times {} core(s) / {ranks} \
             ranks",
            self.preset,
            self.sequences,
            self.model.block_size,
            cores()
        )
    }
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The sustained model TFLOP/s of one rank of `ranks` on this machine: a training step's
/// forward and backward of `c` timed on one thread (the median of 5 after 2 warm-ups), times
/// the cores each rank gets when all compute (at most one).
pub fn measure_rank_tflops(c: &Calibration, ranks: usize) -> Result<f64> {
    use burn::tensor::{Device, Int, Tensor, TensorData};
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .context("starting a one-thread pool")?;
    let t = c.model.block_size;
    let tokens = c.sequences * t;
    let secs = pool.install(|| {
        let device = Device::flex().autodiff();
        let model = c.model.init(&device);
        let ids = |salt: i64| -> Tensor<2, Int> {
            let v: Vec<i64> = (0..tokens as i64)
                .map(|i| (i * 7 + salt) % c.model.vocab_size as i64)
                .collect();
            Tensor::from_data(TensorData::new(v, [c.sequences, t]), &device)
        };
        let mut times: Vec<f64> = (0..7)
            .map(|i| {
                let start = Instant::now();
                let (_, loss) = model.forward_loss(ids(i), ids(i + 1), None);
                drop(loss.backward());
                start.elapsed().as_secs_f64()
            })
            .skip(2)
            .collect();
        times.sort_by(f64::total_cmp);
        times[times.len() / 2]
    });
    let flops = c.model.train_flops_per_token(t) * tokens as f64;
    let share = (cores() as f64 / ranks as f64).min(1.0);
    Ok(flops / secs * share / 1e12)
}

/// Shared-memory bandwidth assumed for the GCD level of an emulated cluster, GB/s.
const SHM_GBPS: f64 = 2.0;

/// The rsh agent: runs `command` (one shell command line, as `ssh` would) in the namespace of
/// the GPU whose address is `host`, under the node's hostname, with scratch directories of its
/// own (Open MPI names shared-memory files by hostname, which the node's GPUs share).
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
