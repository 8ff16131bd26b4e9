//! The GPT-2 language model: embeddings, blocks, final norm, tied LM head, cross-entropy.
//! It knows nothing about distribution, optimisers or data: those are applied from outside.

use burn::module::Module;
use burn::nn::Embedding;
use burn::tensor::{DType, Device, Int, Tensor, TensorData};

use crate::config::GptConfig;
use crate::dropout::{DropoutKey, dropout};
use crate::kernels::{linear_transposed, softmax_cross_entropy};
use crate::layers::{Block, LayerNorm};
use crate::layout::Params;

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
    /// Tokens in the vocabulary (kept apart from `wte`, whose values a sharded run may hold
    /// elsewhere).
    vocab: usize,
    /// Longest sequence (`wpe`'s rows).
    positions: usize,
}

/// What is wrong with a model's configuration or its input; the message names the field or
/// the value and what would work.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelError {
    /// An invalid [`GptConfig`].
    Config(String),
    /// Token ids the model cannot take.
    Tokens(String),
}

impl std::fmt::Display for ModelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelError::Config(m) => write!(f, "invalid model configuration: {m}"),
            ModelError::Tokens(m) => write!(f, "{m}"),
        }
    }
}

impl std::error::Error for ModelError {}

/// Token ids `[batch, seq]` a model can take: every id below its vocabulary, `seq` at most
/// its block size. Only [`Gpt::tokens`] makes them, after checking, so the model never
/// indexes outside its embeddings.
#[derive(Debug, Clone)]
pub struct Tokens(Tensor<2, Int>);

impl Tokens {
    /// `[batch, seq]`.
    pub fn dims(&self) -> [usize; 2] {
        self.0.dims()
    }

    /// The ids as a tensor.
    pub fn tensor(&self) -> Tensor<2, Int> {
        self.0.clone()
    }
}

impl GptConfig {
    /// Builds the model with weights drawn from seed 0 (see [`GptConfig::init_with_seed`]).
    pub fn init(&self, device: &Device) -> Result<Gpt, ModelError> {
        self.init_with_seed(0, device)
    }

    /// Builds the model; every weight is a pure function of (`seed`, its path), so all
    /// processes that call this agree bit for bit. Parameters are lazy: nothing is drawn
    /// until a value is read. An invalid configuration is an error naming the field.
    pub fn init_with_seed(&self, seed: u64, device: &Device) -> Result<Gpt, ModelError> {
        self.validate().map_err(ModelError::Config)?;
        let params = Params::new(self, seed, device);
        Ok(Gpt {
            wte: Embedding {
                weight: params.get("wte.weight"),
            },
            wpe: Embedding {
                weight: params.get("wpe.weight"),
            },
            h: (0..self.n_layer)
                .map(|i| Block::init(self, &params, &format!("h.{i}")))
                .collect(),
            ln_f: LayerNorm {
                weight: params.get("ln_f.weight"),
                bias: params.get("ln_f.bias"),
            },
            dropout: self.dropout,
            vocab: self.vocab_size,
            positions: self.block_size,
        })
    }
}

impl Gpt {
    /// Number of positions the model was built with.
    pub fn block_size(&self) -> usize {
        self.positions
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// `ids` as `rows` sequences of token ids on `device`, checked against the model: every
    /// id in `0..vocab_size`, each sequence at most `block_size` long.
    pub fn tokens(
        &self,
        ids: Vec<i64>,
        rows: usize,
        device: &Device,
    ) -> Result<Tokens, ModelError> {
        if rows == 0 || ids.is_empty() || !ids.len().is_multiple_of(rows) {
            return Err(ModelError::Tokens(format!(
                "{} token ids do not make {rows} sequences of equal length",
                ids.len()
            )));
        }
        let t = ids.len() / rows;
        if t > self.positions {
            return Err(ModelError::Tokens(format!(
                "sequences of {t} tokens exceed the model's block size of {}: cut them to at \
                 most {} tokens",
                self.positions, self.positions
            )));
        }
        if let Some(bad) = ids
            .iter()
            .find(|&&i| i < 0 || i as u64 >= self.vocab as u64)
        {
            return Err(ModelError::Tokens(format!(
                "token id {bad} is outside the model's vocabulary of {}: was the text encoded \
                 with another tokenizer?",
                self.vocab
            )));
        }
        Ok(Tokens(Tensor::from_data(
            TensorData::new(ids, [rows, t]),
            device,
        )))
    }

    /// Next-token logits for every position; with a dropout `key` (training) the embeddings
    /// and residual branches draw their masks from it.
    ///
    /// # Shapes
    /// - idx: `[B, T]` token ids, `T <= block_size`
    /// - output: `[B, T, V]`
    pub fn forward(&self, idx: &Tokens, key: Option<&DropoutKey>) -> Tensor<3> {
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
    pub fn embed(&self, idx: &Tokens, key: Option<&DropoutKey>) -> Tensor<3> {
        let [_, t] = idx.dims();
        let idx = idx.tensor();
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
        linear_transposed(x, self.wte.weight.val()) // [B, T, V]
    }

    /// Logits and mean cross-entropy of predicting `targets` (dropout as in
    /// [`Gpt::forward`]).
    ///
    /// # Shapes
    /// - idx, targets: `[B, T]`
    /// - output: (`[B, T, V]`, `[1]`)
    pub fn forward_loss(
        &self,
        idx: &Tokens,
        targets: &Tokens,
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
pub fn cross_entropy(logits: Tensor<3>, targets: &Tokens) -> Tensor<1> {
    let targets = targets.tensor();
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
        let model = config.init_with_seed(5, &Device::flex()).unwrap();
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
        let model = GptConfig::gpt2_large()
            .init_with_seed(0, &Device::flex())
            .unwrap();
        assert!(!model.h[0].attn.c_attn.weight.is_initialized());
        assert_eq!(
            model.h[0].attn.c_attn.weight.lazy_shape().dims::<2>(),
            [1280, 3840]
        );
    }

    #[test]
    fn bad_configurations_and_token_ids_are_errors() {
        let device = Device::flex();
        let mut config = GptConfig::new(2, 2, 16, 8, 40);
        config.n_head = 3;
        match config.init(&device) {
            Err(ModelError::Config(m)) => assert!(m.contains("n_head"), "{m}"),
            other => panic!("n_embd 16 over 3 heads gave {other:?}"),
        }
        let model = GptConfig::new(2, 2, 16, 8, 40).init(&device).unwrap();
        assert!(model.tokens(vec![0, 39, 5, 6], 2, &device).is_ok());
        for (ids, rows, what) in [
            (vec![0, 40], 1, "vocabulary of 40"),
            (vec![-1, 3], 1, "vocabulary of 40"),
            (vec![1; 9], 1, "block size of 8"),
            (vec![1, 2, 3], 2, "equal length"),
            (vec![], 1, "equal length"),
        ] {
            match model.tokens(ids.clone(), rows, &device) {
                Err(ModelError::Tokens(m)) => assert!(m.contains(what), "{ids:?}: {m}"),
                other => panic!("{ids:?} in {rows} rows gave {other:?}"),
            }
        }
    }
}
