//! The rank hierarchy as plain data: level sizes innermost first, rank <-> coordinates, and which
//! ranks form each group. Pure functions only; it deliberately knows nothing of MPI (see `comm`).
//!
//! # Rank numbering
//!
//! Levels are listed innermost first, e.g. `[gcd: D, gpu: G, node: N]`. A rank's coordinates
//! are `(c_0, c_1, ..., c_{L-1})` with the innermost coordinate varying fastest:
//! `rank = c_0 + d_0 * (c_1 + d_1 * (c_2 + ...))`, i.e. for three levels
//! `rank = (node * G + gpu) * D + gcd`. This is the order `mpirun --map-by slot` places ranks,
//! so node-local ranks are consecutive.
//!
//! # Groups
//!
//! - `Scope::Within(i)`: ranks sharing every coordinate *outer* than `i` (the two GCDs of one
//!   GPU for `i = 0`, all ranks of one node for `i = 1`, everyone for the outermost level).
//!   Its size is `d_0 * ... * d_i`; a member's index is `rank mod (d_0 * ... * d_i)`.
//! - `Scope::Across(i)`: ranks sharing every coordinate *except* `c_i` (the same local rank
//!   on every node for the node level). Its size is `d_i`; a member's index is `c_i`.
//! - `Scope::World`: every rank, index = rank.
//! - `Scope::Span { lo, hi }`: ranks sharing every coordinate outside levels `lo..hi`, i.e.
//!   varying exactly `c_lo, ..., c_{hi-1}`. Its size is `d_lo * ... * d_{hi-1}`; a member's
//!   index is the mixed-radix number of `(c_lo, ..., c_{hi-1})` with `c_lo` fastest. Every
//!   other scope is a span: `Within(i) = Span{0, i+1}`, `Across(i) = Span{i, i+1}`,
//!   `World = Span{0, depth}`.
//!
//! # Canonical form (one group, one communicator, one counter key)
//!
//! Since several spellings name the same group, every scope is normalised by
//! [`Topology::canonical`] before it picks a communicator, a counter key or a name, in this
//! order of preference: `Span{0, depth}` is `World`; `Span{i, i+1}` is `Across(i)` (so
//! `Within(0)` is `Across(0)`); `Span{0, h}` is `Within(h-1)`; anything else stays a `Span`.
//! So a topology of depth `L` has exactly `L (L+1) / 2` distinct scopes (6 for three
//! levels), listed by [`Topology::scopes`]. Groups are compared by their level range, not by
//! their member set: on `2x4x1` (one GCD per GPU) `Across(1)` and `Within(1)` hold the same
//! ranks but stay two scopes, so counters keep saying which hop moved the bytes.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::CommError;

/// One level of the hierarchy: a name for messages and counters, and how many children it has.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Level {
    /// Name used in counters, benchmarks and error messages (`gcd`, `gpu`, `node`).
    pub name: String,
    /// Number of members along this level's coordinate (>= 1).
    pub size: usize,
}

/// Level names the CLI uses, innermost first.
pub const CLI_LEVEL_NAMES: [&str; 3] = ["gcd", "gpu", "node"];

/// A hierarchy of levels, innermost first. Built by [`Topology::new`] or [`Topology::parse`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Topology {
    levels: Vec<Level>,
}

/// A set of ranks a collective runs over, named relative to the topology (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Scope {
    /// All ranks.
    World,
    /// Ranks sharing every coordinate outer than level `i`.
    Within(usize),
    /// Ranks sharing every coordinate except that of level `i`.
    Across(usize),
    /// Ranks sharing every coordinate outside levels `lo..hi` (`lo < hi <= depth`).
    Span {
        /// Innermost level the members differ in.
        lo: usize,
        /// One past the outermost level the members differ in.
        hi: usize,
    },
}

impl Topology {
    /// Builds a topology from levels listed innermost first; refuses empty lists, zero sizes
    /// and duplicate names.
    pub fn new(levels: Vec<Level>) -> Result<Self, CommError> {
        if levels.is_empty() {
            return Err(CommError::Topology(
                "no levels given: use at least one level, e.g. `1` for a single rank".into(),
            ));
        }
        for (i, level) in levels.iter().enumerate() {
            if level.size == 0 {
                return Err(CommError::Topology(format!(
                    "level `{}` has size 0: every level needs at least one member",
                    level.name
                )));
            }
            if levels[..i].iter().any(|l| l.name == level.name) {
                return Err(CommError::Topology(format!(
                    "level name `{}` appears twice: give each level its own name",
                    level.name
                )));
            }
        }
        Ok(Self { levels })
    }

