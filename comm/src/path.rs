//! A [`Path`]: how a collective over the group of levels `0..hi` is split into hops, one per
//! run of consecutive levels, and the one chunk permutation that makes any such composition
//! produce exactly the flat layout. Pure data and pure functions; it deliberately moves no data
//! over MPI (the collectives are in `hier` and `quantized`).
//!
//! # Paths
//!
//! A path is a list of boundaries `0 = b_0 < b_1 < ... < b_K = hi <= depth`. Its group is
//! `G = Span{0, hi}` (size `P = d_0 * ... * d_{hi-1}`), and hop `k` (`k = 1..=K`, innermost
//! first) is the group `Span{b_{k-1}, b_k}` of size `D_k`, so `P = D_1 * ... * D_K`. On three
//! levels `[gcd, gpu, node]`:
//!
//! | boundaries | names | hops | what it is |
//! |---|---|---|---|
//! | `[0, 3]` | `world` | world | one flat collective over everyone |
//! | `[0, 2, 3]` | `gpu, node` | within-gpu, across-node | ZeRO++: inside the node, then across nodes |
//! | `[0, 1, 2, 3]` | `gcd, gpu, node` | across-gcd, across-gpu, across-node | one hop per level |
//! | `[0, 2]` | `gpu` | within-gpu | one hop over the node (`G = Within(1)`) |
//!
//! Hops of size 1 move nothing and are skipped at run time. A path knows only its topology's
//! depth, not the level sizes, so one path serves every topology of that depth.
//!
//! # The permutation
//!
//! A member of `G` has index `i = m_1 + D_1 (m_2 + D_2 (m_3 + ...))`, where `m_k` is its index
//! in hop `k` (both are mixed-radix numbers of the same coordinates, innermost fastest). A
//! reduce-scatter run innermost hop first hands hop member `m_1` part `m_1` of the buffer, then
//! splits that part by `m_2`, and so on; for rank `i` to end with chunk `i` (the flat layout),
//! chunk `i` must first be moved to position
//! `p(i) = m_1 D_2 ... D_K + m_2 D_3 ... D_K + ... + m_K` (hop 1's index most significant).
//! An all-gather runs the hops outermost first, which concatenates in exactly that order, and
//! undoes the permutation at the end. With one hop per level over the world this is the
//! digit reversal of `hier`; with one hop it is the identity.

use std::fmt;

use crate::error::CommError;
use crate::padding::{ShardLayout, pad_zeros};
use crate::topology::{Scope, Topology};

/// A validated partition of levels `0..hi` into consecutive hops, innermost first (see the
/// module doc). Build it with [`Path::new`], [`Path::from_names`] or [`Path::parse`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Path {
    /// `0 = b_0 < b_1 < ... < b_K = hi <= depth`.
    bounds: Vec<usize>,
    /// Depth of the topology the path was built for (checked at every use).
    depth: usize,
}

impl Path {
    /// A path from its boundaries, e.g. `[0, 2, 3]` (ZeRO++ on three levels). Refuses lists
    /// that don't start at 0, don't strictly increase, end past the outermost level, or have
    /// no hop.
    pub fn new(topology: &Topology, bounds: &[usize]) -> Result<Self, CommError> {
        let depth = topology.depth();
        let fail = |why: &str| {
            Err(CommError::Topology(format!(
                "path boundaries {bounds:?} on `{topology}` ({depth} levels): {why}; write \
                 0 = b_0 < b_1 < ... <= {depth}, e.g. [0, {depth}] for one flat hop"
            )))
        };
        match bounds {
            [] | [_] => return fail("a path needs at least two boundaries (one hop)"),
            [first, ..] if *first != 0 => return fail("the first boundary must be 0"),
            _ => {}
        }
        if bounds.windows(2).any(|w| w[0] >= w[1]) {
            return fail("boundaries must strictly increase (no empty hop)");
        }
        if bounds.last().is_some_and(|&hi| hi > depth) {
            return fail("the last boundary is past the outermost level");
        }
        Ok(Self {
            bounds: bounds.to_vec(),
            depth,
        })
    }

