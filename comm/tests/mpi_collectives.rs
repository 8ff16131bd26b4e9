//! Flat collectives under real `mpirun` at every test topology: every op, every
//! element type, against a sequential reference each rank computes from the inputs it can
//! regenerate; and the bytes handed to MPI against the formulas. Path (hierarchical)
//! collectives over every path of every prefix group against the flat collective on that
//! group, bit for bit, with per-hop byte counters.

mod common;

use common::*;
use ember_comm::counters::{Counters, formula};
use ember_comm::hier::{all_gather_path, reduce_scatter_path};
use ember_comm::path::all_paths;
use ember_comm::{Bf16, Comm, Element, Group, Op, Path, Reduce, Role, Scope, ShardLayout, Traffic};
use mpi::raw::AsRaw;

/// What the sequential reference needs to know about an element type.
trait Checked: Element {
    fn input(rank: usize, n: usize, salt: usize) -> Vec<Self>;
    fn add(a: Self, b: Self) -> Self;
    /// `Some(sum / g)` for floating types; `None` where Mean must be refused.
    fn mean(sum: Self, g: usize) -> Option<Self>;
}

impl Checked for f32 {
    fn input(rank: usize, n: usize, salt: usize) -> Vec<Self> {
        f32_input(rank, n, salt)
    }
    fn add(a: Self, b: Self) -> Self {
        a + b
    }
    fn mean(sum: Self, g: usize) -> Option<Self> {
        Some(sum / g as f32)
    }
}

impl Checked for Bf16 {
    fn input(rank: usize, n: usize, salt: usize) -> Vec<Self> {
        bf16_input(rank, n, salt)
    }
    fn add(a: Self, b: Self) -> Self {
        Bf16::from_f32(a.to_f32() + b.to_f32())
    }
    fn mean(sum: Self, g: usize) -> Option<Self> {
        Some(Bf16::from_f32(sum.to_f32() / g as f32))
    }
}

impl Checked for u8 {
    fn input(rank: usize, n: usize, salt: usize) -> Vec<Self> {
        u8_input(rank, n, salt)
    }
    fn add(a: Self, b: Self) -> Self {
        a.wrapping_add(b)
    }
    fn mean(_: Self, _: usize) -> Option<Self> {
        None
    }
}

impl Checked for i8 {
    fn input(rank: usize, n: usize, salt: usize) -> Vec<Self> {
        i8_input(rank, n, salt)
    }
    fn add(a: Self, b: Self) -> Self {
        a.wrapping_add(b)
    }
    fn mean(_: Self, _: usize) -> Option<Self> {
        None
    }
}

/// Asserts that exactly `op` on `bytes` was charged to `group`'s scope since the last reset.
fn assert_charged(comm: &Comm, group: &Group, op: Op, bytes: usize, role: Role) {
    let counters = comm.take_counters();
    let want = formula(op, bytes as u64, group.size(), role);
    assert_eq!(
        counters.get(group.scope(), op),
        want,
        "{op:?} on {:?}",
        group.scope()
    );
    assert_eq!(
        counters.entries().count(),
        usize::from(group.size() > 1),
        "one entry only (none for a group of one, which moves nothing)"
    );
}

fn padded_input<T: Checked>(rank: usize, n: usize, padded: usize, salt: usize) -> Vec<T> {
    let mut v = T::input(rank, n, salt);
    v.resize(padded, T::default());
    v
}

