//! The one description of a GPT's parameters: every path, shape and initialiser, in the
//! model's visit order. The model's constructor draws each parameter from its entry here;
//! [`GptConfig::init_of`], [`GptConfig::num_params`] and the partitioner's units of a model
//! that is never built (`ember plan` at any size) read it too, so none of them can drift from
//! the model.

use std::collections::HashMap;

use burn::module::Param;
use burn::tensor::{Device, Tensor};

use crate::config::GptConfig;
use crate::init::{Init, param};

/// One parameter of a GPT.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    /// Dotted module path (`h.0.attn.c_attn.weight`), Hugging Face's name minus
    /// `transformer.`.
    pub path: String,
    /// Shape (`[in, out]` for linear weights, Hugging Face's Conv1D layout).
    pub shape: Vec<usize>,
    /// How it starts.
    pub init: Init,
}

/// GPT-2's scaled init of the projections that write into the residual stream:
/// std / sqrt(2 L), so the stream's variance does not grow with depth (GPT-2 paper, 2.3).
pub(crate) fn residual_std(config: &GptConfig) -> f64 {
    config.init_std / (2.0 * config.n_layer as f64).sqrt()
}

impl GptConfig {
    /// Every parameter of a GPT of this configuration, in the model's visit order.
    pub fn layout(&self) -> Vec<ParamSpec> {
        let (v, t, d) = (self.vocab_size, self.block_size, self.n_embd);
        let normal = Init::Normal(self.init_std);
        let residual = Init::Normal(residual_std(self));
        let spec = |path: String, shape: Vec<usize>, init: Init| ParamSpec { path, shape, init };
        let mut out = vec![
            spec("wte.weight".into(), vec![v, d], normal),
            spec("wpe.weight".into(), vec![t, d], normal),
        ];
        for i in 0..self.n_layer {
            let p = |name: &str| format!("h.{i}.{name}");
            out.extend([
                spec(p("ln_1.weight"), vec![d], Init::Ones),
                spec(p("ln_1.bias"), vec![d], Init::Zeros),
                spec(p("attn.c_attn.weight"), vec![d, 3 * d], normal),
                spec(p("attn.c_attn.bias"), vec![3 * d], Init::Zeros),
                spec(p("attn.c_proj.weight"), vec![d, d], residual),
                spec(p("attn.c_proj.bias"), vec![d], Init::Zeros),
                spec(p("ln_2.weight"), vec![d], Init::Ones),
                spec(p("ln_2.bias"), vec![d], Init::Zeros),
                spec(p("mlp.c_fc.weight"), vec![d, 4 * d], normal),
                spec(p("mlp.c_fc.bias"), vec![4 * d], Init::Zeros),
                spec(p("mlp.c_proj.weight"), vec![4 * d, d], residual),
                spec(p("mlp.c_proj.bias"), vec![d], Init::Zeros),
            ]);
        }
        out.extend([
            spec("ln_f.weight".into(), vec![d], Init::Ones),
            spec("ln_f.bias".into(), vec![d], Init::Zeros),
        ]);
        out
    }

    /// How parameter `path` starts (`None` for a path this configuration's model does not
    /// have). With [`crate::init::init_range`] this draws any range of any parameter
    /// without building the model: a rank of a sharded run draws exactly what it owns.
    pub fn init_of(&self, path: &str) -> Option<Init> {
        self.layout()
            .into_iter()
            .find(|p| p.path == path)
            .map(|p| p.init)
    }

    /// Parameters of the model, the head tied to `wte` counted once (Hugging Face's
    /// convention).
    pub fn num_params(&self) -> u64 {
        self.layout()
            .iter()
            .map(|p| p.shape.iter().product::<usize>() as u64)
            .sum()
    }
}

/// Makes the model's parameters from the layout: lazy, each drawn from (seed, path) when
/// first read.
pub(crate) struct Params<'a> {
    specs: HashMap<String, ParamSpec>,
    seed: u64,
    device: &'a Device,
}

impl<'a> Params<'a> {
    pub(crate) fn new(config: &GptConfig, seed: u64, device: &'a Device) -> Self {
        Self {
            specs: config
                .layout()
                .into_iter()
                .map(|p| (p.path.clone(), p))
                .collect(),
            seed,
            device,
        }
    }

    /// Parameter `path`, as the layout describes it.
    pub(crate) fn get<const D: usize>(&self, path: &str) -> Param<Tensor<D>> {
        let spec = self
            .specs
            .get(path)
            .unwrap_or_else(|| unreachable!("the layout lists every parameter: {path}"));
        let shape: [usize; D] = spec
            .shape
            .as_slice()
            .try_into()
            .unwrap_or_else(|_| unreachable!("{path} has rank {D} in the layout"));
        param(spec.init, self.seed, path, shape, self.device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layout_counts_gpt2s_parameters() {
        // Per block: ln_1 + ln_2 (4d), c_attn (3d^2 + 3d), attn c_proj (d^2 + d), c_fc
        // (4d^2 + 4d), mlp c_proj (4d^2 + d); then wte, wpe and ln_f.
        for config in [GptConfig::tiny(), GptConfig::gpt2(), GptConfig::gpt2_xl()] {
            let (v, t, l, d) = (
                config.vocab_size as u64,
                config.block_size as u64,
                config.n_layer as u64,
                config.n_embd as u64,
            );
            let closed = v * d + t * d + l * (12 * d * d + 13 * d) + 2 * d;
            assert_eq!(config.num_params(), closed);
        }
        assert_eq!(GptConfig::gpt2().num_params(), 124_439_808);
    }
}