    /// Parses the CLI form `NODESxGPUSxGCDS`, outermost first (`2x4x2` = 2 nodes of 4 GPUs of
    /// 2 GCDs). Fewer than three factors fill the missing *inner* levels with 1 (`4` = 4 nodes
    /// of one rank each), so every topology has the three named levels.
    pub fn parse(spec: &str) -> Result<Self, CommError> {
        let factors: Vec<&str> = spec.trim().split(['x', 'X']).collect();
        if factors.len() > CLI_LEVEL_NAMES.len() {
            return Err(CommError::Topology(format!(
                "`{spec}` has {} factors; the CLI names three levels: write NODESxGPUSxGCDS",
                factors.len()
            )));
        }
        let mut sizes = Vec::with_capacity(3);
        for f in &factors {
            let size: usize = f.trim().parse().map_err(|_| {
                CommError::Topology(format!(
                    "`{f}` in `{spec}` is not a positive integer: write e.g. 2x4x2"
                ))
            })?;
            sizes.push(size);
        }
        // Outermost first on the CLI; we store innermost first, padded with inner 1s.
        sizes.reverse();
        let mut padded = vec![1; CLI_LEVEL_NAMES.len() - sizes.len()];
        padded.extend(sizes);
        let levels = CLI_LEVEL_NAMES
            .iter()
            .zip(padded)
            .map(|(name, size)| Level {
                name: (*name).to_string(),
                size,
            })
            .collect();
        Self::new(levels)
    }

    /// The detected topology: `ranks_per_node` from shared memory, GCDs per GPU from the caller
    /// (flag or environment). Refuses layouts that don't divide evenly.
    pub fn from_counts(
        world: usize,
        ranks_per_node: usize,
        gcds_per_gpu: usize,
    ) -> Result<Self, CommError> {
        if ranks_per_node == 0 || !world.is_multiple_of(ranks_per_node) {
            return Err(CommError::Topology(format!(
                "{world} ranks do not split into nodes of {ranks_per_node}: \
                 start the same number of ranks on every node or give the topology explicitly"
            )));
        }
        if gcds_per_gpu == 0 || !ranks_per_node.is_multiple_of(gcds_per_gpu) {
            return Err(CommError::Topology(format!(
                "{ranks_per_node} ranks per node do not split into GPUs of {gcds_per_gpu} GCDs: \
                 fix the GCDs-per-GPU setting or give the topology explicitly"
            )));
        }
        let sizes = [
            gcds_per_gpu,
            ranks_per_node / gcds_per_gpu,
            world / ranks_per_node,
        ];
        Self::new(
            CLI_LEVEL_NAMES
                .iter()
                .zip(sizes)
                .map(|(n, size)| Level {
                    name: (*n).to_string(),
                    size,
                })
                .collect(),
        )
    }

    /// Refuses a topology whose rank count differs from the MPI world size.
    pub fn check_world(&self, world: usize) -> Result<(), CommError> {
        if self.world_size() == world {
            Ok(())
        } else {
            Err(CommError::WorldSize {
                topology: self.world_size(),
                world,
            })
        }
    }

    /// The levels, innermost first.
    pub fn levels(&self) -> &[Level] {
        &self.levels
    }

    /// Number of levels.
    pub fn depth(&self) -> usize {
        self.levels.len()
    }

    /// Size of each level, innermost first.
    pub fn dims(&self) -> Vec<usize> {
        self.levels.iter().map(|l| l.size).collect()
    }

    /// Total ranks: the product of the level sizes.
    pub fn world_size(&self) -> usize {
        self.levels.iter().map(|l| l.size).product()
    }

    /// Distance in rank numbers between neighbours along level `i`: `d_0 * ... * d_{i-1}`.
    pub fn stride(&self, level: usize) -> usize {
        self.levels[..level].iter().map(|l| l.size).product()
    }

