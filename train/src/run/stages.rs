//! GPT described to the partitioner: units `embed` (wte, wpe), one per block `h.i`, and
//! `head` (ln_f, reading the tied wte of `embed`). The model's code is untouched: the stages
//! call its `embed`, block and `head` pieces.

use std::ops::Range;

use burn::tensor::{Device, Tensor};
use ember_data::Batch;
use ember_model::init::init_range;
use ember_model::init::splitmix64;
use ember_model::{DropoutKey, Gpt, GptConfig, Tokens, cross_entropy};
use ember_sharding::assign;
use ember_sharding::plan::{ActivationBytes, UnitSpec};
use ember_sharding::{Flow, ParamSource, ShardError, Side, Staged, UnitDecl};

/// A batch's token ids for `model`. The run's batches are windows of at most `block_size`
/// tokens of data encoded by the tokenizer whose vocabulary sized the model (`setup.rs`), so
/// the model's check cannot fail on them.
fn batch_tokens(model: &Gpt, ids: &[i64], batch: &Batch, device: &Device) -> Tokens {
    model
        .tokens(ids.to_vec(), batch.batch, device)
        .unwrap_or_else(|e| unreachable!("a run's batch is checked when its data loads: {e}"))
}

/// The unit structure of a GPT with `n_layer` blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptStages {
    /// Number of transformer blocks.
    pub n_layer: usize,
    /// The run's seed, which (with the step) keys dropout masks.
    pub seed: u64,
}

impl GptStages {
    /// Declared units: `embed`, `h.0` ... `h.{L-1}`, `head` (which also reads `embed`).
    pub fn decls(&self) -> Vec<UnitDecl> {
        let mut units = vec![UnitDecl::new("embed", &["wte", "wpe"])];
        for i in 0..self.n_layer {
            let name = format!("h.{i}");
            units.push(UnitDecl::new(name.clone(), &[name.as_str()]));
        }
        units.push(UnitDecl::new("head", &["ln_f"]).using(&[0]));
        units
    }
}

impl Staged<3> for GptStages {
    type Module = Gpt;
    type Batch = Batch;

    fn units(&self, _module: &Gpt) -> Vec<UnitDecl> {
        self.decls()
    }

    fn forward(
        &self,
        model: &Gpt,
        unit: usize,
        input: Option<Tensor<3>>,
        _side: &mut Side,
        batch: &Batch,
        device: &Device,
    ) -> Flow<3> {
        let last = self.n_layer + 1;
        // Training forwards draw dropout masks keyed by (seed, step, global sample, site), so
        // a recompute draws the forward's masks and any split of the batch draws one
        // process's (evaluation has no dropout: its model is built with none).
        let key = dropout_key(self.seed, batch);
        let key = Some(&key);
        match (unit, input) {
            (0, _) => {
                Flow::Hidden(model.embed(&batch_tokens(model, &batch.inputs, batch, device), key))
            }
            (u, Some(x)) if u == last => Flow::Loss(cross_entropy(
                model.head(x),
                &batch_tokens(model, &batch.targets, batch, device),
            )),
            (u, Some(x)) => Flow::Hidden(model.blocks()[u - 1].forward(x, key, u - 1)),
            (u, None) => panic!("unit {u} of a GPT needs the previous unit's activation"),
        }
    }
}

/// The units of a GPT of `config`, without building it (for `ember plan` at sizes that would
/// not fit in memory): [`GptStages::decls`], the one description of the split, over the
/// model's parameter layout, whose order is the built module's (tested).
pub fn gpt_units(config: &GptConfig) -> Vec<UnitSpec> {
    let params: Vec<(String, Vec<usize>)> = config
        .layout()
        .into_iter()
        .map(|p| (p.path, p.shape))
        .collect();
    let stages = GptStages {
        n_layer: config.n_layer,
        seed: 0,
    };
    assign(&params, &stages.decls())
        .unwrap_or_else(|e| unreachable!("GPT's declared units own each of its parameters: {e}"))
}

/// The dropout key of `batch` in a run seeded `seed`: the step's seed and each row's global
/// sample index.
pub fn dropout_key(seed: u64, batch: &Batch) -> DropoutKey {
    DropoutKey {
        seed: splitmix64(seed ^ splitmix64(batch.step)),
        samples: (batch.first_sample..batch.first_sample + batch.batch as u64).collect(),
    }
}

/// A GPT's initial weights, drawn from (seed, path) by the model's own initialiser: any
/// range of any parameter alone, so a rank draws only what it owns.
#[derive(Debug, Clone)]
pub struct SeededGpt<'a> {
    /// The model.
    pub config: &'a GptConfig,
    /// The run's seed.
    pub seed: u64,
}

impl ParamSource for SeededGpt<'_> {
    fn read(
        &mut self,
        name: &str,
        _shape: &[usize],
        range: Range<usize>,
    ) -> Result<Vec<f32>, ShardError> {
        let init = self
            .config
            .init_of(name)
            .ok_or_else(|| ShardError::Source(format!("{name} is not a parameter of this GPT")))?;
        Ok(init_range(init, self.seed, name, range))
    }

    fn fingerprint(&self) -> u64 {
        self.seed
    }
}