fn check_group<T: Checked>(comm: &Comm, group: Group, members: &[usize]) {
    let rank = comm.rank();
    let g = members.len();
    let me = group.index();
    let sz = size_of::<T>();
    comm.take_counters();

    // All-gather, blocking and non-blocking.
    let s = 5;
    let want: Vec<T> = members.iter().flat_map(|&m| T::input(m, s, 1)).collect();
    assert_eq!(group.all_gather(&T::input(rank, s, 1)).unwrap(), want);
    assert_charged(comm, &group, Op::AllGather, s * g * sz, Role::Member);

    // Reduce-scatter of a length that does not divide by g (padding rule).
    let n = 7 * g + 3;
    let layout = ShardLayout::new(n, g, 1);
    let inputs: Vec<Vec<T>> = members
        .iter()
        .map(|&m| padded_input(m, n, layout.padded(), 2))
        .collect();
    let sum_at = |i: usize| {
        inputs
            .iter()
            .skip(1)
            .fold(inputs[0][i], |acc, v| T::add(acc, v[i]))
    };
    let want: Vec<T> = layout.range(me).map(sum_at).collect();
    assert_eq!(
        group
            .reduce_scatter(&T::input(rank, n, 2), Reduce::Sum)
            .unwrap(),
        want
    );
    assert_charged(
        comm,
        &group,
        Op::ReduceScatter,
        layout.padded() * sz,
        Role::Member,
    );
    match T::mean(T::default(), g) {
        Some(_) => {
            let want_mean: Vec<T> = want.iter().map(|&x| T::mean(x, g).unwrap()).collect();
            let got = group
                .reduce_scatter(&T::input(rank, n, 2), Reduce::Mean)
                .unwrap();
            assert_eq!(got, want_mean);
        }
        None => {
            let err = group
                .reduce_scatter(&T::input(rank, n, 2), Reduce::Mean)
                .unwrap_err();
            assert!(err.to_string().contains("Reduce::Sum"), "{err}");
        }
    }
    comm.take_counters();

    // All-reduce.
    let n = 13;
    let inputs: Vec<Vec<T>> = members.iter().map(|&m| T::input(m, n, 3)).collect();
    let want: Vec<T> = (0..n)
        .map(|i| {
            inputs
                .iter()
                .skip(1)
                .fold(inputs[0][i], |a, v| T::add(a, v[i]))
        })
        .collect();
    assert_eq!(
        group
            .all_reduce(&T::input(rank, n, 3), Reduce::Sum)
            .unwrap(),
        want
    );
    assert_charged(comm, &group, Op::AllReduce, n * sz, Role::Member);

    // Broadcast from the last member.
    let root = g - 1;
    let role = if me == root { Role::Root } else { Role::Member };
    let want = T::input(members[root], 9, 4);
    let mut buf = T::input(rank, 9, 4);
    group.broadcast(&mut buf, root).unwrap();
    assert_eq!(buf, want);
    assert_charged(comm, &group, Op::Broadcast, 9 * sz, role);
    assert!(group.broadcast(&mut buf, g).is_err());

    // All-to-all of a length that does not divide by g.
    let n = 3 * g + 1;
    let layout = ShardLayout::new(n, g, 1);
    let want: Vec<T> = members
        .iter()
        .flat_map(|&m| padded_input::<T>(m, n, layout.padded(), 5)[layout.range(me)].to_vec())
        .collect();
    assert_eq!(group.all_to_all(&T::input(rank, n, 5)).unwrap(), want);
    assert_charged(
        comm,
        &group,
        Op::AllToAll,
        layout.padded() * sz,
        Role::Member,
    );
    comm.take_counters();
}

#[test]
fn flat_collectives_match_sequential_reference_at_every_topology() {
    if !is_child() {
        for t in TOPOLOGIES {
            mpirun_ok(
                "flat_collectives_match_sequential_reference_at_every_topology",
                t,
            );
        }
        return;
    }
    let comm = child_comm();
    let topo = comm.topology().clone();
    // Every spelling of a level range is one group: one communicator, one canonical scope.
    for lo in 0..topo.depth() {
        for hi in lo + 1..=topo.depth() {
            let canon = topo.span(lo, hi).unwrap();
            let mut spellings = vec![Scope::Span { lo, hi }];
            if lo == 0 {
                spellings.push(Scope::Within(hi - 1));
            }
            if hi == lo + 1 {
                spellings.push(Scope::Across(lo));
            }
            if (lo, hi) == (0, topo.depth()) {
                spellings.push(Scope::World);
            }
            for s in spellings {
                assert_eq!(comm.group(s).scope(), canon, "{s:?}");
                assert_eq!(comm.raw(s).as_raw(), comm.raw(canon).as_raw(), "{s:?}");
            }
        }
    }
    assert!(comm.try_group(Scope::Span { lo: 1, hi: 1 }).is_err());
    assert!(comm.try_group(Scope::Across(topo.depth())).is_err());
    // Every distinct group (spans included): membership from MPI == the pure definition, and
    // every collective on it == the sequential reference over those members.
    assert_eq!(topo.scopes().len(), topo.depth() * (topo.depth() + 1) / 2);
    for scope in topo.scopes() {
        let group = comm.group(scope);
        let members = topo.members(scope, comm.rank());
        assert_eq!(group.size(), members.len());
        assert_eq!(members[group.index()], comm.rank(), "{scope:?}");
        let ranks = group.all_gather(&[comm.rank() as u8]).unwrap();
        let want: Vec<u8> = members.iter().map(|&m| m as u8).collect();
        assert_eq!(ranks, want, "members of {scope:?}");
        comm.take_counters();
        check_group::<f32>(&comm, group, &members);
        check_group::<Bf16>(&comm, group, &members);
        check_group::<u8>(&comm, group, &members);
        check_group::<i8>(&comm, group, &members);
    }
    comm.barrier();
}

