//! `ember cluster`: bring an emulated cluster up or down, run a job on it, and the rsh agent
//! `mpirun` enters its namespaces with.

use std::path::PathBuf;

use clap::{Args, Subcommand};

use ember_model::GptConfig;
use ember_train::cluster::{self, Calibration, Cluster, ClusterSpec};
use ember_train::error::{CliResult, usage};

#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// Bring up NODESxGPUSxGCDS as network namespaces with shaped links (needs root,
    /// iproute2); removes leftovers of the same prefix first
    Up(UpArgs),
    /// Remove the cluster: namespaces, links, state (idempotent)
    Down(PrefixArgs),
    /// Print the cluster's state and its links' byte counters
    Status(PrefixArgs),
    /// Run a program on every rank of the cluster through mpirun, e.g.
    /// `ember cluster run -- ember bench shard --topology 2x4x2`
    Run(RunArgs),
    /// The rsh agent mpirun calls: runs COMMAND in the namespace of HOST
    #[command(hide = true)]
    Rsh(RshArgs),
    /// Measures each tier's links through MPI (run under mpirun on the cluster; `up` runs it)
    #[command(hide = true)]
    Probe(ProbeArgs),
}

#[derive(Debug, Args)]
pub struct ProbeArgs {
    /// Where rank 0 writes the measurements (JSON)
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Debug, Args)]
pub struct PrefixArgs {
    /// Prefix of the cluster's names
    #[arg(long, default_value = "emb")]
    pub prefix: String,
}

