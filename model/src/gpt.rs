//! The GPT-2 language model: embeddings, blocks, final norm, tied LM head, cross-entropy.
//! It knows nothing about distribution, optimisers or data: those are applied from outside.

use burn::module::Module;
use burn::nn::Embedding;
use burn::tensor::module::linear;
use burn::tensor::{DType, Device, Int, Tensor};

use crate::config::GptConfig;
use crate::dropout::{DropoutKey, dropout};
use crate::init::{Init, param};
use crate::kernels::softmax_cross_entropy;
use crate::layers::{Block, LayerNorm, residual_std};

/// A GPT-2-architecture model. Module paths equal Hugging Face names minus `transformer.`.
#[derive(Module, Debug)]
pub struct Gpt {
    /// Token embedding `[V, d]`, also the LM head (weight tying, as GPT-2).
    pub wte: Embedding,
    /// Learned position embedding `[T, d]`.
    pub wpe: Embedding,
    /// The transformer blocks.
    pub h: Vec<Block>,
    /// Final LayerNorm.
    pub ln_f: LayerNorm,
    /// Dropout probability on the embeddings and the residual branches.
    dropout: f64,
}

impl GptConfig {
    /// Builds the model with weights drawn from seed 0 (see [`GptConfig::init_with_seed`]).
    pub fn init(&self, device: &Device) -> Gpt {
        self.init_with_seed(0, device)
    }

    /// Builds the model; every weight is a pure function of (`seed`, its path), so all
    /// processes that call this agree bit for bit. Panics on an invalid config: call
    /// [`GptConfig::validate`] first where the config comes from a user.
    pub fn init_with_seed(&self, seed: u64, device: &Device) -> Gpt {
        if let Err(e) = self.validate() {
            panic!("invalid GptConfig: {e}");
        }
        let (v, t, d) = (self.vocab_size, self.block_size, self.n_embd);
        let std = Init::Normal(self.init_std);
        Gpt {
            wte: Embedding {
                weight: param(std, seed, "wte.weight", [v, d], device),
            },
            wpe: Embedding {
                weight: param(std, seed, "wpe.weight", [t, d], device),
            },
            h: (0..self.n_layer)
                .map(|i| Block::init(self, seed, &format!("h.{i}"), device))
                .collect(),
            ln_f: LayerNorm {
                weight: param(Init::Ones, seed, "ln_f.weight", [d], device),
                bias: param(Init::Zeros, seed, "ln_f.bias", [d], device),
            },
            dropout: self.dropout,
        }
    }
}

impl GptConfig {
    /// How parameter `path` of this model is initialised, or `None` for a path the model does
    /// not have. With [`crate::init::init_range`] this draws any range of any parameter
    /// without building the model: a rank of a sharded run draws exactly what it owns.
    pub fn init_of(&self, path: &str) -> Option<Init> {
        let normal = Init::Normal(self.init_std);
        match path {
            "wte.weight" | "wpe.weight" => return Some(normal),
            "ln_f.weight" => return Some(Init::Ones),
            "ln_f.bias" => return Some(Init::Zeros),
            _ => {}
        }
        let (layer, name) = path.strip_prefix("h.")?.split_once('.')?;
        if layer.parse::<usize>().ok()? >= self.n_layer {
            return None;
        }
        Some(match name {
            "ln_1.weight" | "ln_2.weight" => Init::Ones,
            "ln_1.bias" | "ln_2.bias" | "attn.c_attn.bias" | "attn.c_proj.bias"
            | "mlp.c_fc.bias" | "mlp.c_proj.bias" => Init::Zeros,
            "attn.c_attn.weight" | "mlp.c_fc.weight" => normal,
            "attn.c_proj.weight" | "mlp.c_proj.weight" => Init::Normal(residual_std(self)),
            _ => return None,
        })
    }
}

impl Gpt {
    /// Number of positions the model was built with.
    pub fn block_size(&self) -> usize {
        self.wpe.weight.lazy_shape().dims::<2>()[0]
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.wte.weight.lazy_shape().dims::<2>()[0]
    }