#[test]
fn topology_that_differs_from_world_size_is_refused_naming_both() {
    if !is_child() {
        let out = mpirun(
            "topology_that_differs_from_world_size_is_refused_naming_both",
            3,
            "2x2x1",
            std::time::Duration::from_secs(60),
            &[],
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    }
    let spec = std::env::var(TOPOLOGY_ENV).unwrap();
    let err = Comm::init(ember_comm::CommConfig {
        topology: ember_comm::TopologySource::Explicit(ember_comm::Topology::parse(&spec).unwrap()),
        ..Default::default()
    })
    .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains('4') && msg.contains('3'), "{msg}");
}

fn check_hier<T: Checked>(comm: &Comm, n: usize) {
    let topo = comm.topology().clone();
    let rank = comm.rank();
    let world = comm.world();
    let input = T::input(rank, n, 6);
    let flat = world.reduce_scatter(&input, Reduce::Sum).unwrap();
    comm.take_counters();
    let hier = ember_comm::hier::reduce_scatter(comm, &input, Reduce::Sum).unwrap();
    assert_eq!(hier, flat, "hierarchical reduce-scatter at {topo}");
    // Each level moved the buffer that was left after the inner levels, per the formula.
    let counters = comm.take_counters();
    let mut bytes = ShardLayout::new(n, topo.world_size(), 1).padded() * size_of::<T>();
    for (level, d) in topo.dims().into_iter().enumerate() {
        let want = if d == 1 {
            Default::default()
        } else {
            formula(Op::ReduceScatter, bytes as u64, d, Role::Member)
        };
        assert_eq!(
            counters.get(ember_comm::Scope::Across(level), Op::ReduceScatter),
            want
        );
        bytes /= d;
    }
    if T::mean(T::default(), 2).is_some() {
        let flat = world.reduce_scatter(&input, Reduce::Mean).unwrap();
        let hier = ember_comm::hier::reduce_scatter(comm, &input, Reduce::Mean).unwrap();
        assert_eq!(hier, flat);
    }
    // All-gather: the inverse layout.
    let shard = T::input(rank, 3, 7);
    let flat = world.all_gather(&shard).unwrap();
    let hier = ember_comm::hier::all_gather(comm, &shard).unwrap();
    assert_eq!(hier, flat, "hierarchical all-gather at {topo}");
}

#[test]
fn hierarchical_reduce_scatter_and_all_gather_equal_flat_at_every_topology() {
    if !is_child() {
        for t in TOPOLOGIES {
            mpirun_ok(
                "hierarchical_reduce_scatter_and_all_gather_equal_flat_at_every_topology",
                t,
            );
        }
        return;
    }
    let comm = child_comm();
    for n in [1, 8, 37, 1000] {
        check_hier::<f32>(&comm, n);
        check_hier::<Bf16>(&comm, n);
        check_hier::<u8>(&comm, n);
        check_hier::<i8>(&comm, n);
    }
    comm.barrier();
}