    /// A path from level names, innermost first: each name ends a hop, and a name means the
    /// levels up to and including it (on `[gcd, gpu, node]`: `gcd` = levels `0..1`, `gpu` =
    /// `0..2`, `node` = `0..3`). `world` means all levels (the outermost level's end) unless a
    /// level is itself named `world`. So `["gpu", "node"]` = `[0, 2, 3]` (ZeRO++),
    /// `["world"]` = `[0, 3]`, `["gcd", "gpu", "node"]` = `[0, 1, 2, 3]`, `["gpu"]` = `[0, 2]`.
    pub fn from_names(topology: &Topology, names: &[&str]) -> Result<Self, CommError> {
        let mut bounds = vec![0];
        for name in names {
            let end = topology
                .levels()
                .iter()
                .position(|l| l.name == *name)
                .map(|i| i + 1)
                .or_else(|| (*name == "world").then_some(topology.depth()));
            let Some(end) = end else {
                let known: Vec<&str> = topology.levels().iter().map(|l| l.name.as_str()).collect();
                return Err(CommError::Topology(format!(
                    "path names {names:?}: no level `{name}` in `{topology}`; use names from \
                     {known:?} or `world`, innermost first"
                )));
            };
            if bounds.last().is_some_and(|&b| end <= b) {
                return Err(CommError::Topology(format!(
                    "path names {names:?}: `{name}` is not outside the hop before it; list \
                     each name further out than the last, e.g. [\"gpu\", \"node\"]"
                )));
            }
            bounds.push(end);
        }
        Self::new(topology, &bounds)
    }

    /// [`Path::from_names`] on a comma-separated list, e.g. `gpu,node` (spaces ignored).
    pub fn parse(topology: &Topology, spec: &str) -> Result<Self, CommError> {
        let names: Vec<&str> = spec
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        Self::from_names(topology, &names)
    }

    /// One flat hop over the world: `[0, depth]`.
    pub fn flat(topology: &Topology) -> Self {
        Self {
            bounds: vec![0, topology.depth()],
            depth: topology.depth(),
        }
    }

    /// One hop per level over the world: `[0, 1, ..., depth]` (what `hier` does).
    pub fn per_level(topology: &Topology) -> Self {
        Self {
            bounds: (0..=topology.depth()).collect(),
            depth: topology.depth(),
        }
    }

    /// The boundaries `b_0 = 0, ..., b_K = hi`.
    pub fn bounds(&self) -> &[usize] {
        &self.bounds
    }

    /// One past the outermost level of the group: `G = Span{0, hi}`.
    pub fn hi(&self) -> usize {
        self.bounds.last().copied().unwrap_or(0)
    }

    /// Number of hops `K` (size-1 hops included).
    pub fn hop_count(&self) -> usize {
        self.bounds.len() - 1
    }

    /// The group `G` the collective runs over, in canonical form.
    pub fn group(&self, topology: &Topology) -> Scope {
        topology.canonical(Scope::Span {
            lo: 0,
            hi: self.hi(),
        })
    }

    /// The hops' groups in canonical form, innermost first (size-1 hops included).
    pub fn hops(&self, topology: &Topology) -> Vec<Scope> {
        self.bounds
            .windows(2)
            .map(|w| topology.canonical(Scope::Span { lo: w[0], hi: w[1] }))
            .collect()
    }

    /// Refuses a path built for a topology of another depth.
    pub fn check(&self, topology: &Topology) -> Result<(), CommError> {
        if self.depth == topology.depth() {
            Ok(())
        } else {
            Err(CommError::Topology(format!(
                "path {:?} was built for {} levels but `{topology}` has {}: build the path \
                 from this communicator's topology",
                self.bounds,
                self.depth,
                topology.depth()
            )))
        }
    }

    /// Position of chunk `index` (a `G` index) in hop order (see the module doc).
    pub fn chunk_position(&self, topology: &Topology, index: usize) -> usize {
        let mut rest = index;
        let mut position = 0;
        for hop in self.hops(topology) {
            let d = topology.group_size(hop);
            position = position * d + rest % d;
            rest /= d;
        }
        position
    }

    /// The level names of the hops' outer ends, innermost first (`gpu,node`): the input of
    /// [`Path::parse`].
    pub fn names(&self, topology: &Topology) -> Vec<String> {
        self.bounds[1..]
            .iter()
            .map(|&b| {
                topology
                    .levels()
                    .get(b - 1)
                    .map_or_else(|| format!("level{}", b - 1), |l| l.name.clone())
            })
            .collect()
    }
}

