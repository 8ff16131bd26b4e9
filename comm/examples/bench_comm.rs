//! Runs `ember_comm::bench::run_comm_bench` under mpirun until the `ember bench comm`
//! subcommand exists: `mpirun -np 8 target/release/examples/bench_comm --topology 2x2x2
//! [--sizes 4K,1M,64M] [--json] [--no-kernels] [--no-collectives] [--bytes-per-size 4G]`. Only rank 0 prints. Deliberately no CLI crate.

use ember_comm::bench::{BenchConfig, KernelBench, run_comm_bench};
use ember_comm::{Comm, CommConfig, Topology, TopologySource};

fn parse_size(s: &str) -> u64 {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>().expect("sizes like 4K,1M,256M") * mult
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .map(|i| args[i + 1].clone())
    };
    let topology = match value("--topology") {
        Some(t) => TopologySource::Explicit(Topology::parse(&t).unwrap_or_else(|e| panic!("{e}"))),
        None => TopologySource::Detect { gcds_per_gpu: None },
    };
    let comm = Comm::init(CommConfig {
        topology,
        ..Default::default()
    })
    .unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2)
    });
    let mut config = BenchConfig::full(&comm);
    if let Some(s) = value("--sizes") {
        config.sizes = s.split(',').map(parse_size).collect();
    }
    if let Some(b) = value("--bytes-per-size") {
        config.bytes_per_size = parse_size(&b);
    }
    if args.iter().any(|a| a == "--no-kernels") {
        config.kernels = KernelBench::Skip;
    }
    if args.iter().any(|a| a == "--no-collectives") {
        config.scopes.clear();
    }
    let json = args.iter().any(|a| a == "--json");
    let records = run_comm_bench(&comm, &config);
    if comm.rank() == 0 {
        if !json {
            println!(
                "{:<20} {:<14} {:>12} {:>6} {:>10} {:>10} {:>7} {:>8}",
                "op", "level", "bytes", "ranks", "ember GB/s", "base GB/s", "ratio", "baseline"
            );
        }
        for r in &records {
            if json {
                println!("{}", serde_json::to_string(r).expect("records serialise"));
            } else {
                println!(
                    "{:<20} {:<14} {:>12} {:>6} {:>10.3} {:>10.3} {:>7.3} {:>8}",
                    r.op, r.level, r.bytes, r.ranks, r.ember_gbps, r.mpi_gbps, r.ratio, r.baseline
                );
            }
        }
    }
}