#[derive(Debug, Args)]
pub struct UpArgs {
    /// Nodes x GPUs per node x GCD ranks per GPU
    #[arg(long, default_value = "2x4x2")]
    pub topology: String,
    /// Rate of each GPU's link, each direction (Mbit/s); its GCDs share it
    #[arg(long, default_value_t = 133.0)]
    pub gpu_link: f64,
    /// Rate of each node's uplink, each direction (Mbit/s); its GPUs share it
    #[arg(long, default_value_t = 67.0)]
    pub uplink: f64,
    /// Prefix of the cluster's names (1 to 4 lower-case letters)
    #[arg(long, default_value = "emb")]
    pub prefix: String,
    /// Model preset whose forward and backward measure one rank's compute rate
    #[arg(long, default_value = "small-cpu")]
    pub calibrate: String,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Prefix of the cluster's names
    #[arg(long, default_value = "emb")]
    pub prefix: String,
    /// An extra mpirun argument (repeatable), e.g. --mpi=--timeout --mpi=600
    #[arg(long = "mpi", allow_hyphen_values = true)]
    pub mpi: Vec<String>,
    /// The program and its arguments (`ember` means this binary)
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

#[derive(Debug, Args)]
pub struct RshArgs {
    /// Prefix of the cluster's names
    #[arg(long, default_value = "emb")]
    pub prefix: String,
    /// A GPU's address
    pub host: String,
    /// The command line to run there
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub command: Vec<String>,
}

pub fn run(command: ClusterCommand) -> CliResult<()> {
    match command {
        ClusterCommand::Up(a) => {
            let model = GptConfig::preset(&a.calibrate)
                .ok_or_else(|| usage(format!("--calibrate {}: not a model preset", a.calibrate)))?;
            let spec = ClusterSpec {
                prefix: a.prefix,
                topology: a.topology,
                gpu_link_mbit: a.gpu_link,
                uplink_mbit: a.uplink,
            };
            spec.validate().map_err(|e| usage(format!("{e:#}")))?;
            let calibration = Calibration {
                model,
                preset: a.calibrate,
            };
            let c = cluster::up(&spec, &calibration)?;
            print_up(&c);
            Ok(())
        }
        ClusterCommand::Down(a) => {
            let removed = cluster::down(&a.prefix)?;
            eprintln!(
                "[ember] cluster {}: removed {} item(s)",
                a.prefix,
                removed.len()
            );
            Ok(())
        }
        ClusterCommand::Status(a) => {
            let c = Cluster::load(&Cluster::state_file(&a.prefix))?;
            let bytes = c.link_bytes()?;
            println!("{}", serde_json::to_string_pretty(&c).expect("plain data"));
            for (name, out, inb) in bytes.gpu_links.iter().chain(&bytes.uplinks) {
                println!("{name:<12} out {out:>14} B   in {inb:>14} B");
            }
            Ok(())
        }
        ClusterCommand::Run(a) => {
            let c = Cluster::load(&Cluster::state_file(&a.prefix))?;
            let exe = std::env::current_exe()
                .map_err(|e| anyhow::anyhow!("locating this binary: {e}"))?;
            let mut program = a.command.clone();
            if program[0] == "ember" {
                program[0] = exe.display().to_string();
            }
            let mut child = std::process::Command::new("mpirun")
                .args(c.mpirun_args(&exe))
                .args(&a.mpi)
                .args(&program)
                .stderr(std::process::Stdio::piped())
                .spawn()
                .map_err(|e| anyhow::anyhow!("running mpirun: {e} (is openmpi-bin installed?)"))?;
            // Open MPI's rsh launcher warns when an agent has exec'd before it could set the
            // agent's process group, which is harmless; everything else passes through.
            let stderr = child.stderr.take().expect("piped");
            for line in
                std::io::BufRead::lines(std::io::BufReader::new(stderr)).map_while(Result::ok)
            {
                if !line.contains("plm:rsh: Warning: setpgid") {
                    eprintln!("{line}");
                }
            }
            let status = child
                .wait()
                .map_err(|e| anyhow::anyhow!("waiting for mpirun: {e}"))?;
            if status.success() {
                Ok(())
            } else {
                Err(anyhow::anyhow!("the job failed ({status})").into())
            }
        }
        ClusterCommand::Probe(a) => cluster::probe_links(&a.out).map_err(Into::into),
        ClusterCommand::Rsh(a) => {
            let status = cluster::rsh(&a.prefix, &a.host, &a.command)?;
            std::process::exit(status.code().unwrap_or(1));
        }
    }
}

fn print_up(c: &Cluster) {
    let t = c.topology();
    let dims = t.dims();
    eprintln!(
        "[ember] cluster {} up: {} node(s) x {} GPU(s) x {} GCD rank(s); GPU links {} Mbit/s, \
         uplinks {} Mbit/s",
        c.spec.prefix, dims[2], dims[1], dims[0], c.spec.gpu_link_mbit, c.spec.uplink_mbit
    );
    for (tier, rtt) in &c.rtt_us {
        eprintln!(
            "[ember]   probed over the {tier} tier: round trip {rtt:.0} us, one TCP stream {:.1} \
             Mbit/s",
            c.probed_mbit.get(tier).copied().unwrap_or(f64::NAN)
        );
    }
    let m = &c.measured;
    eprintln!(
        "[ember]   one rank computes {:.2} GFLOP/s on {:.2} core(s); per visit {:.2} ns per \
         parameter, AdamW {:.2} ns per element, copies {:.3} ns/B, int8 round trip {:.3} ns per element, \
         TCP/IP {} ({})",
        m.rank_tflops * 1e3,
        m.cpu.cores_per_rank,
        m.cpu.visit_param_s * 1e9,
        m.cpu.optimizer_element_s * 1e9,
        m.cpu.copy_byte_s * 1e9,
        m.cpu.quant_element_s * 1e9,
        m.cpu
            .message_byte_s
            .iter()
            .skip(1)
            .map(|(n, s)| format!("{n} {:.2} ns/B", s * 1e9))
            .collect::<Vec<_>>()
            .join(", "),
        m.calibration
    );
    let profile: PathBuf = c.dir.join("profile.toml");
    eprintln!("[ember]   profile: {}", profile.display());
    eprintln!(
        "[ember]   run a job: ember cluster run -- ember bench shard --topology {}",
        c.spec.topology
    );
    eprintln!(
        "[ember]   remove it: ember cluster down --prefix {}",
        c.spec.prefix
    );
}
