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
//!
//! The files: `state` (what is asked for and what was built), `net` (namespaces, bridges,
//! shaped links), `probe` (the links measured), `calibrate` (the machine measured, and the
//! profile), `agent` (the rsh agent).

mod agent;
mod calibrate;
mod net;
mod probe;
mod state;

pub use agent::rsh;
pub use calibrate::{Calibration, calibrate, profile_toml};
pub use net::{down, up};
pub use probe::{PROBE_BYTES, probe_links};
pub use state::{
    CLUSTER_ENV, Cluster, ClusterSpec, Gpu, LinkBytes, Measured, MpiProbe, RANGE, STATE_ROOT,
};
