//! The parts of a GPT-2 block: LayerNorm, causal self-attention, MLP, and the block itself.
//! Field names are Hugging Face GPT-2's (`ln_1`, `attn.c_attn`, `mlp.c_fc`, ...), so a module
//! path plus the `transformer.` prefix is the checkpoint name, with no remapping table.

use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::Tensor;

use crate::config::GptConfig;
use crate::dropout::{DropoutKey, dropout};
pub use crate::kernels::gelu_tanh;
use crate::kernels::{causal_attention, layer_norm, linear as fused_linear, linear_gelu};
use crate::layout::Params;

/// GPT-2's LayerNorm epsilon (`layer_norm_epsilon = 1e-5`).
pub const LAYER_NORM_EPS: f64 = 1e-5;

/// LayerNorm with Hugging Face parameter names (`weight`, `bias`) instead of Burn's
/// (`gamma`, `beta`).
#[derive(Module, Debug)]
pub struct LayerNorm {
    /// Scale, `[d]`, starts at 1.
    pub weight: Param<Tensor<1>>,
    /// Shift, `[d]`, starts at 0.
    pub bias: Param<Tensor<1>>,
}

impl LayerNorm {
    pub(crate) fn init(params: &Params<'_>, path: &str) -> Self {
        Self {
            weight: params.get(&format!("{path}.weight")),
            bias: params.get(&format!("{path}.bias")),
        }
    }

    /// # Shapes
    /// - input: `[..., d]`
    /// - output: `[..., d]`
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        layer_norm(x, self.weight.val(), self.bias.val(), LAYER_NORM_EPS)
    }
}

/// A `[d_in, d_out]` linear layer (Hugging Face Conv1D layout) with a bias.
fn linear(params: &Params<'_>, path: &str) -> Linear {
    Linear {
        weight: params.get(&format!("{path}.weight")),
        bias: Some(params.get(&format!("{path}.bias"))),
    }
}

/// Multi-head causal self-attention with a fused q, k, v projection.
#[derive(Module, Debug)]
pub struct CausalSelfAttention {
    /// q, k, v projection, `[d, 3d]`.
    pub c_attn: Linear,
    /// Output projection, `[d, d]`.
    pub c_proj: Linear,
    /// Dropout probability on the output (the residual branch).
    dropout: f64,
    n_head: usize,
}

impl CausalSelfAttention {
    fn init(config: &GptConfig, params: &Params<'_>, path: &str) -> Self {
        Self {
            c_attn: linear(params, &format!("{path}.c_attn")),
            c_proj: linear(params, &format!("{path}.c_proj")),
            dropout: config.dropout,
            n_head: config.n_head,
        }
    }

    /// Dropout (keyed by `key` and `site`) applies to the output only in training.
    ///
    /// # Shapes
    /// - x: `[B, T, d]`
    /// - output: `[B, T, d]`
    pub fn forward(&self, x: Tensor<3>, key: Option<&DropoutKey>, site: u64) -> Tensor<3> {
        // Dropout on attention probabilities is not applied: the fused attention op has none.
        let y = causal_attention(fused_linear(x, &self.c_attn), self.n_head); // [B, T, d]
        dropout(fused_linear(y, &self.c_proj), self.dropout, key, site)
    }
}

/// The position-wise feed-forward network: d -> 4d -> GELU (tanh) -> d.
#[derive(Module, Debug)]
pub struct Mlp {
    /// Expansion, `[d, 4d]`.
    pub c_fc: Linear,
    /// Projection back, `[4d, d]`.
    pub c_proj: Linear,
    /// Dropout probability on the output (the residual branch).
    dropout: f64,
}

impl Mlp {
    fn init(config: &GptConfig, params: &Params<'_>, path: &str) -> Self {
        Self {
            c_fc: linear(params, &format!("{path}.c_fc")),
            c_proj: linear(params, &format!("{path}.c_proj")),
            dropout: config.dropout,
        }
    }

    /// Dropout (keyed by `key` and `site`) applies to the output only in training.
    ///
    /// # Shapes
    /// - x: `[B, T, d]`
    /// - output: `[B, T, d]`
    pub fn forward(&self, x: Tensor<3>, key: Option<&DropoutKey>, site: u64) -> Tensor<3> {
        let x = linear_gelu(x, &self.c_fc); // [B, T, 4d]
        dropout(fused_linear(x, &self.c_proj), self.dropout, key, site)
    }
}

/// One pre-LayerNorm transformer block.
#[derive(Module, Debug)]
pub struct Block {
    /// Norm before attention.
    pub ln_1: LayerNorm,
    /// Causal self-attention.
    pub attn: CausalSelfAttention,
    /// Norm before the MLP.
    pub ln_2: LayerNorm,
    /// Feed-forward network.
    pub mlp: Mlp,
}

impl Block {
    /// Block `path` (e.g. `h.3`) with its parameters from `params`.
    pub(crate) fn init(config: &GptConfig, params: &Params<'_>, path: &str) -> Self {
        Self {
            ln_1: LayerNorm::init(params, &format!("{path}.ln_1")),
            attn: CausalSelfAttention::init(config, params, &format!("{path}.attn")),
            ln_2: LayerNorm::init(params, &format!("{path}.ln_2")),
            mlp: Mlp::init(config, params, &format!("{path}.mlp")),
        }
    }

    /// Block `layer` of its model; with a dropout `key` (training), its two residual branches
    /// draw the masks of sites `1 + 2 layer` and `2 + 2 layer` (site 0 is the embeddings').
    ///
    /// # Shapes
    /// - x: `[B, T, d]`
    /// - output: `[B, T, d]`
    pub fn forward(&self, x: Tensor<3>, key: Option<&DropoutKey>, layer: usize) -> Tensor<3> {
        let site = 1 + 2 * layer as u64;
        let x = x.clone() + self.attn.forward(self.ln_1.forward(x), key, site);
        x.clone() + self.mlp.forward(self.ln_2.forward(x), key, site + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

    #[test]
    fn gelu_tanh_equals_the_tanh_formula() {
        let xs: Vec<f32> = (-60..=60).map(|i| i as f32 * 0.1).collect();
        let n = xs.len();
        let t = Tensor::<1>::from_data(TensorData::new(xs.clone(), [n]), &Device::flex());
        let got = gelu_tanh(t).into_data().try_to_vec::<f32>().unwrap();
        for (x, g) in xs.iter().zip(got) {
            let x = *x as f64;
            let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
            let want = 0.5 * x * (1.0 + u.tanh());
            assert!((g as f64 - want).abs() < 1e-6, "x {x}: {g} vs {want}");
        }
    }
}