    /// Coordinates of `rank`, innermost first.
    pub fn coords(&self, rank: usize) -> Vec<usize> {
        let mut rest = rank;
        self.levels
            .iter()
            .map(|l| {
                let c = rest % l.size;
                rest /= l.size;
                c
            })
            .collect()
    }

    /// The rank at `coords` (innermost first); inverse of [`Topology::coords`].
    pub fn rank(&self, coords: &[usize]) -> usize {
        assert_eq!(coords.len(), self.depth(), "one coordinate per level");
        coords
            .iter()
            .zip(&self.levels)
            .rev()
            .fold(0, |acc, (c, l)| acc * l.size + c)
    }

    /// The level range `lo..hi` whose coordinates the members of `scope` vary (see the module
    /// doc). Does not check that the levels exist (see [`Topology::check_scope`]).
    pub fn bounds(&self, scope: Scope) -> (usize, usize) {
        match scope {
            Scope::World => (0, self.depth()),
            Scope::Within(i) => (0, i + 1),
            Scope::Across(i) => (i, i + 1),
            Scope::Span { lo, hi } => (lo, hi),
        }
    }

    /// Refuses a scope naming levels this topology lacks, or an empty span.
    pub fn check_scope(&self, scope: Scope) -> Result<(), CommError> {
        let (lo, hi) = self.bounds(scope);
        if lo < hi && hi <= self.depth() {
            Ok(())
        } else {
            Err(CommError::Topology(format!(
                "scope {scope:?} covers levels {lo}..{hi}, but `{self}` has levels 0..{}: \
                 use 0 <= lo < hi <= {}",
                self.depth(),
                self.depth()
            )))
        }
    }

    /// The canonical spelling of `scope` (see the module doc): the same group always gives the
    /// same value. Does not check that the levels exist.
    pub fn canonical(&self, scope: Scope) -> Scope {
        match self.bounds(scope) {
            (0, hi) if hi == self.depth() => Scope::World,
            (lo, hi) if hi == lo + 1 => Scope::Across(lo),
            (0, hi) => Scope::Within(hi - 1),
            (lo, hi) => Scope::Span { lo, hi },
        }
    }

    /// The canonical scope of the ranks varying levels `lo..hi`, validated.
    pub fn span(&self, lo: usize, hi: usize) -> Result<Scope, CommError> {
        let scope = Scope::Span { lo, hi };
        self.check_scope(scope)?;
        Ok(self.canonical(scope))
    }

    /// Number of ranks in `scope`'s group: `d_lo * ... * d_{hi-1}`.
    pub fn group_size(&self, scope: Scope) -> usize {
        let (lo, hi) = self.bounds(scope);
        self.levels[lo..hi].iter().map(|l| l.size).product()
    }

    /// `(color, index)` of `rank` in `scope`: ranks with equal colour form one group, ordered
    /// by index. These are exactly the arguments of `MPI_Comm_split`.
    pub fn color_and_index(&self, scope: Scope, rank: usize) -> (usize, usize) {
        // rank = inner + stride(lo) * (index + size * outer): the index is the mixed-radix
        // number of (c_lo, ..., c_{hi-1}), and removing it leaves a value unique per group.
        let (lo, _) = self.bounds(scope);
        let (stride, size) = (self.stride(lo), self.group_size(scope));
        let index = rank / stride % size;
        (rank - index * stride, index)
    }

    /// World rank of the member with index `index` of the group `scope` that contains `rank`.
    pub fn member(&self, scope: Scope, rank: usize, index: usize) -> usize {
        let (color, _) = self.color_and_index(scope, rank);
        color + index * self.stride(self.bounds(scope).0)
    }

    /// World ranks of the group `scope` that contains `rank`, in index order.
    pub fn members(&self, scope: Scope, rank: usize) -> Vec<usize> {
        let (color, _) = self.color_and_index(scope, rank);
        (0..self.world_size())
            .filter(|&r| self.color_and_index(scope, r).0 == color)
            .collect()
    }

    /// Every distinct scope of this topology, one per level range `lo..hi`
    /// (`0 <= lo < hi <= depth`), in canonical form, ordered by `lo` then `hi`.
    pub fn scopes(&self) -> Vec<Scope> {
        let depth = self.depth();
        (0..depth)
            .flat_map(|lo| (lo + 1..=depth).map(move |hi| (lo, hi)))
            .map(|(lo, hi)| self.canonical(Scope::Span { lo, hi }))
            .collect()
    }

