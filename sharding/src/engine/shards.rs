//! What a rank holds of the shards, seen from outside the step: the parameter ranges of its
//! optimizer shard (what a checkpoint stores), its error-feedback residuals, and the whole
//! module gathered from every rank's master weights.

use std::collections::HashMap;

use burn::tensor::Tensor;

use ember_comm::Comm;

use super::{ShardedModel, pieces};
use crate::checkpoint::{Piece, ShardView};
use crate::error::ShardError;
use crate::params::load;
use crate::plan::Plan;
use crate::stage::Staged;
use crate::transport::route;
use crate::transport::staging;

/// One parameter range of this rank's optimizer shard (what it writes to a checkpoint).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OwnedPiece {
    /// The parameter's path.
    pub name: String,
    /// First element of the range, in the flattened parameter.
    pub offset: usize,
    /// Elements in the range.
    pub len: usize,
    /// Elements of the whole parameter.
    pub global_numel: usize,
    pub(crate) unit: usize,
    /// The range within the unit's optimizer shard.
    pub(crate) local: std::ops::Range<usize>,
}

impl<S: Staged<D>, const D: usize> ShardedModel<'_, S, D> {
    /// Whether this rank writes its optimizer shard to a checkpoint: the first of the ranks
    /// holding the same shard (all ranks when the optimizer state spans the world; rank 0
    /// alone when it is replicated).
    pub(crate) fn is_writer(&self) -> bool {
        let o = self.plan.config.optimizer().0;
        self.plan.topology.coords(self.comm.rank())[o..]
            .iter()
            .all(|&c| c == 0)
    }

    /// The parameter ranges this rank's optimizer shard holds, unit by unit (padding is
    /// never part of one; a rank whose shard is all padding holds none): what it writes to a
    /// checkpoint.
    pub(crate) fn owned_pieces(&self) -> Vec<OwnedPiece> {
        let mut out = Vec::new();
        for (u, (unit, shard)) in self.plan.units.iter().zip(&self.optimizer).enumerate() {
            for (p, local) in pieces(unit, &shard.range) {
                out.push(OwnedPiece {
                    name: p.name.clone(),
                    offset: local.start + shard.range.start - p.offset,
                    len: local.len(),
                    global_numel: p.numel,
                    unit: u,
                    local,
                });
            }
        }
        out
    }

    /// The master weights, then each optimizer state, of one owned range, copied to the host.
    fn read_piece(&self, piece: &OwnedPiece) -> Vec<Result<Vec<f32>, ShardError>> {
        let s = &self.optimizer[piece.unit].state;
        let part = |t: &Tensor<1>| staging::to_f32(t.clone().slice(piece.local.clone()));
        std::iter::once(&s.master)
            .chain(&s.slots)
            .map(part)
            .collect()
    }

    /// This rank's error-feedback residuals as `(unit, hop, values)`; empty without error
    /// feedback or before the first step.
    pub(crate) fn residual_tensors(&self) -> Vec<(usize, usize, Tensor<1>)> {
        self.residuals
            .iter()
            .enumerate()
            .flat_map(|(u, r)| {
                r.per_hop
                    .iter()
                    .enumerate()
                    .filter_map(move |(h, t)| t.clone().map(|t| (u, h, t)))
            })
            .collect()
    }

    /// The layout this rank's residuals belong to (JSON): they are only meaningful to the
    /// same rank of the same topology, gradient path, format and unit sizes.
    pub(crate) fn residual_layout(&self) -> String {
        let cfg = &self.plan.config;
        serde_json::json!({
            "rank": self.comm.rank(),
            "topology": self.plan.topology.to_string(),
            "grad_hops": cfg.grad_hops(),
            "quantize_grads": cfg.quantize_grads(),
            "quant_block": cfg.quant_block,
            "padded": self.plan.units.iter().map(|u| u.padded).collect::<Vec<_>>(),
        })
        .to_string()
    }

    /// The whole trained module, on every rank: each unit's f32 master weights (the optimizer's
    /// copy, never quantized) all-gathered over the ranks that split them and loaded into a
    /// copy of the module's skeleton, ready for inference or export with the model's own
    /// `forward`. Every rank must call it together; each then holds the full parameters once
    /// more, on the run's device.
    pub fn gather(&self) -> Result<S::Module, ShardError> {
        Ok(self
            .gather_onto(None)?
            .expect("every rank keeps the module"))
    }

    /// The whole trained module on rank `root` alone (`None` on the others), for saving or
    /// serving from one rank: unit by unit, the f32 masters are all-gathered and only `root`
    /// keeps them, so no other rank holds more than one unit whole at a time (PyTorch's full
    /// state dict with `rank0_only`). Every rank must call it together.
    pub fn gather_to(&self, root: usize) -> Result<Option<S::Module>, ShardError> {
        let world = self.plan.topology.world_size();
        if root >= world {
            return Err(ShardError::setting(
                "root",
                root,
                format!("the job has {world} ranks: pass a rank below {world}"),
            ));
        }
        self.gather_onto(Some(root))
    }

    /// The module gathered onto every rank (`root` `None`) or onto `root` alone.
    fn gather_onto(&self, root: Option<usize>) -> Result<Option<S::Module>, ShardError> {
        let keep = root.is_none_or(|r| r == self.comm.rank());
        let span = self.plan.config.optimizer();
        let group = if span.0 == 0 {
            None
        } else {
            let scope = route::scope(self.comm, self.plan.group(span));
            Some(self.comm.try_group(scope)?)
        };
        let mut values = HashMap::new();
        for (unit, shard) in self.plan.units.iter().zip(&self.optimizer) {
            let mine = staging::to_f32(shard.state.master.clone())?;
            // Group index `i` holds elements `i * shard ..` of the padded unit (`Plan::shard_range`).
            let whole = match &group {
                Some(g) if g.size() > 1 => g.all_gather(&mine)?,
                _ => mine,
            };
            if !keep {
                continue;
            }
            for p in &unit.params {
                let flat = whole[p.offset..p.offset + p.numel].to_vec();
                values.insert(p.name.clone(), staging::from_f32(flat, &self.device));
            }
        }
        Ok(keep.then(|| {
            load(
                self.skeleton.clone(),
                &mut values,
                &self.shapes,
                &self.device,
                false,
            )
        }))
    }
}

impl<S: Staged<D>, const D: usize> ShardView for ShardedModel<'_, S, D> {
    fn comm(&self) -> &Comm {
        self.comm
    }

    fn plan(&self) -> &Plan {
        &self.plan
    }

    fn updates(&self) -> u64 {
        self.updates
    }

    fn is_writer(&self) -> bool {
        ShardedModel::is_writer(self)
    }

    fn state_names(&self) -> &[String] {
        &self.state_names
    }

    fn pieces(&self) -> Vec<Piece> {
        self.owned_pieces()
            .into_iter()
            .map(|p| Piece {
                name: p.name,
                offset: p.offset,
                len: p.len,
                global_numel: p.global_numel,
            })
            .collect()
    }

    fn piece_values(&self) -> Box<dyn Iterator<Item = Result<Vec<f32>, ShardError>> + '_> {
        let pieces = self.owned_pieces();
        Box::new(pieces.into_iter().flat_map(|p| self.read_piece(&p)))
    }

    fn residual_tensors(&self) -> Vec<(usize, usize, Tensor<1>)> {
        ShardedModel::residual_tensors(self)
    }

    fn residual_layout(&self) -> String {
        ShardedModel::residual_layout(self)
    }

    fn generator_seed(&self) -> Option<u64> {
        Some(self.seed)
    }
}