impl fmt::Display for Path {
    /// The boundaries, e.g. `[0, 2, 3]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.bounds)
    }
}

/// Which way a chunk permutation goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Natural order to hop order.
    Scatter,
    /// Hop order back to natural order.
    Gather,
}

/// Copies the chunks of `chunk` elements of `src` into `dst`: chunk `r` lands at
/// `position(r)` (`Scatter`), or the inverse (`Gather`).
pub(crate) fn permute<T: Copy>(
    src: &[T],
    dst: &mut [T],
    chunk: usize,
    position: impl Fn(usize) -> usize,
    dir: Direction,
) {
    for r in 0..src.len().checked_div(chunk).unwrap_or(0) {
        let p = position(r);
        let (from, to) = match dir {
            Direction::Scatter => (r, p),
            Direction::Gather => (p, r),
        };
        dst[to * chunk..(to + 1) * chunk].copy_from_slice(&src[from * chunk..(from + 1) * chunk]);
    }
}

/// `data` zero-padded to `layout` and permuted to hop order for `path`.
pub fn to_hop_order<T: Copy + Default>(
    topology: &Topology,
    path: &Path,
    data: &[T],
    layout: ShardLayout,
) -> Vec<T> {
    in_hop_order(topology, path, data, layout).into_owned()
}

/// [`to_hop_order`], borrowing `data` as it is where that changes nothing: no padding, and
/// every chunk already at its position (a path with one hop that moves data, say).
pub fn in_hop_order<'a, T: Copy + Default>(
    topology: &Topology,
    path: &Path,
    data: &'a [T],
    layout: ShardLayout,
) -> std::borrow::Cow<'a, [T]> {
    let chunks = layout.padded().checked_div(layout.shard).unwrap_or(0);
    if data.len() == layout.padded() && (0..chunks).all(|r| path.chunk_position(topology, r) == r) {
        return std::borrow::Cow::Borrowed(data);
    }
    std::borrow::Cow::Owned(permuted(topology, path, data, layout))
}

fn permuted<T: Copy + Default>(
    topology: &Topology,
    path: &Path,
    data: &[T],
    layout: ShardLayout,
) -> Vec<T> {
    let padded = pad_zeros(data, layout.padded());
    let mut out = vec![T::default(); layout.padded()];
    permute(
        &padded,
        &mut out,
        layout.shard,
        |r| path.chunk_position(topology, r),
        Direction::Scatter,
    );
    out
}

/// `gathered` (chunks of `chunk` elements in hop order for `path`) back in `G` index order.
pub fn from_hop_order<T: Copy + Default>(
    topology: &Topology,
    path: &Path,
    gathered: &[T],
    chunk: usize,
) -> Vec<T> {
    let mut out = vec![T::default(); gathered.len()];
    from_hop_order_into(topology, path, gathered, chunk, &mut out);
    out
}

/// [`from_hop_order`] into `out`, a buffer of `gathered`'s length (memory staged for a
/// device, say).
pub fn from_hop_order_into<T: Copy>(
    topology: &Topology,
    path: &Path,
    gathered: &[T],
    chunk: usize,
    out: &mut [T],
) {
    assert_eq!(out.len(), gathered.len(), "a reordering keeps the length");
    permute(
        gathered,
        out,
        chunk,
        |r| path.chunk_position(topology, r),
        Direction::Gather,
    );
}

