//! How a user describes their model to the partitioner without changing it: a sequence of
//! units (groups of parameters, by path prefix, gathered and released together) and a forward
//! function per unit. The model's own code is untouched; only this description is written.

use burn::module::Module;
use burn::tensor::{Device, Tensor};

use crate::error::ShardError;
use crate::plan::UnitSpec;
use crate::side::Side;

/// A unit as declared: the parameter path prefixes it owns, and other units it reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitDecl {
    /// Name for messages and plans.
    pub name: String,
    /// Path prefixes: a parameter belongs to this unit when its path equals a prefix or starts
    /// with the prefix followed by `.`.
    pub prefixes: Vec<String>,
    /// Indices of other units whose parameters this unit's forward also reads (a tied head).
    pub uses: Vec<usize>,
}

impl UnitDecl {
    /// A unit owning `prefixes` and reading no other unit.
    pub fn new(name: impl Into<String>, prefixes: &[&str]) -> Self {
        Self {
            name: name.into(),
            prefixes: prefixes.iter().map(|p| p.to_string()).collect(),
            uses: Vec::new(),
        }
    }

    /// The same unit, also reading units `uses`.
    pub fn using(mut self, uses: &[usize]) -> Self {
        self.uses = uses.to_vec();
        self
    }

    fn owns(&self, path: &str) -> bool {
        self.prefixes.iter().any(|p| {
            path == p || (path.starts_with(p.as_str()) && path[p.len()..].starts_with('.'))
        })
    }
}

/// What one unit's forward hands on (moved once per unit, so its size does not matter).
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)]
pub enum Flow<const D: usize> {
    /// Activations for the next unit.
    Hidden(Tensor<D>),
    /// Activations for the next unit, and an auxiliary loss of this unit (`[1]`, weighted as
    /// it should count: a mixture of experts' load-balancing loss times its coefficient). It
    /// is added to the last unit's loss: the step's loss and gradients are those of the sum.
    Aux(Tensor<D>, Tensor<1>),
    /// The last unit's mean loss, `[1]`.
    Loss(Tensor<1>),
}

impl<const D: usize> Flow<D> {
    /// The activations and the auxiliary loss of a unit that is not the last (`None` for a
    /// loss).
    pub(crate) fn hidden(self) -> Option<(Tensor<D>, Option<Tensor<1>>)> {
        match self {
            Flow::Hidden(h) => Some((h, None)),
            Flow::Aux(h, aux) => Some((h, Some(aux))),
            Flow::Loss(_) => None,
        }
    }
}

/// A model cut into units that run one after another, each taking the previous one's
/// activation (a float tensor of rank `D`), the side tensors earlier units put ([`Side`]) and
/// the batch.
///
/// Contract: every unit but the last returns [`Flow::Hidden`] (or [`Flow::Aux`], with an
/// auxiliary loss), the last returns [`Flow::Loss`]; `forward` is a function of the
/// parameters, the input, the side tensors and the batch, and of the device's generator as the
/// partitioner seeds it before each unit (so dropout drawn there is replayed exactly when
/// backward runs the unit again); it reads only the parameters of unit `unit` and of its
/// `uses` (reading another's is an error of the step naming both); it builds any tensor it
/// needs from `batch` on `device` (plain or autodiff, the partitioner decides: a training
/// forward runs on the autodiff device, as Burn's own training does, evaluation on the plain
/// one). Every rank must declare the same units.
pub trait Staged<const D: usize> {
    /// The Burn module.
    type Module: Module + Clone;
    /// One micro-batch, as host data.
    type Batch;

    /// The units, in forward order.
    fn units(&self, module: &Self::Module) -> Vec<UnitDecl>;

    /// Runs unit `unit` of `module` on `input` (`None` for the first unit), reading and putting
    /// side tensors in `side`.
    fn forward(
        &self,
        module: &Self::Module,
        unit: usize,
        input: Option<Tensor<D>>,
        side: &mut Side,
        batch: &Self::Batch,
        device: &Device,
    ) -> Flow<D>;
}

/// Assigns every parameter (path, shape in visit order) to exactly one declared unit.
pub fn assign(
    params: &[(String, Vec<usize>)],
    decls: &[UnitDecl],
) -> Result<Vec<UnitSpec>, ShardError> {
    let mut units: Vec<UnitSpec> = decls
        .iter()
        .map(|d| UnitSpec {
            name: d.name.clone(),
            params: Vec::new(),
            uses: d.uses.clone(),
        })
        .collect();
    for (path, shape) in params {
        let owners: Vec<usize> = (0..decls.len()).filter(|&i| decls[i].owns(path)).collect();
        match owners.as_slice() {
            [i] => units[*i].params.push((path.clone(), shape.clone())),
            [] => {
                return Err(ShardError::Units(format!(
                    "parameter `{path}` belongs to no unit: add its path prefix to one"
                )));
            }
            many => {
                let names: Vec<&str> = many.iter().map(|&i| decls[i].name.as_str()).collect();
                return Err(ShardError::Units(format!(
                    "parameter `{path}` matches units {}: make the prefixes disjoint",
                    names.join(" and ")
                )));
            }
        }
    }
    if let Some(empty) = units.iter().find(|u| u.params.is_empty()) {
        return Err(ShardError::Units(format!(
            "unit `{}` owns no parameter: check its prefixes",
            empty.name
        )));
    }
    Ok(units)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_go_to_the_unit_whose_prefix_matches_at_a_dot() {
        let params = vec![
            ("h.1.w".to_string(), vec![2]),
            ("h.10.w".to_string(), vec![3]),
            ("wte.weight".to_string(), vec![4, 2]),
        ];
        let decls = vec![
            UnitDecl::new("embed", &["wte"]),
            UnitDecl::new("h.1", &["h.1"]),
            UnitDecl::new("h.10", &["h.10"]).using(&[0]),
        ];
        let units = assign(&params, &decls).unwrap();
        assert_eq!(units[1].params, vec![("h.1.w".to_string(), vec![2])]);
        assert_eq!(units[2].params[0].0, "h.10.w");
        assert_eq!(units[2].uses, vec![0]);
    }

    #[test]
    fn orphans_overlaps_and_empty_units_are_refused_by_name() {
        let params = vec![("a.w".to_string(), vec![2]), ("b.w".to_string(), vec![2])];
        let e = assign(&params, &[UnitDecl::new("a", &["a"])]).unwrap_err();
        assert!(e.to_string().contains("`b.w` belongs to no unit"), "{e}");
        let e = assign(
            &params,
            &[UnitDecl::new("a", &["a", "b"]), UnitDecl::new("b", &["b"])],
        )
        .unwrap_err();
        assert!(e.to_string().contains("matches units a and b"), "{e}");
        let e = assign(
            &params,
            &[UnitDecl::new("ab", &["a", "b"]), UnitDecl::new("c", &["c"])],
        )
        .unwrap_err();
        assert!(e.to_string().contains("`c` owns no parameter"), "{e}");
    }
}
