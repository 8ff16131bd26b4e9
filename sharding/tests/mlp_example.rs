//! The MLP example (`examples/mlp.rs`, a model that is not a GPT) trains under real `mpirun`
//! jobs: this test re-runs its own binary as the ranks, which call the example's `train`.

#[path = "../examples/mlp.rs"]
#[allow(dead_code)]
mod mlp;

use std::process::Command;

use ember_comm::{Comm, CommConfig, Topology, TopologySource};

const CHILD: &str = "EMBER_MLP_CHILD";

#[test]
fn the_mlp_example_trains_under_mpirun() {
    if let Ok(spec) = std::env::var(CHILD) {
        let (topology, preset) = spec.split_once(':').expect("TOPOLOGY:PRESET");
        let comm = Comm::init(CommConfig {
            topology: TopologySource::Explicit(Topology::parse(topology).unwrap()),
            ..CommConfig::default()
        })
        .unwrap();
        let (first, last) = mlp::train(&comm, preset, 300, 64).unwrap();
        assert!(
            last < 0.2 * first,
            "{preset} at {topology}: loss {first} -> {last} did not fall below a fifth"
        );
        return;
    }
    let exe = std::env::current_exe().unwrap();
    for (np, topology, preset) in [
        (4, "2x2x1", "zero3"),
        (4, "1x2x2", "hier3"),
        (2, "2x1x1", "ddp"),
    ] {
        let tmp =
            std::env::temp_dir().join(format!("ember-mlp-{}-{np}-{preset}", std::process::id()));
        std::fs::create_dir_all(&tmp).unwrap();
        let out = Command::new("timeout")
            .args([
                "--kill-after=5",
                "300",
                "mpirun",
                "-np",
                &np.to_string(),
                "--oversubscribe",
            ])
            .args(["--mca", "btl_vader_single_copy_mechanism", "none"])
            .args(["--mca", "orte_tmpdir_base"])
            .arg(&tmp)
            .args(["-x", "RAYON_NUM_THREADS=1", "-x", CHILD])
            .arg(&exe)
            .args([
                "--exact",
                "the_mlp_example_trains_under_mpirun",
                "--nocapture",
            ])
            .env(CHILD, format!("{topology}:{preset}"))
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .output()
            .expect("running mpirun (is openmpi-bin installed?)");
        let _ = std::fs::remove_dir_all(&tmp);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{preset} at {topology} failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("step  299 loss"), "{stdout}");
    }
}