/// Every path over the group of levels `0..hi`: all boundary lists `[0, ..., hi]`
/// (`2^(hi-1)` of them), for tests and benchmarks that sweep paths.
pub fn all_paths(topology: &Topology, hi: usize) -> Vec<Path> {
    if hi == 0 || hi > topology.depth() {
        return Vec::new();
    }
    (0..1usize << (hi - 1))
        .map(|mask| {
            let mut bounds = vec![0];
            bounds.extend((1..hi).filter(|b| mask >> (b - 1) & 1 == 1));
            bounds.push(hi);
            Path {
                bounds,
                depth: topology.depth(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPECS: [&str; 7] = ["1", "2x1x1", "1x2x2", "2x2x2", "2x4x1", "4x1x2", "3x2x4"];

    /// Reduce-scatter over the hops on chunk labels instead of data, every rank at once: each
    /// rank holds a list of chunk labels; hop `k` gives hop member `m` part `m` of the list.
    /// Returns the labels each rank ends with, per world rank.
    fn simulate_reduce_scatter(t: &Topology, path: &Path) -> Vec<Vec<usize>> {
        let p = t.group_size(path.group(t));
        let mut held: Vec<Vec<usize>> = (0..t.world_size())
            .map(|_| {
                let mut order = vec![usize::MAX; p];
                for i in 0..p {
                    order[path.chunk_position(t, i)] = i;
                }
                order
            })
            .collect();
        for hop in path.hops(t) {
            let d = t.group_size(hop);
            for (r, labels) in held.iter_mut().enumerate() {
                let m = t.color_and_index(hop, r).1;
                let part = labels.len() / d;
                *labels = labels[m * part..(m + 1) * part].to_vec();
            }
        }
        held
    }

    /// All-gather over the hops outermost first on labels (each rank starts with its own `G`
    /// index), then the inverse permutation: returns the gathered labels per world rank.
    fn simulate_all_gather(t: &Topology, path: &Path) -> Vec<Vec<usize>> {
        let g = path.group(t);
        let mut held: Vec<Vec<usize>> = (0..t.world_size())
            .map(|r| vec![t.color_and_index(g, r).1])
            .collect();
        for hop in path.hops(t).into_iter().rev() {
            let next: Vec<Vec<usize>> = (0..t.world_size())
                .map(|r| {
                    t.members(hop, r)
                        .iter()
                        .flat_map(|&m| held[m].clone())
                        .collect()
                })
                .collect();
            held = next;
        }
        held.iter().map(|h| from_hop_order(t, path, h, 1)).collect()
    }

    #[test]
    fn every_path_yields_the_flat_layout_on_its_group() {
        for spec in SPECS {
            let t = Topology::parse(spec).unwrap();
            for hi in 1..=t.depth() {
                let paths = all_paths(&t, hi);
                assert_eq!(paths.len(), 1 << (hi - 1));
                for path in paths {
                    let g = path.group(&t);
                    let p = t.group_size(g);
                    let sizes: usize = path.hops(&t).iter().map(|&h| t.group_size(h)).product();
                    assert_eq!(sizes, p, "hop sizes multiply to |G|");
                    let mut seen: Vec<usize> = (0..p).map(|i| path.chunk_position(&t, i)).collect();
                    seen.sort();
                    assert_eq!(seen, (0..p).collect::<Vec<_>>(), "a permutation");
                    let rs = simulate_reduce_scatter(&t, &path);
                    let ag = simulate_all_gather(&t, &path);
                    for r in 0..t.world_size() {
                        let i = t.color_and_index(g, r).1;
                        assert_eq!(rs[r], vec![i], "{spec} {path}: rank {r} gets chunk {i}");
                        assert_eq!(ag[r], (0..p).collect::<Vec<_>>(), "{spec} {path}");
                    }
                }
            }
        }
    }

    #[test]
    fn positions_have_the_inner_hop_most_significant() {
        let t = Topology::parse("2x2x2").unwrap();
        let zero_pp = Path::new(&t, &[0, 2, 3]).unwrap();
        // G index 1 = (gcd 1, gpu 0, node 0): hop 1 (within-gpu, size 4) index 1, hop 2
        // (across-node) index 0 -> 1 * 2 + 0 = 2.
        assert_eq!(zero_pp.chunk_position(&t, 1), 2);
        assert_eq!(zero_pp.chunk_position(&t, 4), 1);
        let per_level = Path::per_level(&t);
        assert_eq!(per_level.chunk_position(&t, 1), 4);
        assert_eq!(Path::flat(&t).chunk_position(&t, 5), 5);
        // A single non-trivial hop is the identity even when other hops are trivial.
        let t = Topology::parse("2x4x1").unwrap();
        let path = Path::new(&t, &[0, 1, 2]).unwrap();
        assert!((0..4).all(|i| path.chunk_position(&t, i) == i));
    }

    /// The hop order borrows the caller's buffer only where it is the buffer's own order, and
    /// equals the permuted copy everywhere.
    #[test]
    fn hop_order_borrows_only_where_nothing_moves() {
        let t = Topology::parse("2x2x2").unwrap();
        let data: Vec<f32> = (0..16).map(|i| i as f32).collect();
        for path in all_paths(&t, 3) {
            for (len, layout) in [
                (16, ShardLayout::new(16, 8, 1)),
                (13, ShardLayout::new(13, 8, 1)),
            ] {
                let got = in_hop_order(&t, &path, &data[..len], layout);
                assert_eq!(&got[..], &permuted(&t, &path, &data[..len], layout)[..]);
                let identity = (0..8).all(|r| path.chunk_position(&t, r) == r);
                let borrowed = matches!(got, std::borrow::Cow::Borrowed(_));
                assert_eq!(borrowed, identity && len == 16, "{:?} {len}", path.bounds());
            }
        }
        // One path of each kind: the flat one is the natural order, one over two hops is not.
        assert!(matches!(
            in_hop_order(&t, &Path::flat(&t), &data, ShardLayout::new(16, 8, 1)),
            std::borrow::Cow::Borrowed(_)
        ));
        assert!(matches!(
            in_hop_order(&t, &Path::per_level(&t), &data, ShardLayout::new(16, 8, 1)),
            std::borrow::Cow::Owned(_)
        ));
    }

    #[test]
    fn hop_order_round_trips_with_padding() {
        let t = Topology::parse("4x1x2").unwrap();
        let path = Path::new(&t, &[0, 1, 3]).unwrap();
        let layout = ShardLayout::new(21, 8, 1);
        let data: Vec<f32> = (0..21).map(|i| i as f32).collect();
        let perm = to_hop_order(&t, &path, &data, layout);
        assert_ne!(perm[..21], data[..]);
        let back = from_hop_order(&t, &path, &perm, layout.shard);
        assert_eq!(&back[..21], &data[..]);
    }

    #[test]
    fn constructors_validate_and_names_mean_levels_up_to_and_including() {
        let t = Topology::parse("2x2x2").unwrap();
        let named = |n: &[&str]| Path::from_names(&t, n).map(|p| p.bounds().to_vec());
        assert_eq!(named(&["gpu", "node"]).unwrap(), vec![0, 2, 3]);
        assert_eq!(named(&["gpu", "world"]).unwrap(), vec![0, 2, 3]);
        assert_eq!(named(&["world"]).unwrap(), vec![0, 3]);
        assert_eq!(named(&["gcd", "gpu", "node"]).unwrap(), vec![0, 1, 2, 3]);
        assert_eq!(named(&["gpu"]).unwrap(), vec![0, 2]);
        assert_eq!(
            Path::parse(&t, " gpu , node ").unwrap(),
            Path::new(&t, &[0, 2, 3]).unwrap()
        );
        let p = Path::new(&t, &[0, 2, 3]).unwrap();
        assert_eq!(p.names(&t), vec!["gpu", "node"]);
        assert_eq!(p.hops(&t), vec![Scope::Within(1), Scope::Across(2)]);
        assert_eq!(p.group(&t), Scope::World);
        assert_eq!(p.to_string(), "[0, 2, 3]");
        let p = Path::new(&t, &[0, 1, 3]).unwrap();
        assert_eq!(
            p.hops(&t),
            vec![Scope::Across(0), Scope::Span { lo: 1, hi: 3 }]
        );
        assert_eq!(Path::new(&t, &[0, 2]).unwrap().group(&t), Scope::Within(1));

        let err = |r: Result<Path, CommError>| r.unwrap_err().to_string();
        assert!(err(Path::from_names(&t, &["rack"])).contains("no level `rack`"));
        assert!(err(Path::from_names(&t, &["node", "gpu"])).contains("further out"));
        assert!(err(Path::from_names(&t, &["gpu", "gpu"])).contains("further out"));
        assert!(err(Path::from_names(&t, &[])).contains("at least two"));
        assert!(err(Path::new(&t, &[1, 3])).contains("first boundary must be 0"));
        assert!(err(Path::new(&t, &[0, 2, 2])).contains("strictly increase"));
        assert!(err(Path::new(&t, &[0, 4])).contains("past the outermost"));
        let deeper = Topology::new(
            (0..4)
                .map(|i| crate::topology::Level {
                    name: format!("l{i}"),
                    size: 1,
                })
                .collect(),
        )
        .unwrap();
        assert!(
            Path::flat(&deeper)
                .check(&t)
                .unwrap_err()
                .to_string()
                .contains("built for 4 levels")
        );
        assert!(all_paths(&t, 0).is_empty() && all_paths(&t, 4).is_empty());
    }
}
