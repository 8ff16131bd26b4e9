//! `GptConfig`: the size of a GPT-2-architecture model, its presets, and the arithmetic
//! derived from it (parameter count, training FLOPs per token). Pure data: no tensors here.

use burn::config::Config;

/// Shape of a GPT-2-architecture model. Field names follow nanoGPT / Hugging Face `GPT2Config`.
#[derive(Config, Debug, PartialEq)]
pub struct GptConfig {
    /// Number of transformer blocks (`n_layer`).
    pub n_layer: usize,
    /// Number of attention heads per block (`n_head`); must divide `n_embd`.
    pub n_head: usize,
    /// Width of the residual stream (`n_embd`, d).
    pub n_embd: usize,
    /// Number of learned positions (`n_positions`): the longest context the model accepts.
    pub block_size: usize,
    /// Token vocabulary size, equal to the tokenizer's (no padding: the Hugging Face export
    /// must keep GPT-2's 50257 rows).
    pub vocab_size: usize,
    /// Dropout probability on embeddings and residual branches (GPT-2 used 0.1; 0 is the
    /// modern default for pre-training and makes runs deterministic).
    #[config(default = 0.0)]
    pub dropout: f64,
    /// Standard deviation of the normal initialisation of weights (GPT-2: 0.02).
    #[config(default = 0.02)]
    pub init_std: f64,
}

/// Names of the presets accepted by [`GptConfig::preset`], smallest first.
pub const PRESETS: &[&str] = &[
    "tiny",
    "small-cpu",
    "gpt2",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-xl",
    "gpt3-2.7b",
    "gpt3-6.7b",
    "gpt3-13b",
    "neox-20b",
];

/// GPT-2's BPE vocabulary (50,000 merges + 256 bytes + `<|endoftext|>`).
const GPT2_VOCAB: usize = 50257;

impl GptConfig {
    /// For tests: a training step takes a few milliseconds on one CPU core.
    pub fn tiny() -> Self {
        Self::new(2, 2, 64, 64, 512)
    }

    /// The CPU default: 3.3M parameters, trains to readable text on 2 CPU cores in minutes.
    pub fn small_cpu() -> Self {
        Self::new(4, 4, 256, 128, 512)
    }

    /// GPT-2 small, 124M parameters.
    pub fn gpt2() -> Self {
        Self::new(12, 12, 768, 1024, GPT2_VOCAB)
    }

    /// GPT-2 medium, 355M parameters.
    pub fn gpt2_medium() -> Self {
        Self::new(24, 16, 1024, 1024, GPT2_VOCAB)
    }

    /// GPT-2 large, 774M parameters.
    pub fn gpt2_large() -> Self {
        Self::new(36, 20, 1280, 1024, GPT2_VOCAB)
    }

    /// GPT-2 XL, 1.5B parameters.
    pub fn gpt2_xl() -> Self {
        Self::new(48, 25, 1600, 1024, GPT2_VOCAB)
    }

    /// GPT-3 2.7B (Brown et al. 2020, table 2.1).
    pub fn gpt3_2_7b() -> Self {
        Self::new(32, 32, 2560, 2048, GPT2_VOCAB)
    }

    /// GPT-3 6.7B.
    pub fn gpt3_6_7b() -> Self {
        Self::new(32, 32, 4096, 2048, GPT2_VOCAB)
    }

    /// GPT-3 13B. The paper's table says d = 5140 with 40 heads of 128, which do not
    /// multiply; we use 5120 = 40 x 128, as Megatron-LM and GPT-NeoX configs do.
    pub fn gpt3_13b() -> Self {
        Self::new(40, 40, 5120, 2048, GPT2_VOCAB)
    }

    /// The seed paper's 20B size, shaped as GPT-NeoX-20B (vocab padded to 50432 there).
    pub fn neox_20b() -> Self {
        Self::new(44, 64, 6144, 2048, 50432)
    }

    /// Looks a preset up by its CLI name (see [`PRESETS`]).
    pub fn preset(name: &str) -> Option<Self> {
        Some(match name {
            "tiny" => Self::tiny(),
            "small-cpu" => Self::small_cpu(),
            "gpt2" => Self::gpt2(),
            "gpt2-medium" => Self::gpt2_medium(),
            "gpt2-large" => Self::gpt2_large(),
            "gpt2-xl" => Self::gpt2_xl(),
            "gpt3-2.7b" => Self::gpt3_2_7b(),
            "gpt3-6.7b" => Self::gpt3_6_7b(),
            "gpt3-13b" => Self::gpt3_13b(),
            "neox-20b" => Self::neox_20b(),
            _ => return None,
        })
    }

    /// Checks the invariants the model relies on; the message names the field and the fix.
    pub fn validate(&self) -> Result<(), String> {
        let fields = [
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_embd", self.n_embd),
            ("block_size", self.block_size),
            ("vocab_size", self.vocab_size),
        ];
        for (name, value) in fields {
            if value == 0 {
                return Err(format!("{name} must be at least 1"));
            }
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return Err(format!(
                "n_embd ({}) must be divisible by n_head ({}): pick n_embd = n_head x head size, e.g. {}",
                self.n_embd,
                self.n_head,
                self.n_head * self.n_embd.div_ceil(self.n_head)
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(format!("dropout ({}) must be in [0, 1)", self.dropout));
        }
        Ok(())
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Training FLOPs per token at context `seq_len`: `6 N + 12 L d T` (forward + backward,
    /// N = all parameters, the second term the attention score and value products), the
    /// formula MFU figures in the PaLM and nanoGPT reports are based on.
    pub fn train_flops_per_token(&self, seq_len: usize) -> f64 {
        6.0 * self.num_params() as f64
            + 12.0 * self.n_layer as f64 * self.n_embd as f64 * seq_len as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_has_hugging_face_parameter_count() {
        assert_eq!(GptConfig::gpt2().num_params(), 124_439_808);
    }

    #[test]
    fn every_preset_is_valid_and_named() {
        for name in PRESETS {
            let config = GptConfig::preset(name).unwrap_or_else(|| panic!("preset {name}"));
            config.validate().unwrap();
        }
        assert!(GptConfig::preset("gpt5").is_none());
    }

    #[test]
    fn neox_20b_is_about_20b() {
        let n = GptConfig::neox_20b().num_params() as f64;
        assert!((19.5e9..21.0e9).contains(&n), "{n}");
    }

    #[test]
    fn refuses_indivisible_heads() {
        let err = GptConfig::new(2, 3, 64, 16, 100).validate().unwrap_err();
        assert!(
            err.contains("n_embd (64)") && err.contains("n_head (3)"),
            "{err}"
        );
    }

    #[test]
    fn flops_formula() {
        let c = GptConfig::tiny();
        let expected = 6.0 * c.num_params() as f64 + 12.0 * 2.0 * 64.0 * 64.0;
        assert_eq!(c.train_flops_per_token(64), expected);
    }
}