/// Bytes of activations each unit of a GPT keeps per micro-batch of `batch` sequences of
/// `block` tokens, computing in elements of `elem` bytes, for the plan's memory prediction.
/// `fused` says whether the model runs on the fused CPU kernels (`flex`, either dtype).
///
/// The constants are the growth per token of the resident peak of single-process steps,
/// measured at `small-cpu`'s 4 layers and vocabulary 512 (BENCHMARKS.md, "Activation memory"):
/// - fused kernels in f32: about `20 d` values per token per block (measured 15-18 d at d 256
///   and 512 with T 128, 15-20 d at T 64): the inputs of the four linear layers and two
///   norms, the attention's packed projection and output, and the GELU's input; the
///   attention keeps one log-sum-exp per query, not its probabilities.
/// - fused kernels in bf16: about `28 d` bf16 values (measured 22.7 d and 27.0 d at d 256 and
///   512 with T 128, 23.1 d at T 64): 17-25% fewer bytes than f32, not half. What keeps the
///   rest is not located.
/// - Burn's composed ops: about `38 d + 2 h T` (measured at d 256 and 512, T 64 and 128): the
///   GELU's intermediates and the attention's probabilities as well.
///
/// The head keeps its logits, their log-softmax and their gradient (`3 V` values per token,
/// in f32) and the final norm's inputs.
pub fn gpt_activations(
    config: &GptConfig,
    batch: usize,
    block: usize,
    elem: usize,
    fused: bool,
) -> Vec<ActivationBytes> {
    let tokens = (batch * block) as u64;
    let (d, h, t, v) = (
        config.n_embd as u64,
        config.n_head as u64,
        block as u64,
        config.vocab_size as u64,
    );
    let e = elem as u64;
    let hidden = tokens * d * e;
    let per_token = match (fused, elem) {
        (true, 4) => 20 * d,
        (true, _) => 28 * d,
        (false, _) => 38 * d + 2 * h * t,
    };
    let mut out = vec![ActivationBytes {
        output: hidden,
        saved: 2 * hidden,
    }];
    out.extend((0..config.n_layer).map(|_| ActivationBytes {
        output: hidden,
        saved: tokens * per_token * e,
    }));
    out.push(ActivationBytes {
        output: 0,
        saved: tokens * (3 * v * 4 + 4 * d * e),
    });
    out
}

/// Each unit's forward FLOPs for `batch` sequences of `block` tokens, consistent with the
/// `6 N + 12 L d T` training count (forward a third of it): a block's matrix products
/// (`2 x 12 d^2` per token) and attention (`4 d T`), the head's logits (`2 d V`); the embedding
/// is a lookup.
pub fn gpt_flops(config: &GptConfig, batch: usize, block: usize) -> Vec<f64> {
    let tokens = (batch * block) as f64;
    let (d, t, v) = (config.n_embd as f64, block as f64, config.vocab_size as f64);
    let mut out = vec![0.0];
    out.extend((0..config.n_layer).map(|_| tokens * (24.0 * d * d + 4.0 * d * t)));
    out.push(tokens * 2.0 * d * v);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember_sharding::params::param_shapes;

    #[test]
    fn units_from_the_layout_equal_those_derived_from_a_built_model() {
        let config = GptConfig::new(3, 4, 32, 16, 100);
        let model = config.init(&Device::flex()).unwrap();
        let stages = GptStages {
            n_layer: 3,
            seed: 0,
        };
        let derived = assign(&param_shapes(&model), &stages.decls()).unwrap();
        assert_eq!(derived, gpt_units(&config));
        let total: usize = derived
            .iter()
            .flat_map(|u| u.params.iter())
            .map(|(_, s)| s.iter().product::<usize>())
            .sum();
        assert_eq!(total as u64, config.num_params());
    }

    #[test]
    fn running_the_stages_in_order_equals_the_whole_forward() {
        // With dropout on, so the keyed masks are checked too.
        let config = GptConfig {
            dropout: 0.2,
            ..GptConfig::tiny()
        };
        let device = Device::flex();
        let model = config.init_with_seed(3, &device).unwrap();
        let stages = GptStages {
            n_layer: config.n_layer,
            seed: 11,
        };
        let batch = Batch {
            inputs: (0..16).map(|i| (i * 7 % 50) as i64).collect(),
            targets: (0..16).map(|i| (i * 3 % 50) as i64).collect(),
            batch: 2,
            block: 8,
            step: 4,
            first_sample: 6,
        };
        let mut x = None;
        let mut loss = None;
        let mut side = Side::default();
        for u in 0..config.n_layer + 2 {
            match stages.forward(&model, u, x.take(), &mut side, &batch, &device) {
                Flow::Hidden(h) => x = Some(h),
                Flow::Loss(l) => loss = Some(l),
                Flow::Aux(..) => panic!("GPT's units give no auxiliary loss"),
            }
        }
        let key = dropout_key(11, &batch);
        let inputs = model.tokens(batch.inputs.clone(), 2, &device).unwrap();
        let targets = model.tokens(batch.targets.clone(), 2, &device).unwrap();
        let (_, whole) = model.forward_loss(&inputs, &targets, Some(&key));
        let a: f32 = loss.unwrap().into_scalar();
        let b: f32 = whole.into_scalar();
        assert_eq!(a, b);
        let (_, plain) = model.forward_loss(&inputs, &targets, None);
        assert_ne!(a, plain.into_scalar::<f32>(), "dropout is on");
    }
}