    /// Human name of a scope for counters and messages, from its canonical form: `world`,
    /// `within-gpu` (levels 0..=gpu), `across-node` (the node level alone), and for other
    /// spans the levels it varies joined by `+`: `across-gpu+node`.
    pub fn scope_name(&self, scope: Scope) -> String {
        let name = |i: usize| {
            self.levels
                .get(i)
                .map_or_else(|| format!("level{i}"), |l| l.name.clone())
        };
        match self.canonical(scope) {
            Scope::World => "world".into(),
            Scope::Within(i) => format!("within-{}", name(i)),
            Scope::Across(i) => format!("across-{}", name(i)),
            Scope::Span { lo, hi } => {
                let names: Vec<String> = (lo..hi).map(name).collect();
                format!("across-{}", names.join("+"))
            }
        }
    }
}

impl fmt::Display for Topology {
    /// The CLI form, outermost first (`2x4x2`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sizes: Vec<String> = self
            .levels
            .iter()
            .rev()
            .map(|l| l.size.to_string())
            .collect();
        write!(f, "{}", sizes.join("x"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_is_found_by_its_index() {
        let t = Topology::parse("2x2x2").unwrap();
        for scope in t.scopes() {
            for rank in 0..8 {
                let members = t.members(scope, rank);
                for (i, &m) in members.iter().enumerate() {
                    assert_eq!(t.member(scope, rank, i), m, "{scope:?} {rank} {i}");
                }
            }
        }
    }

    #[test]
    fn parse_is_outermost_first_and_pads_inner_levels() {
        let t = Topology::parse("2x4x1").unwrap();
        assert_eq!(t.dims(), vec![1, 4, 2]);
        assert_eq!(t.to_string(), "2x4x1");
        assert_eq!(Topology::parse("1").unwrap().dims(), vec![1, 1, 1]);
        assert_eq!(Topology::parse("4").unwrap().dims(), vec![1, 1, 4]);
        assert!(Topology::parse("2x0x1").is_err());
        assert!(Topology::parse("2xax1").is_err());
        assert!(Topology::parse("1x1x1x1").is_err());
    }

    #[test]
    fn world_size_mismatch_names_both_numbers() {
        let err = Topology::parse("2x2x2")
            .unwrap()
            .check_world(6)
            .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains('8') && msg.contains('6'), "{msg}");
    }

    #[test]
    fn rank_is_innermost_fastest_and_round_trips() {
        let t = Topology::parse("2x2x2").unwrap();
        // rank = ((node * G) + gpu) * D + gcd
        assert_eq!(t.coords(5), vec![1, 0, 1]);
        assert_eq!(t.rank(&[1, 0, 1]), 5);
        for r in 0..8 {
            assert_eq!(t.rank(&t.coords(r)), r);
        }
    }

    #[test]
    fn groups_match_the_documented_membership() {
        let t = Topology::parse("2x2x2").unwrap();
        assert_eq!(t.members(Scope::Within(0), 5), vec![4, 5]); // the two GCDs of one GPU
        assert_eq!(t.members(Scope::Within(1), 5), vec![4, 5, 6, 7]); // one node
        assert_eq!(t.members(Scope::Within(2), 5), (0..8).collect::<Vec<_>>());
        assert_eq!(t.members(Scope::Across(2), 5), vec![1, 5]); // same local rank per node
        assert_eq!(t.members(Scope::Across(1), 5), vec![5, 7]);
        assert_eq!(t.members(Scope::Across(0), 5), vec![4, 5]);
        let t = Topology::parse("4x1x2").unwrap();
        assert_eq!(t.members(Scope::Across(2), 3), vec![1, 3, 5, 7]);
        for scope in t.scopes() {
            for r in 0..8 {
                let m = t.members(scope, r);
                assert_eq!(m.len(), t.group_size(scope));
                assert_eq!(m[t.color_and_index(scope, r).1], r);
            }
        }
    }

    /// The definition, written out: members share every coordinate outside `lo..hi`, ordered
    /// by the mixed-radix number of `(c_lo, ..., c_{hi-1})`, `c_lo` fastest.
    fn members_by_definition(t: &Topology, lo: usize, hi: usize, rank: usize) -> Vec<usize> {
        let mine = t.coords(rank);
        let index = |c: &[usize]| (lo..hi).rev().fold(0, |acc, l| acc * t.dims()[l] + c[l]);
        let mut m: Vec<(usize, usize)> = (0..t.world_size())
            .map(|r| (r, t.coords(r)))
            .filter(|(_, c)| (0..t.depth()).all(|l| (lo..hi).contains(&l) || c[l] == mine[l]))
            .map(|(r, c)| (index(&c), r))
            .collect();
        m.sort();
        m.into_iter().map(|(_, r)| r).collect()
    }

    #[test]
    fn spans_match_their_definition_and_every_spelling_is_one_canonical_scope() {
        for spec in ["1", "2x1x1", "1x2x2", "2x2x2", "2x4x1", "4x1x2", "3x2x4"] {
            let t = Topology::parse(spec).unwrap();
            let depth = t.depth();
            let mut seen = Vec::new();
            for lo in 0..depth {
                for hi in lo + 1..=depth {
                    let span = Scope::Span { lo, hi };
                    let canon = t.span(lo, hi).unwrap();
                    assert_eq!(t.canonical(span), canon);
                    assert_eq!(t.canonical(canon), canon, "canonical is idempotent");
                    assert_eq!(t.bounds(canon), (lo, hi));
                    for r in 0..t.world_size() {
                        let want = members_by_definition(&t, lo, hi, r);
                        assert_eq!(t.members(span, r), want, "{spec} {lo}..{hi} rank {r}");
                        assert_eq!(t.members(canon, r), want);
                        let (_, index) = t.color_and_index(span, r);
                        assert_eq!(want[index], r);
                        assert_eq!(t.group_size(span), want.len());
                    }
                    seen.push(canon);
                }
            }
            assert_eq!(seen, t.scopes());
            let mut distinct = seen.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(
                distinct.len(),
                depth * (depth + 1) / 2,
                "one scope per level range"
            );
            for i in 0..depth {
                assert_eq!(t.canonical(Scope::Within(i)), t.span(0, i + 1).unwrap());
                assert_eq!(t.canonical(Scope::Across(i)), t.span(i, i + 1).unwrap());
            }
            assert_eq!(t.canonical(Scope::World), t.span(0, depth).unwrap());
        }
        let t = Topology::parse("2x2x2").unwrap();
        assert_eq!(t.canonical(Scope::Within(0)), Scope::Across(0));
        assert_eq!(t.canonical(Scope::Within(2)), Scope::World);
        assert_eq!(t.span(1, 3).unwrap(), Scope::Span { lo: 1, hi: 3 });
        assert_eq!(t.members(Scope::Span { lo: 1, hi: 3 }, 5), vec![1, 3, 5, 7]);
        assert_eq!(
            t.scope_name(Scope::Span { lo: 1, hi: 3 }),
            "across-gpu+node"
        );
        assert_eq!(t.scope_name(Scope::Within(0)), "across-gcd");
        assert_eq!(t.scope_name(Scope::Span { lo: 0, hi: 2 }), "within-gpu");
        assert_eq!(t.scope_name(Scope::Within(2)), "world");
        for (lo, hi) in [(0, 0), (2, 1), (0, 4), (3, 4)] {
            let msg = t.span(lo, hi).unwrap_err().to_string();
            assert!(msg.contains("0 <= lo < hi <= 3"), "{msg}");
        }
    }

    #[test]
    fn detection_from_counts() {
        assert_eq!(Topology::from_counts(8, 4, 2).unwrap().to_string(), "2x2x2");
        assert!(Topology::from_counts(8, 3, 1).is_err());
        assert!(Topology::from_counts(8, 4, 3).is_err());
    }

    #[test]
    fn refuses_duplicate_names_and_allows_any_depth() {
        let lv = |n: &str, s| Level {
            name: n.into(),
            size: s,
        };
        assert!(Topology::new(vec![lv("a", 2), lv("a", 2)]).is_err());
        let t = Topology::new(vec![lv("a", 2), lv("b", 3), lv("c", 1), lv("d", 2)]).unwrap();
        assert_eq!(t.world_size(), 12);
        assert_eq!(t.members(Scope::Across(1), 7), vec![7, 9, 11]);
    }
}
