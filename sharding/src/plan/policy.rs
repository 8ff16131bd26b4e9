//! How a run's layout is chosen where its caller leaves two settings open: whether units
//! keep their autodiff graphs from forward to backward ([`Recompute`]), and the dtype forward
//! and backward compute in over bf16 parameters ([`Plan::module_dtype`]). Both trade memory
//! for time, so both are chosen from whether a candidate plan fits: the caller plans the
//! candidates (it knows the model's activations) and says whether one fits every rank's
//! machine (it knows the memory there, and agrees the answer among the ranks); this module
//! only decides, the same way for a run (`ember train`) and for its prediction (`ember plan`).

use crate::config::{Compute, Recompute, ShardConfig, Span};
use crate::plan::Plan;

/// What the policy asks of its caller.
pub trait Candidates {
    /// The caller's error.
    type Error;

    /// The plan of `shard` with its modules computing in `module` (activation and FLOP
    /// estimates included).
    fn plan(&self, shard: ShardConfig, module: Compute) -> Result<Plan, Self::Error>;

    /// Whether `plan` fits the memory available on every rank's machine (the same answer on
    /// every rank), and its bytes per rank.
    fn fits(&mut self, plan: &Plan) -> (bool, u64);
}

/// A choice the policy made, for the caller to report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Recompute chosen: `keep` (no recompute) when keeping every unit's graph fits
    /// (`bytes` per rank, with modules computing in f32 over bf16 parameters when
    /// `widened`), else recompute per unit.
    Recompute {
        /// Whether every unit's graph is kept.
        keep: bool,
        /// Bytes per rank of the plan that keeps them.
        bytes: u64,
        /// Whether the modules of that plan compute in f32 over bf16 parameters.
        widened: bool,
    },
    /// bf16 parameters computing in bf16, on devices that compute bf16 fast.
    Bf16,
    /// Where bf16 arithmetic is slow: one rank sends nothing, so the run trains all in f32
    /// (`bytes` per rank, which fit).
    AllF32 {
        /// Bytes per rank.
        bytes: u64,
    },
    /// Where bf16 arithmetic is slow: modules compute in f32 over bf16 parameters (`bytes`
    /// per rank, which fit).
    F32OverBf16 {
        /// Bytes per rank.
        bytes: u64,
    },
    /// Where bf16 arithmetic is slow but computing in f32 would not fit (`wide` bytes per
    /// rank): modules compute in bf16 (`narrow` bytes per rank).
    Bf16ForMemory {
        /// Bytes per rank computing in f32.
        wide: u64,
        /// Bytes per rank computing in bf16.
        narrow: u64,
    },
}

/// The plan of `shard` for a run whose devices compute fastest in `fast`
/// (f32 where any rank's bf16 arithmetic is slower than its f32; the parameters' dtype
/// otherwise), with the decisions taken on the way, in order:
///
/// - with `choose_recompute` and split parameters, every unit keeps its graph when that
///   fits, else each recomputes ([`Recompute::None`] or [`Recompute::Unit`]);
/// - bf16 parameters compute in bf16 where `fast` is bf16; elsewhere, one rank trains all in
///   f32 where that fits (it sends nothing, so bf16 parameters would only add a copy and
///   casts), and more ranks compute in f32 over bf16 parameters where that fits, else in
///   bf16.
pub fn choose<C: Candidates>(
    candidates: &mut C,
    mut shard: ShardConfig,
    fast: Compute,
    choose_recompute: bool,
) -> Result<(Plan, Vec<Decision>), C::Error> {
    let compute = shard.compute;
    let module = if compute == Compute::Bf16 && fast == Compute::F32 {
        Compute::F32
    } else {
        compute
    };
    let mut decisions = Vec::new();
    let plan = if choose_recompute && shard.params() != Span(0) {
        shard.recompute = Recompute::None;
        let keep = candidates.plan(shard.clone(), module)?;
        let (fits, bytes) = candidates.fits(&keep);
        decisions.push(Decision::Recompute {
            keep: fits,
            bytes,
            widened: module != compute,
        });
        if fits {
            keep
        } else {
            shard.recompute = Recompute::Unit;
            candidates.plan(shard, module)?
        }
    } else {
        candidates.plan(shard, module)?
    };
    let plan = module_dtype(candidates, plan, &mut decisions)?;
    Ok((plan, decisions))
}