#[test]
fn topology_is_detected_from_shared_memory_and_the_gcd_environment() {
    if !is_child() {
        let out = mpirun(
            "topology_is_detected_from_shared_memory_and_the_gcd_environment",
            4,
            "detect",
            std::time::Duration::from_secs(60),
            &[(ember_comm::comm::GCDS_PER_GPU_ENV, "2")],
        );
        assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    }
    // One machine: every rank shares memory, so one node of 4 ranks = 2 GPUs x 2 GCDs.
    let comm = Comm::init(ember_comm::CommConfig::default()).unwrap();
    assert_eq!(comm.topology().to_string(), "1x2x2");
    assert_eq!(comm.topology().levels()[0].name, "gcd");
    comm.barrier();
}

/// What each hop of `path` is charged for a reduce-scatter of `bytes` (innermost hop first,
/// on the buffer the inner hops left) or an all-gather of a `bytes` shard (outermost hop
/// first, on the buffer it produces). Size-1 hops are charged nothing.
fn path_charges(comm: &Comm, path: &Path, op: Op, bytes: usize) -> Vec<(Scope, Traffic)> {
    let topo = comm.topology();
    let mut out = Vec::new();
    let mut bytes = bytes;
    let hops = path.hops(topo);
    let ordered: Vec<Scope> = match op {
        Op::AllGather => hops.into_iter().rev().collect(),
        _ => hops,
    };
    for hop in ordered {
        let d = topo.group_size(hop);
        if d == 1 {
            continue;
        }
        match op {
            Op::AllGather => {
                bytes *= d;
                out.push((hop, formula(op, bytes as u64, d, Role::Member)));
            }
            _ => {
                out.push((hop, formula(op, bytes as u64, d, Role::Member)));
                bytes /= d;
            }
        }
    }
    out
}

/// Asserts that `counters` hold exactly `charges` for `op`, nothing else.
fn assert_path_charged(counters: &Counters, op: Op, charges: &[(Scope, Traffic)], what: &str) {
    for (scope, want) in charges {
        assert_eq!(
            counters.get(*scope, op),
            *want,
            "{what}: {op:?} on {scope:?}"
        );
    }
    assert_eq!(
        counters.entries().count(),
        charges.len(),
        "{what}: only the hops"
    );
}

fn check_paths<T: Checked>(comm: &Comm, n: usize) {
    let topo = comm.topology().clone();
    let rank = comm.rank();
    let sz = size_of::<T>();
    for hi in 1..=topo.depth() {
        for path in all_paths(&topo, hi) {
            let what = format!("path {path} at {topo}, {:?}, n = {n}", T::DTYPE);
            let g = comm.group(path.group(&topo));
            let p = g.size();
            let input = T::input(rank, n, 8);

            // Reduce-scatter: flat on G == path, with the path's charges.
            let flat = g.reduce_scatter(&input, Reduce::Sum).unwrap();
            comm.take_counters();
            let got = reduce_scatter_path(comm, &input, &path, Reduce::Sum).unwrap();
            assert_eq!(got, flat, "reduce-scatter {what}");
            let counters = comm.take_counters();
            let padded = ShardLayout::new(n, p, 1).padded();
            let charges = path_charges(comm, &path, Op::ReduceScatter, padded * sz);
            assert_path_charged(&counters, Op::ReduceScatter, &charges, &what);
            if T::mean(T::default(), 2).is_some() {
                let flat = g.reduce_scatter(&input, Reduce::Mean).unwrap();
                let got = reduce_scatter_path(comm, &input, &path, Reduce::Mean).unwrap();
                assert_eq!(got, flat, "mean reduce-scatter {what}");
            } else {
                assert!(reduce_scatter_path(comm, &input, &path, Reduce::Mean).is_err());
            }
            comm.take_counters();

            // All-gather: the inverse layout.
            let shard = T::input(rank, 3, 9);
            let flat = g.all_gather(&shard).unwrap();
            comm.take_counters();
            let got = all_gather_path(comm, &shard, &path).unwrap();
            assert_eq!(got, flat, "all-gather {what}");
            let counters = comm.take_counters();
            let charges = path_charges(comm, &path, Op::AllGather, shard.len() * sz);
            assert_path_charged(&counters, Op::AllGather, &charges, &what);
        }
    }
}

