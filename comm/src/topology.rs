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
                 start the same number of ranks on every node or pass --topology"
            )));
        }
        if gcds_per_gpu == 0 || !ranks_per_node.is_multiple_of(gcds_per_gpu) {
            return Err(CommError::Topology(format!(
                "{ranks_per_node} ranks per node do not split into GPUs of {gcds_per_gpu} GCDs: \
                 fix the GCDs-per-GPU setting or pass --topology"
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

    /// Number of ranks in `scope`'s group.
    pub fn group_size(&self, scope: Scope) -> usize {
        match scope {
            Scope::World => self.world_size(),
            Scope::Within(i) => self.stride(i + 1),
            Scope::Across(i) => self.levels[i].size,
        }
    }

    /// `(color, index)` of `rank` in `scope`: ranks with equal colour form one group, ordered
    /// by index. These are exactly the arguments of `MPI_Comm_split`.
    pub fn color_and_index(&self, scope: Scope, rank: usize) -> (usize, usize) {
        match scope {
            Scope::World => (0, rank),
            Scope::Within(i) => {
                let size = self.stride(i + 1);
                (rank / size, rank % size)
            }
            Scope::Across(i) => {
                let c = self.coords(rank)[i];
                (rank - c * self.stride(i), c)
            }
        }
    }

    /// World ranks of the group `scope` that contains `rank`, in index order.
    pub fn members(&self, scope: Scope, rank: usize) -> Vec<usize> {
        let (color, _) = self.color_and_index(scope, rank);
        (0..self.world_size())
            .filter(|&r| self.color_and_index(scope, r).0 == color)
            .collect()
    }

    /// Every scope this topology has: the world, then `Within(i)` and `Across(i)` per level.
    pub fn scopes(&self) -> Vec<Scope> {
        let mut out = vec![Scope::World];
        for i in 0..self.depth() {
            out.push(Scope::Within(i));
            out.push(Scope::Across(i));
        }
        out
    }

    /// Human name of a scope for counters and messages: `world`, `within-gpu`, `across-node`.
    pub fn scope_name(&self, scope: Scope) -> String {
        match scope {
            Scope::World => "world".into(),
            Scope::Within(i) => format!("within-{}", self.levels[i].name),
            Scope::Across(i) => format!("across-{}", self.levels[i].name),
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