/// `plan`, or, when its modules compute in f32 over bf16 parameters: at one rank, the same
/// plan all in f32 where that fits; otherwise, where `plan` does not fit, the same plan
/// computing in bf16.
fn module_dtype<C: Candidates>(
    candidates: &mut C,
    plan: Plan,
    decisions: &mut Vec<Decision>,
) -> Result<Plan, C::Error> {
    let compute = plan.config.compute;
    if plan.module_dtype == compute {
        if compute == Compute::Bf16 {
            decisions.push(Decision::Bf16);
        }
        return Ok(plan);
    }
    if plan.topology.world_size() == 1 {
        let mut shard = plan.config.clone();
        shard.compute = Compute::F32;
        let wide = candidates.plan(shard, Compute::F32)?;
        let (fits, bytes) = candidates.fits(&wide);
        if fits {
            decisions.push(Decision::AllF32 { bytes });
            return Ok(wide);
        }
    }
    let (fits, wide) = candidates.fits(&plan);
    if fits {
        decisions.push(Decision::F32OverBf16 { bytes: wide });
        return Ok(plan);
    }
    let narrow = candidates.plan(plan.config.clone(), compute)?;
    let (_, narrow_bytes) = candidates.fits(&narrow);
    decisions.push(Decision::Bf16ForMemory {
        wide,
        narrow: narrow_bytes,
    });
    Ok(narrow)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Preset;
    use crate::plan::UnitSpec;
    use ember_comm::Topology;

    /// Plans of a two-unit model over `ranks` ranks, fitting when their memory is at most
    /// `room`.
    struct Room {
        room: u64,
        ranks: &'static str,
    }

    impl Candidates for Room {
        type Error = crate::error::ShardError;

        fn plan(&self, shard: ShardConfig, module: Compute) -> Result<Plan, Self::Error> {
            let units = (0..2)
                .map(|u| UnitSpec {
                    name: format!("u{u}"),
                    params: vec![(format!("u{u}.w"), vec![1024, 64])],
                    uses: Vec::new(),
                })
                .collect();
            let topology = Topology::parse(self.ranks).unwrap();
            Plan::new(units, shard, topology)?.computing_in(module)
        }

        fn fits(&mut self, plan: &Plan) -> (bool, u64) {
            let bytes = plan.memory(1).total();
            (bytes <= self.room, bytes)
        }
    }

    /// The policy's choice for bf16 zero3 over `ranks` with `room` bytes per rank, devices
    /// fastest in `fast`, recompute chosen when `recompute`.
    fn decide(
        room: u64,
        ranks: &'static str,
        fast: Compute,
        recompute: bool,
    ) -> (Plan, Vec<Decision>) {
        let mut shard = Preset::Zero3.config(3);
        shard.compute = Compute::Bf16;
        choose(&mut Room { room, ranks }, shard, fast, recompute).unwrap()
    }

    #[test]
    fn graphs_are_kept_where_they_fit_and_recomputed_elsewhere() {
        let (plan, d) = decide(u64::MAX, "2x2x2", Compute::Bf16, true);
        assert_eq!(plan.config.recompute, Recompute::None);
        assert!(matches!(
            d[..],
            [Decision::Recompute { keep: true, .. }, Decision::Bf16]
        ));
        let (plan, d) = decide(0, "2x2x2", Compute::Bf16, true);
        assert_eq!(plan.config.recompute, Recompute::Unit);
        assert!(matches!(d[0], Decision::Recompute { keep: false, .. }));
    }

    #[test]
    fn slow_bf16_computes_in_f32_where_that_fits() {
        // Several ranks: f32 modules over bf16 parameters where they fit, else bf16.
        let (plan, d) = decide(u64::MAX, "2x2x2", Compute::F32, false);
        assert_eq!(
            (plan.config.compute, plan.module_dtype),
            (Compute::Bf16, Compute::F32)
        );
        assert!(matches!(d[..], [Decision::F32OverBf16 { .. }]));
        let (plan, d) = decide(0, "2x2x2", Compute::F32, false);
        assert_eq!(plan.module_dtype, Compute::Bf16);
        assert!(matches!(d[..], [Decision::Bf16ForMemory { wide, narrow }] if narrow < wide));
        // One rank: all in f32 where it fits.
        let (plan, d) = decide(u64::MAX, "1x1x1", Compute::F32, false);
        assert_eq!(
            (plan.config.compute, plan.module_dtype),
            (Compute::F32, Compute::F32)
        );
        assert!(matches!(d[..], [Decision::AllF32 { .. }]));
    }
}