#[test]
fn path_collectives_equal_flat_on_their_group_at_every_topology() {
    if !is_child() {
        for t in TOPOLOGIES {
            mpirun_ok(
                "path_collectives_equal_flat_on_their_group_at_every_topology",
                t,
            );
        }
        return;
    }
    let comm = child_comm();
    let topo = comm.topology().clone();
    for n in [1, 8, 37] {
        check_paths::<f32>(&comm, n);
        check_paths::<Bf16>(&comm, n);
        check_paths::<u8>(&comm, n);
        check_paths::<i8>(&comm, n);
    }

    // Two threads on the same groups at once, each on its own lane: a gather thread running
    // path all-gathers (lane 1) while the caller all-reduces on every hop's group (lane 0).
    let zero_pp = Path::from_names(&topo, &["gpu", "node"]).unwrap();
    let per_level = Path::per_level(&topo);
    let lane = comm.lane(1).unwrap();
    let want: Vec<Vec<f32>> = (0..6)
        .map(|k| {
            comm.world()
                .all_gather(&f32_input(comm.rank(), 4 + k, 10))
                .unwrap()
        })
        .collect();
    std::thread::scope(|scope| {
        let gathers = scope.spawn(|| {
            (0..6)
                .map(|k| {
                    let path = if k % 2 == 0 { &zero_pp } else { &per_level };
                    all_gather_path(&lane, &f32_input(comm.rank(), 4 + k, 10), path).unwrap()
                })
                .collect::<Vec<_>>()
        });
        let meanwhile = f32_input(comm.rank(), 10, 12);
        for hop in zero_pp.hops(&topo).into_iter().chain(per_level.hops(&topo)) {
            let sum = comm.group(hop).all_reduce(&meanwhile, Reduce::Sum).unwrap();
            let want: Vec<f32> = (0..10)
                .map(|i| {
                    topo.members(hop, comm.rank())
                        .iter()
                        .map(|&m| small(m, i, 12) as f32)
                        .sum()
                })
                .collect();
            assert_eq!(
                sum, want,
                "all-reduce on {hop:?} beside another lane's gathers"
            );
        }
        assert_eq!(gathers.join().unwrap(), want, "lane 1's gathers");
    });
    assert!(comm.lane(comm.lanes()).is_err());

    // A path for another depth is refused before anything moves.
    let deeper = ember_comm::Topology::new(
        (0..4)
            .map(|i| ember_comm::Level {
                name: format!("l{i}"),
                size: 1,
            })
            .collect(),
    )
    .unwrap();
    let err = all_gather_path(&comm, &[1.0f32], &Path::flat(&deeper)).unwrap_err();
    assert!(err.to_string().contains("built for 4 levels"), "{err}");
    comm.barrier();
}

/// What `Comm` says of GPU memory is what the MPI library says: Open MPI's own `ompi_info`
/// (where it is installed) reports whether it was built with CUDA buffer support, and the
/// rank's answer to `MPIX_Query_cuda_support` must agree; either way a CUDA run stages.
#[test]
fn device_memory_support_is_what_the_mpi_library_reports() {
    if !is_child() {
        let out = mpirun(
            "device_memory_support_is_what_the_mpi_library_reports",
            1,
            "1",
            std::time::Duration::from_secs(60),
            &[],
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let said = stdout
            .lines()
            .find_map(|l| l.split("cuda support: ").nth(1))
            .expect("the rank prints its answer");
        let built = std::process::Command::new("ompi_info")
            .args(["--parsable", "--all"])
            .output()
            .ok()
            .and_then(|o| {
                String::from_utf8_lossy(&o.stdout).lines().find_map(|l| {
                    l.strip_prefix("mca:opal:base:param:opal_built_with_cuda_support:value:")
                        .map(str::to_string)
                })
            });
        match built.as_deref() {
            Some("true") => assert_eq!(said, "Yes", "ompi_info says CUDA support is built"),
            Some("false") => assert_eq!(said, "No", "ompi_info says it is not"),
            _ => eprintln!("no ompi_info: the library's answer ({said}) is not cross-checked"),
        }
        return;
    }
    let comm = child_comm();
    let support = comm.device_memory();
    println!("cuda support: {:?}", support.cuda.0);
    println!("library: {}", comm.library_version());
    assert!(!comm.library_version().is_empty());
    assert!(matches!(
        support.crossing(Some(ember_comm::GpuMemory::Cuda)),
        ember_comm::Crossing::Staged { .. }
    ));
}
