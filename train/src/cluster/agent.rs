//! The rsh agent `mpirun` starts ranks through: a command run inside a GPU's namespace.

use std::path::Path;
use std::process::Command;

use super::state::*;
use anyhow::{Context, Result, anyhow};

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