    /// Next-token logits for every position; with a dropout `key` (training) the embeddings
    /// and residual branches draw their masks from it.
    ///
    /// # Shapes
    /// - idx: `[B, T]` token ids, `T <= block_size`
    /// - output: `[B, T, V]`
    pub fn forward(&self, idx: Tensor<2, Int>, key: Option<&DropoutKey>) -> Tensor<3> {
        let mut x = self.embed(idx, key);
        for (layer, block) in self.h.iter().enumerate() {
            x = block.forward(x, key, layer);
        }
        self.head(x)
    }

    /// Token plus position embeddings, after dropout: the input of block 0. The pieces
    /// `embed`, `h[i].forward` and `head` compose to [`Gpt::forward`], so a caller may run the
    /// model one piece at a time (the sharded trainer does).
    ///
    /// # Shapes
    /// - idx: `[B, T]`, `T <= block_size`
    /// - output: `[B, T, d]`
    pub fn embed(&self, idx: Tensor<2, Int>, key: Option<&DropoutKey>) -> Tensor<3> {
        let [_, t] = idx.dims();
        assert!(
            t <= self.block_size(),
            "sequence of {t} tokens exceeds block_size {}",
            self.block_size()
        );
        let device = idx.device();
        let pos = Tensor::<1, Int>::arange(0..t as i64, &device).unsqueeze::<2>(); // [1, T]
        let x = self.wte.forward(idx) + self.wpe.forward(pos); // [B, T, d]
        dropout(x, self.dropout, key, 0)
    }

    /// The transformer blocks, in order.
    pub fn blocks(&self) -> &[Block] {
        &self.h
    }

    /// Final LayerNorm and the head tied to `wte`.
    ///
    /// # Shapes
    /// - x: `[B, T, d]`
    /// - output: `[B, T, V]`
    pub fn head(&self, x: Tensor<3>) -> Tensor<3> {
        let x = self.ln_f.forward(x); // [B, T, d]
        // Tied head: logits = x wte^T.
        linear(x, self.wte.weight.val().transpose(), None) // [B, T, V]
    }

    /// Logits and mean cross-entropy of predicting `targets` (dropout as in
    /// [`Gpt::forward`]).
    ///
    /// # Shapes
    /// - idx, targets: `[B, T]`
    /// - output: (`[B, T, V]`, `[1]`)
    pub fn forward_loss(
        &self,
        idx: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        key: Option<&DropoutKey>,
    ) -> (Tensor<3>, Tensor<1>) {
        let logits = self.forward(idx, key);
        let loss = cross_entropy(logits.clone(), targets);
        (logits, loss)
    }
}

/// Mean token-level cross-entropy (nats), computed in at least f32: a bf16 log-softmax over
/// the vocabulary loses too much to be a training signal.
///
/// # Shapes
/// - logits: `[B, T, V]`, targets: `[B, T]`
/// - output: `[1]`
pub fn cross_entropy(logits: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
    let [b, t, v] = logits.dims();
    // Only half types are widened: f32 stays, and f64 (the gradient check) keeps its precision.
    let logits = match logits.dtype() {
        DType::BF16 | DType::F16 => logits.cast(DType::F32),
        _ => logits,
    };
    softmax_cross_entropy(logits.reshape([b * t, v]), targets.reshape([b * t]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init::init_values;
    use ember_sharding::params::named_values;

    #[test]
    fn init_of_draws_every_parameter_the_model_builds() {
        let config = GptConfig::new(3, 2, 16, 8, 40);
        let model = config.init_with_seed(5, &Device::flex());
        for (name, shape, value) in named_values(&model) {
            let init = config
                .init_of(&name)
                .unwrap_or_else(|| panic!("no init for {name}"));
            let want = init_values(init, 5, &name, shape.iter().product());
            assert_eq!(
                value.into_data().try_to_vec::<f32>().unwrap(),
                want,
                "{name}"
            );
        }
        assert_eq!(config.init_of("h.3.ln_1.weight"), None);
        assert_eq!(config.init_of("h.0.attn.bias"), None);
    }

    #[test]
    fn building_the_model_allocates_nothing_until_read() {
        let model = GptConfig::gpt2_large().init_with_seed(0, &Device::flex());
        assert!(!model.h[0].attn.c_attn.weight.is_initialized());
        assert_eq!(
            model.h[0].attn.c_attn.weight.lazy_shape().dims::<2>(),
            [1280, 3840]
        );
    }
}
