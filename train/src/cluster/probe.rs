//! The links measured: TCP between GPU namespaces (round trips, one stream's rate, the CPU
//! per byte), and ember's own collectives over every tier under `mpirun` (`probe_links`).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use super::state::*;
use anyhow::{Context, Result, anyhow, bail};

/// Measures TCP round trips and one stream's throughput between GPU namespaces: over a GPU
/// link (two GPUs of node 0) and over the uplinks (GPU 0 of nodes 0 and 1), where they exist.
/// Returns the CPU time spent per byte streamed (both ends and the TCP/IP stack), per tier.
pub(super) fn probe(c: &mut Cluster) -> Result<BTreeMap<String, f64>> {
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

/// Runs [`probe_links`] on every rank of the cluster through `mpirun` and reads what rank 0
/// wrote.
pub(super) fn probe_through_mpi(c: &Cluster) -> Result<MpiProbe> {
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
    use ember_sharding::plan::network::Network;
    use ember_sharding::plan::{Collective, Levels};
    const PER_RANK: usize = PROBE_BYTES;
    let comm = Comm::init(CommConfig::default())?;
    let t = comm.topology().clone();
    let state = std::env::var(CLUSTER_ENV)
        .map_err(|_| anyhow!("{CLUSTER_ENV} is not set: run the probe through ember cluster"))?;
    let spec = Cluster::load(Path::new(&state))?.spec;
    let shaped = [f64::INFINITY, spec.gpu_link_mbit, spec.uplink_mbit].map(|m| m / 8e3);
    let mut unit = ember_sharding::plan::profile::Profile::frontier();
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
